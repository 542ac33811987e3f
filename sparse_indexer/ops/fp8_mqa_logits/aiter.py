"""aiter backend of ``fp8_mqa_logits`` (ROCm; aiter imported lazily): aiter's ``fp8_mqa_logits``.

On gfx942 (whose kernels read e4m3fnuz) e4m3fn operands are converted first with :func:`fnuz_operands`
(values x0.5, scales and weights x2: exact). aiter allocates its ``[M, N]`` result (a column slice of a
256-column-padded tensor), which is copied into ``out``: this backend's prefill is not allocation-free.
"""

from __future__ import annotations

import torch

from ...fp8 import fn_to_fnuz
from .._aiter import aiter_triton_module, gcn_arch

__all__ = ["fnuz_operands", "fp8_mqa_logits"]


def fnuz_operands(q, k_fp8, k_scale, weights):
    """e4m3fn ``(q, k_fp8, k_scale, weights)`` -> e4m3fnuz operands with identical logits (docs/spec.md §2).

    Each FP8 value is halved (exact: the fnuz byte of ``v/2`` decodes like the fn byte of ``v``), so every dot
    product shrinks 4x, compensated by doubling both the key scales and the weights (powers of two: exact).
    """
    q_nuz, w2 = fn_to_fnuz(q, weights)
    k_nuz, s2 = fn_to_fnuz(k_fp8, k_scale)
    return q_nuz, k_nuz, s2, w2


def fp8_mqa_logits(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, clean) -> None:
    """See :func:`sparse_indexer.fp8_mqa_logits`; arguments are checked."""
    m, h, d = q.shape
    n = k_fp8.shape[0]
    if m == 0 or n == 0:
        return
    if h & (h - 1) or d & (d - 1):
        raise NotImplementedError(f"aiter's fp8_mqa_logits needs H and D powers of two, got H={h}, D={d}")
    arch = gcn_arch(q.device)
    if arch == "gfx942" and q.dtype == torch.float8_e4m3fn:
        q, k_fp8, k_scale, weights = fnuz_operands(q, k_fp8, k_scale, weights)
    elif arch != "gfx942" and q.dtype == torch.float8_e4m3fnuz:
        raise NotImplementedError(f"aiter's fp8_mqa_logits on {arch} reads e4m3fn, got e4m3fnuz")
    logits = aiter_triton_module("fp8_mqa_logits").fp8_mqa_logits(
        q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=clean)
    out.copy_(logits)
