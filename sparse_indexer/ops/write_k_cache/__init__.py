"""``write_k_cache``: quantize keys and store them in the paged K cache (docs/spec.md §3, §4)."""

from __future__ import annotations

import torch

from buffers.limits import CacheFormat

from ..._runtime import checks as C
from ..._runtime import library
from ...fp8 import FP8_DTYPES, SCALE_FMTS
from ...kcache import as_3d, cache_layout, view_3d

__all__ = ["write_k_cache"]


def write_k_cache(k: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                  scale_fmt: str | None = "ue8m0", fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                  backend: str | None = None, check_values: bool | None = None,
                  cache_format: CacheFormat | None = None, _checked: bool = False) -> None:
    """Quantize ``k`` per token and write token ``i`` to cache slot ``slot_mapping[i]``.

    Args:
        k: ``[T, D]`` bfloat16/float16/float32 keys (rows ``>= S`` are ignored).
        kv_cache: ``[num_blocks, block_size, D + 4]`` or ``[num_blocks, block_size, 1, D + 4]`` uint8,
            block-major (docs/spec.md §4); written in place.
        slot_mapping: ``[S]`` int64 (int32 accepted), ``S <= T``; slot = block * block_size + offset;
            negative slots are skipped.
        scale_fmt: ``"ue8m0"`` or ``None`` (plain float32 scales).
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e4m3fnuz``.
        backend: ``None``/``"auto"`` (the best backend available on the device; the next one when it raises
            ``NotImplementedError`` for the case) or a backend's name (``sparse_indexer.backends.names()``).
        check_values: check slot values against the cache (a device sync on GPU); default: on CPU only.
        cache_format: write the cache in this :class:`~buffers.CacheFormat` (``None``: ``fp8_dtype`` values, float32
            scales, flat order). Its ``fp8_dtype`` must equal ``fp8_dtype`` unless that is left at its default
            (``ValueError``); ``"ue8m0x4"`` scales need ``scale_fmt="ue8m0"`` (powers of two, exactly encoded;
            ``ValueError``), the ``"preshuffled"`` order a block size that is a multiple of 16. Only the reference
            backend writes every format (Triton: the plain one; aiter: its own preshuffled order), the others
            raise ``NotImplementedError`` and ``auto`` falls back. ``CacheFormat(values="mxfp4")``: MXFP4 keys
            (docs/spec.md §3a, ``[num_blocks, block_size, D / 2 + D / 32]`` caches; ``scale_fmt`` does not apply,
            ``fp8_dtype`` must be left at its default), written by the reference and Triton backends.
        _checked: for :func:`sparse_indexer.sparse_attn_indexer` alone (see :func:`sparse_indexer.top_k_per_row`).
    """
    if cache_format is not None and type(cache_format) is CacheFormat and cache_format.mxfp4:
        if fp8_dtype != torch.float8_e4m3fn:
            raise ValueError(f"fp8_dtype={fp8_dtype} does not apply to an MXFP4 cache (leave it at its default)")
        if not _checked:
            _, lay = _check(k, kv_cache, slot_mapping, scale_fmt, fp8_dtype, check_values, mxfp4=True)
            C.check_order(cache_format, lay.block_size, lay.head_dim)
        library.call("write_k_cache", backend, k.device, k, as_3d(kv_cache), slot_mapping, scale_fmt=scale_fmt,
                     fp8_dtype=fp8_dtype, **C.format_kwargs(cache_format, None))
        return
    if cache_format is not None:
        _write_format(cache_format, fp8_dtype, scale_fmt, kv_cache)
        fp8_dtype = cache_format.fp8_dtype
        fmt_kw = C.format_kwargs(cache_format, None)  # the scale encoding and byte order, where not the plain ones
        if fmt_kw:  # (an FP8 format alone is what fp8_dtype says: the plain call below)
            if not _checked:
                _check(k, kv_cache, slot_mapping, scale_fmt, fp8_dtype, check_values)
            library.call("write_k_cache", backend, k.device, k, as_3d(kv_cache), slot_mapping, scale_fmt=scale_fmt,
                         fp8_dtype=fp8_dtype, **fmt_kw)
            return
    if _checked:
        library.call("write_k_cache", backend, k.device, k, as_3d(kv_cache), slot_mapping, scale_fmt=scale_fmt,
                     fp8_dtype=fp8_dtype)
        return
    ts = (kv_cache, k, slot_mapping)  # (outputs first: _checks.Layouts)
    if _plain_eager():
        proven, facts = _LAYOUTS.match(ts, (scale_fmt, fp8_dtype))
        if proven and not kv_cache.storage_offset() & 3:
            # the layout (and scale_fmt, fp8_dtype) of a call that passed every check below: only aliasing
            # (matched), the cache's alignment (above) and the values
            dev, num_slots, cpu, memo = facts
            if C.values_wanted(check_values, cpu):
                _check_values(slot_mapping, num_slots)
            _run("write_k_cache", backend, dev, (k, view_3d(kv_cache),
                                                 slot_mapping), {"scale_fmt": scale_fmt, "fp8_dtype": fp8_dtype},
                 ts[:1], memo)
            return
    kv3, lay = _check(k, kv_cache, slot_mapping, scale_fmt, fp8_dtype, check_values)
    dev = k.device
    if library.runs_directly(dev, ts):
        _LAYOUTS.remember(ts, 1, (scale_fmt, fp8_dtype), (dev, lay.num_slots, dev.type == "cpu", {}))
    library.call("write_k_cache", backend, dev, k, kv3, slot_mapping, scale_fmt=scale_fmt, fp8_dtype=fp8_dtype)


_LAYOUTS = C.Layouts()  # the last fully checked call's layout (host overhead per call)
_plain_eager = library.plain_eager
_run = library.run_direct


def _check_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    C.values_in("slot_mapping", slot_mapping, None, num_slots,
                lambda: f"slots must be < num_blocks * block_size = {num_slots} (negative = skip)")


def _write_format(fmt, fp8_dtype, scale_fmt, kv_cache) -> None:
    """What a declared write format needs (see :func:`write_k_cache`'s ``cache_format``)."""
    if type(fmt) is not CacheFormat:
        raise TypeError(f"cache_format must be a CacheFormat or None, got {type(fmt).__name__}")
    if fp8_dtype != fmt.fp8_dtype and fp8_dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_dtype={fp8_dtype} disagrees with cache_format.fp8_dtype={fmt.fp8_dtype} (give one)")
    if fmt.scale == "ue8m0x4" and scale_fmt != "ue8m0":
        raise ValueError(f"ue8m0x4 scale bytes hold powers of two only: write with scale_fmt='ue8m0', not "
                         f"{scale_fmt!r}")
    lay = cache_layout(as_3d(kv_cache))
    C.check_order(fmt, lay.block_size, lay.head_dim)


def _check(k, kv_cache, slot_mapping, scale_fmt, fp8_dtype, check_values, mxfp4: bool = False):
    """Every check of :func:`write_k_cache` (``mxfp4``: of a cache of MXFP4 keys); returns the cache's 3-D view
    and its layout."""
    C.tensor("k", k, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32), last_contiguous=True)
    dev = k.device
    kv3 = as_3d(kv_cache)
    lay = cache_layout(kv3, mxfp4=mxfp4)
    C.tensor("kv_cache", kv_cache, device=dev)
    C.tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), device=dev,
             contiguous=True)
    if k.shape[1] != lay.head_dim:
        raise ValueError(f"k.shape[1] must equal the cache's head dim D={lay.head_dim}, got {k.shape[1]}")
    if slot_mapping.shape[0] > k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but k has only {k.shape[0]} rows")
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")
    if fp8_dtype not in FP8_DTYPES:
        raise ValueError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype!r}")
    C.no_alias("kv_cache", kv_cache, k=k, slot_mapping=slot_mapping)
    if C.want_value_checks(check_values, k, slot_mapping):
        _check_values(slot_mapping, lay.num_slots)
    return kv3, lay
