"""``fp8_paged_mqa_topk``: the decode indexer's selection with its scoring, in one call (docs/spec.md §6b).

The result is exactly ``top_k_per_row`` of the ``fp8_paged_mqa_logits`` scores over each row's window
``[0, limit[r])``; a fused implementation (``FUSED = True`` in its module: the CUDA backend's kernel on Hopper)
computes it without writing the ``[B * next_n, W]`` scores to memory. ``auto`` tries only the fused
implementations; a call none of them takes runs the two ops, each through its own ``auto`` (on NVIDIA GPUs the
Gluon or Triton logits and the CUDA top-k, on the CPU the reference), into a scores scratch.
"""

from __future__ import annotations

import functools

import torch

from buffers import BufferTooSmall

from ..._runtime import checks as C
from ..._runtime import dispatch as _dispatch
from ..._runtime import library
from ...kcache import as_3d
from ..fp8_mqa_logits import LOGITS_DTYPES
from ..fp8_paged_mqa_logits import check_paged_inputs, check_paged_values, fp8_paged_mqa_logits
from ..top_k_per_row import top_k_per_row
from .reference import compose
from .workspace import FUSED_WORKSPACE_COLS

__all__ = ["FUSED_WORKSPACE_COLS", "fp8_paged_mqa_topk"]

OP = "fp8_paged_mqa_topk"


def fp8_paged_mqa_topk(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor,
                       block_table: torch.Tensor, *, out: torch.Tensor, logits: torch.Tensor | None = None,
                       workspace: torch.Tensor | None = None, backend: str | None = None,
                       check_values: bool | None = None, logits_dtype: torch.dtype | None = None,
                       _checked: bool = False) -> torch.Tensor:
    """Select, per decode row, the ``topk = out.shape[1]`` key positions with the largest scores.

    Row ``r = b * next_n + j`` scores the request-local key positions ``p < limit[r]`` as
    :func:`sparse_indexer.fp8_paged_mqa_logits` does (``limit = row_limits(context_lens, next_n)``) and selects
    as :func:`sparse_indexer.top_k_per_row` does on the window ``[0, limit[r])``: ``limit <= topk`` gives ``0, 1,
    ..., limit - 1, -1, ...``; a longer window the ``topk`` positions of its largest scores, in any order, ties
    either way, ``-inf`` and NaN below every finite score.

    Args:
        q: ``[B, next_n, H, D]`` ``float8_e4m3fn`` queries (unit last stride), their scale folded into ``weights``.
        kv_cache: ``[num_blocks, block_size, D + 4]`` (or 4-D) uint8 paged cache in the plain format (e4m3fn
            values, float32 scales, flat order; docs/spec.md §4).
        weights: ``[B * next_n, H]`` float32.
        context_lens: ``[B]`` or ``[B, next_n]`` int32.
        block_table: ``[B, max_blocks]`` int32.
        out: ``[B * next_n, topk]`` int32 (unit last stride), written in place.
        logits: optional ``[B * next_n, W]`` float32 or bfloat16 (unit last stride, ``W >= max(limit)``).
            Afterwards its cells inside each row's window hold the scores the selection was made on (rounded once
            to its dtype); the other cells are undefined. Composing backends use it as their scores scratch
            (allocated with ``W = max_blocks * block_size`` when ``None``); a fused kernel writes it only when it
            is given.
        workspace: optional ``[>= B * next_n, >= FUSED_WORKSPACE_COLS]`` int32 scratch (unit last stride) of the
            fused kernels (:mod:`.workspace`: per row three radix histograms and 8 counters); the other backends
            ignore it. Its contents before and after a call are undefined.
        backend: ``None``/``"auto"`` (the fused implementations available on the device, then the composition of
            the two ops' own ``auto``) or a backend's name (``sparse_indexer.backends.names()``), which runs its
            own implementation (reference, Triton and aiter: their logits then their top-k).
        check_values: check the context lengths against ``W`` and ``block_table``, and the block ids against the
            cache (reads device values: a sync on a GPU); default: on the CPU only. Unchecked, the limits are
            clamped into ``[0, min(W, max_blocks * block_size)]`` and a block id outside the cache scores as a zero
            key (docs/spec.md §10).
        logits_dtype: the dtype of the scores the selection runs on when ``logits`` is ``None`` (float32, the
            default, or bfloat16); must match ``logits.dtype`` when both are given.

    Raises:
        BufferTooSmall: ``workspace`` has fewer than ``B * next_n`` rows or ``FUSED_WORKSPACE_COLS`` columns.

    Returns:
        ``out``.

    ``_checked=True`` is for :func:`sparse_indexer.sparse_attn_indexer` alone, which proves every argument itself.
    """
    if _checked:
        library.call(OP, backend, q.device, q, as_3d(kv_cache), weights, context_lens, block_table,
                     **_kwargs(out, logits, workspace, logits_dtype))
        return out
    b, next_n, _, _, dev, _, kv3, lay, capacity = check_paged_inputs(q, kv_cache, weights, context_lens, block_table)
    rows = b * next_n
    C.selection(out, rows, dev, logits, logits_dtype, LOGITS_DTYPES, (rows, None))
    if workspace is not None:
        C.tensor("workspace", workspace, ndim=2, dtypes=torch.int32, device=dev, last_contiguous=True)
        have, cols = workspace.shape
        if have < rows or cols < FUSED_WORKSPACE_COLS:
            raise BufferTooSmall("workspace", rows * max(cols, FUSED_WORKSPACE_COLS), workspace.numel(),
                                 f"fused top-k workspace of shape {tuple(workspace.shape)}: needs >= {rows} rows "
                                 f"of >= {FUSED_WORKSPACE_COLS} int32")
    C.disjoint({"out": out, "logits": logits, "workspace": workspace},
               {"q": q, "kv_cache": kv_cache, "weights": weights, "context_lens": context_lens,
                "block_table": block_table})
    if C.want_value_checks(check_values, context_lens, block_table) and context_lens.numel():
        if logits is None:
            check_paged_values(context_lens, block_table, None, next_n, capacity, capacity, lay, None)
        else:
            check_paged_values(context_lens, block_table, None, next_n, logits.shape[1], capacity, lay, "logits")
    library.call(OP, backend, dev, q, kv3, weights, context_lens, block_table,
                 **_kwargs(out, logits, workspace, logits_dtype))
    return out


def _kwargs(out, logits, workspace, logits_dtype) -> dict:
    """The keyword arguments of an implementation call: the tensors given, and ``logits_dtype`` where no
    ``logits`` says the dtype (implementations that leave it out of their signature never see it)."""
    kw = {"out": out}
    if logits is not None:
        kw["logits"] = logits
    elif logits_dtype is not None:
        kw["logits_dtype"] = logits_dtype
    if workspace is not None:
        kw["workspace"] = workspace
    return kw


def _composition(q, kv_cache, weights, context_lens, block_table, *, out, logits=None, workspace=None,
                 logits_dtype=None) -> None:
    """What ``auto`` runs when no fused implementation takes a call: the paged logits op (``clean=False``) into
    the scores scratch, then the top-k, each through its own ``auto``."""
    compose(_auto_logits, _auto_top_k, q, kv_cache, weights, context_lens, block_table, out=out, logits=logits,
            logits_dtype=logits_dtype)


_auto_logits = functools.partial(fp8_paged_mqa_logits, backend=None, _checked=True)
_auto_top_k = functools.partial(top_k_per_row, backend=None, _checked=True)
_dispatch.compose(OP, _composition)
