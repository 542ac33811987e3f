"""The buffer plan: a pure function from :class:`IndexerLimits` to the layout of one arena (docs/spec.md §9)."""

from __future__ import annotations

import functools
import math

import attrs
import torch

from .limits import IndexerLimits

__all__ = ["ALIGN", "FieldPlan", "BufferPlan", "plan", "FIELDS", "PrefillExtremes", "prefill_extremes",
           "logits_elems", "cp_scratch_cols", "compressed_prefill_logits", "prefill_logits_cells"]

ALIGN = 256  # byte alignment of every field inside the arena


def _topk_scratch_shape(lim: IndexerLimits) -> tuple[int, int] | None:
    """``[decode_batch_rows, cols]``: the top-k workspace of one decode sub-batch, as wide as the widest
    ``topk_workspace`` the registered backends declare (:func:`sparse_indexer.backends.topk_workspace_cols`;
    imported at call time: the ``sparse_indexer`` package imports this one, and the registry imports nothing of
    ``buffers``); absent when no backend declares one."""
    from sparse_indexer.backends import topk_workspace_cols

    cols = topk_workspace_cols(lim)
    return None if cols is None else (lim.decode_batch_rows, cols)

def cp_scratch_cols(world_size: int, topk: int) -> int:
    """int32 columns per row of ``cp_scratch`` (context parallel, docs/spec.md §11): the local candidates
    ``2 * topk`` (values as float32 bits, global positions), the gathered ones ``2 * world_size * topk``, the
    merge's values and positions ``2 * world_size * topk``, and the merge's window bounds 2."""
    return (2 + 4 * world_size) * topk + 2


def _cp_scratch_shape(lim: IndexerLimits) -> tuple[int, int] | None:
    """``[decode_batch_rows, cp_scratch_cols]`` when ``world_size > 1``: the merge runs on pieces of at most
    ``decode_batch_rows`` rows (a decode sub-batch; prefill chunks are merged in pieces of that many tokens)."""
    if lim.world_size == 1:
        return None
    return (lim.decode_batch_rows, cp_scratch_cols(lim.world_size, lim.topk))


@attrs.frozen
class PrefillExtremes:
    """The largest prefill chunk that any step allowed by the limits can form (docs/spec.md §8's chunk planner,
    :func:`sparse_indexer.metadata.plan_prefill_chunks`), each with a step that forms it.

    Attributes:
        keys: most gathered key tokens in one chunk (0 when no prefill request fits the limits).
        keys_step: ``(seq_lens, query_lens)`` of a prefill-only step whose first chunk gathers ``keys`` keys.
        logits: most ``query_tokens * key_tokens`` float32 cells of one chunk.
        logits_step: ``(seq_lens, query_lens)`` of a prefill-only step whose first chunk has ``logits`` cells.
    """

    keys: int
    keys_step: tuple[tuple[int, ...], tuple[int, ...]] | None
    logits: int
    logits_step: tuple[tuple[int, ...], tuple[int, ...]] | None


def _spread(total: int, parts: int) -> tuple[int, ...]:
    """``total`` split into ``parts`` integers as evenly as possible, the larger ones first."""
    b, e = divmod(total, parts)
    return (b + 1,) * e + (b,) * (parts - e)


@functools.lru_cache(maxsize=512)
def prefill_extremes(lim: IndexerLimits) -> PrefillExtremes:
    """The exact maxima of a prefill chunk's keys and logits over every step the limits allow.

    A step holds at most ``max_num_seqs`` requests and ``max_num_batched_tokens`` (T) tokens, every context
    ``<= max_model_len`` (L); a prefill request has ``q >= q0`` query tokens and ``s >= q`` keys, where
    ``q0 = limits.min_prefill_queries`` (``next_n + 1`` unless the limits say otherwise). With the caps
    ``K = prefill_k_tokens`` and ``C = max_logits_bytes // 4``, the planner forms two kinds of chunks:

    - ``r`` whole requests with ``M = sum(q)`` queries and ``N = sum(s)`` keys, where ``r q0 <= M <= min(T, N)``,
      ``N <= min(r L, K)`` and ``M N <= C``; any such ``(M, N)`` is reachable (spread ``M`` and ``N`` evenly
      over ``r`` requests). For ``M`` fixed the best ``r`` is ``min(max_num_seqs, T // q0, M // q0)``.
    - a piece of one request whose ``q s > C``: ``max(1, C // s)`` queries against its ``s`` keys.

    Keys: ``max(L, max_r min(r L, K, C // (r q0)))``. Logits: the larger of the best ``M N`` of the first kind
    (a search over ``M <= min(T, isqrt(C))``) and the best ``max(1, C // s) s`` of the second (a search over the
    quotients ``C // s``); both searches are vectorised and cached per limits.
    """
    L, T, S = lim.max_model_len, lim.max_num_batched_tokens, lim.max_num_seqs
    K, C, q0 = lim.prefill_k_tokens, lim.prefill_logits_elems, lim.min_prefill_queries
    if min(T, L) < q0:  # no request can be a prefill request
        return PrefillExtremes(keys=0, keys_step=None, logits=0, logits_step=None)
    rmax = min(S, T // q0)
    keys, keys_step = L, ((L,), (q0,))
    for r in range(2, rmax + 1):
        n = min(r * L, K, C // (r * q0))
        if n < r * q0:  # r requests of q0 queries no longer fit the logits cap; more requests fit even less
            break
        if n > keys:
            keys, keys_step = n, (_spread(n, r), (q0,) * r)

    logits, logits_step = 0, None
    hi = min(T, math.isqrt(C))
    if hi >= q0:  # whole requests: M queries
        m = torch.arange(q0, hi + 1, dtype=torch.int64)
        r = torch.clamp(m // q0, max=rmax)
        n = torch.minimum(torch.clamp(r * L, max=K), C // m)
        val = torch.where(n >= m, m * n, 0)
        i = int(val.argmax())
        if int(val[i]) > logits:
            mi, ni, ri = int(m[i]), int(n[i]), int(r[i])
            logits, logits_step = mi * ni, (_spread(ni, ri), _spread(mi, ri))
    if L > C:  # pieces of one query against a whole context
        if L > logits:
            logits, logits_step = L, ((L,), (q0,))
    else:  # pieces of C // s queries of a request with min(s, T) * s > C
        a = math.isqrt(C) + 1
        s_lo = max(q0, a if a <= T else max(T + 1, C // T + 1))
        if s_lo <= L:
            v = torch.arange(C // L, C // s_lo + 1, dtype=torch.int64)
            s_ = torch.clamp(C // v, max=L)
            val = torch.where(s_ >= s_lo, (C // s_) * s_, 0)
            i = int(val.argmax())
            if int(val[i]) > logits:
                si = int(s_[i])
                logits, logits_step = int(val[i]), ((si,), (min(si, T),))
    return PrefillExtremes(keys=keys, keys_step=keys_step, logits=logits, logits_step=logits_step)


@functools.lru_cache(maxsize=512)
def compressed_prefill_logits(lim: IndexerLimits) -> int:
    """Most cells of one prefill chunk's *compressed* logits (``IndexerLimits.compressed_prefill_logits``): a
    chunk's queries times its longest window, over every chunk the planner can form (the chunks do not change).

    With ``T, L, S, K, C, q0`` as in :func:`prefill_extremes`:

    - a chunk of one whole request (``q`` queries, ``s`` keys, ``q s <= C``): its last query's window is ``s``,
      so ``q s`` cells, the most ``max_s s min(T, s, C // s)`` (``min(...) >= q0``);
    - a chunk of ``r >= 2`` requests: ``M`` queries, ``N >= M`` keys, longest window ``smax <= L``, with
      ``M N <= C``, ``N <= K``: for each ``M <= min(T, isqrt(C), K)`` and ``r``, the largest ``smax`` with
      ``N = max(M, smax + (r - 1) q0)`` (the other requests as short as allowed) and ``r smax >= M``;
    - a query piece of a request split by the planner: at most its ``max(1, C // s)`` queries times ``s`` (the
      uncompressed piece, an upper bound: the first pieces' windows are shorter).
    """
    L, T, S = lim.max_model_len, lim.max_num_batched_tokens, lim.max_num_seqs
    K, C, q0 = lim.prefill_k_tokens, lim.prefill_logits_elems, lim.min_prefill_queries
    if min(T, L) < q0:
        return 0
    best = 0
    s = torch.arange(q0, L + 1, dtype=torch.int64)
    q = torch.minimum(torch.clamp(s, max=T), C // s)
    whole = torch.where(q >= q0, q * s, 0)
    best = max(best, int(whole.max()))
    qmax = torch.clamp(s, max=T)
    split = qmax * s > C  # the planner splits a request of qmax queries: pieces of max(1, C // s) queries
    if bool(split.any()):
        best = max(best, int(torch.where(split, torch.clamp(C // s, min=1) * s, 0).max()))
    hi = min(T, math.isqrt(C), K)  # N >= M: a chunk of M queries has M N <= C and N <= K
    if hi >= 2 * q0 and S >= 2:
        m = torch.arange(2 * q0, hi + 1, dtype=torch.int64)
        for r in range(2, min(S, hi // q0) + 1):
            # r requests, M = m queries: the longest s_max <= L with N = max(m, s_max + (r-1) q0) keys (the other
            # requests as short as allowed), and r requests of at most s_max keys must hold the m queries
            smax = torch.clamp(C // m - (r - 1) * q0, max=min(L, K - (r - 1) * q0))
            ok = (r * q0 <= m) & (smax >= q0) & (smax * r >= m)
            if bool(ok.any()):
                best = max(best, int(torch.where(ok, m * smax, 0).max()))
    return best


def prefill_logits_cells(lim: IndexerLimits) -> int:
    """Most logits cells of one prefill chunk under ``lim``: :func:`prefill_extremes` (``M x N``), or
    :func:`compressed_prefill_logits` with ``IndexerLimits.compressed_prefill_logits``."""
    return compressed_prefill_logits(lim) if lim.compressed_prefill_logits else prefill_extremes(lim).logits


def logits_elems(lim: IndexerLimits) -> int:
    """Elements (of ``IndexerLimits.logits_dtype``) of the flat ``logits`` field: the larger of the biggest prefill
    chunk (:func:`prefill_logits_cells`) and one decode sub-batch, ``decode_batch_rows x max_model_len``."""
    return max(prefill_logits_cells(lim), lim.decode_batch_rows * lim.max_model_len)


# name -> (shape function of the limits, dtype function of the limits); a shape of None means "absent".
# A top-k backend that needs scratch declares its width in the backend registry (topk_scratch below). Every size
# is the largest that some step allowed by the limits uses (tests/buffers/test_plan_tight.py).
FIELDS = {
    "k_fp8": (lambda lim: (prefill_extremes(lim).keys, lim.head_dim), lambda lim: lim.fp8_dtype),
    "k_scale": (lambda lim: (prefill_extremes(lim).keys,), lambda lim: torch.float32),
    "logits": (lambda lim: (logits_elems(lim),), lambda lim: lim.logits_dtype),
    # decode only, one sub-batch at a time
    "qk": (
        lambda lim: (lim.n_heads, lim.decode_batch_rows, lim.max_model_len) if lim.with_qk else None,
        lambda lim: torch.float32,
    ),
    # Non-uniform decode (requests with fewer than next_n new tokens) packs queries, weights and top-k rows
    # into [max_num_seqs, next_n] slots (docs/spec.md §7, step 4); only needed when next_n > 1. Every decode request of
    # the step is packed at once (sub-batches then read slices), so these hold all max_num_seqs * next_n rows.
    "q_pack": (
        lambda lim: (lim.max_decode_rows, lim.n_heads, lim.head_dim) if lim.next_n > 1 else None,
        lambda lim: lim.fp8_dtype,
    ),
    "w_pack": (
        lambda lim: (lim.max_decode_rows, lim.n_heads) if lim.next_n > 1 else None,
        lambda lim: torch.float32,
    ),
    "topk_pack": (
        lambda lim: (lim.max_decode_rows, lim.topk) if lim.next_n > 1 else None,
        lambda lim: torch.int32,
    ),
    # The top-k workspace of the decode rows, one sub-batch at a time: its width is what the backends of the
    # registry declare (sparse_indexer.backends, Backend.topk_workspace; the Triton split-row top-k: per row,
    # counters, then the positions and the values of its candidate cells).
    "topk_scratch": (
        _topk_scratch_shape,
        lambda lim: torch.int32,
    ),
    # Context parallel (world_size > 1 only): candidates, gathered candidates and merge of one piece of rows
    # (sparse_indexer.parallel).
    "cp_scratch": (
        _cp_scratch_shape,
        lambda lim: torch.int32,
    ),
}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@attrs.frozen
class FieldPlan:
    """Where one field lives in the arena: ``arena[offset : offset + nbytes]`` viewed as ``dtype`` ``shape``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@attrs.frozen
class BufferPlan:
    """The layout of every buffer field in one ``uint8`` arena of ``total_bytes`` bytes."""

    limits: IndexerLimits
    fields: tuple[FieldPlan, ...]
    total_bytes: int

    def __getitem__(self, name: str) -> FieldPlan:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"no field {name!r} in the plan; fields: {[f.name for f in self.fields]}")

    def __contains__(self, name: str) -> bool:
        return any(f.name == name for f in self.fields)

    def __str__(self) -> str:
        rows = [("field", "shape", "dtype", "offset", "bytes", "MiB")]
        for f in self.fields:
            rows.append(
                (f.name, "x".join(map(str, f.shape)), str(f.dtype).replace("torch.", ""), str(f.offset),
                 str(f.nbytes), f"{f.nbytes / 2**20:.2f}")
            )
        rows.append(("total", "", "uint8", "0", str(self.total_bytes), f"{self.total_bytes / 2**20:.2f}"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = []
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) if j < 3 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
            if i == 0 or i == len(rows) - 2:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def plan(limits: IndexerLimits) -> BufferPlan:
    """Lay out every field of :class:`buffers.Buffers` for ``limits``; pure, needs no device.

    Fields are placed in the order of :data:`FIELDS` at 256-byte-aligned offsets; absent fields (``qk`` unless
    ``limits.with_qk``; ``q_pack``, ``w_pack``, ``topk_pack`` when ``next_n == 1``; ``topk_scratch`` when no
    registered backend declares a top-k workspace; ``cp_scratch`` when ``world_size == 1``) take no bytes.
    ``total_bytes`` is what an engine reserves.
    """
    if not isinstance(limits, IndexerLimits):
        raise TypeError(f"plan(limits) needs an IndexerLimits, got {type(limits).__name__}")
    fields = []
    offset = 0
    for name, (shape_fn, dtype_fn) in FIELDS.items():
        shape = shape_fn(limits)
        if shape is None:
            continue
        dtype = dtype_fn(limits)
        nbytes = math.prod(shape) * dtype.itemsize
        offset = _align(offset)
        fields.append(FieldPlan(name=name, shape=tuple(shape), dtype=dtype, offset=offset, nbytes=nbytes))
        offset += nbytes
    return BufferPlan(limits=limits, fields=tuple(fields), total_bytes=_align(offset))
