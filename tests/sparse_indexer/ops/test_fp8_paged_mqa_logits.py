"""fp8_paged_mqa_logits (docs/spec.md §5, paged decode): float64 oracle, paged vs dense, exact -inf masks."""

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from sparse_indexer import fp8_mqa_logits, fp8_paged_mqa_logits, row_limits, top_k_per_row
from tests import oracle
from tests.cases import (
    FP8,
    FP8_IDS,
    assert_logits,
    assert_topk,
    empty_cache,
    expect_error,
    gen,
    hyp_settings,
    int32,
    paged_case,
    random_fp8,
    random_weights,
    skip_unsupported,
    supported,
)

NINF = float("-inf")


def test_hand_computed(backend):
    # one live head of H = 32 (the others: q = 0, weight 0), D = 64, block_size 2; request 0 owns blocks
    # [2, 0], context 3, next_n 1.
    d, h = 64, 32
    kv = empty_cache(3, 2, d)
    keys = torch.zeros(6, d)
    keys[4, :2] = torch.tensor([1.0, 1.0])  # position 0 (block 2, offset 0): q.k = 3
    keys[5, 0] = -4.0  # position 1: q.k = -4 -> relu 0
    keys[0, 1] = 3.0  # position 2 (block 0, offset 0): q.k = 6
    keys[1, 0] = 100.0  # position 3 (block 0, offset 1): outside the window
    scales = torch.tensor([0.25, 8.0, 1.0, 1.0, 1.0, 2.0])
    oracle.write_slots(kv, torch.arange(6), keys.to(torch.float8_e4m3fn).view(torch.uint8), scales)
    q = torch.zeros(1, 1, h, d)
    q[0, 0, 0, :2] = torch.tensor([1.0, 2.0])
    w = torch.zeros(1, h)
    w[0, 0] = -0.5
    out = torch.full((1, 4), 7.0)
    fp8_paged_mqa_logits(q.to(torch.float8_e4m3fn), kv, w, int32([3]), int32([[2, 0]]), out=out, backend=backend)
    assert torch.equal(out, torch.tensor([[-0.5 * 3 * 1.0, 0.0, -0.5 * 6 * 0.25, NINF]])), out


def test_row_limits():
    assert row_limits(int32([5, 1, 0]), 3).tolist() == [3, 4, 5, 0, 0, 1, 0, 0, 0]
    assert row_limits(int32([[2, 7], [0, 3]]), 2).tolist() == [2, 7, 0, 3]
    assert row_limits(int32([[-2, 1]]), 2).tolist() == [0, 1]


def _run(backend, case, q, w, context_lens, width, clean, fill=float("nan")):
    rows = q.shape[0] * q.shape[1]
    out = torch.full((rows, width), fill)
    res = fp8_paged_mqa_logits(q, case.kv, w, context_lens, case.block_table, out=out, clean=clean,
                               backend=backend, cache_fp8_dtype=q.dtype)  # the format paged_case wrote
    assert res is out
    return out


@hyp_settings()
@given(
    b=st.integers(1, 3),
    next_n=st.integers(1, 4),
    h=st.sampled_from([32, 64]),
    d=st.sampled_from([64, 128]),
    bs=st.sampled_from([1, 16, 32, 64]),
    dt=st.sampled_from(FP8),
    two_d=st.booleans(),
    clean=st.booleans(),
    pad=st.sampled_from([0, 8]),
    four_d=st.booleans(),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_matches_oracle(backend, b, next_n, h, d, bs, dt, two_d, clean, pad, four_d, data, seed):
    assume(supported(backend, dt))
    g = gen(seed)
    lens = st.integers(0, 150) | st.integers(0, 5)
    if two_d:
        cl = [[data.draw(lens) for _ in range(next_n)] for _ in range(b)]
        need = [max(r) for r in cl]
    else:
        cl = [data.draw(lens) for _ in range(b)]
        need = cl
    context_lens = int32(cl)
    case = paged_case(g, need, bs, d, dt, pad=pad, four_d=four_d)
    lims = oracle.row_limits(context_lens, next_n)
    cap = case.block_table.shape[1] * bs
    width = data.draw(st.integers(max(lims), cap))
    q = random_fp8((b, next_n, h, d), dt, g, amp=4.0)
    w = random_weights(b * next_n, h, g)
    out = _run(backend, case, q, w, context_lens, width, clean)
    want = oracle.paged_logits(q, case.kv, w, context_lens, case.block_table, width)
    assert_logits(out, want, clean=clean)


@pytest.mark.uses_ops("fp8_paged_mqa_logits", "fp8_mqa_logits")
@pytest.mark.parametrize("dt", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("bs", [1, 16, 64])
def test_paged_equals_dense(backend, dt, bs):
    """The paged op on a permuted block table equals the ragged op on the gathered (dense) keys."""
    skip_unsupported(backend, dt)
    g = gen(bs)
    lens, next_n, h, d = [130, 7, 64, 0], 2, 64, 128
    case = paged_case(g, lens, bs, d, dt, spare_blocks=5)
    q = random_fp8((4, next_n, h, d), dt, g)
    w = random_weights(4 * next_n, h, g)
    context_lens = int32(lens)
    out = _run(backend, case, q, w, context_lens, max(lens), clean=True)
    k, ks_ = case.dense()
    cu = case.cu_seq_lens.long().tolist()
    starts = [cu[r // next_n] for r in range(4 * next_n)]
    ends = [cu[r // next_n] + lim for r, lim in enumerate(oracle.row_limits(context_lens, next_n))]
    dense = fp8_mqa_logits(q.view(4 * next_n, h, d), k, ks_, w, int32(starts), int32(ends), backend=backend)
    want = torch.full_like(out, NINF)
    for r in range(4 * next_n):
        n = ends[r] - starts[r]
        want[r, :n] = dense[r, starts[r] : ends[r]]
    assert_logits(out, want.double(), rtol_l2=1e-6, name="paged vs dense")


@pytest.mark.parametrize("clean", [True, False])
def test_junk_in_unused_block_table_entries(backend, clean):
    """Entries past a request's blocks may hold anything (ids outside the cache); they are never used."""
    g = gen(11)
    case = paged_case(g, [40, 0, 17], 16, 64, torch.float8_e4m3fn, spare_cols=3, junk_unused=True)
    q = random_fp8((3, 1, 32, 64), torch.float8_e4m3fn, g)
    w = random_weights(3, 32, g)
    out = _run(backend, case, q, w, int32([40, 0, 17]), 48, clean)
    assert_logits(out, oracle.paged_logits(q, case.kv, w, int32([40, 0, 17]), case.block_table, 48), clean=clean)


def test_unclean_cells_outside_are_not_relied_upon(backend):
    """clean=False: whatever out holds outside the windows (NaN, +inf, huge) does not leak inside."""
    g = gen(12)
    case = paged_case(g, [33, 70], 16, 128, torch.float8_e4m3fn)
    q = random_fp8((2, 3, 64, 128), torch.float8_e4m3fn, g)
    w = random_weights(6, 64, g)
    cl = int32([33, 70])
    want = oracle.paged_logits(q, case.kv, w, cl, case.block_table, 80)
    for fill in (float("nan"), float("inf"), -3e38, 0.0):
        out = _run(backend, case, q, w, cl, 80, clean=False, fill=fill)
        assert_logits(out, want, clean=False)


@pytest.mark.uses_ops("fp8_paged_mqa_logits", "top_k_per_row")
def test_decode_then_topk(backend):
    """Decode logits -> top_k_per_row with row_starts = 0, row_ends = limit; judged by the float64 logits."""
    g = gen(13)
    next_n, lens = 2, [300, 20, 1, 0]
    case = paged_case(g, lens, 64, 128, torch.float8_e4m3fn)
    q = random_fp8((4, next_n, 64, 128), torch.float8_e4m3fn, g)
    w = random_weights(4 * next_n, 64, g)
    cl = int32(lens)
    out = _run(backend, case, q, w, cl, 300, clean=False)
    want = oracle.paged_logits(q, case.kv, w, cl, case.block_table, 300)
    ends = int32(oracle.row_limits(cl, next_n))
    starts = torch.zeros_like(ends)
    idx = torch.empty(4 * next_n, 64, dtype=torch.int32)
    top_k_per_row(out, starts, ends, out=idx, backend=backend)
    assert_topk(idx, want, starts, ends, rtol=1e-5)


def test_allocates_when_out_is_none(backend):
    g = gen(14)
    case = paged_case(g, [20, 50], 16, 64, torch.float8_e4m3fn, spare_cols=2)
    q = random_fp8((2, 1, 32, 64), torch.float8_e4m3fn, g)
    w = random_weights(2, 32, g)
    out = fp8_paged_mqa_logits(q, case.kv, w, int32([20, 50]), case.block_table, backend=backend)
    width = case.block_table.shape[1] * 16
    assert out.shape == (2, width)
    assert_logits(out, oracle.paged_logits(q, case.kv, w, int32([20, 50]), case.block_table, width))


def _base():
    g = gen(15)
    case = paged_case(g, [20, 9], 16, 64, torch.float8_e4m3fn, spare_cols=1)
    q = random_fp8((2, 2, 32, 64), torch.float8_e4m3fn, g)
    return dict(q=q, kv_cache=case.kv, weights=random_weights(4, 32, g), context_lens=int32([20, 9]),
                block_table=case.block_table, out=torch.zeros(4, 20))


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _kv_floats(a, n):
    return torch.empty(0, dtype=torch.uint8).set_(a["kv_cache"].untyped_storage())[: 4 * n].view(torch.float32)


BAD = [
    ("q bf16", lambda a: {"q": a["q"].to(torch.bfloat16)}, TypeError, "q"),
    ("q 3-D", lambda a: {"q": a["q"][:, 0]}, ValueError, "q"),
    ("q strided", lambda a: {"q": a["q"].transpose(2, 3).contiguous().transpose(2, 3)}, ValueError, "q"),
    ("kv dtype", lambda a: {"kv_cache": a["kv_cache"].view(torch.int8)}, TypeError, "kv_cache"),
    ("kv shape", lambda a: {"kv_cache": torch.zeros(3, 16, 2, 68, dtype=torch.uint8)}, ValueError, "kv_cache"),
    ("kv other D", lambda a: {"kv_cache": torch.zeros(3, 16, 132, dtype=torch.uint8)}, ValueError, "kv_cache"),
    ("kv meta", lambda a: {"kv_cache": _meta(a["kv_cache"])}, ValueError, "kv_cache"),
    ("weights shape", lambda a: {"weights": torch.ones(2, 32)}, ValueError, "weights"),
    ("weights dtype", lambda a: {"weights": torch.ones(4, 32, dtype=torch.bfloat16)}, TypeError, "weights"),
    ("weights strided", lambda a: {"weights": torch.ones(32, 4).T}, ValueError, "weights"),
    ("weights meta", lambda a: {"weights": _meta(a["weights"])}, ValueError, "weights"),
    ("lens int64", lambda a: {"context_lens": a["context_lens"].long()}, TypeError, "context_lens"),
    ("lens shape", lambda a: {"context_lens": int32([20, 9, 1])}, ValueError, "context_lens"),
    ("lens 2-D shape", lambda a: {"context_lens": int32([[20, 9, 1], [1, 1, 1]])}, ValueError, "context_lens"),
    ("lens meta", lambda a: {"context_lens": _meta(a["context_lens"])}, ValueError, "context_lens"),
    ("limit beyond W", lambda a: {"context_lens": int32([21, 9])}, ValueError, "context_lens"),
    ("limit beyond table", lambda a: {"context_lens": int32([[20, 49], [1, 1]]), "out": torch.zeros(4, 60)},
     ValueError, "context_lens"),
    ("bt int64", lambda a: {"block_table": a["block_table"].long()}, TypeError, "block_table"),
    ("bt rows", lambda a: {"block_table": a["block_table"][:1]}, ValueError, "block_table"),
    ("bt strided", lambda a: {"block_table": a["block_table"].T.contiguous().T}, ValueError, "block_table"),
    ("bt meta", lambda a: {"block_table": _meta(a["block_table"])}, ValueError, "block_table"),
    ("bt id beyond cache", lambda a: {"block_table": int32([[0, 1, 0], [99, 0, 0]])}, ValueError, "block_table"),
    ("bt negative id", lambda a: {"block_table": int32([[0, -1, 0], [2, 0, 0]])}, ValueError, "block_table"),
    ("out rows", lambda a: {"out": torch.zeros(3, 20)}, ValueError, "out"),
    ("out dtype", lambda a: {"out": torch.zeros(4, 20, dtype=torch.float64)}, TypeError, "out"),
    ("out strided", lambda a: {"out": torch.zeros(20, 4).T}, ValueError, "out"),
    ("out meta", lambda a: {"out": _meta(a["out"])}, ValueError, "out"),
    ("out aliases kv_cache", lambda a: {"out": _kv_floats(a, 80).view(4, 20)}, ValueError, "out"),
    ("out aliases weights", lambda a: {"out": a["weights"].view(-1)[:80].view(4, 20)}, ValueError, "out"),
]


@pytest.mark.parametrize("what, change, exc, name", BAD, ids=[b[0] for b in BAD])
def test_validation(backend, what, change, exc, name):
    a = _base()
    a.update(change(a))
    watch = [t for t in a.values() if t.device.type != "meta"]
    expect_error(exc, name, lambda: fp8_paged_mqa_logits(**a, backend=backend), watch=watch)
