"""MXFP4 (docs/spec.md §3a) on a GPU: the Triton write and gather byte for byte the reference's, the ragged scores
of Triton and ``auto`` (which must pass Gluon over on Hopper) within tolerance of the reference, and an MXFP4
cache's paged scores on Triton and under ``auto``.

Run: ``PYTHONPATH=. python3 -m pytest tests/gpu/test_mxfp4_gpu.py``."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from buffers import CacheFormat
from sparse_indexer.testing import assert_logits

pytestmark = pytest.mark.gpu
DEV = "cuda"
MX = CacheFormat(values="mxfp4")


@pytest.mark.parametrize("order", ["flat", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,bs", [(128, 64), (64, 16)])
def test_write_and_gather_bytes(dtype, d, bs, order):
    fmt = MX if order == "flat" else CacheFormat.tiled_mxfp4(32) if bs >= 32 else CacheFormat.tiled_mxfp4(16, 16, 2)
    g = torch.Generator(device=DEV).manual_seed(d + bs)
    nb = 40
    n = nb * bs - 7
    x = (torch.randn(n, d, device=DEV, generator=g) * torch.logspace(-30, 30, n, device=DEV)[:, None])
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype)
    x[3, 5] = float("nan")
    slots = torch.randperm(nb * bs, device=DEV, generator=g)[:n]
    want = si.new_kv_cache(nb, bs, d, device=DEV, mxfp4=True)
    got = si.new_kv_cache(nb, bs, d, device=DEV, mxfp4=True)
    si.write_k_cache(x, want, slots, cache_format=fmt, backend="reference")
    si.write_k_cache(x, got, slots, cache_format=fmt, backend="triton")
    assert torch.equal(got, want), int((got != want).sum())
    table = torch.stack([torch.randperm(nb, device=DEV, generator=g) for _ in range(3)]).int()
    lens = [nb * bs, 1, 5 * bs + 3]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    outs = {}
    for backend in ("reference", "triton", None):
        k = torch.zeros(sum(lens), d // 2, dtype=torch.uint8, device=DEV)
        s = torch.zeros(sum(lens), d // 32, dtype=torch.uint8, device=DEV)
        si.gather_k_cache(got, table, cu, out_k=k, out_scale=s, cache_format=fmt, backend=backend)
        outs[backend] = (k, s)
    for backend in ("triton", None):
        assert torch.equal(outs[backend][0], outs["reference"][0]) and torch.equal(outs[backend][1],
                                                                                  outs["reference"][1])


@pytest.mark.parametrize("h", [64, 32])
@pytest.mark.parametrize("backend", ["triton", None])
def test_ragged_scores(backend, h):
    g = torch.Generator(device=DEV).manual_seed(h)
    m, n, d = 300, 5000, 128  # large enough for Gluon's size rule under auto on Hopper
    qv, qs = si.quantize_q_mxfp4(torch.randn(m, h, d, device=DEV, generator=g))
    kv, ks = si.quantize_k_mxfp4(torch.randn(n, d, device=DEV, generator=g))
    w = torch.randn(m, h, device=DEV, generator=g) * (h * d) ** -0.5
    a = torch.randint(0, n // 2, (m,), device=DEV, generator=g, dtype=torch.int32)
    b = torch.randint(n // 2, n + 1, (m,), device=DEV, generator=g, dtype=torch.int32)
    want = si.fp8_mqa_logits(qv, kv, ks, w, a, b, q_scale=qs, backend="reference")
    got = si.fp8_mqa_logits(qv, kv, ks, w, a, b, q_scale=qs, backend=backend)
    assert_logits(got, want.double(), rtol_l2=1e-6)


def _decode_inputs(g, b, nn, h, d, bs, nb, blocks):
    """A decode step's block table (``blocks`` per request), lengths, MXFP4 queries and weights, drawn in that
    order from ``g``."""
    bt = torch.randperm(nb, device=DEV, generator=g)[: b * blocks].view(b, blocks).int()
    cl = torch.randint(1, blocks * bs + 1, (b,), device=DEV, generator=g, dtype=torch.int32)
    qv, qs = si.quantize_q_mxfp4(torch.randn(b * nn, h, d, device=DEV, generator=g))
    w = torch.randn(b * nn, h, device=DEV, generator=g)
    return bt, cl, qv.view(b, nn, h, d // 2), qs.view(b, nn, h, d // 32), w


def test_paged_scores_under_auto():
    g = torch.Generator(device=DEV).manual_seed(1)
    b, nn, h, d, bs, nb = 8, 2, 64, 128, 64, 70
    kv = si.new_kv_cache(nb, bs, d, device=DEV, mxfp4=True)
    si.write_k_cache(torch.randn(nb * bs, d, device=DEV, generator=g), kv, torch.arange(nb * bs, device=DEV),
                     cache_format=MX)
    bt, cl, qv, qs, w = _decode_inputs(g, b, nn, h, d, bs, nb, 8)
    want = si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, cache_format=MX, q_scale=qs, backend="reference")
    for backend in ("triton", None):
        got = si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, cache_format=MX, q_scale=qs, backend=backend)
        assert_logits(got, want.double(), rtol_l2=1e-6)


@pytest.mark.parametrize("order", ["flat", "tiled"])
def test_paged_scores_tiled_equal_flat(order):
    g = torch.Generator(device=DEV).manual_seed(3)
    b, nn, h, d, bs, nb = 16, 2, 64, 128, 64, 70
    fmt = MX if order == "flat" else CacheFormat.tiled_mxfp4(32)
    keys = torch.randn(nb * bs, d, device=DEV, generator=g)
    flat = si.new_kv_cache(nb, bs, d, device=DEV, mxfp4=True)
    kv = si.new_kv_cache(nb, bs, d, device=DEV, mxfp4=True)
    si.write_k_cache(keys, flat, torch.arange(nb * bs, device=DEV), cache_format=MX, backend="triton")
    si.write_k_cache(keys, kv, torch.arange(nb * bs, device=DEV), cache_format=fmt, backend="triton")
    bt, cl, qv, qs, w = _decode_inputs(g, b, nn, h, d, bs, nb, 4)
    want = si.fp8_paged_mqa_logits(qv, flat, w, cl, bt, cache_format=MX, q_scale=qs, backend="reference")
    got = si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, cache_format=fmt, q_scale=qs, backend="triton")
    assert_logits(got, want, rtol_l2=1e-6)


@pytest.mark.parametrize("next_n", [1, 2])
def test_step_matches_the_reference_eager_and_graphed(next_n):
    """The whole MXFP4 step (prefill chunks and decode) under auto on the GPU against the reference backend on the
    same inputs, eager and replayed from a CUDA graph (decode only, the graph's part)."""
    from buffers import IndexerLimits, allocate

    lim = IndexerLimits(max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=16, next_n=next_n, n_heads=64,
                        head_dim=128, topk=512, block_size=64, cache_format=CacheFormat.tiled_mxfp4(32))
    g = torch.Generator().manual_seed(next_n)
    seq = [8000, 3000, 600, 5000, 700, 1500]
    qry = [next_n] * 4 + [500, 1000]
    nb = sum(-(-s // 64) for s in seq) + 4
    bt = torch.zeros(len(seq), 128, dtype=torch.int32)
    perm, o = torch.randperm(nb, generator=g).int(), 0
    for r, s in enumerate(seq):
        bt[r, : -(-s // 64)] = perm[o : o + -(-s // 64)]
        o += -(-s // 64)
    pos = torch.cat([torch.arange(s - q, s) for s, q in zip(seq, qry)])
    req = torch.cat([torch.full((q,), r) for r, q in enumerate(qry)])
    slots = bt.long()[req, pos // 64] * 64 + pos % 64
    t = sum(qry)
    k = torch.randn(t, 128, generator=g).to(torch.bfloat16)
    qv, qs = si.quantize_q_mxfp4(torch.randn(t, 64, 128, generator=g))
    w = torch.randn(t, 64, generator=g) / 90.0
    kv0 = si.new_kv_cache(nb, 64, 128, mxfp4=True)
    hist = torch.randn(nb * 64, 128, generator=g)
    si.write_k_cache(hist, kv0, torch.arange(nb * 64), cache_format=lim.cache_format, backend="reference")
    outs = {}
    for dev, backend in (("cpu", "reference"), (DEV, None)):
        md = si.build_metadata(seq, qry, bt.to(dev), slots.to(dev), lim, num_blocks=nb)
        kv = kv0.to(dev)
        out = torch.full((t, 512), 7, dtype=torch.int32, device=dev)
        si.sparse_attn_indexer(qv.to(dev), k.to(dev), w.to(dev), kv, md, allocate(lim, device=dev), out,
                               q_scale=qs.to(dev), backend=backend)
        outs[dev] = (out.cpu(), kv.cpu())
    assert torch.equal(outs[DEV][1], outs["cpu"][1]), "the MXFP4 cache write differs"
    a, b = outs[DEV][0], outs["cpu"][0]
    overlap = torch.stack([torch.isin(a[i], b[i]).float().mean() for i in range(t)])
    assert overlap.min() >= 0.98 and overlap.mean() >= 0.995, (overlap.min(), overlap.mean())  # near-ties only
    # decode rows only, replayed from a CUDA graph
    nd = next_n * 4
    lim_d = lim
    md = si.build_metadata(seq[:4], qry[:4], bt[:4].to(DEV), slots[:nd].to(DEV), lim_d, num_blocks=nb)
    bufs = allocate(lim_d, device=DEV)
    kv = outs[DEV][1].to(DEV)
    q_d, qs_d, w_d = qv[:nd].to(DEV), qs[:nd].to(DEV), w[:nd].to(DEV)
    out = torch.full((nd, 512), 7, dtype=torch.int32, device=DEV)
    si.sparse_attn_indexer(q_d, None, w_d, kv, md, bufs, out, q_scale=qs_d)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        si.sparse_attn_indexer(q_d, None, w_d, kv, md, bufs, out, q_scale=qs_d)
    out.fill_(7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.sort(1).values, eager.sort(1).values)  # (the top-k is a set: its order may vary)
