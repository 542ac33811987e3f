"""Triton ``top_k_per_row``: sample-guided threshold search with plain-compare counting passes (docs/spec.md §6).

One program per row. Row ``r`` with window ``[start, end)`` of length ``n``:

* ``n <= topk``: write ``0..n-1, -1, ...`` without reading the logits.
* otherwise: rank in-window values by an order-preserving ``uint32`` key ``key(x)`` (sign flip for positives, bit
  inversion for negatives; ``-inf`` and NaN are 0, below every finite value; ``-0.0`` counts as ``+0.0``) and find
  a bracket ``[lo, hi)`` of keys with ``count(key >= lo) >= topk > count(key >= hi)``:

  1. **sample**: ``SAMPLE`` strided cells of the window; a vectorised bit-by-bit search gives their key quantiles
     around the expected rank ``topk * SAMPLE / n`` (``+- SPREAD`` binomial sigmas), the first ``M - 1``
     candidate thresholds.
  2. **count passes**: one read of the window counts, for ``M`` thresholds at once, the cells at or above each
     (one float compare and one add per cell and threshold: ``key(x) >= t`` is ``x >= g(t)`` for a float
     ``g(t)``, so no key is computed). The bracket shrinks to the thresholds around ``topk``; one threshold is
     always ``lo + 1`` (ties and ``-inf``/NaN-heavy rows end at once), the others are spread over a window
     around the linear interpolation of the crossing (or uniformly over the bracket after a miss). The loop
     stops when ``count(key >= lo) == topk`` or ``hi == lo + 1``.
  3. **compaction**: one last read writes cells with ``key >= hi`` and the first ``topk - count(key >= hi)``
     cells with ``lo <= key < hi`` (one packed cumulative sum per tile).

Every kernel first clamps its row's window (:func:`_window`, docs/spec.md §10): ``start >= 0``, ``end <= W``, an end
at or below the start an empty row; a candidate id below 0 or past the window selects nothing. Loads are 16-byte
vectors over the 4-aligned middle of the window, the (at most 6) edge cells are loaded once.
Nothing is allocated and nothing leaves the program besides ``out``; rows never cooperate. bfloat16 logits are
widened to float32 as they are loaded (exactly), so every path selects on the values given.

Measured on an H200 (triton 3.6, randn logits, topk 2048, do_bench median): decode 64 x 64K 123 us (radix-select
kernel before: 162 us), prefill 8K rows with windows [0, 56K + j] 5.4 ms (7.4), causal windows [0, 8(j + 1))
3.3 ms (4.0). block 4096 / 16 warps was best; 8 thresholds per pass 138 us, block 8192 spills (726 us), 8 warps
177 us, 32 warps 144 us, a 2048-cell sample 143 us.

**Split-row path** (``workspace`` given and fewer rows than twice the SM count, decided from shapes): three
launches, no host sync, no allocation; the workspace row holds 32 counters, then ``cap`` candidate positions and
``cap`` candidate values (float bits).

1. sample (grid rows): short rows written; else a 4096-cell strided sample gives two 16-bit key quantiles at
   ranks ``kk -+ 4.5 sigma`` (``kk = topk * 4096 / n``): a bracket ``[f_lo, f_hi)`` stored in the counters, which
   are zeroed here (the kernels reset the scratch themselves).
2. collect (grid rows x splits, about 16 programs per SM): cells ``>= f_hi`` go straight to ``out`` and cells in
   ``[f_lo, f_hi)`` to the candidates, slots reserved per tile by one relaxed atomic add per counter.
3. finish (grid rows): if ``count(>= f_hi) <= topk <= count(>= f_lo)`` and the candidates fit, four 8-bit radix
   passes (``tl.histogram``) over the candidates find the key of the ``topk``-th cell and the candidates above it
   and enough equal ones fill the rest; otherwise (bracket missed: ties, -inf/NaN-heavy rows, fewer finite cells
   than ``topk``; or overflow) the row is redone whole by the per-row algorithm above.

Measured on an H200 (triton 3.6, randn, topk 2048, CUDA-graph replay over 6 sets / do_bench median): decode
64 x 64K 54.8 us (per-row kernel 122.6) / 70.7 us (123.1); 128 x 32K 57.4 us (70.0) / 72.7 us (76.1). Graph stage
split at 64 x 64K: sample 12.9, collect 22.1, finish 19.8 us. Prefill 8K x 64K with an 8K-row workspace: 4.03 ms
(5.39 ms) -- not used there (it would need a 270 MB workspace).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..._runtime.launch import Launcher
from ..._runtime.triton_compat import fix_interpreter
from .workspace import COUNTERS as CTR
from .workspace import SAMPLE as SPLIT_SAMPLE
from .workspace import SPREAD as SPLIT_SPREAD

fix_interpreter()  # Triton 3.6's interpreter under NumPy >= 2.4 (sparse_indexer/_runtime/triton_compat.py)

__all__ = ["top_k_per_row"]

BLOCK = 4096
NUM_WARPS = 16
NUM_THR = 4  # thresholds per counting pass (8 was slower on the H200: 138 vs 123 us decode; _count takes 4)
SAMPLE = 1024  # strided sample cells
QBITS = 16  # key bits resolved for the sample quantiles
SPREAD = 3.0  # half-width of the sample thresholds, in binomial sigmas
WIN = 2.5  # half-width of refinement windows, in sqrt(cells in the bracket)
# split-row path (with a workspace): collect tiles, warps, programs per SM; finish kernel candidate tile
SPLIT_BLOCK = 2048
SPLIT_WARPS = 4
SPLIT_PROGRAMS_PER_SM = 16
SPLIT_SAMPLE_WARPS = 16  # 16/16 vs 8/8: 53.9 vs 54.8 us (64 x 64K), 56.4 vs 57.4 (128 x 32K); 4/4: 68.8
SPLIT_FINISH_WARPS = 16
# Narrower rows take the one-program-per-row kernel even with a workspace: one launch instead of three (host
# time) and no slower on the device. H200, L2 flushed, us per-row / split: 4 x 4K 30.1 / 39.3, 4 x 8K 26.3 /
# 37.2, 64 x 8K 40.9 / 39.0, 4 x 16K 37.4 / 38.8, 64 x 16K 46.0 / 42.4, 64 x 32K 69.4 / 50.0 (docs/benchmarks.md)
SPLIT_MIN_WIDTH = 16384
CBLOCK = 4096


@triton.jit
def _sort_key(x):
    """Order-preserving uint32 key of float32 ``x``; ``-inf`` and NaN (``not x > -inf``) give 0."""
    u = x.to(tl.uint32, bitcast=True)
    flip = (x.to(tl.int32, bitcast=True) >> 31).to(tl.uint32, bitcast=True) | 0x80000000
    return tl.where(x > float("-inf"), u ^ flip, tl.zeros_like(u))


@triton.jit
def _thr_f32(t):
    """Float ``g`` with ``(x >= g) == (key(x) >= t)`` for every float32 ``x``; ``t`` int64 in ``[1, 2**32)``.

    ``t <= key(-FLT_MAX)`` counts every finite cell (``g = -FLT_MAX``); keys above ``key(+inf)`` give a NaN ``g``
    (nothing counted); ``-0.0`` and ``+0.0`` compare equal, which is the key order with ``-0.0 == +0.0``.
    """
    t = tl.maximum(t, 0x00800000)
    bits = tl.where(t >= 0x80000000, t ^ 0x80000000, t ^ 0xFFFFFFFF)
    return bits.to(tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def _pick(v, jm, j: tl.constexpr):
    return tl.sum(tl.where(jm == j, v, 0), 0)


@triton.jit
def _window(starts_ptr, ends_ptr, row, width):
    """Row ``row``'s window as ``(start, n)``: its start clamped to ``>= 0``, its end to ``<= width`` (the logits'
    columns), ``n = max(end - start, 0)`` (an end below the start is an empty row). Hostile bounds (past ``W``,
    negative, 2**30) therefore never move a read outside the row, and ``n`` never overflows."""
    start = tl.maximum(tl.load(starts_ptr + row), 0)
    end = tl.minimum(tl.load(ends_ptr + row), width)
    return start, tl.maximum(end - start, 0)


@triton.jit
def _count(base, s4, e4, ex, f0, f1, f2, f3, BLOCK: tl.constexpr):
    """Cells of the window with ``x >= f_j``, ``j < 4`` (middle ``[s4, e4)`` by vector loads, edge cells ``ex``)."""
    offs = tl.arange(0, BLOCK)
    a0 = tl.zeros([BLOCK], tl.int32)
    a1 = tl.zeros([BLOCK], tl.int32)
    a2 = tl.zeros([BLOCK], tl.int32)
    a3 = tl.zeros([BLOCK], tl.int32)
    e4 = tl.multiple_of(e4, 4)
    for i in range(s4, e4, BLOCK):
        o = tl.multiple_of(i, 4) + offs
        x = tl.load(base + o, mask=o < e4, other=float("-inf")).to(tl.float32)
        a0 += (x >= f0).to(tl.int32)
        a1 += (x >= f1).to(tl.int32)
        a2 += (x >= f2).to(tl.int32)
        a3 += (x >= f3).to(tl.int32)
    c0 = tl.sum(a0, 0) + tl.sum((ex >= f0).to(tl.int32), 0)
    c1 = tl.sum(a1, 0) + tl.sum((ex >= f1).to(tl.int32), 0)
    c2 = tl.sum(a2, 0) + tl.sum((ex >= f2).to(tl.int32), 0)
    c3 = tl.sum(a3, 0) + tl.sum((ex >= f3).to(tl.int32), 0)
    return c0, c1, c2, c3


@triton.jit
def _short_row(orow, n, topk, BLOCK: tl.constexpr):
    """``orow = 0, 1, ..., n - 1, -1, ...`` (``n <= topk``), without reading the logits."""
    offs = tl.arange(0, BLOCK)
    for i in range(0, topk, BLOCK):
        o = i + offs
        tl.store(orow + o, tl.where(o < n, o, -1), mask=o < topk)


@triton.jit
def _row_topk(orow, base, start, n, topk, BLOCK: tl.constexpr, M: tl.constexpr, SAMPLE: tl.constexpr,
              QBITS: tl.constexpr, SPREAD: tl.constexpr, WIN: tl.constexpr):
    """The ``n > topk`` row of window ``[start, start + n)`` of ``base`` (the row's logits): all of ``orow``."""
    tl.static_assert(M == 4, "a counting pass takes 4 thresholds (_count)")
    offs = tl.arange(0, BLOCK)
    end = start + n
    s4 = (start + 3) // 4 * 4  # 4-aligned middle [s4, e4) (empty when s4 >= e4)
    e4 = end // 4 * 4
    s4c = tl.minimum(s4, end)
    e4c = tl.maximum(e4, s4c)
    eo = tl.arange(0, 8)  # edge cells: [start, s4c) and [e4c, end), at most 3 each
    epos = tl.where(eo < 4, start + eo, e4c + eo - 4)
    emask = ((eo < 4) & (epos < s4c)) | ((eo >= 4) & (epos < end))
    ex = tl.load(base + epos, mask=emask, other=float("-inf")).to(tl.float32)

    # 1. sample quantiles: t[j] = QBITS-bit prefix of the r[j]-th largest sample key
    js = tl.arange(0, SAMPLE)
    sk = _sort_key(tl.load(base + start + ((js.to(tl.int64) * n) // SAMPLE).to(tl.int32)).to(tl.float32))
    jm = tl.arange(0, M)
    jf = jm.to(tl.float32)
    kk = (topk * 1.0) * SAMPLE / n.to(tl.float32)
    sig = tl.sqrt(kk) + 1.0
    r = kk + SPREAD * sig * (2.0 * jf / (M - 2) - 1.0)
    r = tl.minimum(tl.maximum(tl.math.ceil(r), 1.0), SAMPLE * 1.0).to(tl.int32)
    t = tl.zeros([M], tl.uint32)
    for b in tl.static_range(QBITS):
        c = t | tl.full((), 1 << (31 - b), tl.uint32)
        cnt = tl.sum((sk[:, None] >= c[None, :]).to(tl.int32), 0)
        t = tl.where(cnt >= r, c, t)

    lo = tl.full((), 0, tl.int64)  # count(key >= lo) = c_lo >= topk
    hi = tl.full((), 0xFFFFFFFF, tl.int64)  # count(key >= hi) = c_hi < topk; no key reaches 0xFFFFFFFF
    c_lo = n
    c_hi = n * 0
    thr = tl.where(jm == M - 1, 1, tl.maximum(t.to(tl.int64), 1))
    windowed = 1
    done = 0
    while done == 0:
        t0 = _pick(thr, jm, 0)
        t1 = _pick(thr, jm, 1)
        t2 = _pick(thr, jm, 2)
        t3 = _pick(thr, jm, 3)
        c0, c1, c2, c3 = _count(base, s4, e4, ex, _thr_f32(t0), _thr_f32(t1), _thr_f32(t2), _thr_f32(t3), BLOCK)
        cv = tl.where(jm == 0, c0, 0) + tl.where(jm == 1, c1, 0) + tl.where(jm == 2, c2, 0) + \
            tl.where(jm == 3, c3, 0)
        ge = cv >= topk
        lo = tl.maximum(lo, tl.max(tl.where(ge, thr, -1), 0))
        c_lo = tl.minimum(c_lo, tl.min(tl.where(ge, cv, n), 0))
        hi = tl.minimum(hi, tl.min(tl.where(ge, 0xFFFFFFFF, thr), 0))
        c_hi = tl.maximum(c_hi, tl.max(tl.where(ge, 0, cv), 0))
        done = ((c_lo == topk) | (hi - lo == 1)).to(tl.int32)
        # did the crossing fall between the spread thresholds (all but the lo + 1 slot)?
        inner = jm < M - 1
        hit = (lo >= tl.min(tl.where(inner, thr, 0xFFFFFFFF), 0)) & (hi <= tl.max(tl.where(inner, thr, 0), 0))
        missed = (windowed != 0) & (hit == 0)
        # next thresholds: lo + 1, and M - 1 spread over a window around the interpolated crossing
        mf = (c_lo - c_hi).to(tl.float32)
        span = (hi - lo).to(tl.float32)
        est = ((c_lo - topk).to(tl.float32) + 0.5) / mf
        hw = WIN * tl.sqrt(mf) / mf
        use_w = (missed == 0) & (hw < 0.4)
        fa = tl.where(use_w, tl.maximum(est - hw, 0.0), 0.0)
        fb = tl.where(use_w, tl.minimum(est + hw, 1.0), 1.0)
        nt = lo + (span * (fa + (fb - fa) * (jf + 1.0) / M)).to(tl.int64)
        nt = tl.minimum(tl.maximum(nt, lo + 1), hi - 1)
        thr = tl.where(jm == M - 1, lo + 1, nt)
        windowed = use_w.to(tl.int32)

    # 3. compaction: keys >= hi (all selected) first, then the first topk - c_hi keys in [lo, hi)
    g_hi = _thr_f32(hi)
    g_lo = _thr_f32(tl.maximum(lo, 1))
    lo0 = (lo == 0).to(tl.int32)  # keys >= 0: every in-window cell
    k_eq = topk - c_hi
    egt = (emask & (ex >= g_hi)).to(tl.int32)
    eeq = emask.to(tl.int32) & ((ex >= g_lo).to(tl.int32) | lo0) & (1 - egt)
    epk = egt + (eeq << 16)
    ecs = tl.cumsum(epk, 0)
    ep_eq = (ecs >> 16) - 1
    etake = (egt | (eeq & (ep_eq < k_eq).to(tl.int32))) != 0
    tl.store(orow + tl.where(egt != 0, (ecs & 0xFFFF) - 1, c_hi + ep_eq), epos - start, mask=etake)
    tot = tl.sum(epk, 0)
    n_gt = tot & 0xFFFF
    n_eq = tot >> 16
    e4h = tl.multiple_of(e4, 4)
    for i in range(s4, e4, BLOCK):
        o = tl.multiple_of(i, 4) + offs
        m = o < e4h
        x = tl.load(base + o, mask=m, other=float("-inf")).to(tl.float32)
        gt = (m & (x >= g_hi)).to(tl.int32)
        eq = m.to(tl.int32) & ((x >= g_lo).to(tl.int32) | lo0) & (1 - gt)
        packed = gt + (eq << 16)  # BLOCK < 2**16: counts never carry
        cs = tl.cumsum(packed, 0)
        p_gt = n_gt + (cs & 0xFFFF) - 1
        p_eq = n_eq + (cs >> 16) - 1
        take = (gt | (eq & (p_eq < k_eq).to(tl.int32))) != 0
        tl.store(orow + tl.where(gt != 0, p_gt, c_hi + p_eq), o - start, mask=take)
        tot = tl.sum(packed, 0)
        n_gt += tot & 0xFFFF
        n_eq += tot >> 16


@triton.jit
def _top_k_per_row_kernel(
    out_ptr,  # [R, topk] int32, row stride stride_o
    logits_ptr,  # [R, W] float32, row stride stride_l
    starts_ptr,  # [R] int32
    ends_ptr,  # [R] int32
    stride_l,
    stride_o,
    topk,
    width,  # W: the logits' columns (windows are clamped to [0, W))
    BLOCK: tl.constexpr,
    M: tl.constexpr,
    SAMPLE: tl.constexpr,
    QBITS: tl.constexpr,
    SPREAD: tl.constexpr,
    WIN: tl.constexpr,
):
    row = tl.program_id(0)
    start, n = _window(starts_ptr, ends_ptr, row, width)
    orow = out_ptr + row.to(tl.int64) * stride_o
    if n <= topk:
        _short_row(orow, n, topk, BLOCK)
    else:
        _row_topk(orow, logits_ptr + row.to(tl.int64) * stride_l, start, n, topk, BLOCK, M, SAMPLE, QBITS, SPREAD,
                  WIN)



# ---------------------------------------------------------------- split-row path (global workspace)
@triton.jit
def _split_sample_kernel(
    out_ptr, logits_ptr, starts_ptr, ends_ptr, ws_ptr, stride_l, stride_o, stride_w, topk, width,
    BLOCK: tl.constexpr, SAMPLE: tl.constexpr, QBITS: tl.constexpr, SPREAD: tl.constexpr,
):
    """Per row: short rows written; else counters zeroed and the bracket ``[f_lo, f_hi)`` stored (float bits)."""
    row = tl.program_id(0)
    start, n = _window(starts_ptr, ends_ptr, row, width)
    orow = out_ptr + row.to(tl.int64) * stride_o
    wrow = ws_ptr + row.to(tl.int64) * stride_w
    if n <= topk:
        _short_row(orow, n, topk, BLOCK)
    else:
        base = logits_ptr + row.to(tl.int64) * stride_l
        js = tl.arange(0, SAMPLE)
        sk = _sort_key(tl.load(base + start + ((js.to(tl.int64) * n) // SAMPLE).to(tl.int32)).to(tl.float32))
        jm = tl.arange(0, 2)  # 0: hi (fewer cells above), 1: lo (more cells above)
        kk = (topk * 1.0) * SAMPLE / n.to(tl.float32)
        sig = tl.sqrt(kk) + 1.0
        r = kk + SPREAD * sig * (2.0 * jm.to(tl.float32) - 1.0)
        r = tl.minimum(tl.maximum(tl.math.ceil(r), 1.0), SAMPLE * 1.0).to(tl.int32)
        t = tl.zeros([2], tl.uint32)
        for b in tl.static_range(QBITS):
            c = t | tl.full((), 1 << (31 - b), tl.uint32)
            cnt = tl.sum((sk[:, None] >= c[None, :]).to(tl.int32), 0)
            t = tl.where(cnt >= r, c, t)
        t64 = t.to(tl.int64)
        hi = tl.sum(tl.where(jm == 0, t64, 0), 0)
        lo = tl.sum(tl.where(jm == 1, t64, 0), 0)
        hi = tl.minimum(tl.maximum(hi, lo + (1 << (32 - QBITS))), 0xFFFFFFFF)  # the lo bucket is all candidates
        f_hi = _thr_f32(hi)
        f_lo = _thr_f32(tl.maximum(lo, 1))  # lo = 0 would take -inf/NaN: the fallback does that exactly
        tl.store(wrow + jm, tl.zeros([2], tl.int32))  # [0] cells >= f_hi, [1] candidates
        tl.store(wrow + 2 + jm, tl.where(jm == 0, f_lo, f_hi).to(tl.int32, bitcast=True))


@triton.jit
def _collect_tile(x, pos, valid, f_lo, f_hi, wrow, orow, cpos, cval, topk, cap):
    """Cells ``>= f_hi`` straight to ``orow``, cells in ``[f_lo, f_hi)`` to the candidates (atomic counters)."""
    gt = (valid & (x >= f_hi)).to(tl.int32)
    cd = (valid & (x >= f_lo)).to(tl.int32) & (1 - gt)
    packed = gt + (cd << 16)  # tiles < 2**16 cells: counts never carry
    tot = tl.sum(packed, 0)
    if tot != 0:
        cs = tl.cumsum(packed, 0)
        b_g = tl.atomic_add(wrow, tot & 0xFFFF, sem="relaxed")  # slot reservation only: no ordering needed
        b_c = tl.atomic_add(wrow + 1, tot >> 16, sem="relaxed")
        p_g = b_g + (cs & 0xFFFF) - 1
        tl.store(orow + p_g, pos, mask=(gt != 0) & (p_g < topk))
        p_c = b_c + (cs >> 16) - 1
        mc = (cd != 0) & (p_c < cap)
        tl.store(cpos + p_c, pos, mask=mc)
        tl.store(cval + p_c, x.to(tl.int32, bitcast=True), mask=mc)


@triton.jit
def _split_collect_kernel(
    out_ptr, logits_ptr, starts_ptr, ends_ptr, ws_ptr, stride_l, stride_o, stride_w, topk, width, cap, chunk,
    BLOCK: tl.constexpr, CTR: tl.constexpr,
):
    """Grid (rows, splits): split ``s`` reads ``chunk`` cells of the row's 4-aligned middle (split 0 the edges)."""
    row = tl.program_id(0)
    sp = tl.program_id(1)
    start, n = _window(starts_ptr, ends_ptr, row, width)
    end = start + n
    s4 = (start + 3) // 4 * 4
    e4 = end // 4 * 4
    s4c = tl.minimum(s4, end)
    e4c = tl.maximum(e4, s4c)
    lo_i = s4 + sp * chunk  # plain arithmetic keeps the 4-divisibility visible (tl.multiple_of does not)
    if (n > topk) & ((lo_i < e4) | (sp == 0)):
        orow = out_ptr + row.to(tl.int64) * stride_o
        wrow = ws_ptr + row.to(tl.int64) * stride_w
        cpos = wrow + CTR
        cval = cpos + cap
        base = logits_ptr + row.to(tl.int64) * stride_l
        f_lo = tl.load(wrow + 2).to(tl.float32, bitcast=True)
        f_hi = tl.load(wrow + 3).to(tl.float32, bitcast=True)
        if sp == 0:
            eo = tl.arange(0, 8)  # edge cells: [start, s4c) and [e4c, end), at most 3 each
            epos = tl.where(eo < 4, start + eo, e4c + eo - 4)
            emask = ((eo < 4) & (epos < s4c)) | ((eo >= 4) & (epos < end))
            ex = tl.load(base + epos, mask=emask, other=float("-inf")).to(tl.float32)
            _collect_tile(ex, epos - start, emask, f_lo, f_hi, wrow, orow, cpos, cval, topk, cap)
        offs = tl.arange(0, BLOCK)
        hi_i = tl.minimum(lo_i + chunk, e4)  # empty when the middle is (e4 < s4)
        for i in range(lo_i, hi_i, BLOCK):
            o = i + offs
            m = o < hi_i
            x = tl.load(base + o, mask=m, other=float("-inf")).to(tl.float32)
            _collect_tile(x, o - start, m, f_lo, f_hi, wrow, orow, cpos, cval, topk, cap)


@triton.jit
def _split_finish_kernel(
    out_ptr, logits_ptr, starts_ptr, ends_ptr, ws_ptr, stride_l, stride_o, stride_w, topk, width, cap,
    CTR: tl.constexpr, CBLOCK: tl.constexpr, BLOCK: tl.constexpr, M: tl.constexpr, SAMPLE: tl.constexpr,
    QBITS: tl.constexpr, SPREAD: tl.constexpr, WIN: tl.constexpr,
):
    """Per row: exact selection of the missing ``topk - count(>= f_hi)`` among the candidates (4 radix passes
    of 8 bits), or the whole row by :func:`_row_topk` when the bracket missed or the candidates overflowed."""
    row = tl.program_id(0)
    start, n = _window(starts_ptr, ends_ptr, row, width)
    if n > topk:
        orow = out_ptr + row.to(tl.int64) * stride_o
        wrow = ws_ptr + row.to(tl.int64) * stride_w
        cnt_g = tl.load(wrow)
        cnt_c = tl.load(wrow + 1)
        ok = (cnt_g <= topk) & (cnt_g + cnt_c >= topk) & (cnt_c <= cap)
        if ok:
            k_rem = topk - cnt_g
            if k_rem > 0:
                cpos = wrow + CTR
                cval = cpos + cap
                offs = tl.arange(0, CBLOCK)
                bins = tl.arange(0, 256)
                prefix = tl.zeros((), tl.uint32)
                for p in tl.static_range(4):
                    hist = tl.zeros([256], tl.int32)
                    for i in range(0, cnt_c, CBLOCK):
                        o = i + offs
                        m = o < cnt_c
                        key = _sort_key(tl.load(cval + o, mask=m, other=0).to(tl.float32, bitcast=True))
                        if p == 0:
                            match = m
                        else:
                            match = m & ((key >> (32 - 8 * p)) == (prefix >> (32 - 8 * p)))
                        d = tl.where(match, (key >> (24 - 8 * p)) & 0xFF, 0).to(tl.int32)
                        miss = CBLOCK - tl.sum(match.to(tl.int32), 0)  # sent to bin 0, taken back out
                        hist += tl.histogram(d, 256) - tl.where(bins == 0, miss, 0)
                    suf = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # cells with digit >= b
                    dsel = tl.max(tl.where(suf >= k_rem, bins, 0), 0)
                    k_rem -= tl.sum(tl.where(bins > dsel, hist, 0), 0)
                    prefix = prefix | (dsel.to(tl.uint32) << (24 - 8 * p))
                # prefix = the key of the missing cells' last one; take every candidate above it, k_rem equal
                n_gt = cnt_g  # candidates above go to [cnt_g, topk - k_rem), the equal ones to [topk - k_rem, topk)
                n_eq = topk - k_rem
                for i in range(0, cnt_c, CBLOCK):
                    o = i + offs
                    m = o < cnt_c
                    key = _sort_key(tl.load(cval + o, mask=m, other=0).to(tl.float32, bitcast=True))
                    pos = tl.load(cpos + o, mask=m, other=0)
                    gt = (m & (key > prefix)).to(tl.int32)
                    eq = (m & (key == prefix)).to(tl.int32)
                    packed = gt + (eq << 16)
                    cs = tl.cumsum(packed, 0)
                    p_gt = n_gt + (cs & 0xFFFF) - 1
                    p_eq = n_eq + (cs >> 16) - 1
                    take = (gt != 0) | ((eq != 0) & (p_eq < topk))
                    tl.store(orow + tl.where(gt != 0, p_gt, p_eq), pos, mask=take)
                    tot = tl.sum(packed, 0)
                    n_gt += tot & 0xFFFF
                    n_eq += tot >> 16
        else:
            _row_topk(orow, logits_ptr + row.to(tl.int64) * stride_l, start, n, topk, BLOCK, M, SAMPLE, QBITS,
                      SPREAD, WIN)


# Launches bound once per specialization (sparse_indexer/_runtime/launch.py): the constexprs and options of each
# configuration are kept in a LaunchConfig made on first use, so a call only prepares its tensors and ints.
_ROW = Launcher(_top_k_per_row_kernel)
_SAMPLE = Launcher(_split_sample_kernel)
_COLLECT = Launcher(_split_collect_kernel)
_FINISH = Launcher(_split_finish_kernel)


@functools.lru_cache(maxsize=64)
def _row_cfg(block, num_warps, sample, qbits, spread, win):
    return _ROW.config(BLOCK=block, M=NUM_THR, SAMPLE=sample, QBITS=qbits, SPREAD=spread, WIN=win,
                       num_warps=num_warps)


@functools.lru_cache(maxsize=64)
def _split_cfgs(block, num_warps, sample, spread, sample_warps, finish_warps):
    return (_SAMPLE.config(BLOCK=BLOCK, SAMPLE=sample, QBITS=QBITS, SPREAD=spread, num_warps=sample_warps),
            _COLLECT.config(BLOCK=block, CTR=CTR, num_warps=num_warps),
            _FINISH.config(CTR=CTR, CBLOCK=CBLOCK, BLOCK=BLOCK, M=NUM_THR, SAMPLE=SAMPLE, QBITS=QBITS, SPREAD=SPREAD,
                           WIN=WIN, num_warps=finish_warps))


def _launch(logits, row_starts, row_ends, out, *, block=BLOCK, num_warps=NUM_WARPS, sample=SAMPLE, qbits=QBITS,
            spread=SPREAD, win=WIN):
    r = logits.shape[0]
    if r == 0:
        return
    if block >= 1 << 16:
        raise NotImplementedError(f"{block=} must be < 2**16 (packed counters)")
    _ROW.launch_with((r,), _row_cfg(block, num_warps, sample, qbits, spread, win),
                     (out, logits, row_starts, row_ends, logits.stride(0), out.stride(0), out.shape[1],
                      logits.shape[1]), 4)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (queried once; 64 for the CPU interpreter)."""
    if device.type != "cuda":
        return 64
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_split(logits, row_starts, row_ends, out, workspace, *, block=SPLIT_BLOCK, num_warps=SPLIT_WARPS,
                  programs_per_sm=SPLIT_PROGRAMS_PER_SM, sample=SPLIT_SAMPLE, spread=SPLIT_SPREAD,
                  sample_warps=SPLIT_SAMPLE_WARPS, finish_warps=SPLIT_FINISH_WARPS):
    """Split-row path: sample (rows) -> collect (rows x splits) -> finish (rows); three launches, no host sync."""
    r, w = logits.shape
    if r == 0:
        return
    if block >= 1 << 16 or CBLOCK >= 1 << 16:
        raise NotImplementedError("tiles must hold < 2**16 cells (packed counters)")
    cap = (workspace.shape[1] - CTR) // 2
    splits = max(1, min(triton.cdiv(w, block), triton.cdiv(programs_per_sm * _sm_count(logits.device), r)))
    chunk = max(1, triton.cdiv(triton.cdiv(w, splits), block)) * block
    splits = max(1, triton.cdiv(w, chunk))
    args = (out, logits, row_starts, row_ends, workspace, logits.stride(0), out.stride(0), workspace.stride(0),
            out.shape[1], w)
    c_sample, c_collect, c_finish = _split_cfgs(block, num_warps, sample, spread, sample_warps, finish_warps)
    _SAMPLE.launch_with((r,), c_sample, args, 5)
    _COLLECT.launch_with((r, splits), c_collect, args + (cap, chunk), 5)
    _FINISH.launch_with((r,), c_finish, args + (cap,), 5)


def use_split(rows: int, device: torch.device, width: int) -> bool:
    """Whether a call of ``rows`` rows of ``width`` logits columns with a workspace takes the split path (shapes
    only, no host sync): few rows (``< 2 x SMs``) and rows wide enough (``>= SPLIT_MIN_WIDTH``) that spreading
    one row over several programs pays for the split path's two extra launches."""
    return 0 < rows < 2 * _sm_count(torch.device(device)) and width >= SPLIT_MIN_WIDTH


def top_k_per_row(logits, row_starts, row_ends, *, out, workspace=None, candidates=None,
                  candidate_block_size=None) -> None:
    """See :func:`sparse_indexer.top_k_per_row`; arguments are checked."""
    if candidates is not None:
        candidate_top_k(logits, row_starts, row_ends, out, candidates, candidate_block_size)
        return
    if workspace is not None and use_split(logits.shape[0], logits.device, logits.shape[1]):
        _launch_split(logits, row_starts, row_ends, out, workspace)
    else:
        _launch(logits, row_starts, row_ends, out)


# ---------------------------------------------------------------- candidate-restricted top-k (docs/spec.md §6a)
# Shared with the Triton select_candidate_blocks (sparse_indexer/ops/select_candidate_blocks/triton.py): an exact
# radix select of the k largest uint32 keys of a row, key 0 never taken (cells that are not eligible), in digits of
# RADIX_BITS bits, then one compaction pass.
RADIX_BITS = 8  # digit width: 4 passes of 256 bins (Triton's histogram costs grow with the bins)
RADIX_BINS = 1 << RADIX_BITS
CAND_CELLS = 4096  # cells per tile of the candidate top-k (candidates per tile: CAND_CELLS // next_pow2(b))
CAND_WARPS = 8


@triton.jit
def radix_digit(hist, krem, NB: tl.constexpr):
    """The digit ``d`` of the ``krem``-th largest key given the histogram ``hist [NB]`` of the digits of the keys
    still in the running, and ``krem`` minus the keys of larger digits."""
    bins = tl.arange(0, NB)
    suf = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with digit >= b
    d = tl.max(tl.where(suf >= krem, bins, 0), 0)
    return d, krem - tl.sum(tl.where(bins > d, hist, 0), 0)


@triton.jit
def masked_hist(key, match, SHIFT: tl.constexpr, NB: tl.constexpr, N: tl.constexpr):
    """Histogram ``[NB]`` of the digits ``(key >> SHIFT) & (NB - 1)`` of the ``N`` keys where ``match``."""
    d = tl.where(match, (key >> SHIFT) & (NB - 1), 0).to(tl.int32)
    miss = N - tl.sum(match.to(tl.int32), 0)  # sent to bin 0, taken back out
    return tl.histogram(d, NB) - tl.where(tl.arange(0, NB) == 0, miss, 0)


@triton.jit
def compact_tile(orow, key, val, thr, need_eq, n_gt, ng, neq):
    """Store ``val`` where ``key > thr`` at ``orow[ng + rank]`` and, for the first ``need_eq`` keys equal to
    ``thr`` (a running count ``neq``), at ``orow[n_gt + neq + rank]``; returns the updated ``ng, neq``."""
    gt = (key > thr).to(tl.int32)
    eq = ((key == thr) & (neq < need_eq)).to(tl.int32)
    packed = gt + (eq << 16)  # tiles < 2**16 cells: counts never carry
    cs = tl.cumsum(packed, 0)
    p_gt = ng + (cs & 0xFFFF) - 1
    p_eq = neq + (cs >> 16) - 1
    take = (gt != 0) | ((eq != 0) & (p_eq < need_eq))
    tl.store(orow + tl.where(gt != 0, p_gt, n_gt + p_eq), val, mask=take)
    tot = tl.sum(packed, 0)
    return ng + (tot & 0xFFFF), neq + (tot >> 16)


@triton.jit
def fill_rest(orow, k, total, BLOCK: tl.constexpr):
    """``orow[k:total] = -1``."""
    offs = tl.arange(0, BLOCK)
    for i in range(k, total, BLOCK):
        o = i + offs
        tl.store(orow + o, tl.full([BLOCK], -1, tl.int32), mask=o < total)


@triton.jit
def _cand_tile(base, crow, c0, n, kb, BS: tl.constexpr, BP: tl.constexpr, TC: tl.constexpr):
    """Keys and window positions of the cells of candidates ``[c0, c0 + TC)``: 0 where not eligible, at least
    1 where eligible (``-inf`` and NaN are 1, below every finite value)."""
    j = c0 + tl.arange(0, TC)
    cid = tl.load(crow + j, mask=j < kb, other=-1).to(tl.int64)
    o = tl.arange(0, BP)
    col = cid[:, None] * BS + o[None, :]
    m = (cid[:, None] >= 0) & (o[None, :] < BS) & (col < n)
    x = tl.load(base + col, mask=m, other=float("-inf")).to(tl.float32)
    key = _sort_key(x)
    key = tl.where(m, tl.where(key == 0, 1, key), 0).to(tl.uint32)
    return tl.reshape(key, [TC * BP]), tl.reshape(col.to(tl.int32), [TC * BP])


@triton.jit
def _cand_hist(base, crow, n, kb, prefix, SHIFT_HI: tl.constexpr, SHIFT: tl.constexpr, NB: tl.constexpr,
               BS: tl.constexpr, BP: tl.constexpr, TC: tl.constexpr):
    hist = tl.zeros([NB], tl.int32)
    for c0 in range(0, kb, TC):
        key, pos = _cand_tile(base, crow, c0, n, kb, BS, BP, TC)
        hist += masked_hist(key, (key >> SHIFT_HI) == (prefix >> SHIFT_HI), SHIFT, NB, TC * BP)
    return hist


@triton.jit
def _candidate_topk_kernel(out_ptr, logits_ptr, starts_ptr, ends_ptr, cand_ptr, stride_l, stride_o, stride_c, topk,
                           kb, width, BS: tl.constexpr, BP: tl.constexpr, TC: tl.constexpr, NB: tl.constexpr,
                           DB: tl.constexpr):
    """One program per row: the ``topk`` largest eligible cells of the row's candidate blocks (all of them when
    there are at most ``topk``), by an exact radix select over keys recomputed from the candidate cells."""
    row = tl.program_id(0)
    start, n = _window(starts_ptr, ends_ptr, row, width)
    base = logits_ptr + row.to(tl.int64) * stride_l + start
    crow = cand_ptr + row.to(tl.int64) * stride_c
    orow = out_ptr + row.to(tl.int64) * stride_o
    hist = tl.zeros([NB], tl.int32)
    ne = n * 0
    for c0 in range(0, kb, TC):
        key, pos = _cand_tile(base, crow, c0, n, kb, BS, BP, TC)
        hist += tl.histogram((key >> (32 - DB)).to(tl.int32), NB)
        ne += tl.sum((key != 0).to(tl.int32), 0)
    thr = tl.zeros((), tl.uint32)  # at most topk eligible: every key > 0
    need_eq = ne * 0
    if ne > topk:
        krem = topk
        prefix = tl.zeros((), tl.uint32)
        for p in tl.static_range(32 // DB):
            if p > 0:
                hist = _cand_hist(base, crow, n, kb, prefix, 32 - DB * p, 32 - DB * (p + 1), NB, BS, BP, TC)
            d, krem = radix_digit(hist, krem, NB)
            prefix = prefix | (d.to(tl.uint32) << (32 - DB * (p + 1)))
        thr = prefix
        need_eq = krem
    k = tl.minimum(ne, topk)
    n_gt = k - need_eq
    ng = n * 0
    neq = n * 0
    for c0 in range(0, kb, TC):
        key, pos = _cand_tile(base, crow, c0, n, kb, BS, BP, TC)
        ng, neq = compact_tile(orow, key, pos, thr, need_eq, n_gt, ng, neq)
    fill_rest(orow, k, topk, 1024)


_CAND = Launcher(_candidate_topk_kernel)


@functools.lru_cache(maxsize=64)
def _cand_cfg(block_size: int):
    bp = triton.next_power_of_2(block_size)
    return _CAND.config(BS=block_size, BP=bp, TC=max(1, CAND_CELLS // bp), NB=RADIX_BINS, DB=RADIX_BITS,
                        num_warps=CAND_WARPS)


def candidate_top_k(logits, row_starts, row_ends, out, candidates, block_size) -> None:
    """The candidate-restricted top-k (arguments checked): one launch, no scratch."""
    r = logits.shape[0]
    if r == 0:
        return
    if triton.next_power_of_2(block_size) > CAND_CELLS:
        raise NotImplementedError(f"candidate blocks of {block_size} positions (the Triton top-k takes <= "
                                  f"{CAND_CELLS})")
    _CAND.launch_with((r,), _cand_cfg(block_size),
                      (out, logits, row_starts, row_ends, candidates, logits.stride(0), out.stride(0),
                       candidates.stride(0), out.shape[1], candidates.shape[1], logits.shape[1]), 5)
