"""Reference ``fp8_mqa_topk``: the reference ragged logits (``clean=False``) into the scores scratch, then the
reference top-k of every row's window ``[ks, ke)`` (docs/spec.md §5, §6): the specification of the op.

:func:`compose` is that composition for any pair of implementations, in blocks of as many query rows as the
scratch holds (the Triton and aiter backends compose their own kernels with it, and ``auto`` the two ops' own
``auto``).
"""

from __future__ import annotations

import torch

from ..fp8_mqa_logits.reference import fp8_mqa_logits as reference_logits
from ..top_k_per_row.reference import top_k_per_row as reference_top_k

__all__ = ["FUSED", "compose", "fp8_mqa_topk"]

FUSED = False
"""A composition of two ops, not one kernel: ``auto`` composes the ops' own ``auto`` instead of running it."""


def compose(score, select, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, logits=None,
            logits_dtype=None) -> None:
    """``score`` (an ``fp8_mqa_logits`` implementation, called with ``clean=False``) then ``select`` (a
    ``top_k_per_row`` implementation, windows ``[ks, ke)``, positions relative to ``ks``) into ``out``, for
    blocks of ``R`` query rows at a time.

    ``logits``: ``[R, N]`` float32 or bfloat16 scratch, ``1 <= R <= M``: rows ``[r0, r0 + R)`` are scored into it
    and selected before the next block, so the scratch is ``R * N`` cells whatever ``M`` is; with ``R == M`` its
    in-window cells hold every row's scores afterwards. ``None``: ``[M, N]`` allocated in ``logits_dtype``
    (default float32)."""
    m = q.shape[0]
    if m == 0:
        return
    if logits is None:
        logits = torch.empty(m, k_fp8.shape[0], dtype=logits_dtype or torch.float32, device=q.device)
    step = logits.shape[0]
    for r0 in range(0, m, step):
        r1 = min(m, r0 + step)
        block = logits if r1 - r0 == step else logits[: r1 - r0]
        ks, ke = cu_seqlen_ks[r0:r1], cu_seqlen_ke[r0:r1]
        score(q[r0:r1], k_fp8, k_scale, weights[r0:r1], ks, ke, out=block, clean=False)
        select(block, ks, ke, out=out[r0:r1])


def fp8_mqa_topk(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, logits=None,
                 logits_dtype=None) -> None:
    """See :func:`sparse_indexer.fp8_mqa_topk`; arguments are checked."""
    compose(reference_logits, reference_top_k, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out=out,
            logits=logits, logits_dtype=logits_dtype)
