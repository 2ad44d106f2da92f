"""The SGLang conformance tier: runs only in the .venv-sglang built by `make test-sglang`."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "sglang.srt.disaggregation.kv_events", reason="the SGLang conformance tier needs sglang"
)

from tests.conftest import made, make_sub  # noqa: F401  (fixture re-export)
