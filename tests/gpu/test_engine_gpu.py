"""Engine integration on a GPU (Triton backend): CUDA graph capture and replay of a decode step, no host sync
in the decode path, zero caching-allocator calls in a warm mixed step, opcheck and torch.compile on CUDA, and
the profile helper. Run: ``PYTHONPATH=. python3 -m pytest tests/gpu/test_engine_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

import sparse_indexer as si
from buffers import IndexerLimits, allocate
from sparse_indexer.commands.profile import profile_step
from sparse_indexer.testing import capture_cuda_graph

pytestmark = pytest.mark.gpu
FN = torch.float8_e4m3fn
DEV = "cuda"


def _lim(**kw):
    base = dict(max_model_len=4096, max_num_batched_tokens=1024, max_num_seqs=8, next_n=2, n_heads=64,
                head_dim=128, topk=256, block_size=64, prefill_k_tokens=8192, max_logits_bytes=4 * 2**20)
    base.update(kw)
    return IndexerLimits(**base)


class World:
    """A paged cache with random keys and a block table big enough for max_model_len per request."""

    def __init__(self, lim, n_req, seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.lim = lim
        bs, d = lim.block_size, lim.head_dim
        self.max_blocks = (lim.max_model_len + bs - 1) // bs
        nb = n_req * self.max_blocks + 4
        self.kv = si.new_kv_cache(nb, bs, d, device=DEV)
        si.write_k_cache(torch.randn(nb * bs, d, generator=g).to(DEV), self.kv,
                         torch.arange(nb * bs, device=DEV), backend="triton")
        perm = torch.randperm(nb, generator=g)[: n_req * self.max_blocks]
        self.block_table = perm.view(n_req, self.max_blocks).int().to(DEV)
        self.g = g

    def inputs(self, seq, qry):
        lim, g = self.lim, self.g
        t = sum(qry)
        q = (torch.randn(t, lim.n_heads, lim.head_dim, generator=g) * 2).to(FN).to(DEV)
        k = torch.randn(t, lim.head_dim, generator=g).to(torch.bfloat16).to(DEV)
        w = (torch.randn(t, lim.n_heads, generator=g) / math.sqrt(lim.n_heads * lim.head_dim)).to(DEV)
        pos = torch.cat([torch.arange(s - n, s) for s, n in zip(seq, qry)])
        req = torch.cat([torch.full((n,), r) for r, n in enumerate(qry)])
        bt = self.block_table[: len(seq)].cpu().long()
        bs = lim.block_size
        slots = (bt[req, pos // bs] * bs + pos % bs).to(DEV)
        md = si.build_metadata(seq, qry, self.block_table[: len(seq)], slots, lim)
        return q, k, w, md


def _same_topk(a, b, logits_rows=None):
    """Equal as sets per row (ties may differ in order)."""
    return torch.equal(a.sort(1).values, b.sort(1).values)


def test_cuda_graph_decode_step_replays_with_new_inputs():
    lim = _lim()
    b, nn = 8, lim.next_n
    wd = World(lim, b, seed=1)
    bufs = allocate(lim, DEV)
    seq = [300, 4096, 77, 1000, 2, 513, 64, 3000]
    q, k, w, md = wd.inputs(seq, [nn] * b)
    dm = md.decode
    out = torch.zeros(b * nn, lim.topk, dtype=torch.int32, device=DEV)

    def step():
        si.indexer_decode(q, w, wd.kv, md, bufs, out, backend="triton")

    step()  # warm-up: Triton compiles outside the capture
    torch.cuda.synchronize()
    graph = capture_cuda_graph(step)

    for trial in range(3):
        seq2 = [int(x) for x in torch.randint(1, lim.max_model_len + 1, (b,), generator=wd.g)]
        q2, _, w2, md2 = wd.inputs(seq2, [nn] * b)
        perm = torch.randperm(b, generator=wd.g)
        # new contents copied into the captured tensors (same shapes): queries, weights, lengths, block table,
        # row windows
        q.copy_(q2), w.copy_(w2)
        dm.context_lens.copy_(md2.decode.context_lens)
        dm.block_table.copy_(wd.block_table[perm.to(DEV)] if trial else md2.decode.block_table)
        dm.row_ends.copy_(md2.decode.row_ends)
        graph.replay()
        torch.cuda.synchronize()
        want = torch.zeros_like(out)
        si.fp8_paged_mqa_logits(q.view(b, nn, lim.n_heads, lim.head_dim), wd.kv, w, dm.context_lens,
                                dm.block_table, out=bufs.logits_view(b * nn, dm.width), clean=False,
                                backend="triton")
        si.top_k_per_row(bufs.logits_view(b * nn, dm.width), dm.row_starts, dm.row_ends, out=want,
                         backend="triton")
        assert _same_topk(out, want), f"trial {trial}: replay differs from eager"


def test_decode_step_does_not_sync():
    lim = _lim()
    wd = World(lim, 8, seed=2)
    bufs = allocate(lim, DEV)
    seq = [300, 4096, 77, 1000, 2, 513, 64, 3000]
    q, k, w, md = wd.inputs(seq, [1, 2, 2, 0, 2, 1, 2, 2])  # non-uniform decode: the packing path too
    out = torch.zeros(md.num_tokens, lim.topk, dtype=torch.int32, device=DEV)
    si.sparse_attn_indexer(q, k, w, wd.kv, md, bufs, out, backend="triton")  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        si.sparse_attn_indexer(q, k, w, wd.kv, md, bufs, out, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_warm_mixed_step_makes_no_allocator_call():
    lim = _lim(next_n=2, prefill_k_tokens=8192, max_logits_bytes=4 * 300_000)
    wd = World(lim, 6, seed=3)
    bufs = allocate(lim, DEV)
    seq, qry = [900, 4096, 33, 2000, 1500, 700], [2, 1, 2, 400, 300, 200]  # decode (non-uniform) + prefill
    q, k, w, md = wd.inputs(seq, qry)
    assert md.decode is not None and len(md.prefill_chunks) >= 2
    out = torch.zeros(md.num_tokens, lim.topk, dtype=torch.int32, device=DEV)
    for _ in range(2):
        si.sparse_attn_indexer(q, k, w, wd.kv, md, bufs, out, backend="triton")
    torch.cuda.synchronize()
    keys = ("allocation.all.allocated", "segment.all.allocated", "allocated_bytes.all.allocated")
    before = {key: torch.cuda.memory_stats()[key] for key in keys}
    si.sparse_attn_indexer(q, k, w, wd.kv, md, bufs, out, backend="triton")
    torch.cuda.synchronize()
    after = {key: torch.cuda.memory_stats()[key] for key in keys}
    assert after == before, f"the step called the caching allocator: {before} -> {after}"


def test_opcheck_on_cuda():
    from tests.sparse_indexer.test_library import _cases, _op_args, _opcheck

    def to_cuda(x):
        return x.to(DEV) if isinstance(x, torch.Tensor) else x

    for name, _, args, kwargs in _cases():
        a, kw = _op_args(name, args, kwargs)
        a = tuple(to_cuda(x) for x in a)
        kw = {n: to_cuda(x) for n, x in kw.items()}
        for backend in ("triton", "reference"):
            kw["backend"] = backend
            try:
                _opcheck(name, a, kw)
            except Exception as e:  # an unsupported case of a backend is a NotImplementedError, not a failure
                if "NotImplementedError" not in repr(e) and not isinstance(e.__cause__, NotImplementedError):
                    raise


def test_compile_on_cuda_matches_eager():
    lim = _lim()
    wd = World(lim, 4, seed=4)
    bufs = allocate(lim, DEV)
    q, k, w, md = wd.inputs([700, 2, 1200, 900], [2, 2, 300, 200])
    want = torch.zeros(md.num_tokens, lim.topk, dtype=torch.int32, device=DEV)
    kv0 = wd.kv.clone()
    si.sparse_attn_indexer(q, k, w, wd.kv, md, bufs, want, backend="triton")

    def step(q, k, w, kv, md, bufs, out):
        si.sparse_attn_indexer(q, k, w, kv, md, bufs, out, backend="triton")

    wd.kv.copy_(kv0)
    got = torch.zeros_like(want)
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True)(q, k, w, wd.kv, md, bufs.split_storages(), got)
    torch.cuda.synchronize()
    assert _same_topk(got, want)


def test_profile_step_on_cuda_allocates_nothing_beyond_the_plan():
    lim = _lim()
    r = profile_step(lim, DEV, backend="triton")
    assert r.arena_bytes == r.plan_bytes
    assert r.step_peak_bytes == 0, f"the worst-case step allocated {r.step_peak_bytes} B beyond the plan"
    assert r.fits_plan
