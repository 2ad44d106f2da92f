"""Build hook for the optional C accelerators; all metadata lives in pyproject.toml.

``optional=True``: if an extension fails to build (no compiler, no Python
headers), installation goes on and coalesce runs its pure-Python
compactor or recorder, or sends through pyzmq alone.
"""

import sys

from setuptools import Extension, setup

_PARTS = {
    "_ccompact": [f"coalesce/_cc_{part}.h" for part in ("ids", "read", "rules", "build")],
    "_crecord": ["coalesce/_cr_table.h", "coalesce/_cr_encode.h"],
}
"""The parts a module's .c file includes (one translation unit)."""

setup(
    ext_modules=[
        Extension(
            f"coalesce.{name}",
            [f"coalesce/{name}.c"],
            depends=[
                "coalesce/_cstruct.h",
                "coalesce/_kinds.h",
                "coalesce/_cmix.h",
                *_PARTS.get(name, ()),
            ],
            optional=True,
            extra_compile_args=["-O2", "-std=c99", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
        for name in ("_ccompact", "_crecord")
    ]
    + [
        Extension(
            "coalesce._csend",
            ["coalesce/_csend.c"],
            optional=True,
            libraries=["dl"] if sys.platform.startswith("linux") else [],
            extra_compile_args=["-O2", "-std=c99", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
