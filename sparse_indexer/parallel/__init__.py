"""Context parallel: one request's keys over ``world_size`` ranks, exact top-k through ``torch.distributed``
(docs/spec.md §11).

Pure functions over an explicit process group (NCCL on GPUs, gloo on the CPU); no global state, no hidden
buffers (the candidates and the merge live in ``Buffers.cp_scratch``, planned when
``IndexerLimits.world_size > 1``).

Sharding: interleaved by cache block. Block ``j`` of a request (its keys ``[j * bs, (j + 1) * bs)``) lives on
rank ``j % world_size``; the request's block table row lists, in column ``j``, the id of that block in the cache of
its rank. Rank ``r``'s local keys of a request are the concatenation of its blocks ``r, r + W, r + 2W, ...``, so
local position ``p`` is global position ``((p // bs) * W + r) * bs + p % bs``, and a request of ``n`` keys has
:func:`local_lens` ``(n)`` of them on rank ``r`` (the last, partial block counts on its owner only). vLLM's
decode context parallel interleaves by token by default (``cp_kv_cache_interleave_size = 1``, token ``t`` on rank
``t % W``) and lets the interleave size grow up to the block size. We use whole blocks: each rank's keys stay
whole pages of an ordinary paged cache, so the existing paged logits op, the gather and the cache write run
unchanged on a rank's own block table; the imbalance is at most one block per request (``bs`` keys), which is
nothing next to the 128K-1M-key contexts context parallel is for.

A step (:func:`cp_decode`, :func:`cp_prefill`, :func:`cp_sparse_attn_indexer`): every rank builds the same global
:class:`~sparse_indexer.metadata.IndexerMetadata` (``build_metadata`` on the global lengths and block table),
turns it into its local one once per step (:func:`shard_metadata`), scores its local keys with the library's
ops, selects its local top-k, maps it to global positions and the values it selected, and merges: the global
top-k of a row lies inside the union of the ranks' local top-k (a key outside its rank's top-k has ``topk``
larger keys on that rank alone), so one ``all_gather_into_tensor`` of the ``(value, position)`` candidates
(``world_size x rows x topk``) and one ``top_k_per_row`` over the ``world_size * topk`` candidates of each row
give the same multiset as one device holding the whole cache. Local windows shorter than ``topk`` pad with
position ``-1`` and value ``-inf``; a real ``-inf``/NaN logit is carried as the lowest finite float32, so it
still ranks last among real keys but above every padding candidate (as the single-device top-k ranks in-window
``-inf``/NaN below every finite value). ``topk_out`` has ``sparse_attn_indexer``'s contract: request-local
(global) positions, ``-1`` padding, rows of a window ``n <= topk`` hold ``0..n-1, -1, ...`` as on one device,
longer rows the same multiset of values as one device (positions may differ where values tie at the k-th).

CUDA graphs and host cost: the merge (:func:`merge_topk`) has static shapes fixed by host integers, reads no
device value on the host and allocates nothing: every intermediate is a view of ``Buffers.cp_scratch``. On a GPU
it is five launches: a Triton kernel writing the candidates (:mod:`sparse_indexer.parallel.triton`), the
all-gather, one copy of the gathered values into row-major ``[rows, W * topk]``, the top-k, and a Triton kernel
writing the selected candidates' positions (read straight from the all-gather's output); ``all_gather_into_tensor``
on NCCL is capturable, and :func:`cp_decode` replays from a CUDA graph (``scripts/cp_bench.py --graph``).
:func:`shard_metadata` is per-step host planning (like ``build_metadata``) and stays outside the graph; on metadata
from ``build_metadata`` (which records each prefill chunk's host key counts) it reads nothing from the device.

Compressed caches (DeepSeek-V4) shard by blocks of keys alike. The two-level indexer (DeepSeek-V4.1's candidate
blocks, docs/spec.md §6a and §11): a source layer merges its ranks' candidate blocks (:func:`merge_candidates`:
one more all-gather) so that every rank holds the global ones, a consumer layer selects among its own cells of
them (:func:`local_candidates`) and merges its top-k without the short-row rule (``merge_topk(short_rows=False)``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from buffers import Buffers, BufferTooSmall
from buffers.plan import cp_scratch_cols

from .._runtime.triton_compat import interpreting
from ..indexer import (
    _check_candidates,
    _chunk_logits,
    _decode_candidates,
    _decode_inputs,
    _decode_logits,
    _rows,
    check_step,
    decode_batch,
)
from ..metadata import DecodeMetadata, IndexerMetadata, PrefillChunk
from ..ops.select_candidate_blocks import num_blocks, select_candidate_blocks
from ..ops.top_k_per_row import top_k_per_row

__all__ = ["local_lens", "local_block_table", "global_positions", "shard_metadata", "merge_topk", "merge_candidates",
           "local_candidates", "cp_decode", "cp_prefill", "cp_sparse_attn_indexer", "check_group"]

_LOW = torch.finfo(torch.float32).min


def _check_rank(rank: int, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")


def local_lens(lens: torch.Tensor, rank: int, world_size: int, block_size: int) -> torch.Tensor:
    """Keys of rank ``rank`` among the first ``lens`` keys of a request (block-interleaved sharding).

    ``lens``: integer tensor of any shape (values >= 0); returns the same shape and dtype. A window ``[0, n)``
    of global keys is the window ``[0, local_lens(n))`` of local keys (the map is monotonic and local keys keep
    the global order), which is why causal windows shard exactly.
    """
    _check_rank(rank, world_size)
    full = torch.div(lens, block_size, rounding_mode="floor")
    rem = lens - full * block_size
    owned_full = torch.div(full + (world_size - 1 - rank), world_size, rounding_mode="floor")
    tail = torch.where(torch.remainder(full, world_size) == rank, rem, torch.zeros_like(rem))
    return owned_full * block_size + tail


def local_block_table(block_table: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s block table: columns ``rank, rank + W, ...`` of ``block_table [R, max_blocks]`` int32,
    contiguous ``[R, max(1, ceil(max_blocks / W))]`` (a missing last column is 0 and never read: its keys are
    past every local length)."""
    _check_rank(rank, world_size)
    r, mb = block_table.shape
    cols = max(1, -(-mb // world_size))
    out = torch.zeros(r, cols, dtype=block_table.dtype, device=block_table.device)
    own = block_table[:, rank::world_size]
    out[:, : own.shape[1]] = own
    return out


def global_positions(local_pos: torch.Tensor, rank: int, world_size: int, block_size: int) -> torch.Tensor:
    """Request-local global positions of rank ``rank``'s local positions ``local_pos`` (int32, ``-1`` kept)."""
    _check_rank(rank, world_size)
    p = local_pos
    g = (torch.div(p, block_size, rounding_mode="floor") * world_size + rank) * block_size + torch.remainder(
        p, block_size)
    return torch.where(p < 0, p, g)


def _local_width(width: int, world_size: int, block_size: int) -> int:
    blocks = -(-width // block_size)
    return max(1, -(-blocks // world_size)) * block_size


def _local_len(n: int, rank: int, world: int, bs: int) -> int:
    """:func:`local_lens` of one host integer."""
    full, rem = divmod(n, bs)
    return (full + world - 1 - rank) // world * bs + (rem if full % world == rank else 0)


def shard_metadata(metadata: IndexerMetadata, rank: int, world_size: int) -> IndexerMetadata:
    """Rank ``rank``'s local metadata of a step whose global metadata is ``metadata`` (per step, shared by every
    layer; run it beside ``build_metadata``, outside CUDA graphs).

    Decode: the local block table, the local windows ``row_ends = local_lens(global row_ends)`` (as 2-D
    ``context_lens [B, next_n]``, so the paged op scores exactly the local causal windows) and a local width of
    ``ceil(ceil(width / bs) / W) * bs`` columns; device ops only. Prefill chunks: the local block table,
    ``cu_seq_lens`` of the local keys and every query's local window (device ops), and the local key count
    ``num_k_tokens``, a host integer (it sizes the key gather and the logits): from the chunk's host
    ``seq_lens`` (``build_metadata`` records them), which reads nothing from the device; for chunks of a builder
    that does not record them, read from the local ``cu_seq_lens`` in one transfer for all such chunks (one
    device synchronisation per step for GPU metadata; decode-only steps never read the device).
    The slot mapping is the global one; the cache write of a context-parallel step is the caller's (each rank
    writes the new keys of its own blocks, :func:`cp_sparse_attn_indexer`).
    """
    if not isinstance(metadata, IndexerMetadata):
        raise TypeError(f"metadata must be an IndexerMetadata, got {type(metadata).__name__}")
    _check_rank(rank, world_size)
    bs = metadata.limits.block_size
    dm = metadata.decode
    local_dm = None
    if dm is not None:
        ends = local_lens(dm.row_ends, rank, world_size, bs)
        local_dm = DecodeMetadata(
            num_reqs=dm.num_reqs, next_n=dm.next_n, uniform=dm.uniform,
            width=_local_width(dm.width, world_size, bs),
            context_lens=ends.view(dm.num_reqs, dm.next_n).contiguous(),
            block_table=local_block_table(dm.block_table, rank, world_size),
            row_starts=dm.row_starts, row_ends=ends.contiguous(), pack_src=dm.pack_src, unpack_src=dm.unpack_src)
    parts = []
    for c in metadata.prefill_chunks:
        cu = c.cu_seq_lens.long()
        lens_l = local_lens(cu[1:] - cu[:-1], rank, world_size, bs)
        cu_l = torch.zeros_like(cu)
        torch.cumsum(lens_l, 0, out=cu_l[1:])
        ks = c.cu_seqlen_ks.long()
        req = torch.searchsorted(cu[1:].contiguous(), ks, right=True)
        ks_l = cu_l[req]
        ke_l = ks_l + local_lens(c.cu_seqlen_ke.long() - ks, rank, world_size, bs)
        parts.append((cu_l, ks_l, ke_l))
    local_seq = [None if c.seq_lens is None else tuple(_local_len(n, rank, world_size, bs) for n in c.seq_lens)
                 for c in metadata.prefill_chunks]
    unknown = [i for i, ls in enumerate(local_seq) if ls is None]
    read = torch.stack([parts[i][0][-1] for i in unknown]).tolist() if unknown else []  # one transfer
    counts = [sum(ls) if ls is not None else None for ls in local_seq]
    for i, n in zip(unknown, read):
        counts[i] = n
    chunks = []
    for c, (cu_l, ks_l, ke_l), n, ls in zip(metadata.prefill_chunks, parts, counts, local_seq):
        dt = c.cu_seqlen_ks.dtype
        chunks.append(PrefillChunk(
            token_start=c.token_start, token_end=c.token_end, num_k_tokens=n, gather=c.gather,
            block_table=local_block_table(c.block_table, rank, world_size), cu_seq_lens=cu_l.to(c.cu_seq_lens.dtype),
            cu_seqlen_ks=ks_l.to(dt), cu_seqlen_ke=ke_l.to(dt), seq_lens=ls))
    return IndexerMetadata(
        num_decodes=metadata.num_decodes, num_decode_tokens=metadata.num_decode_tokens,
        num_prefills=metadata.num_prefills, num_prefill_tokens=metadata.num_prefill_tokens,
        slot_mapping=metadata.slot_mapping, decode=local_dm, prefill_chunks=tuple(chunks), limits=metadata.limits,
        num_blocks=metadata.num_blocks, empty_rows=metadata.empty_rows)


def check_group(group, buffers: Buffers, topk: int, candidate_blocks: int = 0,
                candidate_block_size: int = 8) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group`` (``None``: the default group), after checking that ``buffers`` has a
    ``cp_scratch`` planned for this world size, ``topk`` and the limits' candidate blocks. Raises
    ``ValueError``/:class:`BufferTooSmall`."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("context parallel needs an initialised torch.distributed process group")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if buffers.cp_scratch is None:
        raise BufferTooSmall("cp_scratch", 1, 0, f"this record was planned with world_size=1, the group has {world}")
    if buffers.logits.dtype != torch.float32:
        raise ValueError(f"context parallel needs float32 logits buffers (the merge exchanges float32 candidates); "
                         f"buffers.logits is {buffers.logits.dtype}")
    cols = cp_scratch_cols(world, topk, candidate_blocks, candidate_block_size)
    if buffers.cp_scratch.shape[1] != cols:
        raise ValueError(f"buffers.cp_scratch has {buffers.cp_scratch.shape[1]} columns; world_size={world}, "
                         f"topk={topk}, candidate_blocks={candidate_blocks} need {cols} (plan with "
                         f"IndexerLimits(world_size={world}) and the step's other limits)")
    return rank, world


class _Views:
    """Views of the first ``rows`` rows of ``Buffers.cp_scratch`` (int32 offsets in the flat region, in order):

    ``cand`` ``[2, rows, topk]`` (values as float32 bits, global positions: the all-gather's input), ``gath``
    ``[W, 2, rows, topk]`` (its output), ``mval`` ``[rows, W * topk]`` (the merge's values, row-major), ``mpos``
    ``[rows, W * topk]`` and ``bounds`` ``[2, rows]`` (the merge's window starts and ends). Regions are reused
    once free (no allocation in the merge): after the all-gather ``cand[0]`` holds the merge's selected columns.
    The torch path also keeps, before the all-gather, int64 gather indices in ``mval``, the padding mask in
    ``mpos`` and int64 window starts in ``bounds``; after the top-k, int64 indices and then the short rows' fill
    in ``mval``, the gathered positions row-major in ``mpos``, an ``arange`` in ``cand[1]``, masks in ``gath`` and
    the global window lengths in ``bounds``. Offsets are even (int64 views stay 8-byte aligned)."""

    __slots__ = ("rows", "topk", "world", "flat", "cand", "gath", "mval", "mpos", "bounds", "o_mval", "o_mpos")

    def __init__(self, scratch: torch.Tensor, rows: int, world: int, topk: int):
        n = rows * topk
        flat = scratch.view(-1)
        self.rows, self.topk, self.world, self.flat = rows, topk, world, flat
        o_gath, self.o_mval = 2 * n, (2 + 2 * world) * n
        self.o_mpos, o_b = self.o_mval + world * n, (2 + 4 * world) * n
        self.cand = flat[:o_gath]
        self.gath = flat[o_gath : self.o_mval]
        self.mval = flat[self.o_mval : self.o_mval + world * n].view(rows, world * topk)
        self.mpos = flat[self.o_mpos : o_b].view(rows, world * topk)
        self.bounds = flat[o_b : o_b + 2 * rows]

    def int64(self, offset: int, shape) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        return self.flat[offset : offset + 2 * n].view(torch.int64).view(shape)


def _views(buffers: Buffers, rows: int, world: int, topk: int) -> _Views:
    cap = buffers.cp_scratch.shape[0]
    if rows > cap:
        raise BufferTooSmall("cp_scratch", rows * buffers.cp_scratch.shape[1], buffers.cp_scratch.numel(),
                             f"{rows} rows > {cap}")
    return _Views(buffers.cp_scratch, rows, world, topk)


# torch >= 2.13 names the collective all_gather_single (all_gather_into_tensor, the same call, warns there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _use_triton(logits: torch.Tensor, backend: str | None) -> bool:
    """The merge's elementwise work in Triton kernels (:mod:`sparse_indexer.parallel.triton`) on GPUs (every
    backend but ``reference``) and under ``TRITON_INTERPRET=1`` with ``backend="triton"``; torch ops otherwise."""
    if backend == "reference":
        return False
    if logits.is_cuda:
        return True
    return backend == "triton" and interpreting()


def merge_topk(sel: torch.Tensor, logits: torch.Tensor, starts: torch.Tensor, global_starts: torch.Tensor,
               global_ends: torch.Tensor, buffers: Buffers, *, rank: int, world_size: int, block_size: int,
               group=None, backend: str | None = None, short_rows: bool = True) -> torch.Tensor:
    """Turn ``sel [rows, topk]`` int32, this rank's local top-k (local positions relative to ``starts``, ``-1``
    padding) of ``logits [rows, *]`` float32 (unit last stride; local windows starting at ``starts [rows]``
    int32), into the global top-k, in place: request-local global positions; a row whose global window
    ``[global_starts, global_ends)`` (``[rows]`` int32) has ``n <= topk`` keys comes out as ``0..n-1, -1, ...``
    (the single-device order). Collective: every rank of ``group`` calls it with the same ``rows``.
    ``rows <= buffers.cp_scratch.shape[0]``; arguments are not checked here (the step checked them).
    ``short_rows=False`` (a consumer layer's top-k over candidate blocks, whose eligible cells are not the whole
    window): no row is rewritten as ``0..n-1``; the merged top-k already lists every eligible cell first when
    there are at most ``topk``.

    Steps, on views of ``buffers.cp_scratch`` only (no allocation, static shapes, no host read of device values:
    CUDA-graph capturable): candidates ``(value, global position)`` ``[2, rows, topk]`` (one Triton kernel on a
    GPU); one ``all_gather_into_tensor`` into ``[W, 2, rows, topk]``; the values copied row-major into
    ``[rows, W * topk]``; ``top_k_per_row`` over the window ``[0, W * topk)`` of each row; the selected
    candidates' positions into ``sel`` (one Triton kernel on a GPU, reading the gathered positions in place).
    The ``reference`` backend and the CPU run the same steps as torch ops on the same views.
    """
    rows, topk = sel.shape
    if rows == 0:
        return sel
    if logits.dtype != torch.float32:
        raise TypeError(f"merge_topk needs float32 logits, got {logits.dtype}")
    v = _views(buffers, rows, world_size, topk)
    n = rows * topk
    cand = v.cand.view(2, rows, topk)
    st, en = v.bounds[:rows], v.bounds[rows:]
    triton_path = _use_triton(logits, backend)
    if triton_path:
        from . import triton as K

        K.pack(sel, logits, starts, cand[0].view(torch.float32), cand[1], v.bounds, rank=rank,
               world_size=world_size, block_size=block_size)
    else:
        _pack_torch(v, sel, logits, starts, rank, world_size, block_size)
    _all_gather(v.gath, v.cand, group=group)
    gath = v.gath.view(world_size, 2, rows, topk)
    v.mval.view(rows, world_size, topk).copy_(gath[:, 0].transpose(0, 1))
    col = cand[0]  # free after the all-gather: the merge's column indices
    top_k_per_row(v.mval.view(torch.float32), st, en, out=col, backend=backend, check_values=False, _checked=True)
    if triton_path:
        K.unpack(col, gath[0, 1], global_starts, global_ends, sel, short_rows=short_rows)
    else:
        _unpack_torch(v, col, gath, global_starts, global_ends, sel, n, short_rows)
    if not short_rows:
        _valid_first(v, sel)
    return sel


def _mask_view(region: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` bools in the first ``ceil(n / 4)`` int32 cells of the flat scratch ``region`` (a mask of a merge)."""
    return region[: -(-n // 4)].view(torch.uint8)[:n].view(torch.bool)


def _valid_first(v: _Views, sel: torch.Tensor) -> None:
    """``sel``'s rows with their positions ``>= 0`` first, in order, then the ``-1`` padding (the merged top-k of
    a row with fewer than ``topk`` eligible cells holds padding candidates anywhere): destinations from cumulative
    counts, one scatter; torch ops on views of the merge's scratch, all free once ``sel`` is written."""
    rows, topk = sel.shape
    n = rows * topk
    flat = v.flat
    tmp = flat[:n].view(rows, topk)
    dest = flat[2 * n : 4 * n].view(torch.int64).view(rows, topk)
    cnt = flat[4 * n : 6 * n].view(torch.int64).view(rows, topk)
    ar = flat[6 * n : 6 * n + 2 * topk].view(torch.int64)
    mask = _mask_view(flat[6 * n + 2 * topk :], n).view(rows, topk)
    torch.ge(sel, 0, out=mask)
    torch.cumsum(mask, 1, out=cnt)  # valid cells up to and with j
    torch.arange(1, topk + 1, out=ar)
    dest.copy_(ar.expand(rows, topk))
    dest.sub_(cnt).add_(cnt[:, -1:]).sub_(1)  # padding j: after every valid cell, in order
    cnt.sub_(1)
    torch.where(mask, cnt, dest, out=dest)
    tmp.copy_(sel)
    sel.scatter_(1, dest, tmp)


def _global_into(out: torch.Tensor, local: torch.Tensor, rank: int, world: int, unit: int) -> torch.Tensor:
    """:func:`global_positions` in place: ``out = local + (local // unit) * (world - 1) * unit + rank * unit``, the
    global index of rank ``rank``'s local index ``local`` in runs of ``unit`` (positions in blocks of ``unit``
    keys, or candidate blocks in cache blocks of ``unit`` of them); a negative ``local`` comes out negative."""
    torch.div(local, unit, rounding_mode="floor", out=out)
    return out.mul_((world - 1) * unit).add_(local).add_(rank * unit)


def _pack_torch(v: _Views, sel, logits, starts, rank: int, world: int, bs: int) -> None:
    """:func:`merge_topk`'s candidates and window bounds as torch ops on scratch views (no temporaries)."""
    rows, topk = sel.shape
    cand = v.cand.view(2, rows, topk)
    vals, pos = cand[0].view(torch.float32), cand[1]
    mask = _mask_view(v.mpos.view(-1), rows * topk).view(rows, topk)
    torch.lt(sel, 0, out=mask)
    if logits.shape[1]:
        idx = v.int64(v.o_mval, (rows, topk))
        st64 = v.int64(v.o_mpos + v.world * rows * topk, (rows, 1))  # the bounds region, written below
        idx.copy_(sel)
        idx.clamp_(min=0)
        st64.copy_(starts.view(rows, 1))
        # padding (-1) reads a cell of the row that is then overwritten (a rank without keys of a request: its
        # window starts at the row's end, so the column is clamped into the row)
        idx.add_(st64).clamp_(max=logits.shape[1] - 1)
        torch.gather(logits, 1, idx, out=vals)
        vals.nan_to_num_(nan=_LOW, posinf=float("inf"), neginf=_LOW)
    # else: no local key of any row (every sel is -1, filled with -inf below)
    vals.masked_fill_(mask, float("-inf"))
    _global_into(pos, sel, rank, world, bs)
    pos.masked_fill_(mask, -1)
    v.bounds[:rows].zero_()
    v.bounds[rows:].fill_(world * topk)


def _unpack_torch(v: _Views, col, gath, global_starts, global_ends, sel, n: int, short_rows: bool = True) -> None:
    """:func:`merge_topk`'s positions of the selected candidates and short rows as torch ops on scratch views."""
    rows, topk = sel.shape
    world = v.world
    v.mpos.view(rows, world, topk).copy_(gath[:, 1].transpose(0, 1))
    idx = v.int64(v.o_mval, (rows, topk))  # the merge's values are read: free
    idx.copy_(col)
    torch.gather(v.mpos, 1, idx, out=sel)
    if not short_rows:
        return
    # short rows (global n <= topk): 0..n-1, -1, ...
    ar = v.cand[n : n + topk].view(1, topk)  # cand[1]: free after the all-gather
    torch.arange(topk, out=ar.view(topk))
    lens = v.bounds[:rows].view(rows, 1)  # free after the top-k
    torch.sub(global_ends.view(rows, 1), global_starts.view(rows, 1), out=lens)
    past = _mask_view(v.gath, rows * topk).view(rows, topk)
    short = _mask_view(v.gath[n:], rows).view(rows, 1)
    torch.ge(ar, lens, out=past)
    torch.le(lens, topk, out=short)
    fill = v.mval.view(-1)[:n].view(rows, topk)  # the int64 indices are read: free
    fill.copy_(ar.expand(rows, topk))
    fill.masked_fill_(past, -1)
    torch.where(short, fill, sel, out=sel)


class _CandViews:
    """Views of ``Buffers.cp_scratch`` for :func:`merge_candidates` and :func:`local_candidates` on ``rows`` rows
    of ``K_b = kb`` candidate blocks of ``b`` positions (int32 offsets in the flat region; int64 views at even
    offsets; bool masks in int32 cells). ``cand [2, rows, kb]`` (scores as float32 bits, global ids: the
    all-gather's input) comes first; after it, the scores' cells (``pos`` int64 ``[rows, kb, b]``, ``vals``, two
    masks, an ``arange(b)``), and, once those are read, the same region again for the gathered candidates
    (``gath [W, 2, rows, kb]``), the merged scores ``mval`` and ids ``mid`` ``[rows, W * kb + 1]``, the selection's
    workspace ``ws``, int64 indices ``idx [rows, kb]``, the bounds ``n``, ``newest``, ``zero``, ``end`` ``[rows]``
    and two masks (sizes: :func:`buffers.plan.cp_scratch_cols`)."""

    def __init__(self, scratch: torch.Tensor, rows: int, world: int, kb: int, b: int):
        flat = scratch.view(-1)
        self.flat, o = flat, 0

        def take(n: int, even: bool = False) -> torch.Tensor:
            nonlocal o
            o += o & 1 if even else 0
            t = flat[o : o + n]
            o += n
            return t

        def mask(n: int) -> torch.Tensor:
            return _mask_view(take(-(-n // 4)), n)

        self.cand = take(2 * rows * kb).view(2, rows, kb)
        start = o
        self.pos = take(2 * rows * kb * b, True).view(torch.int64).view(rows, kb, b)
        self.vals = take(rows * kb * b).view(torch.float32).view(rows, kb * b)
        self.bad = mask(rows * kb * b).view(rows, kb, b)
        self.bad2 = mask(rows * kb * b).view(rows, kb, b)
        self.ar = take(2 * b, True).view(torch.int64)
        self.st64 = take(2 * rows, True).view(torch.int64).view(rows, 1, 1)
        self.en64 = take(2 * rows, True).view(torch.int64).view(rows, 1, 1)
        need, o = o, start
        m = world * kb + 1
        self.gath = take(2 * world * rows * kb)
        self.mval = take(rows * m).view(torch.float32).view(rows, m)
        self.mid = take(rows * m).view(rows, m)
        self.ws = take(rows * m).view(rows, m)
        self.idx = take(2 * rows * kb, True).view(torch.int64).view(rows, kb)
        self.n, self.newest, self.zero, self.end = (take(rows) for _ in range(4))
        self.eq = mask(rows * world * kb).view(rows, world * kb)
        self.neg = mask(rows * kb).view(rows, kb)
        if max(need, o) > flat.numel():
            raise BufferTooSmall("cp_scratch", max(need, o), flat.numel(),
                                 f"candidate-block merge of {rows} rows, K_b={kb}, world_size={world}")


def merge_candidates(cand: torch.Tensor, logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                     global_starts: torch.Tensor, global_ends: torch.Tensor, buffers: Buffers, *, rank: int,
                     world_size: int, block_size: int, candidate_block_size: int, group=None,
                     backend: str | None = None) -> torch.Tensor:
    """Turn ``cand [rows, K_b]`` int32, this rank's ``select_candidate_blocks`` of its local ``logits [rows, *]``
    float32 (local block ids relative to ``starts [rows]``, windows ``[starts, ends)`` int32; ``-1`` padding),
    into the candidate blocks of the global windows ``[global_starts, global_ends)`` (docs/spec.md §6a), in place:
    global block ids relative to the global start. Collective: every rank of ``group`` calls it with the same
    ``rows`` (``<= buffers.cp_scratch.shape[0]``).

    Blocks of ``b = candidate_block_size`` positions lie in one cache block of ``block_size`` (``b`` divides it),
    so each lives on one rank, and local block ``j`` is global block ``((j // q) * W + rank) * q + j % q`` with
    ``q = block_size // b``. Exact: the global choice is the newest block and the ``K_b - 1`` best others, and a
    rank's own choice (its own newest block and its ``K_b - 1`` best others) holds every block of its that the
    global choice can take. Steps, on views of ``cp_scratch`` (no allocation, static shapes, no host read of a
    device value): each chosen block's score, the maximum of its cells in the window (NaN if one is NaN,
    ``-inf`` for padding); one ``all_gather_into_tensor`` of ``(score, global id)``; per row the ``W * K_b``
    gathered candidates, the global newest block taken out of them and put last, so that
    ``select_candidate_blocks`` with blocks of one cell ranks it first, and the other classes of §6a follow
    from the scores (``+inf`` first, NaN after every finite score, ``-inf`` never); the chosen cells' ids into
    ``cand``.
    """
    rows, kb = cand.shape
    if rows == 0:
        return cand
    if logits.dtype != torch.float32:
        raise TypeError(f"merge_candidates needs float32 logits, got {logits.dtype}")
    w, b = world_size, candidate_block_size
    q = block_size // b
    v = _CandViews(buffers.cp_scratch, rows, w, kb, b)
    score, gid = v.cand[0].view(torch.float32), v.cand[1]
    # the chosen blocks' cells: start + id * b + t, outside the window (or padding) masked
    torch.arange(b, out=v.ar)
    pos = v.pos
    pos.copy_(cand.view(rows, kb, 1).expand(rows, kb, b))
    v.st64.copy_(starts.view(rows, 1, 1))
    v.en64.copy_(ends.view(rows, 1, 1))
    pos.mul_(b).add_(v.ar.view(1, 1, b)).add_(v.st64)
    torch.lt(pos, v.st64, out=v.bad)
    torch.ge(pos, v.en64, out=v.bad2)
    v.bad.logical_or_(v.bad2)
    if logits.shape[1]:
        pos.masked_fill_(v.bad, 0)
        torch.gather(logits, 1, pos.view(rows, kb * b), out=v.vals)
        v.vals.masked_fill_(v.bad.view(rows, kb * b), float("-inf"))
    else:  # no local key in any row: every block is padding
        v.vals.fill_(float("-inf"))
    torch.amax(v.vals.view(rows, kb, b), dim=2, out=score)  # (NaN propagates)
    _global_into(gid, cand, rank, w, q)  # (padding's ids are never read: its score is -inf)
    _all_gather(v.gath, v.cand.view(-1), group=group)
    gath = v.gath.view(w, 2, rows, kb)
    m = w * kb
    v.mval[:, :m].view(rows, w, kb).copy_(gath[:, 0].view(torch.float32).transpose(0, 1))
    v.mid[:, :m].view(rows, w, kb).copy_(gath[:, 1].transpose(0, 1))
    # the global newest block, (n - 1) // b of a window of n > 0 positions: out of the candidates, pinned last
    torch.sub(global_ends, global_starts, out=v.n)
    torch.sub(v.n, 1, out=v.newest)
    v.newest.div_(b, rounding_mode="floor")
    torch.eq(v.mid[:, :m], v.newest.view(rows, 1), out=v.eq)
    v.mval[:, :m].masked_fill_(v.eq, float("-inf"))
    v.mval[:, m].fill_(0.0)
    v.mid[:, m].copy_(v.newest)
    v.zero.zero_()
    torch.clamp(v.n, 0, 1, out=v.end)
    v.end.mul_(m + 1)  # (an empty global window: no candidate)
    select_candidate_blocks(v.mval, v.zero, v.end, out=cand, block_size=1, workspace=v.ws, backend=backend,
                            check_values=False, _checked=True)
    torch.lt(cand, 0, out=v.neg)
    v.idx.copy_(cand)
    v.idx.clamp_(min=0)
    torch.gather(v.mid, 1, v.idx, out=cand)
    cand.masked_fill_(v.neg, -1)
    return cand


def local_candidates(candidates: torch.Tensor, buffers: Buffers, *, rank: int, world_size: int, block_size: int,
                     candidate_block_size: int) -> torch.Tensor:
    """This rank's ids of the global candidate blocks ``candidates [rows, K_b]`` int32 (a consumer layer's rows:
    global block ids relative to the global window start, ``-1`` padding), as ``[rows, K_b]`` int32 local block ids
    relative to the local window start, ``-1`` where another rank holds the block: a view of the start of
    ``buffers.cp_scratch``, valid until the next merge. No allocation, no collective."""
    rows, kb = candidates.shape
    b = candidate_block_size
    q = block_size // b
    v = _CandViews(buffers.cp_scratch, rows, world_size, kb, b)
    local, blk = v.cand[0], v.cand[1]
    torch.div(candidates, q, rounding_mode="floor", out=blk)  # the cache block (padding: -1)
    torch.remainder(blk, world_size, out=local)  # its rank
    torch.ne(local, rank, out=v.neg)
    torch.lt(candidates, 0, out=v.eq[:, :kb])
    v.neg.logical_or_(v.eq[:, :kb])
    # local id: (blk // W) * q + id % q = (blk // W) * q + id - blk * q
    torch.div(blk, world_size, rounding_mode="floor", out=local)
    local.mul_(q).add_(candidates)
    blk.mul_(q)
    local.sub_(blk)
    local.masked_fill_(v.neg, -1)
    return local


def _pieces(n: int, per: int):
    for a in range(0, n, per):
        yield a, min(n, a + per)


def _local_selection(sel, logits, starts, ends, cand, buffers: Buffers, write: bool, lim, backend,
                     ws=None) -> None:
    """The local selection of a chunk or decode sub-batch, before any merge: a source layer's (``write``) candidate
    blocks into ``cand`` and its top-k, a plain layer's top-k (``ws``: the top-k workspace). A consumer layer's
    top-k needs its local candidate ids, which live in the merge's scratch: :func:`_merge_piece` selects it."""
    if cand is not None and not write:
        return
    if cand is not None:
        b = lim.candidate_block_size
        scores = buffers.block_scores_view(cand.shape[0], max(1, num_blocks(logits.shape[1], b)))
        select_candidate_blocks(logits, starts, ends, out=cand, block_size=b, backend=backend, check_values=False,
                                workspace=scores, _checked=True)
    top_k_per_row(logits, starts, ends, out=sel, backend=backend, check_values=False, workspace=ws, _checked=True)


def _merge_piece(sel, logits, starts, ends, gstarts, gends, cand, buffers: Buffers, write: bool, *, rank: int,
                 world: int, lim, group, backend) -> None:
    """The merges of one piece of rows (at most ``cp_scratch``'s): a source layer's candidate blocks
    (:func:`merge_candidates`) and top-k; a consumer layer's top-k among its own cells of the global candidates
    (:func:`local_candidates`), merged without the short-row rule; a plain layer's top-k."""
    kw = {"rank": rank, "world_size": world, "block_size": lim.block_size, "group": group, "backend": backend}
    b = lim.candidate_block_size
    consumer = cand is not None and not write
    if cand is not None and write:
        merge_candidates(cand, logits, starts, ends, gstarts, gends, buffers, candidate_block_size=b, **kw)
    if consumer:
        own = local_candidates(cand, buffers, rank=rank, world_size=world, block_size=lim.block_size,
                               candidate_block_size=b)
        top_k_per_row(logits, starts, ends, out=sel, backend=backend, check_values=False, candidates=own,
                      candidate_block_size=b, _checked=True)
    merge_topk(sel, logits, starts, gstarts, gends, buffers, short_rows=not consumer, **kw)


def cp_prefill(q_fp8: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor, metadata: IndexerMetadata,
               local: IndexerMetadata, buffers: Buffers, topk_out: torch.Tensor, *, group=None,
               backend: str | None = None, candidates: torch.Tensor | None = None, write_candidates: bool = False,
               _checked: bool = False) -> torch.Tensor:
    """Top-k of every prefill token of a context-parallel step; writes the prefill rows of ``topk_out``.

    ``metadata``: the step's global metadata; ``local``: ``shard_metadata(metadata, rank, world_size)``;
    ``kv_cache``: this rank's cache (the blocks its local block tables name). Per chunk: gather the local keys,
    local logits, local top-k into ``topk_out``'s rows, then :func:`merge_topk` in pieces of
    ``buffers.cp_scratch.shape[0]`` tokens (the same number of collectives on every rank).
    ``candidates``/``write_candidates``: the two-level indexer, as :func:`cp_sparse_attn_indexer` (a consumer
    layer's top-k runs piece by piece: its local candidate ids live in the merge's scratch)."""
    lim = metadata.limits
    rank, world = check_group(group, buffers, topk_out.shape[1], lim.candidate_blocks, lim.candidate_block_size)
    if not _checked:
        _check(q_fp8, weights, kv_cache, metadata, local, buffers, topk_out, backend, decode=False,
               candidates=candidates, write=write_candidates)
    per = buffers.cp_scratch.shape[0]
    for gc, c in zip(metadata.prefill_chunks, local.prefill_chunks):
        rows, logits = _chunk_logits(q_fp8, weights, kv_cache, c, buffers, backend)
        sel = topk_out[rows]
        cand = None if candidates is None else candidates[rows]
        _local_selection(sel, logits, c.cu_seqlen_ks, c.cu_seqlen_ke, cand, buffers, write_candidates, lim, backend)
        for a, b in _pieces(c.num_tokens, per):
            _merge_piece(_rows(sel, a, b), _rows(logits, a, b), _rows(c.cu_seqlen_ks, a, b),
                         _rows(c.cu_seqlen_ke, a, b), _rows(gc.cu_seqlen_ks, a, b), _rows(gc.cu_seqlen_ke, a, b),
                         None if cand is None else _rows(cand, a, b), buffers, write_candidates, rank=rank,
                         world=world, lim=lim, group=group, backend=backend)
    return topk_out


def cp_decode(q_fp8: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor, metadata: IndexerMetadata,
              local: IndexerMetadata, buffers: Buffers, topk_out: torch.Tensor, *, group=None,
              backend: str | None = None, candidates: torch.Tensor | None = None, write_candidates: bool = False,
              _checked: bool = False) -> torch.Tensor:
    """Top-k of every decode token of a context-parallel step; writes ``topk_out[:num_decode_tokens]``.

    Like :func:`sparse_indexer.indexer_decode` on the local metadata (sub-batches, packing of non-uniform
    steps), with :func:`merge_topk` after each sub-batch's local top-k (one all-gather per sub-batch; two in a
    source layer of the two-level indexer, ``candidates``/``write_candidates`` as :func:`cp_sparse_attn_indexer`).
    The sub-batch loop reads host integers only, so the whole decode step is capturable in a CUDA graph.
    """
    lim = metadata.limits
    rank, world = check_group(group, buffers, topk_out.shape[1], lim.candidate_blocks, lim.candidate_block_size)
    if not _checked:
        _check(q_fp8, weights, kv_cache, metadata, local, buffers, topk_out, backend, prefill=False,
               candidates=candidates, write=write_candidates)
    dm = local.decode
    if dm is None:
        return topk_out
    b = dm.num_reqs
    nd = local.num_decode_tokens
    q, w, sel = _decode_inputs(q_fp8, weights, dm, nd, buffers, topk_out)
    cand = _decode_candidates(candidates, dm, nd, buffers, write_candidates)
    gdm = metadata.decode
    per = decode_batch(local)
    for b0, b1 in _pieces(b, per):
        r0, r1, logits, ws = _decode_logits(q, w, kv_cache, dm, buffers, b0, b1, backend)
        s, c = _rows(sel, r0, r1), None if cand is None else _rows(cand, r0, r1)
        starts, ends = _rows(dm.row_starts, r0, r1), _rows(dm.row_ends, r0, r1)
        _local_selection(s, logits, starts, ends, c, buffers, write_candidates, lim, backend, ws)
        _merge_piece(s, logits, starts, ends, _rows(gdm.row_starts, r0, r1), _rows(gdm.row_ends, r0, r1), c,
                     buffers, write_candidates, rank=rank, world=world, lim=lim, group=group, backend=backend)
    if not dm.uniform:
        torch.index_select(sel, 0, dm.unpack_src, out=topk_out[:nd])
        if cand is not None and write_candidates:
            torch.index_select(cand, 0, dm.unpack_src, out=_rows(candidates, 0, nd))
    return topk_out


def _check(q_fp8, weights, kv_cache, metadata, local, buffers, topk_out, backend, *, prefill=True, decode=True,
           candidates=None, write=False):
    """Both metadata records describe the same step, the local step fits the buffers (check_step), and the
    two-level indexer's candidates are what the step needs (the single-device step's checks)."""
    if not isinstance(local, IndexerMetadata):
        raise TypeError(f"local must be an IndexerMetadata (shard_metadata), got {type(local).__name__}")
    if not isinstance(metadata, IndexerMetadata):
        raise TypeError(f"metadata must be an IndexerMetadata, got {type(metadata).__name__}")
    if (local.num_tokens, local.num_decodes, len(local.prefill_chunks)) != (
            metadata.num_tokens, metadata.num_decodes, len(metadata.prefill_chunks)):
        raise ValueError("local is not shard_metadata(metadata, rank, world_size): tokens, decodes or chunks differ")
    check_step(q_fp8, weights, kv_cache, local, buffers, topk_out, prefill=prefill, decode=decode, backend=backend)
    if candidates is not None:
        _check_candidates(candidates, write, metadata, buffers, q_fp8, weights, None, topk_out, kv_cache, backend)
    elif write:
        raise ValueError("write_candidates=True needs candidates= (the rows the source layer writes)")
    per = buffers.cp_scratch.shape[0]
    if decode and local.decode is not None:
        rows = min(local.decode.num_reqs, decode_batch(local)) * local.decode.next_n
        if rows > per:
            raise BufferTooSmall("cp_scratch", rows, per, "rows of one decode sub-batch")


def cp_sparse_attn_indexer(q_fp8: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor,
                           metadata: IndexerMetadata, local: IndexerMetadata, buffers: Buffers,
                           topk_out: torch.Tensor, *, group=None, backend: str | None = None,
                           candidates: torch.Tensor | None = None, write_candidates: bool = False) -> torch.Tensor:
    """One context-parallel indexer step of one layer on this rank, over ``group``: the ``topk_out`` contract of
    :func:`sparse_indexer.sparse_attn_indexer` (rows ``[0, num_tokens)`` hold request-local positions, ``-1``
    padding; rows ``[num_tokens, T)`` are filled with ``-1``; rows from ``T`` on are untouched).

    ``kv_cache``: this rank's cache, already holding the step's new keys (each rank writes the new tokens of the
    blocks it owns with :func:`sparse_indexer.write_k_cache` and its own slot mapping, ``-1`` for the others'
    tokens); ``metadata``: the global metadata (the same on every rank); ``local``: :func:`shard_metadata` of it
    for this rank. ``candidates [>= T, K_b]`` int32 and ``write_candidates``: the two-level indexer
    (docs/spec.md §6a) as in :func:`sparse_indexer.sparse_attn_indexer`: a source layer writes every rank's copy
    of the global candidate blocks (:func:`merge_candidates`), a consumer layer selects among them (the same
    rows on every rank). Raises before anything is written when the step does not fit (``check_step`` on
    ``local``).
    """
    lim = metadata.limits
    check_group(group, buffers, topk_out.shape[1], lim.candidate_blocks, lim.candidate_block_size)
    _check(q_fp8, weights, kv_cache, metadata, local, buffers, topk_out, backend, candidates=candidates,
           write=write_candidates)
    write = candidates is not None and write_candidates
    n, t = metadata.num_tokens, q_fp8.shape[0]
    if t > n:
        topk_out[n:t].fill_(-1)
        if write:
            candidates[n:t].fill_(-1)
    for a, b in metadata.empty_rows:  # prefill rows of chunks without keys (compressed caches): all -1 on every rank
        topk_out[a:b].fill_(-1)
        if write:
            candidates[a:b].fill_(-1)
    kw = {"group": group, "backend": backend, "candidates": candidates, "write_candidates": write_candidates,
          "_checked": True}
    cp_prefill(q_fp8, weights, kv_cache, metadata, local, buffers, topk_out, **kw)
    cp_decode(q_fp8, weights, kv_cache, metadata, local, buffers, topk_out, **kw)
    return topk_out
