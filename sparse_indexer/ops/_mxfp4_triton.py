"""Triton helpers shared by the MXFP4 kernels (docs/spec.md §3a): where a key's bytes sit inside a block of an
MXFP4 cache in its byte order (``"flat"`` or aiter's ``"tiled:N,C,L"``; :func:`sparse_indexer.kcache.mxfp4_offsets`
is the reference), and the host side that turns a ``cache_order`` string into the kernels' constants."""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from buffers.limits import mxfp4_tile

__all__ = ["value_offset", "scale_offset", "tile_constants"]


@triton.jit
def value_offset(t, j, HALF: tl.constexpr, N: tl.constexpr, C: tl.constexpr):
    """Byte offset inside the block of value byte ``j`` (of ``HALF = D / 2``) of the block's key ``t``: runs of
    ``N`` keys, each stored as ``[C-byte chunk, key, byte]`` (``N = C = 1``: the flat ``t * HALF + j``)."""
    return (t // N) * (N * HALF) + (j // C) * (N * C) + (t % N) * C + j % C


@triton.jit
def scale_offset(t, s, BS: tl.constexpr, HALF: tl.constexpr, NB: tl.constexpr, N: tl.constexpr,
                 L: tl.constexpr):
    """Byte offset inside the block of scale byte ``s`` (of ``NB = D / 32``) of the block's key ``t``: after the
    block's ``BS * HALF`` value bytes, runs of ``N`` keys stored as ``[s % L, key, s // L]`` (``N = L = 1``: the
    flat ``BS * HALF + t * NB + s``)."""
    PER: tl.constexpr = NB // L
    return BS * HALF + (t // N) * (N * NB) + (s % L) * (N * PER) + (t % N) * PER + s // L


@functools.lru_cache(maxsize=64)
def tile_constants(cache_order: str, bs: int, d: int, what: str) -> dict:
    """``{"TN": N, "TC": C, "TL": L}`` of an MXFP4 ``cache_order`` for a kernel of ``what``; ``NotImplementedError``
    where the order does not tile ``bs``-key blocks of ``D = d`` (the public functions check it first). Cached:
    every call of the kernels asks (callers only read the dict)."""
    try:
        n, c, lanes = mxfp4_tile(cache_order)
    except ValueError as e:
        raise NotImplementedError(f"{what} reads the MXFP4 orders 'flat' and 'tiled:N,C,L', not {cache_order!r}") from e
    if bs % n or (d // 2) % c or (d // 32) % lanes:
        raise NotImplementedError(f"{what}: the MXFP4 order {cache_order!r} does not tile {bs}-key blocks of D={d}")
    return {"TN": n, "TC": c, "TL": lanes}
