"""The buffer plan: a pure function from :class:`IndexerLimits` to the layout of one arena (docs/spec.md §9)."""

from __future__ import annotations

import functools
import math

import attrs
import torch

from .limits import IndexerLimits

__all__ = ["ALIGN", "FieldPlan", "BufferPlan", "plan", "FIELDS", "PrefillExtremes", "prefill_extremes",
           "logits_elems", "cp_scratch_cols", "block_scores_elems", "compressed_prefill_logits", "prefill_logits_cells"]

ALIGN = 256  # byte alignment of every field inside the arena


def _topk_scratch_shape(lim: IndexerLimits) -> tuple[int, int] | None:
    """``[decode_batch_rows, cols]``: the top-k workspace of one decode sub-batch, as wide as the widest
    ``topk_workspace`` the registered backends declare (:func:`sparse_indexer.backends.topk_workspace_cols`;
    imported at call time: the ``sparse_indexer`` package imports this one, and the registry imports nothing of
    ``buffers``); absent when no backend declares one."""
    from sparse_indexer.backends import topk_workspace_cols

    cols = topk_workspace_cols(lim)
    return None if cols is None else (lim.decode_batch_rows, cols)

def cp_scratch_cols(world_size: int, topk: int, candidate_blocks: int = 0, candidate_block_size: int = 8) -> int:
    """int32 columns per row of ``cp_scratch`` (context parallel, docs/spec.md §11), the most of what one merge
    holds at a time. The top-k merge: the local candidates ``2 * topk`` (values as float32 bits, global
    positions), the gathered ones ``2 * world_size * topk``, the merge's values and positions ``2 * world_size *
    topk``, and its window bounds 2. With ``candidate_blocks = K_b > 0`` (blocks of ``candidate_block_size =
    b`` positions), also the candidate-block merge (``sparse_indexer.parallel.merge_candidates``): ``2 * K_b``
    candidates (scores, global ids), then either the scores' cells (int64 positions, values, two masks:
    ``3.5 * K_b * b``; the windows in int64: 4) or the gathered candidates ``2 * W * K_b``, the merged scores, ids
    and selection workspace ``3 * (W * K_b + 1)``, int64 columns ``2 * K_b``, four bounds and two masks; plus
    ``2 * b + 8`` (an arange, alignment)."""
    cols = (2 + 4 * world_size) * topk + 2
    if candidate_blocks:
        kb, b, w = candidate_blocks, candidate_block_size, world_size
        cells = 2 * kb * b + kb * b + 2 * -(-kb * b // 4) + 4
        merged = 2 * w * kb + 3 * (w * kb + 1) + 2 * kb + 4 + -(-w * kb // 4) + -(-kb // 4)
        cols = max(cols, 2 * kb + max(cells, merged) + 2 * b + 8)
    return cols


def _cp_scratch_shape(lim: IndexerLimits) -> tuple[int, int] | None:
    """``[decode_batch_rows, cp_scratch_cols]`` when ``world_size > 1``: the merge runs on pieces of at most
    ``decode_batch_rows`` rows (a decode sub-batch; prefill chunks are merged in pieces of that many tokens)."""
    if lim.world_size == 1:
        return None
    return (lim.decode_batch_rows, cp_scratch_cols(lim.world_size, lim.topk, lim.candidate_blocks,
                                                   lim.candidate_block_size))


@attrs.frozen
class PrefillExtremes:
    """The largest prefill chunk that any step allowed by the limits can form (docs/spec.md §8's chunk planner,
    :func:`sparse_indexer.metadata.plan_prefill_chunks`), each with a step that forms it.

    Attributes:
        keys: most gathered keys in one chunk (0 when no prefill request fits the limits).
        keys_step: ``(seq_lens, query_lens)`` (tokens) of a prefill-only step whose first chunk gathers ``keys``
            keys.
        logits: most ``query_tokens * keys`` float32 cells of one chunk.
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


class _Units:
    """Tokens and keys of prefill requests under ``lim`` (``C = compress_ratio``): a request of ``s`` tokens has
    ``s // C`` keys, so the longest request with ``n`` keys has ``tokens(n) = min(L, C n + C - 1)`` tokens (and at
    most that many queries); ``n_min`` is the fewest keys of a request that can hold ``q0`` queries."""

    def __init__(self, lim: IndexerLimits):
        self.L, self.T, self.S = lim.max_model_len, lim.max_num_batched_tokens, lim.max_num_seqs
        self.K, self.cap, self.q0, self.c = lim.prefill_k_tokens, lim.prefill_logits_elems, lim.min_prefill_queries, \
            lim.compress_ratio
        self.Lc = lim.max_keys
        self.n_min = max(0, -(-(self.q0 + 1 - self.c) // self.c))
        self.any = min(self.T, self.L) >= self.q0  # some request can be a prefill request

    def tokens(self, n):
        """``min(L, C n + C - 1)``: an int or an int64 tensor."""
        if isinstance(n, torch.Tensor):
            return torch.clamp(self.c * n + self.c - 1, max=self.L)
        return min(self.L, self.c * n + self.c - 1)

    def spread_tokens(self, keys, r):
        """Most tokens of ``r`` requests holding ``keys`` keys in all (spread evenly: ``tokens`` is concave)."""
        b, e = torch.div(keys, r, rounding_mode="floor"), torch.remainder(keys, r)
        return e * self.tokens(b + 1) + (r - e) * self.tokens(b)

    def step(self, keys: int, queries: int, r: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(seq_lens, query_lens)`` of ``r`` requests with ``keys`` keys and ``queries`` queries in all: keys
        spread evenly, each request as long as its keys allow, queries ``q0`` each and the rest filled in order
        up to each request's length (the caller checks that they fit)."""
        seq = tuple(self.tokens(n) for n in _spread(keys, r))
        qry, left = [], queries - r * self.q0
        for s in seq:
            extra = min(left, s - self.q0)
            qry.append(self.q0 + extra)
            left -= extra
        return seq, tuple(qry)


@functools.lru_cache(maxsize=512)
def prefill_extremes(lim: IndexerLimits) -> PrefillExtremes:
    """The exact maxima of a prefill chunk's keys and logits over every step the limits allow.

    A step holds at most ``max_num_seqs`` (S) requests and ``max_num_batched_tokens`` (T) tokens, every context
    ``<= max_model_len`` (L) tokens; a prefill request has ``q >= q0`` query tokens (``q0 =
    limits.min_prefill_queries``), ``s >= q`` tokens and ``n = s // C`` keys (``C = compress_ratio``), so with
    ``n`` keys at most ``tokens(n) = min(L, C n + C - 1)`` queries, and at least ``n_min`` keys to hold ``q0``
    queries. With the caps ``K = prefill_k_tokens`` (keys) and ``X = max_logits_bytes // 4`` (cells), the planner
    forms two kinds of chunks:

    - ``r`` whole requests with ``M = sum(q)`` queries and ``N = sum(n)`` keys: ``r q0 <= M <= T``, ``r <= S``,
      ``r n_min <= N <= min(r L // C, K)``, ``M N <= X`` and ``M <= `` the most queries ``r`` requests of ``N``
      keys hold (keys spread evenly). For ``M`` fixed the best ``r`` is the largest these allow (more
      requests hold more queries and keys); a search over every ``M <= T``.
    - a piece of one request whose ``min(tokens(n), T) n > X``: ``max(1, X // n)`` queries against its ``n``
      keys; a search over ``n``.

    Keys: ``max(L // C, max_r min(r L // C, K, X // (r q0)))`` over the ``r`` whose requests still hold ``n_min``
    keys each. Both searches are vectorised and cached per limits. With ``C = 1``, ``tokens(n) = n``: a request
    has at least as many keys as queries.
    """
    u = _Units(lim)
    if not u.any or u.n_min > u.Lc:  # no request can be a prefill request
        return PrefillExtremes(keys=0, keys_step=None, logits=0, logits_step=None)
    T, S, K, X, q0, Lc = u.T, u.S, u.K, u.cap, u.q0, u.Lc
    rmax = min(S, T // q0)
    keys, keys_step = Lc, u.step(Lc, q0, 1)
    if rmax >= 2:
        r = torch.arange(2, rmax + 1, dtype=torch.int64)
        n = torch.minimum(torch.clamp(r * Lc, max=K), X // (r * q0))
        n = torch.where(n >= r * u.n_min, n, -1)  # r requests must hold n_min keys each
        i = int(n.argmax())
        if int(n[i]) > keys:
            keys, keys_step = int(n[i]), u.step(int(n[i]), int(r[i]) * q0, int(r[i]))

    logits, logits_step = 0, None
    # whole requests: M queries (every M <= T)
    m = torch.arange(q0, T + 1, dtype=torch.int64)
    ncap = torch.clamp(X // m, max=K)
    r = torch.clamp(m // q0, max=S)
    if u.n_min:
        r = torch.minimum(r, ncap // u.n_min)
    ok = r >= 1
    r = torch.clamp(r, min=1)
    n = torch.minimum(r * Lc, ncap)
    val = torch.where(ok & (m <= u.spread_tokens(n, r)), m * n, 0)
    i = int(val.argmax())
    if int(val[i]) > logits:
        logits, logits_step = int(val[i]), u.step(int(n[i]), int(m[i]), int(r[i]))
    # pieces of a request of n keys the planner splits along its queries
    n = torch.arange(max(1, u.n_min), Lc + 1, dtype=torch.int64)
    split = torch.clamp(u.tokens(n), max=T) * n > X
    val = torch.where(split, torch.clamp(X // n, min=1) * n, 0)
    if val.numel():
        i = int(val.argmax())
        if int(val[i]) > logits:
            ni = int(n[i])
            logits, logits_step = int(val[i]), ((u.tokens(ni),), (min(u.tokens(ni), T),))
    return PrefillExtremes(keys=keys, keys_step=keys_step, logits=logits, logits_step=logits_step)


@functools.lru_cache(maxsize=512)
def compressed_prefill_logits(lim: IndexerLimits) -> int:
    """Most cells of one prefill chunk's *compressed* logits (``IndexerLimits.compressed_prefill_logits``): a
    chunk's queries times its longest window, over every chunk the planner can form (the chunks do not change).

    With ``T, L, S, K, X, q0, C, tokens, n_min`` as in :func:`prefill_extremes` (a request's last query sees all
    its ``n`` keys, so a chunk's longest window is its largest ``n``):

    - a chunk of one whole request (``q`` queries, ``n`` keys, ``q n <= X``): ``q n`` cells, the most
      ``max_n n min(tokens(n), T, X // n)`` (``min(...) >= q0``);
    - a chunk of ``r >= 2`` requests: ``M`` queries, longest window ``n_max <= L // C``, with ``M N <= X``,
      ``N <= K`` and ``N >= n_max + (r - 1) n_min`` (the other requests as short as allowed), and ``r`` requests
      of at most ``n_max`` keys must hold the ``M`` queries (``r tokens(n_max) >= M``): for each ``M`` and ``r``
      the largest such ``n_max``;
    - a query piece of a request split by the planner: at most its ``max(1, X // n)`` queries times ``n`` (the
      uncompressed piece, an upper bound: the first pieces' windows are shorter).
    """
    u = _Units(lim)
    if not u.any or u.n_min > u.Lc:
        return 0
    T, S, K, X, q0, Lc = u.T, u.S, u.K, u.cap, u.q0, u.Lc
    best = 0
    n = torch.arange(max(1, u.n_min), Lc + 1, dtype=torch.int64)
    qmax = torch.clamp(u.tokens(n), max=T)
    q = torch.minimum(qmax, X // n)
    whole = torch.where(q >= q0, q * n, 0)
    split = qmax * n > X  # the planner splits a request of qmax queries: pieces of max(1, X // n) queries
    if n.numel():
        best = max(best, int(whole.max()))
        if bool(split.any()):
            best = max(best, int(torch.where(split, torch.clamp(X // n, min=1) * n, 0).max()))
    # with C = 1 a chunk has N >= M keys, so M <= isqrt(X) and M <= K
    hi = min(T, math.isqrt(X), K) if u.c == 1 else T
    if hi >= 2 * q0 and S >= 2:
        m = torch.arange(2 * q0, hi + 1, dtype=torch.int64)
        for r in range(2, min(S, hi // q0) + 1):
            others = (r - 1) * u.n_min
            nmax = torch.clamp(X // m - others, max=min(Lc, K - others))
            ok = (r * q0 <= m) & (nmax >= max(1, u.n_min)) & (u.tokens(nmax) * r >= m)
            if bool(ok.any()):
                best = max(best, int(torch.where(ok, m * nmax, 0).max()))
    return best


def prefill_logits_cells(lim: IndexerLimits) -> int:
    """Most logits cells of one prefill chunk under ``lim``: :func:`prefill_extremes` (``M x N``), or
    :func:`compressed_prefill_logits` with ``IndexerLimits.compressed_prefill_logits``."""
    return compressed_prefill_logits(lim) if lim.compressed_prefill_logits else prefill_extremes(lim).logits


def logits_elems(lim: IndexerLimits) -> int:
    """Elements (of ``IndexerLimits.logits_dtype``) of the flat ``logits`` field: the larger of the biggest prefill
    chunk (:func:`prefill_logits_cells`) and one decode sub-batch, ``decode_batch_rows x max_keys``."""
    return max(prefill_logits_cells(lim), lim.decode_batch_rows * lim.max_keys)


# name -> (shape function of the limits, dtype function of the limits); a shape of None means "absent".
# A top-k backend that needs scratch declares its width in the backend registry (topk_scratch below). Every size
# is the largest that some step allowed by the limits uses (tests/buffers/test_plan_tight.py).
FIELDS = {
    # the gathered keys of one prefill chunk: D FP8 values and a float32 scale per key, or with an MXFP4 cache
    # D / 2 value bytes and D / 32 scale bytes (docs/spec.md §3a)
    "k_fp8": (
        lambda lim: (prefill_extremes(lim).keys, lim.head_dim // 2 if lim.mxfp4 else lim.head_dim),
        lambda lim: torch.uint8 if lim.mxfp4 else lim.cache.fp8_dtype,
    ),
    "k_scale": (
        lambda lim: (prefill_extremes(lim).keys, lim.head_dim // 32) if lim.mxfp4 else (prefill_extremes(lim).keys,),
        lambda lim: torch.uint8 if lim.mxfp4 else torch.float32,
    ),
    "logits": (lambda lim: (logits_elems(lim),), lambda lim: lim.logits_dtype),
    # decode only, one sub-batch at a time
    "qk": (
        lambda lim: (lim.n_heads, lim.decode_batch_rows, lim.max_keys) if lim.with_qk else None,
        lambda lim: torch.float32,
    ),
    # Non-uniform decode (requests with fewer than next_n new tokens) packs queries, weights and top-k rows
    # into [max_num_seqs, next_n] slots (docs/spec.md §7, step 4); only needed when next_n > 1. Every decode request of
    # the step is packed at once (sub-batches then read slices), so these hold all max_num_seqs * next_n rows.
    "q_pack": (
        lambda lim: (lim.max_decode_rows, lim.n_heads, lim.head_dim // 2 if lim.mxfp4 else lim.head_dim)
        if lim.next_n > 1 else None,
        lambda lim: torch.uint8 if lim.mxfp4 else lim.fp8_dtype,
    ),
    # MXFP4 queries' scale bytes, packed like q_pack
    "q_scale_pack": (
        lambda lim: (lim.max_decode_rows, lim.n_heads, lim.head_dim // 32) if lim.next_n > 1 and lim.mxfp4 else None,
        lambda lim: torch.uint8,
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
    # Two-level indexer (candidate_blocks > 0 only): the source layer's block scores of one chunk or decode
    # sub-batch (select_candidate_blocks' workspace), and the packed candidate rows of a non-uniform decode.
    "block_scores": (
        lambda lim: (block_scores_elems(lim),) if lim.candidate_blocks else None,
        lambda lim: torch.int32,
    ),
    "cand_pack": (
        lambda lim: (lim.max_decode_rows, lim.candidate_blocks) if lim.candidate_blocks and lim.next_n > 1 else None,
        lambda lim: torch.int32,
    ),
    # Context parallel (world_size > 1 only): candidates, gathered candidates and merge of one piece of rows
    # (sparse_indexer.parallel).
    "cp_scratch": (
        _cp_scratch_shape,
        lambda lim: torch.int32,
    ),
}


def block_scores_elems(lim: IndexerLimits) -> int:
    """int32 cells of the flat ``block_scores`` field (two-level indexer, ``IndexerLimits.candidate_blocks > 0``):
    one score per candidate block of one ``select_candidate_blocks`` call, ``rows * ceil(cols / b)``, at most for
    a decode sub-batch ``decode_batch_rows * ceil(max_keys / b)`` and for a prefill chunk of ``M`` rows and
    ``M * N <= prefill_logits_cells`` cells ``ceil((M * N + M * (b - 1)) / b)`` with ``M <= max_num_batched_tokens``
    (an upper bound: a chunk with the most cells need not have the most rows)."""
    b = lim.candidate_block_size
    # (context parallel: a rank's decode rows are ceil(ceil(max_keys / bs) / W) * bs wide, at most one block more
    # than max_keys / W, which exceeds max_keys only for contexts of a block or two)
    blocks = -(-lim.max_keys // lim.block_size)
    per_rank = -(-blocks // lim.world_size) * lim.block_size
    decode = lim.decode_batch_rows * -(-max(lim.max_keys, per_rank) // b)
    cells = prefill_logits_cells(lim)
    rows = min(lim.max_num_batched_tokens, cells)
    return max(decode, -(-(cells + rows * (b - 1)) // b))


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
    ``limits.with_qk``; ``q_pack``, ``w_pack``, ``topk_pack`` when ``next_n == 1``; ``q_scale_pack`` unless the
    cache is MXFP4 and ``next_n > 1``; ``topk_scratch`` when no
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
