"""Decode under a logits budget on the GPU (Triton backend): the budgeted step gives the top-k of one unbudgeted
batch, is captured in a CUDA graph and replayed with new inputs, calls no allocator, and a 256 MiB budget works at
1M context. Run: ``PYTHONPATH=. python3 -m pytest -q tests/gpu/test_budget_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch

import sparse_indexer as si
from buffers import IndexerLimits, allocate, plan
from buffers.plan import prefill_extremes
from sparse_indexer.commands.profile import profile_step
from sparse_indexer.indexer import decode_batch
from tests.sparse_indexer.test_decode_budget import same_selection

pytestmark = pytest.mark.gpu
FN = torch.float8_e4m3fn
DEV = "cuda"
MiB = 1 << 20


def _lim(**kw):
    base = dict(max_model_len=8192, max_num_batched_tokens=1024, max_num_seqs=16, next_n=2, n_heads=64,
                head_dim=128, topk=2048, block_size=64, prefill_k_tokens=16384, max_logits_bytes=MiB // 4)
    base.update(kw)
    return IndexerLimits(**base)


def _cache(num_tokens: int, bs: int, d: int, g: torch.Generator) -> torch.Tensor:
    nb = (num_tokens + bs - 1) // bs
    kv = si.new_kv_cache(nb, bs, d, device=DEV)
    for t0 in range(0, nb * bs, 1 << 20):
        t1 = min(nb * bs, t0 + (1 << 20))
        si.write_k_cache(torch.randn(t1 - t0, d, generator=g).to(DEV), kv, torch.arange(t0, t1, device=DEV),
                         backend="triton")
    return kv


def _inputs(lim, seq, qry, nb, g):
    t = sum(qry)
    h, d = lim.n_heads, lim.head_dim
    q = (torch.randn(t, h, d, generator=g) * 2).to(FN).to(DEV)
    w = (torch.randn(t, h, generator=g) / math.sqrt(h * d)).to(DEV)
    blocks = (lim.max_model_len + lim.block_size - 1) // lim.block_size
    table = torch.stack([torch.randperm(nb, generator=g)[:blocks] for _ in seq]).int().to(DEV)
    md = si.build_metadata(seq, qry, table, torch.full((t,), -1, dtype=torch.int64, device=DEV), lim, num_blocks=nb)
    return q, w, md, table


BACKEND = {"backend": "triton"}


def _decode(q, w, kv, md, bufs, out):
    si.indexer_decode(q, w, kv, md, bufs, out, **BACKEND)


@pytest.fixture(params=["triton", None], ids=["triton", "auto"])
def backend(request):
    """The portable Triton path and the default (auto: the CUDA top-k where it loads)."""
    BACKEND["backend"] = request.param
    yield request.param
    BACKEND["backend"] = "triton"


@pytest.mark.parametrize("qry", [[2] * 16, [2, 1, 2, 2, 1, 2, 2, 2, 0, 2, 2, 1, 2, 2, 2, 2]], ids=["uniform", "packed"])
def test_budgeted_decode_graph_replay_equals_one_batch(qry, backend):
    g = torch.Generator().manual_seed(1)
    free = _lim()
    lim = _lim(max_decode_logits_bytes=3 * 2 * 8192 * 4)  # sub-batches of 3 requests: 6 of them for 16
    assert lim.decode_batch == 3 and plan(lim)["logits"].nbytes < plan(free)["logits"].nbytes
    kv = _cache(8192 * 4, lim.block_size, lim.head_dim, g)
    nb = kv.shape[0]
    seq = [int(x) for x in torch.randint(3, 8193, (16,), generator=g)]
    q, w, md, _ = _inputs(lim, seq, qry, nb, g)
    dm = md.decode
    bufs, fbufs = allocate(lim, DEV), allocate(free, DEV)
    out = torch.zeros(md.num_tokens, lim.topk, dtype=torch.int32, device=DEV)
    want = torch.zeros_like(out)
    assert decode_batch(md) == 3 and dm.num_reqs > 3

    _decode(q, w, kv, md, bufs, out)  # warm-up: Triton compiles outside the capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _decode(q, w, kv, md, bufs, out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _decode(q, w, kv, md, bufs, out)

    keys = ("allocation.all.allocated", "segment.all.allocated")
    for _ in range(3):
        seq2 = [int(x) for x in torch.randint(3, 8193, (16,), generator=g)]
        q2, w2, md2, table2 = _inputs(lim, seq2, qry, nb, g)
        q.copy_(q2), w.copy_(w2)
        for name in ("context_lens", "block_table", "row_ends"):
            getattr(dm, name).copy_(getattr(md2.decode, name))
        if not dm.uniform:
            dm.pack_src.copy_(md2.decode.pack_src), dm.unpack_src.copy_(md2.decode.unpack_src)
        before = {k: torch.cuda.memory_stats()[k] for k in keys}
        graph.replay()
        torch.cuda.synchronize()
        assert {k: torch.cuda.memory_stats()[k] for k in keys} == before
        got_eager = torch.zeros_like(out)
        _decode(q, w, kv, md, bufs, got_eager)  # eager budgeted
        # unbudgeted: one batch over the same queries, windows and tables
        fmd = si.build_metadata(seq2, qry, table2, md.slot_mapping, free, num_blocks=nb)
        _decode(q, w, kv, fmd, fbufs, want)
        torch.cuda.synchronize()
        rows = fmd.decode.num_rows
        logits = fbufs.logits_view(rows, fmd.decode.width)
        if not fmd.decode.uniform:
            logits = logits[fmd.decode.unpack_src]
        same_selection(out.cpu(), want.cpu(), logits.cpu())
        same_selection(got_eager.cpu(), want.cpu(), logits.cpu())
        same_selection(out.cpu(), got_eager.cpu())  # positions come in any order


def test_budget_of_256_mib_at_1m_context_on_gpu(backend):
    """max_model_len 1M, 256 sequences, next_n 2, a 256 MiB budget: 64 decode requests (two sub-batches of 32)
    with contexts up to 1M give the top-k of one unbudgeted batch (planned for 64 requests), eager and in a
    CUDA graph."""
    g = torch.Generator().manual_seed(2)
    L, b, nn = 1 << 20, 64, 2
    common = dict(max_model_len=L, max_num_batched_tokens=8192, next_n=nn)
    lim = IndexerLimits(**common, max_num_seqs=256, max_decode_logits_bytes=256 * MiB)
    free = IndexerLimits(**common, max_num_seqs=b)
    assert lim.decode_batch == 32 and plan(lim)["logits"].nbytes == max(prefill_extremes(lim).logits * 4, 256 * MiB)
    kv = _cache(L, lim.block_size, lim.head_dim, g)  # requests share the cache's blocks, in their own orders
    seq = [int(x) for x in torch.randint(L // 2, L + 1, (b,), generator=g)]
    seq[0] = L
    q, w, md, table = _inputs(lim, seq, [nn] * b, kv.shape[0], g)
    fmd = si.build_metadata(seq, [nn] * b, table, md.slot_mapping, free, num_blocks=kv.shape[0])
    bufs, fbufs = allocate(lim, DEV), allocate(free, DEV)
    got = torch.zeros(b * nn, 2048, dtype=torch.int32, device=DEV)
    want = torch.zeros_like(got)
    si.sparse_attn_indexer(q, None, w, kv, md, bufs, got, backend=backend)
    si.sparse_attn_indexer(q, None, w, kv, fmd, fbufs, want, backend=backend)
    torch.cuda.synchronize()
    logits = fbufs.logits_view(b * nn, L).cpu()
    same_selection(got.cpu(), want.cpu(), logits)
    graph = torch.cuda.CUDAGraph()
    replayed = torch.zeros_like(got)
    with torch.cuda.graph(graph):
        si.indexer_decode(q, w, kv, md, bufs, replayed, backend=backend)
    graph.replay()
    torch.cuda.synchronize()
    # ties at the k-th value may go either way (the split-row top-k's atomics): compare selected multisets
    same_selection(replayed.cpu(), got.cpu(), logits)


def test_profile_step_with_budget_allocates_nothing_and_reaches_the_plan(backend):
    lim = _lim(max_decode_logits_bytes=5 * 2 * 8192 * 4)
    r = profile_step(lim, DEV, backend=backend)
    assert r.arena_bytes == r.plan_bytes and r.step_peak_bytes == 0 and r.fits_plan
    assert r.reaches_plan, (r.peaks, r.capacity)
