"""``fp8_mqa_logits`` with MXFP4 operands (docs/spec.md §3a) on the backend under test (the reference, and
Triton in the CPU interpreter in CI) against a float64 oracle: the dequantized operands' exact scores."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from sparse_indexer.testing import assert_logits

pytestmark = pytest.mark.uses_ops("fp8_mqa_logits")


def _case(seed: int, m: int, h: int, n: int, d: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(m, h, d, generator=g) * torch.logspace(-1, 1, h).view(1, h, 1)
    k = torch.randn(n, d, generator=g) * torch.logspace(-2, 2, n).unsqueeze(1)
    k[:, : min(32, d)] *= 50.0  # blocks of different scales within a key
    w = torch.randn(m, h, generator=g) * (h * d) ** -0.5
    qv, qs = si.quantize_q_mxfp4(q)
    kv, ks = si.quantize_k_mxfp4(k)
    starts = torch.randint(0, n // 2, (m,), generator=g, dtype=torch.int32)
    ends = torch.randint(n // 2, n + 1, (m,), generator=g, dtype=torch.int32)
    starts[:3] = torch.tensor([0, 5, n - 1], dtype=torch.int32)
    ends[:3] = torch.tensor([n, 5, n], dtype=torch.int32)  # full, empty, the last key alone
    return qv, qs, kv, ks, w, starts, ends


def _oracle(qv, qs, kv, ks, w, starts, ends, compressed_width=None):
    q64 = si.dequantize_mxfp4(qv, qs, torch.float64)
    k64 = si.dequantize_mxfp4(kv, ks, torch.float64)
    full = (w.double()[:, :, None] * torch.relu(torch.einsum("mhd,nd->mhn", q64, k64))).sum(1)
    n = kv.shape[0]
    cols = torch.arange(n)[None, :]
    inside = (cols >= starts[:, None].long()) & (cols < ends[:, None].long())
    full = torch.where(inside, full, float("-inf"))
    if compressed_width is None:
        return full
    out = torch.full((qv.shape[0], compressed_width), float("-inf"), dtype=torch.float64)
    for r in range(qv.shape[0]):
        a, b = int(starts[r]), int(ends[r])
        if b > a:
            out[r, : b - a] = full[r, a:b]
    return out


@pytest.mark.parametrize("m,h,n,d", [(9, 16, 70, 128), (5, 3, 33, 64), (4, 64, 40, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_logits_against_float64(backend, m, h, n, d, dtype):
    qv, qs, kv, ks, w, a, b = _case(m * n + d, m, h, n, d)
    want = _oracle(qv, qs, kv, ks, w, a, b)
    out = torch.full((m, n), 5.0, dtype=dtype)
    si.fp8_mqa_logits(qv, kv, ks, w, a, b, out=out, q_scale=qs, backend=backend)
    assert_logits(out.float(), want, rtol_l2=1e-6 if dtype == torch.float32 else 4e-3)
    out.fill_(5.0)
    si.fp8_mqa_logits(qv, kv, ks, w, a, b, out=out, q_scale=qs, backend=backend, clean=False)
    inside = want != float("-inf")
    assert (out[~inside] == 5.0).all()  # clean=False leaves the cells outside the windows alone
    width = int((b - a).clamp(min=0).max()) + 3
    comp = si.fp8_mqa_logits(qv, kv, ks, w, a, b, q_scale=qs, backend=backend, max_seqlen_k=width,
                             logits_dtype=dtype)
    assert_logits(comp.float(), _oracle(qv, qs, kv, ks, w, a, b, width),
                  rtol_l2=1e-6 if dtype == torch.float32 else 4e-3)


def test_mxfp4_nan_blocks_give_nan_scores(backend):
    qv, qs, kv, ks, w, a, b = _case(3, 4, 8, 20, 64)
    ks[7, 1] = 255  # key 7: one NaN block
    qs[2, 5, 0] = 255  # query 2, head 5: one NaN block
    out = si.fp8_mqa_logits(qv, kv, ks, w, torch.zeros_like(a), torch.full_like(b, 20), q_scale=qs,
                            backend=backend)
    assert out[:, 7].isnan().all()
    assert out[2].isnan().all()
    rest = torch.ones_like(out, dtype=torch.bool)
    rest[:, 7] = False
    rest[2] = False
    assert not out[rest].isnan().any()
