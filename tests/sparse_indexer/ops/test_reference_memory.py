"""The reference backend keeps its temporaries bounded (an [M, N] = [8192, 65536] prefill call must not
build an [H, M, N] intermediate)."""

from __future__ import annotations

import torch

import sparse_indexer as si
from sparse_indexer.ops.fp8_mqa_logits import reference as ragged_ref


def test_tile_sizes_bound_the_deepseek_prefill_call():
    rows, cols = ragged_ref.tile_sizes(8192, 64, 65536)
    assert rows * 64 * cols <= ragged_ref.TILE_ELEMS
    assert rows * 64 * cols < 8192 * 64 * 65536 // 1000  # far below the [H, M, N] intermediate
    assert ragged_ref.tile_sizes(3, 64, 10) == (3, 10)


def test_tiled_results_equal_untiled(monkeypatch):
    torch.manual_seed(0)
    m, n, h, d = 37, 300, 32, 64
    q = torch.randn(m, h, d).to(torch.float8_e4m3fn)
    k = torch.randn(n, d).to(torch.float8_e4m3fn)
    ks = torch.rand(n) + 0.5
    w = torch.randn(m, h)
    s = torch.randint(0, 100, (m,), dtype=torch.int32)
    e = (s + torch.randint(0, 200, (m,), dtype=torch.int32)).clamp(max=n)
    want = si.fp8_mqa_logits(q, k, ks, w, s, e, backend="reference")
    seen = []
    orig = ragged_ref.score_tile

    def spy(qt, kt, wt):
        seen.append(qt.shape[0] * qt.shape[1] * kt.shape[0])
        return orig(qt, kt, wt)

    monkeypatch.setattr(ragged_ref, "TILE_ELEMS", 32 * 50)
    monkeypatch.setattr(ragged_ref, "score_tile", spy)
    got = si.fp8_mqa_logits(q, k, ks, w, s, e, backend="reference")
    assert len(seen) > 1 and max(seen) <= 32 * 50
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got))
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-6, atol=1e-6)
