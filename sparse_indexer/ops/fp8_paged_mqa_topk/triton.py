"""Triton ``fp8_paged_mqa_topk``: the Triton paged logits into the scores scratch, then the Triton top-k (the
portable composition, :func:`.reference.compose`). The top-k runs without the split-row workspace."""

from __future__ import annotations

from ..._runtime.triton_compat import fix_interpreter
from ..fp8_paged_mqa_logits.triton import fp8_paged_mqa_logits as triton_logits
from ..top_k_per_row.triton import top_k_per_row as triton_top_k
from .reference import compose

fix_interpreter()

__all__ = ["FUSED", "fp8_paged_mqa_topk"]

FUSED = False
"""Two kernels, not one: ``auto`` composes the ops' own ``auto`` instead of running it."""


def fp8_paged_mqa_topk(q, kv_cache, weights, context_lens, block_table, *, out, logits=None, workspace=None,
                       logits_dtype=None) -> None:
    """See :func:`sparse_indexer.fp8_paged_mqa_topk`; ``kv_cache`` is the 3-D view, arguments are checked. Raises
    ``NotImplementedError`` (before anything is written) for what the Triton paged logits do not take (D or block
    size not a power of two, ``next_n > 4``). ``workspace`` is not used."""
    compose(triton_logits, triton_top_k, q, kv_cache, weights, context_lens, block_table, out=out, logits=logits,
            logits_dtype=logits_dtype)
