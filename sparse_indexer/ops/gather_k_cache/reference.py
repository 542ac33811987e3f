"""Reference ``gather_k_cache``: index the cache's value and scale views with each row's slot."""

from __future__ import annotations

import torch

from ...kcache import cache_views, read_keys, read_keys_mxfp4


def gather_k_cache(kv_cache, block_table, cu_seq_lens, *, out_k, out_scale, cache_scale="float32",
                   cache_order="flat", cache_values="fp8") -> None:
    """See :func:`sparse_indexer.gather_k_cache`; ``kv_cache`` is the 3-D view, arguments are checked.
    ``cache_scale``, ``cache_order``: the cache's scale encoding and byte order (``buffers.CacheFormat``); the
    output is always the plain one (values in token order, float32 scales). ``cache_values="mxfp4"``: MXFP4 keys
    (docs/spec.md §3a), copied as they are (``out_k [N, D / 2]``, ``out_scale [N, D / 32]`` uint8).

    Values the checks would refuse (value checks off): request ``r`` has ``clamp(cu_seq_lens[r + 1] -
    cu_seq_lens[r], 0, max_blocks * block_size)`` keys (a decreasing ``cu_seq_lens`` gives an empty request;
    positions past the block table's row are not read and their rows not written), rows outside ``[0, N)`` are not
    written, and a block id outside ``[0, num_blocks)`` reads as a zero key (value bytes 0, scale 0)."""
    r, max_blocks = block_table.shape
    if r == 0:
        return
    nb, bs = kv_cache.shape[:2]
    dev = out_k.device
    cu = cu_seq_lens.long()
    lens = (cu[1:] - cu[:-1]).clamp(0, max_blocks * bs)
    total = int(lens.sum())
    if total == 0:
        return
    req = torch.repeat_interleave(torch.arange(r, device=dev), lens)  # request of each gathered key
    pos = torch.arange(total, device=dev) - (lens.cumsum(0) - lens)[req]  # request-local position
    row = cu[req] + pos
    keep = (row >= 0) & (row < out_k.shape[0])
    req, pos, row = req[keep], pos[keep], row[keep]
    blk = block_table.long()[req, pos // bs]
    off = pos % bs
    valid = (blk >= 0) & (blk < nb)
    blk = torch.where(valid, blk, 0)
    if nb == 0:  # (no block to read: every key is a zero key)
        out_k.view(torch.uint8)[row] = 0
        out_scale[row] = 0
        return
    if cache_values == "mxfp4":
        vals, scales = read_keys_mxfp4(kv_cache, blk, off, cache_order)
    elif cache_scale == "float32" and cache_order == "flat":
        values, scales = cache_views(kv_cache, out_k.dtype)
        vals, scales = values[blk, off], scales[blk, off]
    else:
        vals, scales = read_keys(kv_cache, blk, off, out_k.dtype, cache_scale, cache_order)
    bad = ~valid
    vals.view(torch.uint8)[bad] = 0
    scales[bad] = 0
    out_k[row] = vals
    out_scale[row] = scales
