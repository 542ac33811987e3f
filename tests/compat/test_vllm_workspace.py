"""The shim against vLLM's own WorkspaceManager (vllm.v1.worker.workspace, vllm==0.33.0 from PyPI)."""

from __future__ import annotations

import pytest
import torch

from buffers import BufferTooSmall, plan
from sparse_indexer.compat.vllm import (
    VllmIndexer,
    WorkspaceTooSmall,
    buffers_from_workspace,
    held_bytes,
    reserve,
)
from tests.compat.test_vllm_metadata import limits
from tests.compat.vllm_batches import make_batch, run_ours, vllm_metadata

ws = pytest.importorskip("vllm.v1.worker.workspace")


@pytest.fixture
def manager(monkeypatch):
    # vLLM 0.33 calls torch.accelerator.empty_cache() before every growth of the workspace; on a machine
    # without an accelerator that call raises "Cannot access accelerator device when none is available".
    # It only returns cached device memory to the driver, so a no-op changes nothing on the CPU.
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    ws.reset_workspace_manager()
    ws.init_workspace_manager(torch.device("cpu"), num_lanes=2)
    yield ws.current_workspace_manager()
    ws.reset_workspace_manager()


def slot_tensor(m) -> torch.Tensor:
    return m._current_workspaces[m._get_workspace_id()]


def test_reserve_grows_to_exactly_the_plan(manager):
    lim = limits()
    p = reserve(lim)  # default manager: vLLM's current_workspace_manager()
    assert p == plan(lim)
    assert held_bytes(manager) == p.total_bytes == slot_tensor(manager).numel()
    ptr = slot_tensor(manager).data_ptr()
    reserve(lim, manager)  # no growth, same storage
    assert slot_tensor(manager).data_ptr() == ptr and held_bytes(manager) == p.total_bytes
    reserve(limits(max_model_len=48, prefill_k_tokens=96), manager)  # smaller plan: nothing changes
    assert held_bytes(manager) == p.total_bytes


def test_buffers_are_the_plan_laid_on_the_workspace(manager):
    lim = limits(next_n=3)
    p = reserve(lim, manager)
    base = slot_tensor(manager)
    bufs = buffers_from_workspace(lim, manager)
    assert set(bufs.tensors()) == {f.name for f in p.fields}
    for f in p.fields:
        t = getattr(bufs, f.name)
        assert t.data_ptr() - base.data_ptr() == f.offset, f.name
        assert tuple(t.shape) == f.shape and t.dtype == f.dtype
    # the next step (after another workspace user) gets the same storage back
    manager.get_simultaneous(((100,), torch.float32))
    again = buffers_from_workspace(lim, manager)
    assert all(again.tensors()[n].data_ptr() == t.data_ptr() for n, t in bufs.tensors().items())
    assert slot_tensor(manager) is base


def test_locked_too_small_is_our_error(manager):
    lim = limits()
    p = reserve(lim, manager)
    ws.lock_workspace()
    buffers_from_workspace(lim, manager)  # fits: fine while locked
    bigger = limits(max_model_len=192, prefill_k_tokens=384)
    need = plan(bigger).total_bytes
    with pytest.raises(WorkspaceTooSmall, match=f"{need - p.total_bytes} bytes missing") as e:
        buffers_from_workspace(bigger, manager)
    assert isinstance(e.value, BufferTooSmall) and isinstance(e.value, ValueError)
    assert (e.value.needed, e.value.available, e.value.missing) == (need, p.total_bytes, need - p.total_bytes)
    with pytest.raises(WorkspaceTooSmall):
        reserve(bigger, manager)
    assert held_bytes(manager) == p.total_bytes  # nothing grew
    with pytest.raises(AssertionError, match="locked"):  # what vLLM itself would have said
        manager.get_simultaneous(((need,), torch.uint8))
    ws.unlock_workspace()
    assert reserve(bigger, manager).total_bytes == held_bytes(manager) == need


def test_two_lanes(manager):
    lim = limits()
    total = reserve(lim, manager).total_bytes
    with ws.use_workspace_lane(1):
        assert held_bytes(manager) == 0  # lane 1 has its own, still empty, slot
        ws.lock_workspace()
        with pytest.raises(WorkspaceTooSmall, match=f"slot 1 holds 0 bytes.*{total} bytes missing"):
            buffers_from_workspace(lim, manager)
        ws.unlock_workspace()
        b1 = buffers_from_workspace(lim, manager)
        assert held_bytes(manager) == total
    b0 = buffers_from_workspace(lim, manager)
    assert b0.k_fp8.data_ptr() != b1.k_fp8.data_ptr()
    assert b0.k_fp8.untyped_storage().data_ptr() != b1.k_fp8.untyped_storage().data_ptr()


def op_args(batch, lim, kv, topk_buffer, hidden_rows=None):
    rows = hidden_rows or batch.q_fp8.shape[0]
    return (torch.zeros(rows, 16), "model.layers.0.indexer.k_cache", kv, batch.q_fp8, batch.k, batch.weights,
            lim.head_dim, "ue8m0", lim.topk, lim.head_dim, lim.max_model_len, lim.prefill_k_tokens, topk_buffer)


def test_vllm_op_profiles_then_runs(manager):
    lim = limits(next_n=2)
    batch = make_batch([40, 61, 30, 75], [2, 1, 30, 12], lim)
    state = {"md": None}
    op = VllmIndexer(max_num_seqs=lim.max_num_seqs, next_n=2, max_logits_bytes=lim.max_logits_bytes,
                     backend="reference", attn_metadata=lambda: state["md"])
    assert op.limits(batch.kv, batch.q_fp8, lim.topk, lim.head_dim, lim.max_model_len, lim.prefill_k_tokens,
                     torch.empty(lim.max_num_batched_tokens, lim.topk, dtype=torch.int32)) == lim
    buf = torch.full((lim.max_num_batched_tokens, lim.topk), 7, dtype=torch.int32)
    kv = batch.kv.clone()
    # profiling run (attn_metadata is None): reserves the plan, writes nothing
    assert op(*op_args(batch, lim, kv, buf)) is buf
    assert held_bytes(manager) == plan(lim).total_bytes
    assert (buf == 7).all() and torch.equal(kv, batch.kv)
    ws.lock_workspace()
    # the fake touches no workspace (not even the locked one)
    held, manager._current_workspaces[0] = manager._current_workspaces[0], None
    assert op.fake(*op_args(batch, lim, kv, buf)) is buf
    manager._current_workspaces[0] = held
    # real run, two padded rows as under a cudagraph
    state["md"] = {"model.layers.0.indexer.k_cache": vllm_metadata(batch, 2)}
    n = sum(batch.query_lens)
    op(*op_args(batch, lim, kv, buf, hidden_rows=n + 2))
    expected, kv_expected = run_ours(batch, lim)
    assert torch.equal(kv, kv_expected)
    assert torch.equal(buf[:n].sort(1).values, expected[:n].sort(1).values)
    assert (buf[n : n + 2] == -1).all() and (buf[n + 2 :] == 7).all()
    # skip_k_cache_insert: the cache is already written; same result
    buf2 = torch.full_like(buf, 7)
    op(*op_args(batch, lim, kv, buf2), skip_k_cache_insert=True)
    assert torch.equal(buf2[:n].sort(1).values, expected[:n].sort(1).values)


def test_vllm_op_locked_workspace_too_small(manager):
    lim = limits(next_n=1)
    batch = make_batch([40, 17], [1, 1], lim)
    op = VllmIndexer(max_num_seqs=lim.max_num_seqs, max_logits_bytes=lim.max_logits_bytes, backend="reference",
                     attn_metadata=lambda: {"layer": vllm_metadata(batch, 1)})
    ws.lock_workspace()
    buf = torch.full((lim.max_num_batched_tokens, lim.topk), 7, dtype=torch.int32)
    kv = batch.kv.clone()
    args = list(op_args(batch, lim, kv, buf))
    args[1] = "layer"
    with pytest.raises(WorkspaceTooSmall, match=f"{plan(lim).total_bytes} bytes missing"):
        op(*args)
    assert (buf == 7).all() and torch.equal(kv, batch.kv)


def test_vllm_op_rejects_what_it_does_not_do():
    lim = limits()
    batch = make_batch([40], [1], lim)
    op = VllmIndexer(max_num_seqs=8, attn_metadata=lambda: None)
    buf = torch.zeros(lim.max_num_batched_tokens, lim.topk, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="compress_ratio"):
        op(*op_args(batch, lim, batch.kv, buf), compress_ratio=4)
