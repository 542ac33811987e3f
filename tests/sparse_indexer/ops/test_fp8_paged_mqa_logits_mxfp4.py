"""``fp8_paged_mqa_logits`` on an MXFP4 cache (docs/spec.md §3a) on the backend under test (the reference, and
Triton in the CPU interpreter in CI) against the reference: 1-D and 2-D lengths, ``indices``, ``clean`` on and off,
float32 and bfloat16 scores, block sizes below and above the key tile."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from sparse_indexer.testing import assert_logits
from tests.sparse_indexer.test_mxfp4 import MX

pytestmark = pytest.mark.uses_ops("fp8_paged_mqa_logits")


def _case(g, b, nn, h, d, bs, two_d):
    nb = b * 6 + 2
    kv = si.new_kv_cache(nb, bs, d, mxfp4=True)
    keys = torch.randn(nb * bs, d, generator=g) * torch.logspace(-1, 1, nb * bs).unsqueeze(1)
    si.write_k_cache(keys, kv, torch.arange(nb * bs), cache_format=MX, backend="reference")
    max_blocks = -(-(6 * 16) // bs)
    bt = torch.randint(0, nb, (b, max_blocks), generator=g, dtype=torch.int32)
    cap = max_blocks * bs
    cl = torch.randint(0, cap + 1, (b,), generator=g, dtype=torch.int32)
    cl[0] = cap
    if two_d:
        cl = torch.stack([(cl - nn + j + 1 - j % 2).clamp(min=0) for j in range(nn)], 1).int()
    qv, qs = si.quantize_q_mxfp4(torch.randn(b * nn, h, d, generator=g))
    w = torch.randn(b * nn, h, generator=g) * (h * d) ** -0.5
    return qv.view(b, nn, h, d // 2), qs.view(b, nn, h, d // 32), kv, w, cl, bt


@pytest.mark.parametrize("b,nn,h,d,bs,two_d", [(3, 2, 16, 128, 16, False), (4, 3, 8, 64, 64, True),
                                               (2, 1, 32, 128, 128, False), (5, 4, 4, 64, 8, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_paged_logits(backend, b, nn, h, d, bs, two_d, dtype):
    g = torch.Generator().manual_seed(b * 100 + d + bs)
    qv, qs, kv, w, cl, bt = _case(g, b, nn, h, d, bs, two_d)
    width = bt.shape[1] * bs + 5
    want = torch.empty(b * nn, width, dtype=dtype)
    si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, out=want, cache_format=MX, q_scale=qs, backend="reference")
    rtol = 1e-6 if dtype == torch.float32 else 4e-3
    got = torch.full((b * nn, width), 3.0, dtype=dtype)
    si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, out=got, cache_format=MX, q_scale=qs, backend=backend)
    assert_logits(got.float(), want.float(), rtol_l2=rtol)
    got.fill_(3.0)
    si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, out=got, cache_format=MX, q_scale=qs, backend=backend, clean=False)
    outside = want == float("-inf")
    assert (got[outside] == 3.0).all()
    if nn == 1:  # indices: entry i reads block-table row idx[i]
        idx = torch.randint(0, b, (b,), generator=g, dtype=torch.int32)
        want_i = si.fp8_paged_mqa_logits(qv, kv, w, cl[idx.long()], bt, cache_format=MX, q_scale=qs, indices=idx,
                                         backend="reference")
        got_i = si.fp8_paged_mqa_logits(qv, kv, w, cl[idx.long()], bt, cache_format=MX, q_scale=qs, indices=idx,
                                        backend=backend)
        assert_logits(got_i, want_i, rtol_l2=1e-6)
