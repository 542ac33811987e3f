"""GPU check + benchmark of the Triton logits kernels (H200).

Usage: ``PYTHONPATH=. python3 scripts/logits_sweep.py [quick|paged]`` (``paged``: the paged kernel only,
checks and a KSC_PF/num_stages sweep, calling the backends directly rather than the registered op)
(on the CPU under ``TRITON_INTERPRET=1`` it
runs a smoke test of itself on tiny shapes).

Prints: correctness (rel L2 vs float64 on sampled rows, exact -inf masks vs the float32 reference) at DeepSeek
shapes, then median times (L2 flushed, triton.testing.do_bench) for config sweeps, with the fraction of the floor.
"""
import functools
import json
import os
import sys
import time

import torch
import triton

import sparse_indexer as si
from sparse_indexer.kcache import cache_views, new_kv_cache
from sparse_indexer.ops.fp8_mqa_logits import triton as ragged_tr
from sparse_indexer.ops.fp8_paged_mqa_logits import triton as paged_tr
from sparse_indexer.testing import logits_error

dev = "cuda" if torch.cuda.is_available() else "cpu"
SMOKE = dev == "cpu"  # interpreter smoke test of this script: tiny shapes, no timing
FP8 = torch.float8_e4m3fn
OUT = os.environ.get("OUT", "/tmp")
LOG = open(os.path.join(OUT, "bench_log.txt"), "a")
RESULTS = {}


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.write(s + "\n")
    LOG.flush()


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


def rand_fp8(*shape):
    return (torch.randn(*shape, device=dev) * 2).to(FP8)


def bench(fn, rep=200):
    if SMOKE:
        fn()
        return 1.0
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")  # ms


# ---------------------------------------------------------------- ceilings
def copy_bw():
    x = torch.empty((1 << 20) if SMOKE else (2 << 30), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x), rep=100)
    nbytes = 2 * x.numel()
    return nbytes / ms / 1e9  # TB/s


def fp8_mm_rate():
    try:
        n = 64 if SMOKE else 8192
        a = rand_fp8(n, n)
        b = rand_fp8(n, n).t()
        one = torch.ones((), device=dev)
        ms = bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), rep=100)
        return 2 * n**3 / ms / 1e9
    except Exception as e:  # noqa
        log("scaled_mm failed", e)
        return float("nan")


# ---------------------------------------------------------------- paged
def make_paged(b, L, next_n, h=64, d=128, bs=64, pad=0, ragged=False, cl2d=False, extra_blocks=0):
    max_blocks = (L + bs - 1) // bs + extra_blocks
    nb = b * max_blocks
    kv = new_kv_cache(nb, bs, d, device=dev, block_pad=pad)
    vals, scales = cache_views(kv, FP8)
    vals.copy_(rand_fp8(nb, bs, d))
    scales.copy_(torch.rand(nb, bs, device=dev) * 0.01 + 0.001)
    bt = torch.randperm(nb, device=dev).view(b, max_blocks).int()
    q = rand_fp8(b, next_n, h, d)
    wts = torch.randn(b * next_n, h, device=dev) * 0.1
    if ragged:
        lens = torch.randint(1, L + 1, (b,), device=dev)
        lens[0] = 0
    else:
        lens = torch.full((b,), L, device=dev)
    lens = lens.int()
    if cl2d:
        cl = (lens[:, None] - torch.randint(0, next_n, (b, next_n), device=dev)).clamp(min=0).int()
    else:
        cl = lens
    return q, kv, wts, cl, bt


def paged_f64_rows(q, kv, wts, cl, bt, rows):
    b, nn, h, d = q.shape
    vals, scales = cache_views(kv, q.dtype)
    bs = vals.shape[1]
    lim = si.row_limits(cl, nn)
    res = []
    for r in rows:
        bi, j = divmod(r, nn)
        n = int(lim[r])
        pos = torch.arange(n, device=dev)
        blk = bt[bi, pos // bs].long()
        k = vals[blk, pos % bs].double()
        sc = scales[blk, pos % bs].double()
        s = (q[bi, j].double() @ k.T).relu()
        res.append(((wts[r].double()[:, None] * s).sum(0) * sc, n))
    return res


def rel_err_rows(out, f64rows, rows):
    """Relative L2 error of ``out``'s ``rows`` inside their windows (:func:`sparse_indexer.testing.logits_error`);
    ``f64rows``: ``(values, start, end)`` of each row's window, float64."""
    want = torch.full((len(rows), out.shape[1]), float("-inf"), dtype=torch.float64)
    for i, (ref, a, e) in enumerate(f64rows):
        want[i, a:e] = ref.cpu()
    return logits_error(out[rows], want, clean=False)[0]


def check_paged(name, b, L, next_n, **kw):
    q, kv, wts, cl, bt = make_paged(b, L, next_n, **kw)
    W = bt.shape[1] * kv.shape[1] + 40
    outs = {}
    for be in ("reference", "triton"):
        o = torch.full((b * next_n, W + 8), 7777.0, device=dev)[:, :W]
        si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=o, clean=True, backend=be)
        outs[be] = o
    o2 = torch.full((b * next_n, W), 7777.0, device=dev)
    si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=o2, clean=False, backend="triton")
    sync()
    ref, got = outs["reference"], outs["triton"]
    mask_ok = torch.equal(torch.isneginf(ref), torch.isneginf(got)) and not (got == 7777.0).any().item()
    noclean_ok = torch.equal(o2 == 7777.0, torch.isneginf(ref))
    nan_ok = not torch.isnan(got).any().item()
    rows = sorted(set([0, 1, b * next_n - 1] + torch.randint(0, b * next_n, (6,)).tolist()))
    f64 = paged_f64_rows(q, kv, wts, cl, bt, rows)
    e_tr = rel_err_rows(got, [(v, 0, n) for v, n in f64], rows)
    e_ref = rel_err_rows(ref, [(v, 0, n) for v, n in f64], rows)
    ok = mask_ok and noclean_ok and nan_ok and e_tr < 1e-3
    log(f"CHECK paged {name}: err_triton={e_tr:.2e} err_ref32={e_ref:.2e} mask={mask_ok} noclean={noclean_ok} "
        f"nan_ok={nan_ok} {'OK' if ok else 'FAIL'}")
    return ok


def time_paged(b, L, next_n, configs, floor_tbs, clean=False, ragged=False):
    q, kv, wts, cl, bt = make_paged(b, L, next_n, ragged=ragged)
    W = bt.shape[1] * kv.shape[1]
    out = torch.empty(b * next_n, W, device=dev)
    kv3 = kv
    bytes_ = cl.long().clamp(min=0).sum().item() * 132 if ragged else b * L * 132
    best = None
    for cfg in configs:
        try:
            fn = lambda cfg=cfg: paged_tr.fp8_paged_mqa_logits(q, kv3, wts, cl, bt, out=out, clean=clean, config=cfg)
            fn()
            ms = bench(fn)
        except Exception as e:  # noqa
            log(f"  paged cfg {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        tbs = bytes_ / ms / 1e9
        cfg = dict(cfg, programs_per_sm=paged_tr.LAST_LAUNCH.get("programs_per_sm"))
        frac = tbs / floor_tbs
        log(f"  paged B={b} L={L} next_n={next_n} clean={clean} ragged={ragged} {cfg}: {ms*1e3:.1f} us  "
            f"{tbs:.2f} TB/s  {frac*100:.1f}% of copy floor")
        RESULTS[f"paged_b{b}_L{L}_nn{next_n}_clean{clean}_ragged{ragged}_{json.dumps(cfg, sort_keys=True)}"] = ms
        if best is None or ms < best[0]:
            best = (ms, cfg)
    return best


# ---------------------------------------------------------------- ragged
def make_ragged(mq, nk, h=64, d=128):
    q = rand_fp8(mq, h, d)
    k = rand_fp8(nk, d)
    ksc = torch.rand(nk, device=dev) * 0.01 + 0.001
    wts = torch.randn(mq, h, device=dev) * 0.1
    j = torch.arange(mq, device=dev)
    ks = torch.zeros(mq, dtype=torch.int32, device=dev)
    ke = (nk - mq + j + 1).int()
    return q, k, ksc, wts, ks, ke


def ragged_f64_rows(q, k, ksc, wts, ks, ke, rows):
    res = []
    for r in rows:
        a, e = int(ks[r]), int(ke[r])
        s = (q[r].double() @ k[a:e].double().T).relu()
        res.append(((wts[r].double()[:, None] * s).sum(0) * ksc[a:e].double(), a, e))
    return res


def check_ragged(name, mq, nk, multi=False):
    q, k, ksc, wts, ks, ke = make_ragged(mq, nk)
    if multi:  # two requests of a chunk plus an empty row
        half = mq // 2
        ks[half:] = nk // 3
        ke[half:] = (nk // 3 + torch.arange(mq - half, device=dev) * 3 + 5).clamp(max=nk).int()
        ke[:half] = (torch.arange(half, device=dev) + nk // 3 - half + 1).int()
        ke[1] = 0
    outs = {}
    for be in ("reference", "triton"):
        o = torch.full((mq, nk + 8), 7777.0, device=dev)[:, :nk]
        si.fp8_mqa_logits(q, k, ksc, wts, ks, ke, out=o, clean=True, backend=be)
        outs[be] = o
    o2 = torch.full((mq, nk), 7777.0, device=dev)
    si.fp8_mqa_logits(q, k, ksc, wts, ks, ke, out=o2, clean=False, backend="triton")
    sync()
    ref, got = outs["reference"], outs["triton"]
    mask_ok = torch.equal(torch.isneginf(ref), torch.isneginf(got)) and not (got == 7777.0).any().item()
    noclean_ok = torch.equal(o2 == 7777.0, torch.isneginf(ref))
    nan_ok = not torch.isnan(got).any().item()
    rows = sorted(set([0, mq - 1] + torch.randint(0, mq, (6,)).tolist()))
    f64 = ragged_f64_rows(q, k, ksc, wts, ks, ke, rows)
    e_tr, e_ref = rel_err_rows(got, f64, rows), rel_err_rows(ref, f64, rows)
    ok = mask_ok and noclean_ok and nan_ok and e_tr < 1e-3
    log(f"CHECK ragged {name}: err_triton={e_tr:.2e} err_ref32={e_ref:.2e} mask={mask_ok} noclean={noclean_ok} "
        f"nan_ok={nan_ok} {'OK' if ok else 'FAIL'}")
    return ok


def time_ragged(mq, nk, configs, fp8_rate, clean=False):
    q, k, ksc, wts, ks, ke = make_ragged(mq, nk)
    out = torch.empty(mq, nk, device=dev)
    pairs = (ke.long() - ks.long()).sum().item()
    flop = pairs * 64 * 128 * 2
    best = None
    for cfg in configs:
        try:
            fn = lambda cfg=cfg: ragged_tr.fp8_mqa_logits(q, k, ksc, wts, ks, ke, out=out, clean=clean, config=cfg)
            fn()
            ms = bench(fn, rep=300)
        except Exception as e:  # noqa
            log(f"  ragged cfg {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        tf = flop / ms / 1e9
        log(f"  ragged {mq}x{nk} causal clean={clean} {cfg}: {ms:.3f} ms  {tf:.0f} TFLOP/s  "
            f"{tf / fp8_rate * 100:.1f}% of measured fp8 mm rate")
        RESULTS[f"ragged_{mq}x{nk}_clean{clean}_{json.dumps(cfg, sort_keys=True)}"] = ms
        if best is None or ms < best[0]:
            best = (ms, cfg)
    return best


DB, DL = (4, 300) if SMOKE else (64, 65536)


def S(x):
    return max(8, x // 64) if SMOKE else x


def paged_sweep():
    """``paged`` mode: paged kernel only; checks then times variants (KSC_PF: key-scale prefetch distance)."""
    t0 = time.time()
    log(dev if SMOKE else torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    from sparse_indexer.kcache import as_3d
    from sparse_indexer.ops.fp8_paged_mqa_logits import reference as paged_ref

    def direct(q, kv, wts, cl, bt, *, out, clean, backend=None):  # the backends without the op layer
        (paged_ref if backend == "reference" else paged_tr).fp8_paged_mqa_logits(q, as_3d(kv), wts, cl, bt, out=out,
                                                                                  clean=clean)
        return out

    si.fp8_paged_mqa_logits = direct
    base = dict(paged_tr.CONFIG)
    ok = True
    for pf in (1, 2):
        paged_tr.CONFIG.update(base, KSC_PF=pf)
        log(f"-- checks with KSC_PF={pf}")
        ok &= check_paged("B=8 L=5000 nn=1 ragged", 8, S(5000), 1, ragged=True, extra_blocks=2)
        ok &= check_paged("B=8 L=4100 nn=2 ragged pad cl1d", 8, S(4100), 2, ragged=True, pad=64)
        ok &= check_paged("B=6 L=3000 nn=2 cl2d", 6, S(3000), 2, ragged=True, cl2d=True)
        ok &= check_paged("B=4 L=2000 nn=3 bs16", 4, S(2000), 3, ragged=True, bs=16)
        ok &= check_paged("B=5 L=3000 nn=4 bs32 h32 d64", 5, S(3000), 4, ragged=True, bs=32, h=32, d=64)
        ok &= check_paged("B=4 L=2000 nn=4 bs1 h32 d64", 4, S(2000), 4, ragged=True, bs=1, h=32, d=64)
        ok &= check_paged(f"B={DB} L={S(20000)} nn=1 ragged", DB, S(20000), 1, ragged=True)
    paged_tr.CONFIG.update(base)
    log(f"correctness {'ALL OK' if ok else 'FAILURES'} ({time.time()-t0:.0f}s)")
    bw = copy_bw()
    log(f"copy bandwidth {bw:.2f} TB/s -> decode floor {DB * DL * 132 / bw / 1e6:.1f} us")
    c = dict(BLOCK_N=64, num_warps=4, programs_per_sm=4, SPLIT=False)
    sweeps = {
        1: [dict(c, KSC_PF=0, num_stages=6)] + [dict(c, KSC_PF=pf, num_stages=st) for pf, st in [
            (1, 6), (1, 8), (2, 8)]] + [dict(c, KSC_PF=0, num_stages=6)],
        2: [dict(c, KSC_PF=0, num_stages=5, maxnreg=128)] + [
            dict(c, KSC_PF=pf, num_stages=st, maxnreg=r) for pf, st, r in [
                (1, 5, 128), (1, 8, 128), (2, 8, 128)]]
        + [dict(c, KSC_PF=0, num_stages=5, maxnreg=128)],
    }
    if SMOKE:
        sweeps = {k: v[:2] for k, v in sweeps.items()}
    for nn, cfgs in sweeps.items():
        q, kv, wts, cl, bt = make_paged(DB, DL, nn)
        W = bt.shape[1] * kv.shape[1]
        ref = torch.empty(DB * nn, W, device=dev)
        si.fp8_paged_mqa_logits(q, kv, wts, cl, bt, out=ref, clean=True, backend="reference")
        fin = torch.isfinite(ref)
        out = torch.empty(DB * nn, W, device=dev)
        for cfg in cfgs:
            try:
                fn = functools.partial(paged_tr.fp8_paged_mqa_logits, q, kv, wts, cl, bt, out=out, clean=False,
                                       config=cfg)
                out.fill_(float("nan"))
                fn()
                sync()
                err = logits_error(out, ref, fin, clean=False)[0]
                ms = bench(fn)
            except Exception as e:  # noqa
                log(f"  cfg {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            tbs = DB * DL * 132 / ms / 1e9
            ll = paged_tr.LAST_LAUNCH
            log(f"  nn={nn} {cfg} pps={ll.get('programs_per_sm')} regs={ll.get('n_regs')} "
                f"smem={paged_tr.LAST_LAUNCH.get('shared')}: {ms*1e3:.1f} us {tbs:.2f} TB/s {tbs/bw*100:.1f}% "
                f"err={err:.1e} {'OK' if err < 1e-3 else 'FAIL'}")
        time_paged(DB, DL, nn, [{}, dict(KSC_PF=0)], bw, clean=False, ragged=True)
    log(f"done in {time.time()-t0:.0f}s")


def main():
    if "paged" in sys.argv:
        return paged_sweep()
    quick = "quick" in sys.argv
    t0 = time.time()
    log(dev if SMOKE else torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    ok = True
    ok &= check_paged("B=8 L=5000 nn=1 ragged", 8, S(5000), 1, ragged=True, extra_blocks=2)
    ok &= check_paged("B=8 L=4100 nn=2 ragged pad cl1d", 8, S(4100), 2, ragged=True, pad=64)
    ok &= check_paged("B=6 L=3000 nn=2 cl2d", 6, S(3000), 2, ragged=True, cl2d=True)
    ok &= check_paged("B=4 L=2000 nn=3 bs16", 4, S(2000), 3, ragged=True, bs=16)
    ok &= check_paged("B=4 L=2000 nn=4 bs1 h32 d64", 4, S(2000), 4, ragged=True, bs=1, h=32, d=64)
    ok &= check_paged(f"B={DB} L={DL} nn=2 full", DB, DL, 2)
    ok &= check_ragged("1024x8192 causal", S(1024), S(8192))
    ok &= check_ragged("1000x5000 multi-request", S(1000), S(5000), multi=True)
    log(f"correctness {'ALL OK' if ok else 'FAILURES'} ({time.time()-t0:.0f}s)")

    bw = copy_bw()
    rate = fp8_mm_rate()
    floor_us = DB * DL * 132 / bw / 1e6
    log(f"copy bandwidth {bw:.2f} TB/s -> decode floor {floor_us:.1f} us; fp8 8192^3 scaled_mm {rate:.0f} TFLOP/s")

    pc = [dict(BLOCK_N=64, num_warps=4, num_stages=st, programs_per_sm=8, SPLIT=False, maxnreg=r) for st, r in [
        (6, None), (6, 128), (5, 128), (6, 104), (8, 104), (4, 96)]]
    if quick:
        pc = pc[:2]
    best1 = time_paged(DB, DL, 1, pc, bw)
    log("BEST paged nn=1", best1)
    best2 = time_paged(DB, DL, 2, pc, bw)
    log("BEST paged nn=2", best2)
    time_paged(DB, DL, 1, [{}], bw, clean=True)  # the defaults
    time_paged(DB, DL, 2, [{}], bw, clean=True)
    time_paged(DB, DL, 1, [{}], bw, ragged=True)
    time_ragged(S(8192), S(8192), [{}], rate)
    time_ragged(S(8192), S(65536), [{}], rate)
    time_ragged(S(8192), S(65536), [{}], rate, clean=True)
    time_ragged(S(8192), S(8192), [{}], rate, clean=True)
    json.dump(RESULTS, open(os.path.join(OUT, "bench.json"), "w"), indent=1)
    log(f"done in {time.time()-t0:.0f}s")


if __name__ == "__main__":
    main()
