"""Triton ``fp8_mqa_logits``: ragged (prefill) indexer scores.

One program per ``BLOCK_Q`` consecutive query tokens (``BLOCK_Q * H`` MMA columns, 8 x 64 = 512 by default), so
each key tile it loads is reused by all of them (H is padded to a power of two >= 16, D to one >= 32).
It iterates over the key tiles of the union of its rows' windows only:
per tile one fp8 ``tl.dot`` (keys as M, the ``BLOCK_Q * H`` query rows as N), ``relu``, times the head weights,
sum over heads, times the key scale, masked store. Programs run the last query blocks first (the longest rows
under causal prefill). With ``clean=True`` each program then fills its rows' cells outside their windows
with ``-inf`` (outside the hot loop, so ``clean`` costs only the extra bytes).

H200, DeepSeek shapes (``bench --sweep logits``): 8K queries causal over 64K keys 9.10-9.17 ms (~900 TFLOP/s,
73% of cuBLAS fp8 at 8192^3); 8K causal over 8K 0.60 ms.

MXFP4 operands (``MXFP4``, docs/spec.md §3a): the same program and windows; per key tile and 32-element block,
the low and the high nibbles' e2m1 values (exact in fp16; the queries' unpacked once per program) as two K = 16
``tl.dot`` products (the same element pairs on both sides: the block's exact dot), times the key's power of two
and then the query's (exact unless the product leaves float32's normal range: operands beyond about ``2**115``
or scores below ``2**-126``), NaN for a scale byte of 255, the blocks summed in order; no key scale after the
head sum. Untuned (:data:`MXFP4_CONFIG`).

No host synchronisation and no allocation: the grid is ``cdiv(M, BLOCK_Q)``.

Windows the value checks would refuse: ``ks`` and ``ke`` are clamped into ``[0, N]`` once per row (``ke <= ks``:
an empty row); compressed rows store only columns ``< W`` (a window longer than ``W`` keeps its first ``W`` keys).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..._runtime.launch import Launcher, no_kernel_needed
from ..._runtime.triton_compat import fix_interpreter

fix_interpreter()  # Triton 3.6's interpreter under NumPy >= 2.4 (sparse_indexer/_runtime/triton_compat.py)

__all__ = ["fp8_mqa_logits", "to_out"]


@triton.jit
def to_out(x, ptr):
    """float32 ``x`` in the element type of ``ptr``: itself for float32; for bfloat16 rounded to nearest, ties to
    even, by integer arithmetic on the bits (torch's rounding on every device: Triton's interpreter truncates
    a plain ``.to(tl.bfloat16)``). ``-inf`` stays ``-inf``; a NaN stays a (quiet) NaN: its payload would carry
    into the exponent (``0x7FFFFFFF`` -> ``-0.0``, ``0xFFFFFFFF`` -> ``+0.0``), so it keeps its top bits with the
    quiet bit set, as torch does."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(x != x, (bits >> 16) | 0x40, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x


@triton.jit
def _e2m1(codes):
    """fp16 values of e2m1 codes (uint8 0-15, exact): magnitude ``m = c & 7`` is ``0.5 * m`` for ``m < 2``, else
    ``(1 + (m & 1) / 2) * 2 ** ((m >> 1) - 1)``; bit 3 the sign."""
    m = (codes & 7).to(tl.int32)
    e = m >> 1
    f = (m & 1).to(tl.float32)
    big = (1.0 + 0.5 * f) * (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * f, big)
    return tl.where((codes & 8) != 0, -mag, mag).to(tl.float16)


@triton.jit
def _scale_factors(s):
    """``2 ** (s - 127)`` (float32, exact; ``s = 0``: the subnormal ``2 ** -127``) of scale bytes ``s`` (int32),
    NaN for the byte 255 (docs/spec.md §3a)."""
    bits = tl.where(s >= 1, s << 23, 0x00400000)
    return tl.where(s == 255, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def _mxfp4_tile(k_ptr, ksc_ptr, n, nmask, stride_k, stride_ksc, qlo, qhi, fq, b: tl.constexpr):
    """Block ``b`` of a key tile against the queries' block ``b`` (``qlo``/``qhi``: their low and high nibbles'
    fp16 values, ``fq`` their scale factors): the exact e2m1 dot (the low and the high nibbles as two K = 16
    products: the same pairs of elements on both sides), times the key's and then the query's power of two.
    ``[BLOCK_N, C]`` float32."""
    offs_b = tl.arange(0, 16)
    kb = tl.load(k_ptr + n[:, None].to(tl.int64) * stride_k + b * 16 + offs_b[None, :], mask=nmask[:, None],
                 other=0)
    sk = tl.load(ksc_ptr + n.to(tl.int64) * stride_ksc + b, mask=nmask, other=127).to(tl.int32)
    dot = tl.dot(_e2m1(kb & 15), tl.trans(qlo)) + tl.dot(_e2m1(kb >> 4), tl.trans(qhi))
    return dot * _scale_factors(sk)[:, None] * fq[None, :]


@triton.jit(do_not_specialize=["M", "N"])
def _mqa_logits_kernel(
    out_ptr,  # [M, W] float32 or bfloat16 (W = N, or the compressed width), row stride stride_out
    q_ptr,  # [M, H, D] fp8
    k_ptr,  # [N, D] fp8
    ksc_ptr,  # [N] float32
    w_ptr,  # [M, H] float32
    ks_ptr,  # [M] int32/int64
    ke_ptr,  # [M] int32/int64
    qsc_ptr,  # MXFP4 only: [M, H, D / 32] uint8 (else unused)
    M, N, W,
    stride_out, stride_qm, stride_qh, stride_k, stride_ksc, stride_w, stride_ks, stride_ke, stride_qsm, stride_qsh,
    H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, CLEAN: tl.constexpr,
    FILL_N: tl.constexpr, COMPRESSED: tl.constexpr, MXFP4: tl.constexpr,
):
    # MXFP4 (docs/spec.md §3a): q_ptr [M, H, D / 2] and k_ptr [N, D / 2] packed e2m1 values, qsc_ptr [M, H, D / 32]
    # and ksc_ptr [N, D / 32] (row stride stride_ksc) their scale bytes; D is the unpacked head dim.
    pid = tl.program_id(0)
    mb = tl.num_programs(0) - 1 - pid  # longest (last) rows first
    offs_q = tl.arange(0, BLOCK_Q)
    rows = mb * BLOCK_Q + offs_q
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    ks = tl.load(ks_ptr + rows64 * stride_ks, mask=rmask, other=0).to(tl.int32)
    ke = tl.load(ke_ptr + rows64 * stride_ke, mask=rmask, other=0).to(tl.int32)
    # windows clamped into [0, N] (values the checks would refuse: every store and -inf fill stays in its row)
    ks = tl.minimum(tl.maximum(ks, 0), N)
    ke = tl.minimum(tl.maximum(ke, 0), N)
    nonempty = rmask & (ke > ks)
    lo = tl.min(tl.where(nonempty, ks, N), axis=0)
    hi = tl.max(tl.where(nonempty, ke, 0), axis=0)
    t_lo = lo // BLOCK_N
    t_hi = tl.cdiv(hi, BLOCK_N)

    offs_c = tl.arange(0, BLOCK_Q * HP)  # query row (token c // HP, head c % HP; HP >= H padded)
    offs_d = tl.arange(0, DP)
    dmask = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    crow = (mb * BLOCK_Q + offs_c // HP).to(tl.int64)
    cmask = (crow < M) & (offs_c % HP < H)
    if not MXFP4:
        q = tl.load(q_ptr + crow[:, None] * stride_qm + (offs_c % HP)[:, None] * stride_qh + offs_d[None, :],
                    mask=cmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_Q * HP, DP]
    else:
        qrow = q_ptr + crow * stride_qm + (offs_c % HP) * stride_qh  # [C] byte rows
        srow = qsc_ptr + crow * stride_qsm + (offs_c % HP) * stride_qsh
        offs_b = tl.arange(0, 16)  # (each block's values unpacked once, before the key loop)
        q0 = tl.load(qrow[:, None] + offs_b[None, :], mask=cmask[:, None], other=0)
        q0l, q0h = _e2m1(q0 & 15), _e2m1(q0 >> 4)
        f0 = _scale_factors(tl.load(srow, mask=cmask, other=127).to(tl.int32))
        if D >= 64:
            q1 = tl.load(qrow[:, None] + 16 + offs_b[None, :], mask=cmask[:, None], other=0)
            q1l, q1h = _e2m1(q1 & 15), _e2m1(q1 >> 4)
            f1 = _scale_factors(tl.load(srow + 1, mask=cmask, other=127).to(tl.int32))
        if D >= 128:
            q2 = tl.load(qrow[:, None] + 32 + offs_b[None, :], mask=cmask[:, None], other=0)
            q2l, q2h = _e2m1(q2 & 15), _e2m1(q2 >> 4)
            f2 = _scale_factors(tl.load(srow + 2, mask=cmask, other=127).to(tl.int32))
            q3 = tl.load(qrow[:, None] + 48 + offs_b[None, :], mask=cmask[:, None], other=0)
            q3l, q3h = _e2m1(q3 & 15), _e2m1(q3 >> 4)
            f3 = _scale_factors(tl.load(srow + 3, mask=cmask, other=127).to(tl.int32))
    wts = tl.load(w_ptr + crow * stride_w + offs_c % HP, mask=cmask, other=0.0)
    out_rows = out_ptr + rows64 * stride_out  # [BLOCK_Q]

    for t in range(t_lo, t_hi):
        n = t * BLOCK_N + offs_n
        nmask = n < N
        if not MXFP4:
            if D == DP:
                k = tl.load(k_ptr + n[:, None].to(tl.int64) * stride_k + offs_d[None, :], mask=nmask[:, None],
                            other=0.0)
            else:
                k = tl.load(k_ptr + n[:, None].to(tl.int64) * stride_k + offs_d[None, :],
                            mask=nmask[:, None] & dmask[None, :], other=0.0)
            ksc = tl.load(ksc_ptr + n * stride_ksc, mask=nmask, other=0.0)
            s = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_Q * HP] float32
        else:  # the blocks' scaled dots summed in order (docs/spec.md §3a)
            s = _mxfp4_tile(k_ptr, ksc_ptr, n, nmask, stride_k, stride_ksc, q0l, q0h, f0, 0)
            if D >= 64:
                s = s + _mxfp4_tile(k_ptr, ksc_ptr, n, nmask, stride_k, stride_ksc, q1l, q1h, f1, 1)
            if D >= 128:
                s = s + _mxfp4_tile(k_ptr, ksc_ptr, n, nmask, stride_k, stride_ksc, q2l, q2h, f2, 2)
                s = s + _mxfp4_tile(k_ptr, ksc_ptr, n, nmask, stride_k, stride_ksc, q3l, q3h, f3, 3)
        if MXFP4:  # (a NaN scale byte's NaN survives relu, as torch.relu keeps it)
            s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL) * wts[None, :]
        else:
            s = tl.maximum(s, 0.0) * wts[None, :]
        if BLOCK_Q == 1:
            logit = tl.sum(s, axis=1)[:, None]
        else:
            logit = tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_Q, HP)), axis=2)  # [BLOCK_N, BLOCK_Q]
        if not MXFP4:
            logit = logit * ksc[:, None]
        inside = (n[:, None] >= ks[None, :]) & (n[:, None] < ke[None, :])
        if COMPRESSED:
            # row m's key n lands in column n - ks[m] (docs/spec.md §5, compressed logits)
            col = n[:, None] - ks[None, :]
            tl.store(out_rows[None, :] + col, to_out(logit, out_ptr),
                     mask=inside & rmask[None, :] & (col < W))
        else:
            tl.store(out_rows[None, :] + n[:, None], to_out(logit, out_ptr), mask=inside & rmask[None, :])

    if CLEAN and COMPRESSED:
        # Columns past each row's window length (all of an empty row's): -inf.
        offs_f = tl.arange(0, FILL_N)
        ninf = to_out(tl.full([BLOCK_Q, FILL_N], float("-inf"), tl.float32), out_ptr)
        len_f = tl.where(rmask, tl.maximum(ke - ks, 0), W)
        for c0 in range((tl.min(len_f, axis=0) // FILL_N) * FILL_N, W, FILL_N):
            cols = c0 + offs_f
            tl.store(out_rows[:, None] + cols[None, :], ninf,
                     mask=rmask[:, None] & (cols[None, :] >= len_f[:, None]) & (cols < W)[None, :])
    if CLEAN and not COMPRESSED:
        # Cells outside each row's window [ks, ke) (all of an empty row's): -inf.
        offs_f = tl.arange(0, FILL_N)
        ninf = to_out(tl.full([BLOCK_Q, FILL_N], float("-inf"), tl.float32), out_ptr)
        ks_f = tl.where(rmask, ks, 0)
        ke_f = tl.where(rmask, ke, N)
        for c0 in range(0, tl.max(ks_f, axis=0), FILL_N):
            cols = c0 + offs_f
            tl.store(out_rows[:, None] + cols[None, :], ninf, mask=rmask[:, None] & (cols[None, :] < ks_f[:, None]))
        for c0 in range((tl.min(ke_f, axis=0) // FILL_N) * FILL_N, N, FILL_N):
            cols = c0 + offs_f
            tl.store(out_rows[:, None] + cols[None, :], ninf,
                     mask=rmask[:, None] & (cols[None, :] >= ke_f[:, None]) & (cols < N)[None, :])


# Tuned on an H200 (``bench --sweep logits``); overridable for benchmarking.
CONFIG = {"BLOCK_Q": 8, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


_LAUNCH = Launcher(_mqa_logits_kernel)
_PLANS: dict = {}  # (H, D, clean) -> (BLOCK_Q, LaunchConfig) of the default CONFIG


MXFP4_CONFIG = {"BLOCK_Q": 2, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
"""The MXFP4 scores' configuration (correctness first: not tuned; each query block's unpacked values stay in
registers)."""


def _plan(h: int, d: int, clean: bool, config, compressed: bool = False, mxfp4: bool = False):
    cfg = dict(MXFP4_CONFIG if mxfp4 else CONFIG, **(config or {}))
    hp = max(16, triton.next_power_of_2(h))
    dp = max(32, triton.next_power_of_2(d))
    if dp > 256:
        raise NotImplementedError(f"triton fp8_mqa_logits handles D <= 256, got {d=}")
    block_q = max(1, min(cfg["BLOCK_Q"], 256 // hp))
    kwargs = dict(H=h, HP=hp, D=d, DP=dp, BLOCK_Q=block_q, BLOCK_N=cfg["BLOCK_N"], CLEAN=bool(clean),
                  FILL_N=cfg.get("FILL_N", max(64, 1024 // block_q)), COMPRESSED=bool(compressed),
                  MXFP4=bool(mxfp4), num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    return block_q, _LAUNCH.config(**kwargs)


def fp8_mqa_logits(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, clean, compressed=False,
                   config=None, q_scale=None) -> None:
    """See :func:`sparse_indexer.fp8_mqa_logits`; arguments are checked. ``config`` overrides :data:`CONFIG`.
    ``out`` float32 or bfloat16 (the kernel converts each float32 score once, at the store); ``compressed``:
    ``out`` is ``[M, W]`` with row ``m``'s window from column 0. Keys in another FP8 format than ``q`` (a mix) raise
    ``NotImplementedError``."""
    if q_scale is not None:
        _mxfp4(q, q_scale, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out, clean, compressed, config)
        return
    if k_fp8.dtype is not q.dtype:
        raise NotImplementedError(f"triton fp8_mqa_logits: {q.dtype} queries against {k_fp8.dtype} keys (a mix of "
                                  "FP8 formats)")
    m, h, d = q.shape
    n = k_fp8.shape[0]
    w = out.shape[1]
    if no_kernel_needed(m, n, w, out, clean):
        return
    if config is None:
        key = (h, d, clean, compressed)
        plan = _PLANS.get(key)
        if plan is None:
            plan = _PLANS[key] = _plan(h, d, clean, None, compressed)
    else:
        plan = _plan(h, d, clean, config, compressed)
    block_q, cfg = plan
    qs = q.stride()
    _LAUNCH.launch_with(
        ((m + block_q - 1) // block_q,), cfg,
        (out, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, k_scale, m, n, w, out.stride()[0], qs[0],
         qs[1], k_fp8.stride()[0], k_scale.stride()[0], weights.stride()[0], cu_seqlen_ks.stride()[0],
         cu_seqlen_ke.stride()[0], 0, 0), 8)


def _mxfp4(q, q_scale, k_vals, k_scales, weights, cu_seqlen_ks, cu_seqlen_ke, out, clean, compressed, config):
    """MXFP4 operands (``q [M, H, D / 2]``, ``q_scale [M, H, D / 32]``, ``k_vals [N, D / 2]``, ``k_scales [N, D /
    32]`` uint8, checked): the same kernel with ``MXFP4`` (one K = 16 fp16 product per half block, exact, then
    the block's power of two). ``D`` 32, 64 or 128."""
    m, h, half = q.shape
    d = 2 * half
    if d not in (32, 64, 128):
        raise NotImplementedError(f"triton fp8_mqa_logits scores MXFP4 with D in (32, 64, 128), got {d=}")
    n = k_vals.shape[0]
    w = out.shape[1]
    if no_kernel_needed(m, n, w, out, clean):
        return
    block_q, cfg = _plan(h, d, clean, config, compressed, mxfp4=True)
    qs, ss = q.stride(), q_scale.stride()
    _LAUNCH.launch_with(
        ((m + block_q - 1) // block_q,), cfg,
        (out, q, k_vals, k_scales, weights, cu_seqlen_ks, cu_seqlen_ke, q_scale, m, n, w, out.stride()[0], qs[0],
         qs[1], k_vals.stride()[0], k_scales.stride()[0], weights.stride()[0], cu_seqlen_ks.stride()[0],
         cu_seqlen_ke.stride()[0], ss[0], ss[1]), 8)
