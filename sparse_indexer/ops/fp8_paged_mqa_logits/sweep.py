"""``python -m sparse_indexer bench --sweep logits``: the Triton logits kernels on the GPU, checked and swept.

Sections (``--sections``; default ``check,configs``): ``check``: the paged kernel (``fp8_paged_mqa_logits``) and
the ragged one (``fp8_mqa_logits``) against float64 on sampled rows (relative L2, exact ``-inf`` masks, the
``clean=False`` contract, no NaN) at DeepSeek shapes and odd layouts; ``configs``: paged launch configurations
(``num_stages``, registers) at B=64 L=64K next_n 1 and 2, then the default configurations of both kernels
(decode clean/unclean/ragged, prefill 8K x 8K and 8K x 64K causal) against the copy and FP8-matmul floors the bench
measured; ``paged``: the paged kernel alone, called without the op layer, checked and timed with each key-scale
prefetch distance (``KSC_PF``). Times are the bench's timer (CUDA events, L2 flushed). ``--smoke``: tiny shapes
(the prefill rows 64 x 128 and 64 x 256) and, unless given, one timed call per row; on the CPU the
kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, which ``python -m sparse_indexer bench`` sets itself
there), about a minute on two cores.
"""

from __future__ import annotations

import functools
import json
import math
import time

import torch

from ..._runtime.triton_compat import interpreting
from ...kcache import cache_views, new_kv_cache
from ...testing import logits_error
from ..fp8_mqa_logits import fp8_mqa_logits as ragged_op
from . import fp8_paged_mqa_logits as paged_op
from . import row_limits

__all__ = ["DEFAULT_SECTIONS", "SECTIONS", "run"]

SECTIONS = ("check", "configs", "paged")
DEFAULT_SECTIONS = ("check", "configs")


def run(env) -> tuple[list[tuple[str, str, str, str]], dict]:
    """Run the sections of ``env`` (a :class:`sparse_indexer.commands.bench_cases.SweepEnv`); returns the rows
    ``(section, line, "", "")`` and the results (median ms by configuration key, ``check_ok`` per section)."""
    if env.device.type != "cuda" and not interpreting():
        raise RuntimeError("the logits sweep runs the Triton kernels: on the CPU set TRITON_INTERPRET=1 "
                           "(Triton's interpreter) or pass --device cuda")
    from ..fp8_mqa_logits import triton as ragged_tr
    from . import triton as paged_tr

    dev = env.device
    SMOKE = env.smoke  # noqa: N806 - the sweep's mode, read by every helper below
    FP8 = torch.float8_e4m3fn  # noqa: N806
    RESULTS: dict = {}  # noqa: N806
    rows: list[tuple[str, str, str, str]] = []
    current = ["logits"]
    ops = {"paged": paged_op}
    floors = env.floors
    bw = floors.get("bandwidth", {}).get("value") or math.nan  # TB/s, measured by the bench
    rate = floors.get("compute", {}).get("value") or math.nan  # TFLOP/s

    def log(*a):
        s = " ".join(str(x) for x in a)
        print(s, flush=True)
        rows.append((current[0], s, "", ""))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def rand_fp8(*shape):
        return (torch.randn(*shape, device=dev) * 2).to(FP8)

    def bench(fn, rep=200):  # ms, the bench's timer (rep: kept for the call sites; --iters decides)
        return env.median_us(fn) / 1e3

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
        lim = row_limits(cl, nn)
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
            ops["paged"](q, kv, wts, cl, bt, out=o, clean=True, backend=be)
            outs[be] = o
        o2 = torch.full((b * next_n, W), 7777.0, device=dev)
        ops["paged"](q, kv, wts, cl, bt, out=o2, clean=False, backend="triton")
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

    def best_config(what, configs, fn_of, report, **bench_kw):
        """``(ms, cfg)`` of the fastest of ``configs`` (``fn_of(cfg)``: the call to time; a config that fails is
        logged and skipped); ``report(cfg, ms)`` logs and records each timing and returns the config to keep."""
        best = None
        for cfg in configs:
            try:
                fn = fn_of(cfg)
                fn()
                ms = bench(fn, **bench_kw)
            except Exception as e:  # noqa
                log(f"  {what} cfg {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            cfg = report(cfg, ms)
            if best is None or ms < best[0]:
                best = (ms, cfg)
        return best

    def time_paged(b, L, next_n, configs, floor_tbs, clean=False, ragged=False):
        q, kv, wts, cl, bt = make_paged(b, L, next_n, ragged=ragged)
        W = bt.shape[1] * kv.shape[1]
        out = torch.empty(b * next_n, W, device=dev)
        kv3 = kv
        bytes_ = cl.long().clamp(min=0).sum().item() * 132 if ragged else b * L * 132

        def report(cfg, ms):
            tbs = bytes_ / ms / 1e9
            cfg = dict(cfg, programs_per_sm=paged_tr.LAST_LAUNCH.get("programs_per_sm"))
            frac = tbs / floor_tbs
            log(f"  paged B={b} L={L} next_n={next_n} clean={clean} ragged={ragged} {cfg}: {ms*1e3:.1f} us  "
                f"{tbs:.2f} TB/s  {frac*100:.1f}% of copy floor")
            RESULTS[f"paged_b{b}_L{L}_nn{next_n}_clean{clean}_ragged{ragged}_{json.dumps(cfg, sort_keys=True)}"] = ms
            return cfg

        return best_config("paged", configs, lambda cfg: functools.partial(
            paged_tr.fp8_paged_mqa_logits, q, kv3, wts, cl, bt, out=out, clean=clean, config=cfg), report)

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
            ragged_op(q, k, ksc, wts, ks, ke, out=o, clean=True, backend=be)
            outs[be] = o
        o2 = torch.full((mq, nk), 7777.0, device=dev)
        ragged_op(q, k, ksc, wts, ks, ke, out=o2, clean=False, backend="triton")
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

        def report(cfg, ms):
            tf = flop / ms / 1e9
            log(f"  ragged {mq}x{nk} causal clean={clean} {cfg}: {ms:.3f} ms  {tf:.0f} TFLOP/s  "
                f"{tf / fp8_rate * 100:.1f}% of measured fp8 mm rate")
            RESULTS[f"ragged_{mq}x{nk}_clean{clean}_{json.dumps(cfg, sort_keys=True)}"] = ms
            return cfg

        return best_config("ragged", configs, lambda cfg: functools.partial(
            ragged_tr.fp8_mqa_logits, q, k, ksc, wts, ks, ke, out=out, clean=clean, config=cfg), report, rep=300)

    DB, DL = (4, 300) if SMOKE else (64, 65536)  # noqa: N806

    def S(x):
        return max(8, x // 64) if SMOKE else x

    def paged_sweep():
        """``paged`` mode: paged kernel only; checks then times variants (KSC_PF: key-scale prefetch distance)."""
        t0 = time.time()
        from sparse_indexer.kcache import as_3d
        from sparse_indexer.ops.fp8_paged_mqa_logits import reference as paged_ref

        def direct(q, kv, wts, cl, bt, *, out, clean, backend=None):  # the backends without the op layer
            impl = paged_ref if backend == "reference" else paged_tr
            impl.fp8_paged_mqa_logits(q, as_3d(kv), wts, cl, bt, out=out, clean=clean)
            return out

        ops["paged"] = direct
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
        log(f"copy bandwidth (bench floor) {bw:.2f} TB/s -> decode floor {DB * DL * 132 / bw / 1e6:.1f} us")
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
            ops["paged"](q, kv, wts, cl, bt, out=ref, clean=True, backend="reference")
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
        return ok

    def main():
        t0 = time.time()
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
        return ok

    def timings():
        t0 = time.time()
        floor_us = DB * DL * 132 / bw / 1e6
        log(f"copy bandwidth {bw:.2f} TB/s -> decode floor {floor_us:.1f} us; FP8 _scaled_mm {rate:.0f} TFLOP/s "
            "(the bench's floors)")

        pc = [dict(BLOCK_N=64, num_warps=4, num_stages=st, programs_per_sm=8, SPLIT=False, maxnreg=r) for st, r in [
            (6, None), (6, 128), (5, 128), (6, 104), (8, 104), (4, 96)]]
        if SMOKE:
            pc = pc[:2]
        best1 = time_paged(DB, DL, 1, pc, bw)
        log("BEST paged nn=1", best1)
        best2 = time_paged(DB, DL, 2, pc, bw)
        log("BEST paged nn=2", best2)
        time_paged(DB, DL, 1, [{}], bw, clean=True)  # the defaults
        time_paged(DB, DL, 2, [{}], bw, clean=True)
        time_paged(DB, DL, 1, [{}], bw, ragged=True)
        # prefill 8K x 8K and 8K x 64K; --smoke: 64 x 128 and 64 x 256 (the interpreter's time grows with M x N)
        mq, nk, long_keys = (8192, 8192, 65536) if not SMOKE else (64, 128, 256)
        time_ragged(mq, nk, [{}], rate)
        time_ragged(mq, long_keys, [{}], rate)
        time_ragged(mq, long_keys, [{}], rate, clean=True)
        time_ragged(mq, nk, [{}], rate, clean=True)
        log(f"done in {time.time()-t0:.0f}s")

    sections = env.sections or frozenset(DEFAULT_SECTIONS)
    for name, fn in (("check", main), ("configs", timings), ("paged", paged_sweep)):
        if name not in sections:
            continue
        current[0] = name
        ok = fn()
        if ok is not None:
            RESULTS[f"check_ok/{name}"] = bool(ok)
    return rows, RESULTS
