"""Host-side planning of one indexer step: the decode/prefill split and the prefill chunks (docs/spec.md §7, §8).

Everything here runs on the host, once per engine step (shared by every layer), and produces small device
tensors; the step itself (:func:`sparse_indexer.sparse_attn_indexer`) then reads only host integers and these
tensors, so it never synchronises with the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from buffers import IndexerLimits

from ._runtime import checks as C

__all__ = [
    "ChunkPlan", "PrefillChunk", "DecodeMetadata", "IndexerMetadata", "plan_prefill_chunks", "build_metadata",
    "pack_decode",
]


@attrs.frozen
class ChunkPlan:
    """One prefill chunk: requests ``[req_start, req_end)`` (prefill-local indices) and, within the chunk's
    concatenated queries, rows ``[query_start, query_end)``."""

    req_start: int
    req_end: int
    query_start: int
    query_end: int


def _ints(name: str, xs) -> list[int]:
    if isinstance(xs, torch.Tensor):
        xs = xs.tolist()
    out = [int(x) for x in xs]
    for i, x in enumerate(out):
        if x < 0:
            raise ValueError(f"{name}[{i}] = {x} must be >= 0")
    return out


def plan_prefill_chunks(seq_lens: Sequence[int], query_lens: Sequence[int], k_tokens_cap: int,
                        logits_elems_cap: int) -> list[ChunkPlan]:
    """Split prefill requests into chunks that bound gathered keys and logits (docs/spec.md §8). Pure, host integers.

    Whole requests are added greedily, in order, while ``sum(seq_len) <= k_tokens_cap`` and
    ``sum(query_len) * sum(seq_len) <= logits_elems_cap``. A request whose ``query_len * seq_len`` alone
    exceeds the logits cap forms chunks alone, split along its queries into pieces of
    ``max(1, logits_elems_cap // seq_len)``. A request with ``seq_len > k_tokens_cap`` raises ``ValueError``.

    Example: ``plan_prefill_chunks([10, 10, 10], [5, 5, 5], 100, 250)`` ->
    ``[ChunkPlan(0, 2, 0, 10), ChunkPlan(2, 3, 0, 5)]``.
    """
    seq = _ints("seq_lens", seq_lens)
    qry = _ints("query_lens", query_lens)
    if len(seq) != len(qry):
        raise ValueError(f"seq_lens has {len(seq)} entries but query_lens has {len(qry)}")
    if k_tokens_cap < 1 or logits_elems_cap < 1:
        raise ValueError(f"caps must be >= 1, got {k_tokens_cap=} {logits_elems_cap=}")
    chunks: list[ChunkPlan] = []
    start, s_sum, q_sum = 0, 0, 0

    def close(end: int) -> None:
        if end > start:
            chunks.append(ChunkPlan(start, end, 0, q_sum))

    for i, (s, q) in enumerate(zip(seq, qry)):
        if s > k_tokens_cap:
            raise ValueError(
                f"prefill request {i} has seq_len {s} > k_tokens_cap {k_tokens_cap}: it cannot be gathered "
                f"(IndexerLimits guarantees prefill_k_tokens >= max_model_len; is seq_len > max_model_len?)"
            )
        if q * s > logits_elems_cap:
            close(i)
            piece = max(1, logits_elems_cap // max(1, s))
            for q0 in range(0, q, piece):
                chunks.append(ChunkPlan(i, i + 1, q0, min(q, q0 + piece)))
            start, s_sum, q_sum = i + 1, 0, 0
            continue
        if i > start and (s_sum + s > k_tokens_cap or (q_sum + q) * (s_sum + s) > logits_elems_cap):
            close(i)
            start, s_sum, q_sum = i, 0, 0
        s_sum += s
        q_sum += q
    close(len(seq))
    return chunks


@attrs.frozen(eq=False, kw_only=True)
class PrefillChunk:
    """Device tensors and host sizes of one prefill chunk.

    Attributes:
        token_start, token_end: rows of the step's tokens (``q_fp8``, ``topk_out``) this chunk scores.
        num_k_tokens: keys gathered for the chunk (``cu_seq_lens[-1]``; compressed entries with
            ``compress_ratio > 1``).
        gather: ``False`` when the keys are already in the buffers (a later query piece of a split request).
        block_table: ``[R_c, max_blocks]`` int32 — the chunk's requests.
        cu_seq_lens: ``[R_c + 1]`` int32 — gathered key offsets.
        cu_seqlen_ks, cu_seqlen_ke: ``[token_end - token_start]`` int32 — each query's key window
            ``[ks, ke)`` in the gathered keys (causal). DeepGEMM's names: per-query window bounds, not
            cumulative sums (``cu_seq_lens`` is the cumulative one).
        window: ``None`` (full ``[M, num_k_tokens]`` logits), or with ``IndexerLimits.compressed_prefill_logits``
            the compressed width (the chunk's longest window, docs/spec.md §5), with ``window_starts`` (zeros)
            and ``window_ends`` (``ke - ks``), ``[token_end - token_start]`` int32: the top-k bounds of
            compressed rows.
        seq_lens: the host key count of each of the chunk's requests (``R_c`` ints, summing to
            ``num_k_tokens``) where the builder knows them (``build_metadata`` does), else ``None``; context
            parallel sharding derives each rank's local key count from them without reading the device.
    """

    token_start: int
    token_end: int
    num_k_tokens: int
    gather: bool
    block_table: torch.Tensor
    cu_seq_lens: torch.Tensor
    cu_seqlen_ks: torch.Tensor
    cu_seqlen_ke: torch.Tensor
    window: int | None = None
    window_starts: torch.Tensor | None = None
    window_ends: torch.Tensor | None = None
    seq_lens: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def logits_cols(self) -> int:
        """Columns of the chunk's logits: ``window`` (compressed) or ``num_k_tokens``."""
        return self.num_k_tokens if self.window is None else self.window

    @property
    def topk_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row_starts, row_ends)`` of the chunk's top-k: ``(ks, ke)``, or ``(0, ke - ks)`` compressed."""
        if self.window is None:
            return self.cu_seqlen_ks, self.cu_seqlen_ke
        return self.window_starts, self.window_ends

    def __attrs_post_init__(self):
        # checked once per step here, so the step's per-layer ops need not (docs/spec.md §7)
        m = self.token_end - self.token_start
        C.tensor("prefill chunk block_table", self.block_table, ndim=2, dtypes=C.INDEX_DTYPES, last_contiguous=True)
        dev = self.block_table.device
        C.tensor("prefill chunk cu_seq_lens", self.cu_seq_lens, dtypes=C.INDEX_DTYPES, device=dev,
                 shape=(self.block_table.shape[0] + 1,), contiguous=True)
        C.tensor("prefill chunk cu_seqlen_ks", self.cu_seqlen_ks, dtypes=C.INDEX_DTYPES, device=dev, shape=(m,),
                 contiguous=True)
        C.tensor("prefill chunk cu_seqlen_ke", self.cu_seqlen_ke, dtypes=C.INDEX_DTYPES, device=dev, shape=(m,),
                 contiguous=True)
        if self.seq_lens is not None and (len(self.seq_lens) != self.block_table.shape[0]
                                          or sum(self.seq_lens) != self.num_k_tokens
                                          or min(self.seq_lens, default=0) < 0):
            raise ValueError(f"prefill chunk seq_lens {list(self.seq_lens)[:8]} must be {self.block_table.shape[0]} "
                             f"non-negative key counts summing to num_k_tokens = {self.num_k_tokens}")
        if self.window is not None:
            if not 0 <= self.window <= self.num_k_tokens:
                raise ValueError(f"prefill chunk window = {self.window} must be in [0, num_k_tokens = "
                                 f"{self.num_k_tokens}]")
            for name in ("window_starts", "window_ends"):
                C.tensor(f"prefill chunk {name}", getattr(self, name), dtypes=C.INDEX_DTYPES, device=dev,
                         shape=(m,), contiguous=True)
            if dev.type == "cpu" and m:  # values on the host only (a device read would sync)
                if int(self.window_starts.min()) < 0 or int(self.window_ends.max()) > self.window:
                    raise ValueError(f"prefill chunk top-k windows must lie in [0, window = {self.window}) "
                                     f"of the compressed logits")


@attrs.frozen(eq=False, kw_only=True)
class DecodeMetadata:
    """Decode requests of one step (docs/spec.md §7, step 4).

    Attributes:
        num_reqs: ``B``.
        next_n: decode slots per request.
        uniform: every request has exactly ``next_n`` new tokens: queries reshape to ``[B, next_n, H, D]``.
        width: ``W``, columns of the decode logits view (static: ``limits.max_keys``).
        context_lens: ``[B]`` int32 (uniform: row ``j`` sees ``context_lens[b] - next_n + j + 1`` keys) or
            ``[B, next_n]`` int32 (each row's keys: packed, where padded slots hold 0, or compressed windows).
        block_table: ``[B, max_blocks]`` int32.
        row_starts, row_ends: ``[B * next_n]`` int32 — top-k windows ``[0, limit)`` of every slot.
        pack_src: ``[B * next_n]`` int64 or ``None`` — token row feeding each packed slot (padding repeats a
            real row, its window is empty).
        unpack_src: ``[num_decode_tokens]`` int64 or ``None`` — packed slot of each real decode token.
    """

    num_reqs: int
    next_n: int
    uniform: bool
    width: int
    context_lens: torch.Tensor
    block_table: torch.Tensor
    row_starts: torch.Tensor
    row_ends: torch.Tensor
    pack_src: torch.Tensor | None
    unpack_src: torch.Tensor | None

    @property
    def num_rows(self) -> int:
        return self.num_reqs * self.next_n

    def __attrs_post_init__(self):
        # checked once per step here, so the step's per-layer ops need not (docs/spec.md §7)
        b, rows = self.num_reqs, self.num_reqs * self.next_n
        C.tensor("decode block_table", self.block_table, ndim=2, dtypes=C.INDEX_DTYPES, shape=(b, None),
                 last_contiguous=True)
        dev = self.block_table.device
        C.tensor("decode context_lens", self.context_lens, dtypes=C.INDEX_DTYPES, device=dev,
                 shape=(b,) if self.context_lens.dim() == 1 else (b, self.next_n), contiguous=True)
        C.tensor("decode row_starts", self.row_starts, dtypes=C.INDEX_DTYPES, device=dev, shape=(rows,),
                 contiguous=True)
        C.tensor("decode row_ends", self.row_ends, dtypes=C.INDEX_DTYPES, device=dev, shape=(rows,), contiguous=True)
        for name in ("pack_src", "unpack_src"):
            if getattr(self, name) is not None:
                C.tensor(f"decode {name}", getattr(self, name), ndim=1, dtypes=torch.int64, device=dev)


@attrs.frozen(eq=False, kw_only=True)
class IndexerMetadata:
    """Everything one step needs besides the tensors of the layer (built by :func:`build_metadata`).

    Tokens are ordered decode first: rows ``[0, num_decode_tokens)`` are decode tokens, the next
    ``num_prefill_tokens`` rows prefill tokens.
    """

    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode: DecodeMetadata | None
    prefill_chunks: tuple[PrefillChunk, ...]
    limits: IndexerLimits
    num_blocks: int | None = None  # the cache size block ids and slots were checked against (None: unchecked)
    # prefill token rows no chunk scores ([start, end) spans): chunks without any key (compress_ratio > 1, every
    # request shorter than C tokens); the step fills their topk_out rows with -1
    empty_rows: tuple[tuple[int, int], ...] = ()
    # what the step proved about this record once (sparse_indexer.indexer._StepPlan per buffers record, backend
    # and step kind): every layer of the step shares the record, so only the layer's own tensors are checked per
    # layer (host overhead per layer). Not an argument; a copy (attrs.evolve) starts empty.
    _step_memo: dict = attrs.field(factory=dict, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def device(self) -> torch.device:
        """The device of every tensor of the record (checked when it is built)."""
        return self.slot_mapping.device

    def __attrs_post_init__(self):
        # checked once per step here, so the step's per-layer ops need not (docs/spec.md §7)
        C.tensor("slot_mapping", self.slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), contiguous=True)
        for a, b in self.empty_rows:
            if not self.num_decode_tokens <= a <= b <= self.num_tokens:
                raise ValueError(f"empty_rows span [{a}, {b}) must lie in the prefill rows [{self.num_decode_tokens}, "
                                 f"{self.num_tokens})")
        dev = self.slot_mapping.device
        parts = ([("decode", self.decode.block_table)] if self.decode is not None else []) + [
            ("prefill chunk", c.block_table) for c in self.prefill_chunks]
        for name, t in parts:
            if t.device != dev:
                raise ValueError(f"the {name} tensors are on {t.device} but slot_mapping is on {dev}: metadata "
                                 "tensors must share one device")

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the record by name (what the step reads besides the layer's tensors)."""
        out = {"slot_mapping": self.slot_mapping}
        dm = self.decode
        if dm is not None:
            out.update({"decode.block_table": dm.block_table, "decode.context_lens": dm.context_lens,
                        "decode.row_starts": dm.row_starts, "decode.row_ends": dm.row_ends})
            if dm.pack_src is not None:
                out["decode.pack_src"], out["decode.unpack_src"] = dm.pack_src, dm.unpack_src
        for i, c in enumerate(self.prefill_chunks):
            out.update({f"prefill_chunks[{i}].block_table": c.block_table,
                        f"prefill_chunks[{i}].cu_seq_lens": c.cu_seq_lens,
                        f"prefill_chunks[{i}].cu_seqlen_ks": c.cu_seqlen_ks,
                        f"prefill_chunks[{i}].cu_seqlen_ke": c.cu_seqlen_ke})
            if c.window is not None:
                out.update({f"prefill_chunks[{i}].window_starts": c.window_starts,
                            f"prefill_chunks[{i}].window_ends": c.window_ends})
        return out


def _i32(xs, device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32, device=device)


def pack_decode(seq_lens: torch.Tensor, decode_lens: torch.Tensor, next_n: int,
                num_rows: int, compress_ratio: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed ``[B, next_n]`` decode grid of requests with ``decode_lens[b] <= next_n`` tokens each, with device
    tensor ops only (no host sync; :func:`build_metadata` and the vLLM shim both build their decode metadata with it).

    ``seq_lens [B]`` and ``decode_lens [B]`` (integer, one device): request ``b`` has ``seq_lens[b]`` tokens, its
    last ``decode_lens[b]`` tokens are this step's (consecutive token rows, request after request). Token ``j <
    decode_lens[b]`` of request ``b`` becomes slot ``b * next_n + j`` with the window ``[0, (seq_lens[b] -
    decode_lens[b] + j + 1) // compress_ratio)`` (docs/spec.md §7; the token's position is ``seq_lens[b] -
    decode_lens[b] + j``); slots past a request's tokens have empty windows and repeat its
    last token (row 0 for a request without tokens). ``num_rows`` token rows are unpacked; rows past the real
    tokens (padding) read the first empty slot, whose top-k row is all -1.

    Returns ``(context_lens [B, next_n] int32, pack_src [B * next_n] int64, unpack_src [num_rows] int64)``;
    ``context_lens`` flattened is the slots' ``row_ends``.
    """
    dev = seq_lens.device
    b = seq_lens.shape[0]
    dl = decode_lens.to(dev).long()
    full = seq_lens.long()
    j = torch.arange(next_n, device=dev)[None, :]
    lim = torch.where(j < dl[:, None], (full - dl)[:, None] + j + 1, 0).clamp(min=0)
    if compress_ratio != 1:
        lim = torch.div(lim, compress_ratio, rounding_mode="floor")
    ends = torch.cumsum(dl, 0)
    starts = ends - dl
    pack_src = torch.where(dl[:, None] > 0, starts[:, None] + torch.minimum(j, (dl - 1).clamp(min=0)[:, None]), 0)
    t = torch.arange(num_rows, device=dev)
    req = torch.searchsorted(ends, t, right=True)  # == b for the padding tokens t >= sum(decode_lens)
    is_real = req < b
    req = req.clamp(max=b - 1)
    empty_slot = torch.argmax((lim.reshape(-1) == 0).to(torch.int32))  # first slot with an empty window
    unpack_src = torch.where(is_real, req * next_n + t - starts[req], empty_slot)
    return lim.to(torch.int32), pack_src.reshape(-1), unpack_src


def _check_blocks_and_slots(seq: list[int], qry: list[int], bt: torch.Tensor, sm: torch.Tensor, bs: int,
                            num_blocks: int | None, c: int = 1) -> None:
    """Host checks of the block ids and slots of one step (``bt``, ``sm``: CPU tensors), docs/spec.md §7.

    With ``num_blocks``: every block id a request uses (its first ``ceil(keys / block_size)`` entries, ``keys =
    seq_len // c``) lies in ``[0, num_blocks)`` and every slot below ``num_blocks * block_size``. Always: every
    slot is negative (no write) or the slot of the token's key: token ``j`` of request ``i`` sits at position
    ``p = seq_len - query_len + j``; with ``c = compress_ratio`` 1 its key is entry ``e = p``, with ``c > 1`` it
    writes entry ``e = p // c`` only when ``(p + 1) % c == 0`` (any other token's slot must be negative); the
    slot is ``block_table[i, e // bs] * bs + e % bs`` through a block id ``>= 0``. A slot anywhere else would
    write a key where no request reads it, or over another key. The slot check reads one block-table entry per
    token; the block-range check, the used part of the table (``num_blocks`` only)."""
    n_req = len(seq)
    if num_blocks is not None and n_req:
        nblk = torch.tensor([(s // c + bs - 1) // bs for s in seq], dtype=torch.long)
        width = int(nblk.max())
        if width:
            # per row over the widest row's blocks first (one pass); only rows out of range there are read again
            # up to their own block count (padding past a row's blocks may hold anything)
            lo, hi = bt[:, :width].amin(1), bt[:, :width].amax(1)
            for r in ((lo < 0) | (hi >= num_blocks)).nonzero()[:, 0].tolist():
                row = bt[r, : int(nblk[r])]
                if not row.numel():
                    continue
                rlo, rhi = row.aminmax()
                if int(rlo) < 0 or int(rhi) >= num_blocks:
                    col = int(((row < 0) | (row >= num_blocks)).nonzero()[0, 0])
                    raise ValueError(f"block_table[{r}, {col}] = {int(row[col])} (a block request {r} uses) is "
                                     f"outside [0, num_blocks={num_blocks})")
    if not sm.numel():
        return
    sm = sm.long()
    if num_blocks is not None and int(sm.max()) >= num_blocks * bs:
        t = int(sm.argmax())
        raise ValueError(f"slot_mapping[{t}] = {int(sm[t])} >= num_blocks * block_size = {num_blocks * bs}")
    q = torch.tensor(qry, dtype=torch.long)
    req = torch.repeat_interleave(torch.arange(n_req), q)  # the request of each token
    first = torch.cumsum(q, 0) - q
    pos = torch.tensor(seq, dtype=torch.long)[req] - q[req] + (torch.arange(sm.numel()) - first[req])
    writes = sm >= 0
    if c > 1:
        keyless = writes & ((pos + 1) % c != 0)
        if bool(keyless.any()):
            t = int(keyless.nonzero()[0, 0])
            raise ValueError(
                f"slot_mapping[{t}] = {int(sm[t])}, but token {t} (request {int(req[t])}'s position {int(pos[t])}) "
                f"ends no group of compress_ratio={c} tokens: only positions p with (p + 1) % {c} == 0 write a key "
                "(compressed_slot_mapping makes the slots); every other token's slot must be negative")
    ent = torch.where(writes, pos // c, 0)  # (a token that writes nothing may sit past the table's last key)
    blk = bt[req, ent // bs].long()
    bad = writes & ((blk < 0) | (sm != blk * bs + ent % bs))
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        r, p, e = int(req[t]), int(pos[t]), int(ent[t])
        what = f"is request {r}'s position {p}" if c == 1 else f"writes request {r}'s key {e} (position {p})"
        if int(blk[t]) < 0:
            key = f"position {p}" if c == 1 else f"key {e} (position {p})"
            raise ValueError(f"block_table[{r}, {e // bs}] = {int(blk[t])} (the block of request {r}'s {key}, which "
                             f"slot_mapping[{t}] writes) is negative")
        raise ValueError(
            f"slot_mapping[{t}] = {int(sm[t])}, but token {t} {what}, whose slot is "
            f"block_table[{r}, {e // bs}] * {bs} + {e % bs} = {int(blk[t]) * bs + e % bs} (or negative: no write): a "
            "key written elsewhere is read by no request, or overwrites another key")


def build_metadata(seq_lens, query_lens, block_table: torch.Tensor, slot_mapping: torch.Tensor,
                   limits: IndexerLimits, *, device: torch.device | str | None = None,
                   num_blocks: int | None = None, decode_width: int | None = None) -> IndexerMetadata:
    """Plan one step on the host.

    Lengths are in tokens whatever ``limits.compress_ratio`` (``C``) is; with ``C > 1`` the record holds the
    compressed windows (docs/spec.md §4a): a request of ``L`` tokens has ``L // C`` keys, its token at position
    ``p`` sees keys ``[0, (p + 1) // C)``.

    Args:
        seq_lens: per request, its context length in tokens including this step's new tokens (host ints or CPU
            tensor).
        query_lens: per request, this step's new tokens. Requests with ``query_len <= next_n`` are decode
            requests and must all come first (decode-first order, as the tokens).
        block_table: ``[num_reqs, max_blocks]`` int32, the requests' K-cache blocks (``block_size`` keys each).
        slot_mapping: ``[sum(query_lens)]`` int64 (int32 accepted; the record keeps int64) cache slots of the new
            tokens' keys: negative (-1: do not write) or the slot the block table gives the token's key (``C >
            1``: only tokens with ``(p + 1) % C == 0`` write one, key ``p // C``;
            :func:`sparse_indexer.compressed_slot_mapping` makes them), checked on the host whenever the values
            are there to read (``num_blocks`` given, or ``block_table`` and ``slot_mapping`` on the CPU).
        limits: the engine's :class:`IndexerLimits` (``next_n``, ``compress_ratio``, caps of the prefill chunks,
            ``max_model_len``).
        device: where the metadata tensors live (default: ``block_table``'s device).
        num_blocks: the K cache's block count: every block id in use and every slot are checked against it, and
            the step checks that its cache holds at least that many blocks. Without it the step can check ids
            only for CPU caches (on a GPU that would synchronise); pass it.
        decode_width: columns of the decode logits (default and most ``limits.max_keys``).

    Raises ``ValueError`` on inconsistent input (naming the request) before producing anything: every
    ``query_len <= seq_len``, decode requests first, the limits (tokens, requests, ``max_model_len``, the block
    table's width, ``decode_width``), and block ids and slots as above.

    Prefill chunks whose requests have no key at all (every request shorter than ``C`` tokens) run no kernel:
    their rows are the record's ``empty_rows``, which the step fills with -1.

    **One step only.** The record describes this step's lengths, windows and slots. Reusing it for the next
    step is an error that nothing can detect when the new tensors have the same shapes (a decode step where every
    request grew by one token): the windows stop one key short of the new token, and the step writes the new keys
    into the previous step's slots, over the keys of the tokens there, so later steps read wrong keys: silent
    wrong selection and a corrupted cache. Build the metadata anew every step; with CUDA graphs, copy the new
    step's values into the captured metadata tensors (as the vLLM shim does). What the step can check cheaply it
    does: the rows of ``q_fp8``, ``k`` and ``topk_out`` against the record's token count, the cache's block
    count against ``num_blocks``, and every buffer the record's chunks and decode rows need.
    """
    seq = _ints("seq_lens", seq_lens)
    qry = _ints("query_lens", query_lens)
    n_req = len(seq)
    if len(qry) != n_req:
        raise ValueError(f"seq_lens has {n_req} entries but query_lens has {len(qry)}")
    C.tensor("block_table", block_table, ndim=2, dtypes=torch.int32)
    C.tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32))
    if block_table.shape[0] < n_req:
        raise ValueError(f"block_table has {block_table.shape[0]} rows but there are {n_req} requests")
    device = torch.device(device) if device is not None else block_table.device
    nn, bs, cr = limits.next_n, limits.block_size, limits.compress_ratio
    width = limits.max_keys if decode_width is None else int(decode_width)
    num_tokens = sum(qry)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries but sum(query_lens) = {num_tokens}")
    if num_tokens > limits.max_num_batched_tokens:
        raise ValueError(f"the step has {num_tokens} tokens > max_num_batched_tokens={limits.max_num_batched_tokens}")

    num_decodes = 0
    while num_decodes < n_req and qry[num_decodes] <= nn:
        num_decodes += 1
    for i in range(num_decodes, n_req):
        if qry[i] <= nn:
            raise ValueError(
                f"request {i} (query_len {qry[i]} <= next_n {nn}) is a decode request after a prefill request: "
                "order requests (and tokens) decode first"
            )
    for i in range(n_req):
        if seq[i] < qry[i]:
            kind = "decode" if i < num_decodes else "prefill"
            raise ValueError(f"{kind} request {i}: query_len {qry[i]} > seq_len {seq[i]} (seq_len counts the "
                             "request's whole context, this step's tokens included)")
    if n_req > limits.max_num_seqs:
        raise ValueError(f"the step has {n_req} requests > max_num_seqs={limits.max_num_seqs} (the buffer plan "
                         "sizes the prefill key gather and the decode rows by it)")
    for i, s in enumerate(seq):
        if s > limits.max_model_len:
            raise ValueError(f"request {i}: seq_len {s} > max_model_len={limits.max_model_len}")
        if s // cr > block_table.shape[1] * bs:
            keys = f"{s // cr} keys" if cr > 1 else f"seq_len {s}"
            raise ValueError(f"request {i}: {keys} need more than the {block_table.shape[1]} blocks of "
                             f"block_table (block_size {bs})")
    if width > limits.max_keys:
        raise ValueError(f"decode_width {width} > max_keys={limits.max_keys} (the decode logits are planned "
                         "max_model_len // compress_ratio wide)")
    if num_decodes and width < max(seq[:num_decodes]) // cr:
        raise ValueError(f"decode_width {width} < the longest decode context's {max(seq[:num_decodes]) // cr} keys")

    if num_blocks is not None or (block_table.device.type == "cpu" and slot_mapping.device.type == "cpu"):
        _check_blocks_and_slots(seq, qry, block_table[:n_req].cpu(), slot_mapping.cpu(), bs, num_blocks, cr)

    num_decode_tokens = sum(qry[:num_decodes])
    bt = block_table.to(device)
    decode = None
    if num_decode_tokens:
        # decode requests with tokens in this step (a request with query_len 0 has no rows at all)
        dec = [i for i in range(num_decodes) if qry[i] > 0]
        d_lens = [qry[i] for i in dec]
        d_seq = [seq[i] for i in dec]
        nd = len(dec)
        uniform = all(d == nn for d in d_lens)
        pack_src = unpack_src = None
        if uniform:
            ends = [max(0, d_seq[b] - nn + j + 1) // cr for b in range(nd) for j in range(nn)]
            row_ends = _i32(ends, device)
            # [B] context lengths (row j sees L - next_n + j + 1 keys); compressed windows need one per row
            # ([B, next_n]; [B] at next_n 1, where the two agree)
            if cr == 1:
                ctx = _i32(d_seq, device)
            else:
                ctx = _i32(ends, device) if nn == 1 else _i32(ends, device).view(nd, nn)
        else:  # built on the host's CPU, then copied (one copy per tensor, as for the other fields)
            lim, pack_src, unpack_src = pack_decode(torch.tensor(d_seq), torch.tensor(d_lens), nn, num_decode_tokens,
                                                    cr)
            ctx, row_ends = lim.to(device), lim.reshape(-1).to(device, copy=True)  # two tensors, as above
            pack_src, unpack_src = pack_src.to(device), unpack_src.to(device)
        dec_bt = bt[:num_decodes] if nd == num_decodes else bt[torch.tensor(dec, device=device)]
        decode = DecodeMetadata(
            num_reqs=nd, next_n=nn, uniform=uniform, width=width, context_lens=ctx,
            block_table=dec_bt, row_starts=torch.zeros(nd * nn, dtype=torch.int32, device=device),
            row_ends=row_ends, pack_src=pack_src, unpack_src=unpack_src,
        )

    chunks, empty = [], []
    p_seq, p_qry = seq[num_decodes:], qry[num_decodes:]
    p_keys = [s // cr for s in p_seq]
    plans = plan_prefill_chunks(p_keys, p_qry, limits.prefill_k_tokens, limits.prefill_logits_elems)
    q_offsets = [num_decode_tokens]
    for q in p_qry:
        q_offsets.append(q_offsets[-1] + q)
    prev = None
    for cp in plans:
        reqs = range(cp.req_start, cp.req_end)
        cu = [0]
        ks, ke = [], []
        for r in reqs:
            first = p_seq[r] - p_qry[r]  # position of the request's first new token
            for j in range(p_qry[r]):
                ks.append(cu[-1])
                ke.append(cu[-1] + (first + j + 1) // cr)
            cu.append(cu[-1] + p_keys[r])
        ks, ke = ks[cp.query_start : cp.query_end], ke[cp.query_start : cp.query_end]
        t0 = q_offsets[cp.req_start] + cp.query_start
        if cu[-1] == 0:  # no key in the chunk: every row is -1, no kernel runs (as vLLM drops such chunks)
            empty.append((t0, t0 + len(ks)))
            prev = cp
            continue
        gather = not (prev is not None and prev.req_start == cp.req_start and prev.req_end == cp.req_end)
        a, b = num_decodes + cp.req_start, num_decodes + cp.req_end
        win = {}
        if limits.compressed_prefill_logits:  # compressed [M, longest window] logits (docs/spec.md §5)
            lens = [e - s for s, e in zip(ks, ke)]
            win = dict(window=max(lens, default=0), window_starts=_i32([0] * len(lens), device),
                       window_ends=_i32(lens, device))
        chunks.append(PrefillChunk(
            token_start=t0, token_end=t0 + len(ks), num_k_tokens=cu[-1], gather=gather, block_table=bt[a:b],
            cu_seq_lens=_i32(cu, device), cu_seqlen_ks=_i32(ks, device), cu_seqlen_ke=_i32(ke, device), **win,
            seq_lens=tuple(p_keys[r] for r in reqs),
        ))
        prev = cp
    return IndexerMetadata(
        num_decodes=num_decodes, num_decode_tokens=num_decode_tokens, num_prefills=n_req - num_decodes,
        num_prefill_tokens=num_tokens - num_decode_tokens, slot_mapping=slot_mapping.to(device, torch.int64),
        decode=decode, prefill_chunks=tuple(chunks), limits=limits, num_blocks=num_blocks,
        empty_rows=_merge_rows(empty),
    )


def _merge_rows(spans: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Adjacent ``[start, end)`` row spans merged (one fill per run of key-less chunks)."""
    out: list[tuple[int, int]] = []
    for a, b in spans:
        if b <= a:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)
