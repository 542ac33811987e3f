"""CUDA backend of ``top_k_per_row`` (NVIDIA only): ``topk_kernel.cu`` compiled at first use by NVRTC.

The kernel (docs/spec.md §6 semantics; its algorithm is described at the top of ``topk_kernel.cu``) runs one
cluster of ``CS`` CTAs per row: a strided sample gives a threshold, one pass over the window pushes the cells above
it (and the positions of cells equal to it) into the leader CTA's shared memory, and the leader radix-selects
exactly among them (shared-memory histograms with 2048 bins: what Triton 3.6 cannot express). It needs no global
workspace (``workspace`` is accepted and ignored) and makes no host sync and no allocation per call.

Needs ``cuda-bindings`` (``cuda.bindings.nvrtc`` / ``cuda.bindings.driver``; a dependency of torch's CUDA 13
wheels, or ``pip install sparse-indexer[cuda]``) and the NVRTC library (``nvidia-cuda-nvrtc``). Without them the
backend reports itself unavailable and ``auto`` uses Triton. Compiled cubins are cached on disk under
``$SPARSE_INDEXER_CACHE_DIR`` (default ``~/.cache/sparse_indexer/nvrtc``), keyed by the SHA-256 of the source, the
compile options, the target architecture and the NVRTC version. Launches go to torch's current stream (CUDA-graph
capturable). ``topk`` up to :data:`MAX_TOPK`; larger raises :class:`NotImplementedError` (``auto`` then uses Triton).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import pathlib
import tempfile

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


def layout(topk: int, width: int, small: bool | None = None) -> tuple[int, int, int, int]:
    """``(cap, sample words, small_max, dynamic shared bytes)`` of a launch over rows of at most ``width`` cells.

    ``small`` (default: ``width <= cap_for(topk)``): every window of the launch fits the candidate buffer and
    is selected in shared memory without sampling; the launch then gets only the counters, the histogram and
    ``width`` key slots, so more CTAs share an SM. Otherwise windows up to ``cap`` cells are still selected
    that way and longer ones sample a threshold first."""
    cap = cap_for(topk)
    if small is None:
        small = width <= cap
    if small:
        if width > cap:
            raise ValueError(f"small layout needs width <= {cap}, got {width}")
        return max(width, 1), 0, width, 4 * (SM_WORDS - SMAX + max(width, 1))
    return cap, SMAX, 0 if width <= cap else cap, 4 * (SM_WORDS + 2 * cap + topk)


def _cache_dir() -> pathlib.Path:
    d = os.environ.get("SPARSE_INDEXER_CACHE_DIR")
    if d:
        return pathlib.Path(d) / "nvrtc"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "sparse_indexer" / "nvrtc"


def _compile(arch: str, nt: int, cs: int, *, cached: bool = True) -> bytes:
    """The cubin of the kernel for ``arch`` (``sm_90a``...), from the disk cache (unless ``cached=False``) or
    NVRTC."""
    from cuda.bindings import nvrtc

    src = SOURCE.read_bytes()
    opts = [f"--gpu-architecture={arch}", "-std=c++17", f"-DNT={nt}", f"-DCS={cs}", f"-DSMAX={SMAX}",
            f"-DMINB={max(1, 1024 // nt)}", "-lineinfo"]
    ver = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    key = hashlib.sha256(src + repr((opts, ver)).encode()).hexdigest()[:32]
    path = _cache_dir() / f"topk_{arch}_{key}.cubin"
    if cached:
        try:
            return path.read_bytes()
        except OSError:
            pass
    prog = _check(nvrtc.nvrtcCreateProgram(src, b"topk_kernel.cu", 0, [], []), "nvrtcCreateProgram")
    try:
        bopts = [o.encode() for o in opts]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(bopts), bopts)
        if int(res) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed to compile {SOURCE.name} ({' '.join(opts)}):\n{log.decode()}")
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
def _kernel(index: int, nt: int, cs: int):
    """The loaded ``CUkernel`` for device ``index``, allowed the device's whole opt-in shared memory (a limit
    only: each launch's occupancy follows the dynamic shared bytes it asks for)."""
    from cuda.bindings import driver

    torch.cuda.init()
    try:
        lib = _check(driver.cuLibraryLoadData(_compile(_arch(index), nt, cs), [], [], 0, [], [], 0),
                     "cuLibraryLoadData")
    except RuntimeError:  # a damaged cache entry: compile afresh (and overwrite it)
        lib = _check(driver.cuLibraryLoadData(_compile(_arch(index), nt, cs, cached=False), [], [], 0, [], [], 0),
                     "cuLibraryLoadData")
    kern = _check(driver.cuLibraryGetKernel(lib, b"si_top_k_per_row"), "cuLibraryGetKernel")
    dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
    smem = _check(driver.cuDeviceGetAttribute(
        driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev), "cuDeviceGetAttribute")
    A = driver.CUfunction_attribute
    _check(driver.cuKernelSetAttribute(A.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem, kern, dev),
           "cuKernelSetAttribute(max dynamic shared)")
    if cs > 8:
        _check(driver.cuKernelSetAttribute(A.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1, kern, dev),
               "cuKernelSetAttribute(non-portable cluster)")
    return lib, kern


@functools.cache
def _usable(index: int, nt: int, cs: int) -> str | None:
    """``None`` when the kernel of ``(nt, cs)`` compiles and loads on device ``index``, else why not (an NVRTC
    too old for the GPU's architecture, a driver older than the NVRTC, ...). Cached, failures included: ``auto``
    then falls back to Triton on every call without compiling again."""
    try:
        _kernel(index, nt, cs)
    except RuntimeError as e:
        return f"the CUDA top-k kernel could not be built or loaded on cuda:{index}: {e}"
    return None


@functools.cache
def _smem_optin(index: int) -> int:
    """Largest dynamic shared memory one CTA may opt in to on device ``index``, in bytes."""
    return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


@functools.lru_cache(maxsize=256)
def config(rows: int, width: int, device: torch.device, topk: int = 2048) -> tuple[int, int]:
    """``(threads per CTA, CTAs per row)`` for a call of ``rows`` rows of ``width`` cells (shapes only).

    Measured on an H200 (``bench --sweep topk``, docs/benchmarks.md): up to one row per SM, 1024
    threads and the rows split over clusters (sm_90+) of 8 CTAs while ``8 rows`` fit half the SMs, of 4 likewise,
    of 2 while ``2 rows`` fit the SMs (larger clusters wait for a free group of SMs in one GPC), each piece at
    least :data:`MIN_SPLIT_CELLS` cells; more rows one CTA each, 512 threads (256 when every window fits shared
    memory: more rows in flight per SM)."""
    index = torch.device(device).index or 0
    sms = _sm_count(index)
    if rows > sms:
        return (256 if width <= cap_for(topk) else 512), 1
    cs = 1
    if torch.cuda.get_device_capability(index)[0] >= 9:
        for c, budget in ((8, sms // 2), (4, sms // 2), (2, sms)):
            if rows * c <= budget and width // c >= MIN_SPLIT_CELLS:
                cs = c
                break
    return 1024, cs


_ARGTYPES = (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)


@functools.lru_cache(maxsize=256)
def _launch_config(index: int, nt: int, cs: int, grid: int, smem: int, stream: int):
    """A ``CUlaunchConfig`` (cached: building one costs microseconds of host time per call)."""
    from cuda.bindings import driver

    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = nt, 1, 1
    cfg.sharedMemBytes = smem
    cfg.hStream = driver.CUstream(stream)
    if cs > 1:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cs, 1, 1
        cfg.attrs = [attr]
        cfg.numAttrs = 1
    else:
        cfg.numAttrs = 0
    return cfg


def launch(logits, row_starts, row_ends, out, *, nt: int, cs: int, stop: int = 0, small: bool | None = None) -> None:
    """One launch of the kernel with ``nt`` threads and ``cs`` CTAs per row (arguments already checked).

    ``stop`` (timing of the phases only; ``out`` is then not written): 3 returns after reading the window
    bounds, 4 after loading the sample, 1 after the sample threshold, 2 after the filter pass. ``small``: see
    :func:`layout`."""
    from cuda.bindings import driver

    r, w = logits.shape
    topk = out.shape[1]
    if r == 0:
        return
    index = logits.device.index or 0
    cap, samp, small_max, smem = layout(topk, w, small)
    _, kern = _kernel(index, nt, cs)
    cfg = _launch_config(index, nt, cs, r * cs, smem, torch._C._cuda_getCurrentRawStream(index))  # torch's stream
    vec_ok = int(logits.data_ptr() % 16 == 0)
    args = (logits.data_ptr(), logits.stride(0), row_starts.data_ptr(), row_ends.data_ptr(), out.data_ptr(),
            out.stride(0), topk, cap, samp, small_max, vec_ok, stop)
    _check(driver.cuLaunchKernelEx(cfg, kern, (args, _ARGTYPES), 0), "cuLaunchKernelEx")


def top_k_per_row(logits, row_starts, row_ends, *, out, workspace=None) -> None:
    """See :func:`sparse_indexer.top_k_per_row`; arguments are checked. ``workspace`` is not needed here."""
    del workspace
    if logits.device.type != "cuda" or torch.version.hip is not None:
        raise NotImplementedError(f"the CUDA top-k runs on NVIDIA GPUs, not {logits.device}")
    topk = out.shape[1]
    if topk > MAX_TOPK:  # the candidate and tie buffers would not fit shared memory
        raise NotImplementedError(f"the CUDA top-k takes topk <= {MAX_TOPK}, got {topk}")
    if logits.shape[0] == 0:
        return
    nt, cs = config(logits.shape[0], logits.shape[1], logits.device, topk)
    index = logits.device.index or 0
    # cases this GPU cannot run raise NotImplementedError before anything is written, so auto takes Triton
    smem = layout(topk, logits.shape[1])[3]
    if smem > _smem_optin(index):
        raise NotImplementedError(f"the CUDA top-k needs {smem} bytes of shared memory per CTA for topk={topk}; "
                                  f"cuda:{index} allows {_smem_optin(index)}")
    why = _usable(index, nt, cs)
    if why is not None:
        raise NotImplementedError(why)
    if torch.cuda.current_device() != index:  # the launch goes to the current context: make it the tensors'
        with torch.cuda.device(index):
            launch(logits, row_starts, row_ends, out, nt=nt, cs=cs)
        return
    launch(logits, row_starts, row_ends, out, nt=nt, cs=cs)
