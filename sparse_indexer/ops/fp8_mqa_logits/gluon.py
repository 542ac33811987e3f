"""Gluon ``fp8_mqa_logits`` for Hopper (sm_90): ragged (prefill) indexer scores, warp-specialized.

One persistent CTA per SM walks blocks of ``BLOCK_Q`` consecutive query tokens (the longest rows first, blocks
dealt to the CTAs in a snake order so every CTA gets a similar amount of keys). Per CTA three partitions
(``gl.warp_specialize``):

- a 1-warp TMA producer: the block's ``[BLOCK_Q * 64, 128]`` fp8 queries into one of two shared-memory
  buffers (the next block's queries load while the current block runs), then the 64-key tiles ``[64, 128]`` of
  the union of the block's windows into a ``STAGES``-deep ring guarded by mbarriers;
- two math warpgroups (ping-pong): tile ``i`` of the ring goes to warpgroup ``i % 2``, which runs
  ``warpgroup_mma(K [64, 128] (M = keys), Q^T [128, BLOCK_Q / 2 * 64])`` twice (fp8, float32 accumulation; the
  two halves of the block's tokens), then the epilogue of the first half while the second half's MMA runs,
  frees the ring slot and does the second half's epilogue (``relu``, times the head weights held in registers,
  sum over each token's 64 heads: a reduction inside a thread plus two shuffles in its quad, times the key
  scale, masked store of ``[64 keys, BLOCK_Q / 2 tokens]``); the other warpgroup's MMAs keep the tensor cores
  busy meanwhile. ``config={"PIPE": True}`` rolls the halves across tiles (the next tile's first half in
  flight during this tile's second epilogue); ptxas serializes that wgmma pipeline (C7514) and it measured
  slower, so it is off.

H200 (docs/benchmarks.md, "Prefill logits"): 8K x 64K causal 8.52 ms (968 TFLOP/s; Triton 8.80), 8K x 8K
causal 0.543 ms (Triton 0.561): ahead of Triton, short of the kernel's 7.5 / 0.45 ms targets (the epilogue is
issue-bound: ~400 instructions per warp per 64-key tile against 512 tensor-core cycles of MMA).

With ``clean=True`` the cells outside each row's window are filled with ``-inf`` after the hot loop (by the
default warps, after the partitions join). Windows the value checks would refuse are clamped into ``[0, N]`` once
per row (the tile loop, the epilogue's masks and the fill alike; compressed rows store only columns ``< W``); key
tiles past ``N`` come zero-filled from TMA and their scales are masked. ``compressed=True`` stores key ``n`` of
row ``m`` at column ``n - ks[m]`` (docs/spec.md §5).

Handles H = 64, D = 128, e4m3fn ``q``/``k_fp8`` whose rows TMA can read (16-byte aligned base, ``k_fp8`` row
stride a multiple of 16 bytes, ``q`` contiguous in its last two dims), float32/bfloat16 ``out``; everything else
raises ``NotImplementedError`` before anything is written (``auto`` then runs the Triton backend). No host
synchronisation and no allocation per call: the TMA descriptors are host objects passed as kernel arguments
(Triton builds the ``CUtensorMap`` at launch), the grid is ``min(#blocks, #SMs)``. ``auto`` leaves small calls to
Triton (:data:`AUTO_MIN_CELLS`, the ``auto_when`` predicate: this launch costs more host time).
"""

from __future__ import annotations

import torch

try:  # Triton >= 3.6's Gluon with Hopper TMA / mbarrier / wgmma (the backend is unavailable otherwise)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import constexpr_function
except ImportError:  # pragma: no cover - CPU-only / older Triton: the registry reports the backend unavailable
    gluon = None

from ..._runtime.launch import Launcher, no_kernel_needed
from ..._runtime.tma import Descriptors

__all__ = ["CONFIG", "fp8_mqa_logits"]

HEADS = 64
HEAD_DIM = 128

CONFIG = {"BLOCK_Q": 4, "SPLIT": True, "PIPE": False, "STAGES": 8, "MATH_REGS": 232, "LOAD_REGS": 24, "MAXNREG": 168,
          "FILL_N": 256}
"""Tuned on an H200; overridable (``config=``) for benchmarking. ``BLOCK_Q`` query tokens per block (the MMA's
N is ``BLOCK_Q * 64 <= 256``), ``STAGES`` key tiles in flight, register budgets of the partitions."""


if gluon is not None:

    @constexpr_function
    def _tok_layout(block_q, heads):
        """The wgmma accumulator ``[64, block_q * heads]`` (4 warps, instr N = block_q * heads) seen as
        ``[64 keys, block_q tokens, heads]``: what ``reshape`` of that accumulator gives (no data movement)."""
        while hasattr(block_q, "value"):
            block_q = block_q.value
        while hasattr(heads, "value"):
            heads = heads.value
        regs = [[0, 0, 1], [8, 0, 0]]
        h = 8
        while h < heads:
            regs.append([0, 0, h])
            h *= 2
        t = 1
        while t < block_q:
            regs.append([0, t, 0])
            t *= 2
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 0, 2], [0, 0, 4], [1, 0, 0], [2, 0, 0],
                                                                      [4, 0, 0]],
                                          warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[],
                                          shape=[64, block_q, heads])

    @gluon.jit
    def _block_of(j, nblocks, G):
        """Block handled in round ``j // G`` by CTA ``j % G``: the blocks longest (last) first, dealt in a snake
        order (odd full rounds backwards) so that the CTAs' key counts even out."""
        rnd = j // G
        p = j % G
        back = (rnd % 2 == 1) & ((rnd + 1) * G <= nblocks)
        pos = gl.where(back, rnd * G + G - 1 - p, rnd * G + p)
        return nblocks - 1 - pos

    @gluon.jit
    def _union(ks_ptr, ke_ptr, mb, M, N, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
        """``(first tile, tile count)`` of the union of the windows of block ``mb``'s rows."""
        rows = mb * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=layout)
        rmask = rows < M
        ks = gl.load(ks_ptr + rows, mask=rmask, other=0).to(gl.int32)
        ke = gl.load(ke_ptr + rows, mask=rmask, other=0).to(gl.int32)
        ks = gl.maximum(ks, 0)
        ke = gl.minimum(ke, N)
        ne = rmask & (ke > ks)
        lo = gl.min(gl.where(ne, ks, N), axis=0)
        hi = gl.max(gl.where(ne, ke, 0), axis=0)
        t_lo = lo // BLOCK_N
        t_hi = (hi + BLOCK_N - 1) // BLOCK_N
        return t_lo, gl.maximum(t_hi - t_lo, 0)

    @gluon.jit
    def _loader(k_desc, q_desc, k_bufs, q_bufs, k_ready, k_empty, q_ready, q_empty, ks_ptr, ke_ptr, M, N,
                BLOCK_Q: gl.constexpr, STAGES: gl.constexpr):
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        QROWS: gl.constexpr = q_desc.block_type.shape[0]
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        G = gl.num_programs(0)
        nblocks = (M + BLOCK_Q - 1) // BLOCK_Q
        i = 0
        it = 0
        for j in range(gl.program_id(0), nblocks, G):
            mb = _block_of(j, nblocks, G)
            t_lo, nt = _union(ks_ptr, ke_ptr, mb, M, N, BLOCK_Q, BLOCK_N, lay)
            qb = it % 2
            mbarrier.wait(q_empty.index(qb), ((it // 2) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qb), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [mb * QROWS, 0], q_ready.index(qb), q_bufs.index(qb))
            for t in range(nt):
                s = i % STAGES
                mbarrier.wait(k_empty.index(s), ((i // STAGES) & 1) ^ 1)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [(t_lo + t) * BLOCK_N, 0], k_ready.index(s), k_bufs.index(s))
                i += 1
            it += 1

    @gluon.jit
    def _rows(ks_ptr, ke_ptr, w_ptr, out_ptr, r0, M, N, stride_w, stride_out, BT: gl.constexpr, H: gl.constexpr,
              tok_l: gl.constexpr, col_l: gl.constexpr):
        """Windows (clamped into ``[0, N]``), head weights and output rows of the ``BT`` tokens from row ``r0``
        (rows past ``M``: empty)."""
        rows = r0 + gl.arange(0, BT, layout=tok_l)
        rmask = rows < M
        ks = gl.load(ks_ptr + rows, mask=rmask, other=0).to(gl.int32)
        ke = gl.load(ke_ptr + rows, mask=rmask, other=0).to(gl.int32)
        ks = gl.minimum(gl.maximum(ks, 0), N)
        ke = gl.minimum(gl.maximum(gl.where(rmask, ke, 0), 0), N)
        offs_c = gl.arange(0, BT * H, layout=col_l)
        crow = r0 + offs_c // H
        wts = gl.load(w_ptr + crow.to(gl.int64) * stride_w + offs_c % H, mask=crow < M, other=0.0)
        return ks, ke, wts, out_ptr + rows.to(gl.int64) * stride_out

    @gluon.jit
    def _epilogue(acc, wts, ksc, keys, ks, ke, out_rows, W, BT: gl.constexpr, H: gl.constexpr,
                  COMPRESSED: gl.constexpr):
        """``[keys, BT tokens]`` logits of one accumulator ``[keys, BT * H]``: relu, head weights, sum over each
        token's heads (in-thread + quad shuffles: the reshape moves no data), key scale, masked store."""
        BLOCK_N: gl.constexpr = acc.shape[0]
        sc = gl.maximum(acc, 0.0) * wts[None, :]
        logit = gl.sum(gl.reshape(sc, [BLOCK_N, BT, H]), axis=2) * ksc[:, None]
        kk = keys[:, None]
        inside = (kk >= ks[None, :]) & (kk < ke[None, :])
        if COMPRESSED:
            col = kk - ks[None, :]
            gl.store(out_rows[None, :] + col, logit.to(out_rows.dtype.element_ty), mask=inside & (col < W))
        else:
            gl.store(out_rows[None, :] + kk, logit.to(out_rows.dtype.element_ty), mask=inside)

    @gluon.jit
    def _math(WG: gl.constexpr, out_ptr, k_bufs, q_bufs, k_ready, k_empty, q_ready, q_empty, ksc_ptr, w_ptr,
              ks_ptr, ke_ptr, M, N, W, stride_out, stride_w,
              BLOCK_Q: gl.constexpr, STAGES: gl.constexpr, COMPRESSED: gl.constexpr, SPLIT: gl.constexpr,
              PIPE: gl.constexpr):
        """One math warpgroup: the ring's tiles ``WG``, ``WG + 2``, ... With ``SPLIT = 2`` the MMA runs as two
        halves of ``BLOCK_Q / 2`` tokens each: the first half's epilogue overlaps the second half's MMA."""
        BLOCK_N: gl.constexpr = k_bufs.type.shape[1]
        H: gl.constexpr = q_bufs.type.shape[1] // BLOCK_Q
        BT: gl.constexpr = BLOCK_Q // SPLIT
        NQ: gl.constexpr = BT * H
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 32])
        l2: gl.constexpr = gl.SliceLayout(2, _tok_layout(BT, H))  # [keys, tokens]
        key_l: gl.constexpr = gl.SliceLayout(1, l2)
        tok_l: gl.constexpr = gl.SliceLayout(0, l2)
        col_l: gl.constexpr = gl.SliceLayout(0, mma)
        lay1: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])

        G = gl.num_programs(0)
        nblocks = (M + BLOCK_Q - 1) // BLOCK_Q
        offs_n = gl.arange(0, BLOCK_N, layout=key_l)
        zero = gl.zeros([BLOCK_N, NQ], gl.float32, mma)
        i = 0
        it = 0
        for j in range(gl.program_id(0), nblocks, G):
            mb = _block_of(j, nblocks, G)
            t_lo, nt = _union(ks_ptr, ke_ptr, mb, M, N, BLOCK_Q, BLOCK_N, lay1)
            ks_a, ke_a, w_a, o_a = _rows(ks_ptr, ke_ptr, w_ptr, out_ptr, mb * BLOCK_Q, M, N, stride_w, stride_out,
                                         BT, H, tok_l, col_l)
            if SPLIT == 2:
                ks_b, ke_b, w_b, o_b = _rows(ks_ptr, ke_ptr, w_ptr, out_ptr, mb * BLOCK_Q + BT, M, N, stride_w,
                                             stride_out, BT, H, tok_l, col_l)
            qb = it % 2
            mbarrier.wait(q_ready.index(qb), (it // 2) & 1)
            q_all = q_bufs.index(qb)
            q_a = q_all.slice(0, NQ, dim=0).permute((1, 0))  # [D, NQ], K-major
            q_b = q_all.slice(NQ * (SPLIT - 1), NQ, dim=0).permute((1, 0))
            # this warpgroup's tiles of the block: global ring index i + t with (i + t) % 2 == WG
            t0 = (WG + 2 - i % 2) % 2
            if PIPE:
                # Rolling pipeline over this warpgroup's tiles: while one half's epilogue runs, the other half's
                # MMA (this tile's second half, or the next tile's first half) is in flight. Every MMA is issued
                # unconditionally (a branch around one makes ptxas serialize the wgmma pipeline): after the last
                # tile (or with no tile) the pair reads a ring slot it does not own, and its result is dropped
                # (drained after the loop).
                g = i + t0
                s = g % STAGES
                if t0 < nt:
                    mbarrier.wait(k_ready.index(s), (g // STAGES) & 1)
                acc_a = warpgroup_mma(k_bufs.index(s), q_a, zero, use_acc=False, is_async=True)
                acc_b = warpgroup_mma(k_bufs.index(s), q_b, zero, use_acc=False, is_async=True)
                for t in range(t0, nt, 2):
                    g = i + t
                    s = g % STAGES
                    keys = (t_lo + t) * BLOCK_N + offs_n
                    ksc = gl.load(ksc_ptr + keys, mask=keys < N, other=0.0)
                    ra = warpgroup_mma_wait(1, deps=(acc_a, ))
                    _epilogue(ra, w_a, ksc, keys, ks_a, ke_a, o_a, W, BT, H, COMPRESSED)
                    gl.thread_barrier()  # keeps ptxas from hoisting the next wait above this epilogue
                    more = t + 2 < nt
                    gn = g + 2
                    sn = gl.where(more, gn % STAGES, s)
                    if more:
                        mbarrier.wait(k_ready.index(sn), (gn // STAGES) & 1)
                    acc_a = warpgroup_mma(k_bufs.index(sn), q_a, zero, use_acc=False, is_async=True)
                    rb = warpgroup_mma_wait(1, deps=(acc_b, ))
                    if more:
                        mbarrier.arrive(k_empty.index(s), count=1)
                    _epilogue(rb, w_b, ksc, keys, ks_b, ke_b, o_b, W, BT, H, COMPRESSED)
                    gl.thread_barrier()
                    acc_b = warpgroup_mma(k_bufs.index(sn), q_b, zero, use_acc=False, is_async=True)
                acc_a, acc_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
                if t0 < nt:  # the last tile's slot, read by the dropped pair too
                    g_last = i + t0 + ((nt - 1 - t0) // 2) * 2
                    mbarrier.arrive(k_empty.index(g_last % STAGES), count=1)
            else:
                for t in range(t0, nt, 2):
                    g = i + t
                    s = g % STAGES
                    mbarrier.wait(k_ready.index(s), (g // STAGES) & 1)
                    k_s = k_bufs.index(s)
                    acc_a = warpgroup_mma(k_s, q_a, zero, use_acc=False, is_async=True)
                    if SPLIT == 2:
                        acc_b = warpgroup_mma(k_s, q_b, zero, use_acc=False, is_async=True)
                    keys = (t_lo + t) * BLOCK_N + offs_n
                    ksc = gl.load(ksc_ptr + keys, mask=keys < N, other=0.0)
                    if SPLIT == 2:
                        acc_a = warpgroup_mma_wait(1, deps=(acc_a, ))
                        _epilogue(acc_a, w_a, ksc, keys, ks_a, ke_a, o_a, W, BT, H, COMPRESSED)
                        gl.thread_barrier()  # keeps ptxas from hoisting the next wait above this epilogue
                        acc_b = warpgroup_mma_wait(0, deps=(acc_b, ))
                        mbarrier.arrive(k_empty.index(s), count=1)
                        _epilogue(acc_b, w_b, ksc, keys, ks_b, ke_b, o_b, W, BT, H, COMPRESSED)
                    else:
                        acc_a = warpgroup_mma_wait(0, deps=(acc_a, ))
                        mbarrier.arrive(k_empty.index(s), count=1)
                        _epilogue(acc_a, w_a, ksc, keys, ks_a, ke_a, o_a, W, BT, H, COMPRESSED)
            mbarrier.arrive(q_empty.index(qb), count=1)
            i += nt
            it += 1

    @gluon.jit
    def _fill(out_ptr, ks_ptr, ke_ptr, M, N, W, stride_out, BLOCK_Q: gl.constexpr, FILL_N: gl.constexpr,
              COMPRESSED: gl.constexpr, num_warps: gl.constexpr):
        """``-inf`` in the cells outside each row's window of every block this CTA handled."""
        lay: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, num_warps], [1, 0])
        rl: gl.constexpr = gl.SliceLayout(1, lay)
        cl: gl.constexpr = gl.SliceLayout(0, lay)
        G = gl.num_programs(0)
        nblocks = (M + BLOCK_Q - 1) // BLOCK_Q
        offs_f = gl.arange(0, FILL_N, layout=cl)
        ninf = gl.full([BLOCK_Q, FILL_N], float("-inf"), gl.float32, lay).to(out_ptr.dtype.element_ty)
        for j in range(gl.program_id(0), nblocks, G):
            mb = _block_of(j, nblocks, G)
            rows = mb * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=rl)
            rmask = rows < M
            ks = gl.minimum(gl.maximum(gl.load(ks_ptr + rows, mask=rmask, other=0).to(gl.int32), 0), N)
            ke = gl.minimum(gl.maximum(gl.load(ke_ptr + rows, mask=rmask, other=0).to(gl.int32), 0), N)
            out_rows = out_ptr + rows.to(gl.int64) * stride_out
            if COMPRESSED:
                ln = gl.where(rmask, gl.maximum(ke - ks, 0), W)
                for c0 in range((gl.min(ln, axis=0) // FILL_N) * FILL_N, W, FILL_N):
                    cols = c0 + offs_f
                    gl.store(out_rows[:, None] + cols[None, :], ninf,
                             mask=rmask[:, None] & (cols[None, :] >= ln[:, None]) & (cols < W)[None, :])
            else:
                ks_f = gl.where(rmask & (ke > ks), ks, N)  # an empty row: -inf from column 0
                ks_f = gl.where(rmask, ks_f, 0)
                ke_f = gl.where(rmask & (ke > ks), ke, 0)
                ke_f = gl.where(rmask, ke_f, N)
                for c0 in range(0, gl.max(ks_f, axis=0), FILL_N):
                    cols = c0 + offs_f
                    gl.store(out_rows[:, None] + cols[None, :], ninf,
                             mask=rmask[:, None] & (cols[None, :] < ks_f[:, None]))
                for c0 in range((gl.min(ke_f, axis=0) // FILL_N) * FILL_N, N, FILL_N):
                    cols = c0 + offs_f
                    gl.store(out_rows[:, None] + cols[None, :], ninf,
                             mask=rmask[:, None] & (cols[None, :] >= ke_f[:, None]) & (cols < N)[None, :])

    @gluon.jit
    def _mqa_logits_kernel(out_ptr, q_desc, k_desc, ksc_ptr, w_ptr, ks_ptr, ke_ptr, M, N, W, stride_out, stride_w,
                           BLOCK_Q: gl.constexpr, STAGES: gl.constexpr, CLEAN: gl.constexpr,
                           COMPRESSED: gl.constexpr, FILL_N: gl.constexpr, MATH_REGS: gl.constexpr,
                           LOAD_REGS: gl.constexpr, SPLIT: gl.constexpr, PIPE: gl.constexpr,
                           num_warps: gl.constexpr):
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(s), count=1)
            mbarrier.init(k_empty.index(s), count=1)
        for s in gl.static_range(2):
            mbarrier.init(q_ready.index(s), count=1)
            mbarrier.init(q_empty.index(s), count=2)  # both math warpgroups
        gl.warp_specialize([
            (_math, (0, out_ptr, k_bufs, q_bufs, k_ready, k_empty, q_ready, q_empty, ksc_ptr, w_ptr, ks_ptr, ke_ptr,
                     M, N, W, stride_out, stride_w, BLOCK_Q, STAGES, COMPRESSED, SPLIT, PIPE)),
            (_math, (1, out_ptr, k_bufs, q_bufs, k_ready, k_empty, q_ready, q_empty, ksc_ptr, w_ptr, ks_ptr, ke_ptr,
                     M, N, W, stride_out, stride_w, BLOCK_Q, STAGES, COMPRESSED, SPLIT, PIPE)),
            (_loader, (k_desc, q_desc, k_bufs, q_bufs, k_ready, k_empty, q_ready, q_empty, ks_ptr, ke_ptr, M, N,
                       BLOCK_Q, STAGES)),
        ], [4, 1], [MATH_REGS, LOAD_REGS])
        if CLEAN:
            _fill(out_ptr, ks_ptr, ke_ptr, M, N, W, stride_out, BLOCK_Q, FILL_N, COMPRESSED, num_warps)

    _LAUNCH = Launcher(_mqa_logits_kernel)
else:  # pragma: no cover
    _LAUNCH = None


class _Plan:
    """What one (dtype of q, BLOCK_Q, STAGES, ...) configuration fixes: shared layouts and the launch config."""

    __slots__ = ("block_q", "k_layout", "q_layout", "cfg", "sms")

    def __init__(self, clean: bool, compressed: bool, config: dict, device: torch.device):
        block_q = config["BLOCK_Q"]
        if block_q not in (1, 2, 4):
            raise NotImplementedError(f"gluon fp8_mqa_logits: BLOCK_Q must be 1, 2 or 4, got {block_q}")
        self.block_q = block_q
        self.k_layout = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], gl.float8e4nv)
        self.q_layout = gl.NVMMASharedLayout.get_default_for([block_q * HEADS, HEAD_DIM], gl.float8e4nv)
        self.cfg = _LAUNCH.config(BLOCK_Q=block_q, STAGES=config["STAGES"], CLEAN=bool(clean),
                                  COMPRESSED=bool(compressed), FILL_N=config["FILL_N"],
                                  MATH_REGS=config["MATH_REGS"], LOAD_REGS=config["LOAD_REGS"],
                                  SPLIT=2 if block_q > 1 and config["SPLIT"] else 1,
                                  PIPE=bool(block_q > 1 and config["SPLIT"] and config["PIPE"]), num_warps=4,
                                  maxnreg=config["MAXNREG"])
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count


_PLANS: dict = {}  # (device index, clean, compressed) -> _Plan of the default CONFIG
_DESCS = Descriptors(TensorDescriptor) if gluon is not None else None  # recent calls' TMA descriptors (_tma.py)


def _unsupported(q, k_fp8, out) -> str | None:
    """Why the kernel cannot take this call (``None``: it can). Shapes and dtypes are already checked."""
    m, h, d = q.shape
    if h != HEADS or d != HEAD_DIM:
        return f"H = {HEADS} and D = {HEAD_DIM} only, got H = {h}, D = {d}"
    if q.dtype != torch.float8_e4m3fn or k_fp8.dtype != torch.float8_e4m3fn:
        return f"e4m3fn operands only, got {q.dtype} queries and {k_fp8.dtype} keys"
    if q.device.type != "cuda":
        return f"a CUDA device, got {q.device}"
    if q.stride(1) != d or (m > 1 and q.stride(0) != h * d):
        return f"q contiguous in its last two dims (TMA reads [M * H, D] rows), got strides {q.stride()}"
    if q.data_ptr() % 16 or k_fp8.data_ptr() % 16 or k_fp8.stride(0) % 16:
        return "16-byte aligned q / k_fp8 and a k_fp8 row stride that is a multiple of 16 bytes (TMA)"
    if out.dtype not in (torch.float32, torch.bfloat16):
        return f"float32 or bfloat16 out, got {out.dtype}"
    return None


def fp8_mqa_logits(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, clean, compressed=False,
                   config=None, q_scale=None) -> None:
    """See :func:`sparse_indexer.fp8_mqa_logits` (docs/spec.md §5); arguments are checked. ``config`` overrides
    :data:`CONFIG`. Raises ``NotImplementedError`` (before writing anything) for cases the kernel does not
    handle: H != 64, D != 128, e4m3fnuz, ``q`` not contiguous in its last two dims, TMA-unaligned operands."""
    if q_scale is not None:
        raise NotImplementedError("the Gluon backend has no MXFP4 scoring kernel (docs/spec.md §3a)")
    if gluon is None:  # pragma: no cover
        raise NotImplementedError("gluon fp8_mqa_logits needs Triton's Gluon (triton.experimental.gluon, Triton 3.6)")
    why = _unsupported(q, k_fp8, out)
    if why is not None:
        raise NotImplementedError(f"gluon fp8_mqa_logits: {why}")
    m = q.shape[0]
    n = k_fp8.shape[0]
    w = out.shape[1]
    if no_kernel_needed(m, n, w, out, clean):
        return
    dev = q.device
    if config is None:
        key = (dev.index, bool(clean), bool(compressed))
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS[key] = _Plan(clean, compressed, CONFIG, dev)
    else:
        plan = _Plan(clean, compressed, dict(CONFIG, **config), dev)
    bq = plan.block_q
    # q is [M, H, D] with strides (H * D, D, 1) (checked above): TMA reads it as [M * H, D] rows from its data
    # pointer (a descriptor takes only its base's pointer and dtype: no view per call, none kept per step)
    q_desc = _DESCS.get(q.data_ptr(), q.dtype, (m * HEADS, HEAD_DIM), (HEAD_DIM, 1), (bq * HEADS, HEAD_DIM),
                        plan.q_layout)
    k_desc = _DESCS.get(k_fp8.data_ptr(), k_fp8.dtype, (n, HEAD_DIM), (k_fp8.stride(0), 1), (64, HEAD_DIM),
                        plan.k_layout)
    nblocks = (m + bq - 1) // bq
    grid = (min(nblocks, plan.sms), )
    _LAUNCH.launch_with(grid, plan.cfg, (out, q_desc, k_desc, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, m, n, w,
                                         out.stride(0), weights.stride(0)))


AUTO_MIN_CELLS = 1 << 26
"""``auto`` runs this kernel when ``M * N`` (queries x keys) is at least this (e.g. 8K x 8K: about 0.5 ms on an H200),
the Triton kernel below it: its launch costs more host time than Triton's (37 vs 27 us per public call on the
H200's host on 2026-12-01, with the descriptors and their encoded maps kept: sparse_indexer/_runtime/tma.py; 54 vs 23 us
when both were made per call), which its few % of device time repays only on large problems (docs/benchmarks.md,
"Host cost per eager call"). An explicit ``backend="gluon"`` always runs it."""


def _auto_when(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, clean, compressed=False,
               config=None, q_scale=None) -> bool:
    """``auto`` takes this backend for this call (_runtime/dispatch.py): large problems only, shapes only; never
    MXFP4 operands (``q_scale``: the kernel reads FP8)."""
    return q_scale is None and (q.numel() >> 13) * k_fp8.shape[0] >= AUTO_MIN_CELLS  # M * N at H = 64, D = 128


fp8_mqa_logits.auto_when = _auto_when
