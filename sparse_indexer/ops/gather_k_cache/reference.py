"""Reference ``gather_k_cache``: index the cache's value and scale views with each row's slot."""

from __future__ import annotations

import torch

from ...kcache import cache_views, read_keys, read_keys_mxfp4


def gather_k_cache(kv_cache, block_table, cu_seq_lens, *, out_k, out_scale, cache_scale="float32",
                   cache_order="flat", cache_values="fp8") -> None:
    """See :func:`sparse_indexer.gather_k_cache`; ``kv_cache`` is the 3-D view, arguments are checked.
    ``cache_scale``, ``cache_order``: the cache's scale encoding and byte order (``buffers.CacheFormat``); the
    output is always the plain one (values in token order, float32 scales). ``cache_values="mxfp4"``: MXFP4 keys
    (docs/spec.md §3a), copied as they are (``out_k [N, D / 2]``, ``out_scale [N, D / 32]`` uint8)."""
    r = block_table.shape[0]
    total = int(cu_seq_lens[-1]) if r else 0
    if total == 0:
        return
    bs = kv_cache.shape[1]
    t = torch.arange(total, device=out_k.device)
    req = torch.searchsorted(cu_seq_lens[1:].long(), t, right=True)  # request of each row
    pos = t - cu_seq_lens.long()[req]  # request-local position
    blk = block_table.long()[req, pos // bs]
    off = pos % bs
    if cache_values == "mxfp4":
        out_k[:total], out_scale[:total] = read_keys_mxfp4(kv_cache, blk, off, cache_order)
    elif cache_scale == "float32" and cache_order == "flat":
        values, scales = cache_views(kv_cache, out_k.dtype)
        out_k[:total] = values[blk, off]
        out_scale[:total] = scales[blk, off]
    else:
        out_k[:total], out_scale[:total] = read_keys(kv_cache, blk, off, out_k.dtype, cache_scale, cache_order)
