"""Reference ``fp8_paged_mqa_logits``: gather keys through the block table, exact FP8 emulation, in tiles.

Vectorised over requests and tiled over key positions (no per-request host loop), so the same code runs
under ``torch.func`` transforms.
"""

from __future__ import annotations

import torch

from ...kcache import cache_views, read_keys, read_keys_mxfp4
from ...mxfp4 import mxfp4_scores
from ..fp8_mqa_logits.reference import TILE_ELEMS


def row_limits(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """``limit[b * next_n + j]`` of docs/spec.md §5 (int64, clamped at 0) from ``[B]`` or ``[B, next_n]`` lengths."""
    if context_lens.dim() == 2:
        lim = context_lens.long().reshape(-1)
    else:
        j = torch.arange(next_n, device=context_lens.device)
        lim = (context_lens.long()[:, None] - next_n + j[None, :] + 1).reshape(-1)
    return lim.clamp(min=0)


def _tile_slots(block_table: torch.Tensor, c0: int, c1: int, bs: int, nb: int):
    """Key positions ``[c0, c1)`` of every request: ``(pos [c], blk [B, c] int64, off [1, c])``, the block ids
    read through ``block_table`` and clamped into the cache (positions past a row's limit are masked later)."""
    b, max_blocks = block_table.shape
    pos = torch.arange(c0, c1, device=block_table.device)
    bi = (pos // bs).clamp(max=max(0, max_blocks - 1))
    blk = block_table[:, bi].long().clamp(0, nb - 1) if max_blocks else torch.zeros(
        b, c1 - c0, dtype=torch.long, device=block_table.device)
    return pos, blk, (pos % bs)[None, :]


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, *, out, clean, indices=None,
                         cache_fp8_dtype=None, cache_scale="float32", cache_order="flat", cache_values="fp8",
                         q_scale=None) -> None:
    """See :func:`sparse_indexer.fp8_paged_mqa_logits`; ``kv_cache`` is the 3-D view, arguments are checked.
    Scores are float32; a bfloat16 ``out`` receives them rounded once. ``indices``: entry ``b`` reads
    block-table row ``indices[b]``. ``cache_fp8_dtype``: the cache's values are read in this format (default:
    ``q``'s), each operand upcast exactly from its own format. ``cache_scale``, ``cache_order``: the scale
    encoding and byte order of the cache (``buffers.CacheFormat``), read by :func:`sparse_indexer.kcache.read_keys`.
    ``cache_values="mxfp4"`` with ``q_scale``: MXFP4 queries ``[B, next_n, H, D / 2]`` against an MXFP4 cache
    (docs/spec.md §3a), scored by :func:`sparse_indexer.mxfp4.mxfp4_scores`."""
    b, next_n, h, d = q.shape
    w = out.shape[1]
    if b == 0 or w == 0:
        return
    if indices is not None:
        block_table = block_table.index_select(0, indices.long())
    if cache_values == "mxfp4":
        _mxfp4(q, q_scale, kv_cache, weights, context_lens, block_table, out, clean, cache_order)
        return
    fp8 = q.dtype if cache_fp8_dtype is None else cache_fp8_dtype
    plain = cache_scale == "float32" and cache_order == "flat"
    if plain:
        values, scales = cache_views(kv_cache, fp8)
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    lim = row_limits(context_lens, next_n).view(b, next_n, 1)
    qf = q.float().reshape(b, next_n * h, d)
    wts = weights.view(b, next_n, h)
    ct = max(1, min(w, TILE_ELEMS // max(1, b * next_n * h)))
    for c0 in range(0, w, ct):
        c1 = min(w, c0 + ct)
        pos, blk, off = _tile_slots(block_table, c0, c1, bs, nb)
        if plain:
            k = values[blk, off].float()  # [B, c, D]
            ksc = scales[blk, off]  # [B, c]
        else:
            kb, ksc = read_keys(kv_cache, blk, off.expand_as(blk), fp8, cache_scale, cache_order)
            k = kb.float()
        s = torch.bmm(qf, k.transpose(1, 2)).view(b, next_n, h, c1 - c0).relu_()
        val = (s * wts.unsqueeze(-1)).sum(2) * ksc[:, None, :]  # [B, next_n, c]
        inside = pos.view(1, 1, -1) < lim
        dst = out[:, c0:c1].view(b, next_n, c1 - c0)
        fill = torch.full_like(val, float("-inf")) if clean else dst
        dst.copy_(torch.where(inside, val, fill))


def _mxfp4(q, q_scale, kv_cache, weights, context_lens, block_table, out, clean, order="flat") -> None:
    """MXFP4 queries against an MXFP4 cache: each request's keys read through its block table in column tiles,
    scored by :func:`~sparse_indexer.mxfp4.mxfp4_scores` (one request at a time: its own keys)."""
    b, next_n, h, _ = q.shape
    w = out.shape[1]
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    nblk = q_scale.shape[-1]
    lim = row_limits(context_lens, next_n).view(b, next_n, 1)
    wts = weights.view(b, next_n, h)
    ct = max(1, min(w, TILE_ELEMS // max(1, next_n * h * nblk * 2)))
    for c0 in range(0, w, ct):
        c1 = min(w, c0 + ct)
        pos, blk, off = _tile_slots(block_table, c0, c1, bs, nb)
        off = off.expand_as(blk)
        kv, ks = read_keys_mxfp4(kv_cache, blk, off, order)  # [B, c, D / 2], [B, c, D / 32]
        val = torch.stack([mxfp4_scores(q[i], q_scale[i], kv[i], ks[i], wts[i]) for i in range(b)])  # [B, next_n, c]
        inside = pos.view(1, 1, -1) < lim
        dst = out[:, c0:c1].view(b, next_n, c1 - c0)
        fill = torch.full_like(val, float("-inf")) if clean else dst.float()
        dst.copy_(torch.where(inside, val, fill))
