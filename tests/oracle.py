"""An independent float64 oracle of docs/spec.md, written from the spec alone (imports nothing from the library).

- FP8 bytes are decoded bit by bit (docs/spec.md §2) and values are rounded to FP8 by nearest-even search over the
  table of all finite values, so neither depends on torch's FP8 casts.
- Quantization (docs/spec.md §3): scales are float32 numbers (the stored format): ``max(amax, floor) / qmax`` rounded to
  float32, then, under ``ue8m0``, rounded up to a power of two exactly (``math.frexp``, no ``log2``).
- The paged K cache (docs/spec.md §4) is read and written byte by byte from the tensor's storage, using only its
  ``storage_offset`` and first stride.
- Logits (docs/spec.md §5) in float64 (top-k selections are judged on them by :mod:`sparse_indexer.testing`).
"""

from __future__ import annotations

import math
import sys

import torch

E4M3FN = "e4m3fn"
E4M3FNUZ = "e4m3fnuz"
FMT_OF_DTYPE = {torch.float8_e4m3fn: E4M3FN, torch.float8_e4m3fnuz: E4M3FNUZ}
LARGEST = {E4M3FN: 448.0, E4M3FNUZ: 240.0}
QMAX = {E4M3FN: 448.0, E4M3FNUZ: 224.0}
K_FLOOR = 1e-4
Q_FLOOR = 1e-10
NEG_INF = float("-inf")

assert sys.byteorder == "little", "the cache's float32 scales are little-endian bytes"


def fmt(x) -> str:
    """``"e4m3fn"``/``"e4m3fnuz"`` from a torch dtype or a name."""
    return FMT_OF_DTYPE.get(x, x)


# ----------------------------------------------------------------------------------------------- FP8 bytes
def decode_byte(byte: int, f: str) -> float:
    """The value of one FP8 byte (docs/spec.md §2): sign, 4 exponent bits, 3 mantissa bits."""
    f = fmt(f)
    sign = -1.0 if byte & 0x80 else 1.0
    e = (byte >> 3) & 0xF
    m = byte & 0x7
    if f == E4M3FN:
        if e == 15 and m == 7:
            return math.nan
        bias = 7
    else:
        if byte == 0x80:
            return math.nan
        bias = 8
    if e == 0:
        return sign * (m / 8.0) * 2.0 ** (1 - bias)
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - bias)


_TABLES: dict[str, torch.Tensor] = {}


def table(f: str) -> torch.Tensor:
    """``[256]`` float64: the value of every byte."""
    f = fmt(f)
    if f not in _TABLES:
        _TABLES[f] = torch.tensor([decode_byte(b, f) for b in range(256)], dtype=torch.float64)
    return _TABLES[f]


def decode(x: torch.Tensor, f=None) -> torch.Tensor:
    """float64 values of an FP8 tensor (or of a uint8 tensor of FP8 bytes in format ``f``)."""
    if x.dtype != torch.uint8:
        f = x.dtype
        x = x.view(torch.uint8)
    return table(f)[x.long()]


def round_to_fp8(x: torch.Tensor, f: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Round float64 ``x`` (``|x| <= largest``) to the nearest FP8 value, ties to the even code.

    Returns ``(values float64, codes uint8)``.
    """
    f = fmt(f)
    tab = table(f)
    top = 0x7E if f == E4M3FN else 0x7F  # largest positive finite code
    pos = tab[: top + 1]  # increasing
    a = x.abs()
    assert bool((a <= LARGEST[f]).all()), "round_to_fp8 needs |x| <= the largest finite value"
    hi = torch.searchsorted(pos, a).clamp(max=top)  # pos[hi - 1] < a <= pos[hi]
    lo = (hi - 1).clamp(min=0)
    dlo = a - pos[lo]
    dhi = pos[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    neg = (x < 0) & (code != 0)
    code = torch.where(neg, code | 0x80, code)
    return tab[code], code.to(torch.uint8)


def midpoint_distance(x: torch.Tensor, f: str) -> torch.Tensor:
    """Relative distance of ``|x|`` to the nearest midpoint between two neighbouring FP8 values."""
    f = fmt(f)
    top = 0x7E if f == E4M3FN else 0x7F
    pos = table(f)[: top + 1]
    mids = (pos[1:] + pos[:-1]) / 2
    a = x.abs().reshape(-1, 1)
    return ((a - mids[None, :]).abs().amin(1) / a.clamp(min=1e-300).squeeze(1)).view(x.shape)


# ----------------------------------------------------------------------------------------------- docs/spec.md §3
def f32(x: float) -> float:
    """Round a Python float to the nearest float32."""
    return float(torch.tensor(x, dtype=torch.float64).float())


def pow2_ceil(s: float) -> float:
    """The smallest power of two ``>= s`` (s > 0), exactly."""
    m, e = math.frexp(s)  # s = m * 2**e, 0.5 <= m < 1
    return math.ldexp(1.0, e - 1) if m == 0.5 else math.ldexp(1.0, e)


def quantize(x: torch.Tensor, f, scale_fmt, floor: float = K_FLOOR):
    """Quantize the rows (last dim) of ``x`` (docs/spec.md §3).

    Returns ``(values float64 [..., D], scale float64 [...], exact float64 [..., D])`` where ``values`` are the
    FP8 values, ``scale`` the float32-representable scales and ``exact = clamp(x / scale)`` before rounding.
    """
    f = fmt(f)
    qmax = QMAX[f]
    x64 = x.double()
    amax = x64.abs().amax(-1)
    flat = []
    for a in amax.reshape(-1).tolist():
        s = f32(max(a, f32(floor)) / qmax)
        if scale_fmt == "ue8m0":
            s = pow2_ceil(s)
        flat.append(s)
    scale = torch.tensor(flat, dtype=torch.float64).view(amax.shape)
    exact = (x64 / scale.unsqueeze(-1)).clamp(-qmax, qmax)
    values, _ = round_to_fp8(exact, f)
    return values, scale, exact


# ----------------------------------------------------------------------------------------------- docs/spec.md §4
def _storage_bytes(kv: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """(flat uint8 storage, byte offset of block 0, block stride, block_size, D)."""
    assert kv.dtype == torch.uint8 and kv.dim() in (3, 4)
    flat = torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage())
    nb, bs, width = kv.shape[0], kv.shape[1], kv.shape[-1]
    stride0 = kv.stride(0) if nb > 1 else bs * width
    return flat, kv.storage_offset(), stride0, bs, width - 4


def _value_index(base, stride0, bs, d, blocks, offsets):
    return (base + blocks * stride0 + offsets * d)[..., None] + torch.arange(d)


def _scale_index(base, stride0, bs, d, blocks, offsets):
    return (base + blocks * stride0 + bs * d + 4 * offsets)[..., None] + torch.arange(4)


def read_slots(kv: torch.Tensor, slots: torch.Tensor, f) -> tuple[torch.Tensor, torch.Tensor]:
    """Values (float64 ``[..., D]``) and scales (float64 ``[...]``) of cache ``slots`` (int64), from raw bytes."""
    flat, base, stride0, bs, d = _storage_bytes(kv)
    slots = slots.long()
    blocks, offsets = slots // bs, slots % bs
    vbytes = flat[_value_index(base, stride0, bs, d, blocks, offsets)]
    sbytes = flat[_scale_index(base, stride0, bs, d, blocks, offsets)].contiguous()
    scales = sbytes.view(torch.float32).squeeze(-1).double() if sbytes.numel() else sbytes.new_empty(
        slots.shape, dtype=torch.float64)
    return decode(vbytes, f), scales


def read_slot_bytes(kv: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw bytes of cache ``slots``: (values ``[..., D]`` uint8, scale ``[..., 4]`` uint8)."""
    flat, base, stride0, bs, d = _storage_bytes(kv)
    slots = slots.long()
    blocks, offsets = slots // bs, slots % bs
    return (flat[_value_index(base, stride0, bs, d, blocks, offsets)],
            flat[_scale_index(base, stride0, bs, d, blocks, offsets)])


def write_slots(kv: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Store FP8 bytes ``codes`` (uint8 ``[S, D]``) and float32 ``scales`` ``[S]`` at ``slots``, byte by byte."""
    flat, base, stride0, bs, d = _storage_bytes(kv)
    slots = slots.long()
    blocks, offsets = slots // bs, slots % bs
    flat[_value_index(base, stride0, bs, d, blocks, offsets)] = codes.to(torch.uint8)
    sb = scales.to(torch.float32).contiguous().view(torch.uint8).view(-1, 4)
    flat[_scale_index(base, stride0, bs, d, blocks, offsets)] = sb


def slots_of(block_table_row: torch.Tensor, positions: torch.Tensor, bs: int) -> torch.Tensor:
    """Cache slots of request-local positions through one block-table row."""
    positions = positions.long()
    return block_table_row.long()[positions // bs] * bs + positions % bs


# ----------------------------------------------------------------------------------------------- docs/spec.md §5
def scores(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """float64 ``k_scale[n] * sum_h weights[m, h] * relu(q[m, h] . k[n])``: q ``[M, H, D]``, k ``[N, D]``."""
    s = torch.einsum("mhd,nd->mhn", q.double(), k.double()).clamp(min=0)
    return torch.einsum("mh,mhn->mn", weights.double(), s) * k_scale.double()[None, :]


def ragged_logits(q, k, k_scale, weights, ks, ke) -> torch.Tensor:
    """docs/spec.md §5 ragged: ``[M, N]`` float64, ``-inf`` outside ``[ks[m], ke[m])``."""
    val = scores(q, k, k_scale, weights)
    n = torch.arange(k.shape[0])[None, :]
    inside = (n >= ks.long()[:, None]) & (n < ke.long()[:, None])
    return torch.where(inside, val, torch.full_like(val, NEG_INF))


def row_limits(context_lens: torch.Tensor, next_n: int) -> list[int]:
    """``limit[b * next_n + j]`` of docs/spec.md §5 as Python ints (clamped at 0)."""
    cl = context_lens.long().tolist()
    out = []
    for b in range(len(cl)):
        for j in range(next_n):
            lim = cl[b][j] if context_lens.dim() == 2 else cl[b] - next_n + j + 1
            out.append(max(0, lim))
    return out


def paged_logits(q, kv, weights, context_lens, block_table, width: int) -> torch.Tensor:
    """§5 paged: ``[B * next_n, width]`` float64, ``-inf`` at ``p >= limit``. ``q`` is FP8 ``[B, n, H, D]``."""
    b, next_n, h, d = q.shape
    bs = kv.shape[1]
    qv = decode(q)
    out = torch.full((b * next_n, width), NEG_INF, dtype=torch.float64)
    lims = row_limits(context_lens, next_n)
    for bi in range(b):
        longest = max(lims[bi * next_n : (bi + 1) * next_n], default=0)
        if longest == 0:
            continue
        pos = torch.arange(longest)
        kvals, ksc = read_slots(kv, slots_of(block_table[bi], pos, bs), q.dtype)
        for j in range(next_n):
            r = bi * next_n + j
            lim = lims[r]
            if lim:
                out[r, :lim] = scores(qv[bi, j : j + 1], kvals[:lim], ksc[:lim], weights[r : r + 1])[0]
    return out

