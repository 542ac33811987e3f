"""The buffer plan: a pure function of the limits (docs/spec.md §9)."""

import math

import pytest
import torch

from buffers import ALIGN, BufferPlan, IndexerLimits, plan
from buffers.plan import prefill_extremes
from sparse_indexer.ops.top_k_per_row.workspace import COUNTERS as TOPK_SCRATCH_COUNTERS
from sparse_indexer.ops.top_k_per_row.workspace import topk_scratch_cap

BASE = dict(max_model_len=1000, max_num_batched_tokens=77, max_num_seqs=5, n_heads=32, head_dim=64,
            max_logits_bytes=12345, prefill_k_tokens=1001)
LIMITS = [
    IndexerLimits(**BASE),
    IndexerLimits(**BASE, with_qk=True, next_n=3),
    IndexerLimits(**{**BASE, "head_dim": 128, "n_heads": 64}, fp8_dtype=torch.float8_e4m3fnuz),
    IndexerLimits(max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=256, with_qk=True),
    IndexerLimits(max_model_len=1, max_num_batched_tokens=1, max_num_seqs=1, max_logits_bytes=1),
]


def test_alignment_constant():
    assert ALIGN == 256


@pytest.mark.parametrize("lim", LIMITS)
def test_offsets_aligned_ordered_disjoint(lim):
    p = plan(lim)
    assert isinstance(p, BufferPlan)
    end = 0
    for f in p.fields:
        assert f.offset % 256 == 0, f
        assert f.offset >= end, f"{f.name} overlaps the previous field"
        assert f.offset - end < 256, f"{f.name} leaves more than the alignment gap"
        assert f.nbytes == math.prod(f.shape) * f.dtype.itemsize
        end = f.offset + f.nbytes
    assert p.total_bytes % 256 == 0
    assert end <= p.total_bytes < end + 256


@pytest.mark.parametrize("lim", LIMITS)
def test_field_shapes_per_spec(lim):
    p = plan(lim)
    ext = prefill_extremes(lim)
    names = [f.name for f in p.fields]
    assert names[:3] == ["k_fp8", "k_scale", "logits"]
    assert p["k_fp8"].shape == (ext.keys, lim.head_dim) and ext.keys <= lim.prefill_k_tokens
    assert p["k_fp8"].dtype == lim.fp8_dtype
    assert p["k_scale"].shape == (ext.keys,) and p["k_scale"].dtype == torch.float32
    want_logits = max(lim.decode_batch_rows * lim.max_model_len, ext.logits)
    assert p["logits"].shape == (want_logits,) and p["logits"].dtype == torch.float32
    if lim.with_qk:
        assert "qk" in p
        assert p["qk"].shape == (lim.n_heads, lim.decode_batch_rows, lim.max_model_len)
        assert p["qk"].dtype == torch.float32
    else:
        assert "qk" not in p
        with pytest.raises(KeyError, match="qk"):
            p["qk"]


def test_total_bytes_by_hand():
    lim = IndexerLimits(**BASE)
    # L = 1000, T = 77, 5 requests, C = 12345 // 4 = 3086 cells, K = 1001; a prefill request has >= 2 queries.
    # keys: one request of 1000 keys; two would hold at most 3086 // 4 = 771 (4 queries): 1000 -> k_fp8 64000 B,
    # next at 64000; k_scale 4000 -> 68000 -> 68096; logits max(5 x 1000 decode, 3085 prefill: 5 queries over
    # 617 keys of 2 requests, the best product <= 3086 that the planner can form) * 4 = 20000 -> 88096 -> 88320
    p = plan(lim)
    ext = prefill_extremes(lim)
    assert (ext.keys, ext.logits) == (1000, 3085)
    assert [sum(x) for x in ext.logits_step] == [617, 5]
    assert [f.offset for f in p.fields][:4] == [0, 64000, 68096, 88320]
    assert p.total_bytes >= 88320  # plus the top-k scratch


def test_small_engine_plan_is_what_it_can_touch():
    """A small engine: a prefill chunk holds at most 4 x 4096 keys and 1024 queries (64 MiB of
    logits); decode 4 x 4096 float32. By hand: 64 MiB + 16384 x (128 + 4) B + top-k scratch ~ 66 MiB."""
    MiB = 1 << 20
    lim = IndexerLimits(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=1024)
    p = plan(lim)
    assert p["k_fp8"].shape == (16384, 128) and p["logits"].shape == (1024 * 16384,)
    by_hand = 1024 * 16384 * 4 + 16384 * 132 + 4 * 4096 * 4
    assert p.total_bytes <= 1.05 * by_hand and by_hand / MiB < 66.2
    small = plan(IndexerLimits(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=128))
    assert small["logits"].shape == (128 * 16384,)
    assert small.total_bytes <= 1.05 * (128 * 16384 * 4 + 16384 * 132 + 4 * 4096 * 4)


def test_no_prefill_possible():
    """Steps of at most next_n tokens (or contexts of at most next_n keys) have no prefill: no gather buffer."""
    for kw in (dict(max_model_len=2, max_num_batched_tokens=64), dict(max_model_len=64, max_num_batched_tokens=2)):
        p = plan(IndexerLimits(**kw, max_num_seqs=2, next_n=2))
        assert p["k_fp8"].shape == (0, 128) and p["logits"].shape == (2 * 2 * kw["max_model_len"],)


def test_decode_budget_shrinks_decode_fields():
    MiB = 1 << 20
    kw = dict(max_model_len=1 << 20, max_num_batched_tokens=8192, max_num_seqs=256, next_n=2, with_qk=True,
              n_heads=4, max_logits_bytes=512 * MiB)
    free, budget = plan(IndexerLimits(**kw)), plan(IndexerLimits(**kw, max_decode_logits_bytes=256 * MiB))
    assert free["logits"].nbytes == 2048 * MiB and budget["logits"].nbytes == 512 * MiB  # the prefill cap binds
    assert free["qk"].shape == (4, 512, 1 << 20) and budget["qk"].shape == (4, 64, 1 << 20)
    assert free["topk_scratch"].shape[0] == 512 and budget["topk_scratch"].shape[0] == 64
    for name in ("k_fp8", "q_pack", "w_pack", "topk_pack"):  # prefill and the packs are not affected
        assert free[name].shape == budget[name].shape


def test_with_qk_adds_exactly_qk():
    a = plan(IndexerLimits(**BASE))
    b = plan(IndexerLimits(**BASE, with_qk=True))
    assert sorted(f.name for f in b.fields) == sorted([f.name for f in a.fields] + ["qk"])
    assert b.total_bytes == a.total_bytes + -(-32 * 5 * 1000 * 4 // 256) * 256
    for f in a.fields:
        assert b[f.name].shape == f.shape and b[f.name].dtype == f.dtype


def test_pure_and_deterministic():
    lim = IndexerLimits(**BASE, with_qk=True)
    assert plan(lim) == plan(lim)
    assert plan(lim).limits is lim


def test_str_is_readable_table():
    p = plan(IndexerLimits(**BASE, with_qk=True))
    s = str(p)
    lines = s.splitlines()
    for name in ("k_fp8", "k_scale", "logits", "qk", "total"):
        assert any(line.split()[0] == name for line in lines if line.strip()), name
    assert "float8_e4m3fn" in s and "float32" in s
    assert "1000x64" in s
    assert str(p.total_bytes) in s
    assert len({len(line) for line in lines}) <= 2  # a table, not a repr


def test_plan_rejects_non_limits():
    with pytest.raises(TypeError, match="IndexerLimits"):
        plan({"max_model_len": 1})


@pytest.mark.parametrize("lim", LIMITS)
def test_topk_scratch_planned_for_every_limits(lim):
    p = plan(lim)
    f = p["topk_scratch"]
    cap = topk_scratch_cap(lim)
    assert f.shape == (lim.decode_batch_rows, TOPK_SCRATCH_COUNTERS + 2 * cap) and f.dtype == torch.int32
    assert cap >= 256 and cap & (cap - 1) == 0


def test_topk_scratch_size_deepseek():
    lim = IndexerLimits(max_model_len=163840, max_num_batched_tokens=8192, max_num_seqs=256, next_n=2)
    assert topk_scratch_cap(lim) == 4096
    assert plan(lim)["topk_scratch"].nbytes == 512 * (32 + 8192) * 4  # 16.06 MiB
    big = IndexerLimits(max_model_len=1048576, max_num_batched_tokens=8192, max_num_seqs=256, next_n=2)
    assert topk_scratch_cap(big) == 16384
