"""Triton ``fp8_mqa_topk``: the Triton ragged logits into the scores scratch, then the Triton top-k, in blocks of
the scratch's rows (:func:`.reference.compose`)."""

from __future__ import annotations

from ..._runtime.triton_compat import fix_interpreter
from ..fp8_mqa_logits.triton import fp8_mqa_logits as triton_logits
from ..top_k_per_row.triton import top_k_per_row as triton_top_k
from .reference import compose

fix_interpreter()

__all__ = ["FUSED", "fp8_mqa_topk"]

FUSED = False
"""Two kernels, not one: ``auto`` composes the ops' own ``auto`` instead of running it."""


def fp8_mqa_topk(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, logits=None,
                 logits_dtype=None) -> None:
    """See :func:`sparse_indexer.fp8_mqa_topk`; arguments are checked. Raises ``NotImplementedError`` (before
    anything is written) for what the Triton ragged logits do not take (``D > 256``, a mix of FP8 formats)."""
    compose(triton_logits, triton_top_k, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out=out,
            logits=logits, logits_dtype=logits_dtype)
