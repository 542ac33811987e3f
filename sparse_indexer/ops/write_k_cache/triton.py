"""Triton ``write_k_cache``: quantize each key row (docs/spec.md §3), scatter it into the paged cache (§4).

One program quantizes ``BLOCK_T`` rows of ``k`` (a ``[BLOCK_T, D]`` tile in registers): ``amax`` per row,
``scale = max(amax, 1e-4) / qmax`` with IEEE division, ``ue8m0`` rounding done on the float32 bits
(``(bits + 0x7FFFFF) & 0xFF800000`` rounds a positive normal up to a power of two, exactly), values
``clamp(k / scale)`` cast round-to-nearest-even. e4m3fnuz bytes are produced through the e4m3fn cast of
``2 * v`` (the same byte decodes to half the value in fnuz; ``-0`` becomes ``+0``, as fnuz has no negative zero),
which is exact and keeps the kernel free of fnuz support in the compiler. Bit-exact with the reference.

A slot outside ``[0, num_blocks * block_size)`` (any negative one, or one past the cache: a caller's bug when value
checks are off) skips its row: folded into the row mask, so nothing outside the written slots is touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._runtime.launch import Launcher
from ..._runtime.triton_compat import fix_interpreter, interpreting
from ...fp8 import K_SCALE_FLOOR, QUANT_MAX
from .._mxfp4_triton import scale_offset, tile_constants, value_offset

fix_interpreter()  # Triton 3.6's interpreter under NumPy >= 2.4 (sparse_indexer/_runtime/triton_compat.py)
_SOFT_FP8 = interpreting()  # Triton decides at import whether kernels are interpreted; so does this flag

__all__ = ["write_k_cache"]

_BLOCK_T = 16


@triton.jit
def _e4m3fn_bits(q):
    """Round-to-nearest-even e4m3fn byte of float32 ``q`` (``|q| <= 448``), in integer arithmetic.

    Only used under the interpreter, whose float32 -> fp8 cast mis-rounds when rounding carries into the
    exponent; compiled kernels use the hardware cast (``cvt.rn.satfinite``), which is exact.
    """
    u = q.to(tl.uint32, bitcast=True)
    sign = (u >> 31) << 7
    a = u & 0x7FFFFFFF
    e = a >> 23
    # normal e4m3fn (|q| >= 2**-6): round the float32 mantissa to 3 bits, rebias the exponent 127 -> 7
    r = (a + 0x7FFFF + ((a >> 20) & 1)) & 0xFFF00000
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # subnormal e4m3fn: m = rne(|q| * 2**9), 0..8 (8 is the smallest normal, byte 0x08)
    mant = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(141 - tl.minimum(e, 141), 31)
    sh = tl.maximum(sh, 1)
    sub = (mant + (1 << (sh - 1)) - 1 + ((mant >> sh) & 1)) >> sh
    sub = tl.where(e == 0, 0, sub)
    byte = tl.where(e >= 121, normal, sub) | sign
    byte = tl.where(a > 0x7F800000, 0x7F, byte)  # NaN: 0x7F, as the hardware cast gives it
    return byte.to(tl.uint8)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _write_k_cache_kernel(
    cache_ptr,  # [num_blocks * block_stride] uint8 (byte view of the 3-D cache)
    k_ptr,  # [T, D] bf16/fp16/fp32, row stride stride_k
    slot_ptr,  # [S] int64/int32
    S,
    num_slots,  # num_blocks * block_size: a slot outside [0, num_slots) is skipped
    stride_k,
    block_stride,  # bytes between blocks
    BS: tl.constexpr,  # block_size
    D: tl.constexpr,
    QMAX: tl.constexpr,
    FLOOR: tl.constexpr,
    UE8M0: tl.constexpr,
    FNUZ: tl.constexpr,
    SOFT_FP8: tl.constexpr,  # integer rounding instead of the cast (interpreter only, see _e4m3fn_bits)
    SIGNED_NAN: tl.constexpr,  # the GPU's cast may give -NaN the byte 0xFF (ROCm): make it 0x7F
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < S
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    ok = tmask & (slot >= 0) & (slot < num_slots)
    d = tl.arange(0, D)
    x = tl.load(k_ptr + t.to(tl.int64)[:, None] * stride_k + d[None, :], mask=ok[:, None], other=0.0)
    x = x.to(tl.float32)
    # NaN propagates through the max, the floor and the clamp (docs/spec.md §3: a row with a NaN has a NaN scale
    # and NaN values; an infinite amax a +inf scale, NaN = inf / inf at the infinities): max.NaN costs what max does
    amax = tl.reduce(tl.abs(x), 1, _max_nan)
    scale = tl.math.div_rn(tl.maximum(amax, FLOOR, propagate_nan=tl.PropagateNan.ALL),
                           tl.full(amax.shape, QMAX, tl.float32))
    if UE8M0:
        bits = scale.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFFFF) & 0xFF800000  # (+inf stays +inf; NaN does not, hence the where below)
        scale = bits.to(tl.float32, bitcast=True)
    scale = tl.where(amax != amax, float("nan"), scale)  # one NaN scale: 0x7FC00000, as the reference stores it
    q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    q = tl.minimum(tl.maximum(q, -QMAX, propagate_nan=tl.PropagateNan.ALL), QMAX, propagate_nan=tl.PropagateNan.ALL)
    if FNUZ:
        q = q * 2.0  # the fnuz byte of v is the fn byte of 2v (except -0, which fnuz lacks)
    if SOFT_FP8:
        qb = _e4m3fn_bits(q)
    else:
        qb = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)  # (satfinite: NaN -> 0x7F, e4m3fn's canonical NaN)
        if SIGNED_NAN:  # a cast that keeps a NaN's sign (not NVIDIA's cvt.satfinite): -NaN 0xFF -> 0x7F
            qb = tl.where(qb == 0xFF, tl.full(qb.shape, 0x7F, tl.uint8), qb)
    if FNUZ:
        qb = tl.where(qb == 0x80, tl.zeros_like(qb), qb)
        qb = tl.where(qb == 0x7F, tl.full(qb.shape, 0x80, tl.uint8), qb)  # e4m3fnuz's only NaN (no finite 0x7F:
        # |2v| <= 448 rounds to at most 0x7E)
    blk = slot // BS
    off = slot - blk * BS
    base = blk * block_stride
    tl.store(cache_ptr + (base + off * D)[:, None] + d[None, :], qb, mask=ok[:, None])
    sptr = (cache_ptr + base + BS * D + off * 4).to(tl.pointer_type(tl.float32))
    tl.store(sptr, scale, mask=ok)


@triton.jit
def _e2m1_codes(v, neg):
    """e2m1 codes (0-15) of ``|v| <= 6`` (float32) and its sign: to nearest, ties to the even code (docs/spec.md
    §3a: the midpoints 0.75, 1.75 and 3.5 round up, 0.25, 1.25, 2.5 and 5 down)."""
    a = tl.abs(v)
    c = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
         + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return c + neg * 8


@triton.jit
def _write_mxfp4_kernel(
    cache_ptr,  # [num_blocks * block_stride] uint8 (byte view of the 3-D MXFP4 cache)
    k_ptr,  # [T, D] bf16/fp16/fp32, row stride stride_k
    slot_ptr,  # [S] int64/int32
    S,
    num_slots,  # num_blocks * block_size: a slot outside [0, num_slots) is skipped
    stride_k,
    block_stride,  # bytes between blocks
    BS: tl.constexpr,  # block_size
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BF16: tl.constexpr,  # k is bfloat16: widened from its bits (exact for subnormals, also in the interpreter)
    TN: tl.constexpr = 1,  # the byte order's runs of TN keys, TC-byte value chunks, TL scale lanes (flat: 1, 1, 1)
    TC: tl.constexpr = 1,
    TL: tl.constexpr = 1,
):
    """docs/spec.md §3a per key: each 32-element block's exponent from amax's float32 bits (``amax = 1.m *
    2**E``: ``e = E - 2``, one more when ``1.m > 1.5``; ``-126`` below ``6 * 2**-126``), the codes of ``x * 2**-e``
    (exact), element ``2j`` in byte ``j``'s low nibble; a block with a NaN or an infinity: scale byte 255, codes
    0. Values and scale bytes where the cache's byte order puts them (:mod:`.._mxfp4_triton`; flat: values at
    ``off * D / 2`` in the block, scale bytes at ``BS * D / 2 + off * D / 32``)."""
    HALF: tl.constexpr = D // 2
    NB: tl.constexpr = D // 32
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < S
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    ok = tmask & (slot >= 0) & (slot < num_slots)
    j = tl.arange(0, HALF)
    row = k_ptr + t.to(tl.int64)[:, None] * stride_k
    if BF16:
        row16 = row.to(tl.pointer_type(tl.uint16))
        xe = (tl.load(row16 + 2 * j[None, :], mask=ok[:, None], other=0).to(tl.uint32) << 16).to(tl.float32,
                                                                                                 bitcast=True)
        xo = (tl.load(row16 + 2 * j[None, :] + 1, mask=ok[:, None], other=0).to(tl.uint32) << 16).to(tl.float32,
                                                                                                     bitcast=True)
    else:
        xe = tl.load(row + 2 * j[None, :], mask=ok[:, None], other=0.0).to(tl.float32)  # elements 2j
        xo = tl.load(row + 2 * j[None, :] + 1, mask=ok[:, None], other=0.0).to(tl.float32)  # elements 2j + 1
    ae = tl.reshape(tl.abs(xe), (BLOCK_T, NB, 16))
    ao = tl.reshape(tl.abs(xo), (BLOCK_T, NB, 16))
    amax = tl.maximum(tl.max(ae, axis=2), tl.max(ao, axis=2))  # [BLOCK_T, NB] (NaN: caught below)
    bad = tl.max(((ae != ae) | (ae == float("inf")) | (ao != ao) | (ao == float("inf"))).to(tl.int32), axis=2) > 0
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 129 + ((bits & 0x7FFFFF) > 0x400000).to(tl.int32)
    e = tl.where(amax < 1.5 * 2.0**-124, -126, e)  # (the floor 6 * 2**-126, and subnormal or zero blocks)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2 ** -e, exact (e in [-126, 126])
    inv_full = tl.reshape(tl.broadcast_to(inv[:, :, None], (BLOCK_T, NB, 16)), (BLOCK_T, HALF))
    bad_full = tl.reshape(tl.broadcast_to(bad[:, :, None], (BLOCK_T, NB, 16)), (BLOCK_T, HALF))
    ce = _e2m1_codes(xe * inv_full, (xe.to(tl.int32, bitcast=True) >> 31) & 1)
    co = _e2m1_codes(xo * inv_full, (xo.to(tl.int32, bitcast=True) >> 31) & 1)
    byte = tl.where(bad_full, 0, ce | (co << 4)).to(tl.uint8)
    blk = slot // BS
    off = slot - blk * BS
    base = blk * block_stride
    tl.store(cache_ptr + base[:, None] + value_offset(off[:, None], j[None, :], HALF, TN, TC), byte, mask=ok[:, None])
    b = tl.arange(0, NB)
    sc = tl.where(bad, 255, e + 127).to(tl.uint8)
    tl.store(cache_ptr + base[:, None] + scale_offset(off[:, None], b[None, :], BS, HALF, NB, TN, TL), sc,
             mask=ok[:, None])


_LAUNCH_MX = Launcher(_write_mxfp4_kernel)
_LAUNCH = Launcher(_write_k_cache_kernel)
_CONFIGS: dict = {}  # (block_size, D, fp8 dtype, ue8m0) -> LaunchConfig


def _config(bs: int, d: int, fp8_dtype, ue8m0: bool):
    key = (bs, d, fp8_dtype, ue8m0)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = _LAUNCH.config(
            BS=bs, D=d, QMAX=QUANT_MAX[fp8_dtype], FLOOR=K_SCALE_FLOOR, UE8M0=ue8m0,
            FNUZ=fp8_dtype == torch.float8_e4m3fnuz, SOFT_FP8=_SOFT_FP8, SIGNED_NAN=torch.version.hip is not None,
            BLOCK_T=_BLOCK_T, num_warps=4)
    return cfg


def write_k_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, scale_fmt,
                  fp8_dtype, cache_scale="float32", cache_order="flat", cache_values="fp8") -> None:
    """See :func:`sparse_indexer.write_k_cache`; ``kv_cache`` is the 3-D view, arguments are checked. Writes
    float32 scales in the flat order only (another FP8 format raises ``NotImplementedError``), or MXFP4 keys
    (``cache_values="mxfp4"``, :func:`_write_mxfp4_kernel`)."""
    if cache_values == "mxfp4":
        _write_mxfp4(k, kv_cache, slot_mapping, cache_order)
        return
    if cache_scale != "float32" or cache_order != "flat":
        raise NotImplementedError(f"the Triton write_k_cache writes float32 scales in the flat order, got "
                                  f"{cache_scale!r}, {cache_order!r}")
    s = slot_mapping.shape[0]
    nb, bs, width = kv_cache.shape
    d = width - 4
    if d & (d - 1):
        raise NotImplementedError(f"the Triton write_k_cache needs a power-of-two head dim, got D={d}")
    if s == 0:
        return
    block_stride = kv_cache.stride()[0] if nb > 1 else bs * width  # CacheLayout.block_stride of the checked view
    _LAUNCH.launch_with(((s + _BLOCK_T - 1) // _BLOCK_T,), _config(bs, d, fp8_dtype, scale_fmt == "ue8m0"),
                        (kv_cache, k, slot_mapping, s, nb * bs, k.stride()[0], block_stride), 3)


def _write_mxfp4(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, order: str) -> None:
    """MXFP4 keys into an MXFP4 cache in byte order ``order`` (docs/spec.md §3a; arguments checked):
    :func:`_write_mxfp4_kernel`."""
    s = slot_mapping.shape[0]
    nb, bs, width = kv_cache.shape
    d = width * 32 // 17
    tiles = tile_constants(order, bs, d, "the Triton write_k_cache")
    if s == 0:
        return
    block_stride = kv_cache.stride()[0] if nb > 1 else -(-bs * width // 4) * 4
    bf16 = k.dtype == torch.bfloat16
    key = ("mxfp4", bs, d, bf16, order)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = _LAUNCH_MX.config(BS=bs, D=d, BLOCK_T=_BLOCK_T, BF16=bf16, num_warps=4, **tiles)
    _LAUNCH_MX.launch_with(((s + _BLOCK_T - 1) // _BLOCK_T,), cfg,
                           (kv_cache, k, slot_mapping, s, nb * bs, k.stride()[0], block_stride), 3)
