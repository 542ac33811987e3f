"""Reference ``top_k_per_row``: ``torch.topk`` on float64 keys that rank out-of-window cells last.

In-window values keep their order; in-window ``-inf``/NaN become ``-1e300`` (below every float32, above the
``-inf`` given to cells outside the window), so a row with more than ``topk`` cells never selects outside.

Windows are clamped as the kernels clamp them when values are not checked (docs/spec.md §10): ``row_starts`` to
``>= 0``, ``row_ends`` to ``<= W``; an end at or below its start is an empty row. Valid windows are unchanged.
"""

from __future__ import annotations

import torch

ROW_TILE_ELEMS = 1 << 24


def top_k_per_row(logits, row_starts, row_ends, *, out, candidates=None, candidate_block_size=None) -> None:
    """See :func:`sparse_indexer.top_k_per_row`; arguments are checked."""
    if candidates is not None:
        _candidate_top_k(logits, row_starts, row_ends, out, candidates, candidate_block_size)
        return
    r, w = logits.shape
    topk = out.shape[1]
    if r == 0:
        return
    rt = max(1, min(r, ROW_TILE_ELEMS // max(1, w)))
    cols = torch.arange(w, device=logits.device)
    ar = torch.arange(topk, device=logits.device)
    for r0 in range(0, r, rt):
        r1 = min(r, r0 + rt)
        s, e = clamped_windows(row_starts[r0:r1], row_ends[r0:r1], w)
        n = (e - s).clamp(min=0)
        short = torch.where(ar[None, :] < n, ar[None, :], -1)  # [rows, topk]
        if w >= topk:
            inside = (cols[None, :] >= s) & (cols[None, :] < e)
            res = torch.where(n > topk, _top_inside(logits[r0:r1], inside, topk) - s, short)
        else:  # every window is shorter than topk
            res = short
        out[r0:r1] = res.to(torch.int32)


def clamped_windows(row_starts, row_ends, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, e)`` int64 ``[R, 1]``: the windows clamped into ``[0, w]`` (starts ``>= 0``, ends ``<= w``)."""
    return row_starts.long().clamp(min=0)[:, None], row_ends.long().clamp(max=w)[:, None]


def _top_inside(x: torch.Tensor, inside: torch.Tensor, topk: int) -> torch.Tensor:
    """Columns of the ``topk`` largest cells of each row of ``x`` among those ``inside`` (docs/spec.md §6 order:
    ``-inf`` and NaN below every finite value, in float64); meaningful for rows with more than ``topk`` cells
    inside."""
    x = x.double()
    x = torch.where(torch.isnan(x) | (x == float("-inf")), torch.full_like(x, -1e300), x)
    x = torch.where(inside, x, torch.full_like(x, float("-inf")))
    return torch.topk(x, topk, dim=1, sorted=False).indices


def eligible_cells(w: int, row_starts, row_ends, candidates, block_size: int) -> torch.Tensor:
    """``[R, W]`` bool: the window cells of each row that lie in one of its candidate blocks (block ``j`` is
    ``[s + j*b, s + (j+1)*b)``, the window clamped into ``[0, W]``; ids outside ``[0, ceil(W / b))`` and negative
    ids select nothing)."""
    r = row_starts.shape[0]
    dev = row_starts.device
    nb = -(-w // block_size)
    c = candidates.long()
    flags = torch.zeros(r, nb + 1, dtype=torch.bool, device=dev)
    flags.scatter_(1, torch.where((c >= 0) & (c < nb), c, nb), True)
    s, e = clamped_windows(row_starts, row_ends, w)
    cols = torch.arange(w, device=dev)[None, :]
    inside = (cols >= s) & (cols < e)
    blk = ((cols - s).clamp(min=0) // block_size).clamp(max=nb)
    return inside & flags[:, :nb].gather(1, blk.clamp(max=nb - 1)) if nb else inside


def _candidate_top_k(logits, row_starts, row_ends, out, candidates, block_size) -> None:
    """The top-k of each row's eligible cells (docs/spec.md §6a): every eligible position when there are at most
    ``topk`` (increasing, then -1), else the ``topk`` largest, ``-inf``/NaN below every finite value."""
    r, w = logits.shape
    topk = out.shape[1]
    if r == 0:
        return
    rt = max(1, min(r, ROW_TILE_ELEMS // max(1, w)))
    ar = torch.arange(topk, device=logits.device)
    cols = torch.arange(w, device=logits.device)
    for r0 in range(0, r, rt):
        r1 = min(r, r0 + rt)
        s = clamped_windows(row_starts[r0:r1], row_ends[r0:r1], w)[0]
        elig = eligible_cells(w, row_starts[r0:r1], row_ends[r0:r1], candidates[r0:r1], block_size)
        n = elig.sum(dim=1, keepdim=True)
        k = min(topk, w)
        # at most topk eligible: their positions in increasing order (eligible cells first, stable)
        first = torch.where(elig, cols[None, :], w + cols[None, :]).topk(k, dim=1, largest=False).values
        short = torch.full((r1 - r0, topk), -1, dtype=torch.int64, device=logits.device)
        short[:, :k] = torch.where(ar[None, :k] < n, first - s, -1)
        if w > topk:
            res = torch.where(n > topk, _top_inside(logits[r0:r1], elig, topk) - s, short)
        else:
            res = short
        out[r0:r1] = res.to(torch.int32)
