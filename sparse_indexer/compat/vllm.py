"""vLLM integration: the indexer's buffers carved from vLLM's workspace manager, and a drop-in for vLLM's
``rocm_aiter_sparse_attn_indexer`` custom op.

vLLM (``vllm.v1.worker.workspace``, 0.14 and later) owns one flat ``uint8`` scratch buffer per (micro-batch,
lane) slot. ``WorkspaceManager.get_simultaneous(*(shape, dtype))`` returns views of that buffer at 256-byte
aligned offsets, growing it to exactly the sum of the aligned sizes when it is too small; after
``lock_workspace()`` growth is an ``AssertionError``. Our plan (:func:`buffers.plan`) lays its fields out the
same way, so asking for the plan's fields, in plan order, in **one** call yields views at exactly the plan's
offsets and a buffer of exactly ``plan.total_bytes``:

* :func:`reserve` at profiling time (before ``lock_workspace()``) grows the workspace to the plan's total;
* :func:`buffers_from_workspace` at run time makes the same call and wraps the views into a
  :class:`buffers.Buffers`. **The views alias the workspace**: they stay valid until the next
  ``get_simultaneous`` on the same manager slot (any other user of the workspace, e.g. the MoE or attention
  layers, reuses the same bytes). Take the record right before the indexer step and drop it after.

A locked workspace that is too small raises :class:`WorkspaceTooSmall` (a :class:`buffers.BufferTooSmall`,
hence a ``ValueError``) naming the missing bytes, before vLLM's own assertion.

:class:`VllmIndexer` is callable with the argument list of vLLM's ``rocm_aiter_sparse_attn_indexer`` op: it
converts vLLM's ``DeepseekV32IndexerMetadata`` (decode and prefill-chunk fields) to our
:class:`~sparse_indexer.IndexerMetadata` (:func:`metadata_from_vllm`) and runs
:func:`sparse_indexer.sparse_attn_indexer` on buffers from the workspace. Its ``fake`` returns the top-k buffer
and touches no workspace.

DeepSeek-V4 and V4.1 call the same op on compressed indexer caches (``compress_ratio`` ``C`` in 1, 2, 4: one key
per ``C`` tokens, written by the model's compressor before the op, so ``skip_k_cache_insert=True`` and
``k=None``). vLLM's metadata then holds compressed lengths, windows and slots (its builder divides by ``C``), and
the op's ``max_model_len`` and ``total_seq_lens`` are already ``// C``. The shim keeps one
:class:`IndexerLimits` (``compress_ratio=C``) and plan per ratio, and the cache's byte format per
:func:`v4_cache_format`.

DeepSeek-V4.1's two-level indexer passes the model's candidate buffer ``candidate_blocks [max_num_batched_tokens,
K_b]`` int32 with ``candidate_block_size`` ``b`` (8) to its candidate source layer (``candidate_write=True``: the
op writes the rows of the step's tokens) and to the index layers after it (which read them and select their top-k
inside those blocks): :meth:`VllmIndexer.__call__` says how. The op writes ``candidate_blocks`` on the source
layer, so a registration of the drop-in lists it among the mutated arguments (:data:`MUTATES_ARGS`, as vLLM
registers its own op).
"""

from __future__ import annotations

import functools
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import attrs
import torch

from buffers import Buffers, BufferTooSmall, CacheFormat, IndexerLimits, plan
from buffers.limits import DEFAULT_PREFILL_K_TOKENS, MiB
from buffers.plan import BufferPlan

from ..indexer import sparse_attn_indexer
from ..metadata import DecodeMetadata, IndexerMetadata, PrefillChunk, pack_decode
from ..ops.fp8_paged_mqa_logits import row_limits

__all__ = [
    "COMPRESS_RATIOS", "MUTATES_ARGS", "VllmIndexer", "WorkspaceTooSmall", "buffers_from_workspace", "held_bytes",
    "metadata_from_vllm", "reserve", "v4_cache_format", "workspace_specs",
]

# compress ratios of the indexer layers vLLM runs through the op: 1 (DeepSeek-V3.2, V4.1), 2 (V4.1), 4 (V4's
# compressed sparse attention layers). V4's heavily compressed layers (128) attend every compressed entry and
# never call the op.
COMPRESS_RATIOS = (1, 2, 4)

# the arguments of vLLM's indexer op that the op writes (vLLM 0.33 registers rocm_aiter_sparse_attn_indexer and
# sparse_attn_indexer with these ``mutates_args``): the top-k rows, and on DeepSeek-V4.1's candidate source layer
# the candidate blocks. A registration of :meth:`VllmIndexer.__call__` as the op passes them as ``mutates_args``.
MUTATES_ARGS = ("topk_indices_buffer", "candidate_blocks")


class WorkspaceTooSmall(BufferTooSmall):
    """vLLM's workspace is locked and holds fewer bytes than the indexer's plan.

    Attributes (besides :class:`BufferTooSmall`'s, in bytes): ``missing`` bytes, ``workspace_id`` (the
    manager's (ubatch, lane) slot).
    """

    def __init__(self, needed: int, available: int, workspace_id: int):
        super().__init__("workspace", needed, available)
        self.missing = self.needed - self.available
        self.workspace_id = workspace_id
        msg = (
            f"vLLM's workspace is locked and its slot {workspace_id} holds {self.available} bytes, but the indexer "
            f"plan needs {self.needed}: {self.missing} bytes missing. Call "
            f"sparse_indexer.compat.vllm.reserve(limits) at profiling time, before lock_workspace(), with the "
            f"same IndexerLimits (in every ubatch and lane that runs the indexer)"
        )
        self.args = (msg,)

    def __str__(self) -> str:
        return self.args[0]


# ------------------------------------------------------------------------------------------------ workspace
def _manager(manager):
    if manager is not None:
        return manager
    from vllm.v1.worker.workspace import current_workspace_manager

    return current_workspace_manager()


def _as_plan(limits: IndexerLimits | BufferPlan) -> BufferPlan:
    if isinstance(limits, BufferPlan):
        return limits
    if not isinstance(limits, IndexerLimits):
        raise TypeError(f"limits must be an IndexerLimits or BufferPlan, got {type(limits).__name__}")
    return plan(limits)


def workspace_specs(limits: IndexerLimits | BufferPlan) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """The plan's fields as ``get_simultaneous`` arguments ``((shape, dtype), ...)``, in plan order."""
    return tuple((f.shape, f.dtype) for f in _as_plan(limits).fields)


def held_bytes(manager=None) -> int | None:
    """Bytes the manager's workspace holds for the current (ubatch, lane) slot; ``None`` if this vLLM
    version does not expose them (``_current_workspaces`` / ``_get_workspace_id``)."""
    m = _manager(manager)
    slots = getattr(m, "_current_workspaces", None)
    get_id = getattr(m, "_get_workspace_id", None)
    if slots is None or get_id is None:
        return None
    ws = slots[get_id()]
    return 0 if ws is None else ws.numel() * ws.element_size()


def _check_fits(m, p: BufferPlan) -> None:
    if not m.is_locked():
        return
    held = held_bytes(m)
    if held is not None and held < p.total_bytes:
        raise WorkspaceTooSmall(p.total_bytes, held, m._get_workspace_id())


def reserve(limits: IndexerLimits | BufferPlan, manager=None) -> BufferPlan:
    """Grow vLLM's workspace to hold the indexer's buffers; call at profiling time, before locking.

    One ``get_simultaneous`` call with the plan's fields: the workspace grows to exactly
    ``plan.total_bytes`` (when smaller) and no more. ``manager`` defaults to vLLM's
    ``current_workspace_manager()``. Returns the plan.

    Raises:
        WorkspaceTooSmall: the workspace is locked and smaller than the plan.
    """
    p = _as_plan(limits)
    m = _manager(manager)
    _check_fits(m, p)
    m.get_simultaneous(*workspace_specs(p))
    return p


def buffers_from_workspace(limits: IndexerLimits | BufferPlan, manager=None) -> Buffers:
    """A :class:`Buffers` record of views of vLLM's workspace, laid out as ``plan(limits)``.

    Valid until the manager's next ``get_simultaneous`` on the same (ubatch, lane) slot, which hands out the
    same bytes again: take the record right before the indexer step. On the same slot, consecutive steps get
    the same storage (nothing is allocated once :func:`reserve` ran).

    Raises:
        WorkspaceTooSmall: the workspace is locked and smaller than the plan.
    """
    p = _as_plan(limits)
    m = _manager(manager)
    _check_fits(m, p)
    views = m.get_simultaneous(*workspace_specs(p))
    base = views[0].data_ptr()
    for f, v in zip(p.fields, views):
        if v.data_ptr() - base != f.offset or tuple(v.shape) != f.shape or v.dtype != f.dtype:
            raise RuntimeError(
                f"vLLM's get_simultaneous placed {f.name} at offset {v.data_ptr() - base} "
                f"{tuple(v.shape)} {v.dtype}; the plan says {f.offset} {f.shape} {f.dtype} (layout changed?)"
            )
    return Buffers(**{f.name: v for f, v in zip(p.fields, views)})


# ------------------------------------------------------------------------------------------------ metadata
def _decode_from_vllm(d, num_decode_tokens: int, width: int, next_n: int, compress_ratio: int = 1,
                      uncompressed_seq_lens: torch.Tensor | None = None) -> DecodeMetadata:
    """vLLM's ``DeepSeekV32IndexerDecodeMetadata`` -> ours, with device tensor ops only (no host sync: the
    conversion runs inside a captured CUDA graph and is replayed with the new contents of vLLM's buffers).

    The layouts vLLM 0.33's ``DeepseekV32IndexerMetadataBuilder`` produces (``num_decode_tokens`` = ``T_d``,
    decode requests ``B``, ``d_b`` = ``decode_lens``, ``L_b`` the context in tokens, ``C`` = ``compress_ratio``;
    every length is in keys, ``// C``, which vLLM applies after the layouts below):

    * native: ``seq_lens [B, n]`` int32 with ``n = max d_b`` and ``seq_lens[b, j] = clamp(L_b - n + j + 1, 0) //
      C`` (``[B, 1]`` = ``L_b // C`` at one token); older versions pass ``[B]`` (row ``j`` then sees ``L_b - n +
      j + 1`` keys; ``C = 1`` only). Uniform when ``B * n == T_d`` and not ``requires_padding``: token ``t`` is
      slot ``t`` of the ``[B, n]`` grid. With ``C > 1`` and one token per request vLLM's ``seq_lens`` has
      ``T_d`` rows (``[T_d, 1]``, rows past the ``B`` requests 0) while ``block_table`` has ``B``.
    * flattened (no native kernel for the step's decode length, e.g. off CUDA at next_n > 2, or adaptive
      verification): one row per token, ``seq_lens [T_d, 1]`` = ``(L_b - d_b + j + 1) // C``,
      ``block_table`` repeated per token, ``decode_lens`` all ones.
    * padded for a FULL CUDA graph: padding requests (``d_b = 0``, ``L_b = 0``, ``seq_lens`` rows 0) at the
      end, padding tokens counted in ``T_d`` (their ``slot_mapping`` is -1), ``requires_padding`` set (also at
      one token per request).
    * padded tokens without padding requests (FULL graphs of batches that are not uniform decodes): ``T_d``
      larger than the real tokens.

    One slot per request (``n == 1``: native one-token decodes, flattened) is always uniform: row ``t`` is token
    ``t`` for the first ``min(rows, T_d)`` rows (``rows``: of ``seq_lens`` and of ``block_table``), since
    requests without a token (padding, window 0) come after those with one; so the packing buffers, absent when
    ``next_n == 1``, are never needed there.

    Otherwise (``n > 1`` with ``requires_padding``, or ``B * n != T_d``) the real tokens ``t < S = sum(d_b)`` are
    packed left-aligned into the ``[B, n]`` grid: token ``j < d_b`` of request ``b`` is slot ``b * n + j`` with
    window ``(L_b - d_b + j + 1) // C`` (docs/spec.md §7). vLLM's grid holds the windows of ``d_b = n``, so the
    packed windows come from the uncompressed ``L_b``: ``seq_lens[b, -1]`` when ``C == 1``,
    ``uncompressed_seq_lens[b]`` (vLLM's ``DeepseekV32IndexerMetadata.seq_lens``, ``[>= B]`` int32, in
    tokens, padding requests 0) when ``C > 1``. Slots ``j >= d_b`` have empty windows (their top-k rows are all
    -1). The result describes ``min(T_d, B * n)`` token rows (``S <= B * n``: the rest can only be padding, left
    to the caller); each padding token ``S <= t < B * n`` is unpacked from the first empty slot, which exists
    because ``S < B * n`` then, so its ``topk_out`` row is -1 and no index reaches past the last request. Decode
    lengths above ``n`` are not checked (that would need a host sync).
    """
    seq_lens, bt = d.seq_lens, d.block_table
    if getattr(d, "indices", None) is not None:
        raise NotImplementedError("vLLM varlen decode metadata (decode.indices) is not supported")
    b = seq_lens.shape[0]
    dev = seq_lens.device
    if b == 0:
        raise ValueError("decode metadata with 0 requests but num_decode_tokens > 0")
    if seq_lens.dim() not in (1, 2):
        raise ValueError(f"decode.seq_lens must be [B] or [B, n], got shape {tuple(seq_lens.shape)}")
    if seq_lens.dim() == 2:
        nn = seq_lens.shape[1]
    elif d.requires_padding or num_decode_tokens % b:
        nn = next_n
    else:
        nn = num_decode_tokens // b
    if seq_lens.dim() == 1 and compress_ratio > 1 and nn > 1:
        raise ValueError(f"decode.seq_lens [B] with compress_ratio={compress_ratio} and {nn} tokens per request: "
                         "compressed windows need one length per token ([B, n] or [T, 1])")
    if nn == 1:
        # one token per row: token t is row t (requests without a token, vLLM's padding, come last); rows of
        # seq_lens past the block table's (compressed one-token decodes) are padding tokens
        b = min(b, bt.shape[0], num_decode_tokens)
        ctx = seq_lens[:b].to(torch.int32)
        return DecodeMetadata(
            num_reqs=b, next_n=1, uniform=True, width=width, context_lens=ctx, block_table=bt[:b],
            row_starts=torch.zeros(b, dtype=torch.int32, device=dev),
            row_ends=row_limits(ctx, 1).to(torch.int32), pack_src=None, unpack_src=None,
        )
    if bt.shape[0] < b:
        raise ValueError(f"decode.block_table has {bt.shape[0]} rows for {b} decode rows")
    if not d.requires_padding and b * nn == num_decode_tokens:
        ctx = seq_lens.to(torch.int32)
        return DecodeMetadata(
            num_reqs=b, next_n=nn, uniform=True, width=width, context_lens=ctx, block_table=bt[:b],
            row_starts=torch.zeros(b * nn, dtype=torch.int32, device=dev),
            row_ends=row_limits(ctx, nn).to(torch.int32), pack_src=None, unpack_src=None,
        )
    # tokens past the [B, n] grid can only be padding (a request has at most n tokens): no rows for them here
    rows = min(num_decode_tokens, b * nn)
    if d.decode_lens.shape != (b,):
        raise ValueError(f"decode.decode_lens has shape {tuple(d.decode_lens.shape)}, expected [{b}]")
    if compress_ratio == 1:
        full = seq_lens[:, -1] if seq_lens.dim() == 2 else seq_lens
    else:
        if uncompressed_seq_lens is None or uncompressed_seq_lens.dim() != 1 or uncompressed_seq_lens.shape[0] < b:
            shape = None if uncompressed_seq_lens is None else tuple(uncompressed_seq_lens.shape)
            raise ValueError(f"padded compressed decode (compress_ratio={compress_ratio}) needs the metadata's "
                             f"seq_lens in tokens, [>= {b}], got {shape}")
        full = uncompressed_seq_lens[:b]
    lim, pack_src, unpack_src = pack_decode(full, d.decode_lens, nn, rows, compress_ratio)
    return DecodeMetadata(
        num_reqs=b, next_n=nn, uniform=False, width=width, context_lens=lim, block_table=bt[:b],
        row_starts=torch.zeros(b * nn, dtype=torch.int32, device=dev),
        row_ends=lim.reshape(-1).clone(), pack_src=pack_src, unpack_src=unpack_src,
    )


def _chunk_from_vllm(c) -> PrefillChunk:
    """vLLM's ``DeepseekV32IndexerPrefillChunkMetadata`` -> our :class:`PrefillChunk` (same conventions:
    ``token_start/token_end`` are absolute rows of the step, ``cu_seqlen_ks/ke`` index the chunk's gathered
    keys, ``cu_seq_lens`` the gather offsets, ``skip_kv_gather`` a later query piece of a split request; with a
    compressed cache every key count and window is in compressed entries already)."""
    local = getattr(c, "local_cu_seq_lens", None)
    if local is not None and local is not c.cu_seq_lens:
        raise NotImplementedError("vLLM context-parallel prefill chunks (local_cu_seq_lens) are not supported")
    if getattr(c, "pcp_deinterleave_idx", None) is not None:
        raise NotImplementedError("vLLM prefill context parallelism (pcp_deinterleave_idx) is not supported")
    t0, t1 = int(c.token_start), int(c.token_end)
    if c.cu_seqlen_ks.shape[0] != t1 - t0 or c.cu_seqlen_ke.shape[0] != t1 - t0:
        raise ValueError(f"prefill chunk [{t0}, {t1}) has {c.cu_seqlen_ks.shape[0]} key windows")
    return PrefillChunk(
        token_start=t0, token_end=t1, num_k_tokens=int(c.total_seq_lens),
        gather=not bool(getattr(c, "skip_kv_gather", False)), block_table=c.block_table,
        cu_seq_lens=c.cu_seq_lens, cu_seqlen_ks=c.cu_seqlen_ks, cu_seqlen_ke=c.cu_seqlen_ke,
    )


def _split_chunk(c: PrefillChunk, limits: IndexerLimits) -> tuple[PrefillChunk, ...]:
    """``c`` as runs of whole requests whose keys fit the gather buffers (``limits.prefill_k_tokens``) and whose
    ``[rows, keys]`` logits fit ``limits.max_logits_bytes`` (``c`` itself when it fits). Reads the chunk's key
    offsets and windows on the host. A run without keys (requests shorter than ``C``) becomes no chunk: its rows
    are the record's empty rows. A request that alone does not fit is left whole (the step then says which
    buffer is too small)."""
    cells = limits.max_logits_bytes // 4
    if c.num_k_tokens <= limits.prefill_k_tokens and c.num_tokens * c.num_k_tokens <= cells:
        return (c,)
    cu = c.cu_seq_lens.tolist()
    ks = c.cu_seqlen_ks.tolist()
    req_of = [bisect_right(cu, k, 0, len(cu) - 1) - 1 for k in ks]  # each row's request (monotone)
    first_row = [bisect_left(req_of, r) for r in range(len(cu))]  # (len(cu) - 1 requests; the end sentinel)
    out, a = [], 0
    n_req = len(cu) - 1
    while a < n_req:
        b = a + 1
        while (b < n_req and cu[b + 1] - cu[a] <= limits.prefill_k_tokens
               and (first_row[b + 1] - first_row[a]) * (cu[b + 1] - cu[a]) <= cells):
            b += 1
        r0, r1, keys = first_row[a], first_row[b], cu[b] - cu[a]
        if keys and r1 > r0:
            base = cu[a]
            out.append(attrs.evolve(
                c, token_start=c.token_start + r0, token_end=c.token_start + r1, num_k_tokens=keys, gather=True,
                block_table=c.block_table[a:b], cu_seq_lens=c.cu_seq_lens[a : b + 1] - base,
                cu_seqlen_ks=c.cu_seqlen_ks[r0:r1] - base, cu_seqlen_ke=c.cu_seqlen_ke[r0:r1] - base,
                seq_lens=tuple(cu[i + 1] - cu[i] for i in range(a, b))))
        a = b
    return tuple(out)


def metadata_from_vllm(md, limits: IndexerLimits, *, split_chunks: bool = False) -> IndexerMetadata:
    """Our :class:`IndexerMetadata` from one layer's vLLM ``DeepseekV32IndexerMetadata`` (any object with its
    field names: ``slot_mapping``, ``num_decodes``, ``num_decode_tokens``, ``num_prefills``,
    ``num_prefill_tokens``, ``decode``, ``prefill.chunks``; ``seq_lens`` (``[num_reqs]`` int32, tokens) for a
    padded compressed decode). ``limits.compress_ratio`` is the cache's ``C`` (the builder's
    ``kv_cache_spec.tokens_per_state``); decode logits use ``W = limits.max_keys``.

    Reads host integers and makes device tensors only, so it can run inside a captured CUDA graph. Padding
    from vLLM's FULL CUDA graphs gets no rows: padding decode tokens are unpacked from an empty slot
    (:func:`_decode_from_vllm`), and padding tokens after the prefill chunks (counted in vLLM's
    ``num_prefill_tokens``, covered by no chunk) fall beyond our ``num_tokens``, so the step fills their
    ``topk_out`` rows with -1. Their ``slot_mapping`` entries are -1 (no cache write).

    ``split_chunks``: cut chunks that do not fit the limits' gather buffers or logits into runs of whole requests
    (:func:`_split_chunk`; vLLM's ROCm MXFP4 builder bounds a chunk by its logits alone). Reads the chunk's key
    offsets on the host; the rows of a run without keys become ``empty_rows``.

    With ``C > 1`` vLLM drops every prefill chunk without a key (all its requests shorter than ``C`` tokens),
    also between two others: the rows before or between the remaining chunks that no chunk covers are such
    tokens, whose windows are empty; they become the record's ``empty_rows`` (-1 rows). Rows after the last
    chunk are left to the step's padding fill, -1 as well.

    Raises:
        ValueError: the chunks do not cover increasing rows from ``num_decode_tokens`` on (consecutive rows when
            ``C == 1``, where vLLM drops no chunk), or the decode part holds more tokens than its ``[B, n]`` grid
            and prefill rows follow.
        NotImplementedError: vLLM features the shim does not implement (varlen decode ``indices``, context
            parallelism).
    """
    nd, npf = int(md.num_decode_tokens), int(md.num_prefill_tokens)
    cr = limits.compress_ratio
    decode = None
    decode_rows = 0
    if int(md.num_decodes) > 0 and nd > 0:
        if md.decode is None:
            raise ValueError("num_decodes > 0 but the metadata has no decode part")
        decode = _decode_from_vllm(md.decode, nd, limits.max_keys, limits.next_n, cr, getattr(md, "seq_lens", None))
        decode_rows = min(nd, decode.num_rows)
    chunks: tuple[PrefillChunk, ...] = ()
    if int(md.num_prefills) > 0:
        if md.prefill is None:
            raise ValueError("num_prefills > 0 but the metadata has no prefill part")
        chunks = tuple(_chunk_from_vllm(c) for c in md.prefill.chunks)
        if split_chunks:
            chunks = tuple(piece for c in chunks for piece in _split_chunk(c, limits))
    # prefill rows: the chunks' rows, in order from the decode tokens on; gaps are dropped key-less chunks
    # (compressed caches only); the rest of vLLM's prefill tokens are FULL-graph padding (requests with no
    # tokens) or key-less tokens, left to the step's -1 fill
    end = nd
    gaps = []
    for c in chunks:
        if c.token_start < end or (cr == 1 and c.token_start != end):
            raise ValueError(f"prefill chunk rows [{c.token_start}, {c.token_end}) do not start at row {end} "
                             f"(the end of the previous chunk or of the {nd} decode tokens)"
                             + ("" if cr == 1 else " or after it"))
        if c.token_start > end:
            gaps.append((end, c.token_start))
        end = c.token_end
    if end > nd + npf:
        raise ValueError(f"prefill chunks end at row {end} > num_decode_tokens + num_prefill_tokens = {nd + npf}")
    if chunks and decode_rows != nd:
        raise ValueError(f"{nd} decode tokens do not fit the decode part's {decode_rows} slots, and prefill rows "
                         f"follow them")
    return IndexerMetadata(
        num_decodes=int(md.num_decodes), num_decode_tokens=decode_rows, num_prefills=int(md.num_prefills),
        num_prefill_tokens=end - nd, slot_mapping=md.slot_mapping.to(torch.int64), decode=decode,
        prefill_chunks=chunks, limits=limits, empty_rows=tuple(gaps),
    )


# ------------------------------------------------------------------------------------------------ the op
_cuda_available = torch.cuda.is_available


def _forward_context_metadata():
    from vllm.forward_context import get_forward_context

    return get_forward_context().attn_metadata


def _layer_name(prefix) -> str:
    if isinstance(prefix, str):
        return prefix
    from vllm.utils.torch_utils import _resolve_layer_name

    return _resolve_layer_name(prefix)


def _is_rocm() -> bool:
    return torch.version.hip is not None


def _uses_mx_scales(device: torch.device) -> bool:
    """vLLM's ``mqa_logits_use_mx_scales()``: CUDA (not ROCm) devices of capability family 100 (SM100, SM103),
    whose MQA logits kernels take UE8M0-scaled inputs, so vLLM's V4 writers store each key's scale as four
    equal UE8M0 bytes."""
    if device.type != "cuda" or _is_rocm() or not _cuda_available():
        return False
    return torch.cuda.get_device_capability(device)[0] == 10


def v4_cache_format(compress_ratio: int, block_size: int, device: torch.device,
                    q_dtype: torch.dtype) -> CacheFormat | None:
    """The byte format of an indexer cache written by vLLM 0.33's DeepSeek-V4/V4.1 writers (the compressor's
    fused quantize-and-insert kernels), as :class:`buffers.CacheFormat`; ``None`` where that is the format the
    step assumes by default (``CacheFormat(fp8_dtype=q_dtype)``).

    * values: ``float8_e4m3fn`` on every platform (also where the queries are ``e4m3fnuz``, gfx942);
    * scales: ``"ue8m0x4"`` (four equal UE8M0 bytes) where vLLM's MQA logits take MX scales (CUDA SM100),
      else one ``float32``;
    * byte order: ``"preshuffled"`` (16 x 16 tiles) on ROCm for ``C`` 1 and 2 with more than one entry per block
      (the V4.1 writer shuffles exactly then); ``"flat"`` for ``C = 4`` (V4's block-flat layout) and elsewhere.

    ``compress_ratio`` ``C``, ``block_size`` the cache's entries per block (``kv_cache.shape[1]``), ``device`` the
    cache's, ``q_dtype`` the queries' FP8 dtype.
    """
    order = "preshuffled" if _is_rocm() and compress_ratio in (1, 2) and block_size > 1 else "flat"
    scale = "ue8m0x4" if _uses_mx_scales(device) else "float32"
    fmt = CacheFormat(fp8_dtype=torch.float8_e4m3fn, scale=scale, order=order)
    return None if fmt == CacheFormat(fp8_dtype=q_dtype) else fmt


@attrs.frozen(kw_only=True)
class VllmIndexer:
    """Drop-in for vLLM's ``rocm_aiter_sparse_attn_indexer`` (same argument list; register ``__call__`` as the
    op and ``fake`` as its fake, ``mutates_args=MUTATES_ARGS``: ``["topk_indices_buffer", "candidate_blocks"]``).

    The op's arguments fix most :class:`IndexerLimits` (``max_model_len``, ``total_seq_lens`` ->
    ``prefill_k_tokens``, ``topk_tokens``, ``head_dim``, heads and fp8 format of ``q_fp8``, the cache's
    block size, ``topk_indices_buffer.shape[0]`` -> ``max_num_batched_tokens``, ``compress_ratio``,
    ``candidate_blocks.shape[1]`` -> ``candidate_blocks`` and ``candidate_block_size``); the rest are engine
    limits given here. Layers of different compress ratios (DeepSeek-V4.1 mixes 1 and 2, each K-cache group
    with its own vLLM metadata object) and of different candidate configurations (V4.1's index layers before
    the candidate source have none) get limits and a plan each; a profiling run reserves the largest plan seen
    so far, so vLLM's workspace ends up holding every one of them (a candidate plan's ``block_scores`` and
    ``cand_pack`` included).

    Attributes:
        max_num_seqs, next_n, max_logits_bytes, with_qk: the remaining :class:`IndexerLimits`.
        model_max_model_len: the model's context length in tokens (vLLM's ``model_config.max_model_len``), or
            ``None``. The op passes ``max_model_len // C``; with this the limits get the exact length, without
            it the longest length with that many keys, ``(max_model_len // C) * C + C - 1`` (the same keys, so
            the same buffers).
        backend: passed to every op (``None`` = auto).
        prefill_tokens: the tokens the prefill gather buffers of the MXFP4 entry (:meth:`rocm_mxfp4`, whose op
            gets no ``total_seq_lens``) hold keys for, ``// C`` per layer; ``None``: ``DEFAULT_PREFILL_K_TOKENS``
            keys. :meth:`from_vllm_config` sets vLLM's prefill workspace rule (``get_max_prefill_buffer_size``),
            the key count vLLM's FP8 op passes as ``total_seq_lens``.
        attn_metadata: returns the forward context's ``attn_metadata`` (default: vLLM's
            ``get_forward_context().attn_metadata``); not a dict means a profiling run.
        manager: the workspace manager (``None`` = vLLM's ``current_workspace_manager()``).
    """

    max_num_seqs: int
    next_n: int = 1
    max_logits_bytes: int = 512 * MiB
    with_qk: bool = False
    model_max_model_len: int | None = None
    backend: str | None = None
    prefill_tokens: int | None = None
    attn_metadata: Callable[[], Any] = _forward_context_metadata
    manager: Any = None
    # conversions of vLLM's metadata objects, most recent last: every layer of a step that shares a K-cache group
    # passes the same metadata object, so its conversion (small device tensors) runs once per step and limits
    # (a group's layers with and without candidate blocks have limits each), not once per layer, also when layers
    # of several groups (compress ratios) alternate. Key: (id of vLLM's object, capture
    # state, id of the limits) -> (the object, the limits, our record); the object and limits are held so that
    # their ids stay theirs. The capture state is part of the key: a conversion made outside a CUDA graph
    # capture (a warm-up with the same object) must not be reused inside it, or the graph would replay stale
    # tensors instead of converting the new metadata.
    _converted: OrderedDict = attrs.field(factory=OrderedDict, init=False, repr=False, eq=False)
    # per-call records that only change with the op's shapes or the workspace (host overhead: a per-layer call
    # costs what a direct sparse_attn_indexer call costs): "limits" maps the arguments that fix the
    # IndexerLimits (the compress ratio and candidate configuration among them) to (limits, plan); "buffers" maps
    # (workspace slot, id of a plan) to (plan, its workspace tensor, the Buffers record of views of it), kept only
    # while the workspace is locked (it cannot grow or move then)
    _memo: dict = attrs.field(factory=lambda: {"limits": {}, "buffers": {}}, init=False, repr=False, eq=False)

    # conversions kept (a step has one metadata object per K-cache group with an indexer, one to three, each with
    # at most two limits: with and without candidate blocks)
    MAX_CONVERTED = 8

    def _metadata(self, vllm_md, limits: IndexerLimits, split_chunks: bool = False) -> IndexerMetadata:
        """:func:`metadata_from_vllm`, once per (metadata object, capture state, limits)."""
        capturing = _cuda_available() and torch.cuda.is_current_stream_capturing()
        memo = self._converted
        key = (id(vllm_md), capturing, id(limits))
        hit = memo.get(key)
        if hit is not None and hit[0] is vllm_md and hit[1] is limits:
            memo.move_to_end(key)
            return hit[2]
        # (split_chunks only where asked: an engine may wrap metadata_from_vllm with its own two arguments)
        md = (metadata_from_vllm(vllm_md, limits, split_chunks=True) if split_chunks
              else metadata_from_vllm(vllm_md, limits))
        memo[key] = (vllm_md, limits, md)
        while len(memo) > self.MAX_CONVERTED:
            memo.popitem(last=False)
        return md

    def _limits_and_plan(self, kv_cache: torch.Tensor, q_fp8: torch.Tensor, topk_tokens: int, head_dim: int,
                         max_model_len: int, total_seq_lens: int, topk_indices_buffer: torch.Tensor,
                         compress_ratio: int = 1, skip_k_cache_insert: bool = False, candidate_blocks: int = 0,
                         candidate_block_size: int = 8,
                         cache_format: CacheFormat | None = None) -> tuple[IndexerLimits, BufferPlan]:
        """:meth:`limits` and its plan, made once per distinct set of the arguments they read (``candidate_blocks``:
        ``K_b``, the columns of the op's candidate buffer, 0 without one)."""
        args = (kv_cache, q_fp8, topk_tokens, head_dim, max_model_len, total_seq_lens, topk_indices_buffer)
        kw = {"compress_ratio": compress_ratio, "skip_k_cache_insert": skip_k_cache_insert,
              "candidate_blocks": candidate_blocks, "candidate_block_size": candidate_block_size,
              "cache_format": cache_format}
        key = (kv_cache.shape[1], kv_cache.device, q_fp8.shape[1], q_fp8.dtype, topk_tokens, head_dim, max_model_len,
               total_seq_lens, topk_indices_buffer.shape[0], compress_ratio, bool(skip_k_cache_insert),
               candidate_blocks, candidate_block_size if candidate_blocks else 0, cache_format)
        memo = self._memo["limits"]
        try:
            hit = memo.get(key)
        except TypeError:  # an unhashable argument: no memo (limits() converts or rejects it)
            lim = self.limits(*args, **kw)
            return lim, plan(lim)
        if hit is None:
            lim = self.limits(*args, **kw)
            if len(memo) >= 64:  # (distinct shapes are few; a bound all the same)
                memo.clear()
            hit = memo[key] = (lim, plan(lim))
        return hit

    def _largest_plan(self, p: BufferPlan) -> BufferPlan:
        """The plan with the most bytes among ``p`` and every plan made so far (one per compress ratio,
        candidate configuration and shape): what a profiling run reserves, so the locked workspace holds any of
        them (each is taken whole from the start of the workspace, one at a time)."""
        best = p
        for _, q in self._memo["limits"].values():
            if q.total_bytes > best.total_bytes:
                best = q
        return best

    def _buffers(self, p: BufferPlan) -> Buffers:
        """:func:`buffers_from_workspace`; the record is kept per workspace slot and plan while vLLM's workspace
        is locked and reused while the slot holds the same workspace tensor (the views would be the same bytes)."""
        m = _manager(self.manager)
        slots = getattr(m, "_current_workspaces", None)
        get_id = getattr(m, "_get_workspace_id", None)
        is_locked = getattr(m, "is_locked", None)
        memo = self._memo["buffers"]
        if slots is None or get_id is None or is_locked is None or not is_locked():
            memo.clear()  # (the workspace may grow: no views of an old one are kept)
            return buffers_from_workspace(p, m)
        wid = get_id()
        key = (wid, id(p))
        hit = memo.get(key)
        if hit is not None and hit[0] is p and hit[1] is slots[wid]:
            return hit[2]
        bufs = buffers_from_workspace(p, m)
        if len(memo) >= 64:
            memo.clear()
        memo[key] = (p, slots[wid], bufs)
        return bufs

    @classmethod
    def from_vllm_config(cls, vllm_config, **kw) -> VllmIndexer:
        """Limits from a ``VllmConfig``: ``scheduler_config.max_num_seqs``, 1 + speculative tokens,
        ``model_config.max_model_len`` and ``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB``."""
        import os

        spec = getattr(vllm_config, "speculative_config", None)
        n_spec = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec is not None else 0
        mb = int(os.environ.get("VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", "512"))
        model = getattr(vllm_config, "model_config", None)
        model_len = getattr(model, "max_model_len", None) if model is not None else None
        kw.setdefault("model_max_model_len", int(model_len) if model_len else None)
        if "prefill_tokens" not in kw:
            try:
                from vllm.v1.attention.backends.mla.indexer import get_max_prefill_buffer_size

                kw["prefill_tokens"] = int(get_max_prefill_buffer_size(vllm_config))
            except (ImportError, AttributeError, AssertionError, TypeError):
                pass  # (not vLLM's config or version: the default)
        return cls(max_num_seqs=int(vllm_config.scheduler_config.max_num_seqs), next_n=1 + n_spec,
                   max_logits_bytes=mb * MiB, **kw)

    def limits(self, kv_cache: torch.Tensor, q_fp8: torch.Tensor, topk_tokens: int, head_dim: int,
               max_model_len: int, total_seq_lens: int, topk_indices_buffer: torch.Tensor, *,
               compress_ratio: int = 1, skip_k_cache_insert: bool = False, candidate_blocks: int = 0,
               candidate_block_size: int = 8, cache_format: CacheFormat | None = None) -> IndexerLimits:
        """The :class:`IndexerLimits` of one op call. ``max_model_len`` and ``total_seq_lens`` are the op's, in
        keys (``// compress_ratio``); the limits' ``max_model_len`` is in tokens (:attr:`model_max_model_len`
        when it has ``max_model_len`` keys, else the longest length that has). A cache the model's compressor
        wrote (``skip_k_cache_insert``) has the byte format of :func:`v4_cache_format`. ``candidate_blocks``
        (``K_b``: the columns of the op's ``candidate_blocks`` buffer; 0 without one) and
        ``candidate_block_size`` become the limits' two-level indexer fields (``IndexerLimits`` raises
        ``ValueError`` when ``(K_b - 1) * b + 1 < topk_tokens``). ``cache_format``: an MXFP4 cache's format
        (:meth:`rocm_mxfp4`; ``q_fp8`` is then the packed MXFP4 queries, uint8)."""
        cr = _compress_ratio(compress_ratio)
        keys = int(max_model_len)
        tokens = keys * cr + cr - 1
        if self.model_max_model_len is not None and self.model_max_model_len // cr == keys:
            tokens = int(self.model_max_model_len)
        fmt = cache_format
        if fmt is None and skip_k_cache_insert:
            fmt = v4_cache_format(cr, int(kv_cache.shape[1]), kv_cache.device, q_fp8.dtype)
        return IndexerLimits(
            max_model_len=tokens, max_num_batched_tokens=int(topk_indices_buffer.shape[0]),
            max_num_seqs=self.max_num_seqs, next_n=self.next_n, n_heads=int(q_fp8.shape[1]),
            head_dim=int(head_dim), topk=int(topk_tokens), block_size=int(kv_cache.shape[1]), compress_ratio=cr,
            prefill_k_tokens=max(int(total_seq_lens), keys), max_logits_bytes=self.max_logits_bytes,
            fp8_dtype=torch.float8_e4m3fn if q_fp8.dtype == torch.uint8 else q_fp8.dtype, cache_format=fmt,
            with_qk=self.with_qk,
            # vLLM's builder on ROCm/CPU sends requests of 1..next_n tokens whose length differs from the first
            # decode's down the prefill path: its chunks may hold max_num_seqs one-token prefills
            min_prefill_query_len=1,
            **({"candidate_blocks": int(candidate_blocks), "candidate_block_size": int(candidate_block_size)}
               if candidate_blocks else {}),
        )

    def __call__(self, hidden_states: torch.Tensor, k_cache_prefix, kv_cache: torch.Tensor, q_fp8: torch.Tensor,
                 k: torch.Tensor | None, weights: torch.Tensor, quant_block_size: int, scale_fmt: str | None,
                 topk_tokens: int, head_dim: int, max_model_len: int, total_seq_lens: int,
                 topk_indices_buffer: torch.Tensor | None, skip_k_cache_insert: bool = False,
                 compress_ratio: int = 1, candidate_blocks: torch.Tensor | None = None,
                 candidate_block_size: int = 0, candidate_write: bool = False) -> torch.Tensor:
        """One indexer step of one layer, as vLLM's op: returns ``topk_indices_buffer`` with rows
        ``[0, hidden_states.shape[0])`` written (request-local positions, -1 = none; compressed-entry indices
        when ``compress_ratio > 1``).

        DeepSeek-V4.1's two-level indexer (docs/spec.md §6a): ``candidate_blocks`` is the model's buffer
        ``[max_num_batched_tokens, K_b]`` int32, shared by the candidate source layer and the index layers after
        it, ``candidate_block_size`` ``b >= 1`` the keys per block (compressed entries when ``C > 1``; the source
        and its consumers share one ``C``), ``candidate_write`` whether this layer is the source. The source
        writes rows ``[0, T)`` (``T = q_fp8.shape[0]``) with the request-local ids of the candidate blocks of each
        token's window (-1 padded; rows of padding tokens and of tokens without keys all -1, as are the rows
        ``[T, hidden_states.shape[0])``) and selects its own top-k over the whole windows; a consumer reads the
        rows of its tokens and selects its top-k only inside their blocks. Every call's limits and plan include
        ``candidate_blocks=K_b, candidate_block_size=b``.

        **Row order differs from vLLM's own op.** Here row ``t`` of ``candidate_blocks`` is always token ``t``'s
        (a decode laid out as a padded ``[B, n]`` grid is unpacked to token rows like its top-k rows). vLLM's op
        writes a decode's candidate rows in the order of its grid, ``candidate_blocks[:B * n]``, after the prefill
        chunks' rows: a padded decode (``requires_padding``, fewer tokens than ``B * n``) in a step with prefill
        tokens overwrites the candidate rows of the first prefill tokens before the consumer layers read them.
        With this drop-in as source and consumers every token reads its own candidates; a step's rows are not
        vLLM's row for row in that case (only a reader of token rows, this drop-in, reads them right).

        Raises:
            ValueError: ``candidate_blocks`` without ``candidate_block_size >= 1`` or not 2-D,
                ``candidate_write`` without ``candidate_blocks``, ``K_b`` blocks of ``b`` that cannot hold
                ``topk_tokens`` positions (``(K_b - 1) * b + 1 < topk_tokens``), and the step's own checks
                (:func:`sparse_indexer.sparse_attn_indexer`: shapes, dtypes, aliasing); nothing is written then.
            NotImplementedError: a compressed cache with ``skip_k_cache_insert=False``, ``quant_block_size !=
                head_dim``, vLLM features the shim does not implement.
        """
        cr = _compress_ratio(compress_ratio)
        if cr > 1 and not skip_k_cache_insert:
            raise NotImplementedError(f"compress_ratio={cr} with skip_k_cache_insert=False: the keys of a compressed "
                                      "cache come from the model's compressor, which writes them before the op")
        kb = _candidate_columns(candidate_blocks, candidate_block_size, candidate_write)
        if quant_block_size != head_dim:
            raise NotImplementedError(f"{quant_block_size=} must equal {head_dim=} (one key scale per token)")
        if topk_indices_buffer is None:
            raise ValueError("topk_indices_buffer must be given")
        if topk_indices_buffer.shape[1] != topk_tokens:
            raise ValueError(f"topk_indices_buffer has {topk_indices_buffer.shape[1]} columns, {topk_tokens=}")
        limits, p = self._limits_and_plan(kv_cache, q_fp8, topk_tokens, head_dim, max_model_len, total_seq_lens,
                                          topk_indices_buffer, cr, bool(skip_k_cache_insert), kb,
                                          candidate_block_size if kb else 8)
        attn_metadata = self.attn_metadata()
        if not isinstance(attn_metadata, dict):
            # Profiling run: reserve here, in the real implementation (the fake runs under FakeTensor mode).
            reserve(self._largest_plan(p), self.manager)
            return self.fake(hidden_states, k_cache_prefix, kv_cache, q_fp8, k, weights, quant_block_size,
                             scale_fmt, topk_tokens, head_dim, max_model_len, total_seq_lens, topk_indices_buffer)
        md = self._metadata(attn_metadata[_layer_name(k_cache_prefix)], limits)
        bufs = self._buffers(p)
        rows = hidden_states.shape[0]
        out = topk_indices_buffer
        if not skip_k_cache_insert and k is None:
            raise ValueError("k must be provided when skip_k_cache_insert is False")
        # the step fills the padding rows [n, q_fp8 rows) with -1; k=None skips the cache write
        k_step = None if skip_k_cache_insert else k
        if kb:
            sparse_attn_indexer(q_fp8, k_step, weights, kv_cache, md, bufs, out, backend=self.backend,
                                scale_fmt=scale_fmt, candidates=candidate_blocks,
                                write_candidates=bool(candidate_write))
        else:
            sparse_attn_indexer(q_fp8, k_step, weights, kv_cache, md, bufs, out, backend=self.backend,
                                scale_fmt=scale_fmt)
        _fill_padding_rows(out, candidate_blocks if kb and candidate_write else None, q_fp8.shape[0], rows)
        return out

    def rocm_mxfp4(self, hidden_states: torch.Tensor, k_cache_prefix, kv_cache: torch.Tensor, q_values: torch.Tensor,
                   q_scale: torch.Tensor, weights: torch.Tensor, topk_tokens: int, head_dim: int, max_model_len: int,
                   topk_indices_buffer: torch.Tensor, compress_ratio: int = 1,
                   candidate_blocks: torch.Tensor | None = None, candidate_block_size: int = 0,
                   candidate_write: bool = False) -> torch.Tensor:
        """Drop-in for vLLM 0.33's ``rocm_mxfp4_sparse_attn_indexer`` (``RocmSparseAttnIndexer.forward_hip``, the
        ROCm MXFP4 indexer of DeepSeek-V4/V4.1 on CDNA4): one step of one layer on the MXFP4 cache the model wrote
        (``k`` is never given), with vLLM's ``RocmMxfp4IndexerMetadata`` (its base fields are read, as
        :meth:`__call__` reads them); returns ``topk_indices_buffer``. Register it with :meth:`fake_rocm_mxfp4`.

        ``q_values [T, H, D / 2]`` uint8 packed e2m1; ``q_scale`` each head's ``D / 32`` UE8M0 bytes, as vLLM's
        query kernel returns them (``[T, H]`` int32 at ``D = 128``) or as ``[T, H, D / 32]`` uint8; ``weights
        [T, H]`` float32 with the softmax and head scales folded in (not the query scales). The cache ``[pages,
        entries, D / 2 + D / 32]`` uint8 is read where it lies, in aiter's tiled page order
        (:func:`rocm_mxfp4_cache_format`), pages any stride apart. ``max_model_len`` is in keys (``// C``), as the
        FP8 op's. Candidate blocks as in :meth:`__call__`.

        vLLM's ROCm MXFP4 builder cuts prefill chunks by their logits alone (its kernel reads the paged cache in
        place; nothing is gathered), so a chunk may hold more keys than the plan's gather buffers
        (``prefill_k_tokens``: :attr:`prefill_tokens` ``// C``, at least one request's keys); such a chunk is cut
        into runs of whole requests that fit (:func:`metadata_from_vllm` with ``split_chunks``), which reads its
        key offsets on the host once per step.

        Raises:
            ValueError, TypeError: bad arguments (shapes, dtypes), before anything is written.
            NotImplementedError: where vLLM's page order cannot be learnt (aiter's ``cache_format``).
        """
        cr = _compress_ratio(compress_ratio)
        kb = _candidate_columns(candidate_blocks, candidate_block_size, candidate_write)
        if topk_indices_buffer is None or topk_indices_buffer.shape[1] != topk_tokens:
            raise ValueError(f"topk_indices_buffer must be [rows, topk_tokens={topk_tokens}], got "
                             f"{None if topk_indices_buffer is None else list(topk_indices_buffer.shape)}")
        qs = _mxfp4_q_scale(q_values, q_scale, head_dim)
        fmt = rocm_mxfp4_cache_format(int(q_values.shape[1]), int(head_dim), int(kv_cache.shape[1]))
        held = DEFAULT_PREFILL_K_TOKENS if self.prefill_tokens is None else int(self.prefill_tokens) // cr
        limits, p = self._limits_and_plan(kv_cache, q_values, topk_tokens, head_dim, max_model_len,
                                          max(int(max_model_len), held), topk_indices_buffer, cr, True, kb,
                                          candidate_block_size if kb else 8, fmt)
        attn_metadata = self.attn_metadata()
        if not isinstance(attn_metadata, dict):
            reserve(self._largest_plan(p), self.manager)
            return topk_indices_buffer
        md = self._metadata(attn_metadata[_layer_name(k_cache_prefix)], limits, split_chunks=True)
        bufs = self._buffers(p)
        out = topk_indices_buffer
        extra = {"candidates": candidate_blocks, "write_candidates": bool(candidate_write)} if kb else {}
        sparse_attn_indexer(q_values, None, weights, kv_cache, md, bufs, out, backend=self.backend, q_scale=qs,
                            **extra)
        _fill_padding_rows(out, candidate_blocks if kb and candidate_write else None, q_values.shape[0],
                           hidden_states.shape[0])
        return out

    def fake_rocm_mxfp4(self, hidden_states, k_cache_prefix, kv_cache, q_values, q_scale, weights, topk_tokens,
                        head_dim, max_model_len, topk_indices_buffer, compress_ratio=1, candidate_blocks=None,
                        candidate_block_size=0, candidate_write=False):
        """:meth:`rocm_mxfp4`'s fake (FakeTensor mode): returns ``topk_indices_buffer``; touches no workspace."""
        return topk_indices_buffer

    def fake(self, hidden_states, k_cache_prefix, kv_cache, q_fp8, k, weights, quant_block_size, scale_fmt,
             topk_tokens, head_dim, max_model_len, total_seq_lens, topk_indices_buffer, skip_k_cache_insert=False,
             compress_ratio=1, candidate_blocks=None, candidate_block_size=0, candidate_write=False):
        """The op's fake (FakeTensor mode): returns ``topk_indices_buffer``; touches no workspace."""
        return topk_indices_buffer


def _candidate_columns(candidate_blocks, candidate_block_size, candidate_write) -> int:
    """``K_b``, the columns of the op's ``candidate_blocks`` (0 without the buffer), after checking the candidate
    arguments of one call."""
    if candidate_blocks is None:
        if candidate_write:
            raise ValueError("candidate_write=True needs candidate_blocks (the buffer the candidate source layer "
                             "writes)")
        return 0
    if (isinstance(candidate_block_size, bool) or not isinstance(candidate_block_size, int)
            or candidate_block_size < 1):
        raise ValueError(f"candidate_block_size={candidate_block_size!r} must be an int >= 1 when candidate_blocks "
                         "is given (keys per candidate block; DeepSeek-V4.1: 8)")
    if not isinstance(candidate_blocks, torch.Tensor) or candidate_blocks.dim() != 2 or candidate_blocks.shape[1] < 1:
        shape = list(candidate_blocks.shape) if isinstance(candidate_blocks, torch.Tensor) else None
        raise ValueError(f"candidate_blocks must be a [max_num_batched_tokens, K_b >= 1] int32 tensor, got "
                         f"{type(candidate_blocks).__name__} {shape}")
    return int(candidate_blocks.shape[1])


def _compress_ratio(c) -> int:
    if isinstance(c, bool) or not isinstance(c, int) or c not in COMPRESS_RATIOS:
        raise ValueError(f"compress_ratio={c!r} is not supported: the indexer op takes one of {COMPRESS_RATIOS} "
                         "(DeepSeek-V4's ratio-128 layers have no indexer)")
    return c


def _fill_padding_rows(out: torch.Tensor, candidates: torch.Tensor | None, t: int, rows: int) -> None:
    """CUDA-graph padding rows ``[t, rows)`` beyond the queries: -1 in the top-k rows (and in the candidate rows
    of a candidate source layer), as vLLM does."""
    if rows > t:
        out[t:rows].fill_(-1)
        if candidates is not None:
            candidates[t:rows].fill_(-1)


def _mxfp4_q_scale(q_values: torch.Tensor, q_scale: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The MXFP4 queries' scale bytes ``[T, H, D / 32]`` uint8 (a view) from vLLM's ``q_scale``: one int32 per
    head (``[T, H]``, ``D = 128``) or the bytes themselves."""
    if not isinstance(q_values, torch.Tensor) or q_values.dim() != 3 or q_values.dtype != torch.uint8:
        raise TypeError(f"q_values must be [T, H, D / 2] uint8 (packed e2m1), got "
                        f"{getattr(q_values, 'dtype', type(q_values).__name__)} {list(getattr(q_values, 'shape', []))}")
    t, h, half = q_values.shape
    if 2 * half != head_dim:
        raise ValueError(f"q_values holds D = {2 * half} (D / 2 = {half} bytes) but head_dim={head_dim}")
    nb = head_dim // 32
    if not isinstance(q_scale, torch.Tensor) or q_scale.dtype not in (torch.int32, torch.uint8):
        raise TypeError(f"q_scale must be [T, H] int32 (4 scale bytes per head) or [T, H, D / 32] uint8, got "
                        f"{getattr(q_scale, 'dtype', type(q_scale).__name__)}")
    if q_scale.shape[:2] != (t, h) or q_scale.numel() * q_scale.element_size() != t * h * nb:
        raise ValueError(f"q_scale must hold {nb} scale bytes per head for q_values' [T={t}, H={h}], got "
                         f"{q_scale.dtype} {list(q_scale.shape)}")
    if not q_scale.is_contiguous():
        raise ValueError(f"q_scale must be contiguous, got strides {q_scale.stride()}")
    return q_scale.view(torch.uint8).view(t, h, nb)


@functools.cache
def rocm_mxfp4_cache_format(num_heads: int, head_dim: int, page_entries: int) -> CacheFormat:
    """The :class:`buffers.CacheFormat` of vLLM's ROCm MXFP4 indexer cache: MXFP4 keys in aiter's tiled page
    order, as vLLM's ``rocm_paged_mxfp4_cache_layout`` reads it from aiter's ``cache_format`` for ``num_heads``
    query heads of ``head_dim`` and ``page_entries`` entries per page (the only place vLLM learns it, so the
    writer and this reader cannot disagree). Cached per arguments, as vLLM caches the layout: every layer asks.

    Raises:
        NotImplementedError: vLLM's layout function or aiter is not importable here.
        ValueError: aiter describes an order that ``"tiled:N,C,L"`` cannot express (vLLM raises it).
    """
    try:
        from vllm.v1.attention.ops.rocm_paged_mxfp4_indexer import rocm_paged_mxfp4_cache_layout
    except ImportError as e:
        raise NotImplementedError(f"the ROCm MXFP4 indexer cache's page order comes from vLLM 0.33 and aiter: "
                                  f"{e}") from e
    try:
        layout = rocm_paged_mxfp4_cache_layout(num_heads, head_dim, page_entries)
    except ImportError as e:
        raise NotImplementedError(f"the ROCm MXFP4 indexer cache's page order comes from aiter's cache_format(), which "
                                  f"is not importable here: {e}") from e
    return CacheFormat.tiled_mxfp4(int(layout.n_per_tile), int(layout.d_per_tile), int(layout.scale_lanes))
