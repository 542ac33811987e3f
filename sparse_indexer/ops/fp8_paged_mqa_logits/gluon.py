"""Gluon ``fp8_paged_mqa_logits`` for Hopper (sm_90): decode indexer scores streamed by TMA.

One persistent launch, split like the Triton kernel (``triton.py``): the key tiles of all requests
(``cdiv(min(max_limit[b], CAP), 64)`` tiles of 64 positions for request ``b``) form one global range cut into
``P`` equal contiguous pieces, one per CTA, so ragged lengths stay balanced; a piece may span several requests.

Each CTA is warp-specialized (``gl.warp_specialize``):

- a 1-warp *producer* walks its piece: it reads the block-table entries a chunk of ``CHUNK`` tiles at a time
  (one vector load, the next chunk's load issued before the current chunk is used), and per 64-key tile issues
  two TMA copies into a ``STAGES``-deep shared-memory ring guarded by ``ready``/``empty`` mbarriers: the tile's
  ``[64, 128]`` fp8 values (a 2-D descriptor over the cache read as rows of 128 bytes: block ``blk`` is rows
  ``blk * R .. blk * R + 63`` with ``R = block_stride / 128``) and its 64 float32 scales (a ``[num_blocks,
  block_stride / 4]`` float32 descriptor, columns ``BS * D / 4 ..``). Per request it also copies the
  ``next_n`` query tiles ``[64 heads, 128]`` into a ``QBUF``-deep buffer (``q_ready``/``q_empty``);
- ``NCONS`` (1 or 2) 4-warp *math* warpgroups take the CTA's tiles in turn. Per tile: ``next_n`` asynchronous
  ``warpgroup_mma(K [64 keys, 128], Q_j^T [128, 64 heads])`` (keys as M, heads as N: the head-sum is a reduction
  along N within a thread and its quad) and one wait, the stage released, then ``relu``, times the head weights,
  sum over heads, times the key scale, and a masked store of the 64 logits of each row (``pos < limit``).
  With ``PAIR`` a warpgroup takes its tiles two at a time and the second tile's wgmmas run during the first
  tile's epilogue. With ``WIDE`` (next_n 2 or 4; opt-in: measured slower, 176 vs 171 us at next_n=2) one wgmma
  per tile takes the stacked queries of all tokens as N = next_n * 64, so the key tile is read from shared memory
  once per k-step instead of once per token, and the epilogue sums each token's 64 columns after a reshape.

``config={"DIAG": True}`` is a measurement mode, not a result: the math warpgroups release every stage unread, so
the time is the TMA stream's alone (docs/benchmarks.md).

Values the checks would refuse (docs/spec.md §10): row limits are clamped to ``[0, CAP]``; a block id outside
the cache is copied as block ``num_blocks``, wholly past both descriptors, which TMA fills with zeros (a zero key:
in-window logits 0); an ``indices`` entry outside the block table has no tiles (empty windows).

With ``clean=True`` all warps then fill the columns at or past each row's limit with ``-inf`` (chunks of
``FILL_N`` columns shared round-robin, the Triton kernel's pass), disjoint from the cells the tile loop writes.

No host synchronisation and no allocation per call: the TMA descriptors are host ``TensorDescriptor`` objects
(kernel parameters: CUDA-graph capturable) built from pointers, shapes and strides and kept with their encoded
maps (_runtime/tma.py); the launch plan is cached per specialization. Cases the kernel does not take raise
``NotImplementedError`` before anything is written (see :func:`fp8_paged_mqa_logits`), so ``auto`` runs the Triton
backend for them; ``auto`` also leaves small calls to Triton (:data:`AUTO_MIN_KEY_BLOCKS`, the ``auto_when``
predicate: this launch costs more host time).
"""

from __future__ import annotations

import functools

import torch

from ..._runtime.launch import Launcher
from ..._runtime.tma import Descriptors
from .reference import fp8_paged_mqa_logits as _reference

try:  # Gluon (Triton >= 3.6); the module is imported only where the backend is available (backends.py)
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _GLUON = True
except ImportError:  # pragma: no cover - CPU CI with an older Triton: nothing below is used there
    _GLUON = False

__all__ = ["fp8_paged_mqa_logits"]

# Launch configuration, overridable per call with ``config=``. Shared memory per CTA: STAGES * 8448 B (values +
# scales, twice that with DUO) + QBUF * next_n * 8 KB of queries; registers: the warp-specialized CTA has 8 warps
# (12 with NCONS=2) of at most maxnreg registers. Chosen on an H200 by a sweep at B=64, L=64K (docs/kernels.md,
# "Paged decode logits, Gluon"): next_n=1 four CTAs per SM of one math warpgroup and 4 stages (147.3 us; 2 CTAs x
# 8 stages 150.2, two math warpgroups per CTA 147.8-151.4); next_n=2 tiles in pairs (168.7 us; 174.6 without), since
# 2026-12-01 two tiles per ring slot (DUO, 4 slots: 161.1 against 164.4 us with a clean L2; next_n=1 and 3 gain
# nothing or lose with it); next_n=3 two CTAs x 6 stages (221.7 us); next_n=4 one CTA of two math warpgroups
# (297.7 us; two CTAs of one: 298.2).
CONFIG = {"STAGES": 8, "CHUNK": 32, "ctas_per_sm": 2, "FILL_N": 1024, "maxnreg": 128, "NCONS": 1, "QBUF": 2,
          "CONS_REGS": 152, "PAIR": False, "DUO": False}
CONFIG_BY_NEXT_N: dict = {
    1: {"ctas_per_sm": 4, "STAGES": 4, "maxnreg": 64},
    2: {"DUO": True, "STAGES": 4},
    3: {"STAGES": 6},
    4: {"STAGES": 12, "NCONS": 2, "ctas_per_sm": 1, "maxnreg": 168, "CONS_REGS": 216},
}

_H, _D, _BS, _BLOCK_N = 64, 128, 64, 64  # the shapes the kernel is written for (DeepSeek-V3.2's indexer)


if _GLUON:

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _req_tiles(cl_ptr, idx_ptr, b, stride_clb, stride_cln, CAP, NR, NEXT_N: gl.constexpr, CL_2D: gl.constexpr,
                   HAS_IDX: gl.constexpr):
        """Key tiles of request ``b``: ``cdiv(min(max_limit, CAP), 64)`` (the largest row limit: the last token's
        for 1-D lengths); 0 for an entry whose ``indices`` value is outside ``[0, NR)`` (an empty window)."""
        m = gl.load(cl_ptr + b * stride_clb).to(gl.int32)
        if CL_2D:
            for j in gl.static_range(1, NEXT_N):
                m = gl.maximum(m, gl.load(cl_ptr + b * stride_clb + j * stride_cln).to(gl.int32))
        m = gl.minimum(gl.maximum(m, 0), CAP)
        if HAS_IDX:
            row = gl.load(idx_ptr + b)
            m = gl.where((row >= 0) & (row < NR), m, 0)
        return (m + 63) // 64

    @gluon.jit
    def _row_limit(cl_ptr, b, j: gl.constexpr, stride_clb, stride_cln, CAP, NEXT_N: gl.constexpr,
                   CL_2D: gl.constexpr):
        """``limit[b * next_n + j]`` (docs/spec.md §5) clamped to ``[0, CAP]``; 0 for ``j >= next_n``."""
        if j < NEXT_N:
            if CL_2D:
                lim = gl.load(cl_ptr + b * stride_clb + j * stride_cln).to(gl.int32)
            else:  # (the length clamped at 0 first: no int32 overflow below)
                lim = gl.maximum(gl.load(cl_ptr + b * stride_clb).to(gl.int32), 0) - NEXT_N + j + 1
            lim = gl.minimum(gl.maximum(lim, 0), CAP)
        else:
            lim = 0
        return lim

    @gluon.jit
    def _tile_copy(kv_desc, sc_desc, bar, k_ring, s_ring, slot, blk, R, SC_COL: gl.constexpr, sc_smem_l: gl.constexpr):
        """TMA copies of cache block ``blk``'s values and scales into ring entry ``slot``, counted on ``bar``."""
        tma.async_copy_global_to_shared(kv_desc, [blk * R, 0], bar, k_ring.index(slot))
        tma.async_copy_global_to_shared(sc_desc, [blk, SC_COL], bar,
                                        s_ring.index(slot)._reinterpret(gl.float32, [1, 64], sc_smem_l))

    @gluon.jit
    def _producer(kv_desc, sc_desc, q_desc, bt_ptr, idx_ptr, cl_ptr, k_ring, s_ring, q_buf, ready, empty,
                  q_ready, q_empty, start, end, b0, b_start0, stride_bt, stride_clb, stride_cln, CAP, R, NB, NR,
                  NEXT_N: gl.constexpr, CL_2D: gl.constexpr, HAS_IDX: gl.constexpr, STAGES: gl.constexpr,
                  CHUNK: gl.constexpr, QBUF: gl.constexpr, WIDE: gl.constexpr, DUO: gl.constexpr):
        """1 warp: block-table entries by the chunk, TMA copies of the values, scales and queries. ``DUO``: two
        tiles of a request per ring slot (one wait, one expect and one release for both). A block id outside
        ``[0, NB)`` is copied as block ``NB``, past the descriptors' rows: TMA fills its values and scales with
        zeros (a zero key, and no int32 overflow of ``blk * R`` for a huge id)."""
        SC_COL: gl.constexpr = 64 * 128 // 4  # float32 column of a block's first scale
        chunk_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        offs = gl.arange(0, CHUNK, layout=chunk_l)
        sc_smem_l: gl.constexpr = sc_desc.layout
        TILE_BYTES: gl.constexpr = 64 * 128 + 64 * 4
        Q_BYTES: gl.constexpr = NEXT_N * 64 * 128
        t = start
        b = b0
        b_start = b_start0
        it = 0
        k = 0
        while t < end:
            b_end = b_start + _req_tiles(cl_ptr, idx_ptr, b, stride_clb, stride_cln, CAP, NR, NEXT_N, CL_2D,
                                         HAS_IDX)
            if b_end > t:
                qs = k % QBUF
                mbarrier.wait(q_empty.index(qs), ((k // QBUF) & 1) ^ 1)
                mbarrier.expect(q_ready.index(qs), Q_BYTES)
                for j in gl.static_range(NEXT_N):
                    if WIDE:  # the tokens' tiles stacked: one [next_n * 64, 128] operand
                        tma.async_copy_global_to_shared(q_desc, [(b * NEXT_N + j) * 64, 0], q_ready.index(qs),
                                                        q_buf.index(qs).slice(j * 64, 64))
                    else:
                        tma.async_copy_global_to_shared(q_desc, [(b * NEXT_N + j) * 64, 0], q_ready.index(qs),
                                                        q_buf.index(qs * NEXT_N + j))
                k += 1
                if HAS_IDX:
                    row = gl.load(idx_ptr + b).to(gl.int64)
                else:
                    row = b.to(gl.int64)
                bt_row = bt_ptr + row * stride_bt
                t_lo = t - b_start
                t_hi = gl.minimum(end, b_end) - b_start
                nxt = gl.load(bt_row + t_lo + offs, mask=t_lo + offs < t_hi, other=0)
                for c0 in range(t_lo, t_hi, CHUNK):
                    cur = gl.where((nxt >= 0) & (nxt < NB), nxt, NB)  # (one entry per lane, once per chunk)
                    nxt = gl.load(bt_row + c0 + CHUNK + offs, mask=c0 + CHUNK + offs < t_hi, other=0)
                    n = gl.minimum(t_hi - c0, CHUNK)
                    if DUO:  # tiles (c0 + i, c0 + i + 1) of the request in slot s (CHUNK is even: pairs from t_lo)
                        for i in range(0, n, 2):
                            blk = gl.sum(gl.where(offs == i, cur, 0), axis=0).to(gl.int32)
                            s = it % STAGES
                            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                            bar = ready.index(s)
                            if i + 1 < n:
                                blk2 = gl.sum(gl.where(offs == i + 1, cur, 0), axis=0).to(gl.int32)
                                mbarrier.expect(bar, 2 * TILE_BYTES)
                                _tile_copy(kv_desc, sc_desc, bar, k_ring, s_ring, 2 * s, blk, R, SC_COL, sc_smem_l)
                                _tile_copy(kv_desc, sc_desc, bar, k_ring, s_ring, 2 * s + 1, blk2, R, SC_COL,
                                           sc_smem_l)
                            else:
                                mbarrier.expect(bar, TILE_BYTES)
                                _tile_copy(kv_desc, sc_desc, bar, k_ring, s_ring, 2 * s, blk, R, SC_COL, sc_smem_l)
                            it += 1
                    else:
                        for i in range(n):
                            blk = gl.sum(gl.where(offs == i, cur, 0), axis=0).to(gl.int32)  # TMA coordinates
                            s = it % STAGES
                            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                            bar = ready.index(s)
                            mbarrier.expect(bar, TILE_BYTES)
                            _tile_copy(kv_desc, sc_desc, bar, k_ring, s_ring, s, blk, R, SC_COL, sc_smem_l)
                            it += 1
                t = gl.minimum(end, b_end)
            b += 1
            b_start = b_end

    @gluon.jit
    def _token_epilogue(acc, w, ksc, out_row, pos, lim):
        """Row ``out_row``'s 64 logits of one tile: ``sum_h relu(acc) * w[h]`` times the key scales, stored where
        ``pos < lim``."""
        logit = gl.sum(gl.maximum(acc, 0.0) * w[None, :], axis=1) * ksc
        gl.store(out_row + pos, logit.to(out_row.dtype.element_ty), mask=pos < lim)

    @gluon.jit
    def _mma_issue(kt, q_buf, qb, zero, NEXT_N: gl.constexpr):
        """The ``next_n`` wgmmas ``K [64, 128] x Q_j^T [128, 64]`` of one tile, issued asynchronously (the unused
        slots of the 4-tuple repeat the first)."""
        a0 = warpgroup_mma(kt, q_buf.index(qb).permute((1, 0)), zero, use_acc=False, is_async=True)
        a1 = a0
        a2 = a0
        a3 = a0
        if NEXT_N > 1:
            a1 = warpgroup_mma(kt, q_buf.index(qb + 1).permute((1, 0)), zero, use_acc=False, is_async=True)
        if NEXT_N > 2:
            a2 = warpgroup_mma(kt, q_buf.index(qb + 2).permute((1, 0)), zero, use_acc=False, is_async=True)
        if NEXT_N > 3:
            a3 = warpgroup_mma(kt, q_buf.index(qb + 3).permute((1, 0)), zero, use_acc=False, is_async=True)
        return a0, a1, a2, a3

    @gluon.jit
    def _mma_wait(a0, a1, a2, a3, NEXT_N: gl.constexpr):
        """Wait for :func:`_mma_issue`'s wgmmas; their accumulators (unused slots repeat the first)."""
        if NEXT_N == 1:
            r0 = warpgroup_mma_wait(0, deps=[a0])
            r1 = r0
            r2 = r0
            r3 = r0
        elif NEXT_N == 2:
            r0, r1 = warpgroup_mma_wait(0, deps=[a0, a1])
            r2 = r0
            r3 = r0
        elif NEXT_N == 3:
            r0, r1, r2 = warpgroup_mma_wait(0, deps=[a0, a1, a2])
            r3 = r0
        else:
            r0, r1, r2, r3 = warpgroup_mma_wait(0, deps=[a0, a1, a2, a3])
        return r0, r1, r2, r3

    @gluon.jit
    def _take(k_ring, s_ring, ready, empty, q_buf, qb, zero, g, STAGES: gl.constexpr, NEXT_N: gl.constexpr,
              row_l: gl.constexpr):
        """Consume ring slot ``g % STAGES``: wait for its tile, run the wgmmas, read the key scales, release the
        slot. Returns the accumulators (:func:`_mma_wait`) and the scales."""
        s = g % STAGES
        mbarrier.wait(ready.index(s), (g // STAGES) & 1)
        a0, a1, a2, a3 = _mma_issue(k_ring.index(s), q_buf, qb, zero, NEXT_N)
        ksc = s_ring.index(s).load(row_l)
        c0, c1, c2, c3 = _mma_wait(a0, a1, a2, a3, NEXT_N)
        mbarrier.arrive(empty.index(s), count=1)
        return c0, c1, c2, c3, ksc

    @gluon.jit
    def _epilogue(c0, c1, c2, c3, w0, w1, w2, w3, lim0, lim1, lim2, lim3, ksc, out_row0, stride_out, pos,
                  NEXT_N: gl.constexpr):
        _token_epilogue(c0, w0, ksc, out_row0, pos, lim0)
        if NEXT_N > 1:
            _token_epilogue(c1, w1, ksc, out_row0 + stride_out, pos, lim1)
        if NEXT_N > 2:
            _token_epilogue(c2, w2, ksc, out_row0 + 2 * stride_out, pos, lim2)
        if NEXT_N > 3:
            _token_epilogue(c3, w3, ksc, out_row0 + 3 * stride_out, pos, lim3)

    @gluon.jit
    def _consumer(out_ptr, w_ptr, cl_ptr, idx_ptr, k_ring, s_ring, q_buf, ready, empty, q_ready, q_empty, start, end,
                  b0, b_start0, stride_out, stride_w, stride_clb, stride_cln, CAP, NR, X: gl.constexpr,
                  NCONS: gl.constexpr, NEXT_N: gl.constexpr, CL_2D: gl.constexpr, HAS_IDX: gl.constexpr,
                  STAGES: gl.constexpr, QBUF: gl.constexpr,
                  DIAG: gl.constexpr, PAIR: gl.constexpr, WIDE: gl.constexpr, DUO: gl.constexpr):
        """Math warpgroup ``X`` of ``NCONS``: it takes the CTA's tiles ``X, X + NCONS, ...``; per tile the
        ``next_n`` wgmmas (issued together, one wait), the relu/weight/head-sum epilogue and a masked store.
        ``PAIR``: tiles two at a time, the second tile's wgmmas running during the first tile's epilogue. ``DUO``
        (one math warpgroup): the same, with both tiles in one ring slot, so one wait and one release per pair
        (Triton puts a warpgroup barrier before each mbarrier wait and arrive)."""
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, 64, 32])
        row_l: gl.constexpr = gl.SliceLayout(1, mma_l)  # along the keys (M)
        col_l: gl.constexpr = gl.SliceLayout(0, mma_l)  # along the heads (N)
        offs_n = gl.arange(0, 64, layout=row_l)
        offs_h = gl.arange(0, 64, layout=col_l)
        zero = gl.zeros([64, 64], gl.float32, mma_l)
        t = start
        b = b0
        b_start = b_start0
        it = 0  # the CTA's tiles before the current request
        k = 0
        while t < end:
            b_end = b_start + _req_tiles(cl_ptr, idx_ptr, b, stride_clb, stride_cln, CAP, NR, NEXT_N, CL_2D,
                                         HAS_IDX)
            if b_end > t:
                r0 = b.to(gl.int64) * NEXT_N
                w0 = gl.load(w_ptr + r0 * stride_w + offs_h)
                w1 = w0
                w2 = w0
                w3 = w0
                if NEXT_N > 1:
                    w1 = gl.load(w_ptr + (r0 + 1) * stride_w + offs_h)
                if NEXT_N > 2:
                    w2 = gl.load(w_ptr + (r0 + 2) * stride_w + offs_h)
                if NEXT_N > 3:
                    w3 = gl.load(w_ptr + (r0 + 3) * stride_w + offs_h)
                lim0 = _row_limit(cl_ptr, b, 0, stride_clb, stride_cln, CAP, NEXT_N, CL_2D)
                lim1 = _row_limit(cl_ptr, b, 1, stride_clb, stride_cln, CAP, NEXT_N, CL_2D)
                lim2 = _row_limit(cl_ptr, b, 2, stride_clb, stride_cln, CAP, NEXT_N, CL_2D)
                lim3 = _row_limit(cl_ptr, b, 3, stride_clb, stride_cln, CAP, NEXT_N, CL_2D)
                out_row0 = out_ptr + r0 * stride_out
                qs = k % QBUF
                mbarrier.wait(q_ready.index(qs), (k // QBUF) & 1)
                qb = qs * NEXT_N
                t_lo = t - b_start
                n_t = gl.minimum(end, b_end) - t
                first = (X + NCONS - it % NCONS) % NCONS
                if DIAG:  # measuring the stream alone: every stage released unread
                    for i in range(first, n_t, NCONS):
                        g = it + i
                        mbarrier.wait(ready.index(g % STAGES), (g // STAGES) & 1)
                        mbarrier.arrive(empty.index(g % STAGES), count=1)
                elif WIDE:
                    # one wgmma per tile with the next_n tokens' heads as N (next_n * 64): the key tile is read
                    # from shared memory once per k-step instead of once per token
                    mma_w: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                    instr_shape=[16, NEXT_N * 64, 32])
                    out_l: gl.constexpr = gl.BlockedLayout([1, NEXT_N], [32, 1], [4, 1], [1, 0])
                    cols = gl.arange(0, NEXT_N * 64, layout=gl.SliceLayout(0, mma_w))
                    w_all = gl.load(w_ptr + (r0 + cols // 64) * stride_w + cols % 64)
                    zero_w = gl.zeros([64, NEXT_N * 64], gl.float32, mma_w)
                    ro = gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))
                    jo = gl.arange(0, NEXT_N, layout=gl.SliceLayout(0, out_l))
                    lims = gl.where(jo == 0, lim0, gl.where(jo == 1, lim1, gl.where(jo == 2, lim2, lim3)))
                    rows = out_row0 + jo.to(gl.int64) * stride_out
                    qv = q_buf.index(qs).permute((1, 0))
                    for i in range(first, n_t, NCONS):
                        g = it + i
                        s = g % STAGES
                        mbarrier.wait(ready.index(s), (g // STAGES) & 1)
                        acc = warpgroup_mma(k_ring.index(s), qv, zero_w, use_acc=False, is_async=True)
                        ksc = s_ring.index(s).load(gl.SliceLayout(1, out_l))
                        acc = warpgroup_mma_wait(0, deps=[acc])
                        mbarrier.arrive(empty.index(s), count=1)
                        x = gl.reshape(gl.maximum(acc, 0.0) * w_all[None, :], [64, NEXT_N, 64])
                        lg = gl.convert_layout(gl.sum(x, axis=2), out_l) * ksc[:, None]
                        pos = (t_lo + i) * 64 + ro
                        gl.store(rows[None, :] + pos[:, None], lg.to(out_ptr.dtype.element_ty),
                                 mask=pos[:, None] < lims[None, :])
                elif DUO:
                    for i in range(0, n_t, 2):
                        g = it + i // 2
                        s = g % STAGES
                        mbarrier.wait(ready.index(s), (g // STAGES) & 1)
                        a0, a1, a2, a3 = _mma_issue(k_ring.index(2 * s), q_buf, qb, zero, NEXT_N)
                        ksc = s_ring.index(2 * s).load(row_l)
                        c0, c1, c2, c3 = _mma_wait(a0, a1, a2, a3, NEXT_N)
                        pos = (t_lo + i) * 64 + offs_n
                        if i + 1 < n_t:
                            d0, d1, d2, d3 = _mma_issue(k_ring.index(2 * s + 1), q_buf, qb, zero, NEXT_N)
                            _epilogue(c0, c1, c2, c3, w0, w1, w2, w3, lim0, lim1, lim2, lim3, ksc, out_row0,
                                      stride_out, pos, NEXT_N)
                            ksc2 = s_ring.index(2 * s + 1).load(row_l)
                            e0, e1, e2, e3 = _mma_wait(d0, d1, d2, d3, NEXT_N)
                            mbarrier.arrive(empty.index(s), count=1)
                            _epilogue(e0, e1, e2, e3, w0, w1, w2, w3, lim0, lim1, lim2, lim3, ksc2, out_row0,
                                      stride_out, pos + 64, NEXT_N)
                        else:
                            mbarrier.arrive(empty.index(s), count=1)
                            _epilogue(c0, c1, c2, c3, w0, w1, w2, w3, lim0, lim1, lim2, lim3, ksc, out_row0,
                                      stride_out, pos, NEXT_N)
                elif PAIR:
                    for i in range(first, n_t, 2 * NCONS):
                        g = it + i
                        c0, c1, c2, c3, ksc = _take(k_ring, s_ring, ready, empty, q_buf, qb, zero, g, STAGES,
                                                    NEXT_N, row_l)
                        pos = (t_lo + i) * 64 + offs_n
                        if i + NCONS < n_t:
                            g2 = g + NCONS
                            s2 = g2 % STAGES
                            mbarrier.wait(ready.index(s2), (g2 // STAGES) & 1)
                            d0, d1, d2, d3 = _mma_issue(k_ring.index(s2), q_buf, qb, zero, NEXT_N)
                            _epilogue(c0, c1, c2, c3, w0, w1, w2, w3, lim0, lim1, lim2, lim3, ksc, out_row0,
                                      stride_out, pos, NEXT_N)
                            ksc2 = s_ring.index(s2).load(row_l)
                            e0, e1, e2, e3 = _mma_wait(d0, d1, d2, d3, NEXT_N)
                            mbarrier.arrive(empty.index(s2), count=1)
                            _epilogue(e0, e1, e2, e3, w0, w1, w2, w3, lim0, lim1, lim2, lim3, ksc2, out_row0,
                                      stride_out, pos + NCONS * 64, NEXT_N)
                        else:
                            _epilogue(c0, c1, c2, c3, w0, w1, w2, w3, lim0, lim1, lim2, lim3, ksc, out_row0,
                                      stride_out, pos, NEXT_N)
                else:
                    for i in range(first, n_t, NCONS):
                        c0, c1, c2, c3, ksc = _take(k_ring, s_ring, ready, empty, q_buf, qb, zero, it + i, STAGES,
                                                    NEXT_N, row_l)
                        _epilogue(c0, c1, c2, c3, w0, w1, w2, w3, lim0, lim1, lim2, lim3, ksc, out_row0, stride_out,
                                  (t_lo + i) * 64 + offs_n, NEXT_N)
                mbarrier.arrive(q_empty.index(qs), count=1)
                if DUO:
                    it += (n_t + 1) // 2  # slots
                else:
                    it += n_t
                k += 1
                t = gl.minimum(end, b_end)
            b += 1
            b_start = b_end

    @gluon.jit(do_not_specialize=["NUM_PROGRAMS"])
    def _paged_logits_kernel(
        out_ptr,  # [B * next_n, W] float32 or bfloat16, row stride stride_out
        kv_desc,  # TMA: the cache's bytes as fp8 rows of 128, [num_blocks * R, 128], box [64, 128]
        sc_desc,  # TMA: the cache as float32 [num_blocks, block_stride / 4], box [1, 64]
        q_desc,  # TMA: q as [B * next_n * 64, 128] fp8, box [64, 128]
        w_ptr,  # [B * next_n, 64] float32, row stride stride_w
        cl_ptr,  # [B] or [B, next_n] int32/int64
        bt_ptr,  # [B, max_blocks] int32/int64 (HAS_IDX: [num_requests, max_blocks])
        idx_ptr,  # [B] block-table row of each entry (read only when HAS_IDX)
        B, W, CAP, R,  # CAP = min(W, max_blocks * 64); R = block_stride / 128
        NB, NR,  # cache blocks, block-table rows: ids outside [0, NB) score as zero keys, indices outside [0, NR) empty
        stride_out, stride_w, stride_clb, stride_cln, stride_bt,
        NUM_PROGRAMS,
        NEXT_N: gl.constexpr, CL_2D: gl.constexpr, CLEAN: gl.constexpr, HAS_IDX: gl.constexpr,
        BLOCK_B: gl.constexpr, STAGES: gl.constexpr, CHUNK: gl.constexpr, FILL_N: gl.constexpr,
        NCONS: gl.constexpr, QBUF: gl.constexpr, CONS_REGS: gl.constexpr, DIAG: gl.constexpr, PAIR: gl.constexpr,
        WIDE: gl.constexpr, DUO: gl.constexpr, num_warps: gl.constexpr,
    ):
        pid = gl.program_id(0)
        # This CTA's piece [start, end) of the global tile range, its first request b0 and where b0's tiles start.
        if BLOCK_B <= 256:  # every warp holds all B (its reductions stay in the warp: shuffles, no bar.sync)
            b_l: gl.constexpr = gl.BlockedLayout([BLOCK_B // 32], [32], [num_warps], [0])
        else:  # B spread over the warps (fewer registers per thread)
            b_l: gl.constexpr = gl.BlockedLayout([max(1, BLOCK_B // (32 * num_warps))], [32], [num_warps], [0])
        offs_b = gl.arange(0, BLOCK_B, layout=b_l)
        bmask = offs_b < B
        maxlim = gl.load(cl_ptr + offs_b * stride_clb, mask=bmask, other=0).to(gl.int32)
        if CL_2D:
            for j in gl.static_range(1, NEXT_N):
                c = gl.load(cl_ptr + offs_b * stride_clb + j * stride_cln, mask=bmask, other=0).to(gl.int32)
                maxlim = gl.maximum(maxlim, c)
        maxlim = gl.minimum(gl.maximum(maxlim, 0), CAP)
        if HAS_IDX:  # an entry whose block-table row is outside the table: an empty window
            iv = gl.load(idx_ptr + offs_b, mask=bmask, other=0)
            maxlim = gl.where((iv >= 0) & (iv < NR), maxlim, 0)
        tiles = (maxlim + 63) // 64
        cum_end = gl.associative_scan(tiles, 0, _add)
        total = gl.sum(tiles, axis=0)
        start = (pid.to(gl.int64) * total // NUM_PROGRAMS).to(gl.int32)
        end = ((pid + 1).to(gl.int64) * total // NUM_PROGRAMS).to(gl.int32)
        b0 = gl.sum((cum_end <= start).to(gl.int32), axis=0)
        b_start0 = gl.sum(gl.where(offs_b == b0, cum_end - tiles, 0), axis=0)

        TILES: gl.constexpr = 2 * STAGES if DUO else STAGES  # ring entries (DUO: two per slot)
        k_ring = gl.allocate_shared_memory(gl.float8e4nv, [TILES, 64, 128], kv_desc.layout)
        s_ring = gl.allocate_shared_memory(gl.float32, [TILES, 64], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        if WIDE:
            q_buf = gl.allocate_shared_memory(gl.float8e4nv, [QBUF, NEXT_N * 64, 128], q_desc.layout)
        else:
            q_buf = gl.allocate_shared_memory(gl.float8e4nv, [QBUF * NEXT_N, 64, 128], q_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [QBUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(QBUF):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=NCONS)  # every math warpgroup releases the queries

        if NCONS == 1:
            gl.warp_specialize([
                (_consumer, (out_ptr, w_ptr, cl_ptr, idx_ptr, k_ring, s_ring, q_buf, ready, empty, q_ready, q_empty,
                             start, end, b0, b_start0, stride_out, stride_w, stride_clb, stride_cln, CAP, NR, 0, 1,
                             NEXT_N, CL_2D, HAS_IDX, STAGES, QBUF, DIAG, PAIR, WIDE, DUO)),
                (_producer, (kv_desc, sc_desc, q_desc, bt_ptr, idx_ptr, cl_ptr, k_ring, s_ring, q_buf, ready, empty,
                             q_ready, q_empty, start, end, b0, b_start0, stride_bt, stride_clb, stride_cln, CAP, R,
                             NB, NR, NEXT_N, CL_2D, HAS_IDX, STAGES, CHUNK, QBUF, WIDE, DUO)),
            ], [1], [40])
        else:
            gl.warp_specialize([
                (_consumer, (out_ptr, w_ptr, cl_ptr, idx_ptr, k_ring, s_ring, q_buf, ready, empty, q_ready, q_empty,
                             start, end, b0, b_start0, stride_out, stride_w, stride_clb, stride_cln, CAP, NR, 0, 2,
                             NEXT_N, CL_2D, HAS_IDX, STAGES, QBUF, DIAG, PAIR, WIDE, DUO)),
                (_consumer, (out_ptr, w_ptr, cl_ptr, idx_ptr, k_ring, s_ring, q_buf, ready, empty, q_ready, q_empty,
                             start, end, b0, b_start0, stride_out, stride_w, stride_clb, stride_cln, CAP, NR, 1, 2,
                             NEXT_N, CL_2D, HAS_IDX, STAGES, QBUF, DIAG, PAIR, WIDE, DUO)),
                (_producer, (kv_desc, sc_desc, q_desc, bt_ptr, idx_ptr, cl_ptr, k_ring, s_ring, q_buf, ready, empty,
                             q_ready, q_empty, start, end, b0, b_start0, stride_bt, stride_clb, stride_cln, CAP, R,
                             NB, NR, NEXT_N, CL_2D, HAS_IDX, STAGES, CHUNK, QBUF, WIDE, DUO)),
            ], [4, 1], [CONS_REGS, 40])

        if CLEAN:
            # Cells at or past each row's limit: -inf, chunks of FILL_N columns shared round-robin.
            fill_l: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
            offs_f = gl.arange(0, FILL_N, layout=fill_l)
            ninf = gl.full([FILL_N], float("-inf"), gl.float32, fill_l).to(out_ptr.dtype.element_ty)
            chunks = gl.cdiv(W, FILL_N)
            for c in range(pid, B * NEXT_N * chunks, NUM_PROGRAMS):
                r = c // chunks
                col0 = (c % chunks) * FILL_N
                fb = r // NEXT_N
                fj = r % NEXT_N
                if CL_2D:
                    flim = gl.load(cl_ptr + fb * stride_clb + fj * stride_cln).to(gl.int32)
                else:  # (the length clamped at 0 first: no int32 overflow below)
                    flim = gl.maximum(gl.load(cl_ptr + fb * stride_clb).to(gl.int32), 0) - NEXT_N + fj + 1
                flim = gl.minimum(gl.maximum(flim, 0), CAP)
                if HAS_IDX:  # an entry whose block-table row is outside the table: an empty window
                    frow = gl.load(idx_ptr + fb)
                    flim = gl.where((frow >= 0) & (frow < NR), flim, 0)
                if col0 + FILL_N > flim:
                    cols = col0 + offs_f
                    gl.store(out_ptr + r.to(gl.int64) * stride_out + cols, ninf, mask=(cols >= flim) & (cols < W))


_LAUNCH = Launcher(_paged_logits_kernel) if _GLUON else None


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


_FP8 = (torch.float8_e4m3fn,)
_PLANS: dict = {}  # specialization -> (LaunchConfig of the constexprs and launch options, CTAs)
_DESCS = Descriptors(TensorDescriptor) if _GLUON else None  # the TMA descriptors of recent calls (_tma.py)


@functools.cache
def _layouts():
    return (gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))


def unsupported_reason(q, kv_cache, weights, context_lens, block_table, out, indices=None) -> str | None:
    """Why the Gluon kernel cannot take this (checked) call, or ``None``."""
    if not _GLUON:
        return "triton.experimental.gluon (Triton >= 3.6) is not importable"
    b, next_n, h, d = q.shape
    nb, bs, width = kv_cache.shape
    if q.device.type != "cuda" or torch.version.hip is not None:
        return f"gluon fp8_paged_mqa_logits runs on NVIDIA Hopper GPUs, not {q.device}"
    if _capability(q.device.index if q.device.index is not None else torch.cuda.current_device()) != (9, 0):
        return "gluon fp8_paged_mqa_logits needs sm_90 (wgmma, TMA)"
    if (h, d, bs) != (_H, _D, _BS):
        return f"gluon fp8_paged_mqa_logits handles H=64, D=128, block_size=64, got H={h}, D={d}, {bs=}"
    if not 1 <= next_n <= 4:
        return f"gluon fp8_paged_mqa_logits handles next_n in 1..4, got {next_n=}"
    if q.dtype not in _FP8:
        return f"gluon fp8_paged_mqa_logits handles float8_e4m3fn queries, got {q.dtype}"
    if out.dtype not in (torch.float32, torch.bfloat16):
        return f"gluon fp8_paged_mqa_logits writes float32 or bfloat16, got {out.dtype}"
    stride0 = kv_cache.stride(0) if nb > 1 else bs * width
    if kv_cache.data_ptr() % 16 or stride0 % 128:
        return ("gluon fp8_paged_mqa_logits needs a 16-byte aligned cache with a block stride that is a multiple of "
                f"128 bytes (TMA rows), got data_ptr % 16 = {kv_cache.data_ptr() % 16}, block stride {stride0}")
    if q.stride(3) != 1 or q.stride(2) != d or q.stride(1) != h * d or (b > 1 and q.stride(0) != next_n * h * d) \
            or q.data_ptr() % 16:
        return f"gluon fp8_paged_mqa_logits needs a contiguous, 16-byte aligned q, got strides {q.stride()}"
    if (nb + 1) * (stride0 // 128) >= 2**31 or b * next_n * h >= 2**31:  # (block nb: the zero key's coordinate)
        return "gluon fp8_paged_mqa_logits: TMA coordinates are int32"
    return None


def _wide(cfg: dict, next_n: int) -> bool:
    """``WIDE`` where it compiles: N = next_n * 64 must be a power of two, and next_n = 4's [64, 256] accumulator
    needs a single math warpgroup with >= 168 registers."""
    if not cfg.get("WIDE", False) or next_n not in (2, 4):
        return False
    return next_n == 2 or (int(cfg.get("NCONS", 1)) == 1 and int(cfg.get("maxnreg") or 255) >= 168)


def _plan(q, out, context_lens, block_table, next_n: int, b: int, cl_2d: bool, clean: bool, has_idx: bool, config):
    cfg = {**CONFIG, **CONFIG_BY_NEXT_N.get(next_n, {}), **(config or {})}
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    kwargs = dict(NEXT_N=next_n, CL_2D=cl_2d, CLEAN=bool(clean), HAS_IDX=has_idx,
                  BLOCK_B=max(32, triton.next_power_of_2(b)), STAGES=int(cfg["STAGES"]), CHUNK=int(cfg["CHUNK"]),
                  FILL_N=int(cfg["FILL_N"]), NCONS=int(cfg["NCONS"]), QBUF=int(cfg["QBUF"]),
                  CONS_REGS=int(cfg["CONS_REGS"]), DIAG=bool(cfg.get("DIAG", False)),
                  PAIR=bool(cfg.get("PAIR", False)), WIDE=_wide(cfg, next_n),
                  num_warps=4)
    # DUO (two tiles per ring slot) where it is written: one math warpgroup, the per-token wgmmas, an even CHUNK
    kwargs["DUO"] = (bool(cfg.get("DUO", False)) and kwargs["NCONS"] == 1 and not kwargs["WIDE"]
                     and not kwargs["DIAG"] and kwargs["CHUNK"] % 2 == 0)
    if cfg.get("maxnreg"):
        kwargs["maxnreg"] = int(cfg["maxnreg"])
    return _LAUNCH.config(**kwargs), _num_sms(dev) * int(cfg["ctas_per_sm"])


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, *, out, clean, indices=None,
                         config=None, cache_fp8_dtype=None, cache_scale="float32", cache_order="flat",
                         cache_values="fp8", q_scale=None) -> None:
    """See :func:`sparse_indexer.fp8_paged_mqa_logits`; ``kv_cache`` is the 3-D view, arguments are checked.

    Handles ``H = 64``, ``D = 128``, ``block_size = 64``, ``next_n`` 1..4, float8_e4m3fn ``q`` (contiguous), a
    16-byte aligned cache whose block stride is a multiple of 128 bytes, float32 or bfloat16 ``out``, 1-D or 2-D
    ``context_lens``, ``indices``; anything else raises ``NotImplementedError`` before writing. ``config``
    overrides :data:`CONFIG` and :data:`CONFIG_BY_NEXT_N` (``STAGES``, ``CHUNK``, ``ctas_per_sm``, ``FILL_N``,
    ``maxnreg``, ``NCONS``, ``QBUF``, ``CONS_REGS``, ``PAIR``, ``DUO``, ``WIDE``, ``DIAG``); the plan is then not
    cached."""
    if cache_values != "fp8" or q_scale is not None:
        raise NotImplementedError("the Gluon backend does not score MXFP4 caches (docs/spec.md §3a)")
    if cache_fp8_dtype is not None and cache_fp8_dtype != q.dtype:
        raise NotImplementedError(f"{q.dtype} queries against a {cache_fp8_dtype} cache (a declared mix of formats)")
    if cache_scale != "float32" or cache_order != "flat":
        raise NotImplementedError(f"gluon fp8_paged_mqa_logits reads float32 scales in the flat order, got "
                                  f"{cache_scale!r}, {cache_order!r}")
    why = unsupported_reason(q, kv_cache, weights, context_lens, block_table, out, indices)
    if why is not None:
        raise NotImplementedError(why)
    b, next_n, h, d = q.shape
    nb, bs, width = kv_cache.shape
    w = out.shape[1]
    if b == 0 or w == 0:
        return
    if nb == 0:  # no key to read (every in-window cell is a zero key's); a TMA descriptor needs rows
        _reference(q, kv_cache, weights, context_lens, block_table, out=out, clean=clean, indices=indices)
        return
    stride0 = kv_cache.stride(0) if nb > 1 else bs * width
    rows_per_block = stride0 // 128
    l8, l32 = _layouts()
    base = kv_cache.data_ptr()
    kv_desc = _DESCS.get(base, q.dtype, (nb * rows_per_block, 128), (128, 1), (64, 128), l8)
    sc_desc = _DESCS.get(base, torch.float32, (nb, stride0 // 4), (stride0 // 4, 1), (1, 64), l32)
    q_desc = _DESCS.get(q.data_ptr(), q.dtype, (b * next_n * h, d), (d, 1), (64, 128), l8)
    max_blocks = block_table.shape[1]
    cl_2d = context_lens.dim() == 2
    has_idx = indices is not None
    key = (q.device, out.dtype, context_lens.dtype, block_table.dtype, next_n, (b - 1).bit_length(), cl_2d,
           bool(clean), has_idx)
    plan = _PLANS.get(key) if config is None else None
    if plan is None:
        plan = _plan(q, out, context_lens, block_table, next_n, b, cl_2d, clean, has_idx, config)
        if config is None:
            _PLANS[key] = plan
    cfg, programs = plan
    cls = context_lens.stride()
    # bound launch (sparse_indexer/_runtime/launch.py): Triton's own launch path re-specializes every argument per call
    _LAUNCH.launch_with((programs,), cfg, (
        out, kv_desc, sc_desc, q_desc, weights, context_lens, block_table,
        indices if has_idx else context_lens, b, w, min(w, max_blocks * bs), rows_per_block, nb,
        block_table.shape[0], out.stride(0), weights.stride(0), cls[0], cls[1] if cl_2d else 0,
        block_table.stride(0), programs))


AUTO_MIN_KEY_BLOCKS = 32768
"""``auto`` runs this kernel when ``B * next_n * max_blocks`` (the key blocks the rows can score) is at least this
(2M keys of block 64: about 65 us of copy floor on an H200), the Triton kernel below it. Its launch costs more
host time than Triton's (46-47 vs 30.5 us per public call on the H200's host on 2026-12-01, with the three TMA
descriptors and their encoded maps kept: sparse_indexer/_runtime/tma.py; 57 vs 23 us when Triton's launcher encoded them
per call), which its 3% of device time repays only where the GPU, not the host, is the bottleneck
(docs/benchmarks.md, "Host cost per eager call"). An explicit ``backend="gluon"`` always runs it."""


AUTO_MIN_KEY_BLOCKS_GRAPHED = 8192
"""``auto`` runs this kernel from this many key blocks (512K keys) when the call is captured into a CUDA graph,
where the launch's host time is paid once, at capture, and only device time counts. Measured on the H200
(2026-12-03, graphed, L2 flushed, against the Triton kernel): 64 x 16K keys 48.2 against 50.8 us, 64 x 16K at
next_n 2 53.0 against 55.6, 32 x 16K at next_n 2 33.2 against 36.9, 8 x 64K at next_n 2 33.0 against 36.4, 64 x 8K
30.3 against 31.9, 32 x 16K 30.0 against 30.7; level below (4096 blocks: 19.3-19.5 against 19.2-20.7; 1 x 64K
10.5 against 10.8)."""


def _capturing(q) -> bool:
    """Whether the current CUDA stream of ``q``'s device is capturing a CUDA graph."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def _auto_when(q, kv_cache, weights, context_lens, block_table, *, out, clean, indices=None, config=None,
               cache_fp8_dtype=None, cache_scale="float32", cache_order="flat", cache_values="fp8",
               q_scale=None) -> bool:
    """``auto`` takes this backend for this call (sparse_indexer/_runtime/dispatch.py): from
    :data:`AUTO_MIN_KEY_BLOCKS` key blocks, or from :data:`AUTO_MIN_KEY_BLOCKS_GRAPHED` in a CUDA-graph capture
    (``q.numel() >> 13`` is ``B * next_n`` at the H = 64, D = 128 this kernel runs; other shapes it refuses); never
    an MXFP4 cache (the kernel reads FP8). Reads the shapes and, in the band between the two thresholds, whether
    the stream is capturing (``graph_aware``: its answers are not remembered per layout)."""
    if cache_values != "fp8" or q_scale is not None:
        return False
    blocks = (q.numel() >> 13) * block_table.shape[1]
    if blocks >= AUTO_MIN_KEY_BLOCKS:
        return True
    return blocks >= AUTO_MIN_KEY_BLOCKS_GRAPHED and _capturing(q)


_auto_when.graph_aware = True
fp8_paged_mqa_logits.auto_when = _auto_when
