"""Triton ``gather_k_cache``: copy each request's paged keys and scales into the dense workspace (docs/spec.md §4).

The grid is ``(token tiles, requests)``: program ``(j, r)`` copies request-local tokens
``[j * BLOCK_T, (j + 1) * BLOCK_T)`` of request ``r`` (when they exist; otherwise it exits at once), so the
host never reads ``cu_seq_lens``. Values move as 32-bit words (``D / 4`` per token, 16-byte vectors), scales
as float32; byte offsets are int64.

Hostile values (value checks off) cost two scalar clamps per program and one compare per token, folded into the
existing masks: a request's length is clamped to ``[0, max_blocks * block_size]`` (a decreasing ``cu_seq_lens``
gives an empty request; positions past the block table's row are neither read from it nor written), output rows
outside ``[0, N)`` are not written, and a block id outside ``[0, num_blocks)`` reads as a zero key (value bytes 0,
scale 0; MXFP4: value and scale bytes 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._runtime.launch import Launcher
from ..._runtime.triton_compat import fix_interpreter
from .._mxfp4_triton import scale_offset, tile_constants, value_offset
from ..fp8_paged_mqa_logits.triton import _ue8m0

fix_interpreter()  # Triton 3.6's interpreter under NumPy >= 2.4 (sparse_indexer/_runtime/triton_compat.py)

__all__ = ["gather_k_cache"]

_BLOCK_T = 64
_MAX_GRID_Y = 65535


@triton.jit
def _gather_k_cache_kernel(
    out_k_ptr,  # [N, D / 4] int32 (word view of the fp8 out_k)
    out_scale_ptr,  # [N] float32
    cache_ptr,  # [num_blocks * block_stride] uint8 (byte view of the 3-D cache)
    bt_ptr,  # [R, max_blocks] int32, row stride bt_stride
    cu_ptr,  # [R + 1] int32
    bt_stride,
    block_stride,  # bytes between blocks, a multiple of 4
    num_blocks,  # a block id outside [0, num_blocks) reads as a zero key
    cap,  # max_blocks * BS: the most keys a block table row holds
    N,  # rows of out_k: rows outside [0, N) are never written
    BS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    UE8M0: tl.constexpr,  # key scales as 4 UE8M0 bytes (the "ue8m0x4" encoding), written out as float32
    MX: tl.constexpr = False,  # MXFP4 keys (docs/spec.md §3a): D / 2 value bytes (out_k [N, D / 8] int32 words)
    # and D / 32 scale bytes per key (out_scale [N, D / 32] uint8), copied as they are
    VB: tl.constexpr = 0,  # value bytes per key (D, or D / 2 with MX); the scale region starts at BS * VB
    TN: tl.constexpr = 1,  # MX: the byte order's runs of TN keys, TC-byte value chunks, TL scale lanes (flat: 1s)
    TC: tl.constexpr = 1,
    TL: tl.constexpr = 1,
):
    j = tl.program_id(0)
    r = tl.program_id(1)
    beg = tl.load(cu_ptr + r).to(tl.int64)
    # the request's positions [p_lo, n): at most the block table's row, only those landing in rows [0, N)
    n = tl.minimum(tl.minimum(tl.load(cu_ptr + r + 1).to(tl.int64) - beg, cap), N - beg)
    p_lo = tl.maximum(-beg, 0)
    if (j * BLOCK_T < n) & ((j + 1) * BLOCK_T > p_lo):
        DW: tl.constexpr = VB // 4
        p = j * BLOCK_T + tl.arange(0, BLOCK_T)
        pm = (p < n) & (p >= p_lo)
        blk = tl.load(bt_ptr + r.to(tl.int64) * bt_stride + p // BS, mask=pm, other=0).to(tl.int64)
        bm = pm & (blk >= 0) & (blk < num_blocks)  # (a block id outside the cache: a zero key)
        off = p % BS
        base = blk * block_stride  # bytes
        words = cache_ptr.to(tl.pointer_type(tl.int32))
        w = tl.arange(0, DW)
        if MX:  # (word w holds value bytes 4w..4w+3: one chunk, TC a multiple of 4 or TN = 1)
            vals = tl.load(words + (base[:, None] + value_offset(off[:, None], 4 * w[None, :], VB, TN, TC)) // 4,
                           mask=bm[:, None], other=0)
        else:
            vals = tl.load(words + (base // 4 + off * DW)[:, None] + w[None, :], mask=bm[:, None], other=0)
        row = beg + p
        tl.store(out_k_ptr + row[:, None] * DW + w[None, :], vals, mask=pm[:, None])
        if MX:
            SB: tl.constexpr = D // 32
            sb = tl.arange(0, SB)
            sc = tl.load(cache_ptr + base[:, None] + scale_offset(off[:, None], sb[None, :], BS, VB, SB, TN, TL),
                         mask=bm[:, None], other=0)
            tl.store(out_scale_ptr + row[:, None] * SB + sb[None, :], sc, mask=pm[:, None])
        elif UE8M0:
            sw = tl.load((cache_ptr + base + BS * VB + off * 4).to(tl.pointer_type(tl.int32)), mask=bm, other=0)
            tl.store(out_scale_ptr + row, tl.where(bm, _ue8m0(sw), 0.0), mask=pm)
        else:
            sptr = (cache_ptr + base + BS * VB + off * 4).to(tl.pointer_type(tl.float32))
            tl.store(out_scale_ptr + row, tl.load(sptr, mask=bm, other=0.0), mask=pm)


_LAUNCH = Launcher(_gather_k_cache_kernel)
_CONFIGS: dict = {}  # (block_size, D, ue8m0, mxfp4, cache order) -> LaunchConfig


def gather_k_cache(kv_cache, block_table, cu_seq_lens, *, out_k, out_scale, cache_scale="float32",
                   cache_order="flat", cache_values="fp8") -> None:
    """See :func:`sparse_indexer.gather_k_cache`; ``kv_cache`` is the 3-D view, arguments are checked.
    ``cache_scale``: float32 or ``"ue8m0x4"`` (decoded exactly into float32 ``out_scale``); the preshuffled order
    raises ``NotImplementedError``. ``cache_values="mxfp4"``: MXFP4 keys, their bytes copied (``out_k [N, D / 2]``,
    ``out_scale [N, D / 32]`` uint8)."""
    mx = cache_values == "mxfp4"
    if cache_order != "flat" and not mx:
        raise NotImplementedError(f"the Triton gather_k_cache reads the flat order, not {cache_order!r}")
    ue8m0 = cache_scale == "ue8m0x4"
    r, max_blocks = block_table.shape
    nb, bs, width = kv_cache.shape
    d = width * 32 // 17 if mx else width - 4
    tiles = tile_constants(cache_order, bs, d, "the Triton gather_k_cache") if mx else {}
    if tiles and tiles["TN"] > 1 and tiles["TC"] % 4:
        raise NotImplementedError(f"the Triton gather_k_cache copies MXFP4 values in 4-byte words: the order "
                                  f"{cache_order!r} splits them")
    if d & (d - 1):
        raise NotImplementedError(f"the Triton gather_k_cache needs a power-of-two head dim, got D={d}")
    if r > _MAX_GRID_Y:
        raise NotImplementedError(f"the Triton gather_k_cache handles at most {_MAX_GRID_Y} requests, got {r}")
    if r == 0 or max_blocks == 0:
        return
    # CacheLayout.block_stride of the checked view
    block_stride = kv_cache.stride()[0] if nb > 1 else -(-bs * width // 4) * 4
    key = (bs, d, ue8m0, mx, cache_order)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = _LAUNCH.config(BS=bs, D=d, BLOCK_T=_BLOCK_T, UE8M0=ue8m0, MX=mx, VB=d // 2 if mx else d,
                                             num_warps=4, **tiles)
    _LAUNCH.launch_with((triton.cdiv(max_blocks * bs, _BLOCK_T), r), cfg,
                        (out_k.view(torch.int32), out_scale, kv_cache, block_table, cu_seq_lens,
                         block_table.stride()[0], block_stride, nb, max_blocks * bs, out_k.shape[0]), 5)
