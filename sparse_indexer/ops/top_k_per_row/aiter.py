"""aiter backend of ``top_k_per_row`` (ROCm gfx950, topk 2048, as vLLM uses it; aiter imported lazily).

aiter's ``top_k_per_row_prefill`` returns *absolute* column indices; :func:`localize_topk` makes them relative
to each row's start (docs/spec.md §6) and :func:`short_rows` writes the exact ``0..len-1, -1...`` rows that §6
requires for windows no longer than ``topk``. The op takes arbitrary ``row_starts``, so it uses the prefill kernel
(aiter's ``top_k_per_row_decode`` assumes windows starting at 0).
"""

from __future__ import annotations

import torch

from .._aiter import gcn_arch

__all__ = ["AITER_TOPK", "check_case", "localize_topk", "short_rows", "top_k_per_row"]

AITER_TOPK = 2048


def localize_topk(indices: torch.Tensor, row_starts: torch.Tensor) -> None:
    """In place: ``indices[r, i] -= row_starts[r]`` where ``indices[r, i] >= 0`` (-1 stays -1)."""
    torch.where(indices >= 0, indices - row_starts[:, None].to(indices.dtype), indices, out=indices)


def short_rows(indices: torch.Tensor, row_starts: torch.Tensor, row_ends: torch.Tensor) -> None:
    """In place: rows whose window has ``len <= topk`` become ``0, 1, ..., len - 1, -1, ...`` (docs/spec.md §6)."""
    topk = indices.shape[1]
    n = (row_ends.long() - row_starts.long()).clamp(min=0)[:, None]
    ar = torch.arange(topk, device=indices.device)[None, :]
    pattern = torch.where(ar < n, ar, -1).to(indices.dtype)
    torch.where(n <= topk, pattern, indices, out=indices)


def check_case(logits_dtype: torch.dtype, device: torch.device, topk: int) -> None:
    """``NotImplementedError`` unless aiter's top-k takes ``logits_dtype`` logits on ``device`` with this ``topk``
    (float32, gfx950, ``topk`` 2048)."""
    if logits_dtype != torch.float32:
        raise NotImplementedError(f"aiter's top-k reads float32 logits, got {logits_dtype}")
    arch = gcn_arch(device)
    if arch != "gfx950" or topk != AITER_TOPK:
        raise NotImplementedError(f"aiter's top-k runs on gfx950 with topk {AITER_TOPK}; got {arch}, "
                                  f"topk {topk}")


def top_k_per_row(logits, row_starts, row_ends, *, out, candidates=None, candidate_block_size=None) -> None:
    """See :func:`sparse_indexer.top_k_per_row`; arguments are checked."""
    if candidates is not None:
        raise NotImplementedError("aiter's top-k reads whole windows; candidate blocks run in the Triton backend")
    if logits.shape[0] == 0:
        return
    check_case(logits.dtype, logits.device, out.shape[1])
    from aiter.ops.topk import top_k_per_row_prefill

    top_k_per_row_prefill(logits, row_starts, row_ends, out, None, logits.shape[0], logits.stride(0),
                          logits.stride(1), k=out.shape[1])
    localize_topk(out, row_starts)
    short_rows(out, row_starts, row_ends)
