"""CUDA backend of ``fp8_paged_mqa_topk``: decode scores and their exact top-k in one kernel (NVIDIA Hopper).

``fused_kernel.cu`` beside this file (its header describes the algorithm), compiled at first use by NVRTC and
cached by source hash and architecture through the CUDA top-k backend's loader
(``sparse_indexer/ops/top_k_per_row/cuda.py``). One cooperative grid of one CTA per SM scores a sample of each
request's key tiles first, takes from it a per-row threshold that at least ``topk`` cells reach (a rank of the
sample well above the expected ``topk``-th largest's), and then scores the rest with wgmma, filing only the cells
at or above the threshold into the row's lists in ``workspace``; the CTA that completes a row selects its
``topk`` exactly from the lists. A threshold that too few cells reach, or a list that overflows, makes that CTA
rescore the row alone, exactly (hostile values only). No scores are stored anywhere unless ``logits`` is given
(then they are written, as the test mode that proves the selection exact for the values the kernel computed).

Not taken (``NotImplementedError``): anything but sm_90, D != 128, H not in (32, 64), ``next_n > 4``,
``topk > 2048``, block size != 64, a cache in a format other than e4m3fn values with float32 scales in the flat
order, int64 lengths or block tables, unaligned tensors, and shapes whose worst case lists more tiles per CTA
than its shared memory holds beside the ring (12 bytes a tile: about 13K tiles, e.g. 256 requests x 400K keys).

With value checks off (docs/spec.md §10) the kernel clamps every limit into ``[0, min(W, max_blocks * 64)]`` (in
64 bits) and copies a tile whose block id lies outside ``[0, num_blocks)`` as zeros (nothing read), so its cells
score 0, as the reference composition's zero keys do.

The per-row counters (4 int32 a row) are one buffer per device that only this kernel writes: zeroed when it is
made and left at zero by every call (each row's finisher resets its row), so a call needs no zeroing and no grid
barrier. It is made, or grown for more rows, outside CUDA-graph capture: a call inside capture that needs more
rows than the buffer has raises ``NotImplementedError`` (engines warm up eagerly at their largest batch before
they capture). Launches of this kernel on one device must not overlap (two cooperative grids of one CTA per SM
cannot be resident together, and they would share the counters).
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import threading
from typing import NamedTuple

import torch

from ..fp8_paged_mqa_logits.cuda import cache_tensor_map
from ..top_k_per_row import cuda as _T
from .workspace import FUSED_WORKSPACE_COLS

__all__ = ["FUSED", "capacity_tiles", "fp8_paged_mqa_topk", "takes", "warpgroups"]

FUSED = True
"""Marks this backend's implementation as a fused kernel (the public function's ``auto`` tries only these)."""

SOURCE = pathlib.Path(__file__).with_name("fused_kernel.cu")
STAGES = (8, 7, 6, 5, 4, 3, 2)
"""Ring depths (tiles per warpgroup's ring) in order of preference: the deepest whose shared memory leaves room
for the worst case's tile list is built (a deeper ring keeps more of the HBM latency covered)."""
TILE_KEYS = 64
D = 128
HEADS = (32, 64)
MAX_NEXT_N = 4
MAX_TOPK = 2048
"""``fused_kernel.cu``'s ``CE``: the positions equal to a row's threshold it keeps."""
LIST_BYTES = 2 * 6144 * 4
"""``fused_kernel.cu``'s final select holds a row's ``CG`` listed keys and positions in the idle ring."""
SAMPLE_TILES = 32
KERNEL = b"si_paged_mqa_topk"


def warpgroups(next_n: int) -> int:
    """Math warpgroups per CTA (``fused_kernel.cu``'s ``NWG``): four up to ``next_n = 2``, two beyond (four
    warpgroups at ``next_n`` 3-4 spill at the 128-register cap of 512 threads)."""
    return 4 if next_n <= 2 else 2


def _fixed_smem(next_n: int, h: int, b: int, stages: int, nwg: int) -> int:
    """Shared bytes other than the per-tile ones (``fused_kernel.cu``'s ``carve``): alignment slack, the rings,
    the query buffers, scales, ring barriers, histogram, sample keys, staging, scratch words, the request table and the
    thresholds, and the list's rounding."""
    return (1024 + stages * nwg * (8192 + 256 + 8) + nwg * next_n * h * 128 + 2048 * 4 + SAMPLE_TILES * 64 * 4
            + nwg * 4 * 64 * 8 + 128 + 32 + ((b + 1) * 4 + 15) // 16 * 16 + (b * next_n * 4 + 15) // 16 * 16
            + 3 * 16)


def capacity_tiles(next_n: int, h: int, b: int, smem_optin: int, stages: int, nwg: int) -> int:
    """Key tiles one CTA lists (request, tile, cache block: 12 bytes) in ``smem_optin`` bytes of shared memory
    next to a ring of ``stages``."""
    return max(0, (smem_optin - _fixed_smem(next_n, h, b, stages, nwg)) // 12)


def stages_for(per_cta: int, next_n: int, h: int, b: int, smem_optin: int, nwg: int) -> int | None:
    """The deepest ring of :data:`STAGES` that leaves room for ``per_cta`` listed tiles and holds the final
    select's list, or ``None``."""
    for st in STAGES:
        if st * nwg * 8192 >= LIST_BYTES and capacity_tiles(next_n, h, b, smem_optin, st, nwg) >= per_cta:
            return st
    return None


class _Params(ctypes.Structure):
    _fields_ = [("tmap", ctypes.c_ubyte * 128),
                ("cache", ctypes.c_void_p), ("block_stride", ctypes.c_longlong), ("q", ctypes.c_void_p),
                ("w", ctypes.c_void_p), ("stride_w", ctypes.c_longlong), ("cl", ctypes.c_void_p),
                ("stride_clb", ctypes.c_longlong), ("bt", ctypes.c_void_p), ("stride_bt", ctypes.c_longlong),
                ("out", ctypes.c_void_p), ("stride_o", ctypes.c_longlong), ("ws", ctypes.c_void_p),
                ("stride_ws", ctypes.c_longlong), ("lg", ctypes.c_void_p), ("stride_lg", ctypes.c_longlong),
                ("ctr", ctypes.c_void_p), ("probe", ctypes.c_void_p), ("B", ctypes.c_int), ("cap", ctypes.c_int),
                ("topk", ctypes.c_int), ("cl_2d", ctypes.c_int), ("capt", ctypes.c_int),
                ("num_blocks", ctypes.c_int), ("_pad", ctypes.c_ubyte * 64)]
    # (``fused_kernel.cu``'s Params is 64-byte aligned, its tensor map first; the padding covers its tail)


class _Args(threading.local):
    def __init__(self):
        self.p = _Params()
        self.ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(self.p))


_ARGS = _Args()
_STATE: dict[int, torch.Tensor] = {}
_STATE_LOCK = threading.Lock()


def _counters(dev: torch.device, rows: int) -> torch.Tensor:
    """The device's per-row counters, ``[>= rows, 4]`` int32 (zero between calls), made or grown here."""
    index = dev.index or 0
    st = _STATE.get(index)
    if st is None or st.shape[0] < rows:
        if torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(f"the fused top-k's counters are made for {rows} rows at a call outside "
                                      "CUDA-graph capture (call it once eagerly at the largest batch first)")
        with _STATE_LOCK:
            st = _STATE.get(index)
            if st is None or st.shape[0] < rows:
                torch.cuda.synchronize(dev)  # (no launch still counts on the buffer being replaced)
                st = _STATE[index] = torch.zeros(max(rows, 1024), 4, dtype=torch.int32, device=dev)
    return st


@functools.cache
def _why_not_device(index: int) -> str | None:
    why = _T.unavailable_reason()
    if why is not None:
        return why
    if _T._capability(index) != (9, 0):
        major, minor = _T._capability(index)
        return f"the fused kernel uses Hopper's wgmma (sm_90), not sm_{major}{minor}"
    return None


COOPERATIVE = True
"""Measurements only: ``False`` launches the grid without the cooperative attribute (its CTAs are then resident
together only because nothing else runs beside them)."""


class _Launch:
    """A launch configuration (cooperative, one CTA per SM) per kernel build, stream and shared size."""

    def __init__(self):
        self.cfgs: dict = {}

    def get(self, index: int, kern, stream: int, smem: int, nt: int):
        key = (index, int(kern), stream, smem, nt, COOPERATIVE)
        got = self.cfgs.get(key)
        if got is None:
            from cuda.bindings import driver

            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = _T._sm_count(index), 1, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = nt, 1, 1
            cfg.sharedMemBytes = smem
            cfg.hStream = driver.CUstream(stream)
            if COOPERATIVE:
                attr = driver.CUlaunchAttribute()
                attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
                attr.value.cooperative = 1
                cfg.attrs = [attr]
                cfg.numAttrs = 1
            if len(self.cfgs) >= 64:
                self.cfgs.clear()
            got = self.cfgs[key] = (cfg, cfg.getPtr())
        return got


_LAUNCH = _Launch()


def _width(block_table, logits) -> int:
    """``W = min(max_blocks * 64, logits' width)``: the widest window the shapes allow."""
    width = block_table.shape[1] * TILE_KEYS
    return width if logits is None else min(width, logits.shape[1])


class _Plan(NamedTuple):
    per_cta: int  # worst-case tiles per CTA
    nwg: int      # warpgroups
    stages: int   # ring depth per warpgroup
    capt: int     # tiles one CTA lists beside that ring


@functools.cache
def _plan(b: int, next_n: int, h: int, width: int, index: int) -> _Plan | None:
    """The launch plan for ``b`` requests of up to ``width`` keys on ``cuda:index`` (``None``: the worst case's
    tile list does not fit the shared memory beside a ring): :func:`warpgroups`, at the deepest of
    :data:`STAGES` that fits."""
    smem = _T._smem_optin(index)
    per_cta = -(-(b * -(-width // TILE_KEYS)) // _T._sm_count(index))
    nwg = warpgroups(next_n)
    st = stages_for(per_cta, next_n, h, b, smem, nwg)
    if st is None:
        return None
    return _Plan(per_cta, nwg, st, capacity_tiles(next_n, h, b, smem, st, nwg))


def takes(q, kv_cache, weights, context_lens, block_table, out, logits=None, workspace=None) -> str | None:
    """``None`` when the fused kernel takes this call (shapes, dtypes, alignment, the workspace and the
    shared-memory capacity for the worst case the shapes allow), else why not. Reads no device values."""
    dev = q.device
    if dev.type != "cuda" or torch.version.hip is not None:
        return f"the fused CUDA kernel runs on NVIDIA GPUs, not {dev}"
    index = dev.index or 0
    why = _why_not_device(index)
    if why is not None:
        return why
    b, next_n, h, d = q.shape
    if q.dtype != torch.float8_e4m3fn or d != D or h not in HEADS or not 1 <= next_n <= MAX_NEXT_N:
        return f"the fused kernel takes e4m3fn queries with D = {D}, H in {HEADS}, next_n <= {MAX_NEXT_N}"
    if not 1 <= out.shape[1] <= MAX_TOPK:
        return f"the fused kernel selects 1 to {MAX_TOPK} positions per row, not {out.shape[1]}"
    if kv_cache.dim() != 3 or kv_cache.shape[1] != TILE_KEYS or kv_cache.shape[2] != D + 4:
        return f"the fused kernel reads blocks of {TILE_KEYS} keys of {D} values"
    if (kv_cache.stride(1), kv_cache.stride(2)) != (D + 4, 1) or kv_cache.stride(0) % 16 or kv_cache.data_ptr() % 16:
        return "the fused kernel needs each cache block's bytes contiguous and 16-byte aligned"
    if not q.is_contiguous() or q.data_ptr() % 16:
        return "the fused kernel needs contiguous, 16-byte aligned queries"
    if context_lens.dtype != torch.int32 or block_table.dtype != torch.int32:
        return "the fused kernel reads int32 lengths and block tables"
    if out.stride(1) != 1 or weights.stride(1) != 1 or block_table.stride(1) != 1:
        return "the fused kernel needs unit last strides"
    if logits is not None and logits.dtype not in (torch.float32, torch.bfloat16):
        return "the fused kernel writes float32 or bfloat16 logits"
    rows = b * next_n
    if workspace is not None and (workspace.dtype != torch.int32 or workspace.shape[0] < rows
                                  or workspace.shape[1] < FUSED_WORKSPACE_COLS or workspace.stride(1) != 1
                                  or workspace.stride(0) % 4 or workspace.data_ptr() % 16):
        return (f"the fused kernel needs an int32 workspace of [>= {rows}, >= {FUSED_WORKSPACE_COLS}] with "
                "16-byte aligned rows")
    width = _width(block_table, logits)
    if _plan(b, next_n, h, width, index) is None:
        per_cta = -(-(b * -(-width // TILE_KEYS)) // _T._sm_count(index))
        capt = capacity_tiles(next_n, h, b, _T._smem_optin(index), STAGES[-1], warpgroups(next_n))
        return (f"the worst case of these shapes ({b} requests x {width} keys) lists {per_cta} tiles per CTA in "
                f"shared memory; cuda:{index} holds {capt}")
    return None


def fp8_paged_mqa_topk(q, kv_cache, weights, context_lens, block_table, *, out, logits=None, workspace=None,
                       logits_dtype=None, stages=None, probe=None, rescore=False) -> None:
    """See :func:`sparse_indexer.fp8_paged_mqa_topk`; arguments are checked. ``NotImplementedError`` (before
    anything is written) for the cases :func:`takes` declines. Measurement and test knobs: ``stages`` (the ring
    depth instead of :func:`_plan`'s), ``probe`` (an int64 ``[SMs, 8]`` tensor: a ``PROBE=1`` build writes each
    CTA's ``%globaltimer`` at its phase marks there, ``fused_kernel.cu``), ``rescore`` (every row takes the
    exact rescoring path that guards against thresholds too few cells reach and overflowing lists)."""
    why = takes(q, kv_cache, weights, context_lens, block_table, out, logits, workspace)
    if why is not None:
        raise NotImplementedError(why)
    dev = q.device
    index = dev.index or 0
    b, next_n, h, _ = q.shape
    rows = b * next_n
    if rows == 0:
        return
    state = _counters(dev, rows)
    if workspace is None:  # (a call outside the step; the step passes its buffer)
        workspace = torch.empty(rows, FUSED_WORKSPACE_COLS, dtype=torch.int32, device=dev)
    bf16 = (logits.dtype if logits is not None else (logits_dtype or torch.float32)) == torch.bfloat16
    smem = _T._smem_optin(index)
    pl = _plan(b, next_n, h, _width(block_table, logits), index)
    nwg, st, capt = pl.nwg, pl.stages, pl.capt
    if stages is not None:  # (measurement knob)
        if stages * nwg * 8192 < LIST_BYTES or capacity_tiles(next_n, h, b, smem, stages, nwg) < pl.per_cta:
            raise NotImplementedError(f"a ring of {stages} stages leaves no room for {pl.per_cta} tiles")
        st, capt = stages, capacity_tiles(next_n, h, b, smem, stages, nwg)
    defines = (f"NEXT_N={next_n}", f"H={h}", f"STAGES={st}", f"LG_OUT={int(logits is not None)}",
               f"PROBE={int(probe is not None)}", f"NWG={nwg}", f"NO_SAMPLE_FILTER={int(bool(rescore))}")
    kern = _T._kernel(index, 128 * nwg, 1, bf16, defines, KERNEL, SOURCE)[1]
    tmap = cache_tensor_map(kv_cache)
    a = _ARGS.p
    ctypes.memmove(a.tmap, tmap, 128)
    a.cache, a.block_stride = kv_cache.data_ptr(), kv_cache.stride(0)
    a.q = q.data_ptr()
    a.w, a.stride_w = weights.data_ptr(), weights.stride(0)
    a.cl, a.stride_clb = context_lens.data_ptr(), context_lens.stride(0)
    a.bt, a.stride_bt = block_table.data_ptr(), block_table.stride(0)
    a.out, a.stride_o = out.data_ptr(), out.stride(0)
    a.ws, a.stride_ws = workspace.data_ptr(), workspace.stride(0)
    a.lg, a.stride_lg = (None, 0) if logits is None else (logits.data_ptr(), logits.stride(0))
    a.ctr = state.data_ptr()
    a.probe = None if probe is None else probe.data_ptr()
    a.B, a.cap, a.topk, a.cl_2d = b, _width(block_table, logits), out.shape[1], int(context_lens.dim() == 2)
    a.capt = capt
    a.num_blocks = kv_cache.shape[0]  # block ids outside [0, num_blocks) score as zero keys
    _T.on_device(index, _fire, index, kern, smem, 128 * nwg)


def _fire(index: int, kern, smem: int, nt: int) -> None:
    if not _T._PARAMS.has_ctx:
        _T._ensure_context(index)
    stream = torch._C._cuda_getCurrentRawStream(index)
    got = _LAUNCH.get(index, kern, stream, smem, nt)
    rc = _T._driver_launch()(got[1], int(kern), _ARGS.ptrs, None)
    if rc:
        raise _T._launch_error(rc)


def _auto_when(q, kv_cache, weights, context_lens, block_table, *, out, logits=None, workspace=None,
               logits_dtype=None, **_) -> bool:
    """Whether ``auto`` runs the fused kernel for a call: never today. It is slower than composing the Gluon
    logits and the CUDA top-k at every shape measured on the H200 (docs/benchmarks.md, "Fused decode top-k";
    graphed, L2 flushed: 35.6 against 24.1 us at 1 x 64K keys, 98.8 against 64.6 at 16 x 64K, 209.3 against
    169.6 at 64 x 64K); ``backend="cuda"`` runs it."""
    return False


fp8_paged_mqa_topk.auto_when = _auto_when
