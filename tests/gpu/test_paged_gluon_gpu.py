"""GPU tests of the Gluon ``fp8_paged_mqa_logits`` kernel against the reference backend.

The contract (docs/spec.md §5): relative L2 error <= 2e-4 against the reference on in-window cells, exact ``-inf``
masks with ``clean=True``, out-of-window cells untouched with ``clean=False``; float32 and bfloat16 ``out``; 1-D
and 2-D context lengths, next_n 1..4, ragged lengths (0, non-multiples of 64), padded block tables, ``indices``.
Cases the kernel does not take raise ``NotImplementedError`` and write nothing. Skipped without an sm_90 GPU.
"""

from __future__ import annotations

import functools

import pytest
import torch

import sparse_indexer as si
from sparse_indexer import backends
from sparse_indexer.kcache import cache_views, new_kv_cache
from sparse_indexer.testing import logits_error

FP8 = torch.float8_e4m3fn
SENTINEL = 7777.0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or backends.get("gluon").unavailable_reason(
        torch.device("cuda")) is not None, reason="the gluon backend needs an NVIDIA sm_90 GPU and Triton >= 3.6"),
]


def _fp8(*shape, gen=None):
    return (torch.randn(*shape, device="cuda", generator=gen) * 2).to(FP8)


def _inputs(b, L, next_n, *, cl2d=False, pad_blocks=3, block_pad=0, four_d=False, seed=0, h=64):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bs, d = 64, 128
    max_blocks = (L + bs - 1) // bs + pad_blocks
    nb = b * max_blocks + 7
    kv = new_kv_cache(nb, bs, d, device="cuda", block_pad=block_pad, four_d=four_d)
    vals, scales = cache_views(kv, FP8)
    vals.copy_(_fp8(nb, bs, d, gen=g))
    scales.copy_(torch.rand(nb, bs, device="cuda", generator=g) * 0.01 + 0.001)
    bt = torch.randperm(nb, device="cuda", generator=g)[: b * max_blocks].view(b, max_blocks).int()
    lens = torch.randint(1, L + 1, (b,), device="cuda", generator=g).int()
    lens[0] = 0
    lens[-1] = L
    if b > 2:
        lens[1] = 64 * (L // 128) + 1  # one past a tile boundary
        lens[2] = 63
    if cl2d:
        cl = (lens[:, None] - torch.randint(0, next_n + 2, (b, next_n), device="cuda", generator=g)).clamp(min=0)
        cl = cl.int().contiguous()
    else:
        cl = lens
    # block-table entries past each request's blocks: ids the cache does not have (must never be read)
    used = (si.row_limits(cl, next_n).view(b, next_n).amax(1) + bs - 1) // bs
    cols = torch.arange(max_blocks, device="cuda")[None, :]
    bt = torch.where(cols < used[:, None], bt, torch.full_like(bt, 2**30)).contiguous()
    q = _fp8(b, next_n, h, d, gen=g)
    wts = torch.randn(b * next_n, h, device="cuda", generator=g) * 0.1
    return q, kv, wts, cl, bt


def _ref(q, kv, wts, cl, bt, w, indices=None):
    out = torch.empty(q.shape[0] * q.shape[1], w, device="cuda")
    si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="reference", indices=indices,
                            check_values=False)
    return out


def _check(got, ref, clean, untouched=None, tol=2e-4):
    inside = ref != float("-inf")
    err, mask_bad = logits_error(got.float(), ref, inside, clean=clean)
    assert mask_bad == 0, f"-inf mask differs from the reference in {mask_bad} cells"
    assert err <= tol, f"relative L2 error {err:.2e} against the reference"
    if untouched is not None:
        assert bool((got[~inside] == SENTINEL).all()), "clean=False wrote outside the windows"


@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("cl2d", [False, True])
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gluon_paged_logits(next_n, cl2d, clean, dtype):
    q, kv, wts, cl, bt = _inputs(9, 2000 + 37 * next_n, next_n, cl2d=cl2d, seed=next_n)
    w = bt.shape[1] * 64 + 40  # wider than the block table covers
    ref = _ref(q, kv, wts, cl, bt, w)
    out = torch.full((q.shape[0] * next_n, w + 24), SENTINEL, device="cuda", dtype=dtype)[:, :w]
    si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=clean, backend="gluon")
    tol = 2e-4 if dtype == torch.float32 else 4e-3  # bfloat16: one rounding, 2**-9 relative
    _check(out, ref, clean, None if clean else SENTINEL, tol)
    # the padding columns of the wider allocation are never written
    assert bool((out.as_strided((out.shape[0], 24), (out.stride(0), 1), w) == SENTINEL).all())


WIDE = {2: {"WIDE": True}, 4: {"WIDE": True, "ctas_per_sm": 1, "maxnreg": 168, "STAGES": 12, "NCONS": 1}}


@pytest.mark.parametrize("next_n", [2, 4])
@pytest.mark.parametrize("cl2d", [False, True])
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gluon_paged_logits_wide(next_n, cl2d, clean, dtype):
    """``config={"WIDE": True}``: one wgmma per tile with N = next_n * 64 (not the default yet)."""
    from sparse_indexer.kcache import as_3d
    from sparse_indexer.ops.fp8_paged_mqa_logits import gluon as G

    q, kv, wts, cl, bt = _inputs(7, 1900, next_n, cl2d=cl2d, seed=20 + next_n)
    w = bt.shape[1] * 64
    ref = _ref(q, kv, wts, cl, bt, w)
    out = torch.full((q.shape[0] * next_n, w), SENTINEL, device="cuda", dtype=dtype)
    G.fp8_paged_mqa_logits(q, as_3d(kv), wts, cl, bt, out=out, clean=clean, config=WIDE[next_n])
    _check(out, ref, clean, None if clean else SENTINEL, 2e-4 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("next_n", [1, 2, 3])
@pytest.mark.parametrize("cfg", [{"PAIR": True}, {"DUO": True, "STAGES": 2}, {"DUO": True, "STAGES": 4},
                                 {"DUO": False, "PAIR": False}], ids=["pair", "duo2", "duo4", "plain"])
@pytest.mark.parametrize("cl2d", [False, True])
def test_gluon_paged_logits_tile_schedules(next_n, cfg, cl2d):
    """The consumer's tile schedules through ``config``: one tile at a time, tiles in pairs (``PAIR``), two tiles
    per ring slot (``DUO``, the next_n=2 default), on ragged lengths (odd tile counts, a request split between
    CTAs, lengths 0 and 1)."""
    from sparse_indexer.kcache import as_3d
    from sparse_indexer.ops.fp8_paged_mqa_logits import gluon as G

    q, kv, wts, cl, bt = _inputs(37, 3000, next_n, cl2d=cl2d, seed=40 + next_n)
    w = bt.shape[1] * 64
    ref = _ref(q, kv, wts, cl, bt, w)
    for clean in (True, False):
        out = torch.full((q.shape[0] * next_n, w), SENTINEL, device="cuda")
        G.fp8_paged_mqa_logits(q, as_3d(kv), wts, cl, bt, out=out, clean=clean, config=cfg)
        _check(out, ref, clean, None if clean else SENTINEL)


@pytest.mark.parametrize("b,L", [(1, 64), (3, 1), (300, 700), (2, 70000)])
def test_gluon_paged_logits_shapes(b, L):
    """Few and many requests (the prologue's request vector), a single tile, more tiles than CTAs per request."""
    q, kv, wts, cl, bt = _inputs(b, L, 1, seed=b)
    w = bt.shape[1] * 64
    ref = _ref(q, kv, wts, cl, bt, w)
    out = torch.full((b, w), SENTINEL, device="cuda")
    si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="gluon")
    _check(out, ref, True)


def test_gluon_paged_logits_indices_and_4d_cache():
    q, kv, wts, cl, bt = _inputs(5, 1500, 1, four_d=True, seed=11)
    idx = torch.tensor([4, 0, 4, 2, 1, 3, 3], device="cuda", dtype=torch.int32)
    qi = _fp8(idx.numel(), 1, 64, 128)
    wi = torch.randn(idx.numel(), 64, device="cuda") * 0.1
    cli = (cl[idx.long()] - torch.tensor([0, 1, 5, 0, 63, 2, 0], device="cuda")).clamp(min=0).int()
    w = bt.shape[1] * 64
    ref = _ref(qi, kv, wi, cli, bt, w, indices=idx)
    out = torch.full((idx.numel(), w), SENTINEL, device="cuda")
    si.fp8_paged_mqa_logits(qi, kv, wi, cli, bt, out=out, clean=True, backend="gluon", indices=idx)
    _check(out, ref, True)


def _refused(q, kv, wts, cl, bt, **kw):
    out = torch.full((q.shape[0] * q.shape[1], bt.shape[1] * kv.shape[1]), SENTINEL, device="cuda")
    with pytest.raises(NotImplementedError):
        si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="gluon", **kw)
    assert bool((out == SENTINEL).all()), "a refused call wrote"
    # auto takes another backend for it
    si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="auto", **kw)


def test_gluon_paged_logits_refuses():
    q, kv, wts, cl, bt = _inputs(3, 500, 1)
    # a block stride that is not a multiple of 128 bytes (TMA rows)
    _, kvp, _, _, _ = _inputs(3, 500, 1, block_pad=64)
    _refused(q, kvp, wts, cl, bt)
    # next_n = 5
    q5 = _fp8(3, 5, 64, 128)
    _refused(q5, kv, torch.randn(15, 64, device="cuda"), cl, bt)
    # H = 32
    _refused(_fp8(3, 1, 32, 128), kv, torch.randn(3, 32, device="cuda"), cl, bt)
    # block size 32
    kv32 = new_kv_cache(kv.shape[0] * 2, 32, 128, device="cuda")
    _refused(q, kv32, wts, cl, torch.cat([bt * 2, bt * 2 + 1], 1).clamp(0, kv32.shape[0] - 1))
    # q with a head stride that is not D (a strided view)
    qs = _fp8(3, 1, 64, 256)[..., :128]
    _refused(qs, kv, wts, cl, bt)


def test_gluon_paged_logits_repeated_calls_reuse_the_encoded_descriptors():
    """The bound launch passes each TMA descriptor's encoded map kept on the descriptor (sparse_indexer/_runtime/tma.py,
    ``_launch._with_encoded_maps``): repeated calls on the same buffers stay right, and a query at another address
    gets its own descriptor. (A specialization's first launch takes Triton's own path, which encodes per call.)"""
    from sparse_indexer.ops.fp8_paged_mqa_logits import gluon as G

    q, kv, wts, cl, bt = _inputs(4, 3000, 1, seed=7)
    G._DESCS.clear()  # (earlier tests' descriptors: some only ever took Triton's first-launch path)
    w = bt.shape[1] * 64
    out = torch.full((4, w), SENTINEL, device="cuda")
    for _ in range(3):
        si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="gluon")
        _check(out, _ref(q, kv, wts, cl, bt, w), True)
    bound = [b for cfg, _ in G._PLANS.values() for b in cfg.bound.values()]
    assert bound and all(b.run.__name__ == "run_encoded" for b in bound), [b.run for b in bound]
    descs = list(G._DESCS._cache.values())
    assert descs and all(getattr(d, "_si_encoded", None) is not None for d in descs)
    q2 = _fp8(*q.shape)
    si.fp8_paged_mqa_logits(q2, kv, wts, cl, bt, out=out, clean=True, backend="gluon")
    _check(out, _ref(q2, kv, wts, cl, bt, w), True)


def test_gluon_paged_logits_cuda_graph():
    q, kv, wts, cl, bt = _inputs(4, 3000, 2, seed=5)
    w = bt.shape[1] * 64
    out = torch.full((8, w), SENTINEL, device="cuda")
    si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="gluon")  # compile, plan
    torch.cuda.synchronize()
    out.fill_(SENTINEL)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="gluon", check_values=False)
    # new values in the same buffers, then replay (lengths within the blocks each request has: the block-table
    # entries past them are ids the cache does not have)
    q.copy_(_fp8(*q.shape))
    cl.copy_(torch.tensor([0, 1400, 40, 2999], device="cuda", dtype=cl.dtype))
    out.fill_(SENTINEL)
    g.replay()
    torch.cuda.synchronize()
    _check(out, _ref(q, kv, wts, cl, bt, w), True)


def test_auto_takes_gluon_for_large_calls_only():
    """``auto`` runs the Gluon kernel where ``B * next_n * max_blocks >= AUTO_MIN_KEY_BLOCKS`` (its ``auto_when``)
    and the Triton kernel below (cheaper launches); a small call through ``auto`` still equals the reference."""
    from sparse_indexer._runtime import dispatch as _dispatch
    from sparse_indexer.kcache import as_3d
    from sparse_indexer.ops.fp8_paged_mqa_logits import gluon as G

    dev = torch.device("cuda")
    found = _dispatch.routes("fp8_paged_mqa_logits", None, dev)
    assert [r.name for r in found if r.name == "gluon" and r.when is not None] == ["gluon"]
    kv = new_kv_cache(8, 64, 128, device=dev)
    for b, nn, blocks, want in ((64, 1, 1024, "gluon"), (32, 2, 512, "gluon"), (4, 1, 64, "triton"),
                                (64, 1, G.AUTO_MIN_KEY_BLOCKS // 64 - 1, "triton")):
        q = torch.zeros(b, nn, 64, 128, device=dev, dtype=torch.float8_e4m3fn)
        bt = torch.zeros(b, blocks, device=dev, dtype=torch.int32)
        args = (q, as_3d(kv), torch.zeros(b * nn, 64, device=dev), torch.zeros(b, device=dev, dtype=torch.int32), bt)
        kw = {"out": torch.empty(b * nn, 64, device=dev), "clean": True}
        assert _dispatch.chosen(found, None, args, kw).name == want, (b, nn, blocks)
        named = _dispatch.routes("fp8_paged_mqa_logits", "gluon", dev)
        assert _dispatch.chosen(named, "gluon", args, kw).name == "gluon"


def test_auto_takes_gluon_for_smaller_calls_in_a_graph(monkeypatch):
    """Between ``AUTO_MIN_KEY_BLOCKS_GRAPHED`` and ``AUTO_MIN_KEY_BLOCKS`` key blocks, ``auto`` runs the Triton
    kernel eagerly and the Gluon kernel when the call is captured into a CUDA graph, on a layout already proven
    eagerly too; the replayed logits equal the reference."""
    from sparse_indexer._runtime import dispatch as _dispatch
    from sparse_indexer.ops.fp8_paged_mqa_logits import gluon as G

    ran = []
    real = G.fp8_paged_mqa_logits

    @functools.wraps(real)  # (its signature and auto_when: the routes read both)
    def spy(*a, **k):
        ran.append(torch.cuda.is_current_stream_capturing())
        return real(*a, **k)

    monkeypatch.setattr(G, "fp8_paged_mqa_logits", spy)
    _dispatch._implementation.cache_clear()
    _dispatch._resolved.clear()
    _dispatch._routes.cache_clear()
    try:
        q, kv, wts, cl, bt = _inputs(64, 16384 - 200, 1, pad_blocks=0, seed=9)
        blocks = 64 * bt.shape[1]
        assert G.AUTO_MIN_KEY_BLOCKS_GRAPHED <= blocks < G.AUTO_MIN_KEY_BLOCKS
        w = bt.shape[1] * 64
        out = torch.full((64, w), SENTINEL, device="cuda")
        for _ in range(2):  # eager, then the same layout proven: Triton both times
            si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True)
        assert ran == []
        si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="gluon")  # (compile outside)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, check_values=False)
        assert ran == [False, True]
        out.fill_(SENTINEL)
        g.replay()
        torch.cuda.synchronize()
        _check(out, _ref(q, kv, wts, cl, bt, w), True)
        si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True)  # eager again: Triton
        assert ran == [False, True]
    finally:
        monkeypatch.undo()
        _dispatch._implementation.cache_clear()
        _dispatch._resolved.clear()
        _dispatch._routes.cache_clear()
