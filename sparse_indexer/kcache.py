"""The paged indexer K cache (docs/spec.md §4): layout, views, allocation.

A cache is a ``uint8`` tensor ``[num_blocks, block_size, D + 4]`` (or ``[num_blocks, block_size, 1, D + 4]``).
Inside block ``b`` (starting at byte ``b * stride0``) the bytes are block-major: first the FP8 values of all
``block_size`` tokens (``D`` bytes each), then their float32 scales (4 bytes each).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from buffers.limits import mxfp4_tile

__all__ = ["HEAD_DIMS", "CacheLayout", "cache_layout", "cache_views", "compressed_slot_mapping", "encode_ue8m0x4",
           "decode_ue8m0", "new_kv_cache", "preshuffled_offsets", "mxfp4_offsets", "read_keys", "read_keys_mxfp4",
           "slots_from_block_table", "write_keys", "write_keys_mxfp4"]

HEAD_DIMS = (64, 128)
"""The indexer head dims the ops take (docs/spec.md §1)."""


class CacheLayout(NamedTuple):
    """Static facts about one K cache tensor (a NamedTuple, so ``torch.compile`` can build one while tracing)."""

    num_blocks: int
    block_size: int
    head_dim: int
    block_stride: int  # bytes between consecutive blocks (stride0), >= block_size * bytes per key

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def scale_offset(self) -> int:
        """Byte offset of the scale region inside a block of an FP8 cache (an MXFP4 cache's is ``block_size *
        head_dim // 2``)."""
        return self.block_size * self.head_dim


def view_3d(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[nb, bs, D + 4]`` view of a cache already checked by :func:`as_3d` (no checks: the fast paths)."""
    return kv_cache if kv_cache.dim() == 3 else kv_cache[:, :, 0, :]


def as_3d(kv_cache: torch.Tensor, name: str = "kv_cache") -> torch.Tensor:
    """``[nb, bs, D + 4]`` view of a 3-D or 4-D (``[nb, bs, 1, D + 4]``) cache, checked."""
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != torch.uint8:
        raise TypeError(f"{name} must be uint8 (a byte cache), got {kv_cache.dtype}")
    if kv_cache.dim() == 4:
        if kv_cache.shape[2] != 1:
            raise ValueError(f"4-D {name} must be [num_blocks, block_size, 1, D + 4], got {tuple(kv_cache.shape)}")
    elif kv_cache.dim() != 3:
        raise ValueError(
            f"{name} must be [num_blocks, block_size, D + 4] or [num_blocks, block_size, 1, D + 4], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    return view_3d(kv_cache)


def cache_layout(kv_cache: torch.Tensor, name: str = "kv_cache", mxfp4: bool = False) -> CacheLayout:
    """Check ``kv_cache``'s layout and return its :class:`CacheLayout` (``mxfp4``: a cache of MXFP4 keys,
    ``D / 2 + D / 32`` bytes each, docs/spec.md §3a; the bytes carry no format)."""
    kv = as_3d(kv_cache, name)
    nb, bs, width = kv.shape
    if mxfp4:
        d = width * 32 // 17
        if d not in HEAD_DIMS or d // 2 + d // 32 != width:
            raise ValueError(f"{name}.shape[-1] of an MXFP4 cache must be D / 2 + D / 32 with D in {HEAD_DIMS} "
                             f"(34 or 68), got {width}")
    else:
        d = width - 4
        if d not in HEAD_DIMS:
            raise ValueError(f"{name}.shape[-1] must be D + 4 with D in {HEAD_DIMS}, got {width}")
    stride0 = kv.stride(0) if nb > 1 else -(-bs * width // 4) * 4  # (one block: its bytes, 4-byte aligned)
    if kv.stride(2) != 1 or (bs > 1 and kv.stride(1) != width):
        raise ValueError(f"{name} must be contiguous inside a block (strides [*, {width}, 1]), got {kv.stride()}")
    if stride0 < bs * width or stride0 % 4:
        raise ValueError(
            f"{name} block stride must be a multiple of 4 and >= block_size * {width} = {bs * width}, got {stride0}"
        )
    # Dynamo cannot trace storage_offset(); eager calls (and the op bodies, which run eagerly) check it.
    if not torch.compiler.is_compiling() and kv.storage_offset() % 4:
        raise ValueError(f"{name} must start at a 4-byte aligned storage offset, got {kv.storage_offset()}")
    return CacheLayout(num_blocks=nb, block_size=bs, head_dim=d, block_stride=stride0)


def cache_views(kv_cache: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the value and scale regions: (``[nb, bs, D]`` fp8_dtype, ``[nb, bs]`` float32).

    Writing into them writes the cache. Works for padded block strides.
    """
    lay = cache_layout(kv_cache)
    kv = as_3d(kv_cache)
    nb, bs, d = lay.num_blocks, lay.block_size, lay.head_dim
    raw = kv.as_strided((nb, bs * (d + 4)), (lay.block_stride, 1), kv.storage_offset())
    values = raw[:, : bs * d].view(nb, bs, d).view(fp8_dtype)
    scales = raw[:, bs * d :].view(torch.float32)
    return values, scales


def new_kv_cache(num_blocks: int, block_size: int, head_dim: int = 128, *, device="cpu", block_pad: int = 0,
                 four_d: bool = False, mxfp4: bool = False) -> torch.Tensor:
    """Allocate a zeroed cache ``[num_blocks, block_size, head_dim + 4]`` uint8 (``head_dim`` 64 or 128:
    ``ValueError`` for any other, as every op would reject the cache); ``mxfp4``: of MXFP4 keys, ``[num_blocks,
    block_size, head_dim / 2 + head_dim / 32]`` (docs/spec.md §3a).

    ``block_pad`` extra bytes per block (a multiple of 4) give a padded block stride, as when the cache is a
    view of a larger per-layer allocation; ``four_d`` returns the ``[nb, bs, 1, width]`` shape.
    """
    for name, v, lo in (("num_blocks", num_blocks, 0), ("block_size", block_size, 1), ("block_pad", block_pad, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS} (what every op reads), got {head_dim!r}")
    if block_pad % 4:
        raise ValueError(f"block_pad must be a multiple of 4, got {block_pad}")
    width = head_dim // 2 + head_dim // 32 if mxfp4 else head_dim + 4
    per_block = block_size * width + block_pad
    if mxfp4 and per_block % 4:  # (4-byte aligned blocks, as every cache: padded up)
        block_pad += 4 - per_block % 4
        per_block = block_size * width + block_pad
    flat = torch.zeros(num_blocks * per_block, dtype=torch.uint8, device=device)
    kv = flat.as_strided((num_blocks, block_size, width), (per_block, width, 1))
    return kv.unsqueeze(2) if four_d else kv


def slots_from_block_table(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of request-local token ``positions`` ``[B, P]`` through ``block_table`` ``[B, max_blocks]``:
    ``block_table[b, p // block_size] * block_size + p % block_size`` (int64). Negative positions give -1."""
    pos = positions.long()
    blk = block_table.long().gather(1, (pos.clamp(min=0) // block_size))
    return torch.where(pos >= 0, blk * block_size + pos.clamp(min=0) % block_size, -1)


def compressed_slot_mapping(block_table: torch.Tensor, seq_lens, query_lens, block_size: int, *,
                            compress_ratio: int = 1, token_slots: torch.Tensor | None = None) -> torch.Tensor:
    """The step's ``slot_mapping`` ``[sum(query_lens)]`` int64 for a cache of ``compress_ratio`` (``C``) tokens per
    key (docs/spec.md §4a): the slot of the key each new token writes, -1 where it writes none.

    Token ``j`` of request ``r`` sits at position ``p = seq_lens[r] - query_lens[r] + j``. With ``C = 1`` it
    writes key ``p``; with ``C > 1`` only a token ending a group, ``(p + 1) % C == 0``, writes one: key ``e = p //
    C`` (what the model's compressor produced from tokens ``[C e, C e + C)``), at slot ``block_table[r, e //
    block_size] * block_size + e % block_size``; every other token maps to -1. ``block_size`` counts keys per
    page (tokens per page ``// C``). ``token_slots`` (optional, ``[sum(query_lens)]``): the tokens' own slots in
    the engine's token-level caches; a token whose own slot is negative (padding, a replayed token) writes no key
    (-1), as vLLM's ``get_compressed_slot_mapping`` has it.

    ``block_table`` ``[num_reqs, max_blocks]`` int32 (on any device; the result is on its device), ``seq_lens``
    and ``query_lens`` host ints (or CPU tensors) in tokens.
    """
    seq = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    qry = [int(x) for x in (query_lens.tolist() if isinstance(query_lens, torch.Tensor) else query_lens)]
    if len(seq) != len(qry) or block_table.dim() != 2 or block_table.shape[0] < len(seq):
        raise ValueError(f"compressed_slot_mapping: {len(seq)} seq_lens, {len(qry)} query_lens and a block table of "
                         f"shape {tuple(block_table.shape)} (one row per request at least)")
    if isinstance(compress_ratio, bool) or not isinstance(compress_ratio, int) or compress_ratio < 1:
        raise ValueError(f"compress_ratio must be an int >= 1, got {compress_ratio!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for r, (s, q) in enumerate(zip(seq, qry)):
        if not 0 <= q <= s:
            raise ValueError(f"request {r}: query_len {q} must be in [0, seq_len {s}]")
    dev = block_table.device
    t = sum(qry)
    if not t:
        return torch.empty(0, dtype=torch.int64, device=dev)
    q = torch.tensor(qry, dtype=torch.long)
    req = torch.repeat_interleave(torch.arange(len(qry)), q)
    first = torch.cumsum(q, 0) - q
    pos = torch.tensor(seq, dtype=torch.long)[req] - q[req] + (torch.arange(t) - first[req])
    writes = (pos + 1) % compress_ratio == 0
    ent = torch.where(writes, pos // compress_ratio, 0)  # (a token that writes nothing needs no block)
    if int(ent.max()) // block_size >= block_table.shape[1]:
        raise ValueError(f"a request needs key {int(ent.max())}, past the {block_table.shape[1]} blocks of "
                         f"block_table (block_size {block_size})")
    req_d, ent_d = req.to(dev), ent.to(dev)
    blk = block_table.long()[req_d, ent_d // block_size]
    out = torch.where(writes.to(dev), blk * block_size + ent_d % block_size, -1)
    if token_slots is not None:
        if token_slots.shape != (t,):
            raise ValueError(f"token_slots must be [{t}], got {tuple(token_slots.shape)}")
        out = torch.where(token_slots.to(dev) < 0, -1, out)
    return out


# --- cache formats (docs/spec.md §4, buffers.CacheFormat): decoding what other writers store ---------------------

UE8M0_NAN = 0xFF
"""The UE8M0 byte that means NaN (the OCP MX scale format); every other byte ``e`` is ``2 ** (e - 127)``."""


def decode_ue8m0(e: torch.Tensor) -> torch.Tensor:
    """float32 scales of UE8M0 exponent bytes ``e`` (uint8, any shape), exactly: ``2 ** (e - 127)`` (``e = 0``:
    the subnormal ``2 ** -127``), NaN for ``e = 255`` (also what ``pack_ue8m0_x4`` stores for a NaN or
    infinite float32 scale)."""
    ei = e.to(torch.int32)
    bits = torch.where(ei == 0, 0x00400000, ei << 23)
    bits = torch.where(ei == UE8M0_NAN, 0x7FC00000, bits)
    return bits.view(torch.float32)


def encode_ue8m0x4(scale: torch.Tensor) -> torch.Tensor:
    """The 4 scale bytes of ``scale`` (float32, any shape) in the ``"ue8m0x4"`` encoding, as int32 words (vLLM's
    ``pack_ue8m0_x4``: the float32 exponent field repeated in each byte, ``((bits >> 23) & 0xFF) * 0x01010101``).
    Exact for powers of two (``quantize_k(..., scale_fmt="ue8m0")``); any other scale loses its mantissa."""
    e = (scale.contiguous().view(torch.int32) >> 23) & 0xFF
    return e * 0x01010101


def preshuffled_offsets(block_size: int, head_dim: int, device=None) -> torch.Tensor:
    """``[block_size, head_dim]`` int64: byte offset of value ``(t, d)`` inside a block of the ``"preshuffled"``
    order (16 x 16 tiles: ``(t // 16) * 16 * D + (d // 16) * 256 + (t % 16) * 16 + d % 16``, docs/spec.md §4);
    ``ValueError`` unless both are multiples of 16."""
    if block_size % 16 or head_dim % 16:
        raise ValueError(f"the preshuffled order needs block_size and head_dim multiples of 16, got {block_size}, "
                         f"{head_dim}")
    t = torch.arange(block_size, device=device)[:, None]
    d = torch.arange(head_dim, device=device)[None, :]
    return (t // 16) * 16 * head_dim + (d // 16) * 256 + (t % 16) * 16 + d % 16


def read_keys(kv_cache: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, fp8_dtype: torch.dtype,
              scale: str = "float32", order: str = "flat") -> tuple[torch.Tensor, torch.Tensor]:
    """The keys in slots ``(blk, off)`` (int64 block ids and offsets inside the block, equal shapes ``S``) of a cache
    in the format ``(fp8_dtype, scale, order)`` (a ``buffers.CacheFormat``'s fields): their values ``[*S, D]`` in
    ``fp8_dtype`` (token order ``d = 0..D-1`` whatever the byte order) and float32 scales ``[*S]`` (``"ue8m0x4"``:
    decoded from the first of the four bytes, :func:`decode_ue8m0`; the other three are not read).

    A copy (advanced indexing); the reference backends' reader of every format."""
    lay = cache_layout(kv_cache)
    kv = as_3d(kv_cache)
    nb, bs, d = lay.num_blocks, lay.block_size, lay.head_dim
    raw = kv.as_strided((nb, bs * (d + 4)), (lay.block_stride, 1), kv.storage_offset())
    if order == "flat":
        values = raw[:, : bs * d].view(nb, bs, d).view(fp8_dtype)[blk, off]
    else:
        offs = preshuffled_offsets(bs, d, kv.device)
        values = raw[blk.unsqueeze(-1), offs[off]].view(fp8_dtype)
    if scale == "float32":
        scales = raw[:, bs * d :].view(torch.float32)[blk, off]
    else:
        scales = decode_ue8m0(raw[:, bs * d :].view(nb, bs, 4)[blk, off, 0])
    return values, scales


def write_keys(kv_cache: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, values: torch.Tensor,
               scales: torch.Tensor, scale: str = "float32", order: str = "flat") -> None:
    """Store keys (``values [S, D]`` FP8 in token order, ``scales [S]`` float32) in slots ``(blk, off)`` (int64
    ``[S]``) of a cache in the scale encoding ``scale`` and byte order ``order`` (:func:`read_keys`'s inverse;
    ``"ue8m0x4"`` is exact for power-of-two scales only: :func:`encode_ue8m0x4`)."""
    lay = cache_layout(kv_cache)
    kv = as_3d(kv_cache)
    nb, bs, d = lay.num_blocks, lay.block_size, lay.head_dim
    raw = kv.as_strided((nb, bs * (d + 4)), (lay.block_stride, 1), kv.storage_offset())
    if order == "flat":
        raw[:, : bs * d].view(nb, bs, d).view(values.dtype)[blk, off] = values
    else:
        raw[blk[:, None], preshuffled_offsets(bs, d, kv.device)[off]] = values.view(torch.uint8)
    if scale == "float32":
        raw[:, bs * d :].view(torch.float32)[blk, off] = scales
    else:
        raw[:, bs * d :].view(torch.int32)[blk, off] = encode_ue8m0x4(scales)


def mxfp4_offsets(block_size: int, head_dim: int, order: str = "flat",
                  device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte offsets inside one block of an MXFP4 cache in byte order ``order`` (docs/spec.md §3a; ``"flat"`` or
    ``"tiled:N,C,L"``, :func:`buffers.limits.mxfp4_tile`): ``(values [block_size, D / 2], scales [block_size, D /
    32])`` int64, of value byte ``j`` and scale byte ``s`` of the block's key ``t``. The values fill the block's
    first ``block_size * D / 2`` bytes, the scales the rest; in runs of ``N`` keys, value byte ``j`` of key ``t``
    is at ``(t // N) * N * D / 2 + (j // C) * N * C + (t % N) * C + j % C`` and scale byte ``s`` at
    ``block_size * D / 2 + (t // N) * N * D / 32 + (s % L) * N * (D / 32 / L) + (t % N) * (D / 32 / L) + s // L``
    (``"flat"`` is ``N = C = L = 1``: ``t * D / 2 + j`` and ``block_size * D / 2 + t * D / 32 + s``)."""
    n, c, lanes = mxfp4_tile(order)
    half, nsc = head_dim // 2, head_dim // 32
    if block_size % n or half % c or nsc % lanes:
        raise ValueError(f"the MXFP4 byte order {order!r} needs block_size a multiple of {n}, D / 2 = {half} of {c} "
                         f"and D / 32 = {nsc} of {lanes}")
    t = torch.arange(block_size, device=device)[:, None]
    j = torch.arange(half, device=device)[None, :]
    sc = torch.arange(nsc, device=device)[None, :]
    run, tt = t // n * n, t % n
    values = run * half + j // c * (n * c) + tt * c + j % c
    per = nsc // lanes
    scales = block_size * half + run * nsc + sc % lanes * (n * per) + tt * per + sc // lanes
    return values, scales


def _mxfp4_bytes(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``[nb, block bytes]`` uint8 view of an MXFP4 cache's blocks, its block size and head dim."""
    lay = cache_layout(kv_cache, mxfp4=True)
    kv = as_3d(kv_cache)
    nb, bs, d = lay.num_blocks, lay.block_size, lay.head_dim
    raw = kv.as_strided((nb, bs * (d // 2 + d // 32)), (lay.block_stride, 1), kv.storage_offset())
    return raw, bs, d


def read_keys_mxfp4(kv_cache: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
                    order: str = "flat") -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP4 keys in slots ``(blk, off)`` (int64, equal shapes ``S``) of an MXFP4 cache in byte order ``order``
    (docs/spec.md §3a, :func:`mxfp4_offsets`): ``(values [*S, D / 2], scales [*S, D / 32])`` uint8 (a copy)."""
    raw, bs, d = _mxfp4_bytes(kv_cache)
    vo, so = mxfp4_offsets(bs, d, order, raw.device)
    b = blk.unsqueeze(-1)
    return raw[b, vo[off]], raw[b, so[off]]


def write_keys_mxfp4(kv_cache: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, values: torch.Tensor,
                     scales: torch.Tensor, order: str = "flat") -> None:
    """Store MXFP4 keys (``values [S, D / 2]``, ``scales [S, D / 32]`` uint8) in slots ``(blk, off)`` (int64 ``[S]``)
    of an MXFP4 cache in byte order ``order`` (:func:`read_keys_mxfp4`'s inverse)."""
    raw, bs, d = _mxfp4_bytes(kv_cache)
    vo, so = mxfp4_offsets(bs, d, order, raw.device)
    b = blk.unsqueeze(-1)
    raw[b, vo[off]] = values
    raw[b, so[off]] = scales
