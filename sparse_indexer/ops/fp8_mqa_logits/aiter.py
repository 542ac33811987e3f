"""aiter backend of ``fp8_mqa_logits`` (ROCm; aiter imported lazily): aiter's ``fp8_mqa_logits``.

On gfx942 (whose kernels read e4m3fnuz) e4m3fn operands are converted first with :func:`fnuz_operands`
(values x0.5, scales and weights x2: exact). aiter allocates its ``[M, N]`` result (a column slice of a
256-column-padded tensor), which is copied into ``out`` (rounded for a bfloat16 ``out``; gathered for compressed
rows): this backend's prefill is not allocation-free.
"""

from __future__ import annotations

import torch

from ...fp8 import fn_to_fnuz
from .._aiter import aiter_triton_module, gcn_arch

__all__ = ["check_case", "fnuz_operands", "fp8_mqa_logits"]


def fnuz_operands(q, k_fp8, k_scale, weights):
    """e4m3fn ``(q, k_fp8, k_scale, weights)`` -> e4m3fnuz operands with identical logits (docs/spec.md §2).

    Each FP8 value is halved (exact: the fnuz byte of ``v/2`` decodes like the fn byte of ``v``), so every dot
    product shrinks 4x, compensated by doubling both the key scales and the weights (powers of two: exact).
    """
    q_nuz, w2 = fn_to_fnuz(q, weights)
    k_nuz, s2 = fn_to_fnuz(k_fp8, k_scale)
    return q_nuz, k_nuz, s2, w2


def _mix_case(q, k_fp8) -> None:
    if k_fp8.dtype != q.dtype:
        raise NotImplementedError(f"aiter's fp8_mqa_logits: {q.dtype} queries against {k_fp8.dtype} keys (a mix of "
                                  "FP8 formats)")


def _kernel_case(q) -> None:
    _, h, d = q.shape
    if h & (h - 1) or d & (d - 1):
        raise NotImplementedError(f"aiter's fp8_mqa_logits needs H and D powers of two, got H={h}, D={d}")
    arch = gcn_arch(q.device)
    if arch != "gfx942" and q.dtype == torch.float8_e4m3fnuz:
        raise NotImplementedError(f"aiter's fp8_mqa_logits on {arch} reads e4m3fn, got e4m3fnuz")


def check_case(q, k_fp8) -> None:
    """``NotImplementedError`` for a call aiter's ``fp8_mqa_logits`` does not take (``q [M, H, D]``, ``k_fp8``):
    a mix of FP8 formats, ``H`` or ``D`` not a power of two, e4m3fnuz queries off gfx942."""
    _mix_case(q, k_fp8)
    _kernel_case(q)


def fp8_mqa_logits(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, clean, compressed=False,
                   q_scale=None) -> None:
    """See :func:`sparse_indexer.fp8_mqa_logits`; arguments are checked.

    aiter writes float32 ``[M, N]``; a bfloat16 ``out`` receives it rounded by the copy, and compressed rows
    (``compressed=True``) are gathered from it (``out[m, j] = logits[m, ks[m] + j]``, in row tiles)."""
    if q_scale is not None:
        raise NotImplementedError("the aiter backend has no MXFP4 scoring kernel (docs/spec.md §3a)")
    _mix_case(q, k_fp8)
    m = q.shape[0]
    n = k_fp8.shape[0]
    if m == 0 or out.shape[1] == 0:
        return
    if n == 0:
        if clean:
            out.fill_(float("-inf"))
        return
    _kernel_case(q)
    if gcn_arch(q.device) == "gfx942" and q.dtype == torch.float8_e4m3fn:
        q, k_fp8, k_scale, weights = fnuz_operands(q, k_fp8, k_scale, weights)
    logits = aiter_triton_module("fp8_mqa_logits").fp8_mqa_logits(
        q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=clean)
    if not compressed:
        out.copy_(logits)
        return
    w = out.shape[1]
    rt = max(1, min(m, (1 << 24) // max(1, w)))
    cols = torch.arange(w, device=out.device)[None, :]
    for r0 in range(0, m, rt):
        r1 = min(m, r0 + rt)
        ks = cu_seqlen_ks[r0:r1, None].long()
        lens = cu_seqlen_ke[r0:r1, None].long() - ks
        val = torch.gather(logits[r0:r1], 1, (ks + cols).clamp(0, n - 1))
        dst = out[r0:r1]
        fill = torch.full_like(val, float("-inf")) if clean else dst.float()
        dst.copy_(torch.where(cols < lens, val, fill))
