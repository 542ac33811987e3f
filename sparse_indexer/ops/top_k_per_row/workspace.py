"""Size of the Triton top-k's workspace (``Buffers.topk_scratch``, docs/spec.md §9): the ``triton`` entry of the
backend registry declares :func:`workspace_cols` as its ``topk_workspace``, and :func:`buffers.plan.plan` sizes the
field as the widest over the registered backends (:func:`sparse_indexer.backends.topk_workspace_cols`).

Only the Triton split-row path uses the workspace (few rows on a GPU without the CUDA backend: ROCm without
aiter); the CUDA backend keeps its candidates in shared memory and ignores it. A row of the workspace holds
``COUNTERS`` int32 counters, then ``cap`` candidate positions and ``cap`` candidate values (float32 bits).
This module imports nothing of the package (it holds the kernel constants the size depends on), so the registry
can call it while the planner runs.
"""

from __future__ import annotations

import math

COUNTERS = 32
"""int32 counters at the start of each workspace row."""
SAMPLE = 4096
"""Cells the split top-k samples per row (``triton.py``)."""
SPREAD = 4.5
"""Half-width of its sample bracket, in binomial sigmas."""

__all__ = ["COUNTERS", "SAMPLE", "SPREAD", "candidate_cap", "topk_scratch_cap", "workspace_cols", "workspace_shape"]


def candidate_cap(max_len: int, topk: int) -> int:
    """Candidate slots per workspace row for windows up to ``max_len`` cells.

    The split top-k keeps the cells between two sample quantiles (+-``SPREAD`` sigma around the ``topk``-th
    largest of a ``SAMPLE``-cell sample); a window of ``L`` cells has about ``2 SPREAD (sqrt(topk L / SAMPLE) +
    L / SAMPLE)`` of them. The cap is 1.25x that for ``L = max_len``, rounded up to a power of two (at least 256);
    a row with more candidates is still exact, through a slower per-row fallback.
    """
    want = 2 * SPREAD * (math.sqrt(topk * max_len / SAMPLE) + max_len / SAMPLE) * 1.25
    return max(256, 1 << max(0, math.ceil(want) - 1).bit_length())


def workspace_shape(rows: int, max_len: int, topk: int) -> tuple[int, int]:
    """``(rows, COUNTERS + 2 * candidate_cap(max_len, topk))`` int32: the workspace of ``rows`` rows."""
    return rows, COUNTERS + 2 * candidate_cap(max_len, topk)


def topk_scratch_cap(limits) -> int:
    """Candidate slots per row of the Triton top-k's workspace for the windows of ``limits`` (an
    :class:`~buffers.IndexerLimits`): :func:`candidate_cap` of ``max_keys`` (the decode rows' widest window)
    and ``topk``."""
    return candidate_cap(limits.max_keys, limits.topk)


def workspace_cols(limits) -> int:
    """int32 columns per row of the Triton top-k's workspace for ``limits`` (an :class:`~buffers.IndexerLimits`):
    ``COUNTERS + 2 * topk_scratch_cap(limits)``. The registry's ``topk_workspace`` of the ``triton`` backend."""
    return COUNTERS + 2 * topk_scratch_cap(limits)
