"""aiter backend of ``write_k_cache`` (the cache layout every aiter op agrees on: :mod:`sparse_indexer.ops._aiter`).

aiter's gfx942/gfx950 paged-logits kernel (``deepgemm_fp8_paged_mqa_logits``) reads a *preshuffled* cache when
the block size is a multiple of 16: the value region of each block in 16x16-byte tiles, value byte of (token t,
dim d) at ``(t // 16) * 16 * D + (d // 16) * 256 + (t % 16) * 16 + (d % 16)``; scales unchanged. Under
``backend="aiter"`` the cache is preshuffled exactly when :func:`preshuffled` says so (gfx942 with
e4m3fnuz or gfx950 with e4m3fn, block size a multiple of 16), and the aiter ``write_k_cache``,
``gather_k_cache`` and ``fp8_paged_mqa_logits`` all use that rule, so a cache must be written and read by the
aiter backend throughout. Elsewhere the layout is docs/spec.md §4's plain one, and the aiter paged kernel raising
``NotImplementedError`` (auto then falls back to Triton) is safe.

The writer is pure torch (quantize, then scatter to the preshuffled byte offsets): it runs on any device and
is tested on the CPU against the reference.
"""

from __future__ import annotations

import torch

from ...fp8 import quantize_k
from .._aiter import gcn_arch, preshuffle_offsets, preshuffled, raw_blocks
from . import reference

__all__ = ["write_k_cache", "write_k_cache_preshuffled"]

def write_k_cache_preshuffled(k, kv_cache, slot_mapping, *, scale_fmt, fp8_dtype) -> None:
    """docs/spec.md §3 quantization, stored in the preshuffled layout (``kv_cache`` 3-D, arguments checked)."""
    s = slot_mapping.shape[0]
    if s == 0:
        return
    raw, scales = raw_blocks(kv_cache)
    bs, d = kv_cache.shape[1], k.shape[1]
    offs = preshuffle_offsets(bs, d, k.device)
    k_fp8, k_scale = quantize_k(k[:s], fp8_dtype=fp8_dtype, scale_fmt=scale_fmt)
    slots = slot_mapping.long()
    keep = slots >= 0
    slots = slots[keep]
    blk, off = slots // bs, slots % bs
    raw[blk[:, None], offs[off]] = k_fp8[keep].view(torch.uint8)
    scales[blk, off] = k_scale[keep]


def write_k_cache(k, kv_cache, slot_mapping, *, scale_fmt, fp8_dtype, cache_scale="float32",
                  cache_order="flat", cache_values="fp8") -> None:
    """See :func:`sparse_indexer.write_k_cache`; preshuffled when :func:`preshuffled` says so. A declared format is
    written only where it is this backend's own (float32 scales; the preshuffled order exactly where
    :func:`preshuffled` says so); anything else raises ``NotImplementedError`` (auto falls back)."""
    if cache_values != "fp8":
        raise NotImplementedError("the aiter backend does not store MXFP4 keys (docs/spec.md §3a)")
    shuffle = preshuffled(kv_cache.shape[1], fp8_dtype, gcn_arch(kv_cache.device))
    if cache_scale != "float32" or (cache_order == "preshuffled" and not shuffle):
        raise NotImplementedError(f"the aiter write_k_cache writes float32 scales, preshuffled only on gfx942/gfx950 "
                                  f"in their FP8 format: got {cache_scale!r}, {cache_order!r}")
    if shuffle:
        write_k_cache_preshuffled(k, kv_cache, slot_mapping, scale_fmt=scale_fmt, fp8_dtype=fp8_dtype)
    else:
        reference.write_k_cache(k, kv_cache, slot_mapping, scale_fmt=scale_fmt, fp8_dtype=fp8_dtype)
