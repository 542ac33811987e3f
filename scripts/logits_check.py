"""Compare the Triton logits kernels with the reference (CPU interpreter or GPU). Small shapes by default."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed

import sparse_indexer as si  # noqa: E402
from sparse_indexer.kcache import cache_views, new_kv_cache  # noqa: E402
from sparse_indexer.testing import logits_error  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn


def rand_fp8(*shape):
    return (torch.randn(*shape, device=dev) * 2).clamp(-448, 448).to(FP8)


def paged_case(b, next_n, h, d, bs, lens, w_extra=0, pad=0, cl2d=False, clean=True):
    max_blocks = max(1, (max(lens) + bs - 1) // bs) + 1
    nb = b * max_blocks + 3
    kv = new_kv_cache(nb, bs, d, device=dev, block_pad=pad)
    vals, scales = cache_views(kv, FP8)
    vals.copy_(rand_fp8(nb, bs, d))
    scales.copy_(torch.rand(nb, bs, device=dev) + 0.5)
    bt = torch.randperm(nb, device=dev)[: b * max_blocks].view(b, max_blocks).int()
    q = rand_fp8(b, next_n, h, d)
    wts = torch.randn(b * next_n, h, device=dev)
    L = torch.tensor(lens, device=dev, dtype=torch.int32)
    if cl2d:
        cl = (L[:, None] - torch.randint(0, 3, (b, next_n), device=dev)).clamp(min=0).int()
    else:
        cl = L
    W = max_blocks * bs + w_extra
    outs = []
    for be in ("reference", "triton"):
        o = torch.full((b * next_n, W + 5), 12345.0, device=dev)[:, :W]
        si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=o, clean=clean, backend=be)
        outs.append(o)
    return outs


def compare(name, ref, got, clean):
    """Relative L2 inside the windows and, with ``clean``, the exact -inf mask (sparse_indexer.testing); the
    reference leaves the 12345.0 sentinel outside the windows when not ``clean``."""
    inside = torch.isfinite(ref) & (ref != 12345.0)
    err, mask_bad = logits_error(got, ref, inside, clean=clean)
    good = mask_bad == 0 and err < 1e-5
    print(f"{name}: rel_l2={err:.2e} mask_ok={mask_bad == 0} {'OK' if good else 'FAIL'}")
    return good


allok = True
for (b, nn, h, d, bs, cl2d, clean, pad) in [
    (3, 1, 32, 64, 16, False, True, 0),
    (3, 2, 64, 128, 64, False, True, 16),
    (4, 3, 32, 64, 1, True, True, 0),
    (2, 4, 32, 128, 32, False, False, 4),
    (5, 2, 32, 64, 64, True, False, 0),
]:
    lens = torch.randint(0, 200, (b,)).tolist()
    lens[0] = 0
    ref, got = paged_case(b, nn, h, d, bs, lens, w_extra=37, pad=pad, cl2d=cl2d, clean=clean)
    if not clean:
        # cells outside windows: triton must not write
        allok &= torch.equal((ref == 12345.0), (got == 12345.0))
    allok &= compare(f"paged b={b} nn={nn} h={h} d={d} bs={bs} cl2d={cl2d} clean={clean} pad={pad}", ref, got, clean)

# ragged prefill
for (m, n, h, d, clean) in [(7, 150, 32, 64, True), (9, 200, 64, 128, False), (5, 70, 32, 128, True)]:
    q = rand_fp8(m, h, d)
    k = rand_fp8(n, d)
    ksc = torch.rand(n, device=dev) + 0.5
    wts = torch.randn(m, h, device=dev)
    ks = torch.randint(0, n // 2, (m,), device=dev).int()
    ke = (ks + torch.randint(-5, n // 2, (m,), device=dev)).clamp(max=n).int()
    outs = []
    for be in ("reference", "triton"):
        o = torch.full((m, n + 3), 12345.0, device=dev)[:, :n]
        si.fp8_mqa_logits(q, k, ksc, wts, ks, ke, out=o, clean=clean, backend=be)
        outs.append(o)
    if not clean:
        allok &= torch.equal((outs[0] == 12345.0), (outs[1] == 12345.0))
    allok &= compare(f"ragged m={m} n={n} h={h} d={d} clean={clean}", outs[0], outs[1], clean)
print("ALL OK" if allok else "SOME FAILED")
sys.exit(0 if allok else 1)
