"""Context-parallel decode (sparse_indexer.parallel): equality with one device and like-for-like timings of the
decode step.

GPU (NCCL, one process per GPU):
    python scripts/cp_bench.py --world 2 --batch 64 --context 131072 --graph
    python scripts/cp_bench.py --world 2 --batch 64 --context 1048576 --graph --profile DIR
    python scripts/cp_bench.py --world 2 --batch 64 --context 131072 --compress-ratio 4 --topk 512 --graph  # V4-Flash
CPU smoke (gloo, reference backend, tiny shapes):
    python scripts/cp_bench.py --device cpu --smoke

Each of ``--world`` processes holds its blocks of ``--batch`` requests of ``--context`` tokens (block-interleaved,
docs/spec.md §11) in a cache of its own, written from the same seeded keys as a one-device cache on rank 0. With
``--compress-ratio C`` (DeepSeek-V4's compressed caches, docs/spec.md §4a: ``C = 4`` with ``--topk 512`` and the
default blocks of 64 keys are V4-Flash's indexer layers) a request holds ``context // C`` keys.

Timing: every callable is first called ``--warmup`` times (after one all-reduce and one all-gather of the
candidates' size at start-up, so NCCL's communicator setup and first-call work are never timed), then ``--reps``
times ``--iters`` back-to-back calls are timed with CUDA events (``perf_counter`` on the CPU) after a device
synchronisation and a barrier; a row is the median of the repeats, the slowest rank's. Back-to-back calls are
a model's layers; the L2 is not flushed (a step reads 0.5-8 GB of cache per rank; the merge's 2 MB of candidates
are written just before it in a real step). Graph times replay a CUDA graph that holds ``--graph-calls`` calls
(the graph launch amortised), divided by that count.

Reported (rank 0, one JSON line; ``--out FILE`` also writes it):

- ``one_device_{eager,graph}_ms``: the one-device decode step (``indexer_decode``: paged logits + top-k over every
  key), on rank 0's GPU alone; ``cp_{eager,graph}_ms``: the context-parallel step (``cp_decode``: local logits +
  local top-k + merge) with the same total work; ``speedup_graph`` / ``speedup_eager``: like for like.
- ``merge_{eager,graph}_ms``: ``merge_topk`` alone on this rank's local top-k of the step (each call first restores
  the local top-k: ``restore`` below); ``merge_share_graph``: its share of the graph-replayed cp step
  (``merge_share_eager`` likewise); ``merge_host_ms``: host time to enqueue one eager merge.
- ``parts_graph_ms``: the merge's launches one by one, graph-replayed: ``restore`` (the bench's copy of the local
  top-k), ``pack`` (candidates kernel), ``all_gather`` (NCCL, ``2 * rows * topk`` int32 per rank), ``copy`` (values
  to row-major), ``topk`` (``top_k_per_row`` over ``[rows, W * topk]``), ``unpack`` (positions kernel); and
  ``logits_graph_ms`` / ``local_topk_graph_ms``: the cp step's local logits and local top-k alone.
- ``floor_*_ms``: the K cache bytes each step reads over the device-to-device copy bandwidth measured in the same
  run (``copy_gbs``).
- ``allocs``: caching-allocator allocations per eager call (``merge``, ``cp_step``, ``one_device``; must be 0).
- ``wrong_rows``: rows whose top-k (cp eager and graph, one device eager and graph) is not the top-k of the
  one-device logits (``topk_errors``; must be 0). The script exits 1 when a row is wrong or the merge allocated.

``--profile DIR`` writes rank 0's ``torch.profiler`` tables of 20 eager merges and 5 eager cp steps (host and device
time per op) to ``DIR/profile_<context>.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import sparse_indexer as si  # noqa: E402
from buffers import IndexerLimits, allocate  # noqa: E402
from sparse_indexer import parallel as cp  # noqa: E402
from sparse_indexer.indexer import indexer_decode  # noqa: E402
from sparse_indexer.testing import capture_cuda_graph, topk_errors  # noqa: E402


def limits(a, world: int) -> IndexerLimits:
    return IndexerLimits(max_model_len=a.context, max_num_batched_tokens=a.batch, max_num_seqs=a.batch,
                         n_heads=a.heads, head_dim=a.dim, topk=a.topk, block_size=a.block_size, world_size=world,
                         compress_ratio=a.compress_ratio)


def write_cache(a, dev, world: int, rank: int):
    """(cache, block table) of ``rank`` among ``world`` ranks (``world == 1``: the whole cache): request ``b``'s
    ``context // compress_ratio`` keys, its block ``j`` on rank ``j % world`` at id ``b * blocks_per_rank + j //
    world``."""
    bs = a.block_size
    n = a.context // a.compress_ratio
    nblk = -(-n // bs)
    per = -(-nblk // world)
    j = torch.arange(nblk, device=dev)
    table = (torch.arange(a.batch, device=dev)[:, None] * per + j[None, :] // world).int()
    kv = si.new_kv_cache(a.batch * per, bs, a.dim, device=dev)
    pos = torch.arange(n, device=dev)
    for b in range(a.batch):
        g = torch.Generator(device=dev).manual_seed(1000 + b)  # the same keys on every rank and in the baseline
        keys = torch.randn(n, a.dim, generator=g, device=dev).to(torch.bfloat16)
        slots = table[b, pos // bs].long() * bs + pos % bs
        slots = torch.where((pos // bs) % world == rank, slots, torch.full_like(slots, -1))
        si.write_k_cache(keys, kv, slots, backend=a.backend)
    return kv, table


def inputs(a, dev):
    g = torch.Generator(device=dev).manual_seed(7)
    q_fp8, q_scale = si.quantize_q(torch.randn(a.batch, a.heads, a.dim, generator=g, device=dev))
    w = (torch.randn(a.batch, a.heads, generator=g, device=dev) * a.heads**-0.5 * a.dim**-0.5 * q_scale).float()
    return q_fp8, w


class Timer:
    """Per-call milliseconds of back-to-back calls (see the module doc), the slowest rank's."""

    def __init__(self, a, dev, group):
        self.a, self.dev, self.group = a, dev, group

    def _sync(self, group) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        if group is not None:
            dist.barrier(group)
            if self.dev.type == "cuda":
                torch.cuda.synchronize(self.dev)

    def ms(self, fn, *, calls_per_fn: int = 1, collective: bool = True) -> float:
        """``fn``'s milliseconds per call (``calls_per_fn``: calls that one ``fn()`` makes). ``collective``: every
        rank runs ``fn`` (else rank 0 alone; the others must not call this)."""
        a, cuda = self.a, self.dev.type == "cuda"
        group = self.group if collective else None
        for _ in range(a.warmup):
            fn()
        times = []
        for _ in range(a.reps):
            self._sync(group)
            if cuda:
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                for _ in range(a.iters):
                    fn()
                t1.record()
                t1.synchronize()
                times.append(t0.elapsed_time(t1) / (a.iters * calls_per_fn))
            else:
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    fn()
                times.append((time.perf_counter() - t0) * 1e3 / (a.iters * calls_per_fn))
        med = statistics.median(times)
        if group is None:
            return med
        t = torch.tensor([med], dtype=torch.float64, device=self.dev if cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return float(t)

    def host_ms(self, fn) -> float:
        """Host milliseconds to enqueue one call (``--iters`` calls, then one synchronisation outside the time)."""
        self._sync(self.group)
        t0 = time.perf_counter()
        for _ in range(self.a.iters):
            fn()
        ms = (time.perf_counter() - t0) * 1e3 / self.a.iters
        self._sync(self.group)
        return ms

    def graph(self, fn, *, collective: bool = True) -> tuple[float, torch.cuda.CUDAGraph]:
        """Milliseconds per ``fn()`` replayed from a CUDA graph of ``--graph-calls`` calls, and the graph."""
        n = self.a.graph_calls

        def many():
            for _ in range(n):
                fn()

        g = capture_cuda_graph(many)
        return self.ms(g.replay, calls_per_fn=n, collective=collective), g


def allocations(fn, dev, calls: int = 5) -> float | None:
    """Caching-allocator allocations per call of ``fn`` (after a warm-up call); ``None`` on the CPU."""
    if dev.type != "cuda":
        return None
    fn()
    torch.cuda.synchronize(dev)
    n0 = torch.cuda.memory_stats(dev)["allocation.all.allocated"]
    for _ in range(calls):
        fn()
    torch.cuda.synchronize(dev)
    return (torch.cuda.memory_stats(dev)["allocation.all.allocated"] - n0) / calls


def worker(rank: int, a, port: int) -> None:
    dev = torch.device(a.device, rank) if a.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks of one host over 127.0.0.1: gloo on loopback
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=a.world)
    try:
        run(rank, a, dev)
    finally:
        dist.destroy_process_group()


def warm_up_collectives(a, dev) -> None:
    """NCCL's communicator setup and first calls, before anything is timed."""
    x = torch.zeros(2 * a.batch * a.topk, dtype=torch.int32, device=dev)
    y = torch.empty(a.world * x.numel(), dtype=torch.int32, device=dev)
    for _ in range(3):
        dist.all_reduce(x[:1])
        cp._all_gather(y, x)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()


def copy_bandwidth(dev, timer: Timer) -> float | None:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), rank 0 alone; ``None`` on the CPU."""
    if dev.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = timer.ms(lambda: dst.copy_(src), collective=False)
    return 2 * src.numel() / ms / 1e6


def run(rank: int, a, dev) -> None:
    W = a.world
    timer = Timer(a, dev, dist.group.WORLD)
    warm_up_collectives(a, dev)
    q_fp8, w = inputs(a, dev)
    seq, qry = [a.context] * a.batch, [1] * a.batch
    lim = limits(a, W)
    kv, table = write_cache(a, dev, W, rank)
    md = si.build_metadata(seq, qry, table.cpu(), torch.full((a.batch,), -1, dtype=torch.int64), lim,
                           num_blocks=kv.shape[0], device=dev)
    local = cp.shard_metadata(md, rank, W)
    bufs = allocate(lim, dev)
    sel = torch.empty(a.batch, a.topk, dtype=torch.int32, device=dev)
    step = lambda: cp.cp_decode(q_fp8, w, kv, md, local, bufs, sel, backend=a.backend)  # noqa: E731
    res = {}
    res["cp_eager_ms"] = timer.ms(step)
    step()
    got = {"cp eager": sel.clone()}
    allocs = {"cp_step": allocations(step, dev)}

    # the merge alone, on this rank's local top-k (recomputed once; each call restores it first)
    dm = local.decode
    rows = dm.num_rows
    logits = bufs.logits_view(rows, dm.width)
    local_sel = torch.empty_like(sel)
    gdm = md.decode
    lg = lambda: si.fp8_paged_mqa_logits(q_fp8.view(a.batch, 1, a.heads, a.dim), kv, w, dm.context_lens,  # noqa: E731
                                         dm.block_table, out=logits, clean=False, backend=a.backend,
                                         check_values=False)
    ltk = lambda: si.top_k_per_row(logits, dm.row_starts, dm.row_ends, out=local_sel, backend=a.backend,  # noqa: E731
                                   check_values=False)
    lg()
    ltk()
    work = torch.empty_like(sel)
    restore = lambda: work.copy_(local_sel)  # noqa: E731

    def merge():
        work.copy_(local_sel)
        cp.merge_topk(work, logits, dm.row_starts, gdm.row_starts, gdm.row_ends, bufs, rank=rank, world_size=W,
                      block_size=a.block_size, backend=a.backend)

    res["merge_eager_ms"] = timer.ms(merge)
    res["merge_host_ms"] = timer.host_ms(merge)
    allocs["merge"] = allocations(merge, dev)
    if a.profile:
        profile(a, rank, dev, merge, step)
    if a.graph and dev.type == "cuda":
        res["cp_graph_ms"], g = timer.graph(step)
        sel.fill_(-2)
        g.replay()
        torch.cuda.synchronize(dev)
        got["cp graph"] = sel.clone()  # checked against the one-device logits below, like the eager result
        res["merge_graph_ms"], _ = timer.graph(merge)
        parts = {"restore": restore}
        parts.update(merge_parts(a, rank, W, rows, logits, local_sel, dm, gdm, bufs, work))
        res["parts_graph_ms"] = {k: round(timer.graph(f)[0], 4) for k, f in parts.items()}
        res["logits_graph_ms"], _ = timer.graph(lg)
        res["local_topk_graph_ms"], _ = timer.graph(ltk)
    dist.barrier()
    if rank != 0:
        dist.barrier()
        return
    # one device, the same total work (rank 0 alone; the others wait)
    lim1 = limits(a, 1)
    kv1, table1 = write_cache(a, dev, 1, 0)
    md1 = si.build_metadata(seq, qry, table1.cpu(), torch.full((a.batch,), -1, dtype=torch.int64), lim1,
                            num_blocks=kv1.shape[0], device=dev)
    bufs1 = allocate(lim1, dev)
    sel1 = torch.empty_like(sel)
    one = lambda: indexer_decode(q_fp8, w, kv1, md1, bufs1, sel1, backend=a.backend)  # noqa: E731
    res["one_device_eager_ms"] = timer.ms(one, collective=False)
    one()
    got["one device eager"] = sel1.clone()
    allocs["one_device"] = allocations(one, dev)
    if a.graph and dev.type == "cuda":
        res["one_device_graph_ms"], g1 = timer.graph(one, collective=False)
        sel1.fill_(-2)
        g1.replay()
        torch.cuda.synchronize(dev)
        got["one device graph"] = sel1.clone()
    one()  # leaves the one-device logits of the last step in bufs1
    d1 = md1.decode
    logits1 = bufs1.logits_view(d1.num_rows, d1.width)  # in-window cells are the logits (clean=False)
    bad = []
    for name, s in got.items():
        bad += [f"{name}: {e}" for e in topk_errors(s, logits1, d1.row_starts, d1.row_ends, limit=3)]
    bw = copy_bandwidth(dev, timer)
    row = report(a, res, allocs, bw, kv, kv1, len(bad), dev)
    print(json.dumps(row))
    for e in bad[:5]:
        print("WRONG:", e)
    if allocs["merge"]:
        bad.append("alloc")
        print(f"ALLOC: merge_topk made {allocs['merge']} caching-allocator allocations per call (must be 0)")
    if a.out:
        Path(a.out).write_text(json.dumps(row, indent=1) + "\n")
    dist.barrier()
    if bad:
        raise SystemExit(1)


def merge_parts(a, rank, W, rows, logits, local_sel, dm, gdm, bufs, work) -> dict:
    """The merge's launches one by one, on the same views ``merge_topk`` uses (GPU path; timed in this order:
    each reads what the one before wrote)."""
    from sparse_indexer.parallel import triton as K

    v = cp._views(bufs, rows, W, a.topk)
    cand = v.cand.view(2, rows, a.topk)
    gath = v.gath.view(W, 2, rows, a.topk)
    col = cand[0]
    return {
        "pack": lambda: K.pack(local_sel, logits, dm.row_starts, cand[0].view(torch.float32), cand[1], v.bounds,
                               rank=rank, world_size=W, block_size=a.block_size),
        "all_gather": lambda: cp._all_gather(v.gath, v.cand),
        "copy": lambda: v.mval.view(rows, W, a.topk).copy_(gath[:, 0].transpose(0, 1)),
        "topk": lambda: si.top_k_per_row(v.mval.view(torch.float32), v.bounds[:rows], v.bounds[rows:], out=col,
                                         backend=a.backend, check_values=False),
        "unpack": lambda: K.unpack(col, gath[0, 1], gdm.row_starts, gdm.row_ends, work),
    }


def profile(a, rank, dev, merge, step) -> None:
    """rank 0's profiler tables of eager merges and eager cp steps (every rank makes the calls, profiled or not)."""
    import contextlib

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    out = []
    for name, fn, n in (("merge_topk (with the restoring copy)", merge, 20), ("cp_decode", step, 5)):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier()
        p = None
        with contextlib.ExitStack() as stack:
            if rank == 0:
                try:
                    p = stack.enter_context(prof(activities=acts))
                except Exception as e:  # noqa: BLE001 - the calls run anyway (they are collective)
                    out.append(f"== profiler did not start: {type(e).__name__}: {e}\n")
            for _ in range(n):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        if p is not None:
            out.append(f"== {n} eager calls of {name}, rank 0, context {a.context}\n")
            try:
                out.append(p.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
            except Exception as e:  # noqa: BLE001
                out.append(f"(no table: {type(e).__name__}: {e})")
    if rank == 0:
        d = Path(a.profile)
        d.mkdir(parents=True, exist_ok=True)
        (d / f"profile_{a.context}.txt").write_text("\n".join(out))


def report(a, res, allocs, bw, kv, kv1, wrong: int, dev) -> dict:
    r = lambda x: None if x is None else round(x, 4)  # noqa: E731
    row = dict(world=a.world, batch=a.batch, context=a.context, compress_ratio=a.compress_ratio, topk=a.topk,
               device=str(dev),
               backend=a.backend or "auto", iters=a.iters, reps=a.reps, warmup=a.warmup)
    row.update({k: (v if isinstance(v, dict) else r(v)) for k, v in res.items()})
    one_g, cp_g = res.get("one_device_graph_ms"), res.get("cp_graph_ms")
    row["speedup_graph"] = r(one_g / cp_g) if one_g and cp_g else None
    row["speedup_eager"] = r(res["one_device_eager_ms"] / res["cp_eager_ms"])
    row["merge_share_graph"] = r(res["merge_graph_ms"] / cp_g) if cp_g else None
    row["merge_share_eager"] = r(res["merge_eager_ms"] / res["cp_eager_ms"])
    if bw:  # the cp step reads all of this rank's cache, the one-device step all of the whole cache
        row["copy_gbs"] = round(bw, 1)
        row["floor_one_device_ms"] = r(kv1.numel() / bw / 1e6)
        row["floor_cp_ms"] = r(kv.numel() / bw / 1e6)
    row["allocs"] = allocs
    row["wrong_rows"] = wrong
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64, help="keys per cache block")
    ap.add_argument("--compress-ratio", type=int, default=1,
                    help="tokens per key (DeepSeek-V4's compressed caches: 4; --context stays in tokens)")
    ap.add_argument("--iters", type=int, default=20, help="back-to-back calls per timed repeat")
    ap.add_argument("--reps", type=int, default=5, help="timed repeats (the median is reported)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls before each measurement")
    ap.add_argument("--graph-calls", type=int, default=10, help="calls captured in one CUDA graph")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--backend", default=None, help="backend of every op (default: auto)")
    ap.add_argument("--graph", action="store_true", help="also time every step and the merge replayed from graphs")
    ap.add_argument("--profile", default=None, metavar="DIR", help="write rank 0's profiler tables to DIR")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the reference backend)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.batch, a.context, a.topk, a.heads, a.dim, a.block_size = 4, 600, 64, 8, 64, 16
        a.iters, a.reps, a.warmup, a.graph_calls = 2, 2, 1, 2
    if a.device == "cuda" and torch.cuda.device_count() < a.world:
        print(f"cp_bench: --world {a.world} needs {a.world} GPUs, {torch.cuda.device_count()} visible",
              file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(a, port), nprocs=a.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
