"""Interpreter check (CPU): TRITON_INTERPRET=1 python scripts/gpu_topk_cpu_check.py."""
import os

import torch

import sparse_indexer as si
from sparse_indexer.kcache import new_kv_cache

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

torch.manual_seed(0)

def check_write(T, S, bs, d, nb, pad, fmt, dt, dtype=torch.bfloat16):
    k = (torch.randn(T, d) * torch.rand(T, 1) * 10).to(dtype)
    k[0] = 0
    perm = torch.randperm(nb * bs)[:S]
    slots = perm.clone()
    slots[::5] = -1
    outs = []
    for be in ("reference", "triton"):
        kv = new_kv_cache(nb, bs, d, block_pad=pad)
        kv.view(-1)  if False else None
        si.write_k_cache(k, kv, slots, scale_fmt=fmt, fp8_dtype=dt, backend=be)
        outs.append(kv)
    a, b = outs
    assert torch.equal(a, b), (T, S, bs, d, fmt, dt, (a != b).nonzero()[:5])

for fmt in ("ue8m0", None):
    for dt in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        for bs, d in ((64, 128), (1, 64), (16, 128)):
            for dtype in (torch.bfloat16, torch.float32):
                check_write(40, 33, bs, d, 8, 16, fmt, dt, dtype)
print("write ok")
# exhaustive-ish fp8 rounding check of the kernel's soft path against torch
for _ in range(3):
    check_write(64, 64, 16, 128, 8, 0, None, torch.float8_e4m3fn, torch.float32)
print("write ok 2")

def check_gather(lens, bs, d, pad, dt, extra=5):
    nb = sum((n + bs - 1) // bs for n in lens) + 3
    kv = new_kv_cache(nb, bs, d, block_pad=pad)
    kv.view(torch.uint8).copy_(torch.randint(0, 256, kv.shape, dtype=torch.uint8))
    mb = max(1, max((n + bs - 1) // bs for n in lens))
    perm = torch.randperm(nb)
    bt = torch.zeros(len(lens), mb + 1, dtype=torch.int32)
    c = 0
    for i, n in enumerate(lens):
        k = (n + bs - 1) // bs
        bt[i, :k] = perm[c:c + k].int()
        c += k
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    n = int(cu[-1]) + extra
    res = []
    for be in ("reference", "triton"):
        ok = torch.full((n, d), 7, dtype=torch.uint8).view(dt)
        osc = torch.full((n,), 3.0)
        si.gather_k_cache(kv, bt, cu, out_k=ok, out_scale=osc, backend=be)
        res.append((ok.view(torch.uint8), osc.view(torch.int32)))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1]), (lens, bs, d)

for bs, d in ((64, 128), (1, 64), (16, 128), (32, 64)):
    for dt in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        check_gather([100, 0, 37, 1, 129], bs, d, 8, dt)
check_gather([0, 0], 64, 128, 0, torch.float8_e4m3fn)
print("gather ok")
