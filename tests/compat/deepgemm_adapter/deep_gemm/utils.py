"""``deep_gemm.utils``: the casts DeepGEMM's attention test imports, written for the adapter (FP8 only)."""

from __future__ import annotations

import torch

__all__ = ["cast_back_from_fp4", "cast_back_from_fp8", "ceil_div", "per_custom_dims_cast_to_fp8",
           "per_token_cast_to_fp4", "per_token_cast_to_fp8"]


def ceil_div(a, b):
    return (a + b - 1) // b


def _ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, torch.ceil(torch.log2(x)))


def per_custom_dims_cast_to_fp8(x: torch.Tensor, dims, use_ue8m0: bool):
    """``x`` -> ``(fp8 values, float32 scales)`` with one scale per index of the kept ``dims`` (amax / 448, floor
    1e-4; rounded up to a power of two with ``use_ue8m0``); the scales squeezed."""
    reduce = tuple(i for i in range(x.dim()) if i not in set(dims))
    amax = x.abs().float().amax(dim=reduce, keepdim=True).clamp(min=1e-4)
    sf = amax / 448.0
    if use_ue8m0:
        sf = _ceil_pow2(sf)
    return (x.float() / sf).to(torch.float8_e4m3fn), sf.squeeze()


def _unsupported(*args, **kwargs):
    raise NotImplementedError("MXFP4/MXFP8 casts: FP4 and MX formats are Blackwell-only in DeepGEMM and not "
                              "supported by sparse-indexer")


per_token_cast_to_fp4 = cast_back_from_fp4 = per_token_cast_to_fp8 = cast_back_from_fp8 = _unsupported
