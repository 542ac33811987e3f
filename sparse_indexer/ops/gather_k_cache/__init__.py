"""``gather_k_cache``: copy the paged keys of several requests into one dense workspace (docs/spec.md §4)."""

from __future__ import annotations

import torch

from buffers.limits import CacheFormat

from ..._runtime import checks as C
from ..._runtime import library
from ...kcache import as_3d, cache_layout, view_3d

__all__ = ["gather_k_cache"]

_HOST_LIST_ROWS = 64  # value checks of up to this many requests read cu_seq_lens as one Python list


def gather_k_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, cu_seq_lens: torch.Tensor, *,
                   out_k: torch.Tensor, out_scale: torch.Tensor, backend: str | None = None,
                   check_values: bool | None = None, cache_fp8_dtype: torch.dtype | None = None,
                   cache_format: CacheFormat | None = None, _checked: bool = False) -> None:
    """Gather the keys of ``R`` requests, concatenated, into ``out_k[:cu_seq_lens[R]]`` / ``out_scale``.

    Args:
        kv_cache: ``[num_blocks, block_size, D + 4]`` (or 4-D) uint8 paged cache.
        block_table: ``[R, max_blocks]`` int32, block ids of each request.
        cu_seq_lens: ``[R + 1]`` int32, non-decreasing, ``cu_seq_lens[0] == 0``; request r owns output rows
            ``[cu_seq_lens[r], cu_seq_lens[r + 1])``.
        out_k: ``[N, D]`` fp8 in the cache's format (the bytes are copied), ``N >= cu_seq_lens[R]``; rows beyond
            are not touched.
        out_scale: ``[N]`` float32.
        backend: ``None``/``"auto"`` (the best backend available on the device; the next one when it raises
            ``NotImplementedError`` for the case) or a backend's name (``sparse_indexer.backends.names()``).
        check_values: check ``cu_seq_lens`` and the block ids against ``block_table`` and the cache (reads
            device values: a sync on a GPU); default: on the CPU only.
        cache_fp8_dtype: the FP8 format the cache was written in (``write_k_cache``'s ``fp8_dtype``); ``None``:
            ``float8_e4m3fn``. ``out_k`` must be in that format (``TypeError`` naming both otherwise: the cache bytes
            carry no format, docs/spec.md §4); convert afterwards with :func:`sparse_indexer.fn_to_fnuz`. The
            shorthand of ``cache_format=CacheFormat(fp8_dtype=...)``.
        cache_format: the cache's whole :class:`~buffers.CacheFormat`, or ``None`` (``cache_fp8_dtype``'s rule);
            ``cache_fp8_dtype`` given too must agree with it (``ValueError``). Whatever the format, the output is
            the plain one: ``out_k`` the values in token order (in ``cache_format.fp8_dtype``, which ``out_k``
            must have), ``out_scale`` float32 scales (``"ue8m0x4"``: ``2 ** (byte - 127)`` of each key's first
            scale byte). The ``"preshuffled"`` order needs a block size that is a multiple of 16. The reference
            backend reads every format, Triton ``"ue8m0x4"`` scales, aiter the preshuffled order where its
            kernels use it; otherwise ``NotImplementedError`` (``auto`` falls back). ``CacheFormat(values="mxfp4")``:
            a cache of MXFP4 keys (docs/spec.md §3a): ``out_k [N, D / 2]`` and ``out_scale [N, D / 32]`` uint8 get
            the keys' bytes as they are (the reference backend), ready for ``fp8_mqa_logits(..., q_scale=)``.
        _checked: for :func:`sparse_indexer.sparse_attn_indexer` alone (see :func:`sparse_indexer.top_k_per_row`).
    """
    if cache_format is not None and type(cache_format) is CacheFormat and cache_format.mxfp4:
        _gather_mxfp4(kv_cache, block_table, cu_seq_lens, out_k, out_scale, backend, check_values, cache_fp8_dtype,
                      cache_format)
        return
    if _checked:
        extra = {} if cache_format is None else C.format_kwargs(cache_format, None)
        library.call("gather_k_cache", backend, kv_cache.device, as_3d(kv_cache), block_table, cu_seq_lens,
                     out_k=out_k, out_scale=out_scale, **extra)
        return
    ts = (out_k, out_scale, kv_cache, block_table, cu_seq_lens)  # (outputs first: _checks.Layouts)
    if _plain_eager():
        proven, facts = _LAYOUTS.match(ts, (cache_fp8_dtype, cache_format))
        if proven and not kv_cache.storage_offset() & 3:
            # the layout of a call that passed every check below: only aliasing (matched), the cache's
            # alignment (above) and the values
            dev, lay, cpu, fmt_kw, memo = facts
            if C.values_wanted(check_values, cpu):
                _check_values(block_table, cu_seq_lens, out_k.shape[0], lay)
            _run("gather_k_cache", backend, dev,
                 (view_3d(kv_cache), block_table, cu_seq_lens),
                 {"out_k": out_k, "out_scale": out_scale, **fmt_kw} if fmt_kw else
                 {"out_k": out_k, "out_scale": out_scale}, ts[:2], memo)
            return
    kv3 = as_3d(kv_cache)
    lay = cache_layout(kv3)
    dev = kv_cache.device
    C.tensor("block_table", block_table, ndim=2, dtypes=C.INDEX_DTYPES, device=dev, last_contiguous=True)
    r = block_table.shape[0]
    C.tensor("cu_seq_lens", cu_seq_lens, dtypes=C.INDEX_DTYPES, device=dev, shape=(r + 1,), contiguous=True)
    C.fp8("out_k", out_k, ndim=2, device=dev, shape=(None, lay.head_dim), contiguous=True)
    fmt = C.read_format("out_k", out_k.dtype, cache_format, cache_fp8_dtype, mix=False)
    if fmt.fp8_dtype != out_k.dtype:
        raise TypeError(f"out_k is {out_k.dtype} but the cache holds {fmt.fp8_dtype}: gather_k_cache copies the "
                        "cache's bytes, so out_k must be in the cache's format (convert afterwards: "
                        "sparse_indexer.fn_to_fnuz)")
    C.check_order(fmt, lay.block_size, lay.head_dim)
    fmt_kw = C.format_kwargs(fmt, None)  # (scale encoding and byte order, where not the plain ones)
    C.tensor("out_scale", out_scale, dtypes=torch.float32, device=dev, shape=(out_k.shape[0],), contiguous=True)
    C.no_alias("out_k", out_k, kv_cache=kv_cache, block_table=block_table, cu_seq_lens=cu_seq_lens,
               out_scale=out_scale)
    C.no_alias("out_scale", out_scale, kv_cache=kv_cache, block_table=block_table, cu_seq_lens=cu_seq_lens)
    if C.want_value_checks(check_values, block_table, cu_seq_lens):
        _check_values(block_table, cu_seq_lens, out_k.shape[0], lay)
    if library.runs_directly(dev, ts):
        _LAYOUTS.remember(ts, 2, (cache_fp8_dtype, cache_format), (dev, lay, dev.type == "cpu", fmt_kw, {}))
    library.call("gather_k_cache", backend, dev, kv3, block_table, cu_seq_lens, out_k=out_k, out_scale=out_scale,
                 **fmt_kw)


def _gather_mxfp4(kv_cache, block_table, cu_seq_lens, out_k, out_scale, backend, check_values,
                  cache_fp8_dtype, fmt) -> None:
    """:func:`gather_k_cache` from a cache of MXFP4 keys (docs/spec.md §3a): ``out_k [N, D / 2]`` and ``out_scale
    [N, D / 32]`` uint8, the keys' bytes as they are; every check, then the op."""
    if cache_fp8_dtype is not None:
        raise ValueError(f"cache_fp8_dtype={cache_fp8_dtype} does not apply to an MXFP4 cache (give cache_format "
                         "alone)")
    kv3 = as_3d(kv_cache)
    lay = cache_layout(kv3, mxfp4=True)
    C.check_order(fmt, lay.block_size, lay.head_dim)
    dev = kv_cache.device
    C.tensor("block_table", block_table, ndim=2, dtypes=C.INDEX_DTYPES, device=dev, last_contiguous=True)
    r = block_table.shape[0]
    C.tensor("cu_seq_lens", cu_seq_lens, dtypes=C.INDEX_DTYPES, device=dev, shape=(r + 1,), contiguous=True)
    d = lay.head_dim
    C.tensor("out_k", out_k, ndim=2, dtypes=torch.uint8, device=dev, shape=(None, d // 2), contiguous=True)
    C.tensor("out_scale", out_scale, dtypes=torch.uint8, device=dev, shape=(out_k.shape[0], d // 32),
             contiguous=True)
    C.no_alias("out_k", out_k, kv_cache=kv_cache, block_table=block_table, cu_seq_lens=cu_seq_lens,
               out_scale=out_scale)
    C.no_alias("out_scale", out_scale, kv_cache=kv_cache, block_table=block_table, cu_seq_lens=cu_seq_lens)
    if C.want_value_checks(check_values, block_table, cu_seq_lens):
        _check_values(block_table, cu_seq_lens, out_k.shape[0], lay)
    library.call("gather_k_cache", backend, dev, kv3, block_table, cu_seq_lens, out_k=out_k, out_scale=out_scale,
                 **C.format_kwargs(fmt, None))


_LAYOUTS = C.Layouts()  # the last fully checked call's layout (host overhead per call)
_plain_eager = library.plain_eager
_run = library.run_direct


def _check_values(block_table: torch.Tensor, cu_seq_lens: torch.Tensor, rows: int, lay) -> None:
    """``cu_seq_lens`` starts at 0, its request lengths fit the block table and their sum the ``rows`` of
    ``out_k``; the block ids they use lie in the cache."""
    r = block_table.shape[0]
    dev = block_table.device
    cap = lay.block_size * block_table.shape[1]
    if r <= _HOST_LIST_ROWS:  # few requests: one copy to a list, then plain integers
        cu = cu_seq_lens.tolist()
        if cu[0] != 0:
            raise ValueError(f"cu_seq_lens[0] must be 0, got {cu[0]}")
        lens_ok = all(0 <= b - a <= cap for a, b in zip(cu, cu[1:]))
        total = cu[-1] if r else 0
    else:
        if int(cu_seq_lens[0]) != 0:
            raise ValueError(f"cu_seq_lens[0] must be 0, got {int(cu_seq_lens[0])}")
        lens_ok = False
        total = int(cu_seq_lens[-1])
    lens = lambda: cu_seq_lens.long().diff()  # noqa: E731 - request lengths, only built when needed
    if not lens_ok:
        C.values_in("cu_seq_lens diffs", lens(), 0, cap + 1,
                    lambda: f"request lengths must be >= 0 and fit max_blocks * block_size = {cap}")
    if total > rows:
        raise ValueError(f"cu_seq_lens[-1] = {total} exceeds the {rows} rows of out_k")
    used = lambda: torch.arange(block_table.shape[1], device=dev)[None, :] < (  # noqa: E731 - only on failure
        (lens() + lay.block_size - 1) // lay.block_size)[:, None]
    C.values_in("block_table", block_table, 0, lay.num_blocks,
                lambda: f"block ids must be in [0, num_blocks={lay.num_blocks})", mask=used)
