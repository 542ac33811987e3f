"""Triton ``select_candidate_blocks``: block maxima into the workspace, then an exact radix select (docs/spec.md §6a).

One program per row. Pass 1 reads the window once in tiles of ``[blocks, b]`` cells and stores each block's
uint32 rank key in the workspace row (0: all ``-inf``, never a candidate; 1: holds a NaN; the order-preserving
key of its maximum otherwise; ``0xFFFFFFFF``: the newest block), building the histogram of the keys' top 8
bits. Three more passes over the keys (8-bit digits, ``sparse_indexer.ops.top_k_per_row.triton.radix_digit``)
find the ``K_b``-th largest key exactly, and one last pass writes the ids above it and as many equal ones as
needed (no ties are split wrongly: any of the equal ones is a correct answer), then -1.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..._runtime.launch import Launcher
from ..._runtime.triton_compat import fix_interpreter
from ..top_k_per_row.triton import (
    RADIX_BINS,
    RADIX_BITS,
    _sort_key,
    _window,
    compact_tile,
    fill_rest,
    masked_hist,
    radix_digit,
)

fix_interpreter()

__all__ = ["select_candidate_blocks"]

CELLS = 4096  # logits cells per tile of the first pass
KEYS = 4096  # keys per tile of the later passes
NUM_WARPS = 8


@triton.jit
def _key_hist(wrow, nv, prefix, SHIFT_HI: tl.constexpr, SHIFT: tl.constexpr, NB: tl.constexpr, KEYS: tl.constexpr):
    offs = tl.arange(0, KEYS)
    hist = tl.zeros([NB], tl.int32)
    for i in range(0, nv, KEYS):
        o = i + offs
        m = o < nv
        key = tl.load(wrow + o, mask=m, other=0).to(tl.uint32, bitcast=True)
        hist += masked_hist(key, m & ((key >> SHIFT_HI) == (prefix >> SHIFT_HI)), SHIFT, NB, KEYS)
    return hist


@triton.jit
def _select_blocks_kernel(out_ptr, logits_ptr, starts_ptr, ends_ptr, ws_ptr, stride_l, stride_o, stride_w, kb,
                          width, BS: tl.constexpr, BP: tl.constexpr, TB: tl.constexpr, NB: tl.constexpr,
                          KEYS: tl.constexpr, DB: tl.constexpr):
    row = tl.program_id(0)
    start, n = _window(starts_ptr, ends_ptr, row, width)  # clamped into [0, W): nv <= ceil(W / b)
    nv = (n + BS - 1) // BS
    newest = (n - 1) // BS
    base = logits_ptr + row.to(tl.int64) * stride_l + start
    wrow = ws_ptr + row.to(tl.int64) * stride_w
    orow = out_ptr + row.to(tl.int64) * stride_o
    bi = tl.arange(0, TB)
    oi = tl.arange(0, BP)
    hist = tl.zeros([NB], tl.int32)
    nz = n * 0
    for b0 in range(0, nv, TB):
        blk = b0 + bi
        col = blk[:, None] * BS + oi[None, :]
        m = (oi[None, :] < BS) & (col < n)
        x = tl.load(base + col, mask=m, other=float("-inf")).to(tl.float32)
        isnan = x != x
        mx = tl.max(tl.where(isnan, float("-inf"), x), 1)
        key = _sort_key(mx)
        key = tl.where(tl.max(isnan.to(tl.int32), 1) > 0, 1, key).to(tl.uint32)
        key = tl.where(blk == newest, tl.full([TB], 0xFFFFFFFF, tl.uint32), key)
        valid = blk < nv
        key = tl.where(valid, key, 0).to(tl.uint32)
        tl.store(wrow + blk, key.to(tl.int32, bitcast=True), mask=valid)
        hist += tl.histogram((key >> (32 - DB)).to(tl.int32), NB)
        nz += tl.sum((key != 0).to(tl.int32), 0)
    thr = tl.zeros((), tl.uint32)  # at most K_b candidates: every key > 0
    need_eq = n * 0
    if nz > kb:
        krem = kb
        prefix = tl.zeros((), tl.uint32)
        for p in tl.static_range(32 // DB):
            if p > 0:
                hist = _key_hist(wrow, nv, prefix, 32 - DB * p, 32 - DB * (p + 1), NB, KEYS)
            d, krem = radix_digit(hist, krem, NB)
            prefix = prefix | (d.to(tl.uint32) << (32 - DB * (p + 1)))
        thr = prefix
        need_eq = krem
    k = tl.minimum(nz, kb)
    n_gt = k - need_eq
    ng = n * 0
    neq = n * 0
    offs = tl.arange(0, KEYS)
    for i in range(0, nv, KEYS):
        o = i + offs
        key = tl.load(wrow + o, mask=o < nv, other=0).to(tl.uint32, bitcast=True)
        ng, neq = compact_tile(orow, key, o, thr, need_eq, n_gt, ng, neq)
    fill_rest(orow, k, kb, 1024)


_SELECT = Launcher(_select_blocks_kernel)


@functools.lru_cache(maxsize=64)
def _cfg(block_size: int):
    bp = triton.next_power_of_2(block_size)
    return _SELECT.config(BS=block_size, BP=bp, TB=max(1, CELLS // bp), NB=RADIX_BINS, KEYS=KEYS, DB=RADIX_BITS,
                          num_warps=NUM_WARPS)


def select_candidate_blocks(logits, row_starts, row_ends, *, out, block_size, workspace=None) -> None:
    """See :func:`sparse_indexer.select_candidate_blocks`; arguments are checked."""
    r, w = logits.shape
    if r == 0:
        return
    if triton.next_power_of_2(block_size) > CELLS:
        raise NotImplementedError(f"candidate blocks of {block_size} positions (the Triton kernel takes <= {CELLS})")
    if workspace is None:  # (a call outside the step; the step passes Buffers.block_scores)
        workspace = torch.empty(r, max(1, -(-w // block_size)), dtype=torch.int32, device=logits.device)
    _SELECT.launch_with((r,), _cfg(block_size),
                        (out, logits, row_starts, row_ends, workspace, logits.stride(0), out.stride(0),
                         workspace.stride(0), out.shape[1], w), 5)
