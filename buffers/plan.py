"""The buffer plan: a pure function from :class:`IndexerLimits` to the layout of one arena (SPEC section 9)."""

from __future__ import annotations

import math

import attrs
import torch

from .limits import IndexerLimits

__all__ = ["ALIGN", "FieldPlan", "BufferPlan", "plan", "FIELDS", "TOPK_SCRATCH_COUNTERS", "TOPK_SCRATCH_SAMPLE",
           "TOPK_SCRATCH_SPREAD", "topk_scratch_cap"]

ALIGN = 256  # byte alignment of every field inside the arena

TOPK_SCRATCH_COUNTERS = 32  # int32 counters at the start of each row of ``topk_scratch``
TOPK_SCRATCH_SAMPLE = 4096  # cells the split top-k samples per row (sparse_indexer/ops/top_k_per_row/triton.py)
TOPK_SCRATCH_SPREAD = 4.5  # half-width of its sample bracket, in binomial sigmas


def topk_scratch_cap(lim: IndexerLimits) -> int:
    """Candidate slots per row of ``topk_scratch`` for windows up to ``max_model_len``.

    The split top-k keeps the cells between two sample quantiles (+-4.5 sigma around the ``topk``-th largest of
    a 4096-cell sample); a window of ``L`` cells has about ``9 (sqrt(topk L / 4096) + L / 4096)`` of them. The
    cap is 1.25x that for ``L = max_model_len``, rounded up to a power of two (at least 256); a row with more
    candidates is still exact, through a slower per-row fallback.
    """
    L = lim.max_model_len
    want = 2 * TOPK_SCRATCH_SPREAD * (math.sqrt(lim.topk * L / TOPK_SCRATCH_SAMPLE) + L / TOPK_SCRATCH_SAMPLE) * 1.25
    return max(256, 1 << max(0, math.ceil(want) - 1).bit_length())

# name -> (shape function of the limits, dtype function of the limits); a shape of None means "absent".
# Backends that need scratch add one line here; the field then exists in every plan with its size.
FIELDS = {
    "k_fp8": (lambda lim: (lim.prefill_k_tokens, lim.head_dim), lambda lim: lim.fp8_dtype),
    "k_scale": (lambda lim: (lim.prefill_k_tokens,), lambda lim: torch.float32),
    "logits": (lambda lim: (lim.logits_elems,), lambda lim: torch.float32),
    "qk": (
        lambda lim: (lim.n_heads, lim.max_decode_rows, lim.max_model_len) if lim.with_qk else None,
        lambda lim: torch.float32,
    ),
    # Non-uniform decode (requests with fewer than next_n new tokens) packs queries, weights and top-k rows
    # into [max_num_seqs, next_n] slots (SPEC 7, step 4); only needed when next_n > 1.
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
    # Split-row top-k of the decode rows (Triton): per row, counters, then the positions and the values of up to
    # topk_scratch_cap(lim) candidate cells.
    "topk_scratch": (
        lambda lim: (lim.max_decode_rows, TOPK_SCRATCH_COUNTERS + 2 * topk_scratch_cap(lim)),
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
    ``limits.with_qk``; ``q_pack``, ``w_pack``, ``topk_pack`` when ``next_n == 1``) take no bytes.
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
