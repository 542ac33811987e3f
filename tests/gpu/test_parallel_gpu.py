"""GPU checks of the context-parallel merge (docs/spec.md §11) on 2 GPUs over NCCL: the compiled Triton kernels
of ``merge_topk`` give the torch path's output bit for bit (NaN, -inf, +inf, ties, empty and short windows), the
decode-sized merge (64 rows, topk 2048, the CUDA top-k) selects the same positions as the torch path with the
reference top-k, allocates nothing in the caching allocator, and replays from a CUDA graph with the same result.
The whole cp step against one device: ``scripts/cp_bench.py``.
Run: ``PYTHONPATH=. python3 -m pytest tests/gpu/test_parallel_gpu.py``."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from buffers import IndexerLimits, allocate
from sparse_indexer import parallel as cp
from sparse_indexer.testing import capture_cuda_graph

from ..sparse_indexer.test_parallel import MBS, MROWS, MTOPK, _merge_inputs

pytestmark = pytest.mark.gpu
WORLD = 2


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _merge(sel, logits, starts, gs, ge, bufs, rank, bs, backend, triton):
    saved = cp._use_triton
    cp._use_triton = lambda lg, b: triton
    try:
        cp.merge_topk(sel, logits, starts, gs, ge, bufs, rank=rank, world_size=WORLD, block_size=bs, backend=backend)
    finally:
        cp._use_triton = saved
    return sel


def _worker(rank, port, out):
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        # small cases: Triton kernels vs torch ops, the same reference top-k in between: identical
        lim = IndexerLimits(max_model_len=256, max_num_batched_tokens=MROWS, max_num_seqs=MROWS, n_heads=4,
                            head_dim=64, topk=MTOPK, block_size=MBS, world_size=WORLD)
        bufs = allocate(lim, dev)
        for seed, width in ((0, 40), (1, 13), (2, 0)):
            x = [t.to(dev) for t in _merge_inputs(rank, WORLD, width, seed)]
            logits, starts, sel, gs, ge = x
            ref = _merge(sel.clone(), logits, starts, gs, ge, bufs, rank, MBS, "reference", False)
            got = _merge(sel.clone(), logits, starts, gs, ge, bufs, rank, MBS, "reference", True)
            out[(rank, "small", seed)] = bool(torch.equal(ref, got))

        # decode-sized: 64 rows, topk 2048, 64K local keys (distinct values: one right answer per row)
        rows, topk, bs, width = 64, 2048, 64, 65536
        lim = IndexerLimits(max_model_len=2 * width, max_num_batched_tokens=rows, max_num_seqs=rows, n_heads=4,
                            head_dim=64, topk=topk, block_size=bs, world_size=WORLD)
        bufs = allocate(lim, dev)
        g = torch.Generator(device=dev).manual_seed(5 + rank)
        logits = torch.randn(rows, width, device=dev, generator=g)
        logits[0, :10] = float("nan")
        logits[1, :10] = float("-inf")
        starts = torch.zeros(rows, dtype=torch.int32, device=dev)
        ends = torch.full((rows,), width, dtype=torch.int32, device=dev)
        ends[2] = 1000  # a short local window (< topk)
        ends[3] = 0  # no local key
        gends = torch.full((rows,), 2 * width, dtype=torch.int32, device=dev)
        gends[4] = 100  # a short global window
        import sparse_indexer as si

        local = torch.empty(rows, topk, dtype=torch.int32, device=dev)
        si.top_k_per_row(logits, starts, ends, out=local)
        ref = _merge(local.clone(), logits, starts, starts, gends, bufs, rank, bs, "reference", False)
        sel = local.clone()
        _merge(sel, logits, starts, starts, gends, bufs, rank, bs, None, True)
        out[(rank, "big")] = bool(torch.equal(torch.sort(sel, 1).values, torch.sort(ref, 1).values))
        out[(rank, "short")] = sel[4].tolist() == list(range(100)) + [-1] * (topk - 100)

        def merge():
            sel.copy_(local)
            cp.merge_topk(sel, logits, starts, starts, gends, bufs, rank=rank, world_size=WORLD, block_size=bs)

        merge()
        torch.cuda.synchronize()
        n0 = torch.cuda.memory_stats(dev)["allocation.all.allocated"]
        for _ in range(3):
            merge()
        torch.cuda.synchronize()
        out[(rank, "allocs")] = torch.cuda.memory_stats(dev)["allocation.all.allocated"] - n0
        eager = sel.clone()
        graph = capture_cuda_graph(merge)
        sel.fill_(-2)
        graph.replay()
        torch.cuda.synchronize()
        out[(rank, "graph")] = bool(torch.equal(sel, eager))
    finally:
        dist.destroy_process_group()


def test_merge_on_two_gpus():
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} GPUs")
    with mp.Manager() as m:
        out = m.dict()
        mp.spawn(_worker, args=(_port(), out), nprocs=WORLD, join=True)
        out = dict(out)
    for r in range(WORLD):
        for seed in range(3):
            assert out[(r, "small", seed)], f"rank {r}, case {seed}: Triton kernels differ from the torch path"
        assert out[(r, "big")], f"rank {r}: the decode-sized merge differs from the torch path"
        assert out[(r, "short")], f"rank {r}: a short global window is not 0..n-1, -1, ..."
        assert out[(r, "allocs")] == 0, f"rank {r}: the merge allocated {out[(r, 'allocs')]} times in 3 calls"
        assert out[(r, "graph")], f"rank {r}: the graph replay differs from the eager merge"
