"""``profile_step``: the worst-case step runs on an arena of exactly the plan's bytes (CPU: sizes only)."""

from __future__ import annotations

import torch

from buffers import IndexerLimits, plan
from sparse_indexer.profile import profile_step, worst_case_steps

LIM = IndexerLimits(max_model_len=256, max_num_batched_tokens=300, max_num_seqs=4, next_n=2, n_heads=16,
                    head_dim=64, topk=32, block_size=16, prefill_k_tokens=512, max_logits_bytes=4 * 20000)


def test_worst_case_shapes():
    (_, p_seq, p_qry), (_, d_seq, d_qry) = worst_case_steps(LIM)
    assert p_seq == [256, 256] and p_qry == [256, 44]  # max_num_batched_tokens of prefill over full contexts
    assert d_seq == [256] * 4 and d_qry == [2] * 4  # max_num_seqs * next_n decode rows of max_model_len


def test_profile_step_cpu_uses_exactly_the_plan():
    r = profile_step(LIM, "cpu", backend="reference")
    assert r.plan_bytes == plan(LIM).total_bytes == r.arena_bytes
    assert r.step_peak_bytes is None and r.fits_plan  # no allocator statistics on the CPU
    names = [s[0] for s in r.steps]
    assert names == ["prefill", "decode"]
    assert r.steps[0][1] == 300 and r.steps[0][2] >= 2  # several chunks: the logits cap binds
    assert r.steps[1][3] == LIM.max_num_seqs * LIM.next_n


def test_fake_path_never_profiles(monkeypatch):
    """Tracing the step (meta/fake tensors) must not run the profiler: it is a host-side helper only."""
    import sparse_indexer.profile as prof

    calls = []
    monkeypatch.setattr(prof, "profile_step", lambda *a, **k: calls.append(1))
    import sparse_indexer as si

    t = torch.zeros(0, 16, 64, dtype=torch.float8_e4m3fn, device="meta")
    si.fp8_mqa_logits(t, torch.zeros(0, 64, dtype=t.dtype, device="meta"), torch.zeros(0, device="meta"),
                      torch.zeros(0, 16, device="meta"), torch.zeros(0, dtype=torch.int32, device="meta"),
                      torch.zeros(0, dtype=torch.int32, device="meta"), out=torch.zeros(0, 0, device="meta"))
    assert calls == []
