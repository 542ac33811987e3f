"""``fp8_mqa_topk``: the prefill indexer's selection with its scoring, in one call (docs/spec.md §6b).

The result is exactly ``top_k_per_row`` of the ``fp8_mqa_logits`` scores over each query's window ``[ks, ke)``
(positions relative to ``ks``). No fused prefill kernel exists yet: every backend composes the two ops into a
scores scratch of ``R`` query rows (``R <= M``: the rows run in blocks of ``R``), and ``auto`` composes the two
ops' own ``auto`` (on NVIDIA GPUs the Gluon or Triton logits and the CUDA top-k, on the CPU the reference). A
fused implementation (``FUSED = True`` in its module) would be tried first, as for ``fp8_paged_mqa_topk``.
"""

from __future__ import annotations

import functools

import torch

from ..._runtime import checks as C
from ..._runtime import dispatch as _dispatch
from ..._runtime import library
from ..fp8_mqa_logits import LOGITS_DTYPES, check_ragged_inputs, check_ragged_windows, fp8_mqa_logits
from ..top_k_per_row import top_k_per_row
from .reference import compose

__all__ = ["fp8_mqa_topk"]

OP = "fp8_mqa_topk"


def fp8_mqa_topk(q: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                 cu_seqlen_ks: torch.Tensor, cu_seqlen_ke: torch.Tensor, *, out: torch.Tensor,
                 logits: torch.Tensor | None = None, backend: str | None = None, check_values: bool | None = None,
                 logits_dtype: torch.dtype | None = None, _checked: bool = False) -> torch.Tensor:
    """Select, per query row ``m``, the ``topk = out.shape[1]`` keys of its window ``[ks[m], ke[m])`` with the
    largest scores, as positions relative to ``ks[m]``.

    The scores are :func:`sparse_indexer.fp8_mqa_logits`'s and the selection is
    :func:`sparse_indexer.top_k_per_row`'s with ``row_starts = ks``, ``row_ends = ke``: a window of
    ``len <= topk`` keys gives ``0, 1, ..., len - 1, -1, ...``; a longer one the ``topk`` positions of its largest
    scores, in any order, ties either way, ``-inf`` and NaN below every finite score.

    Args:
        q: ``[M, H, D]`` fp8 queries (unit last stride), their scale folded into ``weights``.
        k_fp8: ``[N, D]`` fp8 keys (unit last stride); another FP8 format than ``q``'s is an explicit mix, which
            only the reference backend computes (``auto`` then runs it).
        k_scale: ``[N]`` float32 key scales.
        weights: ``[M, H]`` float32.
        cu_seqlen_ks: ``[M]`` int32, first key of each query's window.
        cu_seqlen_ke: ``[M]`` int32, one past its last key (``ke <= N``; ``ke <= ks`` is an empty window).
        out: ``[M, topk]`` int32 (unit last stride), written in place.
        logits: optional ``[R, N]`` float32 or bfloat16 scores scratch (unit last stride), ``1 <= R <= M``: query
            rows are scored and selected ``R`` at a time, so the scratch is ``R * N`` cells whatever ``M`` is.
            With ``R == M`` its in-window cells hold the scores the selection was made on afterwards (rounded once
            to its dtype); other cells are undefined. ``None``: ``[M, N]`` is allocated.
        backend: ``None``/``"auto"`` (the composition of the two ops' own ``auto``) or a backend's name
            (``sparse_indexer.backends.names()``), which composes its own logits and top-k.
        check_values: check the windows against ``N`` (reads device values: a sync on a GPU); default: on the CPU
            only. Unchecked windows are clamped (``ks >= 0``, ``ke <= N``; docs/spec.md §10).
        logits_dtype: the dtype of the scores the selection runs on when ``logits`` is ``None`` (float32, the
            default, or bfloat16); must match ``logits.dtype`` when both are given.

    Returns:
        ``out``.

    ``_checked=True`` is for :func:`sparse_indexer.sparse_attn_indexer` alone, which proves every argument itself.
    """
    if not _checked:
        m, n, dev = check_ragged_inputs(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke)
        C.selection(out, m, dev, logits, logits_dtype, LOGITS_DTYPES, (None, n))
        if logits is not None:
            if logits.shape[0] > m or (m and logits.shape[0] < 1):
                raise ValueError(f"logits must have between 1 and M = {m} rows (a scratch of R <= M query rows), got "
                                 f"shape {list(logits.shape)}")
        C.disjoint({"out": out, "logits": logits},
                   {"q": q, "k_fp8": k_fp8, "k_scale": k_scale, "weights": weights, "cu_seqlen_ks": cu_seqlen_ks,
                    "cu_seqlen_ke": cu_seqlen_ke})
        if C.want_value_checks(check_values, cu_seqlen_ks, cu_seqlen_ke):
            check_ragged_windows(cu_seqlen_ks, cu_seqlen_ke, n)
    kw = {"out": out}
    if logits is not None:
        kw["logits"] = logits
    elif logits_dtype is not None:
        kw["logits_dtype"] = logits_dtype
    library.call(OP, backend, q.device, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, **kw)
    return out


def _composition(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, logits=None,
                 logits_dtype=None) -> None:
    """What ``auto`` runs (no fused prefill kernel exists): the ragged logits op (``clean=False``) into the
    scores scratch, then the top-k, each through its own ``auto``, block by block."""
    compose(_auto_logits, _auto_top_k, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out=out,
            logits=logits, logits_dtype=logits_dtype)


_auto_logits = functools.partial(fp8_mqa_logits, backend=None, _checked=True)
_auto_top_k = functools.partial(top_k_per_row, backend=None, _checked=True)
_dispatch.compose(OP, _composition)
