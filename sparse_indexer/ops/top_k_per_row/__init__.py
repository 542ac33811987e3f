"""``top_k_per_row``: the ``topk`` best key positions of every row's window (SPEC 6)."""

from __future__ import annotations

import torch

from ... import _checks as C
from ... import library

__all__ = ["top_k_per_row"]


def top_k_per_row(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor, *, out: torch.Tensor,
                  backend: str | None = None, check_values: bool | None = None) -> torch.Tensor:
    """Select, per row, the positions of the ``topk = out.shape[1]`` largest logits of its window.

    Row ``r``'s window is ``[row_starts[r], row_ends[r])`` (``len`` clamped at 0). When ``len <= topk`` the row
    is ``0, 1, ..., len - 1, -1, ...``; otherwise it holds the ``topk`` positions (relative to ``row_starts[r]``,
    in any order) whose logits are the largest, ties broken either way; ``-inf`` and NaN rank below every
    finite value. Cells outside the window are never read, so ``clean=False`` logits are fine.

    Args:
        logits: ``[R, W]`` float32 (unit last stride).
        row_starts: ``[R]`` int32.
        row_ends: ``[R]`` int32, ``<= W`` for non-empty rows.
        out: ``[R, topk]`` int32, written in place.

    Returns:
        ``out``.
    """
    C.tensor("logits", logits, ndim=2, dtypes=torch.float32, last_contiguous=True)
    r, w = logits.shape
    dev = logits.device
    C.tensor("row_starts", row_starts, dtypes=C.INDEX_DTYPES, device=dev, shape=(r,))
    C.tensor("row_ends", row_ends, dtypes=C.INDEX_DTYPES, device=dev, shape=(r,))
    C.tensor("out", out, ndim=2, dtypes=torch.int32, device=dev, shape=(r, None), last_contiguous=True)
    if out.shape[1] < 1:
        raise ValueError(f"out.shape[1] (topk) must be >= 1, got {out.shape[1]}")
    C.no_alias("out", out, logits=logits, row_starts=row_starts, row_ends=row_ends)
    if C.want_value_checks(check_values, row_starts, row_ends):
        nonempty = row_ends > row_starts
        C.values_in("row_starts", row_starts, 0, None, "window starts must be >= 0", mask=nonempty)
        C.values_in("row_ends", row_ends, None, w + 1, f"window ends must be <= W = {w}", mask=nonempty)
    library.call("top_k_per_row", backend, dev, logits, row_starts, row_ends, out=out)
    return out
