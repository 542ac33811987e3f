"""The DeepGEMM adapter (``tests/compat/deepgemm_adapter``) on the CPU: DeepGEMM's call forms reach the
library and give its float64-checked logits. DeepGEMM's own ``tests/test_attention.py`` runs through it on a GPU
(the adapter's folder first on ``PYTHONPATH``)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from tests import oracle
from tests.cases import assert_logits, gen, int32, paged_case, random_fp8, random_weights

sys.path.insert(0, str(pathlib.Path(__file__).parent / "deepgemm_adapter"))
import deep_gemm  # noqa: E402
from deep_gemm.testing import calc_diff  # noqa: E402
from deep_gemm.utils import per_custom_dims_cast_to_fp8  # noqa: E402

FN = torch.float8_e4m3fn


def test_ragged_forms():
    g = gen(1)
    q = random_fp8((6, 32, 64), FN, g)
    kv = torch.randn(40, 64, generator=g)
    k_fp8, k_scale = per_custom_dims_cast_to_fp8(kv, (0,), False)
    w = random_weights(6, 32, g)
    ks, ke = int32([0, 0, 10, 5, 39, 3]), int32([40, 1, 30, 5, 40, 20])
    want = oracle.ragged_logits(oracle.decode(q), oracle.decode(k_fp8), k_scale, w, ks, ke)
    assert_logits(deep_gemm.fp8_mqa_logits(q, (k_fp8, k_scale), w, ks, ke), want)
    comp = deep_gemm.fp8_fp4_mqa_logits((q, None), (k_fp8, k_scale), w, ks, ke, clean_logits=False, max_seqlen_k=40,
                                        logits_dtype=torch.bfloat16)
    assert comp.shape == (6, 40) and comp.dtype == torch.bfloat16
    for i in range(6):
        s, e = int(ks[i]), int(ke[i])
        if e > s:
            assert calc_diff(comp[i, : e - s].float(), want[i, s:e].float()) < 1e-4
    with pytest.raises(NotImplementedError, match="FP4"):
        deep_gemm.fp8_fp4_mqa_logits((q, torch.ones(6, 32)), (k_fp8, k_scale), w, ks, ke)
    with pytest.raises(NotImplementedError, match="weights"):
        deep_gemm.fp8_mqa_logits(q, (k_fp8, k_scale), w.bfloat16(), ks, ke)


def test_paged_varlen_forms():
    """DeepGEMM's variable tokens per request: a per-row block table with ``indices``, and this library's
    per-request table with ``indices``, give the same logits."""
    g = gen(2)
    pc = paged_case(g, [50, 20, 70], 16, 64, FN)
    tokens = [2, 1, 3]
    indices = int32([r for r, t in enumerate(tokens) for _ in range(t)])
    ctx = int32([[L - t + j + 1] for L, t in zip([50, 20, 70], tokens) for j in range(t)])
    rows = 6
    q = random_fp8((rows, 1, 32, 64), FN, g)
    w = random_weights(rows, 32, g)
    width = pc.block_table.shape[1] * 16
    per_row = pc.block_table.index_select(0, indices.long())
    meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, 16, 8, indices=indices)
    assert meta.shape == (9, 2) and meta.dtype == torch.int32
    a = deep_gemm.fp8_fp4_paged_mqa_logits((q, None), pc.kv.unsqueeze(2), w, ctx, per_row, meta, width,
                                           clean_logits=True, logits_dtype=torch.float32, indices=indices)
    b = deep_gemm.fp8_paged_mqa_logits(q, pc.kv.unsqueeze(2), w, ctx, pc.block_table, meta, width, clean_logits=True,
                                       indices=indices)
    assert torch.equal(a, b)
    assert_logits(a, oracle.paged_logits(q, pc.kv, w, ctx.view(-1), per_row, width))
    c = deep_gemm.fp8_paged_mqa_logits(q, pc.kv.unsqueeze(2), w, ctx, pc.block_table, meta, width, clean_logits=True,
                                       logits_dtype=torch.bfloat16, indices=indices)
    assert c.dtype == torch.bfloat16 and torch.equal(c == float("-inf"), a == float("-inf"))


def test_schedule_metadata_splits_blocks_evenly():
    lens = int32([[128], [0], [64], [256]])  # 2, 0, 1, 4 blocks of 64: 7 in all
    meta = deep_gemm.get_paged_mqa_logits_metadata(lens, 64, 7)
    # SM i starts at global block i: rows 0,0,2,3,3,3,3 and offsets 0,1,0,0,1,2,3; the end is (4, 0)
    assert meta.tolist() == [[0, 0], [0, 1], [2, 0], [3, 0], [3, 1], [3, 2], [3, 3], [4, 0]]
    assert deep_gemm.get_paged_mqa_logits_metadata(torch.zeros(32, 1, dtype=torch.int32), 64, 4).shape == (5, 2)
