"""Reference ``top_k_per_row``: ``torch.topk`` on float64 keys that rank out-of-window cells last.

In-window values keep their order; in-window ``-inf``/NaN become ``-1e300`` (below every float32, above the
``-inf`` given to cells outside the window), so a row with more than ``topk`` cells never selects outside.
"""

from __future__ import annotations

import torch

ROW_TILE_ELEMS = 1 << 24


def top_k_per_row(logits, row_starts, row_ends, *, out) -> None:
    """See :func:`sparse_indexer.top_k_per_row`; arguments are checked."""
    r, w = logits.shape
    topk = out.shape[1]
    if r == 0:
        return
    rt = max(1, min(r, ROW_TILE_ELEMS // max(1, w)))
    cols = torch.arange(w, device=logits.device)
    ar = torch.arange(topk, device=logits.device)
    for r0 in range(0, r, rt):
        r1 = min(r, r0 + rt)
        s = row_starts[r0:r1, None].long()
        e = row_ends[r0:r1, None].long()
        n = (e - s).clamp(min=0)
        short = torch.where(ar[None, :] < n, ar[None, :], -1)  # [rows, topk]
        if w >= topk:
            x = logits[r0:r1].double()
            x = torch.where(torch.isnan(x) | (x == float("-inf")), torch.full_like(x, -1e300), x)
            inside = (cols[None, :] >= s) & (cols[None, :] < e)
            x = torch.where(inside, x, torch.full_like(x, float("-inf")))
            idx = torch.topk(x, topk, dim=1, sorted=False).indices - s
            res = torch.where(n > topk, idx, short)
        else:  # every window is shorter than topk
            res = short
        out[r0:r1] = res.to(torch.int32)
