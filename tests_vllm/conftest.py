"""The conformance tier: runs only in the .venv-vllm built by `make test-vllm`."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.distributed.kv_events", reason="the conformance tier needs vllm")

from tests.conftest import made, make_sub  # noqa: F401  (fixture re-export)
