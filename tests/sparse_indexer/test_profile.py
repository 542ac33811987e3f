"""``profile_step``: the worst-case steps run on an arena of exactly the plan's bytes and use every field of it
in full (CPU: sizes only; ``tests/gpu/test_engine_gpu.py`` checks the allocator on the GPU)."""

from __future__ import annotations

import pytest

from buffers import IndexerLimits, plan
from sparse_indexer.commands.profile import plan_capacity, profile_step, worst_case_steps

LIM = IndexerLimits(max_model_len=256, max_num_batched_tokens=300, max_num_seqs=4, next_n=2, n_heads=16,
                    head_dim=64, topk=32, block_size=16, prefill_k_tokens=512, max_logits_bytes=4 * 20000)


def test_worst_case_shapes():
    steps = {name: (seq, qry) for name, seq, qry in worst_case_steps(LIM)}
    assert list(steps) == ["prefill keys", "prefill logits", "decode"]
    # keys: two requests of 256 keys (3 queries each: a prefill request has > next_n tokens) fill K = 512
    assert steps["prefill keys"] == ([256, 256], [3, 3])
    # logits: all 20000 cells of the cap, e.g. 40 queries x 500 keys of 4 requests
    seq, qry = steps["prefill logits"]
    assert sum(seq) * sum(qry) == 20000
    # decode: max_num_seqs requests of max_model_len, next_n tokens each but the last (non-uniform: packs used)
    assert steps["decode"] == ([256] * 4, [2, 2, 2, 1])


@pytest.mark.parametrize("budget", [None, 2 * 256 * 4])
def test_profile_step_cpu_uses_exactly_the_plan(budget):
    lim = IndexerLimits(**{**{a.name: getattr(LIM, a.name) for a in LIM.__attrs_attrs__},
                           "max_decode_logits_bytes": budget})
    r = profile_step(lim, "cpu", backend="reference")
    assert r.plan_bytes == plan(lim).total_bytes == r.arena_bytes
    assert r.step_peak_bytes is None and r.fits_plan  # no allocator statistics on the CPU
    assert [s[0] for s in r.steps] == ["prefill keys", "prefill logits", "decode"]
    assert r.steps[2][3] == lim.max_num_seqs * lim.next_n
    assert r.capacity == plan_capacity(plan(lim))
    assert r.reaches_plan, {k: (r.peaks[k], r.capacity[k]) for k in r.peaks if r.peaks[k] != r.capacity[k]}

