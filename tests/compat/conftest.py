"""Fixtures of the vLLM shim tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def manager(monkeypatch):
    """vLLM's workspace manager on the CPU, fresh for the test (skipped where vLLM is not installed)."""
    ws = pytest.importorskip("vllm.v1.worker.workspace")
    # vLLM 0.33 calls torch.accelerator.empty_cache() before every growth of the workspace; without an
    # accelerator that raises. It only returns cached device memory to the driver: a no-op on the CPU.
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    ws.reset_workspace_manager()
    ws.init_workspace_manager(torch.device("cpu"))
    yield ws.current_workspace_manager()
    ws.reset_workspace_manager()
