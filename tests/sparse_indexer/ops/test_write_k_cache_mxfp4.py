"""``write_k_cache`` into an MXFP4 cache (docs/spec.md §3a) on the backend under test (the reference, and Triton
in the CPU interpreter in CI): byte for byte the reference's, on rows over float32's whole range, exact ties,
signed zeros, subnormals and non-finite blocks."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from buffers import CacheFormat
from tests.sparse_indexer.test_mxfp4 import _hard_rows

pytestmark = pytest.mark.uses_ops("write_k_cache")
MX = CacheFormat(values="mxfp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,bs,pad", [(128, 16, 0), (64, 5, 8)])
def test_mxfp4_write_bytes(backend, dtype, d, bs, pad):
    g = torch.Generator().manual_seed(d + bs)
    rows = _hard_rows(g)
    rows = rows[:, :d] if d == 64 else torch.cat([rows, rows.flip(0)], 1)
    x = torch.cat([rows, torch.randn(20, d, generator=g) * 40])
    x[3, 5] = float("nan")
    x[7, d - 1] = float("inf")
    x[9, 0] = -float("inf")
    if dtype == torch.float16:
        x = torch.where(x.isfinite(), x.clamp(-6e4, 6e4), x)
    x = x.to(dtype)
    n = x.shape[0]
    nb = -(-n // bs) + 2
    want = si.new_kv_cache(nb, bs, d, mxfp4=True, block_pad=pad)
    got = si.new_kv_cache(nb, bs, d, mxfp4=True, block_pad=pad)
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[[2, 11]] = -1
    si.write_k_cache(x, want, slots, cache_format=MX, backend="reference")
    si.write_k_cache(x, got, slots, cache_format=MX, backend=backend)
    assert torch.equal(got, want), int((got != want).sum())
