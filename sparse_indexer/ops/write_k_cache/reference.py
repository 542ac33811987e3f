"""Reference ``write_k_cache``: plain torch indexing into the cache's value and scale views."""

from __future__ import annotations

import torch

from ...fp8 import quantize_k
from ...kcache import cache_views, write_keys, write_keys_mxfp4
from ...mxfp4 import quantize_k_mxfp4


def write_k_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, scale_fmt,
                  fp8_dtype, cache_scale="float32", cache_order="flat", cache_values="fp8") -> None:
    """See :func:`sparse_indexer.write_k_cache`; ``kv_cache`` is the 3-D view, arguments are checked.
    ``cache_scale``, ``cache_order``: the scale encoding and byte order to store (``buffers.CacheFormat``;
    ``"ue8m0x4"`` only with power-of-two scales, checked by the public function); ``cache_values="mxfp4"``: MXFP4
    keys (docs/spec.md §3a; ``scale_fmt`` and ``fp8_dtype`` do not apply). A slot outside ``[0, num_blocks *
    block_size)`` skips its row (with value checks off, one past the cache is the caller's bug, not a write)."""
    s = slot_mapping.shape[0]
    if s == 0:
        return
    slots = slot_mapping.long()
    nb, bs = kv_cache.shape[:2]
    keep = (slots >= 0) & (slots < nb * bs)
    if cache_values == "mxfp4":
        vals, scales = quantize_k_mxfp4(k[:s])
        write_keys_mxfp4(kv_cache, slots[keep] // bs, slots[keep] % bs, vals[keep], scales[keep], cache_order)
        return
    values, scales = cache_views(kv_cache, fp8_dtype)
    k_fp8, k_scale = quantize_k(k[:s], fp8_dtype=fp8_dtype, scale_fmt=scale_fmt)
    slots = slots[keep]
    blk, off = slots // bs, slots % bs
    if cache_scale == "float32" and cache_order == "flat":
        values[blk, off] = k_fp8[keep]
        scales[blk, off] = k_scale[keep]
    else:
        write_keys(kv_cache, blk, off, k_fp8[keep], k_scale[keep], cache_scale, cache_order)
