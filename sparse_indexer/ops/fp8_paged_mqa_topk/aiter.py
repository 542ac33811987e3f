"""aiter backend of ``fp8_paged_mqa_topk`` (ROCm; aiter imported lazily): aiter's paged logits into the scores
scratch, then aiter's top-k (:func:`.reference.compose` of the two adapters, ``ops/fp8_paged_mqa_logits/aiter.py``
and ``ops/top_k_per_row/aiter.py``).

Both kernels exist together on gfx950 only (aiter's top-k: float32 logits, topk 2048), so every other case raises
``NotImplementedError`` before anything is written: a bfloat16 scores dtype, another ``topk``, another
architecture, or a case aiter's paged logits do not read (the architecture's own FP8 format, block size 1 or a
preshuffled multiple of 16). The cache is in the layout the aiter backend's ``write_k_cache`` writes.
"""

from __future__ import annotations

import torch

from ..fp8_paged_mqa_logits import aiter as paged_aiter
from ..top_k_per_row import aiter as topk_aiter
from .reference import compose

__all__ = ["FUSED", "fp8_paged_mqa_topk"]

FUSED = False
"""Two kernels, not one: ``auto`` composes the ops' own ``auto`` instead of running it."""


def fp8_paged_mqa_topk(q, kv_cache, weights, context_lens, block_table, *, out, logits=None, workspace=None,
                       logits_dtype=None) -> None:
    """See :func:`sparse_indexer.fp8_paged_mqa_topk`; ``kv_cache`` is the 3-D view, arguments are checked.
    ``workspace`` is not used."""
    dtype = logits.dtype if logits is not None else logits_dtype or torch.float32
    if dtype != torch.float32:
        raise NotImplementedError(f"aiter's paged logits and top-k read and write float32 logits, got {dtype}")
    topk_aiter.check_case(dtype, q.device, out.shape[1])
    paged_aiter.kernel_for(q, kv_cache)  # (no qk scratch here: stage1's architectures raise)
    compose(paged_aiter.fp8_paged_mqa_logits, topk_aiter.top_k_per_row, q, kv_cache, weights, context_lens,
            block_table, out=out, logits=logits, logits_dtype=dtype)
