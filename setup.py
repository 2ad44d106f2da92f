"""Build hook for the optional C accelerator; all metadata lives in pyproject.toml.

``optional=True``: if the extension fails to build (no compiler, no Python
headers), installation goes on and coalesce runs its pure-Python compactor.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "coalesce._ccompact",
            ["coalesce/_ccompact.c"],
            optional=True,
            extra_compile_args=["-O2", "-std=c99", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
