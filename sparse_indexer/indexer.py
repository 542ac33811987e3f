"""One indexer step of one layer, as a pure function over caller-owned tensors (docs/spec.md §7).

``sparse_attn_indexer`` writes the K cache, scores every prefill chunk and the decode rows into views of
``buffers``, and writes the top-k positions of every token into ``topk_out``. It reads only host integers and
the device tensors of :class:`~sparse_indexer.metadata.IndexerMetadata`, allocates no device memory, and checks
that the whole step fits the buffers before it writes anything (the cache included).
"""

from __future__ import annotations

from bisect import bisect_left

import torch

from buffers import Buffers, BufferTooSmall

from ._runtime import checks as C
from ._runtime import library
from .fp8 import SCALE_FMTS
from .kcache import as_3d, cache_layout, view_3d
from .metadata import IndexerMetadata
from .ops.top_k_per_row import MIN_WORKSPACE_COLS

__all__ = ["sparse_attn_indexer", "indexer_prefill", "indexer_decode", "check_step", "decode_batch"]


def _check_pack_fields(buffers: Buffers, q_fp8: torch.Tensor) -> None:
    """The optional scratch fields must match the step's H, D and FP8 format (they are reshaped to them)."""
    _, h, d = q_fp8.shape
    qp = buffers.q_pack
    if qp is not None and (tuple(qp.shape[1:]) != (h, d) or qp.dtype != q_fp8.dtype):
        raise ValueError(f"buffers.q_pack is {buffers.q_pack.dtype} {tuple(buffers.q_pack.shape)}, expected "
                         f"{q_fp8.dtype} [*, {h}, {d}]")
    if buffers.w_pack is not None and buffers.w_pack.shape[1] != h:
        raise ValueError(f"buffers.w_pack has {buffers.w_pack.shape[1]} heads, expected H={h}")
    if buffers.qk is not None and buffers.qk.shape[0] != h:
        raise ValueError(f"buffers.qk has {buffers.qk.shape[0]} heads, expected H={h}")


def _check_cache_ids(metadata: IndexerMetadata, lay, kv_cache: torch.Tensor) -> None:
    """Block ids and slots must lie inside the cache. ``build_metadata(..., num_blocks=)`` checked them on the
    host; then only the cache size is compared. Unchecked metadata is checked here when it lives on the CPU
    (free; every layer, as the tensors' values could change in place); on a GPU that would synchronise, so it
    is the caller's promise (pass ``num_blocks``)."""
    if metadata.num_blocks is not None:
        if lay.num_blocks < metadata.num_blocks:
            raise ValueError(f"kv_cache has {lay.num_blocks} blocks but the metadata was checked against "
                             f"num_blocks={metadata.num_blocks}")
        return
    if kv_cache.device.type != "cpu" or C.is_traced(metadata.slot_mapping):
        return
    bs = lay.block_size
    if metadata.slot_mapping.numel():
        C.values_in("slot_mapping", metadata.slot_mapping, None, lay.num_slots,
                    f"slots must be < num_blocks * block_size = {lay.num_slots} (negative = skip)")
    tables = []
    dm = metadata.decode
    if dm is not None and dm.num_reqs:
        need = dm.row_ends.long().view(dm.num_reqs, dm.next_n).amax(1)
        tables.append(("decode block_table", dm.block_table, need))
    for c in metadata.prefill_chunks:
        tables.append(("prefill block_table", c.block_table, c.cu_seq_lens[1:].long() - c.cu_seq_lens[:-1].long()))
    for name, bt, lens in tables:
        used = torch.arange(bt.shape[1])[None, :] < ((lens + bs - 1) // bs)[:, None]
        C.values_in(name, bt, 0, lay.num_blocks, f"block ids must be in [0, num_blocks={lay.num_blocks})", mask=used)


def _rows(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``t[start:stop]``, or ``t`` itself when that is all of it (one sub-batch): a view costs ~1 us of host
    time per call, and the step runs once per layer."""
    return t if start == 0 and stop == t.shape[0] else t[start:stop]


def decode_batch(metadata: IndexerMetadata) -> int:
    """Decode requests scored and selected together: as many as ``limits.decode_batch_rows`` rows hold (at
    least one), so a step under ``IndexerLimits.max_decode_logits_bytes`` runs ``ceil(B / decode_batch)``
    sub-batches over one budget-sized region of ``buffers.logits`` (docs/memory.md)."""
    return max(1, metadata.limits.decode_batch_rows // metadata.decode.next_n)


def _require_backend(backend: str, ops: tuple[str, ...], device: torch.device) -> None:
    """Raise :class:`~sparse_indexer.BackendUnavailable` unless ``backend`` runs every op of ``ops`` on ``device``
    (an explicitly named backend never falls back, so a step must not start writing with it)."""
    from . import backends
    from ._runtime import dispatch as _dispatch

    for op in dict.fromkeys(ops):
        _dispatch.candidates(op, backend, device)  # unknown or unavailable backend
        if not backends.get(backend).implements(op):
            raise _dispatch.BackendUnavailable(
                f"backend {backend!r} does not implement {op}, which this step runs; use backend=None (auto) or "
                f"a backend that implements every op")


def check_step(q_fp8: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor, metadata: IndexerMetadata,
               buffers: Buffers, topk_out: torch.Tensor, k: torch.Tensor | None = None,
               *, prefill: bool = True, decode: bool = True, backend: str | None = None,
               q_scale: torch.Tensor | None = None) -> None:
    """Raise ``ValueError``/``TypeError``/:class:`BufferTooSmall` unless the step fits; reads no device values.

    Shapes: ``q_fp8 [T, H, D]`` fp8, ``k [>= num_tokens, D]``, ``weights [T, H]`` float32,
    ``topk_out [T_max, topk]`` int32, with ``T >= metadata.num_tokens`` and ``T_max >= T``. The cache is in
    ``metadata.limits.cache`` (docs/spec.md §4): ``buffers.k_fp8`` must be in its FP8 format, and ``q_fp8`` in the
    same one unless the limits declare a ``cache_format`` (then ``q_fp8`` is in ``limits.fp8_dtype``, which may
    differ: DeepSeek-V4's e4m3fn caches read with e4m3fnuz queries); the preshuffled order needs a block size that
    is a multiple of 16. With an MXFP4 cache (``IndexerLimits(cache_format=CacheFormat(values="mxfp4"))``,
    docs/spec.md §3a) the queries are MXFP4 too: ``q_fp8 [T, H, D / 2]`` uint8 with ``q_scale [T, H, D / 32]``
    uint8 (:func:`~sparse_indexer.quantize_q_mxfp4`). An explicitly named
    ``backend`` that cannot run one of the step's ops on this device raises
    :class:`~sparse_indexer.BackendUnavailable` here, before the step writes anything.

    What depends only on ``metadata`` and ``buffers`` (the buffer views of every chunk and sub-batch, the
    backend, the scratch fields, the disjointness of the buffer fields and the metadata tensors) is proven once
    per ``(metadata, buffers, backend)`` and remembered in the metadata record (:class:`_StepPlan`); later
    layers check their own tensors (dtypes, shapes, devices, the cache layout) and that those are disjoint from
    the remembered ones and from each other. Every check still runs before anything is written.
    """
    _check(q_fp8, weights, kv_cache, metadata, buffers, topk_out, k, prefill, decode, backend, q_scale)


class _Spans:
    """Byte ranges ``[lo, hi)`` of some tensors sorted by start, with the running maximum of their ends, so
    whether any of them overlaps a range is one bisection (:meth:`hits`, or inlined by its callers)."""

    __slots__ = ("starts", "max_end")

    def __init__(self, tensors):
        spans = sorted(C._span(t) for t in tensors)
        spans = [sp for sp in spans if sp[0] != sp[1]]
        self.starts = [lo for lo, _ in spans]
        self.max_end, m = [], 0
        for _, hi in spans:
            m = max(m, hi)
            self.max_end.append(m)

    def hits(self, lo: int, hi: int) -> bool:
        i = bisect_left(self.starts, hi)
        return i > 0 and self.max_end[i - 1] > lo


class _StepPlan:
    """What one ``(metadata, buffers, backend, prefill, decode, k given)`` step proved once (kept in
    ``metadata._step_memo`` per backend and step kind, for the last buffers record (or one over the same bytes:
    :func:`_same_buffers`); every layer of a step shares the metadata): the byte ranges of the buffer fields
    (written) and of the metadata tensors (read), and the buffer views of every prefill chunk
    ``(chunk, k_fp8, k_scale, logits)`` and decode sub-batch
    ``(b0, b1, r0, r1, logits, qk, workspace, row_starts, row_ends, context_lens, block_table)``."""

    __slots__ = ("buffers", "outs", "both", "chunks", "subs", "written", "layer", "write_kw", "gather_kw", "paged_kw",
                 "chunk_scores", "sub_scores", "fused")

    def __init__(self, metadata: IndexerMetadata, buffers: Buffers, prefill: bool, decode: bool, spans: bool = True):
        self.buffers = buffers
        # (spans=False: a plan for one call off the direct route, where tensors may have no data pointers)
        self.outs = _Spans(buffers.tensors().values()) if spans else None
        self.both = _Spans((*buffers.tensors().values(), *metadata.tensors().values())) if spans else None
        self.chunks = ()
        if prefill:
            self.chunks = tuple((c, *buffers.k_view(c.num_k_tokens), buffers.logits_view(c.num_tokens, c.logits_cols))
                                for c in metadata.prefill_chunks)
        self.subs = ()
        dm = metadata.decode
        if decode and dm is not None:
            per, subs = decode_batch(metadata), []
            for b0 in range(0, dm.num_reqs, per):
                b1 = min(dm.num_reqs, b0 + per)
                r0, r1 = b0 * dm.next_n, b1 * dm.next_n
                subs.append((b0, b1, r0, r1, buffers.logits_view(r1 - r0, dm.width),
                             buffers.qk_view(r1 - r0, dm.width) if buffers.qk is not None else None,
                             buffers.topk_scratch_view(r1 - r0) if buffers.topk_scratch is not None else None,
                             _rows(dm.row_starts, r0, r1), _rows(dm.row_ends, r0, r1),
                             _rows(dm.context_lens, b0, b1), _rows(dm.block_table, b0, b1)))
            self.subs = tuple(subs)
        # the block-score workspaces of a source layer's candidate selection (two-level indexer), per chunk and
        # sub-batch, when the record has them
        self.chunk_scores = self.sub_scores = ()
        if buffers.block_scores is not None:
            b = metadata.limits.candidate_block_size
            self.chunk_scores = tuple(buffers.block_scores_view(c.num_tokens, -(-c.logits_cols // b))
                                      for c, *_ in self.chunks)
            self.sub_scores = tuple(buffers.block_scores_view(sub[3] - sub[2], -(-dm.width // b)) for sub in self.subs)
        # the buffer views the step writes, for one version-counter bump per step (library.bump_versions)
        written = [v for c in self.chunks for v in c[1:]]
        for sub in self.subs:
            written += [v for v in sub[4:7] if v is not None]
        if self.subs and not dm.uniform:
            written += buffers.pack_views(dm.num_rows)
        self.written = tuple(written)
        # what a layer's tensors must be (_layer_fast): device, the queries' fp8 dtype, tokens, rows of k, H, D,
        # topk, block size
        lim = metadata.limits
        self.layer = (buffers.device, lim.fp8_dtype if lim.cache_format is not None else buffers.fp8_dtype,
                      metadata.num_tokens, max(metadata.num_tokens, metadata.slot_mapping.shape[0]), lim.n_heads,
                      lim.head_dim, lim.topk, lim.block_size)
        # the cache format (limits.cache) as the ops' keyword arguments: the write's, the gather's and the paged
        # logits' (empty where it is the plain one: the default format adds nothing to a call)
        self.write_kw, self.gather_kw, self.paged_kw = _format_kwargs(lim)
        self.fused = None  # (registry generation, the fused route of each sub-batch): _fused_routes

    def layer_disjoint(self, outputs: tuple, inputs: tuple) -> bool:
        """Whether the layer's ``outputs`` are disjoint from everything (the buffer fields, the metadata tensors,
        each other, ``inputs``) and its ``inputs`` from the buffer fields. ``False`` means "maybe not": the
        caller then runs the full sweep (:func:`_checks.disjoint`), which raises with the names. One bisection
        per tensor (outputs: over the buffer fields and metadata tensors together)."""
        outs = []
        return (_clear_of(outputs, self.both, outs, True)  # outputs: against everything the step keeps
                and _clear_of(inputs, self.outs, outs, False))  # inputs: against what the step writes


def _format_kwargs(lim) -> tuple[dict, dict, dict]:
    """The step's ops' keyword arguments for the cache format ``lim.cache`` (docs/spec.md §4): the cache write's
    (``fp8_dtype``, and the scale encoding and byte order where not the plain ones), the gather's (scale
    encoding, byte order) and the paged logits' (those, and ``cache_fp8_dtype`` when the queries are in another FP8
    format than the cache)."""
    fmt = lim.cache_format  # (not lim.cache, which builds a record: Dynamo cannot trace an attrs constructor)
    if fmt is None:
        return {"fp8_dtype": lim.fp8_dtype}, {}, {}
    gather = C.format_kwargs(fmt, None)
    return {"fp8_dtype": fmt.fp8_dtype, **gather}, gather, C.format_kwargs(fmt, lim.fp8_dtype)


def _clear_of(tensors: tuple, ranges, outs: list, keep: bool) -> bool:
    """Whether no tensor of ``tensors`` (``None`` and empty ones skipped) may overlap the sorted byte ranges
    ``ranges`` (``starts``, running ``max_end``) or a span in ``outs``; ``keep`` appends each tensor's span to
    ``outs``. ``False`` means "maybe not" (see :meth:`_StepPlan.layer_disjoint`)."""
    starts, max_end = ranges.starts, ranges.max_end
    for t in tensors:
        if t is None:
            continue
        n = t.nbytes
        if not n:
            continue
        lo = t.data_ptr()
        hi = lo + n if t.is_contiguous() else C._span(t)[1]
        j = _bisect(starts, hi)
        if j and max_end[j - 1] > lo:
            return False
        for a, b in outs:
            if a < hi and lo < b:
                return False
        if keep:
            outs.append((lo, hi))
    return True


_bisect = bisect_left


def _same_buffers(a: Buffers, b: Buffers) -> bool:
    """Whether ``b`` holds the same fields as ``a`` over the same bytes (data pointer, shape, strides, dtype,
    device), as plain tensors: vLLM's shim hands every layer a new record of views of one workspace, and the
    plan made for the first one serves them all (its views are those bytes)."""
    ta, tb = a.tensors(), b.tensors()
    if len(ta) != len(tb):
        return False
    for name, x in ta.items():
        y = tb.get(name)
        if y is x:
            continue
        if (type(y) is not _Tensor or y.requires_grad or y.data_ptr() != x.data_ptr() or y.shape != x.shape
                or y.dtype != x.dtype or y.device != x.device or y.stride() != x.stride()):
            return False
    return True


def _plain(tensors) -> bool:
    """Every tensor is exactly a ``torch.Tensor`` that autograd would not record and not on the meta device
    (what :func:`library.runs_directly` asks of a call's tensors)."""
    return all(type(t) is torch.Tensor and not t.requires_grad and not t.is_meta for t in tensors)


def _check(q_fp8, weights, kv_cache, metadata, buffers, topk_out, k, prefill: bool, decode: bool, backend,
           q_scale=None):
    """:func:`check_step`; returns the cache's 3-D view and, when the step may run its ops directly (plain
    eager mode, plain tensors: :func:`library.runs_directly`), the step's :class:`_StepPlan` (else ``None``)."""
    if not isinstance(metadata, IndexerMetadata):
        raise TypeError(f"metadata must be an IndexerMetadata, got {type(metadata).__name__}")
    if not isinstance(buffers, Buffers):
        raise TypeError(f"buffers must be a Buffers record, got {type(buffers).__name__}")
    if (backend is None or type(backend) is str) and q_scale is None and not _is_compiling():
        memo = metadata._step_memo
        plan = memo.get((backend, prefill, decode, k is None))
        if plan is not None and (plan.buffers is buffers or _same_buffers(plan.buffers, buffers)):
            nb = _layer_fast(plan.layer, q_fp8, weights, k, topk_out, kv_cache)
            # (_layer_fast checked what runs_directly asks of the tensors: plain, on the plan's device, not
            # recorded by autograd; the mode half here)
            if nb is not None and _plain_eager():
                # every per-layer check below holds (and the step's own were proven when the plan was made)
                kv3 = view_3d(kv_cache)
                if not plan.layer_disjoint((topk_out, kv_cache), (q_fp8, weights, k)):
                    _disjoint(buffers, metadata, q_fp8, weights, k, topk_out, kv_cache)  # raises with the names
                if metadata.num_blocks is None or nb < metadata.num_blocks:  # (else the cache is large enough)
                    _check_cache_ids(metadata, cache_layout(kv3), kv_cache)
                return kv3, plan
    lim = metadata.limits
    mx = lim.mxfp4
    if mx or q_scale is not None:
        _check_mxfp4_queries(q_fp8, q_scale, buffers, lim)
    else:
        C.fp8("q_fp8", q_fp8, ndim=3, contiguous=True)
    t, h, d = q_fp8.shape
    if mx:
        d *= 2
    dev = q_fp8.device
    if t < metadata.num_tokens:
        raise ValueError(f"q_fp8 has {t} rows but the metadata describes {metadata.num_tokens} tokens")
    if (h, d) != (lim.n_heads, lim.head_dim):
        raise ValueError(f"q_fp8 has H={h}, D={d} but the limits say H={lim.n_heads}, D={lim.head_dim}")
    fmt = lim.cache_format  # (None: the plain format in lim.fp8_dtype; not lim.cache, which Dynamo cannot build)
    cache_fp8 = lim.fp8_dtype if fmt is None else fmt.fp8_dtype
    if not mx:  # (MXFP4 queries and record: _check_mxfp4_queries)
        if buffers.mxfp4:
            raise TypeError("buffers hold MXFP4 keys (uint8 k_fp8) but the limits' cache format is FP8: plan the "
                            "buffers with these limits")
        if buffers.fp8_dtype != cache_fp8:
            raise TypeError(f"buffers.k_fp8 is {buffers.fp8_dtype} but the limits' cache format is {cache_fp8} (the "
                            "prefill gather copies the cache's bytes: plan the buffers with these limits)")
        if fmt is None:
            if q_fp8.dtype != buffers.fp8_dtype:
                raise TypeError(f"q_fp8 is {q_fp8.dtype} but buffers.k_fp8 is {buffers.fp8_dtype} (a cache in another "
                                "FP8 format than the queries must be declared: IndexerLimits(cache_format="
                                "CacheFormat(...)))")
        elif q_fp8.dtype != lim.fp8_dtype:
            raise TypeError(f"q_fp8 is {q_fp8.dtype} but the limits declare {lim.fp8_dtype} queries "
                            f"(IndexerLimits.fp8_dtype) against a {fmt.fp8_dtype} cache")
    if buffers.device != dev:
        raise ValueError(f"buffers live on {buffers.device} but q_fp8 is on {dev}")
    C.tensor("weights", weights, dtypes=torch.float32, device=dev, shape=(t, h), last_contiguous=True)
    if metadata.device != dev:
        raise ValueError(f"the metadata tensors are on {metadata.device} but q_fp8 is on {dev}")
    if k is not None:
        C.tensor("k", k, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32), device=dev, shape=(None, d),
                 last_contiguous=True)
        if k.shape[0] < max(metadata.num_tokens, metadata.slot_mapping.shape[0]):
            raise ValueError(f"k has {k.shape[0]} rows but the metadata describes {metadata.num_tokens} tokens "
                             f"and {metadata.slot_mapping.shape[0]} slots")
    C.tensor("topk_out", topk_out, ndim=2, dtypes=torch.int32, device=dev, contiguous=True)
    if topk_out.shape[0] < t:
        raise ValueError(f"topk_out has {topk_out.shape[0]} rows, fewer than the {t} rows of q_fp8")
    if topk_out.shape[1] != lim.topk:
        raise ValueError(f"topk_out has {topk_out.shape[1]} columns but the limits say topk={lim.topk}")
    kv3 = as_3d(kv_cache)
    lay = cache_layout(kv3, mxfp4=mx)
    C.tensor("kv_cache", kv_cache, device=dev)
    if lay.head_dim != d or lay.block_size != lim.block_size:
        raise ValueError(f"kv_cache has D={lay.head_dim}, block_size={lay.block_size}; expected D={d}, "
                         f"block_size={lim.block_size}")
    if fmt is not None:
        C.check_order(fmt, lay.block_size, lay.head_dim)
    if buffers.head_dim != d:
        raise ValueError(f"buffers.k_fp8 has D={buffers.head_dim} but q_fp8 has D={d}")
    # Plain eager with plain tensors: what only depends on (metadata, buffers) is proven once per step (the
    # metadata record keeps it) and the ops run directly. Anything else (compile, modes, subclasses, autograd):
    # every check below, every layer, and the ops through their public functions.
    direct = (backend is None or type(backend) is str) and library.runs_directly(dev, (q_fp8, weights, k, kv_cache,
                                                                                         topk_out))
    memo = metadata._step_memo if direct else None
    key = (backend, prefill, decode, k is None)
    plan = memo.get(key) if memo is not None else None
    if plan is not None and (plan.buffers is buffers or _same_buffers(plan.buffers, buffers)):
        if not plan.layer_disjoint((topk_out, kv_cache), (q_fp8, weights, k, q_scale)):
            _disjoint(buffers, metadata, q_fp8, weights, k, topk_out, kv_cache, q_scale)  # raises, naming them
        _check_cache_ids(metadata, lay, kv_cache)
        return kv3, plan
    _check_pack_fields(buffers, q_fp8)
    _disjoint(buffers, metadata, q_fp8, weights, k, topk_out, kv_cache, q_scale)
    _check_cache_ids(metadata, lay, kv_cache)
    # (resolving a backend imports modules, which Dynamo cannot trace; a compiled step raises from the op)
    if backend is not None and backend != "auto" and not torch.compiler.is_compiling():
        ops = (("write_k_cache",) if k is not None else ())
        if prefill and metadata.prefill_chunks:
            ops += ("gather_k_cache", "fp8_mqa_logits", "top_k_per_row")
        if decode and metadata.decode is not None:
            ops += ("fp8_paged_mqa_logits", "top_k_per_row")
        _require_backend(backend, ops, dev)
        why = None if fmt is None else _format_unsupported(backend, fmt, q_fp8.dtype, lay.block_size, dev)
        if why is not None:
            from ._runtime.dispatch import BackendUnavailable

            raise BackendUnavailable(f"backend {backend!r} cannot run this step's cache format {fmt}: {why}; use "
                                     "backend=None (auto) or 'reference'")
    if prefill:
        for c in metadata.prefill_chunks:
            buffers.k_view(c.num_k_tokens)
            buffers.logits_view(c.num_tokens, c.logits_cols)
    dm = metadata.decode
    if decode and dm is not None:
        rows = min(dm.num_reqs, decode_batch(metadata)) * dm.next_n  # one sub-batch at a time
        buffers.logits_view(rows, dm.width)
        if buffers.qk is not None:
            buffers.qk_view(rows, dm.width)
        if buffers.topk_scratch is not None:
            ws = buffers.topk_scratch_view(rows)
            if ws.shape[1] < MIN_WORKSPACE_COLS:
                raise BufferTooSmall("topk_scratch", rows * MIN_WORKSPACE_COLS, ws.numel(),
                                     f"rows of >= {MIN_WORKSPACE_COLS} int32")
        if not dm.uniform:
            buffers.pack_views(dm.num_rows)
            if buffers.topk_pack.shape[1] != topk_out.shape[1]:
                raise BufferTooSmall("topk_pack", topk_out.shape[1], buffers.topk_pack.shape[1], "topk columns")
            if mx:
                buffers.q_scale_pack_view(dm.num_rows)
    if memo is None or not _plain((*buffers.tensors().values(), *metadata.tensors().values())):
        return kv3, None
    plan = memo[key] = _StepPlan(metadata, buffers, prefill, decode)
    return kv3, plan


_is_compiling = torch.compiler.is_compiling
_plain_eager = library.plain_eager
_grad_on = torch.is_grad_enabled
_Tensor = torch.Tensor
_K_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_F32, _I32, _U8 = torch.float32, torch.int32, torch.uint8


def _format_unsupported(backend: str, fmt, q_dtype: torch.dtype, block_size: int, device) -> str | None:
    """Why the explicitly named built-in ``backend`` cannot run a step whose cache is in ``fmt`` (queries in
    ``q_dtype``), or ``None``: it can (or it is a registered backend, which raises ``NotImplementedError`` itself).
    The reference reads and writes every format; Triton ``"ue8m0x4"`` scales in the flat order, the queries' FP8
    format (its cache write: float32 scales only); aiter its preshuffled order; Gluon and CUDA the plain one. A step
    must not start writing with a backend that would raise in a later op."""
    if fmt.mxfp4:
        from . import backends

        if backend in ("reference", "triton") or backend not in backends.BUILTIN:
            return None
        return "its kernels read FP8 caches only (MXFP4: the reference and Triton backends)"
    plain_fp8 = fmt.fp8_dtype == q_dtype
    if backend == "reference" or (fmt.scale == "float32" and fmt.order == "flat" and plain_fp8):
        return None
    if backend == "triton":
        if not plain_fp8:
            return f"its kernels read no mix of FP8 formats ({q_dtype} queries against a {fmt.fp8_dtype} cache)"
        if fmt.order != "flat":
            return "its kernels read the flat order"
        return None  # (ue8m0x4 scales: read by its gather and paged logits; its cache write raises at once)
    if backend == "aiter":
        from .ops._aiter import gcn_arch, preshuffled

        if plain_fp8 and fmt.scale == "float32" and preshuffled(block_size, q_dtype, gcn_arch(device)):
            return None
        return "it reads float32 scales, its own FP8 format and the preshuffled order only where its kernel does"
    from . import backends

    if backend in backends.BUILTIN:
        return "it reads the plain format only (float32 scales, flat order, the queries' FP8 format)"
    return None


def _layer_fast(want: tuple, q_fp8, weights, k, topk_out, kv_cache) -> int | None:
    """The cache's block count when the layer's tensors pass every per-layer check of :func:`_check` (plain
    tensors; ``want``: :attr:`_StepPlan.layer`), else ``None`` (the caller then runs those checks, which say what
    is wrong). Plain attribute reads: about a quarter of the checks' cost, paid once per layer (host overhead)."""
    dev, fp8, n_tok, k_rows, h, d, topk, bs = want
    T = _Tensor
    if type(q_fp8) is not T or type(weights) is not T or type(topk_out) is not T or type(kv_cache) is not T:
        return None
    qs = q_fp8.shape
    if len(qs) != 3 or q_fp8.dtype is not fp8 or q_fp8.device != dev or not q_fp8.is_contiguous():
        return None
    t, qh, qd = qs
    if t < n_tok or qh != h or qd != d:
        return None
    ws = weights.shape
    if len(ws) != 2 or ws[0] != t or ws[1] != h or weights.dtype is not _F32 or weights.device != dev or (
            h > 1 and weights.stride()[1] != 1):
        return None
    if k is not None:
        ks = k.shape
        if (type(k) is not T or len(ks) != 2 or ks[1] != d or ks[0] < k_rows or k.dtype not in _K_DTYPES
                or k.device != dev or (d > 1 and k.stride()[1] != 1)):
            return None
    os_ = topk_out.shape
    if (len(os_) != 2 or os_[0] < t or os_[1] != topk or topk_out.dtype is not _I32 or topk_out.device != dev
            or not topk_out.is_contiguous()):
        return None
    if kv_cache.dtype is not _U8 or kv_cache.device != dev:
        return None
    if _grad_on() and (q_fp8.requires_grad or weights.requires_grad or topk_out.requires_grad
                       or kv_cache.requires_grad or (k is not None and k.requires_grad)):
        return None  # autograd would record the call: the custom-op route (library.runs_directly)
    cs = kv_cache.shape
    if len(cs) == 3:
        nb, b, width = cs
        s0, s1, s2 = kv_cache.stride()
    elif len(cs) == 4 and cs[2] == 1:
        nb, b, _, width = cs
        s0, s1, _, s2 = kv_cache.stride()
    else:
        return None
    if b != bs or width != d + 4 or s2 != 1 or (b > 1 and s1 != width) or kv_cache.storage_offset() & 3:
        return None
    if nb <= 1:
        s0 = b * width
    if s0 < b * width or s0 & 3:
        return None
    return nb


def _disjoint(buffers, metadata, q_fp8, weights, k, topk_out, kv_cache, q_scale=None) -> None:
    """What the step writes (``topk_out``, the cache, every buffer field) against everything it reads, one sweep."""
    outputs = {f"buffers.{name}": x for name, x in buffers.tensors().items()}
    outputs["topk_out"], outputs["kv_cache"] = topk_out, kv_cache
    C.disjoint(outputs, {"q_fp8": q_fp8, "weights": weights, "k": k, "q_scale": q_scale, **metadata.tensors()})


def _check_mxfp4_queries(q: torch.Tensor, q_scale: torch.Tensor | None, buffers: Buffers, lim) -> None:
    """An MXFP4 step's queries and record (docs/spec.md §3a): ``q [T, H, D / 2]`` uint8 and ``q_scale [T, H, D /
    32]`` uint8, both contiguous, against limits that declare an MXFP4 cache and a record planned with them."""
    if not lim.mxfp4:
        raise ValueError("q_scale (MXFP4 queries) needs limits with an MXFP4 cache: IndexerLimits(cache_format="
                         "CacheFormat(values='mxfp4'))")
    if q_scale is None:
        raise ValueError("the limits declare an MXFP4 cache: its queries are MXFP4 too, pass q_fp8 (packed e2m1 "
                         "values [T, H, D / 2] uint8) with q_scale [T, H, D / 32] uint8 (quantize_q_mxfp4)")
    C.tensor("q_fp8", q, ndim=3, dtypes=torch.uint8, contiguous=True)
    t, h, half = q.shape
    C.tensor("q_scale", q_scale, dtypes=torch.uint8, device=q.device, shape=(t, h, half // 16), contiguous=True)
    if not buffers.mxfp4:
        raise TypeError(f"the limits declare an MXFP4 cache but buffers.k_fp8 is {buffers.fp8_dtype}: plan the "
                        "buffers with these limits (uint8 k_fp8 [K, D / 2], k_scale [K, D / 32])")


def indexer_prefill(q_fp8: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor,
                    metadata: IndexerMetadata, buffers: Buffers, topk_out: torch.Tensor, *,
                    backend: str | None = None, q_scale: torch.Tensor | None = None,
                    _checked: bool = False) -> torch.Tensor:
    """Top-k of every prefill token, chunk by chunk (docs/spec.md §7 step 3); writes ``topk_out`` prefill rows only.

    Each chunk gathers its requests' keys into ``buffers.k_fp8/k_scale`` (skipped for a later query piece of a
    split request), computes ``[M_c, N_c]`` logits into ``buffers.logits`` with ``clean=False``, and selects
    request-local top-k positions into ``topk_out[token_start:token_end]``.
    """
    plan = None
    if not _checked:
        kv3, plan = _check(q_fp8, weights, kv_cache, metadata, buffers, topk_out, None, True, False, backend,
                           q_scale)
    _run_step(plan, metadata, buffers, q_fp8, weights, None, kv_cache if plan is None else kv3, topk_out,
              backend, None, True, False, q_scale=q_scale)
    return topk_out


def indexer_decode(q_fp8: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor,
                   metadata: IndexerMetadata, buffers: Buffers, topk_out: torch.Tensor, *,
                   backend: str | None = None, q_scale: torch.Tensor | None = None,
                   _checked: bool = False) -> torch.Tensor:
    """Top-k of every decode token (docs/spec.md §7 step 4); writes ``topk_out[:num_decode_tokens]`` only.

    Uniform steps reshape the queries to ``[B, next_n, H, D]`` and write top-k straight into ``topk_out``.
    Non-uniform steps pack queries and weights into ``buffers.q_pack/w_pack`` slots, select into
    ``buffers.topk_pack`` and copy the real rows back, so no padded row reaches ``topk_out``. Under a decode
    logits budget (``IndexerLimits.max_decode_logits_bytes``) requests are scored and selected in sub-batches of
    :func:`decode_batch` requests that reuse one budget-sized logits region. Top-k gets
    ``buffers.topk_scratch`` as its workspace when the record has one (the Triton backend splits few rows over
    several programs with it).
    """
    plan = None
    if not _checked:
        kv3, plan = _check(q_fp8, weights, kv_cache, metadata, buffers, topk_out, None, False, True, backend,
                           q_scale)
    _run_step(plan, metadata, buffers, q_fp8, weights, None, kv_cache if plan is None else kv3, topk_out,
              backend, None, False, True, q_scale=q_scale)
    return topk_out


_run_direct = library.run_direct
"""One op of a step that runs its ops directly (:func:`_check` returned a plan: plain eager, plain tensors): the
implementation (resolved routes, named under the profiler); the step bumps the version counters of what it
wrote once (:func:`library.bump_versions`)."""


def _run_op(name: str, backend: str | None, device: torch.device, args: tuple, kwargs: dict) -> None:
    """One op of a step on any other route (:func:`library.call`: the custom op under compile and every mode,
    the reference under ``torch.func``)."""
    library.call(name, backend, device, *args, **kwargs)


def _run_step(plan, metadata: IndexerMetadata, buffers: Buffers, q_fp8: torch.Tensor, weights: torch.Tensor,
              k: torch.Tensor | None, kv_cache: torch.Tensor, topk_out: torch.Tensor, backend: str | None,
              scale_fmt: str | None, prefill: bool, decode: bool, candidates: torch.Tensor | None = None,
              write_candidates: bool = False, q_scale: torch.Tensor | None = None) -> None:
    """The step's ops (arguments checked): the cache write (with ``k``), the padding rows, every prefill chunk,
    the decode sub-batches. With ``plan`` (:func:`_check`'s, plain eager) on its views and through
    :func:`_run_direct`; without, on views made here and through :func:`_run_op`. The one place that calls the
    step's ops. ``candidates`` (two-level indexer, docs/spec.md §6a): written per token row by a source layer
    (``write_candidates``), read by a consumer layer's top-k. ``q_scale``: the MXFP4 queries' scale bytes (an MXFP4
    cache, docs/spec.md §3a), handed to the logits ops beside the rows of ``q_fp8``."""
    run = _run_direct
    if plan is None:
        run = _run_op
        plan = _StepPlan(metadata, buffers, prefill, decode, spans=False)
        kv_cache = as_3d(kv_cache)
    dev = q_fp8.device
    write = candidates is not None and write_candidates
    try:
        if k is not None:  # (in the cache's format, limits.cache: plan.write_kw holds its fp8_dtype)
            run("write_k_cache", backend, dev, (k, kv_cache, metadata.slot_mapping),
                {"scale_fmt": scale_fmt, **plan.write_kw})
        # docs/spec.md §7 step 2 (fill topk_out[:T] with -1): rows [0, num_tokens) are all written below, by the
        # top-k of their prefill chunk or decode slot (windows <= topk come out as 0..len-1, -1...), so only the
        # padding tokens [num_tokens, T) of a padded batch (CUDA graphs) are filled here. Filling every row would
        # cost a second write of topk_out and, under torch.compile, a staged copy of its rows. A source layer's
        # candidate rows likewise.
        n, t = metadata.num_tokens, q_fp8.shape[0]
        if prefill and decode and t > n:
            topk_out[n:t].fill_(-1)
            if write:
                candidates[n:t].fill_(-1)
        if prefill:  # prefill rows of chunks without keys (compressed caches): no kernel, all -1
            for a, b in metadata.empty_rows:
                topk_out[a:b].fill_(-1)
                if write:
                    candidates[a:b].fill_(-1)
        for i, (c, k_fp8, k_scale, logits) in enumerate(plan.chunks):
            _chunk_ops(run, backend, dev, q_fp8, weights, kv_cache, c, k_fp8, k_scale, logits, plan.gather_kw,
                       q_scale)
            out = _rows(topk_out, c.token_start, c.token_end)
            if candidates is None:
                run("top_k_per_row", backend, dev, (logits, *c.topk_bounds), {"out": out})
            else:
                _selection_ops(run, backend, dev, metadata, logits, c.topk_bounds, out, None,
                               _rows(candidates, c.token_start, c.token_end),
                               plan.chunk_scores[i] if plan.chunk_scores else None, write)
        if plan.subs:
            dm = metadata.decode
            nd = metadata.num_decode_tokens
            q, w, sel = _decode_inputs(q_fp8, weights, dm, nd, buffers, topk_out)
            qs = None if q_scale is None else _decode_q_scale(q_scale, dm, nd, buffers)
            cand = _decode_candidates(candidates, dm, nd, buffers, write)
            # Sub-batches of whole requests (one unless IndexerLimits.max_decode_logits_bytes binds): host integers
            # only, so every shape is fixed by the step's metadata and the loop captures in a CUDA graph; each
            # reuses the same region at the start of buffers.logits (and of qk, topk_scratch). Rows are
            # independent, so the top-k is the one of a single batch.
            fused = _fused_routes(plan, run, backend, q, w, kv_cache, sel) if cand is None else None
            for i, (b0, b1, r0, r1, logits, qk, ws, row_starts, row_ends, ctx, bt) in enumerate(plan.subs):
                if fused is not None and fused[i] is not None:
                    try:  # scores and selection in one kernel, no logits (else: NotImplementedError, nothing written)
                        run("fp8_paged_mqa_topk", fused[i], dev,
                            (_rows(q, b0, b1), kv_cache, _rows(w, r0, r1), ctx, bt),
                            {"out": _rows(sel, r0, r1), "workspace": ws})
                        continue
                    except NotImplementedError:
                        pass
                _sub_batch_ops(run, backend, dev, q, w, kv_cache, b0, b1, r0, r1, logits, qk, ctx, bt, plan.paged_kw,
                               None if qs is None else _rows(qs, b0, b1))
                if cand is None:
                    kw = {"out": _rows(sel, r0, r1)} if ws is None else {"out": _rows(sel, r0, r1), "workspace": ws}
                    run("top_k_per_row", backend, dev, (logits, row_starts, row_ends), kw)
                else:
                    _selection_ops(run, backend, dev, metadata, logits, (row_starts, row_ends), _rows(sel, r0, r1),
                                   ws, _rows(cand, r0, r1), plan.sub_scores[i] if plan.sub_scores else None, write)
            if not dm.uniform:
                torch.index_select(sel, 0, dm.unpack_src, out=_rows(topk_out, 0, nd))
                if write:
                    torch.index_select(cand, 0, dm.unpack_src, out=_rows(candidates, 0, nd))
    finally:
        if run is _run_direct:  # what the ops wrote, once (their ADInplaceOrView kernels would, op by op)
            written = (topk_out, *plan.written) if k is None else (topk_out, kv_cache, *plan.written)
            library.bump_versions((candidates, *written) if write else written)


def _fused_routes(plan, run, backend: str | None, q: torch.Tensor, w: torch.Tensor, kv_cache: torch.Tensor,
                  sel: torch.Tensor) -> tuple | None:
    """The backend whose fused ``fp8_paged_mqa_topk`` ``auto`` runs for each decode sub-batch of ``plan`` (``None``
    where it composes: docs/spec.md §6b), or ``None`` when the step cannot fuse at all: a named backend, a cache
    format other than the plain one, no workspace in the record, or a step off the direct route (compiled, traced:
    the composition of the logits and top-k ops). Decided once per plan and registry generation, from host
    values only; a sub-batch whose call the fused kernel declines after all still composes."""
    if run is not _run_direct or not (backend is None or backend == "auto") or plan.paged_kw or not plan.subs:
        return None
    from ._runtime import dispatch
    from .backends import generation

    if plan.fused is not None and plan.fused[0] == generation:
        return plan.fused[1]
    found = dispatch.routes("fp8_paged_mqa_topk", None, q.device)
    names = []
    for b0, b1, r0, r1, _, _, ws, _, _, ctx, bt in plan.subs:
        r = None
        if ws is not None:
            r = dispatch.chosen(found, None, (_rows(q, b0, b1), kv_cache, _rows(w, r0, r1), ctx, bt),
                                {"out": _rows(sel, r0, r1), "workspace": ws})
        names.append(r.name if r is not None and r.name != dispatch.COMPOSED else None)
    plan.fused = (generation, tuple(names) if any(names) else None)
    return plan.fused[1]


def _selection_ops(run, backend: str | None, dev: torch.device, metadata: IndexerMetadata, logits: torch.Tensor,
                   bounds: tuple, out: torch.Tensor, ws: torch.Tensor | None, rows: torch.Tensor,
                   scores: torch.Tensor | None, write: bool) -> None:
    """The selection of one chunk or sub-batch of a two-level indexer layer (docs/spec.md §6a): a source layer
    (``write``) selects the candidate blocks into ``rows`` (with ``scores``, the block-score workspace, when the
    record has one) and then its ordinary top-k (with the top-k workspace ``ws``); a consumer layer's top-k reads
    only the cells of ``rows``' candidate blocks."""
    b = metadata.limits.candidate_block_size
    if write:
        kw = {"out": rows, "block_size": b} if scores is None else {"out": rows, "block_size": b, "workspace": scores}
        run("select_candidate_blocks", backend, dev, (logits, *bounds), kw)
        run("top_k_per_row", backend, dev, (logits, *bounds),
            {"out": out} if ws is None else {"out": out, "workspace": ws})
    else:
        run("top_k_per_row", backend, dev, (logits, *bounds),
            {"out": out, "candidates": rows, "candidate_block_size": b})


def _check_candidates(candidates: torch.Tensor, write: bool, metadata: IndexerMetadata, buffers: Buffers,
                      q_fp8, weights, k, topk_out, kv_cache, backend) -> None:
    """The two-level indexer's arguments (docs/spec.md §6a): ``candidates [>= T, K_b]`` int32, contiguous, on the
    step's device, ``K_b = limits.candidate_blocks``; a source layer's candidates (written) apart from everything
    the step reads or writes, a consumer's from what it writes."""
    lim = metadata.limits
    if not lim.candidate_blocks:
        raise ValueError("candidates= needs limits planned with IndexerLimits(candidate_blocks=K_b > 0)")
    C.tensor("candidates", candidates, ndim=2, dtypes=torch.int32, device=q_fp8.device, contiguous=True)
    if candidates.shape[0] < q_fp8.shape[0] or candidates.shape[1] != lim.candidate_blocks:
        raise ValueError(f"candidates must be [>= {q_fp8.shape[0]} (the rows of q_fp8), candidate_blocks="
                         f"{lim.candidate_blocks}] int32, got {list(candidates.shape)}")
    if write and buffers.block_scores is None:
        raise BufferTooSmall("block_scores", 1, 0, "a source layer needs a record planned with "
                             "IndexerLimits(candidate_blocks=...)")
    if metadata.decode is not None and not metadata.decode.uniform:
        buffers.cand_pack_view(metadata.decode.num_rows, lim.candidate_blocks)
    fields = {f"buffers.{name}": x for name, x in buffers.tensors().items()}
    reads = {"q_fp8": q_fp8, "weights": weights, "k": k, **metadata.tensors()}
    if write:
        C.disjoint({"candidates": candidates}, {**fields, **reads, "topk_out": topk_out, "kv_cache": kv_cache})
    else:
        C.disjoint({**fields, "topk_out": topk_out, "kv_cache": kv_cache}, {"candidates": candidates})
    if backend is not None and backend != "auto" and not torch.compiler.is_compiling():
        if write:
            _require_backend(backend, ("select_candidate_blocks",), q_fp8.device)
        if backend == "aiter":  # (its kernels read whole windows: an explicit backend never falls back)
            from ._runtime.dispatch import BackendUnavailable

            raise BackendUnavailable("backend 'aiter' has no candidate-block selection or candidate-restricted "
                                     "top-k; use backend=None (auto), 'triton' or 'reference'")


def _chunk_ops(run, backend: str | None, dev: torch.device, q_fp8: torch.Tensor, weights: torch.Tensor,
               kv3: torch.Tensor, c, k_fp8: torch.Tensor, k_scale: torch.Tensor, logits: torch.Tensor,
               fmt_kw: dict | None = None, q_scale: torch.Tensor | None = None) -> None:
    """One prefill chunk's gather (skipped when its keys are already there; ``fmt_kw``: the cache format's keyword
    arguments, :func:`_format_kwargs`) and ``clean=False`` logits (``q_scale``: MXFP4 queries' scale bytes)."""
    if c.gather:
        run("gather_k_cache", backend, dev, (kv3, c.block_table, c.cu_seq_lens),
            {"out_k": k_fp8, "out_scale": k_scale, **fmt_kw} if fmt_kw else {"out_k": k_fp8, "out_scale": k_scale})
    t0, t1 = c.token_start, c.token_end
    kw = {"out": logits, "clean": False} if c.window is None else {"out": logits, "clean": False, "compressed": True}
    if q_scale is not None:
        kw["q_scale"] = _rows(q_scale, t0, t1)
    run("fp8_mqa_logits", backend, dev,
        (_rows(q_fp8, t0, t1), k_fp8, k_scale, _rows(weights, t0, t1), c.cu_seqlen_ks, c.cu_seqlen_ke), kw)


def _sub_batch_ops(run, backend: str | None, dev: torch.device, q: torch.Tensor, w: torch.Tensor, kv3: torch.Tensor,
                   b0: int, b1: int, r0: int, r1: int, logits: torch.Tensor, qk: torch.Tensor | None,
                   context_lens: torch.Tensor, block_table: torch.Tensor, fmt_kw: dict | None = None,
                   q_scale: torch.Tensor | None = None) -> None:
    """Paged ``clean=False`` logits of decode requests ``[b0, b1)`` (rows ``[r0, r1)``) into ``logits`` (and
    ``qk``; not in a cache format other than the plain one, ``fmt_kw``: only aiter's stage1 kernel reads it;
    ``q_scale``: the sub-batch's MXFP4 query scale bytes ``[b1 - b0, next_n, H, D / 32]``)."""
    if fmt_kw:
        kw = {"out": logits, "clean": False, **fmt_kw}
        if q_scale is not None:
            kw["q_scale"] = q_scale
    else:
        kw = {"out": logits, "clean": False} if qk is None else {"out": logits, "clean": False, "qk": qk}
    run("fp8_paged_mqa_logits", backend, dev, (_rows(q, b0, b1), kv3, _rows(w, r0, r1), context_lens, block_table), kw)


def _chunk_logits(q_fp8: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor, c, buffers: Buffers,
                  backend: str | None, limits=None) -> tuple[slice, torch.Tensor]:
    """One prefill chunk's gather and ``clean=False`` logits into ``buffers.logits`` (arguments already checked;
    :func:`_chunk_ops` through :func:`_run_op`); returns the chunk's token rows and its ``[M_c, N_c]`` logits.
    For the context-parallel prefill. ``limits``: the step's (its cache format's scale encoding and byte order;
    ``None``: the plain ones; the FP8 format is the one of ``buffers.k_fp8``)."""
    k_fp8, k_scale = buffers.k_view(c.num_k_tokens)
    logits = buffers.logits_view(c.num_tokens, c.logits_cols)
    fmt_kw = None if limits is None else _format_kwargs(limits)[1]
    _chunk_ops(_run_op, backend, q_fp8.device, q_fp8, weights, as_3d(kv_cache), c, k_fp8, k_scale, logits, fmt_kw)
    return slice(c.token_start, c.token_end), logits


def _decode_inputs(q_fp8: torch.Tensor, weights: torch.Tensor, dm, nd: int, buffers: Buffers,
                   topk_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decode step's queries ``[B, next_n, H, D]``, weights ``[B * next_n, H]`` and top-k rows: views of the
    step's tensors when uniform, else ``buffers.q_pack/w_pack/topk_pack`` with the queries and weights packed
    into their slots (the caller unpacks the top-k rows with ``dm.unpack_src``)."""
    b, nn, h, d = dm.num_reqs, dm.next_n, q_fp8.shape[1], q_fp8.shape[2]
    if dm.uniform:
        return _rows(q_fp8, 0, nd).view(b, nn, h, d), _rows(weights, 0, nd), _rows(topk_out, 0, nd)
    q_pack, w_pack, sel = buffers.pack_views(dm.num_rows)
    torch.index_select(q_fp8.view(torch.uint8), 0, dm.pack_src, out=q_pack.view(torch.uint8))
    torch.index_select(weights, 0, dm.pack_src, out=w_pack)
    return q_pack.view(b, nn, h, d), w_pack, sel


def _decode_candidates(candidates: torch.Tensor | None, dm, nd: int, buffers: Buffers,
                       write: bool) -> torch.Tensor | None:
    """The candidate rows of the decode slots (two-level indexer; ``None`` without ``candidates``): the token rows
    when uniform, else ``buffers.cand_pack`` packed like the top-k rows of :func:`_decode_inputs` (a consumer's
    filled from ``candidates``; a source layer's written by the step, which then unpacks them)."""
    if candidates is None:
        return None
    if dm.uniform:
        return _rows(candidates, 0, nd)
    cand = buffers.cand_pack_view(dm.num_rows, candidates.shape[1])
    if not write:
        torch.index_select(candidates, 0, dm.pack_src, out=cand)
    return cand


def _decode_q_scale(q_scale: torch.Tensor, dm, nd: int, buffers: Buffers) -> torch.Tensor:
    """The MXFP4 decode queries' scale bytes ``[B, next_n, H, D / 32]``, as :func:`_decode_inputs` lays out the
    queries: a view when uniform, else packed into ``buffers.q_scale_pack``."""
    b, nn, h, s = dm.num_reqs, dm.next_n, q_scale.shape[1], q_scale.shape[2]
    if dm.uniform:
        return _rows(q_scale, 0, nd).view(b, nn, h, s)
    packed = buffers.q_scale_pack_view(dm.num_rows)
    torch.index_select(q_scale, 0, dm.pack_src, out=packed)
    return packed.view(b, nn, h, s)


def _decode_logits(q: torch.Tensor, w: torch.Tensor, kv_cache: torch.Tensor, dm, buffers: Buffers, b0: int, b1: int,
                   backend: str | None, limits=None):
    """Paged ``clean=False`` logits of decode requests ``[b0, b1)`` into the start of ``buffers.logits`` (and
    ``qk``; :func:`_sub_batch_ops` through :func:`_run_op`); returns their rows ``r0, r1``, the logits and the
    top-k workspace view (``None`` without one). For the context-parallel decode. ``limits``: the step's (its
    cache format; ``None``: the plain one in the FP8 format of ``buffers.k_fp8``, the cache's, check_step)."""
    r0, r1 = b0 * dm.next_n, b1 * dm.next_n
    logits = buffers.logits_view(r1 - r0, dm.width)
    qk = buffers.qk_view(r1 - r0, dm.width) if buffers.qk is not None else None
    if limits is not None:
        fmt_kw = _format_kwargs(limits)[2]
    else:
        fmt_kw = {} if q.dtype == buffers.fp8_dtype else {"cache_fp8_dtype": buffers.fp8_dtype}
    _sub_batch_ops(_run_op, backend, q.device, q, w, as_3d(kv_cache), b0, b1, r0, r1, logits, qk,
                   _rows(dm.context_lens, b0, b1), _rows(dm.block_table, b0, b1), fmt_kw)
    ws = buffers.topk_scratch_view(r1 - r0) if buffers.topk_scratch is not None else None
    return r0, r1, logits, ws


def sparse_attn_indexer(q_fp8: torch.Tensor, k: torch.Tensor | None, weights: torch.Tensor, kv_cache: torch.Tensor,
                        metadata: IndexerMetadata, buffers: Buffers, topk_out: torch.Tensor, *,
                        backend: str | None = None, scale_fmt: str | None = "ue8m0",
                        candidates: torch.Tensor | None = None, write_candidates: bool = False,
                        q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One indexer step of one layer (docs/spec.md §7). Returns ``topk_out``.

    Args:
        q_fp8: ``[T, H, D]`` fp8 queries, decode tokens first; their scales folded into ``weights``. With an
            MXFP4 cache (docs/spec.md §3a) ``[T, H, D / 2]`` uint8 packed e2m1 values, scales in ``q_scale``.
        k: ``[>= num_tokens, D]`` bfloat16/float16/float32 keys of the new tokens (quantized into the cache;
            rows beyond ``num_tokens`` are ignored), or ``None`` when the cache already holds them.
        weights: ``[T, H]`` float32.
        kv_cache: ``[num_blocks, block_size, D + 4]`` (or 4-D) uint8, this layer's K cache (written).
        metadata: from :func:`sparse_indexer.build_metadata`, shared by every layer of the step.
        buffers: scratch views from :func:`buffers.allocate`; only its views are written.
        topk_out: ``[T_max, topk]`` int32, ``T_max >= T``; rows ``[0, num_tokens)`` receive request-local
            token positions (-1 = none), padding rows ``[num_tokens, T)`` are filled with -1, rows from ``T``
            on are untouched.
        backend: ``None``/``"auto"``, ``"reference"``, ``"triton"`` or ``"aiter"`` for every op.
        scale_fmt: key scale format of the cache write (``"ue8m0"`` or ``None``; a cache format with ``"ue8m0x4"``
            scales needs ``"ue8m0"``).
        candidates: ``[>= T, K_b]`` int32 candidate blocks of a two-level indexer (DeepSeek-V4.1, docs/spec.md
            §6a; ``K_b = limits.candidate_blocks``, blocks of ``limits.candidate_block_size`` positions), one
            row per token: a source layer (``write_candidates=True``) writes rows ``[0, T)`` (the candidates of
            each token's window; -1 for padding rows and rows without keys) and selects its own top-k over its
            whole windows; a consumer layer (``False``) selects inside the candidate blocks of each row.
        write_candidates: this layer is the source of ``candidates``.
        q_scale: ``[T, H, D / 32]`` uint8, the MXFP4 queries' UE8M0 scale bytes (:func:`~sparse_indexer.
            quantize_q_mxfp4`): required with, and only with, limits that declare an MXFP4 cache
            (``IndexerLimits(cache_format=CacheFormat(values="mxfp4"))``; the cache is then ``[num_blocks,
            block_size, D / 2 + D / 32]``, the buffers planned with those limits, and ``k`` is quantized to MXFP4).

    The cache is read (and, with ``k``, written) in ``metadata.limits.cache`` (an ``IndexerLimits(cache_format=
    CacheFormat(...))`` declaration, else the plain format in ``limits.fp8_dtype``): the gather and the paged
    logits are told the format, the ragged logits get the gathered keys in the cache's FP8 format (a mix with the
    queries' is computed by the reference backend; ``auto`` falls back to it). The cache write of a scale encoding
    or byte order other than the plain ones runs in the reference backend (``write_k_cache(cache_format=)``).

    Raises:
        BufferTooSmall, ValueError, TypeError: before anything is written.
    """
    kv3, plan = _check(q_fp8, weights, kv_cache, metadata, buffers, topk_out, k, True, True, backend, q_scale)
    if candidates is not None:
        _check_candidates(candidates, bool(write_candidates), metadata, buffers, q_fp8, weights, k, topk_out,
                          kv_cache, backend)
    elif write_candidates:
        raise ValueError("write_candidates=True needs the candidates tensor to write")
    if k is not None and scale_fmt != "ue8m0":
        if scale_fmt not in SCALE_FMTS:
            raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")
        fmt = metadata.limits.cache_format
        if fmt is not None and fmt.scale == "ue8m0x4":
            raise ValueError(f"the limits' cache format stores ue8m0x4 scales, which hold powers of two only: the "
                             f"step's cache write needs scale_fmt='ue8m0', got {scale_fmt!r}")
    # check_step proved every op's arguments (the layer's tensors, the buffer views) and the metadata's records
    # checked theirs when they were built, once per step: the ops run without their own checks (host time)
    _run_step(plan, metadata, buffers, q_fp8, weights, k, kv_cache if plan is None else kv3, topk_out, backend,
              scale_fmt, True, True, candidates, bool(write_candidates), q_scale)
    return topk_out
