"""Triton ``fp8_paged_mqa_logits``: decode indexer scores read straight from the paged K cache.

One persistent launch. The key tiles of all requests (``cdiv(max_limit[b], BLOCK_N)`` tiles of ``BLOCK_N``
positions for request ``b``) form one global range that is cut into ``P`` equal contiguous pieces, one per
program, so ragged lengths stay balanced; a piece may span several requests. A program loads the
``[next_n * H, D]`` queries of a request once and, per key tile, computes all ``next_n`` rows with one fp8
``tl.dot`` (keys as the MMA's M dimension, ``next_n * H`` query rows as N), so each key byte is read from memory
once. Per tile: ``relu``, times the head weights, sum over heads, times the key scale, masked store.
With ``clean=True`` the programs then fill the columns past each request's last tile with ``-inf``.

No host synchronisation and no allocation: the grid is (multiprocessors x programs per multiprocessor), the
latter the compiled kernel's occupancy (registers, shared memory; computed once per specialization, capped by
``programs_per_sm``). ``SPLIT=True`` runs one ``[BLOCK_N, H]`` dot per query token instead (slower on H200).

Values the checks would refuse (docs/spec.md §10) cost a scalar per tile: row limits are clamped to ``[0, CAP]``;
a block id outside the cache reads its tile's values from block 0 and its key scales as 0 (the scale load's mask),
so its in-window logits are 0 (with ``block_size < BLOCK_N`` the keys' loads are masked instead: a zero key), except
in the scales-ahead configuration (``KSC_PF``: by default next_n 1, 3 and 4), which clamps the id into the cache
(a masked look-ahead cost 4% there on the H200; the clamp costs nothing measurable); an ``indices`` entry outside
the block table has no tiles (empty windows).

Triton's software pipeliner prefetches only the loads that feed a ``tl.dot`` (the keys, and the block-table entry
their address needs); the key scales would be a plain load, a full memory round trip every tile, so with
``KSC_PF`` they are read one tile ahead by hand (loop-carried registers).

H200, B=64, L=64K, block 64, clean=False, L2 flushed (``bench --sweep logits --sections paged``): next_n=1 152 us
(3.64 TB/s, 86% of the 4.24 TB/s copy floor of 131 us; 159 us without the scale prefetch), next_n=2 186 us (70%;
the prefetch does not help there); the dot + relu/weight/head-sum epilogue per 64-key tile is not overlapped with
the loads well enough to reach the floor (no warp specialization in this kernel).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..._runtime.launch import Launcher
from ..._runtime.triton_compat import fix_interpreter
from .._mxfp4_triton import scale_offset, tile_constants, value_offset
from ..fp8_mqa_logits.triton import _e2m1, _scale_factors, to_out
from .reference import fp8_paged_mqa_logits as _reference

fix_interpreter()  # Triton 3.6's interpreter under NumPy >= 2.4 (sparse_indexer/_runtime/triton_compat.py)

__all__ = ["fp8_paged_mqa_logits"]


@triton.jit
def _token_row(k, q, wts, ksc, pos, lim, row_ptr):
    """One query token's logits over one key tile, stored where ``pos < lim``."""
    s = tl.dot(k, tl.trans(q))  # [BLOCK_N, HP] float32
    logit = tl.sum(tl.maximum(s, 0.0) * wts[None, :], axis=1) * ksc
    tl.store(row_ptr + pos, to_out(logit, row_ptr), mask=pos < lim)


@triton.jit
def _ue8m0(w):
    """float32 scales of int32 words whose first (low) byte is a UE8M0 exponent ``e`` (the ``"ue8m0x4"`` encoding:
    four equal bytes), exactly: ``2 ** (e - 127)``, the subnormal ``2 ** -127`` for ``e = 0``, NaN for 255."""
    e = w & 0xFF
    bits = tl.where(e == 0, 0x00400000, tl.where(e == 255, 0x7FC00000, e << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scales(sbase, idx, mask, MASKED: tl.constexpr, UE8M0: tl.constexpr):
    """Key scales of keys ``idx`` of a block whose scale region starts at the byte pointer ``sbase`` (``MASKED``:
    0 where ``mask`` is false): float32, or with ``UE8M0`` the first byte of each key's 4 decoded (:func:`_ue8m0`)."""
    if UE8M0:
        if MASKED:  # (a masked scale is 0, not the byte 0's subnormal 2 ** -127)
            return tl.where(mask, _ue8m0(tl.load(sbase.to(tl.pointer_type(tl.int32)) + idx, mask=mask, other=0)), 0.0)
        else:
            return _ue8m0(tl.load(sbase.to(tl.pointer_type(tl.int32)) + idx))
    else:
        if MASKED:
            return tl.load(sbase.to(tl.pointer_type(tl.float32)) + idx, mask=mask, other=0.0)
        else:
            return tl.load(sbase.to(tl.pointer_type(tl.float32)) + idx)


@triton.jit
def _tile_block(bt_row, tt, t_hi, NB, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cache block of tile ``tt`` of a request (``tt < t_hi``: a program's segments have at least one tile, so
    the clamped index is a tile of the request), 0 when ``tt >= t_hi``; an id outside ``[0, NB)`` is clamped into
    it (the scales-ahead configuration reads a block of the cache instead of a zero key: a masked table read and a
    -1 here cost 4% at B=64, L=64K on the H200, the clamp nothing)."""
    idx = tl.maximum(tl.minimum(tt, t_hi - 1), 0) * BLOCK_N // BS
    return tl.where(tt < t_hi, tl.minimum(tl.maximum(tl.load(bt_row + idx), 0), NB - 1), 0)


@triton.jit
def _tile_scales(kv_ptr, bt_row, tt, t_hi, NB, stride_blk, offs_n, BS: tl.constexpr, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, UE8M0: tl.constexpr):
    """Key scales ``[BLOCK_N]`` of tile ``tt`` (unused when ``tt >= t_hi``; 0 for a block id outside the cache);
    the tile lies inside one block."""
    p0 = tt * BLOCK_N
    blk = _tile_block(bt_row, tt, t_hi, NB, BS, BLOCK_N)
    return _scales(kv_ptr + tl.maximum(blk, 0).to(tl.int64) * stride_blk + BS * D, p0 % BS + offs_n,
                   offs_n < tl.where((tt < t_hi) & (blk >= 0), BLOCK_N, 0), True, UE8M0)


@triton.jit
def _load_token(q_ptr, w_ptr, cl_ptr, b64, j: tl.constexpr, stride_qn, stride_qh, stride_w, stride_clb, stride_cln,
                CAP, offs_h, offs_d, NEXT_N: tl.constexpr, CL_2D: tl.constexpr, H: tl.constexpr,
                HP: tl.constexpr):
    """Queries ``[HP, D]``, weights ``[HP]`` (zero past ``H``) and row limit (in ``[0, CAP]``) of token ``j`` of
    request ``b``."""
    if H == HP:
        q = tl.load(q_ptr + j * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :])
        wts = tl.load(w_ptr + (b64 * NEXT_N + j) * stride_w + offs_h)
    else:
        hmask = offs_h < H
        q = tl.load(q_ptr + j * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :], mask=hmask[:, None],
                    other=0.0)
        wts = tl.load(w_ptr + (b64 * NEXT_N + j) * stride_w + offs_h, mask=hmask, other=0.0)
    if CL_2D:
        lim = tl.load(cl_ptr + b64 * stride_clb + j * stride_cln)
    else:  # (the length clamped at 0 first: no int32 overflow below)
        lim = tl.maximum(tl.load(cl_ptr + b64 * stride_clb), 0) - NEXT_N + j + 1
    return q, wts, tl.minimum(tl.maximum(lim, 0), CAP)


@triton.jit(do_not_specialize=["B", "CAP", "NB", "NR", "NUM_PROGRAMS"])
def _paged_logits_kernel(
    out_ptr,  # [B * next_n, W] float32 or bfloat16, row stride stride_out
    q_ptr,  # [B, next_n, H, D] fp8
    kv_ptr,  # cache bytes (uint8; read as q's fp8 type): block b at b * stride_blk (bytes)
    w_ptr,  # [B * next_n, H] float32
    cl_ptr,  # [B] or [B, next_n] int32/int64
    bt_ptr,  # [B, max_blocks] int32 (HAS_IDX: [num_requests, max_blocks])
    idx_ptr,  # [B] int32 block-table row of each entry (read only when HAS_IDX)
    B, W, CAP,  # CAP = min(W, max_blocks * BS): no key position reaches it
    NB, NR,  # cache blocks, block-table rows: ids outside [0, NB) score as zero keys (clamped into the cache with
    # KSC_PF), indices outside [0, NR) empty
    stride_out, stride_qb, stride_qn, stride_qh, stride_w, stride_clb, stride_cln, stride_bt, stride_blk,
    NUM_PROGRAMS,
    NEXT_N: tl.constexpr, NN_PAD: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, CL_2D: tl.constexpr, CLEAN: tl.constexpr,
    FILL_N: tl.constexpr, SPLIT: tl.constexpr, KSC_PF: tl.constexpr, HAS_IDX: tl.constexpr,
    UE8M0: tl.constexpr,  # key scales as 4 UE8M0 bytes (the "ue8m0x4" encoding) instead of a float32
):
    pid = tl.program_id(0)
    # the byte cache read as q's fp8 type (a pointer cast here instead of a torch view per call: host time)
    kv_ptr = kv_ptr.to(tl.pointer_type(q_ptr.dtype.element_ty))
    offs_b = tl.arange(0, BLOCK_B)
    bmask = offs_b < B
    # Largest row limit of every request (the last token's for 1-D lengths), clamped to [0, CAP].
    if CL_2D:
        maxlim = tl.zeros([BLOCK_B], dtype=tl.int64)
        for j in tl.static_range(NEXT_N):
            c = tl.load(cl_ptr + offs_b * stride_clb + j * stride_cln, mask=bmask, other=0).to(tl.int64)
            maxlim = tl.maximum(maxlim, c)
    else:
        maxlim = tl.load(cl_ptr + offs_b * stride_clb, mask=bmask, other=0).to(tl.int64)
    maxlim = tl.minimum(tl.maximum(maxlim, 0), CAP)
    if HAS_IDX:  # an entry whose block-table row is outside the table: an empty window
        iv = tl.load(idx_ptr + offs_b, mask=bmask, other=0)
        maxlim = tl.where((iv >= 0) & (iv < NR), maxlim, 0)
    tiles = (maxlim + BLOCK_N - 1) // BLOCK_N  # [BLOCK_B] int64
    cum_end = tl.cumsum(tiles, axis=0)
    total = tl.sum(tiles, axis=0)
    start = pid * total // NUM_PROGRAMS
    end = (pid + 1) * total // NUM_PROGRAMS

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_r = tl.arange(0, NN_PAD * HP)  # query row (token j = r // HP, head r % HP)
    offs_j = tl.arange(0, NN_PAD)
    offs_h = tl.arange(0, HP)
    rmask = (offs_r < NEXT_N * HP) & (offs_r % HP < H)
    jmask = offs_j < NEXT_N

    b = tl.sum((cum_end <= start).to(tl.int32), axis=0)
    t = start
    while t < end:
        sel = offs_b == b
        b_end = tl.sum(tl.where(sel, cum_end, 0), axis=0)
        b_tiles = tl.sum(tl.where(sel, tiles, 0), axis=0)
        b_start = b_end - b_tiles
        t_lo = (t - b_start).to(tl.int32)
        t_hi = (tl.minimum(end, b_end) - b_start).to(tl.int32)
        b64 = b.to(tl.int64)
        # Row limits of the request's next_n tokens, in [0, CAP].
        if CL_2D:
            lim = tl.load(cl_ptr + b64 * stride_clb + offs_j * stride_cln, mask=jmask, other=0)
        else:  # (the length clamped at 0 first: no int32 overflow below)
            c = tl.maximum(tl.load(cl_ptr + b64 * stride_clb), 0)
            lim = c - NEXT_N + offs_j + 1
        lim = tl.where(jmask, tl.minimum(tl.maximum(lim, 0), CAP), 0)
        b_lim = tl.sum(tl.where(sel, maxlim, 0), axis=0).to(tl.int32)
        if HAS_IDX:  # (an index outside the table has no tiles: row 0 is never read then)
            row = tl.load(idx_ptr + b64)
            bt_row = bt_ptr + tl.where((row >= 0) & (row < NR), row, 0).to(tl.int64) * stride_bt
        else:
            bt_row = bt_ptr + b64 * stride_bt
        out_rows = out_ptr + (b64 * NEXT_N + offs_j).to(tl.int64) * stride_out  # [NN_PAD] pointers
        if SPLIT:
            # One [BLOCK_N, H] dot per query token (no reshape of the accumulator).
            qb = q_ptr + b64 * stride_qb
            row0 = out_ptr + (b64 * NEXT_N).to(tl.int64) * stride_out
            q0, w0, l0 = _load_token(qb, w_ptr, cl_ptr, b64, 0, stride_qn, stride_qh, stride_w, stride_clb,
                                     stride_cln, CAP, offs_h, offs_d, NEXT_N, CL_2D, H, HP)
            if NEXT_N > 1:
                q1, w1, l1 = _load_token(qb, w_ptr, cl_ptr, b64, 1, stride_qn, stride_qh, stride_w, stride_clb,
                                         stride_cln, CAP, offs_h, offs_d, NEXT_N, CL_2D, H, HP)
            if NEXT_N > 2:
                q2, w2, l2 = _load_token(qb, w_ptr, cl_ptr, b64, 2, stride_qn, stride_qh, stride_w, stride_clb,
                                         stride_cln, CAP, offs_h, offs_d, NEXT_N, CL_2D, H, HP)
            if NEXT_N > 3:
                q3, w3, l3 = _load_token(qb, w_ptr, cl_ptr, b64, 3, stride_qn, stride_qh, stride_w, stride_clb,
                                         stride_cln, CAP, offs_h, offs_d, NEXT_N, CL_2D, H, HP)
        else:
            q = tl.load(q_ptr + b64 * stride_qb + (offs_r // HP)[:, None] * stride_qn
                        + (offs_r % HP)[:, None] * stride_qh + offs_d[None, :], mask=rmask[:, None], other=0.0)
            wts = tl.load(w_ptr + (b64 * NEXT_N + offs_r // HP) * stride_w + offs_r % HP, mask=rmask, other=0.0)
        if KSC_PF > 0:
            # Key scales read KSC_PF tiles ahead by hand: the software pipeliner only prefetches the loads that
            # feed the dot (the keys), so a plain scale load would stall every tile for a full memory round trip.
            ksc_a = _tile_scales(kv_ptr, bt_row, t_lo, t_hi, NB, stride_blk, offs_n, BS, D, BLOCK_N, UE8M0)
            if KSC_PF == 2:
                ksc_b = _tile_scales(kv_ptr, bt_row, t_lo + 1, t_hi, NB, stride_blk, offs_n, BS, D, BLOCK_N, UE8M0)
            blk_c = _tile_block(bt_row, t_lo + KSC_PF, t_hi, NB, BS, BLOCK_N)
        for tt in range(t_lo, t_hi):
            p0 = tt * BLOCK_N
            pos = p0 + offs_n
            if KSC_PF > 0:
                ksc = ksc_a
                pn = (tt + KSC_PF) * BLOCK_N
                ksc_n = _scales(kv_ptr + tl.maximum(blk_c, 0).to(tl.int64) * stride_blk + BS * D, pn % BS + offs_n,
                                offs_n < tl.where((tt + KSC_PF < t_hi) & (blk_c >= 0), BLOCK_N, 0), True, UE8M0)
                blk_c = _tile_block(bt_row, tt + KSC_PF + 1, t_hi, NB, BS, BLOCK_N)
                if KSC_PF == 2:
                    # (an op, not a plain copy of a loop-carried value: the pipeliner gives up on distance-2 deps)
                    ksc_a = tl.where(tt < t_hi, ksc_b, ksc_n)
                    ksc_b = ksc_n
                else:
                    ksc_a = ksc_n
                # a block id outside the cache: clamped into it (values and scales of block 0 or the last block)
                blk = tl.minimum(tl.maximum(tl.load(bt_row + p0 // BS), 0), NB - 1).to(tl.int64)
                k = tl.load(kv_ptr + blk * stride_blk + (p0 % BS + offs_n)[:, None] * D + offs_d[None, :])
            elif BS >= BLOCK_N:
                # The tile lies inside one cache block: contiguous values and scales. A block id outside the
                # cache: values read from block 0 (a scalar select), scales 0 (a uniform mask): its logits are 0.
                blk = tl.load(bt_row + p0 // BS)
                ok = (blk >= 0) & (blk < NB)
                base = kv_ptr + tl.where(ok, blk, 0).to(tl.int64) * stride_blk
                off = p0 % BS + offs_n
                k = tl.load(base + off[:, None] * D + offs_d[None, :])
                ksc = _scales(base + BS * D, off, offs_n < tl.where(ok, BLOCK_N, 0), True, UE8M0)
            else:
                valid = pos < b_lim
                blk = tl.load(bt_row + pos // BS, mask=valid, other=0)
                valid = valid & (blk >= 0) & (blk < NB)  # a block id outside the cache: a zero key
                base = kv_ptr + tl.where(valid, blk, 0).to(tl.int64) * stride_blk
                off = pos % BS
                k = tl.load((base + off * D)[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
                ksc = _scales(base + BS * D, off, valid, True, UE8M0)
            if SPLIT:
                _token_row(k, q0, w0, ksc, pos, l0, row0)
                if NEXT_N > 1:
                    _token_row(k, q1, w1, ksc, pos, l1, row0 + stride_out)
                if NEXT_N > 2:
                    _token_row(k, q2, w2, ksc, pos, l2, row0 + 2 * stride_out)
                if NEXT_N > 3:
                    _token_row(k, q3, w3, ksc, pos, l3, row0 + 3 * stride_out)
            else:
                s = tl.dot(k, tl.trans(q))  # [BLOCK_N, NN_PAD * H] float32
                s = tl.maximum(s, 0.0) * wts[None, :]
                if NN_PAD == 1:
                    logit = tl.sum(s, axis=1)[:, None]  # [BLOCK_N, 1]
                else:
                    logit = tl.sum(tl.reshape(s, (BLOCK_N, NN_PAD, HP)), axis=2)  # [BLOCK_N, NN_PAD]
                logit = logit * ksc[:, None]
                tl.store(out_rows[None, :] + pos[:, None], to_out(logit, out_ptr),
                         mask=pos[:, None] < lim[None, :])
        t = b_start + t_hi
        b += 1

    if CLEAN:
        offs_f = tl.arange(0, FILL_N)
        chunks = tl.cdiv(W, FILL_N)
        # Cells at or past each row's limit: -inf, chunks of FILL_N shared round-robin.
        for c in range(pid, B * chunks, NUM_PROGRAMS):
            fb = c // chunks
            col0 = (c % chunks) * FILL_N
            fb64 = fb.to(tl.int64)
            if CL_2D:
                flim = tl.load(cl_ptr + fb64 * stride_clb + offs_j * stride_cln, mask=jmask, other=0)
            else:  # (the length clamped at 0 first: no int32 overflow below)
                flim = tl.maximum(tl.load(cl_ptr + fb64 * stride_clb), 0) - NEXT_N + offs_j + 1
            flim = tl.minimum(tl.maximum(flim, 0), CAP)
            if HAS_IDX:  # an entry whose block-table row is outside the table: an empty window
                frow = tl.load(idx_ptr + fb64)
                flim = tl.where((frow >= 0) & (frow < NR), flim, 0)
            if col0 + FILL_N > tl.min(tl.where(jmask, flim, CAP), axis=0):
                cols = col0 + offs_f
                rows = out_ptr + (fb64 * NEXT_N + offs_j).to(tl.int64) * stride_out
                ninf = to_out(tl.full([NN_PAD, FILL_N], float("-inf"), tl.float32), out_ptr)
                tl.store(rows[:, None] + cols[None, :], ninf,
                         mask=jmask[:, None] & (cols[None, :] >= flim[:, None]) & (cols < W)[None, :])


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


_OCCUPANCY: dict = {}
LAST_LAUNCH: dict = {}  # registers, shared memory, programs per SM of the last GPU launch (for benchmarks)


def _occupancy(key, args, kwargs) -> int | None:
    """Programs of this specialization that fit on one multiprocessor (registers, shared memory), cached."""
    if key not in _OCCUPANCY:
        occ = None
        try:
            ck = _paged_logits_kernel.warmup(*args, grid=(1,), **kwargs)
            ck._init_handles()
            warps = kwargs["num_warps"]
            regs_per_warp = -(-ck.n_regs * 32 // 256) * 256
            occ = 65536 // max(1, regs_per_warp * warps)
            shared = ck.metadata.shared
            if shared:
                occ = min(occ, (228 * 1024) // (shared + 1024))
            occ = max(1, min(occ, 64 // warps, 32))
            LAST_LAUNCH.update(n_regs=ck.n_regs, shared=shared, occupancy=occ)
        except Exception:  # noqa: BLE001 - fall back to the configured programs per SM
            occ = None
        _OCCUPANCY[key] = occ
    return _OCCUPANCY[key]


# Tuned on an H200 (``bench --sweep logits``, ops/fp8_paged_mqa_logits/sweep.py); overridable for benchmarking.
# programs_per_sm caps the persistent grid (the occupancy of the compiled kernel decides below it).
CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 6, "programs_per_sm": 4, "SPLIT": False, "KSC_PF": 1}
# next_n = 2: a 128-register cap lifts occupancy from 3 to 4 programs per SM (196 -> 186 us at B=64, L=64K).
# KSC_PF: key scales read 1 (or 2) tiles ahead by hand (block_size >= BLOCK_N only); next_n=1 158.8 -> 152.3 us
# (PF 2 with 8 stages 151.6 us, within noise); next_n=2 186 -> 188.5 us (its limit is elsewhere), so off there.
CONFIG_BY_NEXT_N = {2: {"num_stages": 5, "maxnreg": 128, "KSC_PF": 0}}


def _pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


_LAUNCH = Launcher(_paged_logits_kernel)
_PLANS: dict = {}  # specialization of the default configuration -> (LaunchConfig, programs, programs per SM)


def _plan(args, q, context_lens, next_n: int, h: int, d: int, bs: int, b: int, cl_2d: bool, clean: bool,
          config, has_idx: bool = False, ue8m0: bool = False):
    """Constexprs and launch options, and the persistent grid (from the compiled kernel's occupancy)."""
    cfg = {**CONFIG, **CONFIG_BY_NEXT_N.get(next_n, {}), **(config or {})}
    block_n = cfg["BLOCK_N"]
    nn_pad = triton.next_power_of_2(next_n)
    kwargs = dict(NEXT_N=next_n, NN_PAD=nn_pad, H=h, HP=max(16, triton.next_power_of_2(h)), D=d, BS=bs,
                  BLOCK_N=block_n, BLOCK_B=max(16, triton.next_power_of_2(b)), CL_2D=cl_2d, CLEAN=bool(clean),
                  FILL_N=cfg.get("FILL_N", max(128, 1024 // nn_pad)), SPLIT=bool(cfg.get("SPLIT", False)),
                  KSC_PF=int(cfg.get("KSC_PF", 0)) if bs >= block_n and not cfg.get("SPLIT", False) else 0,
                  HAS_IDX=bool(has_idx), UE8M0=bool(ue8m0), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg.get("maxnreg"):
        kwargs["maxnreg"] = cfg["maxnreg"]  # register cap per thread: more programs per SM
    if q.device.type != "cuda":
        return _LAUNCH.config(**kwargs), 3, None  # interpreter: small, but enough for pieces that span requests
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    key = (dev, q.dtype, args[0].dtype, args[2].dtype, context_lens.dtype, args[5].dtype,
           tuple(sorted(kwargs.items())))
    per_sm = cfg["programs_per_sm"]
    occ = _occupancy(key, args, kwargs)
    if occ is not None:
        per_sm = min(per_sm, occ)
    return _LAUNCH.config(**kwargs), _num_sms(dev) * per_sm, per_sm


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, *, out, clean, indices=None,
                         config=None, cache_fp8_dtype=None, cache_scale="float32", cache_order="flat",
                         cache_values="fp8", q_scale=None) -> None:
    """See :func:`sparse_indexer.fp8_paged_mqa_logits`; ``kv_cache`` is the 3-D view, arguments are checked.
    ``config`` overrides :data:`CONFIG` (then nothing is cached). ``out`` float32 or bfloat16 (converted once, at
    the store); ``indices``: entry ``b`` reads block-table row ``indices[b]``. ``cache_scale``: float32 or
    ``"ue8m0x4"`` scales (decoded exactly in the kernel); a mix of FP8 formats or the preshuffled order raise
    ``NotImplementedError``. ``cache_values="mxfp4"`` with ``q_scale``: MXFP4 queries against an MXFP4 cache
    (:func:`_paged_mxfp4_kernel`)."""
    if cache_values == "mxfp4":
        _mxfp4(q, q_scale, kv_cache, weights, context_lens, block_table, out, clean, indices, cache_order)
        return
    if cache_fp8_dtype is not None and cache_fp8_dtype != q.dtype:
        raise NotImplementedError(f"{q.dtype} queries against a {cache_fp8_dtype} cache (a declared mix of formats)")
    if cache_order != "flat":
        raise NotImplementedError(f"triton fp8_paged_mqa_logits reads the flat order, not {cache_order!r}")
    ue8m0 = cache_scale == "ue8m0x4"
    b, next_n, h, d = q.shape
    nb, bs, width = kv_cache.shape
    w = out.shape[1]
    if not (_pow2(d) and _pow2(bs)) or d < 32:
        raise NotImplementedError(f"triton fp8_paged_mqa_logits needs power-of-two D >= 32 and block_size, "
                                  f"got {d=}, {bs=}")
    if next_n > 4:
        raise NotImplementedError(f"triton fp8_paged_mqa_logits handles next_n <= 4, got {next_n=}")
    if b == 0 or w == 0:
        return
    if nb == 0:  # no key to read (every in-window cell is a zero key's): nothing for a kernel to do but fill
        _no_blocks(q, kv_cache, weights, context_lens, block_table, out, clean, indices)
        return
    max_blocks = block_table.shape[1]
    cl_2d = context_lens.dim() == 2
    cls = context_lens.stride()
    qs = q.stride()
    has_idx = indices is not None
    args = [out, q, kv_cache, weights, context_lens, block_table,
            indices if has_idx else context_lens, b, w, min(w, max_blocks * bs), nb, block_table.shape[0],
            out.stride()[0], qs[0], qs[1], qs[2], weights.stride()[0], cls[0], cls[1] if cl_2d else 0,
            block_table.stride()[0], kv_cache.stride()[0] if nb > 1 else bs * width,  # CacheLayout.block_stride
            1]
    if config is None:
        key = (q.device, q.dtype, out.dtype, context_lens.dtype, block_table.dtype, next_n, h, d, bs,
               (b - 1).bit_length(), cl_2d, clean, has_idx, ue8m0)  # (b - 1).bit_length(): BLOCK_B's power of two
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS[key] = _plan(args, q, context_lens, next_n, h, d, bs, b, cl_2d, clean, None, has_idx,
                                       ue8m0)
    else:
        plan = _plan(args, q, context_lens, next_n, h, d, bs, b, cl_2d, clean, config, has_idx, ue8m0)
    cfg, num_programs, per_sm = plan
    if per_sm is not None:
        LAST_LAUNCH["programs_per_sm"] = per_sm
    args[-1] = num_programs
    _LAUNCH.launch_with((num_programs,), cfg, args, 7)


def _no_blocks(q, kv_cache, weights, context_lens, block_table, out, clean, indices, **kw) -> None:
    """A cache of no blocks (every block id is outside it): the in-window cells 0, the others ``-inf`` with
    ``clean`` (the reference's torch ops on the device: no key is read, no synchronisation)."""
    _reference(q, kv_cache, weights, context_lens, block_table, out=out, clean=clean, indices=indices, **kw)


@triton.jit
def _paged_mxfp4_block(kv_ptr, base, off, qlo, qhi, fq, valid, BS: tl.constexpr, D: tl.constexpr,
                       b: tl.constexpr, TN: tl.constexpr, TC: tl.constexpr, TL: tl.constexpr):
    """Block ``b`` of the keys ``off`` of the cache blocks at byte ``base`` (their bytes where the byte order
    ``TN, TC, TL`` puts them, :mod:`.._mxfp4_triton`; flat: values at ``off * D / 2``, scale bytes at ``BS * D / 2
    + off * D / 32``) against a query's block ``b`` (fp16 nibble values ``qlo``/``qhi``, scale factors ``fq``):
    the exact e2m1 dot times the key's and then the query's power of two (docs/spec.md §3a). ``[BLOCK_N, HP]``."""
    offs = tl.arange(0, 16)
    kb = tl.load(kv_ptr + base[:, None] + value_offset(off[:, None], b * 16 + offs[None, :], D // 2, TN, TC),
                 mask=valid[:, None], other=0)
    sk = tl.load(kv_ptr + base + scale_offset(off, b, BS, D // 2, D // 32, TN, TL), mask=valid, other=127).to(tl.int32)
    dot = tl.dot(_e2m1(kb & 15), tl.trans(qlo)) + tl.dot(_e2m1(kb >> 4), tl.trans(qhi))
    return dot * _scale_factors(sk)[:, None] * fq[None, :]


@triton.jit
def _paged_mxfp4_kernel(
    out_ptr,  # [B * next_n, W] float32 or bfloat16, row stride stride_out
    q_ptr,  # [B, next_n, H, D / 2] uint8, contiguous
    qs_ptr,  # [B, next_n, H, D / 32] uint8, contiguous
    kv_ptr,  # MXFP4 cache bytes: block k at k * stride_blk
    w_ptr,  # [B * next_n, H] float32, row stride stride_w
    cl_ptr,  # [B] or [B, next_n] int32/int64
    bt_ptr,  # [B, max_blocks] int32 (HAS_IDX: [num_requests, max_blocks])
    idx_ptr,  # [B] int32 block-table row of each entry (HAS_IDX)
    W, CAP,  # CAP = min(W, max_blocks * BS)
    NB, NR,  # cache blocks, block-table rows: ids outside [0, NB) score as zero keys, indices outside [0, NR) empty
    stride_out, stride_w, stride_clb, stride_cln, stride_bt, stride_blk,
    NEXT_N: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, CL_2D: tl.constexpr, CLEAN: tl.constexpr, HAS_IDX: tl.constexpr,
    TN: tl.constexpr = 1, TC: tl.constexpr = 1, TL: tl.constexpr = 1,  # the cache's byte order (flat: 1, 1, 1)
):
    """Program ``(b, t)``: key positions ``[t * BLOCK_N, (t + 1) * BLOCK_N)`` of request ``b`` against its
    ``next_n`` query tokens (each key read through the block table: a tile may span blocks); per token the
    blocks' scaled dots (:func:`_paged_mxfp4_block`, summed in order), relu, the weights, the head sum; cells at or
    past a row's limit ``-inf`` with ``CLEAN``. A block id outside the cache reads as a zero key (its in-window
    cells 0); an ``indices`` entry outside the block table gives the entry's rows empty windows."""
    b = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cap = CAP
    if HAS_IDX:
        row_bt = tl.load(idx_ptr + b)
        cap = tl.where((row_bt >= 0) & (row_bt < NR), CAP, 0)  # (an empty window: the table is not read)
        row_bt = tl.where(cap > 0, row_bt, 0).to(tl.int64)
    else:
        row_bt = b
    inside = pos < cap
    blk = tl.load(bt_ptr + row_bt * stride_bt + pos // BS, mask=inside, other=0)
    good = inside & (blk >= 0) & (blk < NB)  # the keys read: a block id outside the cache is a zero key
    base = tl.where(good, blk, 0).to(tl.int64) * stride_blk
    off = pos % BS
    offs_h = tl.arange(0, HP)
    hmask = offs_h < H
    offs_b = tl.arange(0, 16)
    for j in tl.static_range(NEXT_N):
        if CL_2D:
            lim = tl.load(cl_ptr + b * stride_clb + j * stride_cln)
        else:  # (the length clamped at 0 first: no int32 overflow below)
            lim = tl.maximum(tl.load(cl_ptr + b * stride_clb), 0) - NEXT_N + j + 1
        lim = tl.minimum(tl.maximum(lim, 0), cap)
        rowq = (b * NEXT_N + j) * H + offs_h  # query rows of token j
        valid = pos < lim
        if tl.program_id(1) * BLOCK_N < lim:
            qrow = q_ptr + rowq * (D // 2)
            srow = qs_ptr + rowq * (D // 32)
            q0 = tl.load(qrow[:, None] + offs_b[None, :], mask=hmask[:, None], other=0)
            kmask = valid & good
            s = _paged_mxfp4_block(kv_ptr, base, off, _e2m1(q0 & 15), _e2m1(q0 >> 4),
                                   _scale_factors(tl.load(srow, mask=hmask, other=127).to(tl.int32)), kmask, BS, D, 0,
                                   TN, TC, TL)
            for blkn in tl.static_range(1, D // 32):
                qn = tl.load(qrow[:, None] + blkn * 16 + offs_b[None, :], mask=hmask[:, None], other=0)
                fq = _scale_factors(tl.load(srow + blkn, mask=hmask, other=127).to(tl.int32))
                s = s + _paged_mxfp4_block(kv_ptr, base, off, _e2m1(qn & 15), _e2m1(qn >> 4), fq, kmask, BS, D,
                                           blkn, TN, TC, TL)
            wts = tl.load(w_ptr + (b * NEXT_N + j) * stride_w + offs_h, mask=hmask, other=0.0)
            s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL) * wts[None, :]
            logit = tl.sum(s, axis=1)
            tl.store(out_ptr + (b * NEXT_N + j) * stride_out + pos, to_out(logit, out_ptr), mask=valid)
        if CLEAN:
            ninf = to_out(tl.full([BLOCK_N], float("-inf"), tl.float32), out_ptr)
            tl.store(out_ptr + (b * NEXT_N + j) * stride_out + pos, ninf, mask=(pos >= lim) & (pos < W))


_LAUNCH_MX = Launcher(_paged_mxfp4_kernel)
_MX_BLOCK_N = 64


def _mxfp4(q, q_scale, kv_cache, weights, context_lens, block_table, out, clean, indices, order="flat") -> None:
    """MXFP4 queries against an MXFP4 cache in byte order ``order`` (arguments checked): :func:`_paged_mxfp4_kernel`
    over ``(B, W / BLOCK_N)``. Untuned (correctness first); D 32, 64 or 128."""
    b, next_n, h, half = q.shape
    d = 2 * half
    if d not in (32, 64, 128):
        raise NotImplementedError(f"triton fp8_paged_mqa_logits scores MXFP4 with D in (32, 64, 128), got {d=}")
    nb, bs, width = kv_cache.shape
    tiles = tile_constants(order, bs, d, "triton fp8_paged_mqa_logits")
    w = out.shape[1]
    if b == 0 or w == 0:
        return
    if nb == 0:  # no key to read (every in-window cell is a zero key's)
        _no_blocks(q, kv_cache, weights, context_lens, block_table, out, clean, indices, cache_order=order,
                   cache_values="mxfp4", q_scale=q_scale)
        return
    cl_2d = context_lens.dim() == 2
    cls = context_lens.stride()
    has_idx = indices is not None
    cfg = _LAUNCH_MX.config(NEXT_N=next_n, H=h, HP=max(16, triton.next_power_of_2(h)), D=d, BS=bs,
                            BLOCK_N=_MX_BLOCK_N, CL_2D=cl_2d, CLEAN=bool(clean), HAS_IDX=has_idx, num_warps=4,
                            **tiles)
    stride_blk = kv_cache.stride()[0] if nb > 1 else -(-bs * width // 4) * 4  # CacheLayout.block_stride
    _LAUNCH_MX.launch_with(
        (b, triton.cdiv(w, _MX_BLOCK_N)), cfg,
        (out, q, q_scale, kv_cache, weights, context_lens, block_table, indices if has_idx else context_lens,
         w, min(w, block_table.shape[1] * bs), nb, block_table.shape[0], out.stride()[0], weights.stride()[0], cls[0],
         cls[1] if cl_2d else 0, block_table.stride()[0], stride_blk), 8)
