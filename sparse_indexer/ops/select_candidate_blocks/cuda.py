"""CUDA backend of ``select_candidate_blocks`` (NVIDIA; ``candidates_kernel.cu`` beside this file, compiled at first
use by NVRTC and cached by source hash and architecture through the CUDA top-k backend's loader,
``sparse_indexer/ops/top_k_per_row/cuda.py``, which also launches the same source's candidate-restricted top-k).

One CTA of 1024 threads per row: the rank keys of its blocks in shared memory (in ``workspace`` when the row has
more blocks than shared memory holds), an exact radix select with shared-memory histograms, one ctypes
``cuLaunchKernel`` on torch's current stream (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from ..top_k_per_row import cuda as _T

__all__ = ["select_candidate_blocks"]


def select_candidate_blocks(logits, row_starts, row_ends, *, out, block_size, workspace=None) -> None:
    """See :func:`sparse_indexer.select_candidate_blocks`; arguments are checked."""
    dev = logits.device
    _T.cand_check_device(dev)
    r, w = logits.shape
    if r == 0:
        return
    if w == 0:
        out.fill_(-1)
        return
    index = dev.index or 0
    nb = -(-w // block_size)
    smem = (_T.CAND_HEADER_WORDS + nb) * 4
    if smem > _T._smem_optin(index):  # the row's block scores go to the workspace
        smem = _T.CAND_HEADER_WORDS * 4
        if workspace is None:  # (a call outside the step; the step passes Buffers.block_scores)
            workspace = torch.empty(r, nb, dtype=torch.int32, device=dev)
    else:
        workspace = None
    kern = _T.cand_kernel(index, b"si_select_candidate_blocks", logits.dtype == torch.bfloat16)
    a = _T.CAND_ARGS.select
    a.logits, a.stride_l = logits.data_ptr(), logits.stride(0)
    a.starts, a.ends = row_starts.data_ptr(), row_ends.data_ptr()
    a.out, a.stride_o, a.kb = out.data_ptr(), out.stride(0), out.shape[1]
    a.ws, a.stride_w = (None, 0) if workspace is None else (workspace.data_ptr(), workspace.stride(0))
    a.bs, a.vec_ok = block_size, int(logits.stride(0) * logits.element_size() % 16 == 0)
    a.width = w  # the kernel clamps the windows into [0, W): at most ceil(W / b) block keys per row
    _T.on_device(index, _T.cand_fire, index, kern, r, smem, _T.CAND_ARGS.select_ptrs)
