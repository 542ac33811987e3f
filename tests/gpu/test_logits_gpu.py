"""GPU tests of the Triton logits kernels at DeepSeek-V3.2 shapes (H=64, D=128, block 64), fresh random inputs.

Relative L2 error against float64 math on the dequantized inputs < 1e-3 (tensor-core fp8 gives ~1e-4 or less),
``-inf`` masks identical to the reference's for ``clean=True``, untouched cells outside the windows for
``clean=False``. Skipped without a GPU (``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from sparse_indexer.kcache import cache_views, new_kv_cache
from sparse_indexer.testing import logits_error

FP8 = torch.float8_e4m3fn
SENTINEL = 7777.0
pytestmark = pytest.mark.gpu


def _fp8(*shape):
    return (torch.randn(*shape, device="cuda") * 2).to(FP8)


def _paged_inputs(b, L, next_n, *, bs=64, pad=0, cl2d=False, h=64, d=128):
    max_blocks = (L + bs - 1) // bs + 1
    nb = b * max_blocks + 5
    kv = new_kv_cache(nb, bs, d, device="cuda", block_pad=pad)
    vals, scales = cache_views(kv, FP8)
    vals.copy_(_fp8(nb, bs, d))
    scales.copy_(torch.rand(nb, bs, device="cuda") * 0.01 + 0.001)
    bt = torch.randperm(nb, device="cuda")[: b * max_blocks].view(b, max_blocks).int()
    lens = torch.randint(1, L + 1, (b,), device="cuda").int()
    lens[0] = 0
    lens[-1] = L
    cl = (lens[:, None] - torch.randint(0, next_n, (b, next_n), device="cuda")).clamp(min=0).int() if cl2d else lens
    return _fp8(b, next_n, h, d), kv, torch.randn(b * next_n, h, device="cuda") * 0.1, cl, bt


def _paged_f64(q, kv, wts, cl, bt):
    b, nn, h, d = q.shape
    vals, scales = cache_views(kv, q.dtype)
    bs = vals.shape[1]
    lim = si.row_limits(cl, nn)
    w = bt.shape[1] * bs
    out = torch.full((b * nn, w), float("-inf"), dtype=torch.float64, device="cuda")
    for r in range(b * nn):
        bi, j = divmod(r, nn)
        n = int(lim[r])
        pos = torch.arange(n, device="cuda")
        blk = bt[bi, pos // bs].long()
        s = (q[bi, j].double() @ vals[blk, pos % bs].double().T).relu()
        out[r, :n] = (wts[r].double()[:, None] * s).sum(0) * scales[blk, pos % bs].double()
    return out


def _check(got, ref64, clean_out_untouched=None):
    fin = torch.isfinite(ref64)
    err, mask_bad = logits_error(got, ref64, fin.cpu())
    assert mask_bad == 0, f"-inf mask differs from the reference in {mask_bad} cells"
    assert err < 1e-3, f"relative L2 error {err:.2e} vs float64"
    if clean_out_untouched is not None:
        assert torch.equal(clean_out_untouched == SENTINEL, ~fin), "clean=False wrote outside the windows"
        assert torch.equal(clean_out_untouched[fin], got[fin])


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("cl2d", [False, True])
@pytest.mark.parametrize("pad", [0, 64])
def test_paged_logits_deepseek(next_n, cl2d, pad):
    q, kv, wts, cl, bt = _paged_inputs(6, 3000, next_n, pad=pad, cl2d=cl2d)
    ref = _paged_f64(q, kv, wts, cl, bt)
    w = ref.shape[1]
    out = torch.full((q.shape[0] * next_n, w + 16), SENTINEL, device="cuda")[:, :w]
    si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="triton")
    out2 = torch.full((q.shape[0] * next_n, w), SENTINEL, device="cuda")
    si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out2, clean=False, backend="triton")
    _check(out, ref, out2)


@pytest.mark.parametrize("bs,next_n", [(1, 3), (16, 4), (32, 2)])
def test_paged_logits_block_sizes(bs, next_n):
    q, kv, wts, cl, bt = _paged_inputs(3, 700, next_n, bs=bs, h=32, d=64)
    ref = _paged_f64(q, kv, wts, cl, bt)
    out = torch.full_like(ref, SENTINEL, dtype=torch.float32)
    si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=out, clean=True, backend="triton")
    _check(out, ref)


@pytest.mark.parametrize("clean", [True, False])
def test_ragged_logits_deepseek(clean):
    m, n, h, d = 300, 2500, 64, 128
    q, k = _fp8(m, h, d), _fp8(n, d)
    ksc = torch.rand(n, device="cuda") * 0.01 + 0.001
    wts = torch.randn(m, h, device="cuda") * 0.1
    # two causal requests of one chunk (keys [0, 1000) and [1000, 2500)) and an empty row
    j = torch.arange(m, device="cuda")
    ks = torch.where(j < 100, 0, 1000).int()
    ke = torch.where(j < 100, 1000 - 100 + j + 1, 2500 - 200 + (j - 100) + 1).int()
    ke[5] = ks[5]
    ref = torch.full((m, n), float("-inf"), dtype=torch.float64, device="cuda")
    for r in range(m):
        a, e = int(ks[r]), int(ke[r])
        s = (q[r].double() @ k[a:e].double().T).relu()
        ref[r, a:e] = (wts[r].double()[:, None] * s).sum(0) * ksc[a:e].double()
    out = torch.full((m, n + 8), SENTINEL, device="cuda")[:, :n]
    si.fp8_mqa_logits(q, k, ksc, wts, ks, ke, out=out, clean=clean, backend="triton")
    if clean:
        _check(out, ref)
    else:
        fin = torch.isfinite(ref)
        assert torch.equal(out == SENTINEL, ~fin)
        err = ((out.double()[fin] - ref[fin]).norm() / ref[fin].norm()).item()
        assert err < 1e-3, f"relative L2 error {err:.2e} vs float64"
