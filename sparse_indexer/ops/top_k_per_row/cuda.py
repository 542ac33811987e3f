"""CUDA backend of ``top_k_per_row`` (NVIDIA only): ``topk_kernel.cu`` compiled at first use by NVRTC.

The kernel (docs/spec.md §6 semantics; its algorithm is described at the top of ``topk_kernel.cu``) runs one
cluster of ``CS`` CTAs per row: a strided sample gives a threshold, one pass over the window pushes the cells above
it (and the positions of cells equal to it) into the leader CTA's shared memory, and the leader radix-selects
exactly among them (shared-memory histograms with 2048 bins: what Triton 3.6 cannot express). It needs no global
workspace (``workspace`` is accepted and ignored) and makes no host sync and no allocation per call. float32 and
bfloat16 logits (one kernel build each: bfloat16 cells are widened exactly, 8 per 16-byte load).

Needs ``cuda-bindings`` (``cuda.bindings.nvrtc`` / ``cuda.bindings.driver``; a dependency of torch's CUDA 13
wheels, or ``pip install sparse-indexer[cuda]``) and the NVRTC library (``nvidia-cuda-nvrtc``). Without them the
backend reports itself unavailable and ``auto`` uses Triton. Compiled cubins are cached on disk under
``$SPARSE_INDEXER_CACHE_DIR`` (default ``~/.cache/sparse_indexer/nvrtc``), keyed by the SHA-256 of the source, the
compile options, the target architecture and the NVRTC version. Launches go to torch's current stream (CUDA-graph
capturable) by one ctypes call of the driver's ``cuLaunchKernelEx`` with everything but the tensors' addresses
planned once per shape (:class:`_Plan`). ``topk`` up to :data:`MAX_TOPK`; larger raises
:class:`NotImplementedError` (``auto`` then uses Triton).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import pathlib
import tempfile
import threading

import torch

__all__ = ["MAX_TOPK", "config", "top_k_per_row", "unavailable_reason"]

SOURCE = pathlib.Path(__file__).with_name("topk_kernel.cu")
MAX_TOPK = 4096
SMAX = 4096  # most sample cells (topk_kernel.cu's SMAX)
SM_WORDS = 16 + 2048 + 32 + SMAX  # counters, histogram, warp sums, sample (u32 words)
CLUSTER_SIZES = (1, 2, 4, 8, 16)
MIN_SPLIT_CELLS = 8192  # a row is split over CTAs only in pieces of at least this many cells


def unavailable_reason() -> str | None:
    """``None`` when cuda-bindings and NVRTC load here, else why not (the device is checked by the dispatcher)."""
    return _bindings_reason()


@functools.cache
def _bindings_reason() -> str | None:
    try:
        from cuda.bindings import driver, nvrtc  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return f"cuda-bindings does not import ({type(e).__name__}: {e}); pip install cuda-bindings"
    try:
        err, *_ = nvrtc.nvrtcVersion()
    except Exception as e:  # noqa: BLE001 - a missing libnvrtc raises here
        return f"NVRTC does not load ({type(e).__name__}: {e}); pip install nvidia-cuda-nvrtc"
    if int(err) != 0:
        return f"NVRTC does not load ({err})"
    return None


def _check(result, what: str):
    """cuda-bindings calls return ``(err, *values)``; raise on an error, return the values."""
    err, *vals = result
    if int(err) != 0:
        from cuda.bindings import driver

        e2, name = driver.cuGetErrorName(err) if isinstance(err, driver.CUresult) else (None, str(err))
        raise RuntimeError(f"{what} failed: {name!r} ({err})")
    return vals[0] if len(vals) == 1 else vals


def cap_for(topk: int) -> int:
    """Candidate slots in shared memory for ``topk``: windows up to this long are selected without sampling."""
    return max(4096, 4 * topk)


SMALL_MAX_CELLS = 32768
"""Longest rows a launch may load whole into shared memory (the small-row list's 16-bit positions allow 65535)."""


SAMPLE_SHORT = 2048
"""Sample cells of rows up to 64K cells (longer rows: :data:`SMAX`), topk_kernel.cu's ``S``."""


def layout(topk: int, width: int, small: bool | None = None) -> tuple[int, int, int, int]:
    """``(cap, sample words, small_max, dynamic shared bytes)`` of a launch over rows of at most ``width`` cells.

    ``small`` (default: ``width <= cap_for(topk)``; allowed up to :data:`SMALL_MAX_CELLS`): every window of the
    launch is loaded whole into shared memory and selected there without sampling; the launch then gets only the
    counters, the histogram and ``width`` key slots. Otherwise windows up to ``cap`` (:func:`cap_for`) cells are
    still selected that way and longer ones sample a threshold first (sample slots for :data:`SAMPLE_SHORT` cells
    when no row exceeds 64K cells)."""
    cap = cap_for(topk)
    if small is None:
        small = width <= cap
    if small:
        if width > max(cap, SMALL_MAX_CELLS):
            raise ValueError(f"small layout needs width <= {max(cap, SMALL_MAX_CELLS)}, got {width}")
        slots = (max(width, 1) + 3) // 4 * 4  # whole 16-byte words (the small-row list reads them 4 at a time)
        return slots, 0, width, 4 * (SM_WORDS - SMAX + slots)
    samp = SAMPLE_SHORT if width <= 65536 else SMAX
    return cap, samp, 0 if width <= cap else cap, 4 * (SM_WORDS - SMAX + samp + 2 * cap + topk)


def _cache_dir() -> pathlib.Path:
    d = os.environ.get("SPARSE_INDEXER_CACHE_DIR")
    if d:
        return pathlib.Path(d) / "nvrtc"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "sparse_indexer" / "nvrtc"


def min_blocks(nt: int) -> int:
    """CTAs per SM the kernel's registers are sized for (``__launch_bounds__``): 2048 threads' worth, except 5 of
    256 threads (48 registers: a small-row launch's shared memory fits 5 CTAs per SM; 165 -> 155 us on 8K x 8K
    causal windows on the H200, docs/benchmarks.md)."""
    return 5 if nt == 256 else max(1, 1024 // nt)


def _compile(arch: str, nt: int, cs: int, bf16: bool = False, defines: tuple = (), *, cached: bool = True,
             source: pathlib.Path = SOURCE) -> bytes:
    """The cubin of the kernel source ``source`` (default: the top-k's) for ``arch`` (``sm_90a``...) reading
    float32 (or, ``bf16``, bfloat16) logits, from the disk cache (unless ``cached=False``; keyed by the source's
    hash and the options) or NVRTC. ``defines``: extra ``-D`` options."""
    from cuda.bindings import nvrtc

    src = source.read_bytes()
    minb = [] if any(d.startswith("MINB=") for d in defines) else [f"-DMINB={min_blocks(nt)}"]
    opts = [f"--gpu-architecture={arch}", "-std=c++17", f"-DNT={nt}", f"-DCS={cs}", f"-DSMAX={SMAX}", *minb,
            f"-DBF16={int(bool(bf16))}", "-lineinfo"] + [f"-D{d}" for d in defines]
    ver = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    key = hashlib.sha256(src + repr((opts, ver)).encode()).hexdigest()[:32]
    path = _cache_dir() / f"{source.stem}_{arch}_{key}.cubin"
    if cached:
        try:
            return path.read_bytes()
        except OSError:
            pass
    prog = _check(nvrtc.nvrtcCreateProgram(src, source.name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        bopts = [o.encode() for o in opts]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(bopts), bopts)
        if int(res) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed to compile {source.name} ({' '.join(opts)}):\n{log.decode()}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    tmp = None
    try:  # atomic publish: concurrent processes never see a partial file
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        os.replace(tmp, path)
    except OSError:  # a read-only or full cache only costs a compile per process
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return cubin


@functools.cache
def _arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}a" if major == 9 else f"sm_{major}{minor}"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _kernel(index: int, nt: int, cs: int, bf16: bool = False, defines: tuple = (), name: bytes = b"si_top_k_per_row",
            source: pathlib.Path = SOURCE):
    """The loaded ``CUkernel`` ``name`` of ``source`` for device ``index``, allowed the device's whole opt-in
    shared memory (a limit only: each launch's occupancy follows the dynamic shared bytes it asks for)."""
    from cuda.bindings import driver

    torch.cuda.init()
    arch = _arch(index)
    try:
        lib = _check(driver.cuLibraryLoadData(_compile(arch, nt, cs, bf16, defines, source=source), [], [], 0, [],
                                              [], 0), "cuLibraryLoadData")
    except RuntimeError:  # a damaged cache entry: compile afresh (and overwrite it)
        lib = _check(driver.cuLibraryLoadData(_compile(arch, nt, cs, bf16, defines, cached=False, source=source), [],
                                              [], 0, [], [], 0), "cuLibraryLoadData")
    kern = _check(driver.cuLibraryGetKernel(lib, name), "cuLibraryGetKernel")
    dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
    smem = _check(driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev), "cuDeviceGetAttribute")
    A = driver.CUfunction_attribute
    smem -= _check(driver.cuKernelGetAttribute(A.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, kern, dev),
                   "cuKernelGetAttribute(static shared)")  # (static shared memory: measurement builds only)
    _check(driver.cuKernelSetAttribute(A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem, kern, dev),
           "cuKernelSetAttribute(max dynamic shared)")
    if cs > 8:
        _check(driver.cuKernelSetAttribute(A.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1, kern, dev),
               "cuKernelSetAttribute(non-portable cluster)")
    return lib, kern


@functools.cache
def _usable(index: int, nt: int, cs: int, bf16: bool = False) -> str | None:
    """``None`` when the kernel of ``(nt, cs, bf16)`` compiles and loads on device ``index``, else why not (an
    NVRTC too old for the GPU's architecture, a driver older than the NVRTC, ...). Cached, failures included:
    ``auto`` then falls back to Triton on every call without compiling again."""
    try:
        _kernel(index, nt, cs, bf16)
    except RuntimeError as e:
        return f"the CUDA top-k kernel could not be built or loaded on cuda:{index}: {e}"
    return None


@functools.cache
def _smem_optin(index: int) -> int:
    """Largest dynamic shared memory one CTA may opt in to on device ``index``, in bytes."""
    return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


PREFETCH_BYTES = 131072


def prefetch_bytes(rows: int, cs: int) -> int:
    """Bytes of its share a CTA of a sampled row asks L2 for while the sample threshold is computed: 128 KB for
    every shape (0 and 32 KB measured on the H200: within 1 us at decode shapes, slower for 8K-row prefill)."""
    del rows, cs
    return PREFETCH_BYTES


SPEC_ROW_BYTES = 131072


def speculative_bytes(rows: int, row_bytes: int, cs: int, sms: int, small: bool) -> int:
    """Bytes of the row each CTA asks L2 for before it has read the row's window bounds (its share of the row's
    first ``cs x`` that many bytes; 0: none): the whole row (at most :data:`SPEC_ROW_BYTES`, whole 128-byte lines)
    for launches of at most one row per SM that load rows whole into shared memory (decode: the windows start at
    column 0). Measured on the H200: 0.3-0.5 us off 1-64 rows of 16K cells; sampled rows lose up to 2 us with it
    (64 x 64K: the prefetch competes with the sample's loads), so they get none."""
    if rows > sms or not small:
        return 0
    return min(SPEC_ROW_BYTES, row_bytes // cs) // 128 * 128


SMALL_FEW_CELLS = 32768
"""Launches of at most one row per SM load rows up to this many cells whole into shared memory (one CTA of 1024
threads per row)."""
SMALL_MANY_CELLS = 16384
"""Launches of more rows than SMs load rows up to this many cells whole into shared memory."""
SMALL_MANY_NT = 512


def _config(index: int, rows: int, width: int, topk: int) -> tuple[int, int, bool]:
    sms = _sm_count(index)
    cap = cap_for(topk)
    if rows > sms:
        if width <= cap:
            return 256, 1, True
        if width <= SMALL_MANY_CELLS:
            return SMALL_MANY_NT, 1, True
        return 512, 1, False
    if width <= max(cap, SMALL_FEW_CELLS):
        return 1024, 1, True
    cs = 1
    if _capability(index)[0] >= 9:
        for c, budget in ((8, sms // 2), (4, sms // 2), (2, sms)):
            if rows * c <= budget and width // c >= MIN_SPLIT_CELLS:
                cs = c
                break
    return (512 if cs == 8 else 1024), cs, False


@functools.lru_cache(maxsize=256)
def config(rows: int, width: int, device: torch.device, topk: int = 2048) -> tuple[int, int, bool]:
    """``(threads per CTA, CTAs per row, small)`` for a call of ``rows`` rows of ``width`` cells (shapes only;
    ``small``: every window is loaded whole into shared memory, see :func:`layout`).

    Measured on an H200 (``bench --sweep topk``, docs/benchmarks.md): up to one row per SM, rows of at most
    :data:`SMALL_FEW_CELLS` cells (or ``4 topk``) in shared memory, one CTA of 1024 threads each; longer rows
    split over clusters (sm_90+) of 8 CTAs of 512 threads while ``8 rows`` fit half the SMs, of 4 CTAs of 1024
    threads likewise, of 2 while ``2 rows`` fit the SMs (larger clusters wait for a free group of SMs in one GPC),
    each piece at least :data:`MIN_SPLIT_CELLS` cells. More rows: one CTA each, 256 threads when every window
    fits ``4 topk`` cells (more rows in flight per SM), :data:`SMALL_MANY_NT` in shared memory up to
    :data:`SMALL_MANY_CELLS`, else 512 threads sampling a threshold."""
    return _config(torch.device(device).index or 0, rows, width, topk)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


# ---------------------------------------------------------------- launches
# A launch costs one ctypes call of the driver's cuLaunchKernelEx: the launch configuration (a cuda-bindings
# CUlaunchConfig, built once per plan and stream) and the kernel handle are cached, the kernel's arguments
# are written into a per-thread ctypes record whose field addresses form the kernelParams array (the driver copies
# the values during the call). cuda-bindings' own cuLaunchKernelEx converted the arguments on every call (27.6 us
# of host time per call on the H200's host, docs/benchmarks.md).

class _Params(ctypes.Structure):
    _fields_ = [("logits", ctypes.c_void_p), ("stride_l", ctypes.c_longlong), ("starts", ctypes.c_void_p),
                ("ends", ctypes.c_void_p), ("out", ctypes.c_void_p), ("stride_o", ctypes.c_longlong),
                ("k", ctypes.c_int), ("cap", ctypes.c_int), ("samp", ctypes.c_int), ("small_max", ctypes.c_int),
                ("vec_ok", ctypes.c_int), ("stop", ctypes.c_int), ("pf_bytes", ctypes.c_int),
                ("spec_bytes", ctypes.c_int), ("width", ctypes.c_int)]


def _pointers(rec: ctypes.Structure):
    """The addresses of ``rec``'s fields, as a kernelParams array."""
    base = ctypes.addressof(rec)
    return (ctypes.c_void_p * len(rec._fields_))(*[base + getattr(type(rec), f).offset for f, _ in rec._fields_])


class _ThreadParams(threading.local):
    """One argument record per thread (launches from several threads never share one), and whether this thread
    has a current CUDA context (checked at its first launch: the driver launches into the calling thread's
    context, and a thread whose first CUDA call is this launch has none)."""

    def __init__(self):
        self.has_ctx = False
        self.p = _Params()
        self.ptrs = _pointers(self.p)


_PARAMS = _ThreadParams()


@functools.cache
def _driver_lib():
    return ctypes.CDLL("libcuda.so.1")


def _ensure_context(index: int) -> None:
    """Make device ``index``'s primary context current on this thread if the thread has no current context
    (what the runtime API does implicitly and a raw driver launch does not). Once per thread."""
    lib = _driver_lib()
    ctx = ctypes.c_void_p()
    rc = lib.cuCtxGetCurrent(ctypes.byref(ctx))
    if rc == 0 and not ctx.value:
        dev = ctypes.c_int()
        rc = lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index))
        if rc == 0:
            rc = lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
        if rc == 0:
            rc = lib.cuCtxSetCurrent(ctx)
    if rc:
        raise _launch_error(rc)
    _PARAMS.has_ctx = True


@functools.cache
def _driver_launch():
    """``cuLaunchKernelEx`` of the process's CUDA driver through ctypes (the library cuda-bindings loads)."""
    fn = _driver_lib().cuLaunchKernelEx
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _launch_error(rc: int) -> RuntimeError:
    from cuda.bindings import driver

    try:
        name = driver.cuGetErrorName(driver.CUresult(rc))[1]
    except Exception:  # noqa: BLE001 - the message only
        name = rc
    return RuntimeError(f"cuLaunchKernelEx failed: {name!r} ({rc})")


class _Plan:
    """Everything a launch needs that depends on shapes only: kernel, grid, layout and launch configurations."""

    __slots__ = ("index", "kern", "handle", "nt", "cs", "grid", "cap", "samp", "small_max", "smem", "pf", "spec",
                 "cfgs")

    def __init__(self, index, nt, cs, rows, topk, width, bf16, small=None, defines=(), pf=None, spec=None):
        self.index, self.nt, self.cs, self.grid = index, nt, cs, rows * cs
        self.pf = prefetch_bytes(rows, cs) if pf is None else pf
        self.cap, self.samp, self.small_max, self.smem = layout(topk, width, small)
        if spec is None:
            spec = speculative_bytes(rows, width * (2 if bf16 else 4), cs, _sm_count(index), self.small_max >= width)
        self.spec = spec
        self.kern = _kernel(index, nt, cs, bf16, defines)[1]
        self.handle = int(self.kern)
        self.cfgs: dict = {}  # raw stream -> (CUlaunchConfig, its address)

    def cfg(self, stream: int) -> tuple:
        """``(CUlaunchConfig, its address)`` for ``stream``; the caller keeps the tuple referenced through the
        launch (another thread may drop the table's entries meanwhile)."""
        got = self.cfgs.get(stream)
        if got is None:
            from cuda.bindings import driver

            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid, 1, 1
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.nt, 1, 1
            cfg.sharedMemBytes = self.smem
            cfg.hStream = driver.CUstream(stream)
            if self.cs > 1:
                attr = driver.CUlaunchAttribute()
                attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = self.cs, 1, 1
                cfg.attrs = [attr]
                cfg.numAttrs = 1
            else:
                cfg.numAttrs = 0
            if len(self.cfgs) >= 64:  # streams come and go (e.g. one per capture): keep the table small
                self.cfgs.clear()
            got = self.cfgs[stream] = (cfg, cfg.getPtr())
        return got

    def fire(self, logits, row_starts, row_ends, out, stop: int = 0) -> None:
        """Launch on torch's current stream of the plan's device (the arguments already checked)."""
        stream = torch._C._cuda_getCurrentRawStream(self.index)
        got = self.cfgs.get(stream)
        if got is None:
            got = self.cfg(stream)
        tp = _PARAMS
        if not tp.has_ctx:
            _ensure_context(self.index)
        p = tp.p
        ptr = logits.data_ptr()
        p.logits = ptr
        p.stride_l = logits.stride(0)
        p.starts = row_starts.data_ptr()
        p.ends = row_ends.data_ptr()
        p.out = out.data_ptr()
        p.stride_o = out.stride(0)
        p.k = out.shape[1]
        p.cap = self.cap
        p.samp = self.samp
        p.small_max = self.small_max
        p.vec_ok = not ptr & 15
        p.stop = stop
        p.pf_bytes = self.pf
        p.spec_bytes = self.spec
        p.width = logits.shape[1]  # the kernel clamps the windows into [0, W)
        rc = _driver_launch()(got[1], self.handle, tp.ptrs, None)
        if rc:
            raise _launch_error(rc)


@functools.lru_cache(maxsize=1024)
def _plan(index: int, rows: int, width: int, topk: int, bf16: bool) -> _Plan | str:
    """The plan of the default configuration, or why this GPU cannot run the case (a ``str``; the caller raises
    ``NotImplementedError`` before anything is written, so ``auto`` takes Triton)."""
    nt, cs, small = _config(index, rows, width, topk)
    smem = layout(topk, width, small)[3]
    if small and smem > _smem_optin(index) and width > cap_for(topk):  # a long row's layout instead
        nt, cs, small = 512 if rows > _sm_count(index) else 1024, 1, False
        smem = layout(topk, width, small)[3]
    if smem > _smem_optin(index):
        return (f"the CUDA top-k needs {smem} bytes of shared memory per CTA for topk={topk}; "
                f"cuda:{index} allows {_smem_optin(index)}")
    why = _usable(index, nt, cs, bf16)
    if why is not None:
        return why
    return _Plan(index, nt, cs, rows, topk, width, bf16, small)


def launch(logits, row_starts, row_ends, out, *, nt: int, cs: int, stop: int = 0, small: bool | None = None,
           defines: tuple = (), pf: int | None = None, spec: int | None = None) -> None:
    """One launch of the kernel with ``nt`` threads and ``cs`` CTAs per row (arguments already checked).

    ``stop`` (timing of the phases only; ``out`` is then not written): 3 returns after reading the window
    bounds, 4 after loading the sample (a row in shared memory: after loading it), 1 after the sample threshold
    (after its first digit), 5 after staging (before the cluster's merge), 2 after the filter pass and the merge.
    ``defines=("PROBE=1",)`` builds a measurement kernel that writes the ``clock64()`` of its phase marks over
    ``out[row, :8]``. ``small``: see
    :func:`layout`. ``defines``: extra ``-D`` options of the kernel source (measurements only). ``pf``: bytes of
    its share each CTA asks L2 for after issuing the sample loads (default :func:`prefetch_bytes`). ``spec``:
    bytes each CTA asks L2 for before reading the bounds (default :func:`speculative_bytes`)."""
    r, w = logits.shape
    if r == 0:
        return
    index = logits.device.index or 0
    plan = _Plan(index, nt, cs, r, out.shape[1], w, logits.dtype == torch.bfloat16, small, tuple(defines), pf,
                 spec)
    plan.fire(logits, row_starts, row_ends, out, stop)


def top_k_per_row(logits, row_starts, row_ends, *, out, workspace=None, candidates=None,
                  candidate_block_size=None) -> None:
    """See :func:`sparse_indexer.top_k_per_row`; arguments are checked (float32 or bfloat16 logits).
    ``workspace`` is not needed here."""
    if candidates is not None:  # the two-level indexer's kernel (CANDIDATES_SOURCE)
        candidate_top_k(logits, row_starts, row_ends, out, candidates, candidate_block_size)
        return
    dev = logits.device
    if dev.type != "cuda" or torch.version.hip is not None:
        raise NotImplementedError(f"the CUDA top-k runs on NVIDIA GPUs, not {dev}")
    topk = out.shape[1]
    if topk > MAX_TOPK:  # the candidate and tie buffers would not fit shared memory
        raise NotImplementedError(f"the CUDA top-k takes topk <= {MAX_TOPK}, got {topk}")
    r, w = logits.shape
    if r == 0:
        return
    index = dev.index
    plan = _plan(index, r, w, topk, logits.dtype == torch.bfloat16)
    if type(plan) is str:  # cases this GPU cannot run: before anything is written, so auto takes Triton
        raise NotImplementedError(plan)
    on_device(index, plan.fire, logits, row_starts, row_ends, out)  # (the launch goes to the current context)


# ---------------------------------------------------------------- the two-level indexer's kernels
CANDIDATES_SOURCE = pathlib.Path(__file__).parent.parent / "select_candidate_blocks" / "candidates_kernel.cu"
"""The two-level indexer's kernels (``si_select_candidate_blocks``, ``si_candidate_topk``): one source, loaded here
for this backend's candidate-restricted top-k and ``sparse_indexer/ops/select_candidate_blocks/cuda.py``."""
CAND_NT = 1024
CAND_HEADER_WORDS = 2048 + 16 + 32  # histogram, counters, warp sums (candidates_kernel.cu's OFF_DATA)


class _SelectArgs(ctypes.Structure):
    _fields_ = [("logits", ctypes.c_void_p), ("stride_l", ctypes.c_longlong), ("starts", ctypes.c_void_p),
                ("ends", ctypes.c_void_p), ("out", ctypes.c_void_p), ("stride_o", ctypes.c_longlong),
                ("kb", ctypes.c_int), ("ws", ctypes.c_void_p), ("stride_w", ctypes.c_longlong), ("bs", ctypes.c_int),
                ("vec_ok", ctypes.c_int), ("width", ctypes.c_int)]


class _TopkArgs(ctypes.Structure):
    _fields_ = [("logits", ctypes.c_void_p), ("stride_l", ctypes.c_longlong), ("starts", ctypes.c_void_p),
                ("ends", ctypes.c_void_p), ("cand", ctypes.c_void_p), ("stride_c", ctypes.c_longlong),
                ("kb", ctypes.c_int), ("bs", ctypes.c_int), ("out", ctypes.c_void_p), ("stride_o", ctypes.c_longlong),
                ("topk", ctypes.c_int), ("width", ctypes.c_int)]


class _CandArgs(threading.local):
    def __init__(self):
        self.select = _SelectArgs()
        self.topk = _TopkArgs()
        self.select_ptrs = _pointers(self.select)
        self.topk_ptrs = _pointers(self.topk)


CAND_ARGS = _CandArgs()


@functools.cache
def _cand_launch_fn():
    fn = _driver_lib().cuLaunchKernel
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def cand_kernel(index: int, name: bytes, bf16: bool) -> int:
    """The handle of the candidate kernel ``name`` on device ``index``."""
    return int(_kernel(index, CAND_NT, 1, bf16, (), name, CANDIDATES_SOURCE)[1])


def cand_check_device(dev: torch.device) -> None:
    """``NotImplementedError`` (``auto`` takes the next backend) unless the candidate kernels can run on ``dev``."""
    if dev.type != "cuda" or torch.version.hip is not None:
        raise NotImplementedError(f"the CUDA candidate kernels run on NVIDIA GPUs, not {dev}")
    why = unavailable_reason()
    if why is not None:
        raise NotImplementedError(why)


def cand_fire(index: int, kern: int, rows: int, smem: int, ptrs) -> None:
    """Launch ``kern`` with one CTA of ``CAND_NT`` threads per row on torch's current stream of device ``index``
    (``ptrs``: the kernel parameters' addresses, a :data:`CAND_ARGS` record's)."""
    if not _PARAMS.has_ctx:
        _ensure_context(index)
    stream = torch._C._cuda_getCurrentRawStream(index)
    rc = _cand_launch_fn()(kern, rows, 1, 1, CAND_NT, 1, 1, smem, stream, ptrs, None)
    if rc:
        raise _launch_error(rc)


def on_device(index: int, fn, *args) -> None:
    """``fn(*args)`` with device ``index`` current (the driver launches into the current context)."""
    if torch._C._cuda_getDevice() != index:
        with torch.cuda.device(index):
            fn(*args)
    else:
        fn(*args)


def candidate_top_k(logits, row_starts, row_ends, out, candidates, block_size) -> None:
    """The candidate-restricted top-k (arguments checked); ``NotImplementedError`` when a row's ``K_b * b``
    candidate cells do not fit shared memory (``auto`` then takes Triton)."""
    dev = logits.device
    cand_check_device(dev)
    r = logits.shape[0]
    if r == 0:
        return
    index = dev.index or 0
    kb = candidates.shape[1]
    smem = (CAND_HEADER_WORDS + kb + kb * block_size) * 4
    if smem > _smem_optin(index):
        raise NotImplementedError(f"{kb} candidate blocks of {block_size} positions need {smem} bytes of shared "
                                  f"memory per row; cuda:{index} allows {_smem_optin(index)}")
    kern = cand_kernel(index, b"si_candidate_topk", logits.dtype == torch.bfloat16)
    a = CAND_ARGS.topk
    a.logits, a.stride_l = logits.data_ptr(), logits.stride(0)
    a.starts, a.ends = row_starts.data_ptr(), row_ends.data_ptr()
    a.cand, a.stride_c, a.kb, a.bs = candidates.data_ptr(), candidates.stride(0), kb, block_size
    a.out, a.stride_o, a.topk = out.data_ptr(), out.stride(0), out.shape[1]
    a.width = logits.shape[1]
    on_device(index, cand_fire, index, kern, r, smem, CAND_ARGS.topk_ptrs)
