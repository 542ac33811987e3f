"""``fp8_paged_mqa_logits``: decode indexer scores read straight from the paged K cache (docs/spec.md §5)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from buffers.limits import CacheFormat

from ..._runtime import checks as C
from ..._runtime import library
from ...kcache import as_3d, cache_layout, view_3d
from ..fp8_mqa_logits import LOGITS_DTYPES
from .reference import row_limits

__all__ = ["PagedInputs", "check_paged_inputs", "check_paged_values", "fp8_paged_mqa_logits", "row_limits"]


class PagedInputs(NamedTuple):
    """What :func:`check_paged_inputs` proved about a paged call: ``q``'s shape ``[b, next_n, h, d]`` and device,
    the cache format's backend keyword arguments (``{}`` for the plain format), the 3-D cache view and its
    layout, and ``capacity = max_blocks * block_size`` (the positions the block table covers)."""

    b: int
    next_n: int
    h: int
    d: int
    dev: torch.device
    fmt_kw: dict
    kv3: torch.Tensor
    lay: object
    capacity: int


def _check_tables(weights, context_lens, block_table, indices, b: int, next_n: int, h: int, dev) -> None:
    """The paged call's ``weights [B * next_n, H]`` float32, ``context_lens [B]`` or ``[B, next_n]``,
    ``block_table [B, max_blocks]`` (``[num_requests, max_blocks]`` with ``indices [B]``), index dtypes, on
    ``dev`` (the FP8 and the MXFP4 calls alike)."""
    C.tensor("weights", weights, dtypes=torch.float32, device=dev, shape=(b * next_n, h), last_contiguous=True)
    C.tensor("context_lens", context_lens, dtypes=C.INDEX_DTYPES, device=dev, contiguous=True,
             shape=(b,) if context_lens.dim() == 1 else (b, next_n))
    C.tensor("block_table", block_table, ndim=2, dtypes=C.INDEX_DTYPES, device=dev,
             shape=(b if indices is None else None, None), last_contiguous=True)
    if indices is not None:
        C.tensor("indices", indices, dtypes=C.INDEX_DTYPES, device=dev, shape=(b,), contiguous=True)


def check_paged_inputs(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                       block_table: torch.Tensor, indices: torch.Tensor | None = None,
                       cache_format: CacheFormat | None = None,
                       cache_fp8_dtype: torch.dtype | None = None) -> PagedInputs:
    """Check the inputs of a paged decode call (everything but its outputs and value checks): ``q [B, next_n, H,
    D]`` fp8 (unit last stride) in the cache's format unless one is declared (docs/spec.md §4), the cache's layout
    and head dim, ``weights [B * next_n, H]`` float32, ``context_lens [B]`` or ``[B, next_n]`` int32,
    ``block_table [B, max_blocks]`` int32 (``[num_requests, max_blocks]`` with ``indices [B]`` int32).
    ``TypeError``/``ValueError`` naming the argument otherwise."""
    if cache_format is not None and type(cache_format) is CacheFormat and cache_format.mxfp4:
        raise NotImplementedError("these checks are of FP8 calls; an MXFP4 cache is scored by "
                                  "fp8_paged_mqa_logits(..., cache_format=, q_scale=) (docs/spec.md §3a)")
    C.fp8("q", q, ndim=4, last_contiguous=True)
    b, next_n, h, d = q.shape
    dev = q.device
    fmt = C.read_format("q", q.dtype, cache_format, cache_fp8_dtype)
    # the format's backend keyword arguments, only where it is not the plain case (a mix: the FP8 format; then the
    # scale encoding and the byte order); the backends read the cache in q's format otherwise
    fmt_kw = C.format_kwargs(fmt, q.dtype)
    kv3 = as_3d(kv_cache)
    lay = cache_layout(kv3)
    C.check_order(fmt, lay.block_size, lay.head_dim)
    C.tensor("kv_cache", kv_cache, device=dev)
    if lay.head_dim != d:
        raise ValueError(f"kv_cache holds D={lay.head_dim} but q has D={d}")
    _check_tables(weights, context_lens, block_table, indices, b, next_n, h, dev)
    return PagedInputs(b, next_n, h, d, dev, fmt_kw, kv3, lay, block_table.shape[1] * lay.block_size)


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, *,
                         out: torch.Tensor | None = None, clean: bool = True, backend: str | None = None,
                         check_values: bool | None = None, qk: torch.Tensor | None = None,
                         indices: torch.Tensor | None = None, logits_dtype: torch.dtype | None = None,
                         cache_fp8_dtype: torch.dtype | None = None, cache_format: CacheFormat | None = None,
                         q_scale: torch.Tensor | None = None, _checked: bool = False) -> torch.Tensor:
    """Score ``next_n`` query tokens of each of ``B`` requests against its cached keys.

    Row ``r = b * next_n + j`` holds key positions ``p < limit[r]`` (request-local, read through
    ``block_table``); ``limit[r] = context_lens[b] - next_n + j + 1`` for 1-D ``context_lens`` and
    ``context_lens[b, j]`` for 2-D, clamped at 0. Other cells are ``-inf`` (``clean=True``) or undefined.
    With ``indices`` (DeepGEMM's row -> request map), query entry ``b`` reads the keys of block-table row
    ``indices[b]``: variable tokens per request, one entry per token (``next_n = 1``, 1-D per-token lengths).

    Args:
        q: ``[B, next_n, H, D]`` fp8 queries: ``float8_e4m3fn`` unless ``cache_fp8_dtype`` says otherwise.
        kv_cache: ``[num_blocks, block_size, D + 4]`` (or 4-D) uint8 paged cache.
        weights: ``[B * next_n, H]`` float32.
        context_lens: ``[B]`` or ``[B, next_n]`` int32.
        block_table: ``[B, max_blocks]`` int32 (with ``indices``: ``[num_requests, max_blocks]``).
        out: ``[B * next_n, W]`` float32 or bfloat16 (unit last stride; scores rounded once to its dtype),
            ``W >= max(limit)``; allocated with ``W = max_blocks * block_size`` (dtype ``logits_dtype``,
            default float32) when ``None``.
        clean: see above.
        backend: ``None``/``"auto"`` (the best backend available on the device; the next one when it raises
            ``NotImplementedError`` for the case) or a backend's name (``sparse_indexer.backends.names()``).
        check_values: check the context lengths against ``W`` and ``block_table``, and the block ids against the
            cache (reads device values: a sync on a GPU); default: on the CPU only. Unchecked values never make a
            backend read or write outside its tensors (docs/spec.md §10): each row's limit is clamped to ``[0,
            min(W, max_blocks * block_size)]``, a block id outside ``[0, num_blocks)`` scores as a zero key (its
            in-window cells 0), an ``indices`` entry outside ``[0, num_requests)`` gives its rows empty windows.
        qk: optional ``[H, B * next_n, W]`` float32 scratch (a :meth:`Buffers.qk_view`) for backends that
            materialise per-head scores (aiter's stage1 kernel on AMD GPUs other than gfx942/gfx950); the other
            backends ignore it. Its contents afterwards are undefined.
        indices: optional ``[B]`` int32, entry ``b``'s block-table row (``0 <= indices[b] < num_requests``;
            checked with the other values).
        logits_dtype: dtype of an allocated ``out``; must match ``out`` when both are given.
        cache_fp8_dtype: the FP8 format the cache's values were written in (``write_k_cache``'s ``fp8_dtype``);
            ``None``: ``float8_e4m3fn``, and then ``q`` must be ``float8_e4m3fn`` too (``TypeError`` naming both
            formats otherwise: the cache bytes carry no format, docs/spec.md §4). A format other than ``q``'s is an
            explicit mix (e4m3fnuz queries against e4m3fn keys, as DeepSeek-V4 on gfx942): each operand is read
            exactly in its own format; only the reference backend computes mixed formats today (the others raise
            ``NotImplementedError``, so ``auto`` runs the reference). The shorthand of
            ``cache_format=CacheFormat(fp8_dtype=...)``.
        cache_format: the cache's whole :class:`~buffers.CacheFormat` (FP8 format, scale encoding, byte order), or
            ``None`` (``cache_fp8_dtype``'s rule). A declaration: ``q`` may then be in another FP8 format (a mix,
            as with ``cache_fp8_dtype``). ``cache_fp8_dtype`` given too must agree with it (``ValueError``). The
            ``"preshuffled"`` order needs a block size that is a multiple of 16 (``ValueError``). The reference
            backend reads every format; Triton reads ``"ue8m0x4"`` scales (flat order, ``q``'s FP8 format); aiter
            the preshuffled order where its kernel does; the others raise ``NotImplementedError`` for anything but
            the plain case, so ``auto`` falls back. ``CacheFormat(values="mxfp4")`` (docs/spec.md §3a): MXFP4 keys,
            scored against MXFP4 queries (``q_scale`` required) by the reference and Triton backends.
        q_scale: with an MXFP4 cache, the queries' scale bytes ``[B, next_n, H, D / 32]`` uint8, ``q`` then
            ``[B, next_n, H, D / 2]`` uint8 packed e2m1 values (:func:`sparse_indexer.quantize_q_mxfp4`; the
            weights carry no query scale).

    Returns:
        ``out``.

    ``_checked=True`` is for :func:`sparse_indexer.sparse_attn_indexer` alone (see :func:`top_k_per_row`).
    """
    if q_scale is not None or (cache_format is not None and type(cache_format) is CacheFormat
                               and cache_format.mxfp4):
        if qk is not None:
            raise ValueError("qk (aiter's per-head scratch) does not apply to an MXFP4 cache: leave it out")
        return _paged_mxfp4(q, kv_cache, weights, context_lens, block_table, out, clean, backend, check_values,
                            indices, logits_dtype, cache_fp8_dtype, cache_format, q_scale)
    if _checked:
        if cache_format is not None:  # (the step: a format other than the plain one, as backend keyword arguments)
            extra = C.format_kwargs(cache_format, q.dtype)
            if indices is not None:
                extra["indices"] = indices
            if qk is not None and not extra.keys() - {"indices"}:
                extra["qk"] = qk
            library.call("fp8_paged_mqa_logits", backend, q.device, q, as_3d(kv_cache), weights, context_lens,
                         block_table, out=out, clean=bool(clean), **extra)
        elif indices is not None:
            extra = {"indices": indices} if qk is None else {"indices": indices, "qk": qk}
            library.call("fp8_paged_mqa_logits", backend, q.device, q, as_3d(kv_cache), weights, context_lens,
                         block_table, out=out, clean=bool(clean), **extra)
        elif qk is None:
            library.call("fp8_paged_mqa_logits", backend, q.device, q, as_3d(kv_cache), weights, context_lens,
                         block_table, out=out, clean=bool(clean))
        else:
            library.call("fp8_paged_mqa_logits", backend, q.device, q, as_3d(kv_cache), weights, context_lens,
                         block_table, out=out, clean=bool(clean), qk=qk)
        return out
    ts = (out, qk, q, kv_cache, weights, context_lens, block_table, indices)  # outputs first: _checks.Layouts
    if out is not None and _plain_eager():
        proven, facts = _LAYOUTS.match(ts, (logits_dtype, cache_fp8_dtype, cache_format))
        if proven and not kv_cache.storage_offset() & 3:
            # the layout of a call that passed every check below: only aliasing (matched), the cache's
            # alignment (above) and the values
            dev, lay, capacity, next_n, cpu, fmt_kw, memo = facts
            if C.values_wanted(check_values, cpu) and context_lens.numel():
                check_paged_values(context_lens, block_table, indices, next_n, out.shape[1], capacity, lay)
            kw = {"out": out, "clean": bool(clean)}
            if fmt_kw:
                kw.update(fmt_kw)
            if indices is not None:
                kw["indices"] = indices
            if qk is not None and not fmt_kw:  # (qk: aiter's stage1 only, which reads the plain format only)
                kw["qk"] = qk
            _run("fp8_paged_mqa_logits", backend, dev,
                 (q, view_3d(kv_cache), weights, context_lens, block_table),
                 kw, (out, qk) if "qk" in kw else (out,), memo)
            return out
    b, next_n, h, d, dev, fmt_kw, kv3, lay, capacity = check_paged_inputs(
        q, kv_cache, weights, context_lens, block_table, indices, cache_format, cache_fp8_dtype)
    if logits_dtype is not None and logits_dtype not in LOGITS_DTYPES:
        raise TypeError(f"logits_dtype must be one of {LOGITS_DTYPES}, got {logits_dtype}")
    given = out is not None
    if out is None:
        out = torch.empty(b * next_n, capacity, dtype=logits_dtype or torch.float32, device=dev)
    else:
        C.tensor("out", out, ndim=2, dtypes=LOGITS_DTYPES if logits_dtype is None else logits_dtype, device=dev,
                 shape=(b * next_n, None), last_contiguous=True)
        C.no_alias("out", out, q=q, kv_cache=kv_cache, weights=weights, context_lens=context_lens,
                   block_table=block_table, indices=indices)
    w = out.shape[1]
    if C.want_value_checks(check_values, context_lens, block_table, indices) and context_lens.numel():
        check_paged_values(context_lens, block_table, indices, next_n, w, capacity, lay)
    extra = {} if indices is None else {"indices": indices}
    extra.update(fmt_kw)
    if qk is not None:
        C.tensor("qk", qk, dtypes=torch.float32, device=dev, shape=(h, b * next_n, w), last_contiguous=True)
        C.no_alias("qk", qk, q=q, kv_cache=kv_cache, weights=weights, context_lens=context_lens,
                   block_table=block_table, logits_out=out, indices=indices)
        if not fmt_kw:  # (qk: aiter's stage1 only, which reads the plain format only)
            extra["qk"] = qk
    if given and library.runs_directly(dev, ts):
        _LAYOUTS.remember(ts, 2, (logits_dtype, cache_fp8_dtype, cache_format),
                          (dev, lay, capacity, next_n, dev.type == "cpu", fmt_kw, {}))
    library.call("fp8_paged_mqa_logits", backend, dev, q, kv3, weights, context_lens, block_table,
                 out=out, clean=bool(clean), **extra)
    return out


def _paged_mxfp4(q, kv_cache, weights, context_lens, block_table, out, clean, backend, check_values, indices,
                 logits_dtype, cache_fp8_dtype, cache_format, q_scale) -> torch.Tensor:
    """:func:`fp8_paged_mqa_logits` with MXFP4 queries against an MXFP4 cache (docs/spec.md §3a): every check,
    then the op."""
    if cache_format is None or type(cache_format) is not CacheFormat or not cache_format.mxfp4:
        raise ValueError("q_scale (MXFP4 queries) needs cache_format=CacheFormat(values='mxfp4')")
    if q_scale is None:
        raise ValueError("an MXFP4 cache is scored against MXFP4 queries: pass q_scale (quantize_q_mxfp4)")
    if cache_fp8_dtype is not None:
        raise ValueError(f"cache_fp8_dtype={cache_fp8_dtype} does not apply to an MXFP4 cache")
    C.tensor("q", q, ndim=4, dtypes=torch.uint8, contiguous=True)
    b, next_n, h, half = q.shape
    dev = q.device
    C.tensor("q_scale", q_scale, dtypes=torch.uint8, device=dev, shape=(b, next_n, h, half // 16), contiguous=True)
    kv3 = as_3d(kv_cache)
    lay = cache_layout(kv3, mxfp4=True)
    C.check_order(cache_format, lay.block_size, lay.head_dim)
    C.tensor("kv_cache", kv_cache, device=dev)
    if lay.head_dim != 2 * half:
        raise ValueError(f"kv_cache holds D={lay.head_dim} but q has D={2 * half} (D / 2 = {half} bytes)")
    _check_tables(weights, context_lens, block_table, indices, b, next_n, h, dev)
    capacity = block_table.shape[1] * lay.block_size
    if logits_dtype is not None and logits_dtype not in LOGITS_DTYPES:
        raise TypeError(f"logits_dtype must be one of {LOGITS_DTYPES}, got {logits_dtype}")
    if out is None:
        out = torch.empty(b * next_n, capacity, dtype=logits_dtype or torch.float32, device=dev)
    else:
        C.tensor("out", out, ndim=2, dtypes=LOGITS_DTYPES if logits_dtype is None else logits_dtype, device=dev,
                 shape=(b * next_n, None), last_contiguous=True)
        C.no_alias("out", out, q=q, q_scale=q_scale, kv_cache=kv_cache, weights=weights, context_lens=context_lens,
                   block_table=block_table, indices=indices)
    if C.want_value_checks(check_values, context_lens, block_table, indices) and context_lens.numel():
        check_paged_values(context_lens, block_table, indices, next_n, out.shape[1], capacity, lay)
    extra = {**C.format_kwargs(cache_format, None), "q_scale": q_scale}
    if indices is not None:
        extra["indices"] = indices
    library.call("fp8_paged_mqa_logits", backend, dev, q, kv3, weights, context_lens, block_table, out=out,
                 clean=bool(clean), **extra)
    return out


_LAYOUTS = C.Layouts()  # the last fully checked call's layout (host overhead per call)
_plain_eager = library.plain_eager
_run = library.run_direct


def check_paged_values(context_lens, block_table, indices, next_n: int, w: int, capacity: int, lay,
                       width_of: str | None = "out") -> None:
    """The value checks of a paged call (``check_values``): ``indices`` within the block table's rows, then the
    row limits within ``min(w, capacity)`` and the block ids they use within the cache (reads values).
    ``width_of``: the tensor whose ``w`` columns the windows must fit, for the message (``None``: ``w`` is the
    capacity itself)."""
    if indices is not None:
        C.values_in("indices", indices, 0, block_table.shape[0],
                    lambda: f"indices must be in [0, block_table rows = {block_table.shape[0]})")
        _check_values(context_lens, block_table.index_select(0, indices.long()), next_n, w, capacity, lay, width_of)
    else:
        _check_values(context_lens, block_table, next_n, w, capacity, lay, width_of)


def _check_values(context_lens, block_table, next_n: int, w: int, capacity: int, lay, width_of) -> None:
    """Row limits within ``min(W, capacity)`` and the block ids they use within the cache (reads values)."""
    b = block_table.shape[0]
    dev = block_table.device
    # the largest row limit is the largest length (1-D: the last token's limit is context_lens[b] itself)
    small = context_lens.dim() == 1 and context_lens.shape[0] <= 32 and context_lens.is_cpu
    if (max(context_lens.tolist()) if small else int(context_lens.max())) > min(w, capacity):  # (a list: ~1 us less)
        lim = row_limits(context_lens, next_n)
        bad = lim > min(w, capacity)
        if bool(bad.any()):
            r = int(bad.nonzero()[0, 0])
            b_, j_ = divmod(r, next_n)
            where = f"context_lens[{b_}]" if context_lens.dim() == 1 else f"context_lens[{b_}, {j_}]"
            n = int(lim[r])
            crossed = [f"the W = {w} columns of {width_of}"] if n > w and width_of else []
            if n > capacity:
                crossed.append(f"what block_table covers (max_blocks * block_size = {block_table.shape[1]} * "
                               f"{lay.block_size} = {capacity})")
            raise ValueError(f"{where} = {int(context_lens.view(-1)[r if context_lens.dim() == 2 else b_])} gives row "
                             f"{r} (request {b_}, token {j_}) the window [0, {n}), longer than "
                             + " and ".join(crossed))

    def used():
        need = row_limits(context_lens, next_n).view(b, next_n).amax(1)
        return torch.arange(block_table.shape[1], device=dev)[None, :] < (
            (need + lay.block_size - 1) // lay.block_size)[:, None]

    C.values_in("block_table", block_table, 0, lay.num_blocks,
                lambda: f"block ids must be in [0, num_blocks={lay.num_blocks})", mask=used)
