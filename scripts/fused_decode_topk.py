# ruff: noqa: B023  (the timed closures run within their loop iteration)
"""The fused decode top-k (``backend="cuda"`` of ``fp8_paged_mqa_topk``) beside the composition it replaces.

Usage on an NVIDIA Hopper GPU (each mode may be combined):

- ``python3 scripts/fused_decode_topk.py check``: the selection exact on the kernel's own scores (its test mode),
  the scores within 2e-4 relative L2 of the Gluon logits op, for next_n 1-4, H 32/64, short and long windows,
  2-D lengths, tie-heavy, constant, all-zero, negative and sorted scores, bfloat16 scores, and every row through
  the exact rescoring path. Exits 1 on a mismatch.
- ``... small``: six of those cases at small shapes (2-D lengths, rows of 1 to 8192 cells, H 32 and 64, next_n 1,
  2 and 4, constant rows, the rescoring path on tied and bfloat16 scores), quick enough to run under
  ``compute-sanitizer --tool memcheck --report-api-errors no``. Exits 1 on a mismatch.
- ``... time``: medians (``triton.testing.do_bench``, L2 flushed) of the copy floor of the same key bytes, the
  logits op alone, the composition (logits + ``top_k_per_row``) eagerly and as a CUDA graph, and the fused kernel
  eagerly, as a graph and per eager call on the host.
- ``... probe``: a ``PROBE=1`` build's per-CTA ``%globaltimer`` marks (setup, the sample tiles scored, every
  sample of the CTA's rows complete, the thresholds computed, scoring done, the rows finished: medians over CTAs
  and the slowest CTA), and the last row selection begun (only finishing CTAs write it: the slowest only).
"""
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed

from sparse_indexer import fp8_paged_mqa_logits, new_kv_cache, quantize_q, row_limits, top_k_per_row, write_k_cache  # noqa: E402
from sparse_indexer.ops.fp8_paged_mqa_topk import cuda as F  # noqa: E402
from sparse_indexer.ops.fp8_paged_mqa_topk.workspace import FUSED_WORKSPACE_COLS as COLS  # noqa: E402
from sparse_indexer.testing import capture_cuda_graph, logits_error, topk_errors  # noqa: E402

dev = torch.device("cuda")


def make(B, nn, H, L, *, dist="normal", lens=None, cl2d=False, seed=0):
    torch.manual_seed(seed)
    nb = -(-L // 64)
    num_blocks = B * nb + 3
    cache = new_kv_cache(num_blocks, 64, 128, device=dev)
    n = num_blocks * 64
    if dist == "ties":  # 16 distinct keys
        base = torch.randn(16, 128, device=dev)
        k = base[torch.randint(0, 16, (n,), device=dev)]
    elif dist == "const":
        k = torch.randn(1, 128, device=dev).expand(n, 128).contiguous()
    else:
        k = torch.randn(n, 128, device=dev)
    write_k_cache(k.bfloat16(), cache, torch.arange(n, device=dev), fp8_dtype=torch.float8_e4m3fn)
    bt = torch.randperm(num_blocks, device=dev)[: B * nb].view(B, nb).int().contiguous()
    q8, qs = quantize_q(torch.randn(B * nn, H, 128, device=dev))
    w = torch.randn(B * nn, H, device=dev) * H ** -0.5 * 128 ** -0.5 * qs
    if dist == "zero":
        q8 = torch.zeros_like(q8)
    if dist == "neg":
        w = -w.abs()
    q4 = q8.view(B, nn, H, 128).contiguous()
    if lens is None:
        lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    cl = lens.int().to(dev)
    if cl2d:
        cl = torch.stack([torch.clamp(cl - nn + j + 1 - (j % 2), min=0) for j in range(nn)], 1).int().contiguous()
    return q4, cache, w.contiguous(), cl, bt


def check(B, nn, H, L, topk, *, bf16=False, rescore=False, **kw):
    q4, cache, w, cl, bt = make(B, nn, H, L, **kw)
    rows = B * nn
    W = bt.shape[1] * 64
    dt = torch.bfloat16 if bf16 else torch.float32
    lg = torch.full((rows, W), float("nan"), device=dev, dtype=dt)
    out = torch.full((rows, topk), -7, dtype=torch.int32, device=dev)
    ws = torch.full((rows, COLS), 123, dtype=torch.int32, device=dev)
    F.fp8_paged_mqa_topk(q4, cache, w, cl, bt, out=out, logits=lg, workspace=ws, rescore=rescore)
    out2 = torch.full((rows, topk), -7, dtype=torch.int32, device=dev)
    F.fp8_paged_mqa_topk(q4, cache, w, cl, bt, out=out2, workspace=ws, logits_dtype=dt, rescore=rescore)
    torch.cuda.synchronize()
    lim = row_limits(cl, nn).to(dev)
    ref = torch.empty(rows, W, device=dev, dtype=dt)
    fp8_paged_mqa_logits(q4, cache, w, cl, bt, out=ref, clean=True)
    inside = torch.arange(W, device=dev)[None, :] < lim[:, None]
    lgm = torch.where(inside, lg.float(), float("-inf"))
    err, _ = logits_error(lgm, ref.float(), inside)
    z = torch.zeros_like(lim, dtype=torch.int32)
    e1 = topk_errors(out, lgm, z, lim.int(), limit=2)
    e2 = topk_errors(out2, lgm, z, lim.int(), limit=2)
    ok = err < 2e-4 and not e1 and not e2
    print(f"{'OK ' if ok else 'BAD'} B={B} nn={nn} H={H} L={L} k={topk} bf16={bf16} rescore={rescore} "
          f"{kw.get('dist', 'normal')} cl2d={kw.get('cl2d', False)} relL2={err:.2e} {e1[:1]} {e2[:1]}", flush=True)
    return ok


def checks():
    bad = 0
    for args, kw in [
        ((2, 1, 64, 4096, 512), {}),
        ((5, 1, 64, 8192, 2048), {"lens": torch.tensor([1, 2048, 2049, 5000, 8192])}),
        ((3, 2, 64, 4096, 512), {"cl2d": True, "lens": torch.tensor([600, 4096, 300])}),
        ((3, 3, 64, 4096, 512), {}),
        ((2, 4, 64, 4096, 512), {}),
        ((4, 1, 32, 8192, 2048), {}),
        ((2, 2, 32, 8192, 1024), {}),
        ((4, 1, 64, 8192, 512), {"dist": "ties"}),
        ((4, 1, 64, 8192, 512), {"dist": "const"}),
        ((4, 1, 64, 8192, 512), {"dist": "zero"}),
        ((4, 1, 64, 8192, 512), {"dist": "neg"}),
        ((64, 1, 64, 65536, 2048), {}),
        ((64, 1, 64, 16384, 512), {"dist": "ties"}),
        ((1, 1, 64, 65536, 2048), {}),
        ((200, 1, 64, 2048, 512), {"lens": torch.randint(1, 2049, (200,))}),
    ]:
        bad += not check(*args, **kw)
    # constant rows of 2049-8192 cells (the cells equal to the threshold), and every row through the exact
    # rescoring path (rescore=True: the guard against thresholds missed and lists overflowed)
    bad += not check(5, 1, 64, 8192, 2048, dist="const", lens=torch.tensor([1, 2049, 4000, 5000, 8192]))
    bad += not check(4, 1, 64, 4096, 512, dist="const")
    bad += not check(2, 1, 64, 65536, 2048, dist="ties")
    bad += not check(5, 1, 64, 8192, 2048, rescore=True, lens=torch.tensor([1, 2048, 2049, 5000, 8192]))
    bad += not check(3, 2, 64, 4096, 512, rescore=True, cl2d=True, lens=torch.tensor([600, 4096, 300]))
    bad += not check(64, 1, 64, 16384, 512, rescore=True, dist="ties")
    bad += not check(16, 1, 64, 65536, 2048, rescore=True)
    bad += not check(2, 1, 64, 65536, 2048, dist="sorted")
    bad += not check(4, 1, 32, 8192, 512, rescore=True, dist="const")
    bad += not check(4, 1, 64, 8192, 512, bf16=True)
    bad += not check(4, 2, 64, 8192, 2048, bf16=True, dist="ties")
    print("checks bad:", bad, flush=True)
    return bad


def small_checks():
    """Small cases for the sanitizer (every row of each through the kernel's phases, in seconds under memcheck)."""
    bad = 0
    bad += not check(5, 1, 64, 8192, 2048, lens=torch.tensor([1, 2048, 2049, 5000, 8192]))
    bad += not check(3, 2, 64, 4096, 512, cl2d=True, lens=torch.tensor([600, 4096, 300]))
    bad += not check(2, 4, 32, 4096, 512)
    bad += not check(4, 1, 64, 4096, 512, dist="const")
    bad += not check(3, 1, 64, 4096, 512, rescore=True, dist="ties")
    bad += not check(3, 2, 64, 4096, 512, rescore=True, bf16=True)
    print("small bad:", bad, flush=True)
    return bad


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def times():
    for (B, nn, H, L, topk) in [(64, 1, 64, 65536, 2048), (64, 1, 32, 65536, 2048), (1, 1, 64, 65536, 2048),
                                (16, 1, 64, 65536, 2048), (64, 1, 64, 16384, 512), (64, 2, 64, 16384, 512),
                                (16, 2, 64, 65536, 2048), (64, 1, 64, 16384, 1024)]:
        q4, cache, w, cl, bt = make(B, nn, H, L)
        rows = B * nn
        W = bt.shape[1] * 64
        out = torch.empty(rows, topk, dtype=torch.int32, device=dev)
        ws = torch.empty(rows, COLS, dtype=torch.int32, device=dev)
        lg = torch.empty(rows, W, device=dev)
        lim = row_limits(cl, nn).int()
        z = torch.zeros_like(lim)
        why = F.takes(q4, cache, w, cl, bt, out)

        def fused():
            F.fp8_paged_mqa_topk(q4, cache, w, cl, bt, out=out, workspace=ws)

        def comp():
            fp8_paged_mqa_logits(q4, cache, w, cl, bt, out=lg, clean=False)
            top_k_per_row(lg, z, lim, out=out)

        def logits_only():
            fp8_paged_mqa_logits(q4, cache, w, cl, bt, out=lg, clean=False)

        src = torch.empty(int(B * L * 132) // 2, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        res = {}
        res["floor"] = bench(lambda: dst.copy_(src))
        comp()
        res["logits"] = bench(logits_only)
        res["comp"] = bench(comp)
        gc = capture_cuda_graph(comp)
        res["comp_graph"] = bench(gc.replay)
        if why is None:
            fused()
            res["fused"] = bench(fused)
            gf = capture_cuda_graph(fused)
            res["fused_graph"] = bench(gf.replay)
            t0 = time.perf_counter()
            for _ in range(100):
                fused()
            torch.cuda.synchronize()
            res["fused_host_us"] = (time.perf_counter() - t0) * 1e4
        print(f"B={B} nn={nn} H={H} L={L} k={topk}: " + " ".join(f"{k}={v:.1f}" for k, v in res.items())
              + ("" if why is None else f" (fused declines: {why})"), flush=True)


def probes():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for (B, nn, H, L, topk) in [(64, 1, 64, 65536, 2048), (16, 1, 64, 65536, 2048), (1, 1, 64, 65536, 2048),
                                (64, 1, 64, 16384, 512), (64, 2, 64, 16384, 512)]:
        q4, cache, w, cl, bt = make(B, nn, H, L)
        rows = B * nn
        out = torch.empty(rows, topk, dtype=torch.int32, device=dev)
        ws = torch.empty(rows, COLS, dtype=torch.int32, device=dev)
        pr = torch.zeros(sms, 8, dtype=torch.int64, device=dev)
        for _ in range(6):
            F.fp8_paged_mqa_topk(q4, cache, w, cl, bt, out=out, workspace=ws, probe=pr)
        torch.cuda.synchronize()
        x = (pr - pr[:, :1].min()).double() / 1e3
        med = x.median(0).values.tolist()
        mx = x.max(0).values.tolist()
        t = bench(lambda: F.fp8_paged_mqa_topk(q4, cache, w, cl, bt, out=out, workspace=ws))
        # marks: 0 start, 1 setup, 2 the CTA's last row selection begun (finishing CTAs only), 3 samples scored,
        # 4 samples complete, 5 scoring done, 6 finished, 7 thresholds computed
        phases = " ".join(f"{name} {med[i]:.1f} ({mx[i]:.1f})" for name, i in (
            ("setup", 1), ("samples-scored", 3), ("samples-complete", 4), ("thresholds", 7), ("scoring-done", 5),
            ("finished", 6)))
        print(f"probe B={B} nn={nn} L={L} k={topk}: time={t:.1f}; us from the first start, median over CTAs "
              f"(slowest): {phases}; last selection begun (slowest) {mx[2]:.1f}", flush=True)


if __name__ == "__main__":
    if "probe" in sys.argv:
        probes()
    if "check" in sys.argv and checks():
        sys.exit(1)
    if "small" in sys.argv and small_checks():
        sys.exit(1)
    if "time" in sys.argv:
        times()
