"""One ``uint8`` arena per record: allocation and carving into the planned views."""

from __future__ import annotations

import torch

from .limits import IndexerLimits
from .plan import ALIGN, BufferPlan, plan
from .record import Buffers

__all__ = ["aligned_arena", "allocate", "carve"]


def carve(plan_: BufferPlan, arena: torch.Tensor) -> Buffers:
    """Views of ``arena`` laid out as ``plan_``; see :meth:`Buffers.from_arena`."""
    return Buffers.from_arena(plan_, arena)


def allocate(limits_or_plan: IndexerLimits | BufferPlan, device: torch.device | str = "cpu") -> Buffers:
    """Allocate one arena of ``plan.total_bytes`` bytes (plus at most 256 for alignment) on ``device`` and
    carve it into a :class:`Buffers`.

    This is the only allocation the indexer needs; do it once, at start-up (or at profiling time).
    Contents are uninitialised.
    """
    p = limits_or_plan if isinstance(limits_or_plan, BufferPlan) else plan(limits_or_plan)
    return carve(p, aligned_arena(p.total_bytes, device))


def aligned_arena(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A fresh ``uint8`` tensor of ``nbytes`` bytes whose data pointer is 256-byte aligned (one allocation of
    ``nbytes + 256``: CUDA allocations are already 512-byte aligned, the CPU's only 64)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, device=device)
    start = (-raw.data_ptr()) % ALIGN
    return raw[start : start + nbytes]
