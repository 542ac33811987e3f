"""``gather_k_cache`` from an MXFP4 cache (docs/spec.md §3a) on the backend under test (the reference, and Triton
in the CPU interpreter in CI): the keys' bytes, exactly as the reference copies them."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from buffers import CacheFormat

pytestmark = pytest.mark.uses_ops("gather_k_cache")
MX = CacheFormat(values="mxfp4")


@pytest.mark.parametrize("d,bs,nb,pad", [(128, 16, 9, 0), (64, 5, 11, 8), (128, 1, 40, 4), (64, 3, 1, 0)])
def test_mxfp4_gather_bytes(backend, d, bs, nb, pad):
    g = torch.Generator().manual_seed(d + bs + nb)
    kv = si.new_kv_cache(nb, bs, d, mxfp4=True, block_pad=pad)
    n = nb * bs
    si.write_k_cache(torch.randn(n, d, generator=g), kv, torch.randperm(n, generator=g), cache_format=MX,
                     backend="reference")
    lens = [n, 0, max(1, n // 3)]
    table = torch.stack([torch.randperm(nb, generator=g) for _ in lens]).int()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    rows = sum(lens) + 3
    want_k = torch.full((rows, d // 2), 7, dtype=torch.uint8)
    want_s = torch.full((rows, d // 32), 7, dtype=torch.uint8)
    si.gather_k_cache(kv, table, cu, out_k=want_k, out_scale=want_s, cache_format=MX, backend="reference")
    got_k, got_s = torch.full_like(want_k, 7), torch.full_like(want_s, 7)
    si.gather_k_cache(kv, table, cu, out_k=got_k, out_scale=got_s, cache_format=MX, backend=backend)
    assert torch.equal(got_k, want_k) and torch.equal(got_s, want_s)
    assert (got_k[sum(lens):] == 7).all()
