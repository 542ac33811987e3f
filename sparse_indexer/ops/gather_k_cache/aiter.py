"""aiter backend of ``gather_k_cache``: un-shuffles a preshuffled cache (see ``write_k_cache/aiter.py``) into
contiguous rows; a plain-layout cache is gathered as the reference does. Pure torch."""

from __future__ import annotations

import torch

from .._aiter import gcn_arch, preshuffle_offsets, preshuffled, raw_blocks
from . import reference

__all__ = ["gather_k_cache", "gather_k_cache_preshuffled"]


def gather_k_cache_preshuffled(kv_cache, block_table, cu_seq_lens, *, out_k, out_scale) -> None:
    """docs/spec.md §4 gather from a preshuffled cache (``kv_cache`` 3-D, arguments checked)."""
    r = block_table.shape[0]
    total = int(cu_seq_lens[-1]) if r else 0
    if total == 0:
        return
    raw, scales = raw_blocks(kv_cache)
    bs, d = kv_cache.shape[1], out_k.shape[1]
    offs = preshuffle_offsets(bs, d, out_k.device)
    t = torch.arange(total, device=out_k.device)
    req = torch.searchsorted(cu_seq_lens[1:].long(), t, right=True)
    pos = t - cu_seq_lens.long()[req]
    blk = block_table.long()[req, pos // bs]
    off = pos % bs
    out_k[:total] = raw[blk[:, None], offs[off]].view(out_k.dtype)
    out_scale[:total] = scales[blk, off]


def gather_k_cache(kv_cache, block_table, cu_seq_lens, *, out_k, out_scale, cache_scale="float32",
                   cache_order="flat", cache_values="fp8") -> None:
    """See :func:`sparse_indexer.gather_k_cache`. A declared format (``cache_scale``, ``cache_order``) is read
    only where it is this backend's own: float32 scales, and the preshuffled order exactly where
    :func:`preshuffled` says so; anything else raises ``NotImplementedError`` (auto falls back)."""
    if cache_values != "fp8":
        raise NotImplementedError("the aiter backend does not read or write MXFP4 caches (docs/spec.md §3a)")
    shuffle = preshuffled(kv_cache.shape[1], out_k.dtype, gcn_arch(kv_cache.device))
    if cache_scale != "float32":
        raise NotImplementedError(f"the aiter gather_k_cache reads float32 scales, not {cache_scale!r}")
    if cache_order == "preshuffled" and not shuffle:
        raise NotImplementedError("the aiter gather_k_cache reads the preshuffled order only where its paged kernel "
                                  "does (gfx942 e4m3fnuz / gfx950 e4m3fn, block_size a multiple of 16)")
    if shuffle:
        gather_k_cache_preshuffled(kv_cache, block_table, cu_seq_lens, out_k=out_k, out_scale=out_scale)
    else:
        reference.gather_k_cache(kv_cache, block_table, cu_seq_lens, out_k=out_k, out_scale=out_scale)
