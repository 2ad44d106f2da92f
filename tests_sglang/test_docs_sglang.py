"""The SGLang examples of the docs, run against the real package."""

from __future__ import annotations

import pytest

from tests.test_docs import doc_blocks, run_block


@pytest.mark.parametrize("code", doc_blocks("sglang"))
def test_sglang_doc_example_runs(code: str) -> None:
    run_block(code)
