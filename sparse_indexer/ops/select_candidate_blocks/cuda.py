"""CUDA backend of the two-level indexer's ops (NVIDIA; ``candidates_kernel.cu`` compiled at first use by NVRTC,
cached by source hash and architecture through the top-k backend's loader, ``sparse_indexer/ops/top_k_per_row/
cuda.py``): ``select_candidate_blocks`` here, the candidate-restricted ``top_k_per_row`` (:func:`candidate_top_k`,
called by that backend).

One CTA of 1024 threads per row; the keys of a row live in shared memory (the block scores of a row in
``workspace`` when more blocks than shared memory holds), radix-selected with shared-memory histograms. A launch
is one ctypes call of the driver's ``cuLaunchKernel`` on torch's current stream (arguments in a per-thread ctypes
record), so it captures in CUDA graphs.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import threading

import torch

from ..top_k_per_row import cuda as _topk_cuda

__all__ = ["candidate_top_k", "select_candidate_blocks"]

SOURCE = pathlib.Path(__file__).with_name("candidates_kernel.cu")
NT = 1024
HEADER_WORDS = 2048 + 16 + 32  # histogram, counters, warp sums (candidates_kernel.cu's OFF_DATA)


class _SelectArgs(ctypes.Structure):
    _fields_ = [("logits", ctypes.c_void_p), ("stride_l", ctypes.c_longlong), ("starts", ctypes.c_void_p),
                ("ends", ctypes.c_void_p), ("out", ctypes.c_void_p), ("stride_o", ctypes.c_longlong),
                ("kb", ctypes.c_int), ("ws", ctypes.c_void_p), ("stride_w", ctypes.c_longlong), ("bs", ctypes.c_int),
                ("vec_ok", ctypes.c_int)]


class _TopkArgs(ctypes.Structure):
    _fields_ = [("logits", ctypes.c_void_p), ("stride_l", ctypes.c_longlong), ("starts", ctypes.c_void_p),
                ("ends", ctypes.c_void_p), ("cand", ctypes.c_void_p), ("stride_c", ctypes.c_longlong),
                ("kb", ctypes.c_int), ("bs", ctypes.c_int), ("out", ctypes.c_void_p), ("stride_o", ctypes.c_longlong),
                ("topk", ctypes.c_int)]


def _pointers(rec: ctypes.Structure):
    base = ctypes.addressof(rec)
    return (ctypes.c_void_p * len(rec._fields_))(*[base + getattr(type(rec), f).offset for f, _ in rec._fields_])


class _Thread(threading.local):
    def __init__(self):
        self.select = _SelectArgs()
        self.topk = _TopkArgs()
        self.select_ptrs = _pointers(self.select)
        self.topk_ptrs = _pointers(self.topk)


_ARGS = _Thread()


@functools.cache
def _launch_fn():
    fn = _topk_cuda._driver_lib().cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def _kernel(index: int, name: bytes, bf16: bool) -> int:
    return int(_topk_cuda._kernel(index, NT, 1, bf16, (), name, SOURCE)[1])


def _check_device(dev: torch.device) -> None:
    if dev.type != "cuda" or torch.version.hip is not None:
        raise NotImplementedError(f"the CUDA candidate kernels run on NVIDIA GPUs, not {dev}")
    why = _topk_cuda.unavailable_reason()
    if why is not None:
        raise NotImplementedError(why)


def _fire(index: int, kern: int, rows: int, smem: int, ptrs) -> None:
    if not _topk_cuda._PARAMS.has_ctx:
        _topk_cuda._ensure_context(index)
    stream = torch._C._cuda_getCurrentRawStream(index)
    rc = _launch_fn()(kern, rows, 1, 1, NT, 1, 1, smem, stream, ptrs, None)
    if rc:
        raise _topk_cuda._launch_error(rc)


def _on_device(index: int, fn, *args) -> None:
    if torch._C._cuda_getDevice() != index:
        with torch.cuda.device(index):
            fn(*args)
    else:
        fn(*args)


def select_candidate_blocks(logits, row_starts, row_ends, *, out, block_size, workspace=None) -> None:
    """See :func:`sparse_indexer.select_candidate_blocks`; arguments are checked."""
    dev = logits.device
    _check_device(dev)
    r, w = logits.shape
    if r == 0:
        return
    if w == 0:
        out.fill_(-1)
        return
    index = dev.index or 0
    nb = -(-w // block_size)
    smem = (HEADER_WORDS + nb) * 4
    if smem > _topk_cuda._smem_optin(index):  # the row's block scores go to the workspace
        smem = HEADER_WORDS * 4
        if workspace is None:  # (a call outside the step; the step passes Buffers.block_scores)
            workspace = torch.empty(r, nb, dtype=torch.int32, device=dev)
    else:
        workspace = None
    kern = _kernel(index, b"si_select_candidate_blocks", logits.dtype == torch.bfloat16)
    a = _ARGS.select
    a.logits, a.stride_l = logits.data_ptr(), logits.stride(0)
    a.starts, a.ends = row_starts.data_ptr(), row_ends.data_ptr()
    a.out, a.stride_o, a.kb = out.data_ptr(), out.stride(0), out.shape[1]
    a.ws, a.stride_w = (None, 0) if workspace is None else (workspace.data_ptr(), workspace.stride(0))
    a.bs, a.vec_ok = block_size, int(logits.stride(0) * logits.element_size() % 16 == 0)
    _on_device(index, _fire, index, kern, r, smem, _ARGS.select_ptrs)


def candidate_top_k(logits, row_starts, row_ends, out, candidates, block_size) -> None:
    """The candidate-restricted top-k (arguments checked); ``NotImplementedError`` when a row's ``K_b * b``
    candidate cells do not fit shared memory (``auto`` then takes Triton)."""
    dev = logits.device
    _check_device(dev)
    r = logits.shape[0]
    if r == 0:
        return
    index = dev.index or 0
    kb = candidates.shape[1]
    smem = (HEADER_WORDS + kb + kb * block_size) * 4
    if smem > _topk_cuda._smem_optin(index):
        raise NotImplementedError(f"{kb} candidate blocks of {block_size} positions need {smem} bytes of shared "
                                  f"memory per row; cuda:{index} allows {_topk_cuda._smem_optin(index)}")
    kern = _kernel(index, b"si_candidate_topk", logits.dtype == torch.bfloat16)
    a = _ARGS.topk
    a.logits, a.stride_l = logits.data_ptr(), logits.stride(0)
    a.starts, a.ends = row_starts.data_ptr(), row_ends.data_ptr()
    a.cand, a.stride_c, a.kb, a.bs = candidates.data_ptr(), candidates.stride(0), kb, block_size
    a.out, a.stride_o, a.topk = out.data_ptr(), out.stride(0), out.shape[1]
    _on_device(index, _fire, index, kern, r, smem, _ARGS.topk_ptrs)
