"""Triton ``fp8_mqa_logits``: ragged (prefill) indexer scores.

One program per ``BLOCK_Q`` consecutive query tokens (``BLOCK_Q * H`` MMA columns, e.g. 2 x 64 = 128), so each key
tile it loads is reused by all of them. It iterates over the key tiles of the union of its rows' windows only:
per tile one fp8 ``tl.dot`` (keys as M, the ``BLOCK_Q * H`` query rows as N), ``relu``, times the head weights,
sum over heads, times the key scale, masked store. Programs run the last query blocks first (the longest rows
under causal prefill). With ``clean=True`` each program also fills its rows' columns outside the tiles it
visited with ``-inf``.

No host synchronisation and no allocation: the grid is ``cdiv(M, BLOCK_Q)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["fp8_mqa_logits"]


@triton.jit
def _mqa_logits_kernel(
    out_ptr,  # [M, N] float32, row stride stride_out
    q_ptr,  # [M, H, D] fp8
    k_ptr,  # [N, D] fp8
    ksc_ptr,  # [N] float32
    w_ptr,  # [M, H] float32
    ks_ptr,  # [M] int32/int64
    ke_ptr,  # [M] int32/int64
    M, N,
    stride_out, stride_qm, stride_qh, stride_k, stride_ksc, stride_w, stride_ks, stride_ke,
    H: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, CLEAN: tl.constexpr,
    FILL_N: tl.constexpr,
):
    pid = tl.program_id(0)
    mb = tl.num_programs(0) - 1 - pid  # longest (last) rows first
    offs_q = tl.arange(0, BLOCK_Q)
    rows = mb * BLOCK_Q + offs_q
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    ks = tl.load(ks_ptr + rows64 * stride_ks, mask=rmask, other=0).to(tl.int32)
    ke = tl.load(ke_ptr + rows64 * stride_ke, mask=rmask, other=0).to(tl.int32)
    ks = tl.maximum(ks, 0)
    ke = tl.minimum(ke, N)
    nonempty = rmask & (ke > ks)
    lo = tl.min(tl.where(nonempty, ks, N), axis=0)
    hi = tl.max(tl.where(nonempty, ke, 0), axis=0)
    t_lo = lo // BLOCK_N
    t_hi = tl.cdiv(hi, BLOCK_N)

    offs_c = tl.arange(0, BLOCK_Q * H)  # query row (token c // H, head c % H)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    crow = (mb * BLOCK_Q + offs_c // H).to(tl.int64)
    cmask = crow < M
    q = tl.load(q_ptr + crow[:, None] * stride_qm + (offs_c % H)[:, None] * stride_qh + offs_d[None, :],
                mask=cmask[:, None], other=0.0)  # [BLOCK_Q * H, D]
    wts = tl.load(w_ptr + crow * stride_w + offs_c % H, mask=cmask, other=0.0)
    out_rows = out_ptr + rows64 * stride_out  # [BLOCK_Q]

    for t in range(t_lo, t_hi):
        n = t * BLOCK_N + offs_n
        nmask = n < N
        k = tl.load(k_ptr + n[:, None].to(tl.int64) * stride_k + offs_d[None, :], mask=nmask[:, None], other=0.0)
        ksc = tl.load(ksc_ptr + n * stride_ksc, mask=nmask, other=0.0)
        s = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_Q * H] float32
        s = tl.maximum(s, 0.0) * wts[None, :]
        if BLOCK_Q == 1:
            logit = tl.sum(s, axis=1)[:, None]
        else:
            logit = tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_Q, H)), axis=2)  # [BLOCK_N, BLOCK_Q]
        logit = logit * ksc[:, None]
        inside = (n[:, None] >= ks[None, :]) & (n[:, None] < ke[None, :])
        ptrs = out_rows[None, :] + n[:, None]
        if CLEAN:
            tl.store(ptrs, tl.where(inside, logit, float("-inf")), mask=rmask[None, :] & nmask[:, None])
        else:
            tl.store(ptrs, logit, mask=inside & rmask[None, :])

    if CLEAN:
        # Columns outside [t_lo * BLOCK_N, t_hi * BLOCK_N): -inf.
        c_lo = tl.minimum(t_lo * BLOCK_N, N)
        c_hi = tl.maximum(t_hi * BLOCK_N, c_lo)
        offs_f = tl.arange(0, FILL_N)
        ninf = tl.full([BLOCK_Q, FILL_N], float("-inf"), tl.float32)
        for c0 in range(0, c_lo, FILL_N):
            cols = c0 + offs_f
            tl.store(out_rows[:, None] + cols[None, :], ninf, mask=rmask[:, None] & (cols < c_lo)[None, :])
        for c0 in range(c_hi, N, FILL_N):
            cols = c0 + offs_f
            tl.store(out_rows[:, None] + cols[None, :], ninf, mask=rmask[:, None] & (cols < N)[None, :])


# Tuned on an H200 (see scripts/gpu_logits_bench.py); overridable for benchmarking.
CONFIG = {"BLOCK_Q": 2, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def _pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def fp8_mqa_logits(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, clean, config=None) -> None:
    """See :func:`sparse_indexer.fp8_mqa_logits`; arguments are checked."""
    cfg = dict(CONFIG, **(config or {}))
    m, h, d = q.shape
    n = k_fp8.shape[0]
    if not (_pow2(h) and _pow2(d)) or d < 32 or h < 16:
        raise NotImplementedError(f"triton fp8_mqa_logits needs power-of-two H >= 16 and D >= 32, got {h=}, {d=}")
    if m == 0 or n == 0:
        return
    block_q = cfg["BLOCK_Q"]
    if block_q * h > 256:
        block_q = max(1, 256 // h)
    grid = (triton.cdiv(m, block_q),)
    _mqa_logits_kernel[grid](
        out, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke,
        m, n,
        out.stride(0), q.stride(0), q.stride(1), k_fp8.stride(0), k_scale.stride(0), weights.stride(0),
        cu_seqlen_ks.stride(0), cu_seqlen_ke.stride(0),
        H=h, D=d, BLOCK_Q=block_q, BLOCK_N=cfg["BLOCK_N"], CLEAN=bool(clean), FILL_N=cfg.get("FILL_N", 1024),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
