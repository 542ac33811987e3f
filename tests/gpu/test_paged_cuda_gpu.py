"""GPU tests of the CUDA ``fp8_paged_mqa_logits`` kernel (``logits_kernel.cu``) against the reference backend.

The contract (docs/spec.md §5): relative L2 error <= 2e-4 against the reference on in-window cells (4e-3 with
bfloat16 ``out``), exact ``-inf`` masks with ``clean=True``, out-of-window cells untouched with ``clean=False``;
H 32 and 64, next_n 1..4, 1-D and 2-D lengths, ragged lengths (0, one past a tile, longer than a CTA's piece),
block-table entries past each request that the cache does not have, ``indices``, every configuration of the
ring, CUDA graphs. Cases the kernel does not take raise ``NotImplementedError`` and write nothing. Skipped
without an sm_90 GPU.
"""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from sparse_indexer.kcache import as_3d, new_kv_cache

from .test_paged_gluon_gpu import SENTINEL, _check, _fp8, _inputs, _ref


def _why_not() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    from sparse_indexer.ops.fp8_paged_mqa_logits import cuda as C

    return C._why_not_device(torch.cuda.current_device())


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why_not() is not None, reason=f"{_why_not()}")]


def _run(q, kv, wts, cl, bt, *, clean, dtype=torch.float32, indices=None, config=None, extra=0):
    from sparse_indexer.ops.fp8_paged_mqa_logits import cuda as C

    w = bt.shape[1] * 64 + extra
    out = torch.full((q.shape[0] * q.shape[1], w + 24), SENTINEL, device="cuda", dtype=dtype)[:, :w]
    if config is None:
        si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=clean, backend="cuda", indices=indices)
    else:
        C.fp8_paged_mqa_logits(q, as_3d(kv), wts, cl, bt, out=out, clean=clean, indices=indices, config=config)
    pad = out.as_strided((out.shape[0], 24), (out.stride(0), 1), w)
    assert bool((pad == SENTINEL).all()), "the padding columns past W were written"
    return out, w


@pytest.mark.parametrize("h", [64, 32])
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("cl2d", [False, True])
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_paged_logits(h, next_n, cl2d, clean, dtype):
    q, kv, wts, cl, bt = _inputs(9, 2000 + 37 * next_n, next_n, cl2d=cl2d, seed=next_n, h=h)
    out, w = _run(q, kv, wts, cl, bt, clean=clean, dtype=dtype, extra=40)
    _check(out, _ref(q, kv, wts, cl, bt, w), clean, None if clean else SENTINEL,
           2e-4 if dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("cfg", [{"STAGES": 2, "ctas_per_sm": 1}, {"NWG": 1, "STAGES": 4, "ctas_per_sm": 2},
                                 {"NWG": 2, "STAGES": 6, "ctas_per_sm": 1}, {"QBUF": 1, "STAGES": 3},
                                 {"NWG": 3, "QBUF": 3, "STAGES": 3}, {"NWG": 1, "STAGES": 3}],
                         ids=["st2", "nwg1x2", "nwg2", "qbuf1", "nwg3-qbuf3", "nwg1-st3"])
def test_cuda_paged_logits_configs(next_n, cfg):
    """Every ring depth, query-slot count and warpgroup count on ragged lengths (a request split between CTAs, a
    CTA's piece spanning many requests, lengths 0 and 1, a ring wrapping many times)."""
    if next_n == 4:  # (one CTA per SM of at most two math warpgroups: 128 accumulators per thread)
        cfg = {**cfg, "ctas_per_sm": 1, "NWG": min(cfg.get("NWG", 1), 2)}
    q, kv, wts, cl, bt = _inputs(37, 3000, next_n, cl2d=next_n == 2, seed=40 + next_n)
    ref = _ref(q, kv, wts, cl, bt, bt.shape[1] * 64)
    for clean in (True, False):
        out, _ = _run(q, kv, wts, cl, bt, clean=clean, config=cfg)
        _check(out, ref, clean, None if clean else SENTINEL)


@pytest.mark.parametrize("b,L,h", [(1, 64, 64), (3, 1, 32), (300, 700, 64), (2, 70000, 32), (1, 65536, 64)])
def test_cuda_paged_logits_shapes(b, L, h):
    """Few and many requests, a single tile, one request over every CTA."""
    q, kv, wts, cl, bt = _inputs(b, L, 1, seed=b, h=h)
    out, w = _run(q, kv, wts, cl, bt, clean=True)
    _check(out, _ref(q, kv, wts, cl, bt, w), True)


def test_cuda_paged_logits_indices_and_4d_cache():
    q, kv, wts, cl, bt = _inputs(5, 1500, 1, four_d=True, seed=11)
    idx = torch.tensor([4, 0, 4, 2, 1, 3, 3, 9, -1], device="cuda", dtype=torch.int32)  # 9, -1: no row
    qi = _fp8(idx.numel(), 1, 64, 128)
    wi = torch.randn(idx.numel(), 64, device="cuda") * 0.1
    cli = (cl[idx.clamp(0, 4).long()] - torch.tensor([0, 1, 5, 0, 63, 2, 0, 0, 0], device="cuda")).clamp(min=0)
    cli = cli.int()
    for clean in (True, False):
        out, w = _run(qi, kv, wi, cli, bt, clean=clean, indices=idx)
        _check(out, _ref(qi, kv, wi, cli, bt, w, indices=idx), clean, None if clean else SENTINEL)


def test_cuda_paged_logits_hostile_values():
    """Unchecked values (docs/spec.md §10): block ids outside the cache inside the windows score as zero keys,
    lengths past the block table are clamped to it, negative lengths are empty windows."""
    q, kv, wts, cl, bt = _inputs(6, 1000, 2, seed=3)
    bt = bt.clone()
    bt[1, 2] = -5
    bt[2, 0] = kv.shape[0]
    cl = cl.clone()
    cl[3] = 10**9
    cl[4] = -(2**31)
    w = bt.shape[1] * 64
    out = torch.full((12, w), SENTINEL, device="cuda")
    si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="cuda", check_values=False)
    _check(out, _ref(q, kv, wts, cl, bt, w), True)


def _refused(q, kv, wts, cl, bt, **kw):
    out = torch.full((q.shape[0] * q.shape[1], bt.shape[1] * kv.shape[1]), SENTINEL, device="cuda")
    with pytest.raises(NotImplementedError):
        si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="cuda", **kw)
    assert bool((out == SENTINEL).all()), "a refused call wrote"
    si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="auto", **kw)  # another backend


def test_cuda_paged_logits_refuses():
    q, kv, wts, cl, bt = _inputs(3, 500, 1)
    _refused(_fp8(3, 5, 64, 128), kv, torch.randn(15, 64, device="cuda"), cl, bt)  # next_n = 5
    _refused(_fp8(3, 1, 16, 128), kv, torch.randn(3, 16, device="cuda"), cl, bt)  # H = 16
    kv32 = new_kv_cache(kv.shape[0] * 2, 32, 128, device="cuda")  # block size 32
    _refused(q, kv32, wts, cl, torch.cat([bt * 2, bt * 2 + 1], 1).clamp(0, kv32.shape[0] - 1))
    _refused(_fp8(3, 1, 64, 256)[..., :128], kv, wts, cl, bt)  # q with a head stride that is not D


def test_cuda_paged_logits_refuses_configs_it_cannot_hold():
    """A configuration whose CTAs do not fit an SM together (shared memory) or leave too few registers for the
    accumulators is refused before anything is written, not compiled into spills or run in waves."""
    from sparse_indexer.ops.fp8_paged_mqa_logits import cuda as C

    q, kv, wts, cl, bt = _inputs(3, 500, 2)
    out = torch.full((6, bt.shape[1] * 64), SENTINEL, device="cuda")
    for cfg in ({"NWG": 2, "STAGES": 8, "ctas_per_sm": 2}, {"NWG": 1, "STAGES": 4, "ctas_per_sm": 3}):
        with pytest.raises(NotImplementedError):
            C.fp8_paged_mqa_logits(q, as_3d(kv), wts, cl, bt, out=out, clean=True, config=cfg)
    assert bool((out == SENTINEL).all())


def test_cuda_paged_logits_cuda_graph():
    q, kv, wts, cl, bt = _inputs(4, 3000, 2, seed=5, h=32)
    w = bt.shape[1] * 64
    out = torch.full((8, w), SENTINEL, device="cuda")
    si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="cuda")  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="cuda", check_values=False)
    q.copy_(_fp8(*q.shape))
    cl.copy_(torch.tensor([0, 1400, 40, 2999], device="cuda", dtype=cl.dtype))
    out.fill_(SENTINEL)
    g.replay()
    torch.cuda.synchronize()
    _check(out, _ref(q, kv, wts, cl, bt, w), True)


def test_auto_takes_cuda_for_h32_next_n2_in_a_graph(monkeypatch):
    """Between ``AUTO_MIN_KEY_BLOCKS_GRAPHED`` and ``AUTO_MIN_KEY_BLOCKS`` key blocks, ``auto`` runs another kernel
    eagerly and the CUDA kernel when an H = 32, next_n = 2 call is captured into a CUDA graph; the replayed logits
    equal the reference."""
    import functools

    from sparse_indexer._runtime import dispatch as _dispatch
    from sparse_indexer.ops.fp8_paged_mqa_logits import cuda as C

    ran = []
    real = C.fp8_paged_mqa_logits

    @functools.wraps(real)  # (its signature and auto_when: the routes read both)
    def spy(*a, **k):
        ran.append(torch.cuda.is_current_stream_capturing())
        return real(*a, **k)

    monkeypatch.setattr(C, "fp8_paged_mqa_logits", spy)
    _dispatch._implementation.cache_clear()
    _dispatch._resolved.clear()
    _dispatch._routes.cache_clear()
    try:
        q, kv, wts, cl, bt = _inputs(16, 32768, 2, pad_blocks=0, seed=9, h=32)
        assert C.AUTO_MIN_KEY_BLOCKS_GRAPHED <= 32 * bt.shape[1] < C.AUTO_MIN_KEY_BLOCKS
        w = bt.shape[1] * 64
        out = torch.full((32, w), SENTINEL, device="cuda")
        for _ in range(2):
            si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True)
        assert ran == []
        si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="cuda")  # (compile outside)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, check_values=False)
        assert ran == [False, True]
        out.fill_(SENTINEL)
        g.replay()
        torch.cuda.synchronize()
        _check(out, _ref(q, kv, wts, cl, bt, w), True)
    finally:
        monkeypatch.undo()
        _dispatch._implementation.cache_clear()
        _dispatch._resolved.clear()
        _dispatch._routes.cache_clear()
