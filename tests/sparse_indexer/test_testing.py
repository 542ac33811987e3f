"""``sparse_indexer.testing``: the output checks accept what docs/spec.md allows and catch what it does not."""

from __future__ import annotations

import pytest
import torch

from sparse_indexer.testing import assert_logits, assert_topk, logits_error, topk_errors, windows


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
    assert [t.tolist() for t in windows(torch.arange(6.0).view(2, 3), [1, 2], [3, 1])] == [[1.0, 2.0], []]


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
