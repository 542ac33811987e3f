"""Reference ``gather_k_cache``: index the cache's value and scale views with each row's slot."""

from __future__ import annotations

import torch

from ...kcache import cache_views


def gather_k_cache(kv_cache, block_table, cu_seq_lens, *, out_k, out_scale) -> None:
    """See :func:`sparse_indexer.gather_k_cache`; ``kv_cache`` is the 3-D view, arguments are checked."""
    r = block_table.shape[0]
    total = int(cu_seq_lens[-1]) if r else 0
    if total == 0:
        return
    values, scales = cache_views(kv_cache, out_k.dtype)
    bs = values.shape[1]
    t = torch.arange(total, device=out_k.device)
    req = torch.searchsorted(cu_seq_lens[1:].long(), t, right=True)  # request of each row
    pos = t - cu_seq_lens.long()[req]  # request-local position
    blk = block_table.long()[req, pos // bs]
    off = pos % bs
    out_k[:total] = values[blk, off]
    out_scale[:total] = scales[blk, off]
