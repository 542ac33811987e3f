"""``python -m sparse_indexer check --fuzz N [--seed S]``: ``N`` random cases, each one of the self-check's cases
(:mod:`.check`: the same oracles, the reference backend on the CPU as the baseline) with its shapes, formats and
lengths drawn across the contract, and its values from its own seed.

Case ``i`` of a run is a pure function of the seed ``S + i``: a failure prints that seed, and ``--fuzz 1 --seed
S + i`` replays exactly that case (with the same ``--device``, ``--backend`` and ``--size``). ``--size small``
draws the interpreter's shapes also on a GPU (many cases a second), ``full`` (a GPU's default) GPU-sized ones.

What is drawn (docs/spec.md): H 16/32/64, D 64/128, block sizes 1-64, next_n 1-4, compress ratios 1/2/4, top-k
(512/1024/2048 on a GPU; 64-256 on the CPU, where Triton's interpreter runs the kernels), both FP8 formats where
the hardware has them, the scale encodings and byte orders (MXFP4 flat and tiled), float32 and bfloat16 logits,
1-D and 2-D decode lengths, lengths 0, 1, below ``C``, ``topk - 1``, ``topk``, ``topk + 1``, block boundaries and
long rows, padding rows, packed and uniform decode, prefill chunks split along their queries, compressed prefill,
candidate blocks, ties, ``-inf`` and NaN in the top-k's rows.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import os
import random
import time
from collections.abc import Callable

import torch

__all__ = ["default_jobs", "draw_case", "draw_sizes", "run_fuzz"]

FUZZ_OPS = ("write_k_cache", "gather_k_cache", "fp8_mqa_logits", "fp8_paged_mqa_logits", "top_k_per_row",
            "fp8_mqa_topk", "fp8_paged_mqa_topk", "select_candidate_blocks", "step")


def _lengths(rng: random.Random, n: int, topk: int, bs: int, longest: int) -> tuple[int, ...]:
    """``n`` lengths, most of them the contract's edge values."""
    edges = [0, 1, 2, 3, topk - 1, topk, topk + 1, bs, bs - 1, bs + 1, 2 * bs, longest, longest - 1]
    out = []
    for _ in range(n):
        x = rng.choice(edges) if rng.random() < 0.7 else rng.randint(0, longest)
        out.append(max(0, min(longest, x)))
    return tuple(out)


def draw_sizes(rng: random.Random, gpu: bool, C) -> object:
    """Sizes of one case: the lengths every case reads (``C.Sizes``, ``C`` the :mod:`.check` module), GPU-sized
    or interpreter-sized."""
    topk = rng.choice((512, 1024, 2048)) if gpu else rng.choice((64, 128, 256))
    longest = rng.choice((2, 3, 4, 8)) * topk if gpu else rng.randint(topk + 2, 3 * topk)
    bs = rng.choice((16, 64))
    paged = _lengths(rng, rng.randint(1, 5), topk, bs, longest)
    gather = _lengths(rng, rng.randint(1, 5), topk, bs, longest)
    rseq = tuple(max(1, x) for x in _lengths(rng, rng.randint(1, 3), topk, bs, longest))
    rq = tuple(rng.randint(1, min(s, 64 if gpu else 24)) for s in rseq)
    return C.Sizes(write_tokens=rng.randint(1, 4096 if gpu else 300), gather_lens=gather, ragged_seq=rseq,
                   ragged_query=rq, paged_ctx=paged, topk_width=rng.randint(topk + 1, 4 * topk),
                   topk_rows=rng.randint(3, 16), step_ctx=max(topk + 2, longest), step_topk=topk)


def draw_case(rng: random.Random, gpu: bool, C) -> tuple[str, str, Callable]:
    """One case of the :mod:`.check` module ``C``: ``(op, description, fn(ctx) -> (measured, tolerance, ok))`` with
    every parameter drawn."""
    op = rng.choice(FUZZ_OPS)
    h, d = rng.choice((16, 32, 64)), rng.choice((64, 128))
    bs = rng.choice((1, 16, 32, 64))
    nn = rng.randint(1, 4)
    if op == "write_k_cache":
        scale, pad, four = rng.choice(("ue8m0", None)), rng.choice((0, 4, 12)), rng.random() < 0.5
        return op, f"D={d} bs={bs} scale={scale} pad={pad} 4-D={four}", lambda c: C.case_write(c, d, bs, scale, pad,
                                                                                                 four)
    if op == "gather_k_cache":
        if rng.random() < 0.3:
            bs4 = rng.choice((16, 32, 64))
            return op, f"MXFP4 D={d} bs={bs4}", lambda c: C.case_mxfp4_cache(c, d, bs4)
        pad = rng.choice((0, 4, 12))
        return op, f"D={d} bs={bs} pad={pad}", lambda c: C.case_gather(c, d, bs, pad)
    if op == "fp8_mqa_logits":
        clean = rng.random() < 0.5
        if rng.random() < 0.3:
            return op, f"MXFP4 H={h} D={d} clean={clean}", lambda c: C.case_ragged_mxfp4(c, h, d, clean)
        return op, f"H={h} D={d} clean={clean}", lambda c: C.case_ragged(c, h, d, clean)
    if op == "fp8_paged_mqa_logits":
        if rng.random() < 0.2:
            return op, f"MXFP4 tiled next_n={nn}", lambda c: C.case_mxfp4_paged_tiled(c, nn)
        two_d, bsp = rng.random() < 0.5, rng.choice((16, 32, 64))
        return op, f"next_n={nn} 2-D={two_d} H={h} D={d} bs={bsp}", lambda c: C.case_paged(c, nn, two_d, h, d, bsp)
    if op == "top_k_per_row":
        topk = rng.choice((16, 64, 256, 512, 2048)) if gpu else rng.choice((16, 64, 256))
        ws, special = rng.random() < 0.4, rng.random() < 0.5
        if rng.random() < 0.3:
            b, kb = rng.choice((4, 8)), rng.choice((8, 64, 300))
            topk = min(topk, (kb - 1) * b + 1)
            return op, f"candidates b={b} K_b={kb} topk={topk} special={special}", \
                lambda c: C.case_candidate_topk(c, b, kb, topk, special)
        return op, f"topk={topk} workspace={ws} special={special}", lambda c: C.case_topk(c, topk, ws, special)
    if op == "fp8_mqa_topk":
        topk = rng.choice((64, 256, 512))
        block_rows = rng.choice((None, 7, 64))
        dtype = rng.choice((torch.float32, torch.bfloat16))
        return op, f"topk={topk} block_rows={block_rows} {dtype}", \
            lambda c: C.case_ragged_topk(c, topk, block_rows, dtype)
    if op == "fp8_paged_mqa_topk":
        two_d, given = rng.random() < 0.5, rng.random() < 0.5
        dtype = rng.choice((torch.float32, torch.bfloat16))
        topk = rng.choice((64, 256))
        return op, f"topk={topk} next_n={nn} 2-D={two_d} {dtype} scores={given}", \
            lambda c: C.case_paged_topk(c, nn, two_d, dtype, given, topk)
    if op == "select_candidate_blocks":
        b, kb, special = rng.choice((2, 4, 8, 16)), rng.choice((1, 8, 100, 2048)), rng.random() < 0.5
        return op, f"b={b} K_b={kb} special={special}", lambda c: C.case_select(c, b, kb, special)
    # the step
    if rng.random() < 0.2:
        tiled = rng.random() < 0.5
        return op, f"MXFP4 tiled={tiled} next_n={nn}", lambda c: C.case_step_mxfp4(c, nn, tiled)
    cr = rng.choice((1, 1, 2, 4))
    decode = tuple(rng.randint(1, nn) for _ in range(rng.randint(0, 4)))
    prefill = tuple((rng.randint(1, 1000), rng.randint(nn + 1, 60 if gpu else 30)) for _ in range(rng.randint(0, 2)))
    if not decode and not prefill:
        decode = (nn,)
    pad, bss = rng.randint(0, 3), rng.choice((16, 64))
    topk = rng.choice((512, 1024)) if cr > 1 else None
    return op, (f"C={cr} next_n={nn} decode={decode} prefill={prefill} pad={pad} H={h} D={d} bs={bss}"
                + (f" topk={topk}" if topk else "")), \
        lambda c: C.case_step(c, nn, decode, prefill, pad, h, d, bss, c=cr, topk=topk, split=False)


def _one(s: int, device: torch.device, backends: list[str], C,
         gpu: bool) -> tuple[str, str, str | None, str, float]:
    """Case ``s`` (its seed): ``(status, op, failure line or None, "op / backend", seconds)``."""
    t0 = time.perf_counter()
    rng = random.Random(s)
    op, name, fn = draw_case(rng, gpu, C)
    sizes = draw_sizes(rng, gpu, C)
    usable = [b for b in backends if op in C._ops_of(b)]
    if not usable:
        return "n/a", op, None, f"{op} / -", 0.0
    b = rng.choice(usable)
    fp8 = rng.choice(C.formats(b, device)[0])
    ctx = C.Ctx(b, device, fp8, sizes, s)
    try:
        err, tol, ok = fn(ctx)
        status = "ok" if ok else "MISMATCH"
    except NotImplementedError as e:
        err, tol, status = f"not implemented: {e}", "", "n/a"
    except Exception as e:  # noqa: BLE001 - a crash is a failed case; the others still run
        err, tol, status = f"{type(e).__name__}: {e}".replace("\n", " "), "", "ERROR"
    line = None
    if status in ("MISMATCH", "ERROR"):
        line = f"  FAILED seed {s}: {op} / {b} / {C.fp8_name(fp8)} / {name} / {sizes}: {err} (tolerance {tol})"
    return status, op, line, f"{op} / {b}", time.perf_counter() - t0


def _chunk(seeds: range, device: str, backends: list[str], gpu: bool, checks: str,
           threads: int | None = None) -> list[tuple[int, str, str, str | None, str, float]]:
    """A worker process's share: the cases of ``seeds``, ``(seed, *_one(seed))`` each, from the check module
    named ``checks`` (a name: a worker imports it itself), with at most ``threads`` CPU threads for torch (the
    workers share the cores: unbounded, each would start one a core)."""
    C = importlib.import_module(checks)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    return [(s, *_one(s, dev, backends, C, gpu)) for s in seeds]


def _report_time(spent: dict[str, list[float]], slowest: list[tuple[float, int, str]]) -> None:
    """Where a run's time went: the op/backend pairs that took the most (cases, total, median, worst: a worst far
    above the median is a first compile), and the slowest cases with their seeds."""
    rows = sorted(spent.items(), key=lambda kv: -sum(kv[1]))[:8]
    print("\ntime by op / backend (cases, total, median, worst):")
    for where, xs in rows:
        xs = sorted(xs)
        print(f"  {where:40s} {len(xs):6d} {sum(xs):8.1f} s {1e3 * xs[len(xs) // 2]:8.1f} ms {xs[-1]:7.2f} s")
    top = sorted(slowest, reverse=True)[:5]
    print("slowest cases: " + ", ".join(f"seed {s} {where} {secs:.2f} s" for secs, s, where in top))


def default_jobs() -> int:
    """Worker processes of a run without ``--jobs``: 4, or the core count where that is smaller. On a GPU a cold run
    is bound by first compiles (Triton's, each on one CPU core), which the processes share through Triton's disk
    cache; the cases themselves take milliseconds. H200 with 16 cores, 10^4 GPU-sized cases cold: 251 s in 4
    processes, 532 s for 9500 in one. Each worker gets ``cores / jobs`` torch threads (8 workers with torch's
    default of a thread a core each stalled after 500 cases). On the CPU, where the interpreter runs the kernels,
    every core helps."""
    return max(1, min(4, os.cpu_count() or 1))


def run_fuzz(n: int, seed: int, device: torch.device, backends: list[str], C, large: bool | None = None,
             jobs: int = 1) -> int:
    """``n`` random cases of the :mod:`.check` module ``C`` (passed in: it calls this module) on ``device``, each on
    one of ``backends`` (drawn) against the CPU reference, GPU-sized shapes when ``large`` (default: on a GPU) and
    interpreter-sized ones otherwise (``--size``), in ``jobs`` processes (the cases in chunks of consecutive seeds;
    a case's result does not depend on the process it ran in; :func:`default_jobs` for ``--jobs``' default).
    Prints progress, every failure with its seed, and a summary. 0 when every case passed (or was not implemented
    by its backend), 1 otherwise."""
    gpu = device.type != "cpu" if large is None else large
    print(f"fuzz: {n} random cases from seed {seed}, {'GPU' if gpu else 'interpreter'}-sized, {jobs} process"
          f"{'es' if jobs > 1 else ''} (case i replays alone with --fuzz 1 --seed {seed}+i and the same --size)")
    t0 = time.perf_counter()
    counts = {"ok": 0, "n/a": 0, "MISMATCH": 0, "ERROR": 0}
    failures, by_op = [], {}
    spent: dict[str, list[float]] = {}  # "op / backend" -> seconds of its cases
    slowest: list[tuple[float, int, str]] = []
    every = max(1, n // 20)
    done = 0

    def take(results) -> None:
        nonlocal done
        for s, status, op, line, where, secs in results:
            counts[status] += 1
            spent.setdefault(where, []).append(secs)
            slowest.append((secs, s, where))
            if line is not None:
                failures.append(s)
                by_op[op] = by_op.get(op, 0) + 1
                print(line, flush=True)
            done += 1
            if done % every == 0 or done == n:
                print(f"  {done}/{n} cases, {time.perf_counter() - t0:.0f} s: {counts['ok']} ok, {counts['n/a']} "
                      f"n/a, {len(failures)} failed", flush=True)

    if jobs <= 1:
        for i in range(n):
            s = seed + i
            take([(s, *_one(s, device, backends, C, gpu))])
    else:
        size = max(1, min(25, n // (jobs * 4) or 1))
        chunks = [range(seed + i, seed + min(n, i + size)) for i in range(0, n, size)]
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            threads = max(1, (os.cpu_count() or 1) // jobs)
            futures = [pool.submit(_chunk, c, str(device), backends, gpu, C.__name__, threads) for c in chunks]
            for f in concurrent.futures.as_completed(futures):
                take(f.result())
        failures.sort()
    _report_time(spent, slowest)
    print(f"\nfuzz: {n} cases in {time.perf_counter() - t0:.1f} s: {counts['ok']} ok, {counts['n/a']} not "
          f"implemented by the drawn backend, {counts['MISMATCH']} mismatched, {counts['ERROR']} failed with an error")
    if failures:
        print("failed cases by op: " + ", ".join(f"{k} {v}" for k, v in sorted(by_op.items())))
        print(f"fuzz FAILED: seeds {', '.join(map(str, failures))} (replay one with --fuzz 1 --seed <seed>)")
        return 1
    print("fuzz passed")
    return 0
