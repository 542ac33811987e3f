"""FP8 formats and the quantization of keys and queries (docs/spec.md §2, §3)."""

from __future__ import annotations

import torch

from buffers.limits import FP8_DTYPES

__all__ = [
    "FP8_DTYPES", "FP8_MAX", "QUANT_MAX", "SCALE_FMTS", "fp8_max", "quant_max", "ue8m0", "quantize_k",
    "quantize_q", "fn_to_fnuz", "fp8_name",
]

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
"""Largest finite value of each format."""
QUANT_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 224.0}
"""The value quantization maps ``amax`` to (e4m3fnuz quantizes against 224, as vLLM does)."""
SCALE_FMTS = ("ue8m0", None)
K_SCALE_FLOOR = 1e-4
Q_SCALE_FLOOR = 1e-10


def _check_fp8(fp8_dtype) -> None:
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype!r}")


def fp8_name(fp8_dtype: torch.dtype) -> str:
    _check_fp8(fp8_dtype)
    return "e4m3fn" if fp8_dtype == torch.float8_e4m3fn else "e4m3fnuz"


def fp8_max(fp8_dtype: torch.dtype) -> float:
    """Largest finite value of ``fp8_dtype``: 448 (e4m3fn) or 240 (e4m3fnuz)."""
    _check_fp8(fp8_dtype)
    return FP8_MAX[fp8_dtype]


def quant_max(fp8_dtype: torch.dtype) -> float:
    """The bound quantization scales against: 448 (e4m3fn) or 224 (e4m3fnuz)."""
    _check_fp8(fp8_dtype)
    return QUANT_MAX[fp8_dtype]


def ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Round positive float32 ``scale`` **up** to a power of two, exactly (no log2 rounding). NaN and +inf stay
    as they are (docs/spec.md §3: a row with a NaN or an infinity has a NaN or +inf scale)."""
    mant, exp = torch.frexp(scale)  # scale = mant * 2**exp, mant in [0.5, 1)
    exp = torch.where(mant == 0.5, exp - 1, exp)
    return torch.where(torch.isfinite(scale), torch.ldexp(torch.ones_like(scale), exp), scale)


def _quantize_rows(x: torch.Tensor, floor: float, fp8_dtype, scale_fmt):
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")
    _check_fp8(fp8_dtype)
    qmax = QUANT_MAX[fp8_dtype]
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # divide by a tensor, not a Python number: CUDA turns `x / scalar` into `x * (1 / scalar)`, which is off by
    # one ulp for non-power-of-two divisors (qmax = 448 or 224) and would break plain (non-ue8m0) scales
    scale = amax.clamp(min=floor) / torch.full_like(amax, qmax)
    if scale_fmt == "ue8m0":
        scale = ue8m0(scale)
    scale = torch.where(scale.isnan(), float("nan"), scale)  # one NaN scale (0x7FC00000), whatever the input's NaN
    values = (xf / scale.unsqueeze(-1)).clamp(-qmax, qmax)
    values = torch.where(values.isnan(), float("nan"), values).to(fp8_dtype)  # one NaN byte: 0x7F (fn), 0x80 (fnuz)
    return values, scale


def quantize_k(k: torch.Tensor, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn, scale_fmt: str | None = "ue8m0"):
    """Quantize keys per token (docs/spec.md §3): one scale per token, the quantization group being the head dim.

    Args:
        k: ``[T, D]`` bfloat16, float16 or float32.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        scale_fmt: ``"ue8m0"`` (scale rounded up to a power of two) or ``None`` (plain float32 scale).

    Returns:
        ``(k_fp8 [T, D] fp8_dtype, k_scale [T] float32)`` with ``k ~= k_fp8.float() * k_scale[:, None]``.
        A row holding a NaN gets a NaN scale and NaN values; a row whose largest magnitude is infinite (no NaN)
        gets a +inf scale, NaN where the input is infinite and 0 elsewhere (docs/spec.md §3). Nothing raises:
        reading the values would synchronise a GPU.
    """
    if not isinstance(k, torch.Tensor) or k.dim() != 2:
        raise ValueError(f"k must be a 2-D tensor [T, D], got {getattr(k, 'shape', type(k))}")
    if k.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"k must be bfloat16, float16 or float32, got {k.dtype}")
    return _quantize_rows(k, K_SCALE_FLOOR, fp8_dtype, scale_fmt)


def quantize_q(q: torch.Tensor, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn, scale_fmt: str | None = "ue8m0"):
    """Quantize queries per (token, head) with scale floor 1e-10 (docs/spec.md §3).

    Args:
        q: ``[T, H, D]`` bfloat16, float16 or float32.

    Returns:
        ``(q_fp8 [T, H, D] fp8_dtype, q_scale [T, H] float32)``. Fold ``q_scale`` into the weights:
        ``weights = w_proj(x) * H**-0.5 * D**-0.5 * q_scale``. Non-finite input as in :func:`quantize_k`, per
        (token, head): a NaN gives a NaN scale and NaN values, an infinity a +inf scale.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor [T, H, D], got {getattr(q, 'shape', type(q))}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    return _quantize_rows(q, Q_SCALE_FLOOR, fp8_dtype, scale_fmt)


def fn_to_fnuz(values: torch.Tensor, scale: torch.Tensor):
    """Convert e4m3fn values and their scales to e4m3fnuz (docs/spec.md §2): values x0.5 before the cast, scales x2.

    Both formats share the same value set up to the factor 2, so the conversion is exact (values below the
    smallest e4m3fnuz subnormal would flush, but halving an e4m3fn value never leaves the fnuz range).

    Returns ``(values_fnuz, scale * 2)``.
    """
    if values.dtype != torch.float8_e4m3fn:
        raise TypeError(f"values must be float8_e4m3fn, got {values.dtype}")
    return (values.float() * 0.5).to(torch.float8_e4m3fnuz), scale * 2.0
