# Racecheck triage for the Gluon logits kernels' reported hazards (prologue reductions before gl.warp_specialize,
# and the store loop after it): a minimal kernel with the same shape -- a cross-warp reduction and scan in the
# prologue (shared-memory scratch), warp_specialize (default + one worker, sharing nothing we allocate), then a
# loop after it. variant "plain": the same without warp_specialize. Hazards here are Triton's lowering, not ours.
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from ws_only import _default, _worker  # the same two partitions (this folder is on sys.path when run)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def k2(x_ptr, y_ptr, z_ptr, c_ptr, N: gl.constexpr, WS: gl.constexpr):
    pid = gl.program_id(0)
    b_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, N, layout=b_l)
    c = gl.load(c_ptr + offs)
    cum = gl.associative_scan(c, 0, _add)
    total = gl.sum(c, axis=0)
    first = gl.sum((cum <= total // 2).to(gl.int32), axis=0)
    if WS:
        gl.warp_specialize([(_default, (x_ptr + pid * N, N)), (_worker, (y_ptr + pid * N, N))], [1], [24])
    for _i in range(pid, 4, 4):
        gl.store(z_ptr + pid * N + offs, (cum + first + total).to(gl.float32))


if __name__ == "__main__":
    n = 128
    c = torch.randint(0, 5, (n,), device="cuda", dtype=torch.int32)
    for ws in (False, True):
        x = torch.zeros(4 * n, device="cuda")
        y = torch.zeros(4 * n, device="cuda")
        z = torch.zeros(4 * n, device="cuda")
        k2[(4,)](x, y, z, c, n, ws, num_warps=4)
        torch.cuda.synchronize()
        cum = torch.cumsum(c, 0)
        tot = int(c.sum())
        first = int((cum <= tot // 2).sum())
        ok = torch.equal(z.view(4, n), (cum + first + tot).float().expand(4, n))
        if ws:
            ok = ok and bool((x == 1).all()) and bool((y == 2).all())
        print(f"k2 warp_specialize={ws}: {'ok' if ok else 'WRONG'}", flush=True)
        if not ok:
            sys.exit(1)
