"""select_candidate_blocks (docs/spec.md §6a): block maxima, the newest block pinned, NaN below every finite score,
all--inf blocks never candidates, ids first then -1, cells outside the windows never read."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from buffers import BufferTooSmall
from sparse_indexer import select_candidate_blocks
from sparse_indexer.testing import TOPK_DISTRIBUTIONS, assert_candidates, topk_values
from tests.cases import SLOW_BACKEND, expect_error, gen, hyp_settings, int32

NINF, NAN, INF = float("-inf"), float("nan"), float("inf")


def test_hand_computed(backend):
    x = torch.tensor([
        [1.0, 9.0, 0.0, 0.0, 5.0, 5.0, 2.0, 2.0, 7.0],  # window [0, 9), b = 2: blocks 0..4 max 9, 0, 5, 2, 7
        [1.0, 9.0, 0.0, 0.0, 5.0, 5.0, 2.0, 2.0, 7.0],  # window [1, 6): blocks (9, 0) (0, 5) (5): 9, 5, 5(newest)
        [NAN, 1.0, NINF, NINF, 3.0, 0.0, 0.0, 0.0, 0.0],  # window [0, 6): NaN, -inf, 3(newest) -> {2, 0}, -1
        [0.0] * 9,  # empty window
    ])
    out = torch.full((4, 2), 99, dtype=torch.int32)
    res = select_candidate_blocks(x, int32([0, 1, 0, 3]), int32([9, 6, 6, 3]), out=out, block_size=2,
                                  backend=backend)
    assert res is out
    assert sorted(out[0].tolist()) == [0, 4]  # the newest (4, score 7) and the best (0, score 9)
    assert sorted(out[1].tolist()) == [0, 2]
    assert sorted(out[2].tolist()) == [0, 2]  # the NaN block ranks above the -inf one, which is never chosen
    assert out[3].tolist() == [-1, -1]
    out = torch.full((1, 4), 99, dtype=torch.int32)
    select_candidate_blocks(x[2:3], int32([0]), int32([6]), out=out, block_size=2, backend=backend)
    assert sorted(out[0, :2].tolist()) == [0, 2] and out[0, 2:].tolist() == [-1, -1]  # -inf block: -1


def _windows(g, r, w, short_every=5):
    s = torch.randint(0, max(1, w // 4), (r,), generator=g)
    e = torch.minimum(s + torch.randint(0, w, (r,), generator=g), torch.tensor(w))
    e[::short_every] = s[::short_every] + torch.randint(0, 3, (len(e[::short_every]),), generator=g)  # tiny rows
    return s.int(), e.clamp(max=w).int()


@pytest.mark.parametrize("dist", TOPK_DISTRIBUTIONS)
@pytest.mark.parametrize("b,kb", [(8, 12), (1, 40), (5, 7), (8, 200)])
def test_distributions_match_the_model(backend, dist, b, kb):
    if SLOW_BACKEND and (b, kb) != (8, 12) and dist != "ints0-3":
        pytest.skip("the CPU interpreter runs every distribution at one shape and every shape on one distribution")
    g = gen(len(dist) * 31 + b * 7 + kb)
    r, w = 12, 700
    x = topk_values(dist, r, w, generator=g)
    s, e = _windows(g, r, w)
    out = torch.full((r, kb), 99, dtype=torch.int32)
    select_candidate_blocks(x, s, e, out=out, block_size=b, backend=backend)
    assert_candidates(out, x, s, e, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cells_outside_the_windows_are_never_read(backend, dtype):
    g = gen(5)
    r, w, b, kb = 9, 600, 8, 10
    s, e = _windows(g, r, w)
    x = torch.randn(r, w, generator=g)
    cols = torch.arange(w)[None, :]
    inside = (cols >= s[:, None].long()) & (cols < e[:, None].long())
    junk = torch.where(torch.rand(r, w, generator=g) < 0.5, torch.full_like(x, INF), torch.full_like(x, NAN))
    x = torch.where(inside, x, junk).to(dtype)
    before = x.clone()
    out = torch.full((r, kb), 99, dtype=torch.int32)
    select_candidate_blocks(x, s, e, out=out, block_size=b, backend=backend)
    assert_candidates(out, x, s, e, b)
    assert torch.equal(x.view(torch.uint8) if dtype == torch.float32 else x.view(torch.int16),
                       before.view(torch.uint8) if dtype == torch.float32 else before.view(torch.int16))


@hyp_settings()
@given(data=st.data(), b=st.sampled_from([1, 2, 3, 8, 16]), kb=st.integers(1, 40), w=st.integers(0, 300))
def test_random_windows(backend, data, b, kb, w):
    r = data.draw(st.integers(0, 5))
    g = gen(data.draw(st.integers(0, 2**16)))
    x = torch.randint(-3, 3, (r, w), generator=g).float()  # ties everywhere
    x[torch.rand(r, w, generator=g) < 0.1] = NINF
    x[torch.rand(r, w, generator=g) < 0.05] = NAN
    s = [data.draw(st.integers(0, w)) for _ in range(r)]
    e = [data.draw(st.integers(max(0, si - 2), w)) for si in s]
    out = torch.full((r, kb), 99, dtype=torch.int32)
    select_candidate_blocks(x, int32(s), int32(e), out=out, block_size=b, backend=backend)
    assert_candidates(out, x, int32(s), int32(e), b)


def test_workspace_is_used_and_checked(backend):
    g = gen(9)
    r, w, b, kb = 4, 500, 8, 9
    x = torch.randn(r, w, generator=g)
    s, e = int32([0, 10, 0, 3]), int32([500, 400, 64, 3])
    out = torch.full((r, kb), 99, dtype=torch.int32)
    ws = torch.full((r + 1, 70), 5, dtype=torch.int32)
    select_candidate_blocks(x, s, e, out=out, block_size=b, workspace=ws, backend=backend)
    assert_candidates(out, x, s, e, b)
    small = torch.zeros(r, 62, dtype=torch.int32)  # ceil(500 / 8) = 63 columns needed
    out2 = torch.full((r, kb), 99, dtype=torch.int32)
    expect_error(BufferTooSmall, "workspace",
                 lambda: select_candidate_blocks(x, s, e, out=out2, block_size=b, workspace=small, backend=backend),
                 watch=(out2,))


def test_bad_arguments_write_nothing(backend):
    x = torch.randn(3, 40)
    s, e = int32([0, 0, 0]), int32([40, 20, 10])
    out = torch.full((3, 4), 99, dtype=torch.int32)
    call = lambda **kw: select_candidate_blocks(**{"logits": x, "row_starts": s, "row_ends": e, "out": out,  # noqa
                                                   "block_size": 8, "backend": backend, **kw})
    expect_error(ValueError, "block_size", lambda: call(block_size=0), watch=(out,))
    expect_error(ValueError, "block_size", lambda: call(block_size=2.0), watch=(out,))
    expect_error(TypeError, "logits", lambda: call(logits=x.double()), watch=(out,))
    expect_error(TypeError, "out", lambda: call(out=out.long()), watch=(out,))
    expect_error(ValueError, "out", lambda: call(out=torch.zeros(2, 4, dtype=torch.int32)), watch=(out,))
    expect_error(ValueError, "out", lambda: call(out=torch.zeros(3, 0, dtype=torch.int32)), watch=(out,))
    expect_error(ValueError, "row_ends", lambda: call(row_ends=int32([41, 1, 1])), watch=(out,))
    expect_error(ValueError, "row_starts", lambda: call(row_starts=int32([-1, 0, 0])), watch=(out,))
    expect_error(ValueError, "out", lambda: call(out=x.view(torch.int32)[:, :4]), watch=(x,))


def test_empty_shapes(backend):
    out = torch.full((0, 3), 9, dtype=torch.int32)
    select_candidate_blocks(torch.zeros(0, 10), int32([]), int32([]), out=out, block_size=4, backend=backend)
    out = torch.full((2, 3), 9, dtype=torch.int32)
    select_candidate_blocks(torch.zeros(2, 0), int32([0, 0]), int32([0, 0]), out=out, block_size=4, backend=backend)
    assert bool((out == -1).all())


@pytest.mark.skipif(SLOW_BACKEND, reason="backend-independent (the reference backend): runs in the reference pass")
def test_compiles_to_one_op_node():
    """Under ``torch.compile(fullgraph=True)`` the op is one opaque node whose result equals eager's."""
    g = gen(3)
    x = torch.randn(4, 200, generator=g)
    s, e = int32([0, 5, 0, 0]), int32([200, 150, 9, 0])

    def f(x, s, e, out):
        return select_candidate_blocks(x, s, e, out=out, block_size=8, backend="reference")

    out = torch.full((4, 6), 9, dtype=torch.int32)
    torch.compile(f, fullgraph=True, backend="aot_eager")(x, s, e, out)
    ref = torch.full((4, 6), 9, dtype=torch.int32)
    f(x, s, e, ref)
    assert torch.equal(out, ref)
