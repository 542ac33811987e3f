"""The checks of the indexer's outputs: top-k selections (docs/spec.md §6) and FP8 logits (§5), in one place.

The tests, the benchmark (``python -m sparse_indexer bench``), the self-check (``python -m sparse_indexer
check``), the demo and the scripts judge results with these functions; so can anyone writing a backend
(README, "Adding a backend").

Top-k: row ``i`` of ``sel [R, topk] int32`` selects from the window ``logits[i, starts[i]:ends[i]]`` (positions
relative to the window start). A window of ``n <= topk`` cells must give exactly ``0, 1, ..., n - 1, -1, ...``;
a longer one ``topk`` distinct positions in ``[0, n)`` whose values, sorted, equal the window's ``topk`` largest
(ties may be broken either way: only the multiset of values counts; NaN ranks as ``-inf``). ``rtol`` allows
the sorted values to differ by ``rtol * max|finite window value|`` (logits from another computation, e.g. a
tensor-core kernel judged by float64 scores); ``threshold=True`` only asks every selected value to be within that
of the ``topk``-th largest.

Logits: inside the windows, the relative L2 error against the expected values (float64 or the reference
backend's); with ``clean``, the ``-inf`` mask (cells outside the windows) must match exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["LOGITS_RTOL_L2", "assert_logits", "assert_topk", "logits_error", "rank_key", "top_values",
           "topk_errors", "windows"]

LOGITS_RTOL_L2 = 1e-5
"""Relative L2 error allowed inside the windows against float64 (FP8 products exact in float32, float32 sums)."""
NEG_INF = float("-inf")


def rank_key(x: torch.Tensor) -> torch.Tensor:
    """float64 values where NaN counts as ``-inf`` (both rank below every finite value)."""
    x = x.double()
    return torch.where(torch.isnan(x), torch.full_like(x, NEG_INF), x)


def top_values(window: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` largest values of a 1-D window (NaN as ``-inf``), sorted descending, float64."""
    return torch.sort(rank_key(window), descending=True).values[:topk]


def windows(logits: torch.Tensor, starts, ends) -> list[torch.Tensor]:
    """The windows ``logits[i, starts[i]:ends[i]]`` (CPU views; an empty window where ``ends <= starts``)."""
    logits = logits.cpu()
    s = [int(x) for x in torch.as_tensor(starts).tolist()]
    e = [int(x) for x in torch.as_tensor(ends).tolist()]
    return [logits[i, s[i] : max(s[i], e[i])] for i in range(len(s))]


def topk_errors(sel: torch.Tensor, rows: Sequence[torch.Tensor], *, rtol: float = 0.0, threshold: bool = False,
                limit: int | None = None) -> list[str]:
    """What is wrong with each row of ``sel [R, topk]`` (int32) as the top-k of the 1-D window ``rows[i]``
    (any float dtype; see the module docstring): one message per wrong row, at most ``limit``; ``[]`` when
    every row is right."""
    if sel.dim() != 2 or sel.shape[0] != len(rows):
        raise ValueError(f"sel must be [R = len(rows) = {len(rows)}, topk], got {tuple(sel.shape)}")
    sel = sel.cpu()
    topk = sel.shape[1]
    errors: list[str] = []
    for i, window in enumerate(rows):
        if limit is not None and len(errors) >= limit:
            break
        n = window.shape[0]
        row = sel[i].long()
        if n <= topk:
            want = torch.cat([torch.arange(n), torch.full((topk - n,), -1)])
            if not torch.equal(row, want):
                errors.append(f"row {i} (len {n} <= topk {topk}): got {row[:20].tolist()}..., "
                              f"want {want[:20].tolist()}...")
            continue
        if bool(((row < 0) | (row >= n)).any()):
            errors.append(f"row {i}: positions outside [0, {n}): {sorted(row.tolist())[:10]}...")
            continue
        if row.unique().numel() != topk:
            errors.append(f"row {i}: {topk - row.unique().numel()} repeated positions")
            continue
        w = rank_key(window.cpu())
        fin_w = torch.isfinite(w)
        scale = float(w[fin_w].abs().max()) if bool(fin_w.any()) else 0.0
        got = torch.sort(w[row], descending=True).values
        want = torch.sort(w, descending=True).values[:topk]
        if threshold:
            worst = float((want[-1] - got).max()) if bool(torch.isfinite(want[-1])) else 0.0
            if worst > rtol * scale:
                errors.append(f"row {i}: a selected value is {worst:.3e} below the {topk}-th largest "
                              f"(tolerance {rtol:.0e} x max|value| {scale:.3e})")
            continue
        fin = torch.isfinite(want)
        if not bool((torch.isfinite(got) == fin).all()):
            errors.append(f"row {i}: selected {int((~torch.isfinite(got)).sum())} -inf/NaN cells, the top-{topk} "
                          f"have {int((~fin).sum())}")
            continue
        diff = (got[fin] - want[fin]).abs()
        if diff.numel() and float(diff.max()) > rtol * scale:
            j = int(diff.argmax())
            errors.append(f"row {i}: sorted selected values differ from the top-{topk} values: "
                          f"{int((diff > rtol * scale).sum())} mismatches, worst at rank {j}: "
                          f"got {float(got[fin][j])!r}, want {float(want[fin][j])!r}")
    return errors


def assert_topk(sel: torch.Tensor, logits, starts=None, ends=None, *, rtol: float = 0.0,
                threshold: bool = False) -> None:
    """Raise ``AssertionError`` naming the first wrong row unless ``sel [R, topk]`` (int32) is the top-k of every
    window: ``logits [R, W]`` with ``starts/ends [R]``, or ``logits`` a sequence of ``R`` 1-D windows."""
    assert sel.dtype == torch.int32, f"top-k output must be int32, got {sel.dtype}"
    rows = windows(logits, starts, ends) if starts is not None else list(logits)
    errors = topk_errors(sel, rows, rtol=rtol, threshold=threshold, limit=1)
    if errors:
        raise AssertionError(errors[0])


def logits_error(actual: torch.Tensor, expected: torch.Tensor, inside: torch.Tensor | None = None, *,
                 clean: bool = True) -> tuple[float, int]:
    """``(relative L2 error inside the windows, cells whose -inf mask differs)`` of ``actual`` against
    ``expected`` (same shape; ``inside`` defaults to ``expected != -inf``). The error is ``inf`` when a value
    inside is not finite; the mask is compared only with ``clean`` (else 0)."""
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    inside = (e != NEG_INF) if inside is None else inside.cpu()
    mask_bad = int(((a == NEG_INF) != ~inside).sum()) if clean else 0
    ai = torch.where(inside, a, 0.0)
    ei = torch.where(inside, e, 0.0)
    if not bool(torch.isfinite(ai).all()):
        return float("inf"), mask_bad
    return float((ai - ei).norm()) / max(float(ei.norm()), 1e-300), mask_bad


def _worst(diff: torch.Tensor, actual, expected, n: int = 8) -> str:
    flat = diff.reshape(-1)
    k = min(n, flat.numel())
    idx = torch.topk(flat.nan_to_num(float("inf")), k).indices
    lines = []
    for i in idx.tolist():
        pos = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), diff.shape))
        lines.append(f"  at {list(pos)}: actual={float(actual[pos])!r} expected={float(expected[pos])!r}")
    return "\n".join(lines)


def assert_logits(actual: torch.Tensor, expected: torch.Tensor, *, clean: bool = True,
                  rtol_l2: float = LOGITS_RTOL_L2, name: str = "logits") -> None:
    """``expected``: float64 (or the reference backend's) logits, ``-inf`` outside the windows. Inside them the
    relative L2 error must be below ``rtol_l2``; with ``clean`` the ``-inf`` masks must match exactly. The
    ``AssertionError`` shows the worst cells."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().cpu().double()
    expected = expected.detach().cpu().double()
    outside = expected == NEG_INF
    if clean:
        bad = (a == NEG_INF) != outside
        if bool(bad.any()):
            raise AssertionError(f"{name}: -inf mask differs in {int(bad.sum())} cells (worst shown):\n"
                                 + _worst(bad.double(), a, expected))
    inside = ~outside
    if not bool(inside.any()):
        return
    ai = torch.where(inside, a, 0.0)
    finite = torch.isfinite(ai)
    if not bool(finite.all()):
        raise AssertionError(f"{name}: non-finite values inside windows:\n" + _worst((~finite).double(), a, expected))
    ei = torch.where(inside, expected, 0.0)
    diff = (ai - ei).abs()
    err = float(diff.norm()) / max(float(ei.norm()), 1e-300)
    if err >= rtol_l2 and float(diff.max()) > 0:
        raise AssertionError(f"{name}: relative L2 error {err:.3e} >= {rtol_l2:.0e}; worst cells:\n"
                             + _worst(diff, a, expected))
