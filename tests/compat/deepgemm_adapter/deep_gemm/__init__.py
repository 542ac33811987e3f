"""DeepGEMM's indexer API (``deep_gemm.fp8_mqa_logits`` and friends) on top of sparse-indexer.

Put ``tests/compat/deepgemm_adapter`` on ``sys.path`` and ``import deep_gemm``: DeepGEMM's own
``tests/test_attention.py`` (the logits tests; its GEMM test needs DeepGEMM's GEMMs, which this library does
not have) then runs against this library's backends (``DG_ADAPTER_BACKEND``: ``auto`` by default, or a backend
name). Both generations of DeepGEMM's names are here:

* ``fp8_mqa_logits(q, kv, weights, ks, ke, clean_logits=True, max_seqlen_k=0, logits_dtype=float32)`` and
  ``fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
  clean_logits=False, logits_dtype=float32, indices=None)`` (``q`` an FP8 tensor, ``kv`` a ``(keys, scales)``
  pair);
* ``fp8_fp4_mqa_logits`` / ``fp8_fp4_paged_mqa_logits``: the same with ``q`` a ``(values, scales)`` pair; FP8
  queries have ``scales=None``. FP4/MXFP8 operands and bfloat16/float16 weights (Blackwell-only in DeepGEMM) raise
  ``NotImplementedError``;
* ``get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=None)`` and ``get_num_sms()``.

Differences, all invisible to DeepGEMM's tests: the schedule metadata is computed as DeepGEMM's shape
``[num_sms + 1, 2]`` int32 (where each SM's share of the key blocks starts: ``(row, block)``) but this library's
paged kernel balances its work on the device and does not read it. DeepGEMM's ``indices`` come with a block table
of one row per query row (its kernel groups the rows of a request); this library's ``indices`` select a row of
a per-request block table. A per-row table is therefore passed on without ``indices`` (every row has its own),
a per-request one with them.
"""

from __future__ import annotations

import os

import torch

import sparse_indexer as si

__all__ = [
    "fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "fp8_mqa_logits", "fp8_paged_mqa_logits", "get_num_sms",
    "get_paged_mqa_logits_metadata",
]


def _backend() -> str | None:
    name = os.environ.get("DG_ADAPTER_BACKEND", "auto")
    return None if name == "auto" else name


def _logits_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    if logits_dtype not in (torch.float32, torch.bfloat16):
        raise NotImplementedError(f"sparse-indexer writes float32 or bfloat16 logits, not {logits_dtype}")
    return logits_dtype


def _fp8_q(q) -> torch.Tensor:
    """DeepGEMM's ``q`` (an FP8 tensor, or a ``(values, scales)`` pair whose scales are ``None`` for FP8)."""
    if isinstance(q, (tuple, list)):
        values, scales = q
        if scales is not None:
            raise NotImplementedError("FP4/MXFP8 queries (with per-block scales) are Blackwell-only in DeepGEMM "
                                      "and not supported by sparse-indexer")
        q = values
    if q.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise NotImplementedError(f"sparse-indexer scores FP8 queries, got {q.dtype}")
    return q


def _float_weights(weights: torch.Tensor) -> torch.Tensor:
    if weights.dtype != torch.float32:
        raise NotImplementedError(f"{weights.dtype} weights are Blackwell-only in DeepGEMM; sparse-indexer takes "
                                  "float32")
    return weights


def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits: bool = True,
                   max_seqlen_k: int = 0, logits_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Ragged logits ``[M, N]``, or compressed ``[M, max_seqlen_k]`` when ``max_seqlen_k > 0``."""
    k_fp8, k_scale = kv
    if k_scale is None or k_scale.dtype != torch.float32:
        raise NotImplementedError("sparse-indexer takes FP8 keys with one float32 scale per key")
    return si.fp8_mqa_logits(_fp8_q(q), k_fp8, k_scale.reshape(-1), _float_weights(weights),
                             cu_seq_len_k_start, cu_seq_len_k_end, clean=clean_logits,
                             max_seqlen_k=int(max_seqlen_k) if max_seqlen_k else None,
                             logits_dtype=_logits_dtype(logits_dtype), backend=_backend())


def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits: bool = True,
                       max_seqlen_k: int = 0, logits_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`fp8_mqa_logits` with DeepGEMM's ``(values, scales)`` query pair (FP8 only here)."""
    return fp8_mqa_logits(_fp8_q(q), kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=clean_logits,
                          max_seqlen_k=max_seqlen_k, logits_dtype=logits_dtype)


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len: int,
                         clean_logits: bool = False, logits_dtype: torch.dtype = torch.float32,
                         indices: torch.Tensor | None = None) -> torch.Tensor:
    """Paged logits ``[B * next_n, max_context_len]`` (``schedule_meta`` is not needed, see the module doc).

    ``context_lens``: ``[B]``, ``[B, next_n]`` or, with ``next_n == 1``, ``[B, 1]`` (DeepGEMM's per-row lengths).
    """
    q = _fp8_q(q)
    if kv_cache.dim() == 4 and kv_cache.shape[2] != 1:
        raise NotImplementedError("one key head per cache token (MQA) only")
    if kv_cache.shape[-1] != q.shape[-1] + 4:
        raise NotImplementedError("FP4 key caches are Blackwell-only in DeepGEMM and not supported by sparse-indexer")
    if q.shape[-1] not in (64, 128):
        raise NotImplementedError(f"sparse-indexer's paged cache holds D = 64 or 128, got D = {q.shape[-1]}")
    b, next_n = q.shape[:2]
    if context_lens.dim() == 2 and next_n == 1:
        context_lens = context_lens.reshape(-1)  # [B, 1] per-row lengths == 1-D lengths when next_n == 1
    if indices is not None and block_table.shape[0] == b:
        indices = None  # DeepGEMM's per-row block table: each row reads its own (see the module doc)
    out = torch.empty(b * next_n, int(max_context_len), dtype=_logits_dtype(logits_dtype), device=q.device)
    return si.fp8_paged_mqa_logits(q, kv_cache, _float_weights(weights), context_lens, block_table, out=out,
                                   clean=clean_logits, indices=indices, backend=_backend())


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len: int,
                             clean_logits: bool = False, logits_dtype: torch.dtype = torch.float32,
                             indices: torch.Tensor | None = None, **unsupported) -> torch.Tensor:
    """:func:`fp8_paged_mqa_logits` with DeepGEMM's ``(values, scales)`` query pair (FP8 only here)."""
    if unsupported:
        raise NotImplementedError(f"arguments not supported by sparse-indexer: {sorted(unsupported)}")
    return fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                                clean_logits=clean_logits, logits_dtype=logits_dtype, indices=indices)


def get_num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int,
                                  indices: torch.Tensor | None = None) -> torch.Tensor:
    """``[num_sms + 1, 2]`` int32: for SM ``i``, the ``(row, block)`` where its equal share of all rows' key blocks
    starts (the last entry: one past the end). DeepGEMM's kernel reads such a split; this library's does not."""
    lens = context_lens.reshape(context_lens.shape[0], -1).amax(1).long().clamp(min=0) if context_lens.numel() \
        else torch.zeros(0, dtype=torch.long, device=context_lens.device)
    blocks = (lens + block_kv - 1) // block_kv
    ends = torch.cumsum(blocks, 0)
    total = int(ends[-1]) if ends.numel() else 0
    targets = torch.arange(num_sms + 1, device=lens.device) * total // max(1, num_sms)
    row = torch.searchsorted(ends, targets, right=True)
    starts = ends - blocks
    first = torch.where(row < lens.numel(), starts[row.clamp(max=max(0, lens.numel() - 1))] if lens.numel()
                        else targets, targets)
    return torch.stack([row, targets - first], 1).to(torch.int32)
