"""Triton kernels of the context-parallel merge (:func:`sparse_indexer.parallel.merge_topk`, docs/spec.md §11).

Two elementwise kernels replace the ~25 small torch ops (and their ``rows x topk`` temporaries) the merge made
around its all-gather and its top-k; both write only views of ``Buffers.cp_scratch`` and ``sel``:

- :func:`pack`: one program per ``(row, BLOCK columns)`` turns the local top-k ``sel`` (local positions relative
  to the row's window start, ``-1`` padding) into the candidates: the logit each position selected as float32
  (an in-window ``-inf``/NaN as the lowest finite float32, padding ``-inf``) and its request-local global
  position (block-interleaved sharding: ``p + (p // bs) * (W - 1) * bs + rank * bs``; padding ``-1``); program
  column 0 also writes the merge's window bounds ``[0, W * topk)``.
- :func:`unpack`: after the top-k over the ``W * topk`` gathered values of each row (``col``: column indices),
  reads each selected candidate's global position straight from the all-gather's output (candidate ``c`` of row
  ``r`` came from rank ``c // topk``, its slot ``c % topk``: no transposed copy of the positions) into ``sel``;
  a row whose global window has ``n <= topk`` keys is written ``0..n-1, -1, ...`` (the single-device order).

Launched through :class:`~sparse_indexer._runtime.launch.Launcher` (a few microseconds of host time each), on the
current stream, no host read of device values: CUDA-graph capturable. Under ``TRITON_INTERPRET=1`` they run on
CPU tensors (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._runtime.launch import Launcher
from .._runtime.triton_compat import fix_interpreter

fix_interpreter()  # Triton 3.6's interpreter under NumPy >= 2.4 (sparse_indexer/_runtime/triton_compat.py)

__all__ = ["pack", "unpack"]

_LOW = -3.4028234663852886e38  # torch.finfo(torch.float32).min
_BLOCK = 1024


@triton.jit
def _pack_kernel(sel_ptr, logits_ptr, starts_ptr, vals_ptr, pos_ptr, bounds_ptr, stride_s, stride_l, topk, rank,
                 world, bs, rows, LOW: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    jb = tl.program_id(1)
    j = jb * BLOCK + tl.arange(0, BLOCK)
    inb = j < topk
    p = tl.load(sel_ptr + r.to(tl.int64) * stride_s + j, mask=inb, other=-1)
    ok = inb & (p >= 0)
    start = tl.load(starts_ptr + r)
    v = tl.load(logits_ptr + r.to(tl.int64) * stride_l + (start + p), mask=ok, other=float("-inf")).to(tl.float32)
    v = tl.where(v != v, LOW, v)  # NaN
    v = tl.where(v == float("-inf"), LOW, v)  # an in-window -inf still ranks above the padding
    v = tl.where(ok, v, float("-inf"))
    g = p + (p // bs) * ((world - 1) * bs) + rank * bs
    g = tl.where(ok, g, -1)
    o = r.to(tl.int64) * topk + j
    tl.store(vals_ptr + o, v, mask=inb)
    tl.store(pos_ptr + o, g, mask=inb)
    if jb == 0:
        tl.store(bounds_ptr + r, 0)
        tl.store(bounds_ptr + rows + r, world * topk)


@triton.jit
def _unpack_kernel(col_ptr, gpos_ptr, gstarts_ptr, gends_ptr, out_ptr, stride_o, topk, rank_stride,
                   BLOCK: tl.constexpr, SHORT: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inb = j < topk
    c = tl.load(col_ptr + r.to(tl.int64) * topk + j, mask=inb, other=0)
    w = c // topk
    g = tl.load(gpos_ptr + w.to(tl.int64) * rank_stride + r.to(tl.int64) * topk + (c - w * topk), mask=inb,
                other=-1)
    if SHORT:  # (a consumer layer over candidate blocks keeps the merged selection)
        n = tl.load(gends_ptr + r) - tl.load(gstarts_ptr + r)
        g = tl.where(n <= topk, tl.where(j < n, j, -1), g)
    tl.store(out_ptr + r.to(tl.int64) * stride_o + j, g, mask=inb)


_PACK = Launcher(_pack_kernel)
_UNPACK = Launcher(_unpack_kernel)
_PACK_CFG = _PACK.config(LOW=_LOW, BLOCK=_BLOCK, num_warps=4)
_UNPACK_CFG = {short: _UNPACK.config(BLOCK=_BLOCK, SHORT=short, num_warps=4) for short in (True, False)}


def pack(sel: torch.Tensor, logits: torch.Tensor, starts: torch.Tensor, vals: torch.Tensor, pos: torch.Tensor,
         bounds: torch.Tensor, *, rank: int, world_size: int, block_size: int) -> None:
    """Candidates of the local top-k ``sel [rows, topk]`` int32 into ``vals [rows, topk]`` float32 and
    ``pos [rows, topk]`` int32 (contiguous), and the merge's window bounds into ``bounds [2 * rows]`` int32
    (starts, then ends). ``logits [rows, *]`` float32 (unit last stride), ``starts [rows]`` int32: the local
    windows' starts. Arguments are the merge's (checked by its caller)."""
    rows, topk = sel.shape
    _PACK.launch_with((rows, triton.cdiv(topk, _BLOCK)), _PACK_CFG,
                      (sel, logits, starts, vals, pos, bounds, sel.stride(0), logits.stride(0), topk, rank,
                       world_size, block_size, rows), 6)


def unpack(col: torch.Tensor, gathered_pos: torch.Tensor, global_starts: torch.Tensor, global_ends: torch.Tensor,
           out: torch.Tensor, *, short_rows: bool = True) -> None:
    """``out [rows, topk]`` int32 (unit last stride): the global position of each selected candidate ``col [rows,
    topk]`` int32 (contiguous, values in ``[0, W * topk)``), read from ``gathered_pos`` (rank 0's positions in the
    all-gather's ``[W, 2, rows, topk]`` output: rank ``w``'s are ``2 * rows * topk`` int32 further); rows with
    ``global_ends - global_starts <= topk`` are written ``0..n-1, -1, ...`` (unless not ``short_rows``)."""
    rows, topk = col.shape
    _UNPACK.launch_with((rows, triton.cdiv(topk, _BLOCK)), _UNPACK_CFG[short_rows],
                        (col, gathered_pos, global_starts, global_ends, out, out.stride(0), topk, 2 * rows * topk), 5)
