"""The plan is tight (docs/memory.md): over random limits and random steps those limits allow, no step needs more
of a field than the plan holds (the step would raise ``BufferTooSmall``), and for every field some step needs
all of it (``profile.worst_case_steps``), so the plan is the maximum, not above it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparse_indexer as si
from buffers import IndexerLimits, allocate, plan
from buffers.plan import compressed_prefill_logits, prefill_extremes
from sparse_indexer.commands.profile import plan_capacity, step_needs, worst_case_steps
from sparse_indexer.indexer import check_step

FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
H, D = 1, 64


@st.composite
def limits_st(draw, big: bool = False, compressed_logits: bool = False):
    """Engine limits: small ones (real buffers are allocated and the step's own checks run) or large ones up to
    1M context (sizes only); compress ratio 1 (V3.2), 2 or 4 (V4's compressed indexer: 4 tokens per key)."""
    nn = draw(st.integers(1, 4))
    cr = draw(st.sampled_from([1, 2, 4]))
    if big:
        L = draw(st.integers(cr, 1 << 20))
        S = draw(st.integers(1, 512))
        T = draw(st.integers(S, 4096))
        C = draw(st.integers(1 << 20, 1 << 28))  # a smaller cap splits long requests into thousands of chunks
        bs = 1 << 14
    else:
        L = draw(st.integers(cr, 600))
        S = draw(st.integers(1, 12))
        T = draw(st.integers(S, 700))
        C = draw(st.integers(1, 40000))
        bs = draw(st.sampled_from([16, 64]))
    Lc = L // cr
    K = draw(st.integers(Lc, 6 * Lc))
    budget = draw(st.one_of(st.none(), st.integers(nn * Lc * 4, S * nn * Lc * 4 + 8)))
    return IndexerLimits(max_model_len=L, max_num_batched_tokens=T, max_num_seqs=S, next_n=nn, n_heads=H,
                         head_dim=D, topk=16, block_size=bs, compress_ratio=cr, prefill_k_tokens=K,
                         max_logits_bytes=4 * C,
                         max_decode_logits_bytes=budget, with_qk=draw(st.booleans()),
                         world_size=1 if compressed_logits else draw(st.sampled_from([1, 2, 3])),  # > 1: cp_scratch
                         compressed_prefill_logits=compressed_logits)


@st.composite
def step_st(draw, lim: IndexerLimits):
    """(seq_lens, query_lens) of a step the limits allow: at most max_num_seqs requests and
    max_num_batched_tokens tokens, decode requests (<= next_n tokens) first, contexts <= max_model_len."""
    L, T, S, nn = lim.max_model_len, lim.max_num_batched_tokens, lim.max_num_seqs, lim.next_n
    n = draw(st.integers(1, S))
    nd = draw(st.integers(0, n))
    seq, qry, left = [], [], T
    for _ in range(nd):
        q = draw(st.integers(0, min(nn, left, L)))
        left -= q
        seq.append(draw(st.integers(q, L)))
        qry.append(q)
    for _ in range(n - nd):
        if left <= nn or L <= nn:
            break
        big = draw(st.booleans())
        q = min(left, L) if big else draw(st.integers(nn + 1, min(left, L)))
        left -= q
        seq.append(L if big else draw(st.integers(q, L)))
        qry.append(q)
    return seq, qry


def metadata(lim: IndexerLimits, seq, qry):
    bs = lim.block_size
    nblk = max(1, (lim.max_keys + bs - 1) // bs)
    table = torch.zeros(max(1, len(seq)), nblk, dtype=torch.int32)  # every request reads block 0: only sizes matter
    return si.build_metadata(seq, qry, table, torch.full((sum(qry),), -1, dtype=torch.int64), lim, num_blocks=1)


def run_checks(lim: IndexerLimits, md, bufs) -> None:
    """The step's own fit check (raises BufferTooSmall) on real buffers."""
    t = max(1, md.num_tokens)
    q = torch.zeros(t, H, D, dtype=lim.fp8_dtype)
    w = torch.zeros(t, H)
    kv = si.new_kv_cache(1, lim.block_size, D)
    check_step(q, w, kv, md, bufs, torch.zeros(t, lim.topk, dtype=torch.int32))


@FAST
@given(data=st.data(), lim=limits_st())
def test_no_step_needs_more_than_the_plan(data, lim):
    p = plan(lim)
    cap = plan_capacity(p)
    bufs = allocate(p)
    for _ in range(3):
        seq, qry = data.draw(step_st(lim))
        md = metadata(lim, seq, qry)
        need = step_needs(md)
        for name, n in need.items():
            if cap[name]:
                assert n <= cap[name], (name, n, cap[name], seq, qry)
        run_checks(lim, md, bufs)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), lim=limits_st(compressed_logits=True))
def test_no_step_needs_more_than_the_plan_compressed_logits(data, lim):
    """With compressed prefill logits (``[M, longest window]``) the plan is an upper bound (split pieces count in
    full): no step needs more."""
    cap = plan_capacity(plan(lim))
    for _ in range(3):
        seq, qry = data.draw(step_st(lim))
        need = step_needs(metadata(lim, seq, qry))
        assert all(n <= cap[k] for k, n in need.items() if cap[k]), (need, cap, seq, qry)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), lim=limits_st(big=True))
def test_no_step_needs_more_than_the_plan_large(data, lim):
    cap = plan_capacity(plan(lim))
    seq, qry = data.draw(step_st(lim))
    need = step_needs(metadata(lim, seq, qry))
    for name, n in need.items():
        if cap[name]:
            assert n <= cap[name], (name, n, cap[name])


def check_reached(lim: IndexerLimits, real: bool) -> None:
    p = plan(lim)
    cap = plan_capacity(p)
    peak = dict.fromkeys(cap, 0)
    bufs = allocate(p) if real else None
    for _, seq, qry in worst_case_steps(lim):
        md = metadata(lim, seq, qry)
        for name, n in step_needs(md).items():
            peak[name] = max(peak[name], n if cap[name] else 0)
        if real:
            run_checks(lim, md, bufs)
    assert peak == cap, {k: (peak[k], cap[k]) for k in cap if peak[k] != cap[k]}


@FAST
@given(lim=limits_st())
def test_worst_case_steps_reach_every_field(lim):
    check_reached(lim, real=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lim=limits_st(big=True))
def test_worst_case_steps_reach_every_field_large(lim):
    check_reached(lim, real=False)


def brute_force(lim: IndexerLimits) -> tuple[int, int, int]:
    """Chunk maxima by enumerating every chunk the planner can form (tiny limits only): the reachable ``(M, N,
    longest window)`` of whole-request chunks of up to ``max_num_seqs`` requests ``(q, s)`` with ``q0 <= q <= s
    <= L`` (``n = s // C`` keys each), inside the caps, and the one-request pieces of a request whose ``q n``
    exceeds the logits cap. Returns ``(keys, logits, compressed logits)``."""
    L, T, S, c = lim.max_model_len, lim.max_num_batched_tokens, lim.max_num_seqs, lim.compress_ratio
    K, X, q0 = lim.prefill_k_tokens, lim.prefill_logits_elems, lim.min_prefill_queries
    reqs = {(q, s // c) for s in range(1, L + 1) for q in range(q0, min(s, T) + 1)}
    keys = logits = comp = 0
    level = {(0, 0, 0)}
    for _ in range(S):
        nxt = set()
        for m, n, w in level:
            for q, k in reqs:
                m2, n2 = m + q, n + k
                if m2 <= T and n2 <= K and m2 * n2 <= X:
                    nxt.add((m2, n2, max(w, k)))
        level = nxt
        for m, n, w in level:
            keys, logits, comp = max(keys, n), max(logits, m * n), max(comp, m * w)
    for q, k in reqs:
        if q * k > X:
            keys, logits = max(keys, k), max(logits, max(1, X // k) * k)
    return keys, logits, comp


@settings(max_examples=150, deadline=None)
@given(L=st.integers(1, 24), S=st.integers(1, 3), extra=st.integers(0, 30), nn=st.integers(1, 3),
       kx=st.integers(0, 40), C=st.integers(1, 300), cr=st.sampled_from([1, 2, 4]))
def test_prefill_extremes_match_brute_force(L, S, extra, nn, kx, C, cr):
    L = max(L, cr)
    lim = IndexerLimits(max_model_len=L, max_num_batched_tokens=S + extra, max_num_seqs=S, next_n=nn,
                        compress_ratio=cr, prefill_k_tokens=L // cr + kx, max_logits_bytes=4 * C)
    e = prefill_extremes(lim)
    keys, logits, comp = brute_force(lim)
    assert (e.keys, e.logits) == (keys, logits)
    # compressed logits: an upper bound (split pieces are counted whole), exact without split pieces
    assert compressed_prefill_logits(lim) >= comp


def test_v4_prefill_of_one_long_prompt_fits_the_plan():
    """DeepSeek-V4's compressed indexer (4 tokens per key): one 8192-token prompt has 8192 queries but 2048 keys,
    more query rows than keys; the plan holds its chunk and the step runs without BufferTooSmall."""
    lim = IndexerLimits(max_model_len=8192, max_num_batched_tokens=8192, max_num_seqs=2, next_n=1, n_heads=H,
                        head_dim=D, topk=512, block_size=64, compress_ratio=4)
    p = plan(lim)
    md = metadata(lim, [8192], [8192])
    assert [c.num_k_tokens for c in md.prefill_chunks] == [2048]
    assert sum(c.num_tokens for c in md.prefill_chunks) == 8192
    cap, need = plan_capacity(p), step_needs(md)
    assert all(need[k] <= cap[k] for k in need), (need, cap)
    run_checks(lim, md, allocate(p))


def test_min_prefill_query_len_plans_one_token_prefills():
    """vLLM's builder (ROCm, CPU) may send one-token requests down the prefill path: with
    ``min_prefill_query_len=1`` (what the vLLM shim sets) a chunk of ``max_num_seqs`` one-token prefills of
    ``max_model_len`` keys each fits the plan; the default plan (prefills of more than next_n tokens) is smaller."""
    base = dict(max_model_len=1000, max_num_batched_tokens=64, max_num_seqs=16, next_n=2,
                prefill_k_tokens=16_000, max_logits_bytes=16_000 * 4 * 16)
    default, vllm = IndexerLimits(**base), IndexerLimits(**base, min_prefill_query_len=1)
    assert default.min_prefill_queries == 3 and vllm.min_prefill_queries == 1
    # 16 requests of 1 query and 1000 keys: 16 x 16000 logits cells, 16000 keys, inside both caps
    keys_needed = 16 * 1000
    assert plan(vllm)["k_fp8"].shape[0] >= keys_needed
    assert plan(default)["k_fp8"].shape[0] < keys_needed  # 16 * 3 queries do not fit with that many keys
    assert plan(vllm)["logits"].shape[0] >= 16 * keys_needed
    with pytest.raises(ValueError, match="min_prefill_query_len"):
        IndexerLimits(**base, min_prefill_query_len=4)
