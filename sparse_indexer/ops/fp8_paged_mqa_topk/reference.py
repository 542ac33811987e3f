"""Reference ``fp8_paged_mqa_topk``: the reference paged logits into the scores scratch, then the reference top-k
of every row's window (docs/spec.md §5, §6): the specification of the fused op.

:func:`compose` is that composition for any pair of implementations (the Triton and aiter backends compose their
own kernels with it, and ``auto`` the two ops' own ``auto``).
"""

from __future__ import annotations

import torch

from ..fp8_paged_mqa_logits.reference import fp8_paged_mqa_logits as reference_logits
from ..fp8_paged_mqa_logits.reference import row_limits
from ..top_k_per_row.reference import top_k_per_row as reference_top_k

__all__ = ["FUSED", "compose", "fp8_paged_mqa_topk"]

FUSED = False
"""A composition of two ops, not one kernel: ``auto`` composes the ops' own ``auto`` instead of running it."""


def compose(score, select, q, kv_cache, weights, context_lens, block_table, *, out, logits=None,
            logits_dtype=None) -> None:
    """``score`` (an ``fp8_paged_mqa_logits`` implementation, called with ``clean=False``) into ``logits``, then
    ``select`` (a ``top_k_per_row`` implementation) over each row's window ``[0, limit[r])`` into ``out``.

    ``logits``: ``[B * next_n, W]`` float32 or bfloat16 scratch, ``W >= max(limit)``; ``None``: allocated with
    ``W = max_blocks * block_size`` in ``logits_dtype`` (default float32). The windows' two ``[B * next_n]`` int32
    bounds are computed on the device (no host synchronisation) and allocated here; the ends are the limits
    clamped into ``[0, min(W, max_blocks * block_size)]``, as the paged logits clamp them (docs/spec.md §10), so a
    limit past the block table selects among the cells the logits op wrote."""
    rows = out.shape[0]
    capacity = block_table.shape[1] * kv_cache.shape[1]
    if logits is None:
        logits = torch.empty(rows, capacity, dtype=logits_dtype or torch.float32, device=q.device)
    ends = row_limits(context_lens, q.shape[1]).clamp(max=min(logits.shape[1], capacity)).to(torch.int32)
    starts = torch.zeros_like(ends)
    score(q, kv_cache, weights, context_lens, block_table, out=logits, clean=False)
    select(logits, starts, ends, out=out)


def fp8_paged_mqa_topk(q, kv_cache, weights, context_lens, block_table, *, out, logits=None, workspace=None,
                       logits_dtype=None) -> None:
    """See :func:`sparse_indexer.fp8_paged_mqa_topk`; ``kv_cache`` is the 3-D view, arguments are checked.
    ``workspace`` (the fused kernels' scratch) is not used."""
    compose(reference_logits, reference_top_k, q, kv_cache, weights, context_lens, block_table, out=out,
            logits=logits, logits_dtype=logits_dtype)
