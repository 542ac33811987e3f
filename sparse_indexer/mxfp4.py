"""MXFP4 keys and queries (docs/spec.md §3a): the block-scaled 4-bit format vLLM uses for DeepSeek-V4's indexer
on AMD CDNA4 and (opt-in) on NVIDIA SM10x.

Per block of 32 consecutive elements of a row: one UE8M0 scale byte ``s`` (the scale ``2 ** (s - 127)``) and 32
e2m1 values, two per byte (element ``2j`` in the low nibble). A D = 128 row is 64 value bytes and 4 scale bytes.
Everything here is the reference: pure torch, exact, any device.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "E2M1_VALUES", "NAN_SCALE", "dequantize_mxfp4", "mxfp4_scores", "quantize_k_mxfp4",
           "quantize_mxfp4", "quantize_q_mxfp4"]

BLOCK = 32
"""Elements per scale."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of the e2m1 codes 0-7 (code 8 + c is the negative of code c)."""
E2M1_MAX = 6.0
NAN_SCALE = 0xFF
"""The scale byte of a block holding a NaN or an infinity: it decodes to NaN (UE8M0's NaN)."""
_AMAX_FLOOR = E2M1_MAX * 2.0 ** -126  # the smallest amax: its scale is 2**-126
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# midpoints between neighbouring magnitudes, and at a tie whether the upper neighbour is the even code
_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)


def _block_exponents(amax: torch.Tensor) -> torch.Tensor:
    """``e = ceil(log2(max(amax, 6 * 2**-126) / 6))`` exactly (int32), for finite float32 ``amax >= 0``: the
    smallest ``e`` with ``6 * 2**e >= amax``. The float64 quotient is exact when it is a power of two (``amax =
    3 * 2**k``) and otherwise lies well clear of one, so ``frexp`` decides the ceiling without rounding."""
    r = amax.double().clamp(min=_AMAX_FLOOR) / E2M1_MAX
    mant, exp = torch.frexp(r)  # r = mant * 2**exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)
    return e.clamp(-127, 127).to(torch.int32)


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0-15) of float64 ``v``: to nearest, ties to the even code, saturating at 6; the sign of
    a value that rounds to zero is kept (code 8 for a negative one)."""
    a = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for mid, up in zip(_MIDS, _TIE_UP):
        code += ((a > mid) | ((a == mid) & up)).to(torch.uint8)  # codes rise by one past each midpoint
    return code + torch.signbit(v).to(torch.uint8) * 8


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dimension of ``x`` in blocks of 32 (docs/spec.md §3a).

    Args:
        x: ``[..., D]`` bfloat16, float16 or float32, ``D`` a positive multiple of 32.

    Returns:
        ``(values [..., D // 2] uint8, scales [..., D // 32] uint8)``: byte ``j`` of ``values`` holds element
        ``2j`` in its low nibble and ``2j + 1`` in its high one; ``x ~= e2m1(values) * 2 ** (scales - 127)`` per
        block. A block holding a NaN or an infinity gets the scale byte :data:`NAN_SCALE` and value codes 0.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(f"x must be a tensor [..., D], got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    d = x.shape[-1]
    if d == 0 or d % BLOCK:
        raise ValueError(f"the last dimension must be a positive multiple of {BLOCK}, got {d}")
    blocks = x.float().reshape(*x.shape[:-1], d // BLOCK, BLOCK)
    finite = torch.isfinite(blocks).all(dim=-1)
    amax = torch.where(finite, blocks.abs().amax(dim=-1), 0.0)
    e = _block_exponents(amax)
    v = blocks.double() * torch.ldexp(torch.ones_like(e, dtype=torch.float64), -e).unsqueeze(-1)  # exact
    codes = torch.where(finite.unsqueeze(-1), _e2m1_codes(v), 0)
    codes = codes.reshape(*x.shape[:-1], d // 2, 2)
    values = codes[..., 0] | (codes[..., 1] << 4)
    scales = torch.where(finite, e + 127, NAN_SCALE).to(torch.uint8)
    return values, scales


def quantize_k_mxfp4(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``k [T, D]`` (bfloat16, float16 or float32) to ``(values [T, D // 2] uint8, scales [T, D // 32]
    uint8)``: :func:`quantize_mxfp4` per token."""
    if not isinstance(k, torch.Tensor) or k.dim() != 2:
        raise ValueError(f"k must be a 2-D tensor [T, D], got {getattr(k, 'shape', type(k))}")
    return quantize_mxfp4(k)


def quantize_q_mxfp4(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``q [T, H, D]`` to ``(values [T, H, D // 2] uint8, scales [T, H, D // 32] uint8)``. The query keeps
    its own scales (they are not folded into the weights, which stay ``w * D**-0.5 * H**-0.5``)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor [T, H, D], got {getattr(q, 'shape', type(q))}")
    return quantize_mxfp4(q)


def _check_pair(name: str, values: torch.Tensor, scales: torch.Tensor) -> int:
    if values.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"{name} values and scales must be uint8, got {values.dtype} and {scales.dtype}")
    if values.dim() < 1 or values.shape[:-1] != scales.shape[:-1] or values.shape[-1] != scales.shape[-1] * 16:
        raise ValueError(f"{name}: values [..., D // 2] and scales [..., D // 32] must agree, got "
                         f"{list(values.shape)} and {list(scales.shape)}")
    if values.device != scales.device:
        raise ValueError(f"{name} values and scales must be on one device, got {values.device} and {scales.device}")
    return values.shape[-1] * 2


def _magnitudes(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=codes.device)
    return table[codes.long()]


def _unpack(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The e2m1 values of ``values [..., D // 2]`` as ``[..., D]`` of ``dtype`` (exact)."""
    codes = torch.stack((values & 0xF, values >> 4), dim=-1).reshape(*values.shape[:-1], values.shape[-1] * 2)
    return _magnitudes(codes, dtype)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2 ** e`` as float64, exactly, for int exponents in float64's normal range ([-1022, 1023]; the scale bytes'
    exponents and their sums stay within [-254, 256]): the exponent field written directly, a multiply cheaper
    than ``torch.ldexp``'s power."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _scale_exponents(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s - 127 as int32, whether s is the NaN byte)``."""
    return scales.to(torch.int32) - 127, scales == NAN_SCALE


def dequantize_mxfp4(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``e2m1(values) * 2 ** (scales - 127)`` per block as ``[..., D]`` of ``dtype`` (float32 or float64; exact in
    float64, and in float32 wherever the result is a normal float32 number); NaN in a block whose scale byte is
    :data:`NAN_SCALE`."""
    d = _check_pair("dequantize_mxfp4", values, scales)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be float32 or float64, got {dtype}")
    x = _unpack(values, torch.float64).reshape(*values.shape[:-1], d // BLOCK, BLOCK)
    e, nan = _scale_exponents(scales)
    x = x * _pow2(e).unsqueeze(-1)
    x = torch.where(nan.unsqueeze(-1), float("nan"), x)
    return x.reshape(*values.shape[:-1], d).to(dtype)


def mxfp4_scores(q_values: torch.Tensor, q_scales: torch.Tensor, k_values: torch.Tensor, k_scales: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
    """The MXFP4 scores of ``M`` query rows against ``N`` keys (docs/spec.md §3a), the reference's order:

    ``score[m, n] = sum_h w[m, h] * relu(sum_b t[m, h, n, b])`` with ``t = 2 ** (sq + sk - 254) * sum_{d in b}
    q4[d] * k4[d]``: each block's dot is exact (products of e2m1 values summed over 32 elements), scaled by
    the power of two and rounded once to float32; the blocks are summed in float32 in order, then relu, the
    weight and the head sum in float32, head after head. A NaN scale byte on either side makes the score NaN.

    Args:
        q_values: ``[M, H, D // 2]`` uint8; q_scales: ``[M, H, D // 32]`` uint8.
        k_values: ``[N, D // 2]`` uint8; k_scales: ``[N, D // 32]`` uint8.
        weights: ``[M, H]`` float32.

    Returns:
        ``[M, N]`` float32.
    """
    d = _check_pair("queries", q_values, q_scales)
    dk = _check_pair("keys", k_values, k_scales)
    if q_values.dim() != 3 or k_values.dim() != 2 or d != dk:
        raise ValueError(f"queries [M, H, D // 2] and keys [N, D // 2] of one D, got {list(q_values.shape)} and "
                         f"{list(k_values.shape)}")
    m, h = q_values.shape[:2]
    if weights.dtype != torch.float32 or tuple(weights.shape) != (m, h):
        raise ValueError(f"weights must be float32 [{m}, {h}], got {weights.dtype} {list(weights.shape)}")
    nb = d // BLOCK
    q4 = _unpack(q_values, torch.float32).reshape(m, h, nb, BLOCK)
    k4 = _unpack(k_values, torch.float32).reshape(-1, nb, BLOCK)
    # exact block dots: |sum| <= 32 * 36 in steps of 0.25, well inside float32's 24 bits
    dots = torch.einsum("mhbd,nbd->mhnb", q4, k4)
    eq, nq = _scale_exponents(q_scales)
    ek, nk = _scale_exponents(k_scales)
    shift = eq[:, :, None, :] + ek[None, None, :, :]  # [M, H, N, nb]
    t = (dots.double() * _pow2(shift)).float()  # exact product, one rounding per block
    nan = nq[:, :, None, :] | nk[None, None, :, :]
    t = torch.where(nan, float("nan"), t)
    acc = t[..., 0]
    for b in range(1, nb):
        acc = acc + t[..., b]
    out = torch.zeros(m, k_values.shape[0], dtype=torch.float32, device=q_values.device)
    for i in range(h):
        out = out + weights[:, i : i + 1] * torch.relu(acc[:, i, :])
    return out
