"""Reference ``select_candidate_blocks``: float64 block maxima and ``torch.topk`` on rank keys (docs/spec.md §6a).

Block ``j`` of row ``r`` covers the window cells ``[s + j*b, s + (j+1)*b) ∩ [s, e)``. Its rank key: the newest
block (the one holding ``e - 1``) ``+inf``; a block holding a NaN ``-1e300`` (below every float32, above an
excluded block); a block whose cells are all ``-inf`` ``-inf`` (never a candidate); a block whose maximum is
``+inf`` ``1e300`` (just below the pinned one); any other its float64 maximum. Windows are clamped as the
kernels clamp them when values are not checked: starts to ``>= 0``, ends to ``<= W``.
"""

from __future__ import annotations

import torch

ROW_TILE_ELEMS = 1 << 23

PINNED = float("inf")
POS_INF = 1e300
NAN_KEY = -1e300


def block_keys(logits: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor,
               block_size: int) -> torch.Tensor:
    """``[R, ceil(W / b)]`` float64 rank keys of every block of every window (``-inf`` past the window)."""
    r, w = logits.shape
    nb = -(-w // block_size)
    s = row_starts.long().clamp(min=0)[:, None]  # windows clamped into [0, W] (the kernels' clamp, §10)
    n = (row_ends.long().clamp(max=w)[:, None] - s).clamp(min=0)
    c = torch.arange(nb * block_size, device=logits.device)[None, :]
    inside = c < n
    x = logits.gather(1, (s + c).clamp(0, max(w - 1, 0))).double()
    x = torch.where(inside, x, torch.full_like(x, float("-inf"))).view(r, nb, block_size)
    nan = torch.isnan(x).any(dim=2)
    mx = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x).amax(dim=2)
    key = torch.where(mx == float("inf"), torch.full_like(mx, POS_INF), mx)
    key = torch.where(nan, torch.full_like(key, NAN_KEY), key)
    newest = torch.arange(nb, device=logits.device)[None, :] == (n - 1) // block_size
    return torch.where(newest & (n > 0), torch.full_like(key, PINNED), key)


def select_candidate_blocks(logits, row_starts, row_ends, *, out, block_size) -> None:
    """See :func:`sparse_indexer.select_candidate_blocks`; arguments are checked."""
    r, w = logits.shape
    kb = out.shape[1]
    if r == 0:
        return
    if w == 0:
        out.fill_(-1)
        return
    nb = -(-w // block_size)
    rt = max(1, min(r, ROW_TILE_ELEMS // max(1, nb * block_size)))
    k = min(kb, nb)
    for r0 in range(0, r, rt):
        r1 = min(r, r0 + rt)
        key = block_keys(logits[r0:r1], row_starts[r0:r1], row_ends[r0:r1], block_size)
        top = torch.topk(key, k, dim=1, sorted=True)
        ids = torch.where(top.values == float("-inf"), -1, top.indices)
        res = torch.full((r1 - r0, kb), -1, dtype=torch.int64, device=logits.device)
        res[:, :k] = ids
        out[r0:r1] = res.to(torch.int32)
