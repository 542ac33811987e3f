"""MXFP4 against FP8 on one GPU, for the record (docs/benchmarks.md): the ragged and the paged (decode) scores of
the Triton kernels on the same shapes, FP8 beside MXFP4, L2 flushed (``triton.testing.do_bench``, medians), each
MXFP4 result checked against the reference first. Hopper has no FP4 matrix units: the MXFP4 kernels decode e2m1
to fp16 and run fp16 dots.

Run: ``PYTHONPATH=. python3 scripts/mxfp4_bench.py``."""

from __future__ import annotations

import torch
import triton.testing

import sparse_indexer as si
from buffers import CacheFormat
from sparse_indexer.testing import assert_logits

DEV = "cuda"


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3  # us


def ragged(m: int, n: int, h: int = 64, d: int = 128) -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    x, keys = torch.randn(m, h, d, device=DEV, generator=g), torch.randn(n, d, device=DEV, generator=g)
    w = torch.randn(m, h, device=DEV, generator=g) * (h * d) ** -0.5
    ks = torch.zeros(m, dtype=torch.int32, device=DEV)
    ke = torch.full((m,), n, dtype=torch.int32, device=DEV)
    out = torch.empty(m, n, device=DEV)
    q8, s8 = si.quantize_q(x)
    k8, kscale = si.quantize_k(keys)
    qv, qs = si.quantize_q_mxfp4(x)
    kv, ksc = si.quantize_k_mxfp4(keys)
    if m * n <= 1 << 22:
        want = si.fp8_mqa_logits(qv, kv, ksc, w, ks, ke, q_scale=qs, backend="reference")
        si.fp8_mqa_logits(qv, kv, ksc, w, ks, ke, q_scale=qs, out=out, backend="triton")
        assert_logits(out, want, rtol_l2=1e-6)
    t8 = bench(lambda: si.fp8_mqa_logits(q8, k8, kscale, w * s8, ks, ke, out=out, backend="triton"))
    t4 = bench(lambda: si.fp8_mqa_logits(qv, kv, ksc, w, ks, ke, q_scale=qs, out=out, backend="triton"))
    print(f"ragged {m} x {n} H={h}: fp8 {t8:9.1f} us  mxfp4 {t4:9.1f} us", flush=True)


def paged(b: int, ctx: int, next_n: int, h: int = 64, d: int = 128, bs: int = 64) -> None:
    g = torch.Generator(device=DEV).manual_seed(1)
    nb = b * (ctx // bs) + 2
    keys = torch.randn(nb * bs, d, device=DEV, generator=g)
    slots = torch.arange(nb * bs, device=DEV)
    bt = torch.randperm(nb, device=DEV, generator=g)[: b * (ctx // bs)].view(b, -1).int()
    cl = torch.full((b,), ctx, dtype=torch.int32, device=DEV)
    x = torch.randn(b * next_n, h, d, device=DEV, generator=g)
    w = torch.randn(b * next_n, h, device=DEV, generator=g) * (h * d) ** -0.5
    out = torch.empty(b * next_n, ctx, device=DEV)
    kv8 = si.new_kv_cache(nb, bs, d, device=DEV)
    si.write_k_cache(keys, kv8, slots)
    q8, s8 = si.quantize_q(x)
    q8 = q8.view(b, next_n, h, d)
    t8 = bench(lambda: si.fp8_paged_mqa_logits(q8, kv8, w * s8, cl, bt, out=out, backend="triton"))
    res = [f"paged B={b} L={ctx} next_n={next_n} H={h}: fp8 {t8:7.1f} us"]
    qv, qs = si.quantize_q_mxfp4(x)
    qv, qs = qv.view(b, next_n, h, d // 2), qs.view(b, next_n, h, d // 32)
    for name, fmt in (("mxfp4", CacheFormat(values="mxfp4")), ("mxfp4 tiled", CacheFormat.tiled_mxfp4(32))):
        kv4 = si.new_kv_cache(nb, bs, d, device=DEV, mxfp4=True)
        si.write_k_cache(keys, kv4, slots, cache_format=fmt)
        if b * ctx <= 1 << 18:
            want = si.fp8_paged_mqa_logits(qv, kv4, w, cl, bt, cache_format=fmt, q_scale=qs, backend="reference")
            si.fp8_paged_mqa_logits(qv, kv4, w, cl, bt, cache_format=fmt, q_scale=qs, out=out, backend="triton")
            assert_logits(out, want, rtol_l2=1e-6)
        t4 = bench(lambda kv4=kv4, fmt=fmt: si.fp8_paged_mqa_logits(qv, kv4, w, cl, bt, cache_format=fmt,
                                                                    q_scale=qs, out=out, backend="triton"))
        res.append(f"{name} {t4:7.1f} us")
    print("  ".join(res), flush=True)


def main() -> None:
    print(torch.cuda.get_device_name(), flush=True)
    paged(4, 8192, 1)  # checked against the reference
    for b, ctx, nn in ((64, 16384, 1), (64, 16384, 2), (64, 65536, 1)):
        paged(b, ctx, nn)
    ragged(512, 4096)  # checked against the reference
    ragged(4096, 16384)


if __name__ == "__main__":
    main()
