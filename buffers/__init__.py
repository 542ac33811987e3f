"""Sizing and carving the indexer's scratch memory: limits -> plan -> one arena -> ``Buffers``."""

from .arena import allocate, carve
from .limits import FP8_DTYPES, CacheFormat, IndexerLimits
from .plan import ALIGN, BufferPlan, FieldPlan, plan
from .record import Buffers, BufferTooSmall

__all__ = [
    "ALIGN", "FP8_DTYPES", "BufferPlan", "CacheFormat", "BufferTooSmall", "Buffers", "FieldPlan", "IndexerLimits",
    "allocate", "carve", "plan",
]
