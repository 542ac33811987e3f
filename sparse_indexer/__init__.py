"""sparse-indexer: the FP8 lightning indexer of DeepSeek-V3.2-class sparse attention.

Pure functions over caller-owned tensors: they write only into the outputs and :class:`buffers.Buffers` they
are given. See ``docs/spec.md`` for the math and layouts.
"""

from buffers import Buffers, BufferTooSmall, CacheFormat, IndexerLimits, allocate, plan

from ._runtime.dispatch import BACKENDS, BackendUnavailable, available
from .fp8 import FP8_MAX, QUANT_MAX, fn_to_fnuz, fp8_max, quant_max, quantize_k, quantize_q
from .indexer import check_step, indexer_decode, indexer_prefill, sparse_attn_indexer
from .kcache import cache_layout, cache_views, compressed_slot_mapping, new_kv_cache, slots_from_block_table
from .metadata import (
    ChunkPlan,
    DecodeMetadata,
    IndexerMetadata,
    PrefillChunk,
    build_metadata,
    plan_prefill_chunks,
)
from .mxfp4 import dequantize_mxfp4, quantize_k_mxfp4, quantize_q_mxfp4
from .ops.fp8_mqa_logits import fp8_mqa_logits
from .ops.fp8_mqa_topk import fp8_mqa_topk
from .ops.fp8_paged_mqa_logits import fp8_paged_mqa_logits, row_limits
from .ops.fp8_paged_mqa_topk import fp8_paged_mqa_topk
from .ops.gather_k_cache import gather_k_cache
from .ops.select_candidate_blocks import select_candidate_blocks
from .ops.top_k_per_row import top_k_per_row
from .ops.write_k_cache import write_k_cache

__version__ = "0.1.0"

__all__ = [
    "ChunkPlan", "DecodeMetadata", "IndexerMetadata", "PrefillChunk", "build_metadata", "check_step",
    "indexer_decode", "indexer_prefill", "plan_prefill_chunks", "sparse_attn_indexer",
    "BACKENDS", "FP8_MAX", "QUANT_MAX", "BackendUnavailable", "BufferTooSmall", "Buffers", "CacheFormat",
    "IndexerLimits",
    "allocate", "available", "cache_layout", "cache_views", "fn_to_fnuz", "fp8_max", "fp8_mqa_logits",
    "fp8_paged_mqa_logits", "gather_k_cache", "new_kv_cache", "plan", "quant_max", "quantize_k", "quantize_q",
    "row_limits", "slots_from_block_table", "compressed_slot_mapping", "top_k_per_row", "write_k_cache",
    "select_candidate_blocks", "fp8_mqa_topk", "fp8_paged_mqa_topk",
    "quantize_k_mxfp4", "quantize_q_mxfp4", "dequantize_mxfp4",
]
