"""CUDA backend of ``fp8_paged_mqa_logits`` for Hopper (sm_90): decode scores from a TMA producer warp and wgmma.

``logits_kernel.cu`` beside this file (its header describes the kernel), compiled at first use by NVRTC and
cached by source hash and architecture through the CUDA top-k backend's loader
(``sparse_indexer/ops/top_k_per_row/cuda.py``). The split and the roles are the Gluon kernel's (``gluon.py``): one
persistent grid, the key tiles of all requests cut into equal contiguous pieces, a 1-warp TMA producer feeding an
mbarrier ring, math warpgroups running one wgmma chain per query token. What differs is the hand-off: here every
math thread arrives on the ring slot's release barrier after its own wgmma wait, with no warpgroup barrier in the
tile loop, where Triton's membar pass puts a ``bar.sync`` before each Gluon mbarrier operation (docs/kernels.md).
It also takes ``H = 32`` (GLM-5.x, V4.1), which the Gluon kernel does not.

Not taken (``NotImplementedError`` before anything is written; ``auto`` then runs Gluon or Triton): anything but
sm_90, ``D != 128``, ``H`` not in (32, 64), ``next_n > 4``, block size != 64, a cache other than e4m3fn values
with float32 scales in the flat order (16-byte aligned, block stride a multiple of 16 bytes), MXFP4, non-contiguous
or unaligned ``q``, int64 lengths or tables, ``out`` other than float32/bfloat16 with a unit last stride, and more
requests than the shared memory's request table holds beside the ring.

Values the checks would refuse (docs/spec.md §10) score as the reference does: limits clamped into ``[0, min(W,
max_blocks * 64)]``, a block id outside the cache a zero key, an ``indices`` entry outside the block table an
empty window.
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import threading

import torch

from ..top_k_per_row import cuda as _T
from .reference import fp8_paged_mqa_logits as _reference

__all__ = ["CONFIG", "CONFIG_BY_N", "cache_tensor_map", "fp8_paged_mqa_logits", "unsupported_reason"]

SOURCE = pathlib.Path(__file__).with_name("logits_kernel.cu")
KERNEL = b"si_paged_mqa_logits"
D = 128
TILE_KEYS = 64
HEADS = (32, 64)
MAX_NEXT_N = 4

CONFIG = {"STAGES": 4, "NWG": 4, "ctas_per_sm": 1, "QBUF": 2}
CONFIG_BY_N: dict = {96: {"NWG": 3, "STAGES": 6}, 128: {"NWG": 3, "STAGES": 6}, 192: {"NWG": 2, "STAGES": 8},
                     256: {"NWG": 1, "STAGES": 12}}
"""Launch configuration per wgmma width ``N = next_n * H`` over :data:`CONFIG`, overridable per call with
``config=``: ``NWG`` math warpgroups per CTA (each with its own producer warp and ring; the CTA has
``128 * (NWG + 1)`` threads, so the registers decide: four warpgroups hold the ``N / 2`` accumulators up to
``N = 64``), ``STAGES`` slots per ring, ``QBUF`` query slots, ``ctas_per_sm`` CTAs per SM (the grid is
``SMs x ctas_per_sm``; they must fit the SM's shared memory together)."""


def _fixed_smem(stages: int, qbuf: int, next_n: int, h: int, nwg: int) -> int:
    """``logits_kernel.cu``'s shared bytes other than the request table: alignment slack, the rings' values and
    scales, the query slots, the barriers and the scan's words."""
    return (1024 + nwg * stages * (8192 + 256) + qbuf * next_n * h * 128 + (2 * nwg * stages + 2 * qbuf) * 8
            + 32 * 4)


def smem_bytes(stages: int, qbuf: int, next_n: int, h: int, b: int, nwg: int) -> int:
    """Dynamic shared bytes of one CTA for ``b`` requests (the request table is ``b + 1`` int32)."""
    return _fixed_smem(stages, qbuf, next_n, h, nwg) + 4 * (b + 1)


@functools.cache
def _smem_per_sm(index: int) -> int:
    """Shared memory of one SM (228 KB on Hopper), of which each resident CTA also reserves 1 KB."""
    return int(getattr(torch.cuda.get_device_properties(index), "shared_memory_per_multiprocessor", 233472))


_TMAPS: dict = {}
_TMAP_LOCK = threading.Lock()


def _encode(key, ptr: int, dims: tuple, strides: tuple, box: tuple, what: str) -> bytes:
    got = _TMAPS.get(key)
    if got is None:
        fn = _T._driver_lib().cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        buf = (ctypes.c_ubyte * 128)()
        n = len(dims)
        rc = fn(buf, ctypes.c_int(0), ctypes.c_uint32(n), ctypes.c_void_p(ptr), (ctypes.c_uint64 * n)(*dims),
                (ctypes.c_uint64 * (n - 1))(*strides), (ctypes.c_uint32 * n)(*box), (ctypes.c_uint32 * n)(*([1] * n)),
                ctypes.c_int(0), ctypes.c_int(3), ctypes.c_int(3), ctypes.c_int(0))  # 128-byte swizzle, zeros outside
        if rc:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed ({rc}) for {what}")
        with _TMAP_LOCK:
            if len(_TMAPS) >= 256:
                _TMAPS.clear()
            got = _TMAPS[key] = bytes(buf)
    return got


def cache_tensor_map(kv_cache: torch.Tensor) -> bytes:
    """The encoded ``CUtensorMap`` of a 3-D cache's values (``[num_blocks][64 rows][128 bytes]``, boxes of one
    block, 128-byte swizzle, zeros outside), one per (address, blocks, block stride)."""
    return _encode(("k", kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.stride(0)), kv_cache.data_ptr(),
                   (D, TILE_KEYS, kv_cache.shape[0]), (D, kv_cache.stride(0)), (D, TILE_KEYS, 1),
                   f"a cache of {kv_cache.shape[0]} blocks")


def _query_map(q: torch.Tensor) -> bytes:
    """The encoded ``CUtensorMap`` of ``q`` as rows of 128 bytes, boxes of one request's ``next_n * H`` rows."""
    b, next_n, h, d = q.shape
    return _encode(("q", q.data_ptr(), b, next_n, h), q.data_ptr(), (d, b * next_n * h), (d,), (d, next_n * h),
                   f"queries of shape {list(q.shape)}")


class _Params(ctypes.Structure):
    _fields_ = [("kmap", ctypes.c_ubyte * 128), ("qmap", ctypes.c_ubyte * 128),
                ("cache", ctypes.c_void_p), ("block_stride", ctypes.c_longlong), ("w", ctypes.c_void_p),
                ("stride_w", ctypes.c_longlong), ("cl", ctypes.c_void_p), ("stride_clb", ctypes.c_longlong),
                ("bt", ctypes.c_void_p), ("stride_bt", ctypes.c_longlong), ("idx", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("stride_o", ctypes.c_longlong), ("B", ctypes.c_int), ("W", ctypes.c_int),
                ("cap", ctypes.c_int), ("num_blocks", ctypes.c_int), ("nr", ctypes.c_int),
                ("_pad", ctypes.c_ubyte * 64)]
    # (``logits_kernel.cu``'s Params is 64-byte aligned, its tensor maps first; the padding covers its tail)


class _Args(threading.local):
    def __init__(self):
        self.p = _Params()
        self.ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(self.p))


_ARGS = _Args()


@functools.cache
def _why_not_device(index: int) -> str | None:
    why = _T.unavailable_reason()
    if why is not None:
        return why
    if _T._capability(index) != (9, 0):
        major, minor = _T._capability(index)
        return f"the CUDA paged logits kernel uses Hopper's wgmma and TMA (sm_90), not sm_{major}{minor}"
    return None


def _config(next_n: int, h: int, config: dict | None) -> dict:
    return {**CONFIG, **CONFIG_BY_N.get(next_n * h, {}), **(config or {})}


def unsupported_reason(q, kv_cache, weights, context_lens, block_table, out, indices=None,
                       config: dict | None = None) -> str | None:
    """Why the kernel cannot take this (checked) call, or ``None``. Reads no device values."""
    dev = q.device
    if dev.type != "cuda" or torch.version.hip is not None:
        return f"the CUDA paged logits kernel runs on NVIDIA Hopper GPUs, not {dev}"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    why = _why_not_device(index)
    if why is not None:
        return why
    b, next_n, h, d = q.shape
    nb, bs, width = kv_cache.shape
    if q.dtype != torch.float8_e4m3fn or d != D or h not in HEADS or not 1 <= next_n <= MAX_NEXT_N:
        return (f"the CUDA paged logits kernel takes e4m3fn queries with D = {D}, H in {HEADS}, next_n <= "
                f"{MAX_NEXT_N}, got {q.dtype}, D={d}, H={h}, next_n={next_n}")
    if bs != TILE_KEYS or width != D + 4:
        return f"the CUDA paged logits kernel reads blocks of {TILE_KEYS} keys of {D} values, got {bs=}"
    stride0 = kv_cache.stride(0) if nb > 1 else bs * width
    if (kv_cache.stride(1), kv_cache.stride(2)) != (D + 4, 1) or stride0 % 16 or kv_cache.data_ptr() % 16:
        return "the CUDA paged logits kernel needs each cache block's bytes contiguous and 16-byte aligned"
    if not q.is_contiguous() or q.data_ptr() % 16:
        return "the CUDA paged logits kernel needs contiguous, 16-byte aligned queries"
    if context_lens.dtype != torch.int32 or block_table.dtype != torch.int32 or \
            (indices is not None and indices.dtype != torch.int32):
        return "the CUDA paged logits kernel reads int32 lengths, block tables and indices"
    if out.dtype not in (torch.float32, torch.bfloat16) or out.stride(1) != 1:
        return "the CUDA paged logits kernel writes float32 or bfloat16 logits with a unit last stride"
    if weights.stride(1) != 1 or weights.stride(0) % 2 or weights.data_ptr() % 8:
        return "the CUDA paged logits kernel reads weights in 8-byte pairs"
    if b * next_n * h >= 2**31 or nb >= 2**31 - 1:
        return "the CUDA paged logits kernel's TMA coordinates are int32"
    cfg = _config(next_n, h, config)
    need = smem_bytes(int(cfg["STAGES"]), int(cfg["QBUF"]), next_n, h, b, int(cfg["NWG"]))
    ctas, nt = int(cfg["ctas_per_sm"]), 128 * (int(cfg["NWG"]) + 1)
    regs = min(255, 65536 // (nt * ctas)) // 8 * 8
    want = next_n * h // 2 + 32
    if regs < want:
        return (f"the CUDA paged logits kernel's {nt}-thread CTAs, {ctas} per SM, leave {regs} registers a thread; "
                f"its accumulators need about {want}")
    if need > _T._smem_optin(index) or ctas * (need + 1024) > _smem_per_sm(index):
        return (f"the CUDA paged logits kernel's request table of {b} requests does not fit the shared memory "
                f"beside its rings ({ctas} x {need} bytes per SM)")
    return None


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, *, out, clean, indices=None,
                         config=None, cache_fp8_dtype=None, cache_scale="float32", cache_order="flat",
                         cache_values="fp8", q_scale=None) -> None:
    """See :func:`sparse_indexer.fp8_paged_mqa_logits`; ``kv_cache`` is the 3-D view, arguments are checked.

    ``NotImplementedError`` before writing anything for the calls :func:`unsupported_reason` declines, MXFP4
    caches, other scale layouts and declared format mixes. ``config`` overrides :data:`CONFIG` and
    :data:`CONFIG_BY_N` (``STAGES``, ``NWG``, ``ctas_per_sm``, ``QBUF``)."""
    if cache_values != "fp8" or q_scale is not None:
        raise NotImplementedError("the CUDA paged logits kernel does not score MXFP4 caches (docs/spec.md §3a)")
    if cache_fp8_dtype is not None and cache_fp8_dtype != q.dtype:
        raise NotImplementedError(f"{q.dtype} queries against a {cache_fp8_dtype} cache (a declared mix of formats)")
    if cache_scale != "float32" or cache_order != "flat":
        raise NotImplementedError(f"the CUDA paged logits kernel reads float32 scales in the flat order, got "
                                  f"{cache_scale!r}, {cache_order!r}")
    why = unsupported_reason(q, kv_cache, weights, context_lens, block_table, out, indices, config)
    if why is not None:
        raise NotImplementedError(why)
    b, next_n, h, _ = q.shape
    nb = kv_cache.shape[0]
    w = out.shape[1]
    if b == 0 or w == 0:
        return
    if nb == 0:  # no key to read (every in-window cell is a zero key's); a tensor map needs rows
        _reference(q, kv_cache, weights, context_lens, block_table, out=out, clean=clean, indices=indices)
        return
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    cfg = _config(next_n, h, config)
    stages, qbuf, nwg, ctas = int(cfg["STAGES"]), int(cfg["QBUF"]), int(cfg["NWG"]), int(cfg["ctas_per_sm"])
    nt = 128 * (nwg + 1)
    defines = (f"NEXT_N={next_n}", f"H={h}", f"STAGES={stages}", f"NWG={nwg}", f"QBUF={qbuf}",
               f"CLEAN={int(bool(clean))}", f"HAS_IDX={int(indices is not None)}",
               f"CL_2D={int(context_lens.dim() == 2)}", f"MINB={ctas}")
    kern = _T._kernel(index, nt, 1, out.dtype == torch.bfloat16, defines, KERNEL, SOURCE)[1]
    a = _ARGS.p
    ctypes.memmove(a.kmap, cache_tensor_map(kv_cache), 128)
    ctypes.memmove(a.qmap, _query_map(q), 128)
    a.cache, a.block_stride = kv_cache.data_ptr(), kv_cache.stride(0) if nb > 1 else kv_cache.shape[1] * (D + 4)
    a.w, a.stride_w = weights.data_ptr(), weights.stride(0)
    a.cl, a.stride_clb = context_lens.data_ptr(), context_lens.stride(0)
    a.bt, a.stride_bt = block_table.data_ptr(), block_table.stride(0)
    a.idx = None if indices is None else indices.data_ptr()
    a.out, a.stride_o = out.data_ptr(), out.stride(0)
    a.B, a.W, a.cap = b, w, min(w, block_table.shape[1] * TILE_KEYS)
    a.num_blocks, a.nr = nb, block_table.shape[0]
    smem = smem_bytes(stages, qbuf, next_n, h, b, nwg)
    _T.on_device(index, _fire, index, kern, _T._sm_count(index) * ctas, nt, smem)


class _Launch:
    """A launch configuration per kernel build, stream, grid and shared size."""

    def __init__(self):
        self.cfgs: dict = {}

    def get(self, kern, stream: int, grid: int, nt: int, smem: int):
        key = (int(kern), stream, grid, nt, smem)
        got = self.cfgs.get(key)
        if got is None:
            from cuda.bindings import driver

            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = nt, 1, 1
            cfg.sharedMemBytes = smem
            cfg.hStream = driver.CUstream(stream)
            cfg.numAttrs = 0
            if len(self.cfgs) >= 64:
                self.cfgs.clear()
            got = self.cfgs[key] = (cfg, cfg.getPtr())
        return got


_LAUNCH = _Launch()


def _fire(index: int, kern, grid: int, nt: int, smem: int) -> None:
    if not _T._PARAMS.has_ctx:
        _T._ensure_context(index)
    stream = torch._C._cuda_getCurrentRawStream(index)
    got = _LAUNCH.get(kern, stream, grid, nt, smem)
    rc = _T._driver_launch()(got[1], int(kern), _ARGS.ptrs, None)
    if rc:
        raise _T._launch_error(rc)


AUTO_MIN_KEY_BLOCKS = 65536
"""``auto`` runs this kernel for ``H = 32`` at ``next_n = 2`` from this many key blocks (``B * next_n *
max_blocks``, 4M keys) in eager calls, where its device time repays its launch's extra host time (33-63 us per
public call against Triton's 21-38 on the H200's host); the Gluon kernel takes only ``H = 64``."""

AUTO_MIN_KEY_BLOCKS_GRAPHED = 16384
"""``auto`` runs this kernel for ``H = 32`` at ``next_n = 2`` from this many key blocks while a CUDA graph is being
captured (the host time is paid once there). Measured on the H200 (2026-12-03, graphed, L2 flushed, against the
Triton kernel; docs/benchmarks.md): 64 x 64K keys 157.0-157.8 against 167.9-169.0 us, 64 x 16K 51.0-51.9 against
53.3-53.6, 128 x 8K 52.3 against 53.7, 16 x 64K 51.4 against 52.2, 8 x 64K 31.6-32.2 against 32.4-32.8; one request
(2048 blocks) 11.7 against 11.5. At ``next_n = 1`` it is level with Triton (152.4 against 152.4 at 64 x 64K; 49.1
against 49.1 at 64 x 16K) and at ``H = 64`` behind the Gluon kernel (153.4 against 150.1 at ``next_n = 1``, 188.9
against 175.7 at ``next_n = 2``), so ``auto`` leaves those calls to them."""


def _auto_when(q, kv_cache, weights, context_lens, block_table, *, out, clean, indices=None, config=None,
               cache_fp8_dtype=None, cache_scale="float32", cache_order="flat", cache_values="fp8",
               q_scale=None) -> bool:
    """Whether ``auto`` runs this kernel for a call: FP8 caches with ``H = 32`` at ``next_n = 2``, from
    :data:`AUTO_MIN_KEY_BLOCKS` key blocks, or from :data:`AUTO_MIN_KEY_BLOCKS_GRAPHED` in a CUDA-graph capture
    (``graph_aware``: its answers are not remembered per layout); ``backend="cuda"`` runs it for every call it
    takes."""
    if cache_values != "fp8" or q_scale is not None or q.dim() != 4:
        return False
    b, next_n, h, _ = q.shape
    if h != 32 or next_n != 2:
        return False
    blocks = b * next_n * block_table.shape[1]
    if blocks >= AUTO_MIN_KEY_BLOCKS:
        return True
    return blocks >= AUTO_MIN_KEY_BLOCKS_GRAPHED and q.is_cuda and torch.cuda.is_current_stream_capturing()


_auto_when.graph_aware = True
fp8_paged_mqa_logits.auto_when = _auto_when
