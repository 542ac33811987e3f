"""Reference ``write_k_cache``: plain torch indexing into the cache's value and scale views."""

from __future__ import annotations

import torch

from ...fp8 import quantize_k
from ...kcache import cache_views


def write_k_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, scale_fmt,
                  fp8_dtype) -> None:
    """See :func:`sparse_indexer.write_k_cache`; ``kv_cache`` is the 3-D view, arguments are checked."""
    s = slot_mapping.shape[0]
    if s == 0:
        return
    values, scales = cache_views(kv_cache, fp8_dtype)
    bs = values.shape[1]
    k_fp8, k_scale = quantize_k(k[:s], fp8_dtype=fp8_dtype, scale_fmt=scale_fmt)
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    blk, off = slots // bs, slots % bs
    values[blk, off] = k_fp8[keep]
    scales[blk, off] = k_scale[keep]
