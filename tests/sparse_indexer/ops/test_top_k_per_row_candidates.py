"""The candidate-restricted top_k_per_row (docs/spec.md §6a): only the window cells of a row's candidate blocks are
eligible; at most topk of them: all, then -1; otherwise the exact top-k of the eligible cells. Only candidate cells
are read and the logits stay as they are."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparse_indexer import select_candidate_blocks, top_k_per_row
from sparse_indexer.testing import TOPK_DISTRIBUTIONS, assert_topk, eligible, topk_values
from tests.cases import SLOW_BACKEND, expect_error, gen, hyp_settings, int32

pytestmark = pytest.mark.uses_ops("top_k_per_row")
NINF, NAN, INF = float("-inf"), float("nan"), float("inf")
NO_CANDIDATES = ("aiter",)  # its top-k kernel reads whole windows: auto takes the next backend for these calls


@pytest.fixture
def cbackend(backend):
    if backend in NO_CANDIDATES:
        pytest.skip(f"the {backend} top-k has no candidate-restricted path")
    return backend


def test_hand_computed(cbackend):
    x = torch.tensor([[9.0, 1.0, 2.0, 3.0, 8.0, 7.0, 6.0, 5.0, 4.0, 0.5]])
    # window [1, 10), b = 3: block 0 = cols 1..3, block 1 = 4..6, block 2 = 7..9; candidates {2, 0}
    out = torch.full((1, 2), 99, dtype=torch.int32)
    top_k_per_row(x, int32([1]), int32([10]), out=out, candidates=int32([[2, -1, 0]]), candidate_block_size=3,
                  backend=cbackend)
    assert sorted(out[0].tolist()) == [6, 7]  # values 5 and 4 (positions relative to the start)
    out = torch.full((1, 5), 99, dtype=torch.int32)
    top_k_per_row(x, int32([1]), int32([10]), out=out, candidates=int32([[9, 1, -1]]), candidate_block_size=3,
                  backend=cbackend)  # id 9 lies past the window: only block 1's three cells
    assert sorted(out[0, :3].tolist()) == [3, 4, 5] and out[0, 3:].tolist() == [-1, -1]


def _distinct_ids(g, r, kb, nb):
    """``[r, kb]`` distinct ids in ``[0, nb + 3)`` (some past the window) with -1 holes."""
    ids = torch.stack([torch.randperm(nb + 3 + kb, generator=g)[:kb] for _ in range(r)])
    ids = torch.where(ids >= nb + 3, -1, ids)
    ids[torch.rand(r, kb, generator=g) < 0.15] = -1
    return ids.int()


@pytest.mark.parametrize("dist", TOPK_DISTRIBUTIONS)
@pytest.mark.parametrize("b,kb,topk", [(8, 20, 64), (1, 90, 50), (5, 30, 100), (8, 6, 64)])
def test_distributions_match_the_model(cbackend, dist, b, kb, topk):
    if SLOW_BACKEND and (b, kb, topk) != (8, 20, 64) and dist != "ints0-3":
        pytest.skip("the CPU interpreter runs every distribution at one shape and every shape on one distribution")
    g = gen(len(dist) * 13 + b + kb)
    r, w = 10, 800
    x = topk_values(dist, r, w, generator=g)
    s = torch.randint(0, 100, (r,), generator=g).int()
    e = torch.minimum(s + torch.randint(0, w, (r,), generator=g).int(), torch.tensor(w, dtype=torch.int32))
    cand = _distinct_ids(g, r, kb, -(-w // b))
    before = x.clone()
    out = torch.full((r, topk), 99, dtype=torch.int32)
    top_k_per_row(x, s, e, out=out, candidates=cand, candidate_block_size=b, backend=cbackend)
    assert_topk(out, x, s, e, candidates=cand, candidate_block_size=b)
    assert torch.equal(x.view(torch.int32), before.view(torch.int32)), "the logits were modified"


def test_source_candidates_then_consumer(cbackend):
    """The two-level pipeline on one set of logits: candidates of one row set restrict another's top-k."""
    g = gen(2)
    r, w, b, kb, topk = 6, 3000, 8, 40, 128
    src = torch.randn(r, w, generator=g)
    con = torch.randn(r, w, generator=g)
    s = int32([0, 0, 100, 0, 7, 0])
    e = int32([3000, 2000, 2900, 100, 1500, 0])
    cand = torch.empty(r, kb, dtype=torch.int32)
    select_candidate_blocks(src, s, e, out=cand, block_size=b, backend=cbackend)
    out = torch.empty(r, topk, dtype=torch.int32)
    top_k_per_row(con, s, e, out=out, candidates=cand, candidate_block_size=b, backend=cbackend)
    assert_topk(out, con, s, e, candidates=cand, candidate_block_size=b)
    dense = torch.empty(r, topk, dtype=torch.int32)
    top_k_per_row(con, s, e, out=dense, backend="reference")
    assert set(out[0].tolist()) != set(dense[0].tolist()), "the restriction changed nothing"
    assert out[3, :100].tolist() != [-1] * 100 and out[5].tolist() == [-1] * topk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_candidate_cells_are_read(cbackend, dtype):
    g = gen(4)
    r, w, b, kb, topk = 5, 900, 8, 12, 40
    s = int32([0, 3, 50, 0, 0])
    e = int32([900, 700, 890, 95, 5])
    cand = _distinct_ids(g, r, kb, -(-w // b))
    x = torch.randn(r, w, generator=g)
    keep = torch.zeros(r, w, dtype=torch.bool)
    for i in range(r):
        keep[i, eligible(int(e[i] - s[i]), cand[i], b) + int(s[i])] = True
    junk = torch.where(torch.rand(r, w, generator=g) < 0.5, torch.full_like(x, INF), torch.full_like(x, NAN))
    x = torch.where(keep, x, junk).to(dtype)
    out = torch.full((r, topk), 99, dtype=torch.int32)
    top_k_per_row(x, s, e, out=out, candidates=cand, candidate_block_size=b, backend=cbackend)
    assert_topk(out, x, s, e, candidates=cand, candidate_block_size=b)


@hyp_settings()
@given(data=st.data(), b=st.sampled_from([1, 2, 3, 8]), kb=st.integers(1, 30), w=st.integers(0, 300),
       topk=st.integers(1, 70))
def test_random_rows(cbackend, data, b, kb, w, topk):
    r = data.draw(st.integers(0, 5))
    g = gen(data.draw(st.integers(0, 2**16)))
    x = torch.randint(-3, 3, (r, w), generator=g).float()
    x[torch.rand(r, w, generator=g) < 0.1] = NINF
    x[torch.rand(r, w, generator=g) < 0.05] = NAN
    s = [data.draw(st.integers(0, w)) for _ in range(r)]
    e = [data.draw(st.integers(max(0, si - 2), w)) for si in s]
    cand = _distinct_ids(g, r, kb, -(-w // b)) if r else torch.zeros(0, kb, dtype=torch.int32)
    out = torch.full((r, topk), 99, dtype=torch.int32)
    top_k_per_row(x, int32(s), int32(e), out=out, candidates=cand, candidate_block_size=b, backend=cbackend)
    assert_topk(out, x, int32(s), int32(e), candidates=cand, candidate_block_size=b)


def test_bad_candidates_write_nothing(backend):
    x = torch.randn(2, 50)
    s, e = int32([0, 0]), int32([50, 30])
    out = torch.full((2, 4), 99, dtype=torch.int32)
    good = int32([[0, 1, -1], [2, -1, -1]])
    call = lambda **kw: top_k_per_row(**{"logits": x, "row_starts": s, "row_ends": e, "out": out,  # noqa: E731
                                         "candidates": good, "candidate_block_size": 8, "backend": backend, **kw})
    expect_error(ValueError, "candidates", lambda: call(candidates=int32([[0, 1, 1], [2, -1, -1]])), watch=(out,))
    expect_error(ValueError, "candidates", lambda: call(candidates=int32([[0, -2, 1], [2, -1, -1]])), watch=(out,))
    expect_error(TypeError, "candidates", lambda: call(candidates=good.long()), watch=(out,))
    expect_error(ValueError, "candidates", lambda: call(candidates=good[:1]), watch=(out,))
    expect_error(ValueError, "block_size", lambda: call(candidate_block_size=None), watch=(out,))
    expect_error(ValueError, "block_size", lambda: call(candidate_block_size=0), watch=(out,))
    expect_error(ValueError, "candidate_block_size",
                 lambda: top_k_per_row(x, s, e, out=out, candidate_block_size=8, backend=backend), watch=(out,))
    expect_error(ValueError, "out", lambda: call(out=good.view(-1)[:4].view(2, 2)), watch=(good,))


@pytest.mark.skipif(SLOW_BACKEND, reason="backend-independent (the reference backend): runs in the reference pass")
def test_compiles_to_one_op_node():
    g = gen(3)
    x = torch.randn(3, 200, generator=g)
    s, e = int32([0, 5, 0]), int32([200, 150, 9])
    cand = int32([[0, 3, 24], [1, -1, 2], [0, -1, -1]])

    def f(x, s, e, out, cand):
        return top_k_per_row(x, s, e, out=out, candidates=cand, candidate_block_size=8, backend="reference")

    out = torch.full((3, 10), 9, dtype=torch.int32)
    torch.compile(f, fullgraph=True, backend="aot_eager")(x, s, e, out, cand)
    assert_topk(out, x, s, e, candidates=cand, candidate_block_size=8)
