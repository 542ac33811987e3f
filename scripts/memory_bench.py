"""GPU measurements behind docs/memory.md (the decode budget and the prefill caps), in one run:

1. ``decode``: the decode step (paged logits + top-k, ``indexer_decode`` as the step runs it, replayed from a CUDA
   graph; default backends, then all-Triton) at B=256, L=64K, next_n 1 and 2, without a budget and with
   ``max_decode_logits_bytes`` a quarter of the decode logits (4 sub-batches), beside the read floor of its key
   cache measured in the same run (bytes / copy bandwidth). Checks that both give the same top-k.
2. ``prefill``: prefill throughput of a realistic mix (8K-token steps of 2-16 requests with 4K-128K contexts,
   max_model_len 128K) through ``indexer_prefill`` for a sweep of the gather cap ``prefill_k_tokens`` (at a
   generous logits cap) and of the logits cap ``max_logits_bytes`` (at a generous gather cap); picks the smallest
   of each within 5% of the generous pair and times that pair too (default backends, as an engine runs them).
   Then the gather cap alone on a 32K engine's mix (2K-32K contexts).

Times are medians of CUDA-event timings with L2 flushed (a 256 MiB buffer zeroed) before each run; prefill
timings include the host's per-chunk work, as an engine sees it. ``--smoke`` runs tiny shapes on the CPU (the
reference backend, no graphs, the fewest timed runs unless given) to check the script in well under a minute.
Writes ``memory_bench.json`` into ``--out`` (default ``bench-out/``, which git ignores).

    PYTHONPATH=. python3 scripts/memory_bench.py --out /tmp/mem
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sparse_indexer as si  # noqa: E402
from buffers import IndexerLimits, allocate, plan  # noqa: E402
from sparse_indexer.commands.bench import Timer as BenchTimer  # noqa: E402
from sparse_indexer.indexer import decode_batch  # noqa: E402
from sparse_indexer.testing import capture_cuda_graph  # noqa: E402

MiB = 1 << 20


def log(*a):
    print(*a, flush=True)


class Timer:
    """The bench's timer (``sparse_indexer.commands.bench.Timer``: CUDA events around the op, L2 flushed by
    ``zero_`` before every iteration; ``perf_counter`` on the CPU), in milliseconds."""

    def __init__(self, device: torch.device):
        self._timer = BenchTimer(device, "zero")
        self.gpu = self._timer.gpu

    def median_ms(self, fn, iters: int, warmup: int = 1) -> float:
        return statistics.median(self._timer.times_us(fn, iters, warmup)) / 1e3
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            self.flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)


def fill_cache(kv: torch.Tensor, num_slots: int, d: int, backend: str, g: torch.Generator) -> None:
    chunk = 1 << 20
    for t0 in range(0, num_slots, chunk):
        t1 = min(num_slots, t0 + chunk)
        k = torch.randn(t1 - t0, d, generator=g).to(torch.bfloat16).to(kv.device)
        si.write_k_cache(k, kv, torch.arange(t0, t1, device=kv.device), backend=backend)


def queries(rows: int, h: int, d: int, dev, g):
    q8, q_scale = si.quantize_q(torch.randn(rows, h, d, generator=g).to(dev))
    w = (torch.randn(rows, h, generator=g).to(dev) * (h * d) ** -0.5 * q_scale).contiguous()
    return q8, w


def copy_floor_tb_s(dev, timer: Timer) -> float:
    n = 1 << 30 if timer.gpu else 64 * MiB
    src = torch.ones(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timer.median_ms(lambda: dst.copy_(src), 10, 2)
    return 2 * n / (t * 1e-3) / 1e12


def mismatched_rows(a: torch.Tensor, b: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """(rows whose position sets differ, rows whose selected score multisets differ beyond 1e-6 of the max)."""
    sa, sb = a.sort(1).values, b.sort(1).values
    bad = (sa != sb).any(1).nonzero().flatten().tolist()
    worse = 0
    for r in bad:
        ga, gb = sa[r][sa[r] >= 0].long(), sb[r][sb[r] >= 0].long()
        va, vb = logits[r, ga].sort().values, logits[r, gb].sort().values
        if va.shape != vb.shape or not torch.allclose(va, vb, rtol=0, atol=1e-6 * float(vb.abs().max())):
            worse += 1
    return len(bad), worse


# ------------------------------------------------------------------------------------------------ decode
def graphed(fn, timer: Timer):
    """``fn`` captured in a CUDA graph (after a warm-up on a side stream): its replay. On the CPU, ``fn``."""
    fn()
    if not timer.gpu:
        return fn
    torch.cuda.synchronize()
    return capture_cuda_graph(fn).replay


def bench_decode(args, dev, timer, backends, floor) -> list[dict]:
    B, L = (256, 65536) if not args.smoke else (8, 512)
    h, d = (64, 128) if not args.smoke else (4, 64)
    bs, topk = 64, 2048 if not args.smoke else 64
    g = torch.Generator().manual_seed(0)
    nb = B * L // bs
    kv = si.new_kv_cache(nb, bs, d, device=dev)
    fill_cache(kv, nb * bs, d, backends[0], g)
    table = torch.randperm(nb, generator=g).view(B, L // bs).int().to(dev)
    kv_bytes = B * L * (d + 4)
    rows = []
    for backend, nn in [(b, n) for b in backends for n in (1, 2)]:
        q, w = queries(B * nn, h, d, dev, g)
        full = B * nn * L * 4
        res = {}
        for name, budget in (("none", None), ("quarter", full // 4)):
            lim = IndexerLimits(max_model_len=L, max_num_batched_tokens=max(8192, B * nn), max_num_seqs=B, next_n=nn,
                                n_heads=h, head_dim=d, topk=topk, block_size=bs, max_decode_logits_bytes=budget)
            md = si.build_metadata([L] * B, [nn] * B, table, torch.full((B * nn,), -1, dtype=torch.int64, device=dev),
                                   lim, num_blocks=nb)
            bufs = allocate(lim, dev)
            out = torch.zeros(B * nn, topk, dtype=torch.int32, device=dev)

            def step(q=q, w=w, kv=kv, md=md, bufs=bufs, out=out, backend=backend):
                si.indexer_decode(q, w, kv, md, bufs, out, backend=backend)

            per = decode_batch(md)
            dm = md.decode
            subs = [(b0, min(B, b0 + per)) for b0 in range(0, B, per)]

            def logits_only(q=q, w=w, kv=kv, dm=dm, bufs=bufs, subs=subs, backend=backend, nn=nn):
                qv = q.view(B, nn, h, d)
                for b0, b1 in subs:
                    si.fp8_paged_mqa_logits(qv[b0:b1], kv, w[b0 * nn : b1 * nn], dm.context_lens[b0:b1],
                                            dm.block_table[b0:b1], out=bufs.logits_view((b1 - b0) * nn, L),
                                            clean=False, backend=backend, check_values=False)

            def topk_only(dm=dm, bufs=bufs, out=out, subs=subs, backend=backend, nn=nn):
                for b0, b1 in subs:
                    r0, r1 = b0 * nn, b1 * nn
                    si.top_k_per_row(bufs.logits_view(r1 - r0, L), dm.row_starts[r0:r1], dm.row_ends[r0:r1],
                                     out=out[r0:r1], backend=backend, check_values=False,
                                     workspace=bufs.topk_scratch_view(r1 - r0))

            t = timer.median_ms(graphed(step, timer), args.iters, 3)
            t_logits = timer.median_ms(graphed(logits_only, timer), args.iters, 3)
            t_topk = timer.median_ms(graphed(topk_only, timer), args.iters, 3)
            step()
            if timer.gpu:
                torch.cuda.synchronize()
            rows_sb = min(B, decode_batch(md)) * nn
            res[name] = dict(ms=t, logits_ms=t_logits, topk_ms=t_topk, sub_batches=len(subs), out=out.clone(),
                             decode_mib=rows_sb * L * 4 / MiB, plan_mib=plan(lim).total_bytes / MiB,
                             logits=bufs.logits_view(rows_sb, L).clone() if name == "none" else None)
            del bufs
        diff, worse = mismatched_rows(res["quarter"]["out"].cpu(), res["none"]["out"].cpu(),
                                      res["none"]["logits"].cpu())
        floor_ms = kv_bytes / (floor * 1e12) * 1e3
        row = dict(backend=backend or "auto", B=B, L=L, next_n=nn, none_ms=res["none"]["ms"],
                   quarter_ms=res["quarter"]["ms"], none_logits_ms=res["none"]["logits_ms"],
                   quarter_logits_ms=res["quarter"]["logits_ms"], none_topk_ms=res["none"]["topk_ms"],
                   quarter_topk_ms=res["quarter"]["topk_ms"],
                   ratio=res["quarter"]["ms"] / res["none"]["ms"], sub_batches=res["quarter"]["sub_batches"],
                   decode_logits_mib_none=res["none"]["decode_mib"],
                   decode_logits_mib_quarter=res["quarter"]["decode_mib"],
                   plan_mib_none=res["none"]["plan_mib"], plan_mib_quarter=res["quarter"]["plan_mib"],
                   read_floor_ms=floor_ms, rows_with_other_positions=diff, rows_with_other_scores=worse)
        log(f"decode [{backend or 'auto'}] B={B} L={L} next_n={nn}: none {row['none_ms']:.3f} ms, quarter budget "
            f"({row['sub_batches']} sub-batches) {row['quarter_ms']:.3f} ms = {row['ratio']:.3f}x; "
            f"read floor {floor_ms:.3f} ms; decode logits {row['decode_logits_mib_none']:.0f} -> "
            f"{row['decode_logits_mib_quarter']:.0f} MiB; "
            f"top-k rows differing {diff} (scores {worse}); parts: logits {row['none_logits_ms']:.3f} -> "
            f"{row['quarter_logits_ms']:.3f} ms, top-k {row['none_topk_ms']:.3f} -> {row['quarter_topk_ms']:.3f} ms")
        rows.append(row)
        del q, w
    del kv, table
    return rows


# ------------------------------------------------------------------------------------------------ prefill
def mix(T: int, lo: int, hi: int, g) -> list[tuple[list[int], list[int]]]:
    """T-token steps of 2-16 requests with lo-hi contexts (log-uniform), queries split at random."""
    steps = []
    for n in (2, 3, 4, 5, 6, 8, 12, 16):
        seq = [int(math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * float(u)))
               for u in torch.rand(n, generator=g)]
        while sum(seq) < T:  # the step's tokens must fit the contexts: lengthen the shortest
            i = seq.index(min(seq))
            seq[i] = min(hi, seq[i] + T - sum(seq))
        share = torch.rand(n, generator=g) + 0.2
        qry = [max(2, int(T * float(s) / float(share.sum()))) for s in share]
        qry = [min(q, s) for q, s in zip(qry, seq)]
        i = 0
        while sum(qry) != T:  # fix the total to exactly T tokens, each 2 <= q <= s
            j = i % n
            if sum(qry) < T and qry[j] < seq[j]:
                qry[j] += min(seq[j] - qry[j], T - sum(qry))
            elif sum(qry) > T and qry[j] > 2:
                qry[j] -= min(qry[j] - 2, sum(qry) - T)
            i += 1
        steps.append((seq, qry))
    return steps


def bench_prefill(args, dev, timer, backend, L: int, lo: int, k_sweep: list[int], c_sweep: list[int],
                  pick: bool) -> dict:
    """The mix of ``L``-context engines (contexts ``lo..L``) over gather caps ``k_sweep`` (at the largest logits
    cap) and logits caps ``c_sweep`` (at the largest gather cap); with ``pick``, also the smallest pair within 5%."""
    T = 8192 if not args.smoke else 256
    h, d = (64, 128) if not args.smoke else (4, 64)
    bs, topk = 64, 2048 if not args.smoke else 64
    g = torch.Generator().manual_seed(1)
    steps = mix(T, lo, L, g)
    most = max(sum((s + bs - 1) // bs for s in seq) for seq, _ in steps)
    kv = si.new_kv_cache(most, bs, d, device=dev)
    fill_cache(kv, most * bs, d, backend, g)
    inputs = []
    for seq, qry in steps:
        nblk = [(s + bs - 1) // bs for s in seq]
        table = torch.zeros(len(seq), (L + bs - 1) // bs, dtype=torch.int32)
        o = 0
        for r, n in enumerate(nblk):
            table[r, :n] = torch.arange(o, o + n, dtype=torch.int32)
            o += n
        q, w = queries(sum(qry), h, d, dev, g)
        inputs.append((seq, qry, table.to(dev), q, w))
    k_gen, c_gen = k_sweep[-1], c_sweep[-1]
    results = {}

    def run(k_cap: int, c_cap: int) -> dict:
        key = (k_cap, c_cap)
        if key in results:
            return results[key]
        lim = IndexerLimits(max_model_len=L, max_num_batched_tokens=T, max_num_seqs=256, n_heads=h, head_dim=d,
                            topk=topk, block_size=bs, prefill_k_tokens=max(L, k_cap), max_logits_bytes=c_cap)
        bufs = allocate(lim, dev)
        out = torch.zeros(T, topk, dtype=torch.int32, device=dev)
        total, chunks = 0.0, 0
        for seq, qry, table, q, w in inputs:
            md = si.build_metadata(seq, qry, table, torch.full((T,), -1, dtype=torch.int64, device=dev), lim,
                                   num_blocks=kv.shape[0])
            chunks += len(md.prefill_chunks)
            total += timer.median_ms(
                lambda q=q, w=w, md=md, bufs=bufs, out=out: si.indexer_prefill(q, w, kv, md, bufs, out,
                                                                               backend=backend),
                args.prefill_iters, 1)
        p = plan(lim)
        r = dict(prefill_k_tokens=lim.prefill_k_tokens, max_logits_mib=c_cap / MiB, ms=total, chunks=chunks,
                 tokens_per_s=len(inputs) * T / (total * 1e-3),
                 k_fp8_mib=(p["k_fp8"].nbytes + p["k_scale"].nbytes) / MiB,
                 logits_mib=p["logits"].nbytes / MiB, plan_mib=p.total_bytes / MiB)
        log(f"prefill [L={L}] K={lim.prefill_k_tokens} C={c_cap / MiB:.0f} MiB: {total:.2f} ms for {len(inputs)} steps "
            f"({chunks} chunks), {r['tokens_per_s'] / 1e3:.1f} K tok/s; plan {r['plan_mib']:.0f} MiB "
            f"(keys {r['k_fp8_mib']:.0f}, logits {r['logits_mib']:.0f})")
        del bufs, out
        if timer.gpu:
            torch.cuda.empty_cache()
        results[key] = r
        return r

    base = run(k_gen, c_gen)
    k_rows = [run(k, c_gen) for k in k_sweep]
    c_rows = [run(k_gen, c) for c in c_sweep] if c_sweep[:-1] else []
    out = dict(L=L, contexts=[lo, L], steps=[dict(seq=s, qry=q) for s, q in steps], generous=base, k_sweep=k_rows,
               c_sweep=c_rows)
    if pick:
        k_best = next(r for r in k_rows if r["ms"] <= 1.05 * base["ms"])
        c_best = next(r for r in c_rows if r["ms"] <= 1.05 * base["ms"])
        pair = run(k_best["prefill_k_tokens"], int(c_best["max_logits_mib"] * MiB))
        results.pop((k_gen, c_gen))
        again = run(k_gen, c_gen)  # the generous pair once more: the run-to-run noise
        log(f"prefill choice [L={L}]: K={k_best['prefill_k_tokens']} C={c_best['max_logits_mib']:.0f} MiB: "
            f"{pair['ms']:.2f} ms = {pair['ms'] / base['ms']:.3f}x the generous pair "
            f"(generous again: {again['ms'] / base['ms']:.3f}x)")
        out.update(choice=pair, ratio=pair["ms"] / base["ms"], generous_again=again)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench-out", help="folder for memory_bench.json (default: bench-out)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU, reference backend, the fewest timed runs unless given")
    p.add_argument("--iters", type=int, default=None,
                   help="timed runs of each decode step (default 20; 3 under --smoke)")
    p.add_argument("--prefill-iters", type=int, default=None,
                   help="timed runs of each prefill step (default 3; 1 under --smoke)")
    p.add_argument("--only", choices=("decode", "prefill"), default=None, help="run one part (default both)")
    args = p.parse_args(argv)
    if args.iters is None:
        args.iters = 3 if args.smoke else 20
    if args.prefill_iters is None:
        args.prefill_iters = 1 if args.smoke else 3
    dev = torch.device("cpu" if args.smoke else "cuda")
    backend = "reference" if args.smoke else None  # None: auto, what an engine runs (the CUDA top-k on NVIDIA)
    if not args.smoke and not torch.cuda.is_available():
        print("memory_bench needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    timer = Timer(dev)
    out = dict(device=torch.cuda.get_device_name() if timer.gpu else "cpu", torch=torch.__version__)
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    floor = copy_floor_tb_s(dev, timer)
    out["copy_tb_s"] = floor
    log(f"{out}; copy bandwidth {floor:.2f} TB/s")
    if args.only in (None, "decode"):
        out["decode"] = bench_decode(args, dev, timer, [backend] if args.smoke else [None, "triton"], floor)
    if args.only in (None, "prefill"):
        sc = 1 if not args.smoke else 1 / 256
        ks = [int(x * sc) for x in (131072, 196608, 262144, 393216, 524288, 1048576, 2097152)]
        cs = [max(1, int(x * sc)) * MiB for x in (64, 128, 256, 512, 1024, 2048, 4096)]
        out["prefill"] = bench_prefill(args, dev, timer, backend, int(131072 * sc), int(4096 * sc), ks, cs, True)
        # a 32K engine (contexts 2K-32K): is a gather cap of 128K tokens, above its max_model_len, enough there?
        ks = [int(x * sc) for x in (32768, 65536, 131072, 524288)]
        out["prefill_32k"] = bench_prefill(args, dev, timer, backend, int(32768 * sc), int(2048 * sc), ks,
                                           [cs[-1]], False)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "memory_bench.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
