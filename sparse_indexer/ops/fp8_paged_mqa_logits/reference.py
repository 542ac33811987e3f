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
    """Key positions ``[c0, c1)`` of every request: ``(pos [c], blk [B, c] int64, off [1, c], good [B, c])``, the
    block ids read through ``block_table`` and clamped into the cache, ``good`` where the id read was inside
    ``[0, nb)`` (a key of another id scores as a zero key); positions past a row's limit are masked later."""
    b, max_blocks = block_table.shape
    pos = torch.arange(c0, c1, device=block_table.device)
    bi = (pos // bs).clamp(max=max(0, max_blocks - 1))
    if max_blocks:
        raw = block_table[:, bi].long()
        good = (raw >= 0) & (raw < nb)
        blk = raw.clamp(0, max(0, nb - 1))
    else:
        blk = torch.zeros(b, c1 - c0, dtype=torch.long, device=block_table.device)
        good = torch.zeros(b, c1 - c0, dtype=torch.bool, device=block_table.device)
    return pos, blk, (pos % bs)[None, :], good


def window_limits(context_lens: torch.Tensor, next_n: int, w: int, block_table: torch.Tensor, bs: int,
                  indices: torch.Tensor | None = None) -> torch.Tensor:
    """The row limits a call scores with its values unchecked (docs/spec.md §10), int64 ``[B * next_n]``:
    :func:`row_limits` clamped to ``min(w, max_blocks * bs)``, and 0 for the rows of an entry whose ``indices``
    value is outside ``[0, num_requests)``."""
    lim = row_limits(context_lens, next_n).clamp(max=min(w, block_table.shape[1] * bs))
    if indices is not None:
        ok = (indices >= 0) & (indices < block_table.shape[0])
        lim = torch.where(ok.repeat_interleave(next_n), lim, 0)
    return lim


def _table_rows(block_table: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Block-table row ``indices[b]`` of every entry (row 0, or zeros without rows, where the index is outside
    the table: its window is empty)."""
    nr = block_table.shape[0]
    if nr == 0:
        return torch.zeros(indices.shape[0], block_table.shape[1], dtype=block_table.dtype,
                           device=block_table.device)
    rows = torch.where((indices >= 0) & (indices < nr), indices.long(), 0)
    return block_table.index_select(0, rows)


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, *, out, clean, indices=None,
                         cache_fp8_dtype=None, cache_scale="float32", cache_order="flat", cache_values="fp8",
                         q_scale=None) -> None:
    """See :func:`sparse_indexer.fp8_paged_mqa_logits`; ``kv_cache`` is the 3-D view, arguments are checked.
    Scores are float32; a bfloat16 ``out`` receives them rounded once. ``indices``: entry ``b`` reads
    block-table row ``indices[b]``. ``cache_fp8_dtype``: the cache's values are read in this format (default:
    ``q``'s), each operand upcast exactly from its own format. ``cache_scale``, ``cache_order``: the scale
    encoding and byte order of the cache (``buffers.CacheFormat``), read by :func:`sparse_indexer.kcache.read_keys`.
    ``cache_values="mxfp4"`` with ``q_scale``: MXFP4 queries ``[B, next_n, H, D / 2]`` against an MXFP4 cache
    (docs/spec.md §3a), scored by :func:`sparse_indexer.mxfp4.mxfp4_scores`.

    Values the checks would refuse (docs/spec.md §10) score as the kernels score them: each row's limit clamped
    to ``[0, min(W, max_blocks * block_size)]`` (:func:`window_limits`), a block id outside ``[0, num_blocks)`` a
    zero key (its in-window cells 0), an ``indices`` entry outside ``[0, num_requests)`` an empty window."""
    b, next_n, h, d = q.shape
    w = out.shape[1]
    if b == 0 or w == 0:
        return
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    lim = window_limits(context_lens, next_n, w, block_table, bs, indices).view(b, next_n, 1)
    if indices is not None:
        block_table = _table_rows(block_table, indices)
    if cache_values == "mxfp4":
        _mxfp4(q, q_scale, kv_cache, weights, lim, block_table, out, clean, cache_order)
        return
    fp8 = q.dtype if cache_fp8_dtype is None else cache_fp8_dtype
    plain = cache_scale == "float32" and cache_order == "flat"
    if plain and nb:
        values, scales = cache_views(kv_cache, fp8)
    qf = q.float().reshape(b, next_n * h, d)
    wts = weights.view(b, next_n, h)
    ct = max(1, min(w, TILE_ELEMS // max(1, b * next_n * h)))
    for c0 in range(0, w, ct):
        c1 = min(w, c0 + ct)
        pos, blk, off, good = _tile_slots(block_table, c0, c1, bs, nb)
        if nb == 0:  # no key to read: every in-window cell is a zero key's
            val = torch.zeros(b, next_n, c1 - c0, device=out.device)
        else:
            if plain:
                k = values[blk, off].float()  # [B, c, D]
                ksc = scales[blk, off]  # [B, c]
            else:
                kb, ksc = read_keys(kv_cache, blk, off.expand_as(blk), fp8, cache_scale, cache_order)
                k = kb.float()
            s = torch.bmm(qf, k.transpose(1, 2)).view(b, next_n, h, c1 - c0).relu_()
            val = (s * wts.unsqueeze(-1)).sum(2) * ksc[:, None, :]  # [B, next_n, c]
            val = torch.where(good[:, None, :], val, 0.0)
        inside = pos.view(1, 1, -1) < lim
        dst = out[:, c0:c1].view(b, next_n, c1 - c0)
        fill = torch.full_like(val, float("-inf")) if clean else dst
        dst.copy_(torch.where(inside, val, fill))


def _mxfp4(q, q_scale, kv_cache, weights, lim, block_table, out, clean, order="flat") -> None:
    """MXFP4 queries against an MXFP4 cache: each request's keys read through its block table in column tiles,
    scored by :func:`~sparse_indexer.mxfp4.mxfp4_scores` (one request at a time: its own keys); ``lim [B, next_n,
    1]`` the rows' limits (:func:`window_limits`)."""
    b, next_n, h, _ = q.shape
    w = out.shape[1]
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    nblk = q_scale.shape[-1]
    wts = weights.view(b, next_n, h)
    ct = max(1, min(w, TILE_ELEMS // max(1, next_n * h * nblk * 2)))
    for c0 in range(0, w, ct):
        c1 = min(w, c0 + ct)
        pos, blk, off, good = _tile_slots(block_table, c0, c1, bs, nb)
        if nb == 0:  # no key to read: every in-window cell is a zero key's
            val = torch.zeros(b, next_n, c1 - c0, device=out.device)
        else:
            off = off.expand_as(blk)
            kv, ks = read_keys_mxfp4(kv_cache, blk, off, order)  # [B, c, D / 2], [B, c, D / 32]
            val = torch.stack([mxfp4_scores(q[i], q_scale[i], kv[i], ks[i], wts[i])
                               for i in range(b)])  # [B, next_n, c]
            val = torch.where(good[:, None, :], val, 0.0)
        inside = pos.view(1, 1, -1) < lim
        dst = out[:, c0:c1].view(b, next_n, c1 - c0)
        fill = torch.full_like(val, float("-inf")) if clean else dst.float()
        dst.copy_(torch.where(inside, val, fill))
