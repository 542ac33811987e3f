"""Racecheck triage, fourth variant: Triton's warp-specialize hand-over written by hand in CUDA (NVRTC), no Triton.

Four warps of "default" threads hand a state word to four "worker" warps the way Triton 3.6 lowers
``gl.warp_specialize``: every default thread stores the word, then ``barrier.sync 1`` (all threads of the CTA); the
workers wait at that barrier in a loop, read their byte of the word and run, join at the next ``barrier.sync 1``, and
read the exit word after a third. Every read of the word is ordered after its write by a CTA-wide barrier, so the
kernel is race-free by construction. The variants differ only in what the default warps do *before* the hand-over:

    PRO=0  nothing                                              (like ws_only.py: racecheck reported 0)
    PRO=1  a reduction through shared memory + ``bar.sync 0, 128`` (what Triton emits for a prologue reduction or
           between mbarrier inits: barrier 0, the default warps' 128 threads)
    PRO=2  the same reduction + ``bar.sync 2, 128`` (another barrier id)
    PRO=3  ``bar.sync 0, 128`` alone, no shared access before the hand-over

A hazard reported on PRO=1 or PRO=3 here is a racecheck report on correct code: the logits kernels' reports sit on
exactly this word (the worker's read at the kernel's entry, the default warps' writes before and after the region).

    python scripts/gluon_race_triage/cuda_handover.py                       # runs every variant, checks results
    compute-sanitizer --tool racecheck python scripts/gluon_race_triage/cuda_handover.py
"""

import ctypes
import sys

import torch

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256) KNAME(int* out) {
    __shared__ unsigned int state[4];   // state[1]: one byte per worker warp 4..7
    __shared__ int scratch[4];
    const int tid = threadIdx.x, warp = tid >> 5;
    if (warp < 4) {
        int s = 0;
#if PRO == 1 || PRO == 2
        if ((tid & 31) == 0) scratch[warp] = warp + 1;
        asm volatile("bar.sync " BAR ", 128;" ::: "memory");
        s = scratch[0] + scratch[1] + scratch[2] + scratch[3];
#elif PRO == 3
        asm volatile("bar.sync 0, 128;" ::: "memory");
#endif
        state[1] = 0x01010101u;                          // hand over: partition 1 for warps 4..7
        asm volatile("barrier.sync 1;" ::: "memory");
        out[blockIdx.x * 256 + tid] = 100 + s;           // the default partition's work
        asm volatile("barrier.sync 1;" ::: "memory");    // join
        state[1] = 0x02020202u;                          // exit
        asm volatile("barrier.sync 1;" ::: "memory");
    } else {
        for (;;) {
            asm volatile("barrier.sync 1;" ::: "memory");
            const unsigned char v = reinterpret_cast<volatile unsigned char*>(state)[4 + warp - 4];
            if (v == 2) break;
            out[blockIdx.x * 256 + tid] = v;             // the worker partition's work
            asm volatile("barrier.sync 1;" ::: "memory");  // join
        }
    }
}
"""

VARIANTS = {0: "no prologue", 1: "reduction + bar.sync 0,128", 2: "reduction + bar.sync 2,128",
            3: "bar.sync 0,128 only"}
CTAS = 4


def _check(result, what):
    err, *vals = result
    if int(err) != 0:
        raise RuntimeError(f"{what}: {err}")
    return vals[0] if len(vals) == 1 else vals


def compile_ptx_or_cubin(pro: int, arch: str, cubin: bool = True) -> bytes:
    from cuda.bindings import nvrtc

    prog = _check(nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"handover.cu", 0, [], []), "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}", f"-DPRO={pro}", f"-DKNAME=handover_pro{pro}", '-DBAR="0"' if pro != 2
            else '-DBAR="2"', "-lineinfo"]
    (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
    if int(res) != 0:
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(log.decode())
    get_size, get = (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if cubin else (nvrtc.nvrtcGetPTXSize,
                                                                                  nvrtc.nvrtcGetPTX)
    size = _check(get_size(prog), "size")
    buf = b" " * size
    _check(get(prog, buf), "get")
    nvrtc.nvrtcDestroyProgram(prog)
    return buf


def main() -> int:
    from cuda.bindings import driver

    torch.cuda.init()
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    ok_all = True
    for pro, what in VARIANTS.items():
        out = torch.zeros(CTAS * 256, dtype=torch.int32, device="cuda")
        mod = _check(driver.cuModuleLoadData(compile_ptx_or_cubin(pro, arch)), "cuModuleLoadData")
        fn = _check(driver.cuModuleGetFunction(mod, f"handover_pro{pro}".encode()), "cuModuleGetFunction")
        args = ((out.data_ptr(),), (ctypes.c_void_p,))
        _check(driver.cuLaunchKernel(fn, CTAS, 1, 1, 256, 1, 1, 0, torch.cuda.current_stream().cuda_stream, args, 0),
               "cuLaunchKernel")
        torch.cuda.synchronize()
        s = 10 if pro in (1, 2) else 0
        want = torch.tensor(([100 + s] * 128 + [1] * 128) * CTAS, dtype=torch.int32)
        ok = torch.equal(out.cpu(), want)
        ok_all &= ok
        print(f"handover_pro{pro} ({what}): {'ok' if ok else 'WRONG'}", flush=True)
    return 0 if ok_all else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ptx":  # compile check without a GPU
        for p in VARIANTS:
            print(compile_ptx_or_cubin(p, "sm_90", cubin=False).decode().count("bar"), "barrier lines, PRO", p)
        sys.exit(0)
    sys.exit(main())
