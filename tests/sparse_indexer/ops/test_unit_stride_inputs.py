"""1-D index and scale arguments must have unit stride: the kernels index them as flat arrays, so a strided
view is refused by name before anything is written (a strided ``cu_seq_lens`` once made a kernel write past
its output)."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si

FN = torch.float8_e4m3fn


def strided(x: torch.Tensor) -> torch.Tensor:
    return torch.stack([x, x], -1)[..., 0]  # same values, stride 2


def test_strided_arguments_are_refused(backend):
    kv = si.new_kv_cache(4, 16, 64)
    cases = [
        ("slot_mapping", lambda: si.write_k_cache(torch.randn(4, 64), kv, strided(torch.arange(4)), backend=backend)),
        ("cu_seq_lens", lambda: si.gather_k_cache(
            kv, torch.zeros(1, 2, dtype=torch.int32), strided(torch.tensor([0, 3], dtype=torch.int32)),
            out_k=torch.empty(8, 64, dtype=FN), out_scale=torch.empty(8), backend=backend)),
        ("out_scale", lambda: si.gather_k_cache(
            kv, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
            out_k=torch.empty(8, 64, dtype=FN), out_scale=strided(torch.empty(8)), backend=backend)),
        ("out_k", lambda: si.gather_k_cache(
            kv, torch.zeros(1, 2, dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
            out_k=torch.empty(8, 128, dtype=FN)[:, :64], out_scale=torch.empty(8), backend=backend)),
        ("row_starts", lambda: si.top_k_per_row(torch.randn(2, 8), strided(torch.zeros(2, dtype=torch.int32)),
                                                torch.full((2,), 8, dtype=torch.int32),
                                                out=torch.empty(2, 4, dtype=torch.int32), backend=backend)),
        ("cu_seqlen_ke", lambda: si.fp8_mqa_logits(
            torch.randn(2, 32, 64).to(FN), torch.randn(5, 64).to(FN), torch.ones(5), torch.randn(2, 32),
            torch.zeros(2, dtype=torch.int32), strided(torch.full((2,), 5, dtype=torch.int32)), backend=backend)),
        ("context_lens", lambda: si.fp8_paged_mqa_logits(
            torch.randn(2, 1, 32, 64).to(FN), kv, torch.randn(2, 32), strided(torch.full((2,), 5, dtype=torch.int32)),
            torch.zeros(2, 1, dtype=torch.int32), backend=backend)),
    ]
    before = kv.clone()
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()
    assert torch.equal(kv, before)
