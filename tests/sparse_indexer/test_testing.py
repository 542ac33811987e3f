"""``sparse_indexer.testing``: the output checks accept what docs/spec.md allows and catch what it does not."""

from __future__ import annotations

import pytest
import torch

from sparse_indexer.testing import assert_logits, assert_topk, logits_error, topk_errors


def _case():
    x = torch.tensor([[5.0, 1.0, 3.0, 3.0, float("nan"), 0.0], [2.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    return x, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([6, 3], dtype=torch.int32)


def test_topk_ties_either_way_and_short_rows():
    x, s, e = _case()
    assert_topk(torch.tensor([[0, 2], [0, 1]], dtype=torch.int32), x, s, e)  # rows 5,3 | short: 0,1
    assert_topk(torch.tensor([[3, 0], [0, 1]], dtype=torch.int32), x, s, e)  # the other 3.0 of the tie


@pytest.mark.parametrize("row0, row1, what", [
    ([0, 1], [0, 1], "sorted selected values differ"),  # 1.0 instead of 3.0
    ([0, 0], [0, 1], "repeated"),
    ([0, 6], [0, 1], "outside"),
    ([0, 2], [1, 0], "len 2 <= topk"),
    ([0, 4], [0, 1], "-inf/NaN"),  # NaN selected over a finite value
])
def test_topk_catches(row0, row1, what):
    x, s, e = _case()
    with pytest.raises(AssertionError, match=what):
        assert_topk(torch.tensor([row0, row1], dtype=torch.int32), x, s, e)


def test_topk_tolerances():
    w = [torch.tensor([1.0, 0.999999, 0.5])]
    sel = torch.tensor([[1]], dtype=torch.int32)
    assert topk_errors(sel, w)  # exact: 0.999999 is not the largest
    assert not topk_errors(sel, w, rtol=1e-5)
    assert not topk_errors(sel, w, rtol=1e-5, threshold=True)
    assert topk_errors(torch.tensor([[2]], dtype=torch.int32), w, rtol=1e-5, threshold=True)
    two = torch.tensor([[9.0, 1.0, 2.0], [1.0, 1.0, 1.0]])
    assert not topk_errors(torch.tensor([[1], [-1]], dtype=torch.int32), two, [1, 2], [3, 1])  # 2.0 | empty
    errs = topk_errors(torch.tensor([[0], [0]], dtype=torch.int32), two, [1, 2], [3, 1])
    assert len(errs) == 2 and errs[0].startswith("row 0: sorted") and errs[1].startswith("row 1 (len 0")
    assert len(topk_errors(torch.tensor([[0], [0]], dtype=torch.int32), two, [1, 2], [3, 1], limit=1)) == 1


def test_topk_vectorized_matches_row_by_row():
    """Many rows of mixed windows (ties, -inf, NaN), selections right and spoiled: the chunked, vectorized
    verdict names exactly the spoiled rows."""
    import sparse_indexer as si

    g = torch.Generator().manual_seed(3)
    r, w, topk = 40, 300, 16
    x = (torch.randn(r, w, generator=g) * 3).round()
    x[x > 4] = float("-inf")
    x[x == -4] = float("nan")
    s = torch.randint(0, 50, (r,), generator=g, dtype=torch.int32)
    e = (s + torch.randint(0, 250, (r,), generator=g, dtype=torch.int32)).clamp(max=w)
    sel = torch.empty(r, topk, dtype=torch.int32)
    si.top_k_per_row(x, s, e, out=sel, backend="reference")
    assert topk_errors(sel, x, s, e) == []
    spoiled = [3, 17, 31]
    for i in spoiled:
        sel[i, 0] = (sel[i, 0] + 1) if int(e[i] - s[i]) > topk else 5
    got = [int(m.split()[1].rstrip(":")) for m in topk_errors(sel, x, s, e)]
    want = [i for i in spoiled if int(e[i] - s[i]) <= topk or
            bool(topk_errors(sel[i : i + 1], [x[i, int(s[i]) : int(e[i])]]))]
    assert got == want and got


def test_logits_checks():
    want = torch.tensor([[1.0, 2.0, float("-inf")], [3.0, float("-inf"), float("-inf")]], dtype=torch.float64)
    got = want.float().clone()
    assert_logits(got, want)
    assert logits_error(got, want) == (0.0, 0)
    got[0, 2] = 0.0
    with pytest.raises(AssertionError, match="-inf mask differs in 1 cells"):
        assert_logits(got, want)
    assert_logits(got, want, clean=False)
    assert logits_error(got, want) == (0.0, 1) and logits_error(got, want, clean=False) == (0.0, 0)
    got[1, 0] = 3.001
    with pytest.raises(AssertionError, match="relative L2 error"):
        assert_logits(got, want, clean=False)
    got[1, 0] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_logits(got, want, clean=False)
    assert logits_error(got, want, clean=False)[0] == float("inf")


def test_topk_values_shapes_and_contents():
    """Every distribution of the shared generator: the asked shape, float32, and what its name says."""
    from sparse_indexer.testing import ADVERSARIAL_DISTRIBUTIONS, TOPK_DISTRIBUTIONS, topk_values

    g = torch.Generator().manual_seed(3)
    for name in TOPK_DISTRIBUTIONS + ADVERSARIAL_DISTRIBUTIONS:
        x = topk_values(name, 3, 1000, generator=g)
        assert x.shape == (3, 1000) and x.dtype == torch.float32, name
    assert set(topk_values("ints0-3", 2, 500, generator=g).unique().tolist()) <= {0.0, 1.0, 2.0, 3.0}
    assert bool((topk_values("sorted", 2, 500, generator=g).diff(dim=1) >= 0).all())
    assert 0.9 < float(topk_values("95%-inf", 4, 5000, generator=g).isneginf().float().mean()) < 0.99
    y = topk_values("nan+inf", 4, 5000, generator=g)
    assert y.isnan().any() and y.isposinf().any() and y.isneginf().any()
    with pytest.raises(ValueError, match="unknown distribution"):
        topk_values("nope", 1, 10)
