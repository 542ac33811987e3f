"""The logits dtype and compressed prefill logits of the limits (docs/spec.md §9): the plan's
``logits`` field has the limits' dtype, bfloat16 halves it (same chunks), compressed prefill logits size it by the
largest chunk's queries x longest window (brute force over every chunk the planner forms, tiny limits)."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers import IndexerLimits, allocate, plan
from buffers.plan import compressed_prefill_logits, logits_elems, prefill_extremes
from sparse_indexer.metadata import plan_prefill_chunks

DEEPSEEK = dict(max_model_len=163840, max_num_batched_tokens=8192, max_num_seqs=256, next_n=2)


def test_defaults_and_validation():
    lim = IndexerLimits(**DEEPSEEK)
    assert lim.logits_dtype == torch.float32 and lim.compressed_prefill_logits is False
    with pytest.raises(ValueError, match="logits_dtype"):
        IndexerLimits(**DEEPSEEK, logits_dtype=torch.float16)
    with pytest.raises(TypeError, match="compressed_prefill_logits"):
        IndexerLimits(**DEEPSEEK, compressed_prefill_logits=1)
    with pytest.raises(ValueError, match="context parallel"):  # the merge exchanges float32 candidates
        IndexerLimits(**DEEPSEEK, logits_dtype=torch.bfloat16, world_size=2)
    assert IndexerLimits(**DEEPSEEK, logits_dtype=torch.bfloat16, world_size=1).world_size == 1


@pytest.mark.parametrize("base", [DEEPSEEK, dict(max_model_len=8192, max_num_batched_tokens=32768, max_num_seqs=64)])
def test_bf16_halves_logits_and_the_plan_shrinks_by_it(base):
    f32 = plan(IndexerLimits(**base))
    b16 = plan(IndexerLimits(**base, logits_dtype=torch.bfloat16))
    assert b16["logits"].dtype == torch.bfloat16 and b16["logits"].shape == f32["logits"].shape
    assert b16["logits"].nbytes * 2 == f32["logits"].nbytes
    assert f32.total_bytes - b16.total_bytes >= b16["logits"].nbytes - 256 * len(f32.fields)
    bufs = allocate(IndexerLimits(max_model_len=256, max_num_batched_tokens=512, max_num_seqs=4,
                                  logits_dtype=torch.bfloat16))
    assert bufs.logits.dtype == torch.bfloat16 and bufs.logits_view(4, 256).dtype == torch.bfloat16


def test_bf16_decode_budget_counts_two_bytes():
    lim = IndexerLimits(**DEEPSEEK, logits_dtype=torch.bfloat16, max_decode_logits_bytes=2 * 163840 * 2 * 10)
    assert lim.decode_batch == 10
    with pytest.raises(ValueError, match="next_n \\* max_keys \\* 2"):
        IndexerLimits(**DEEPSEEK, logits_dtype=torch.bfloat16, max_decode_logits_bytes=100)


def test_compressed_saves_where_chunks_hold_several_requests():
    """DeepSeek defaults: one 8K-token request over a 64K context already fills the 2 GiB cap, so compressed
    logits save nothing there; with 8K contexts and 32K-token steps a chunk holds several requests and the
    compressed plan is the longest-window one (isqrt(C) queries x 8192)."""
    ds = IndexerLimits(**DEEPSEEK)
    assert compressed_prefill_logits(ds) == prefill_extremes(ds).logits
    short = IndexerLimits(max_model_len=8192, max_num_batched_tokens=32768, max_num_seqs=64)
    c = short.prefill_logits_elems
    assert compressed_prefill_logits(short) == 23170 * 8192 < prefill_extremes(short).logits == c
    lim = attrs.evolve(short, compressed_prefill_logits=True)
    assert logits_elems(lim) == 23170 * 8192 and plan(lim)["logits"].shape == (23170 * 8192,)


def brute_force_compressed(lim: IndexerLimits) -> int:
    """Most ``queries x longest window`` cells of a chunk the planner forms, from its own chunking of every step
    of up to ``max_num_seqs`` prefill requests (tiny limits)."""
    L, T, S = lim.max_model_len, lim.max_num_batched_tokens, lim.max_num_seqs
    q0 = lim.min_prefill_queries
    reqs = [(s, q) for s in range(q0, L + 1) for q in range(q0, min(s, T) + 1)]
    best = 0

    def visit(step):
        nonlocal best
        seq, qry = [s for s, _ in step], [q for _, q in step]
        for c in plan_prefill_chunks(seq, qry, lim.prefill_k_tokens, lim.prefill_logits_elems):
            win = 0
            for r in range(c.req_start, c.req_end):
                lo, hi = (c.query_start, c.query_end) if c.req_end - c.req_start == 1 else (0, qry[r])
                win = max(win, seq[r] - qry[r] + hi)
            m = sum(qry[c.req_start:c.req_end]) if c.req_end - c.req_start > 1 else c.query_end - c.query_start
            best = max(best, m * win)

    def rec(step, tokens):
        if step:
            visit(step)
        if len(step) == S:
            return
        for s, q in reqs:
            if tokens + q <= T and (not step or (s, q) >= step[-1]):
                rec(step + [(s, q)], tokens + q)

    rec([], 0)
    return best


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 9), S=st.integers(1, 3), extra=st.integers(0, 10), nn=st.integers(1, 2),
       kx=st.integers(0, 12), C=st.integers(1, 80))
def test_compressed_extreme_bounds_every_chunk(L, S, extra, nn, kx, C):
    """The planned cells hold every chunk's compressed logits and never exceed the uncompressed plan; without
    split requests they are exactly the largest chunk's (split requests are bounded by their uncompressed
    pieces)."""
    lim = IndexerLimits(max_model_len=L, max_num_batched_tokens=S + extra, max_num_seqs=S, next_n=nn,
                        prefill_k_tokens=L + kx, max_logits_bytes=4 * C)
    planned = compressed_prefill_logits(lim)
    brute = brute_force_compressed(lim)
    assert brute <= planned <= prefill_extremes(lim).logits
    if min(S + extra, L) * L <= C:  # no request is split into query pieces: the plan is exactly the largest chunk
        assert planned == brute


def test_compressed_prefill_logits_not_with_context_parallel():
    with pytest.raises(ValueError, match="context parallel"):
        IndexerLimits(**DEEPSEEK, compressed_prefill_logits=True, world_size=2)
