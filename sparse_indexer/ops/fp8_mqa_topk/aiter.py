"""aiter backend of ``fp8_mqa_topk`` (ROCm; aiter imported lazily): aiter's ragged logits into the scores
scratch, then aiter's top-k, in blocks of the scratch's rows (:func:`.reference.compose` of the two adapters,
``ops/fp8_mqa_logits/aiter.py`` and ``ops/top_k_per_row/aiter.py``).

Both kernels exist together on gfx950 only (aiter's top-k: float32 logits, topk 2048), so every other case raises
``NotImplementedError`` before anything is written: a bfloat16 scores dtype, another ``topk``, another
architecture, or a case aiter's logits do not take (a mix of FP8 formats, ``H`` or ``D`` not a power of two).
aiter's logits kernel allocates its own ``[R, N]`` result per block (copied into the scratch).
"""

from __future__ import annotations

import torch

from ..fp8_mqa_logits import aiter as mqa_aiter
from ..top_k_per_row import aiter as topk_aiter
from .reference import compose

__all__ = ["FUSED", "fp8_mqa_topk"]

FUSED = False
"""Two kernels, not one: ``auto`` composes the ops' own ``auto`` instead of running it."""


def fp8_mqa_topk(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, logits=None,
                 logits_dtype=None) -> None:
    """See :func:`sparse_indexer.fp8_mqa_topk`; arguments are checked."""
    dtype = logits.dtype if logits is not None else logits_dtype or torch.float32
    if dtype != torch.float32:
        raise NotImplementedError(f"aiter's logits and top-k write and read float32 logits, got {dtype}")
    topk_aiter.check_case(dtype, q.device, out.shape[1])
    mqa_aiter.check_case(q, k_fp8)
    compose(mqa_aiter.fp8_mqa_logits, topk_aiter.top_k_per_row, q, k_fp8, k_scale, weights, cu_seqlen_ks,
            cu_seqlen_ke, out=out, logits=logits, logits_dtype=dtype)
