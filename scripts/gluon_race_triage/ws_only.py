# Is compute-sanitizer racecheck's report at gl.warp_specialize Triton's own lowering? A minimal Gluon kernel: a
# default partition and one worker partition that share NOTHING we allocate (each stores to its own global
# range); any shared-memory hazard racecheck reports here comes from warp_specialize's lowering, not our code.
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _default(x_ptr, N: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, N, layout=layout)
    gl.store(x_ptr + offs, gl.load(x_ptr + offs) + 1.0)


@gluon.jit
def _worker(y_ptr, N: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs = gl.arange(0, N, layout=layout)
    gl.store(y_ptr + offs, gl.load(y_ptr + offs) + 2.0)


@gluon.jit
def ws_kernel(x_ptr, y_ptr, N: gl.constexpr):
    pid = gl.program_id(0)
    gl.warp_specialize([(_default, (x_ptr + pid * N, N)), (_worker, (y_ptr + pid * N, N))], [1], [24])


if __name__ == "__main__":
    n = 128
    x = torch.zeros(4 * n, device="cuda")
    y = torch.zeros(4 * n, device="cuda")
    ws_kernel[(4,)](x, y, n, num_warps=4)
    torch.cuda.synchronize()
    ok = bool((x == 1).all()) and bool((y == 2).all())
    print("ws_kernel ok" if ok else "ws_kernel WRONG")
    sys.exit(0 if ok else 1)
