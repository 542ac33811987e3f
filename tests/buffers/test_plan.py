"""The buffer plan: a pure function of the limits (docs/spec.md §9)."""

import math

import pytest
import torch

from buffers import ALIGN, BufferPlan, IndexerLimits, plan
from buffers.plan import TOPK_SCRATCH_COUNTERS, topk_scratch_cap

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
    names = [f.name for f in p.fields]
    assert names[:3] == ["k_fp8", "k_scale", "logits"]
    assert p["k_fp8"].shape == (lim.prefill_k_tokens, lim.head_dim)
    assert p["k_fp8"].dtype == lim.fp8_dtype
    assert p["k_scale"].shape == (lim.prefill_k_tokens,) and p["k_scale"].dtype == torch.float32
    want_logits = max(lim.max_num_seqs * lim.next_n * lim.max_model_len, lim.max_logits_bytes // 4)
    assert p["logits"].shape == (want_logits,) and p["logits"].dtype == torch.float32
    if lim.with_qk:
        assert "qk" in p
        assert p["qk"].shape == (lim.n_heads, lim.max_num_seqs * lim.next_n, lim.max_model_len)
        assert p["qk"].dtype == torch.float32
    else:
        assert "qk" not in p
        with pytest.raises(KeyError, match="qk"):
            p["qk"]


def test_total_bytes_by_hand():
    lim = IndexerLimits(**BASE)
    # k_fp8 1001*64 = 64064 -> next at 64256; k_scale 4004 -> 68260 -> 68352; logits max(5000, 3086) * 4 = 20000
    p = plan(lim)
    assert [f.offset for f in p.fields][:3] == [0, 64256, 68352]
    assert p.total_bytes >= 88576  # align(68352 + 20000 = 88352), plus any backend scratch fields


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
    assert "1001x64" in s
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
    assert f.shape == (lim.max_num_seqs * lim.next_n, TOPK_SCRATCH_COUNTERS + 2 * cap) and f.dtype == torch.int32
    assert cap >= 256 and cap & (cap - 1) == 0


def test_topk_scratch_size_deepseek():
    lim = IndexerLimits(max_model_len=163840, max_num_batched_tokens=8192, max_num_seqs=256, next_n=2)
    assert topk_scratch_cap(lim) == 4096
    assert plan(lim)["topk_scratch"].nbytes == 512 * (32 + 8192) * 4  # 16.06 MiB
    big = IndexerLimits(max_model_len=1048576, max_num_batched_tokens=8192, max_num_seqs=256, next_n=2)
    assert topk_scratch_cap(big) == 16384
