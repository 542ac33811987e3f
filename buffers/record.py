"""``Buffers``: the immutable record of scratch views that the indexer threads through every call."""

from __future__ import annotations

import math

import attrs
import torch

from .limits import FP8_DTYPES, LOGITS_DTYPES
from .plan import ALIGN, BufferPlan

__all__ = ["Buffers", "BufferTooSmall"]

OPTIONAL = ("qk", "q_pack", "q_scale_pack", "w_pack", "topk_pack", "topk_scratch", "cp_scratch", "block_scores",
            "cand_pack")


SIZED_BY = {
    "k_fp8": "raise IndexerLimits.prefill_k_tokens",
    "k_scale": "raise IndexerLimits.prefill_k_tokens",
    "logits": "raise IndexerLimits.max_logits_bytes (prefill chunks) or max_num_seqs * next_n * max_model_len "
              "(decode)",
    "qk": "plan with IndexerLimits(with_qk=True); its size follows max_num_seqs * next_n and max_model_len",
    "q_pack": "raise IndexerLimits.max_num_seqs * next_n (planned only when next_n > 1)",
    "q_scale_pack": "raise IndexerLimits.max_num_seqs * next_n (planned only for MXFP4 caches with next_n > 1)",
    "w_pack": "raise IndexerLimits.max_num_seqs * next_n (planned only when next_n > 1)",
    "topk_pack": "raise IndexerLimits.max_num_seqs * next_n (planned only when next_n > 1; topk columns)",
    "topk_scratch": "raise IndexerLimits.max_num_seqs * next_n (its rows; its columns follow max_model_len and "
                    "topk), or use a record built by buffers.allocate / Buffers.from_arena",
    "cp_scratch": "plan with IndexerLimits(world_size=...) of the process group; its rows follow "
                  "max_num_seqs * next_n (or max_decode_logits_bytes), its columns world_size and topk",
    "block_scores": "plan with IndexerLimits(candidate_blocks=...) (its size follows max_num_seqs * next_n, "
                    "max_model_len and the prefill caps)",
    "cand_pack": "plan with IndexerLimits(candidate_blocks=...) (planned only when next_n > 1)",
    "workspace": "pass Buffers.topk_scratch_view(rows) of a plan with IndexerLimits.max_num_seqs * next_n >= rows",
}
"""What to change when a field is too small: a :class:`BufferTooSmall` says it."""


class BufferTooSmall(ValueError):
    """A request needs more of a buffer field than the record holds.

    Attributes: ``field`` (the field's name), ``needed`` and ``available`` (in elements of the field's dtype).
    The message names the limits that size the field (:data:`SIZED_BY`).
    """

    def __init__(self, field: str, needed: int, available: int, what: str = ""):
        self.field = field
        self.needed = int(needed)
        self.available = int(available)
        extra = f" ({what})" if what else ""
        fix = SIZED_BY.get(field, "raise the IndexerLimits that size it")
        super().__init__(
            f"buffer {field!r} is too small{extra}: needs {self.needed} elements, holds {self.available}; {fix}"
        )


def _tensor(ndim, dtypes):
    ndims = ndim if isinstance(ndim, tuple) else (ndim,)

    def check(inst, attribute, value):
        if value is None and attribute.name in OPTIONAL:
            return
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"Buffers.{attribute.name} must be a tensor, got {type(value).__name__}")
        if value.dim() not in ndims:
            raise ValueError(f"Buffers.{attribute.name} must be {' or '.join(map(str, ndims))}-D, got shape "
                             f"{tuple(value.shape)}")
        if value.dtype not in dtypes:
            raise TypeError(f"Buffers.{attribute.name} must have dtype in {dtypes}, got {value.dtype}")
        if not value.is_contiguous():
            raise ValueError(f"Buffers.{attribute.name} must be contiguous, got strides {value.stride()}")

    return check


@attrs.frozen(eq=False, kw_only=True)
class Buffers:
    """Views of the indexer's scratch memory (docs/spec.md §9). Build it with :func:`buffers.allocate` or
    :meth:`Buffers.from_arena`; nothing in the library allocates in their place.

    Attributes:
        k_fp8: ``[K, D]`` fp8 — gathered keys of one prefill chunk (``K``: the most keys a chunk allowed by the
            limits can gather, at most ``prefill_k_tokens``; :func:`buffers.plan.prefill_extremes`); with an MXFP4
            cache (docs/spec.md §3a) ``[K, D / 2]`` uint8, their packed e2m1 values.
        k_scale: ``[K]`` float32 — their scales; with an MXFP4 cache ``[K, D / 32]`` uint8, their UE8M0 bytes.
        logits: ``[E]`` float32 or bfloat16 (``IndexerLimits.logits_dtype``), flat — one prefill chunk's ``[M, N]``
            logits (``[M, longest window]`` with ``IndexerLimits.compressed_prefill_logits``) or one decode
            sub-batch's logits ``[decode_batch * next_n, W]`` (``E``: :func:`buffers.plan.logits_elems`).
        qk: ``[H, decode_batch * next_n, max_model_len]`` float32 or ``None`` — per-head scores of one decode
            sub-batch, for backends that need them.
        q_pack, w_pack, topk_pack: ``[max_num_seqs * next_n, H, D]`` fp8, ``[max_num_seqs * next_n, H]``
            float32, ``[max_num_seqs * next_n, topk]`` int32, or ``None`` when ``next_n == 1`` — the padded
            decode slots of a step whose requests have fewer than ``next_n`` new tokens. With an MXFP4 cache
            ``q_pack`` is ``[max_num_seqs * next_n, H, D / 2]`` uint8 and ``q_scale_pack`` ``[max_num_seqs *
            next_n, H, D / 32]`` uint8 holds the queries' scale bytes (``None`` otherwise).
        topk_scratch: ``[decode_batch * next_n, 32 + 2 * cap]`` int32 or ``None`` — the split-row top-k's global
            scratch for the rows of one decode sub-batch (per row: counters, then positions and values of up to ``cap``
            candidates, ``sparse_indexer.ops.top_k_per_row.workspace.topk_scratch_cap``; the plan's width is the widest
            ``topk_workspace`` of the backend registry); backends that do not split rows ignore it.
            Every plan has it (while a registered backend declares a workspace); a record built by hand may leave
            it out (the step then passes no workspace).
            It is not a pytree leaf: a record rebuilt by ``torch.utils._pytree`` (``torch.func`` transforms,
            which run the reference backend) has ``topk_scratch=None``.
        cp_scratch: ``[decode_batch * next_n, (2 + 4 * world_size) * topk + 2]`` int32 or ``None`` — context
            parallel only (``IndexerLimits.world_size > 1``): the local candidates, the gathered candidates and the
            merge of one piece of rows (:mod:`sparse_indexer.parallel`); with ``candidate_blocks``, as many columns
            as the candidate-block merge needs, where that is more (:func:`buffers.plan.cp_scratch_cols`). Not a
            pytree leaf either.
        block_scores: ``[E]`` int32, flat, or ``None`` — two-level indexer only (``IndexerLimits.candidate_blocks``):
            the block scores of a source layer's ``select_candidate_blocks`` for one prefill chunk or decode
            sub-batch (``E``: :func:`buffers.plan.block_scores_elems`). Not a pytree leaf.
        cand_pack: ``[max_num_seqs * next_n, K_b]`` int32 or ``None`` — two-level indexer with ``next_n > 1``:
            the candidate rows of a non-uniform decode's padded slots (written by a source layer, read by a
            consumer).
    """

    k_fp8: torch.Tensor = attrs.field(validator=_tensor(2, (*FP8_DTYPES, torch.uint8)))
    k_scale: torch.Tensor = attrs.field(validator=_tensor((1, 2), (torch.float32, torch.uint8)))
    logits: torch.Tensor = attrs.field(validator=_tensor(1, LOGITS_DTYPES))
    qk: torch.Tensor | None = attrs.field(default=None, validator=_tensor(3, (torch.float32,)))
    q_pack: torch.Tensor | None = attrs.field(default=None, validator=_tensor(3, (*FP8_DTYPES, torch.uint8)))
    q_scale_pack: torch.Tensor | None = attrs.field(default=None, validator=_tensor(3, (torch.uint8,)))
    w_pack: torch.Tensor | None = attrs.field(default=None, validator=_tensor(2, (torch.float32,)))
    topk_pack: torch.Tensor | None = attrs.field(default=None, validator=_tensor(2, (torch.int32,)))
    topk_scratch: torch.Tensor | None = attrs.field(default=None, validator=_tensor(2, (torch.int32,)))
    cp_scratch: torch.Tensor | None = attrs.field(default=None, validator=_tensor(2, (torch.int32,)))
    block_scores: torch.Tensor | None = attrs.field(default=None, validator=_tensor(1, (torch.int32,)))
    cand_pack: torch.Tensor | None = attrs.field(default=None, validator=_tensor(2, (torch.int32,)))

    def __attrs_post_init__(self):
        if self.k_scale.shape[0] != self.k_fp8.shape[0]:
            raise ValueError(
                f"Buffers.k_scale has {self.k_scale.shape[0]} rows but k_fp8 has {self.k_fp8.shape[0]}"
            )
        mx = self.mxfp4
        # (the trailing dimensions: a record may also hold stacks of layers, [L, ...], under torch.func.vmap)
        kd, sd = self.k_fp8.dim(), self.k_scale.dim()
        k_last, s_last = self.k_fp8.shape[-1], self.k_scale.shape[-1]
        if (mx and (self.k_scale.dtype != torch.uint8 or sd != kd or s_last * 16 != k_last)
                or not mx and (self.k_scale.dtype != torch.float32 or sd != kd - 1)):
            raise ValueError(
                "Buffers.k_scale must be " + (f"[K, {k_last // 16}] uint8 (MXFP4 scale bytes, k_fp8 is "
                                              "uint8)" if mx else f"[K] float32 (k_fp8 is {self.k_fp8.dtype})")
                + f", got {self.k_scale.dtype} {tuple(self.k_scale.shape)}")
        if self.q_pack is not None and (self.q_pack.dtype == torch.uint8) != mx:
            raise ValueError(f"Buffers.q_pack is {self.q_pack.dtype} but k_fp8 is {self.k_fp8.dtype}: MXFP4 records "
                             "hold uint8 keys and queries, FP8 records fp8 ones")
        if (self.q_scale_pack is not None) != (mx and self.q_pack is not None):
            raise ValueError("Buffers.q_scale_pack (MXFP4 query scale bytes) goes with an MXFP4 record's q_pack: "
                             f"q_pack is {None if self.q_pack is None else self.q_pack.dtype}, q_scale_pack "
                             f"{'given' if self.q_scale_pack is not None else 'missing'}")
        for name in ("k_scale", "logits", *OPTIONAL):
            t = getattr(self, name)
            if t is not None and t.device != self.k_fp8.device:
                raise ValueError(f"Buffers.{name} is on {t.device} but k_fp8 is on {self.k_fp8.device}")

    # ---------------------------------------------------------------- views
    @property
    def device(self) -> torch.device:
        return self.k_fp8.device

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.k_fp8.dtype

    @property
    def mxfp4(self) -> bool:
        """Whether the record holds MXFP4 keys and queries (uint8 ``k_fp8``: docs/spec.md §3a)."""
        return self.k_fp8.dtype == torch.uint8

    @property
    def head_dim(self) -> int:
        return self.k_fp8.shape[1] * 2 if self.mxfp4 else self.k_fp8.shape[1]

    @property
    def k_capacity(self) -> int:
        """Key tokens the prefill gather buffers hold."""
        return self.k_fp8.shape[0]

    @property
    def logits_capacity(self) -> int:
        """Elements of the flat logits buffer (of its dtype, float32 or bfloat16)."""
        return self.logits.shape[0]

    def k_view(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` rows of the gather buffers: (``[n, D]`` fp8, ``[n]`` float32), or with MXFP4 keys
        (``[n, D / 2]`` uint8, ``[n, D / 32]`` uint8)."""
        if n > self.k_capacity:
            raise BufferTooSmall("k_fp8", n, self.k_capacity, "gathered prefill key tokens")
        return self.k_fp8[:n], self.k_scale[:n]

    def logits_view(self, rows: int, cols: int) -> torch.Tensor:
        """A contiguous ``[rows, cols]`` view at the start of ``logits`` (its dtype: float32 or bfloat16)."""
        if rows < 0 or cols < 0:
            raise ValueError(f"logits_view needs rows, cols >= 0, got {rows=} {cols=}")
        if rows * cols > self.logits_capacity:
            raise BufferTooSmall("logits", rows * cols, self.logits_capacity, f"[{rows}, {cols}] logits")
        return self.logits[: rows * cols].view(rows, cols)

    def qk_view(self, rows: int, cols: int) -> torch.Tensor:
        """A ``[H, rows, cols]`` float32 view of ``qk`` (rows and columns packed contiguously per head)."""
        if self.qk is None:
            raise BufferTooSmall("qk", 1, 0, "this record was planned without qk (IndexerLimits.with_qk)")
        h = self.qk.shape[0]
        per_head = self.qk.shape[1] * self.qk.shape[2]
        if rows * cols > per_head:
            raise BufferTooSmall("qk", h * rows * cols, h * per_head, f"[{h}, {rows}, {cols}] per-head scores")
        return self.qk.view(h, per_head)[:, : rows * cols].view(h, rows, cols)

    def topk_scratch_view(self, rows: int) -> torch.Tensor:
        """``topk_scratch[:rows]``: the top-k workspace of ``rows`` rows (``top_k_per_row(..., workspace=)``)."""
        if self.topk_scratch is None:
            raise BufferTooSmall("topk_scratch", rows, 0, "this record has no top-k scratch")
        if rows > self.topk_scratch.shape[0]:
            raise BufferTooSmall("topk_scratch", rows * self.topk_scratch.shape[1], self.topk_scratch.numel(),
                                 f"top-k workspace rows: {rows} > {self.topk_scratch.shape[0]}")
        return self.topk_scratch[:rows]

    def block_scores_view(self, rows: int, cols: int) -> torch.Tensor:
        """A contiguous ``[rows, cols]`` int32 view at the start of ``block_scores`` (``select_candidate_blocks(...,
        workspace=)``)."""
        if self.block_scores is None:
            raise BufferTooSmall("block_scores", rows * cols, 0, "this record was planned without candidate blocks")
        if rows * cols > self.block_scores.shape[0]:
            raise BufferTooSmall("block_scores", rows * cols, self.block_scores.shape[0],
                                 f"[{rows}, {cols}] block scores")
        return self.block_scores[: rows * cols].view(rows, cols)

    def cand_pack_view(self, rows: int, cols: int) -> torch.Tensor:
        """``cand_pack[:rows]``: the packed candidate rows of a non-uniform decode (``cols``: ``K_b``)."""
        if self.cand_pack is None:
            raise BufferTooSmall("cand_pack", rows * cols, 0, "this record was planned without candidate blocks or "
                                 "with next_n == 1")
        if rows > self.cand_pack.shape[0] or cols != self.cand_pack.shape[1]:
            raise BufferTooSmall("cand_pack", rows * cols, self.cand_pack.numel(),
                                 f"[{rows}, {cols}] packed candidate rows (have {list(self.cand_pack.shape)})")
        return self.cand_pack[:rows]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The present fields by name (optional ones only when planned)."""
        out = {"k_fp8": self.k_fp8, "k_scale": self.k_scale, "logits": self.logits}
        for name in OPTIONAL:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def pack_views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_pack[:rows], w_pack[:rows], topk_pack[:rows])`` for non-uniform decode."""
        if self.q_pack is None or self.w_pack is None or self.topk_pack is None:
            raise BufferTooSmall("q_pack", rows, 0, "this record was planned with next_n == 1: no decode packing")
        if rows > self.q_pack.shape[0]:
            raise BufferTooSmall("q_pack", rows, self.q_pack.shape[0], "packed decode rows")
        return self.q_pack[:rows], self.w_pack[:rows], self.topk_pack[:rows]

    def q_scale_pack_view(self, rows: int) -> torch.Tensor:
        """``q_scale_pack[:rows]``: the MXFP4 queries' packed scale bytes of a non-uniform decode."""
        if self.q_scale_pack is None:
            raise BufferTooSmall("q_scale_pack", rows, 0, "this record holds no MXFP4 query scales")
        if rows > self.q_scale_pack.shape[0]:
            raise BufferTooSmall("q_scale_pack", rows, self.q_scale_pack.shape[0], "packed decode rows")
        return self.q_scale_pack[:rows]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(t.shape) * t.element_size() for t in self.tensors().values())

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_arena(cls, plan, arena: torch.Tensor) -> Buffers:
        """Carve a caller-owned ``uint8`` arena into a record following ``plan`` (a :class:`BufferPlan`).

        ``arena``: 1-D contiguous ``uint8`` tensor of at least ``plan.total_bytes`` bytes whose data pointer is
        256-byte aligned. The record's fields are views of it; nothing is copied or allocated.
        """
        if not isinstance(plan, BufferPlan):
            raise TypeError(f"plan must be a BufferPlan, got {type(plan).__name__}")
        if not isinstance(arena, torch.Tensor):
            raise TypeError(f"arena must be a torch.Tensor, got {type(arena).__name__}")
        if arena.dtype != torch.uint8 or arena.dim() != 1:
            raise ValueError(f"arena must be a 1-D uint8 tensor, got {arena.dtype} of shape {tuple(arena.shape)}")
        if not arena.is_contiguous():
            raise ValueError(f"arena must be contiguous, got stride {arena.stride()}")
        if arena.numel() < plan.total_bytes:
            raise ValueError(f"arena holds {arena.numel()} bytes but the plan needs total_bytes={plan.total_bytes}")
        if arena.numel() and arena.data_ptr() % ALIGN:
            raise ValueError(
                f"arena data pointer {arena.data_ptr():#x} is not {ALIGN}-byte aligned "
                f"(offset {arena.data_ptr() % ALIGN}); slice it at an aligned offset"
            )
        views = {f.name: arena[f.offset : f.offset + f.nbytes].view(f.dtype).view(f.shape) for f in plan.fields}
        return cls(**views)

    def split_storages(self) -> Buffers:
        """The same record over the same bytes, each field in a storage object of its own (for ``torch.compile``).

        The fields of a carved arena are views of different dtypes of one storage. ``torch.compile``
        (AOTAutograd) refuses to mutate graph inputs that alias each other with different dtypes, although the
        fields never share a byte. This re-exports each field through DLPack: no copy and no allocation (every
        new field has the old one's ``data_ptr()``, the arena stays alive as long as they do), but each field is
        now its own storage, so a compiled step mutates every field in place as a separate input. Eager code
        does not need it. Requires contiguous fields (true for every record built from a plan).
        """

        def own(t):
            if t is None:
                return None
            raw = torch.from_dlpack(t.view(-1).view(torch.uint8).__dlpack__())  # new storage, same memory
            return raw.view(t.dtype).view(t.shape)

        return Buffers(**{n: own(getattr(self, n)) for n in (*_FIELDS, "topk_scratch", "cp_scratch", "block_scores")})


# The pytree leaves. ``topk_scratch`` is not one: only the Triton backend uses it, never under ``torch.func``
# transforms (which run the reference), so a rebuilt record simply has none.
_FIELDS = ("k_fp8", "k_scale", "logits", "qk", "q_pack", "q_scale_pack", "w_pack", "topk_pack", "cand_pack")


# ---------------------------------------------------------------- pytree
def _flatten(b: Buffers):
    return [getattr(b, n) for n in _FIELDS], None


def _unflatten(children, context) -> Buffers:
    # Leaves may be stacks ([L, ...] for vmap over layers), transformed tensors or tracing placeholders; the
    # validators and the post-init checks expect one layer's real tensors, so neither runs here.
    with attrs.validators.disabled():
        b = object.__new__(Buffers)
        for name, value in zip(_FIELDS, children):
            object.__setattr__(b, name, value)
        object.__setattr__(b, "topk_scratch", None)
        object.__setattr__(b, "cp_scratch", None)
        object.__setattr__(b, "block_scores", None)
        return b


def _flatten_with_keys(b: Buffers):
    from torch.utils._pytree import GetAttrKey

    return [(GetAttrKey(n), getattr(b, n)) for n in _FIELDS], None


def _register_pytree() -> None:
    """Register :class:`Buffers` as a pytree node (children: the fields of ``_FIELDS``, ``None`` when absent), so
    ``torch.func.vmap``/``functionalize``, ``make_fx`` and ``torch.utils._pytree`` flatten it to its tensors."""
    from torch.utils import _pytree

    if Buffers in _pytree.SUPPORTED_NODES:
        return
    _pytree.register_pytree_node(Buffers, _flatten, _unflatten, serialized_type_name="buffers.Buffers",
                                 flatten_with_keys_fn=_flatten_with_keys)


_register_pytree()
