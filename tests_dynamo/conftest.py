"""The Dynamo tier: runs only where ``ai-dynamo-runtime`` is installed (make test-dynamo)."""

from __future__ import annotations

import pytest

pytest.importorskip("dynamo.indexer", reason="the Dynamo tier needs ai-dynamo-runtime")
