# Racecheck triage, third variant: the canonical Gluon pattern of Triton's own tutorials -- mbarriers allocated and
# initialised before gl.warp_specialize (Triton follows each init with the default warps' `bar.sync 0, 128`), two
# partitions that never touch them or any other shared memory of ours. If racecheck reports hazards here, the
# reports on the logits kernels (same source lines: the kernel's `def` and the first statement after the region)
# are about Triton's partition hand-over, not about anything the kernels share.
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from ws_only import _default, _worker  # the same two partitions (this folder is on sys.path when run)


@gluon.jit
def k3(x_ptr, y_ptr, z_ptr, N: gl.constexpr):
    pid = gl.program_id(0)
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(bars.index(i), count=1)
    gl.warp_specialize([(_default, (x_ptr + pid * N, N)), (_worker, (y_ptr + pid * N, N))], [1], [24])
    b_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, N, layout=b_l)
    gl.store(z_ptr + pid * N + offs, gl.full([N], 3.0, gl.float32, b_l))


if __name__ == "__main__":
    n = 128
    x = torch.zeros(4 * n, device="cuda")
    y = torch.zeros(4 * n, device="cuda")
    z = torch.zeros(4 * n, device="cuda")
    k3[(4,)](x, y, z, n, num_warps=4)
    torch.cuda.synchronize()
    ok = bool((x == 1).all()) and bool((y == 2).all()) and bool((z == 3).all())
    print("k3 (mbarrier init + warp_specialize) ok" if ok else "k3 WRONG", flush=True)
    sys.exit(0 if ok else 1)
