"""Context parallel decode (issue #15): equality with one device and timings of the decode step.

GPU (the pending measurement, NCCL; not run yet in this project):
    python scripts/cp_bench.py --world 2 --batch 64 --context 131072
    python scripts/cp_bench.py --world 2 --batch 64 --context 1048576 --graph
CPU smoke (gloo, reference backend, tiny shapes; what was run so far):
    python scripts/cp_bench.py --device cpu --smoke

Each of ``--world`` processes holds its blocks of ``--batch`` requests of ``--context`` keys (block-interleaved,
docs/spec.md §11) in a cache of its own, written from the same seeded keys as a one-device cache on rank 0.
Reported (rank 0): the one-device decode step (``indexer_decode``: paged logits + top-k over every key) and the
context-parallel one (``cp_decode``: local logits + local top-k + all-gather + merge) with the same total work,
the speedup, the merge's time alone (``merge_topk``: candidates, all-gather, top-k over ``W * topk``, gather)
and its share of the step, the CUDA-graph replay of ``cp_decode`` with ``--graph``, and the number of rows whose
context-parallel top-k is not the top-k of the one-device logits (``topk_errors``; must be 0). Times are the
slowest rank's mean over ``--iters`` calls after warm-up. ``--out FILE`` writes the row as JSON.
"""

from __future__ import annotations

import argparse
import json
import socket
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
                         n_heads=a.heads, head_dim=a.dim, topk=a.topk, block_size=a.block_size, world_size=world)


def write_cache(a, dev, world: int, rank: int):
    """(cache, block table) of ``rank`` among ``world`` ranks (``world == 1``: the whole cache): request ``b``'s
    block ``j`` lives on rank ``j % world`` at id ``b * blocks_per_rank + j // world``."""
    bs = a.block_size
    nblk = -(-a.context // bs)
    per = -(-nblk // world)
    j = torch.arange(nblk, device=dev)
    table = (torch.arange(a.batch, device=dev)[:, None] * per + j[None, :] // world).int()
    kv = si.new_kv_cache(a.batch * per, bs, a.dim, device=dev)
    pos = torch.arange(a.context, device=dev)
    for b in range(a.batch):
        g = torch.Generator(device=dev).manual_seed(1000 + b)  # the same keys on every rank and in the baseline
        keys = torch.randn(a.context, a.dim, generator=g, device=dev).to(torch.bfloat16)
        slots = table[b, pos // bs].long() * bs + pos % bs
        slots = torch.where((pos // bs) % world == rank, slots, torch.full_like(slots, -1))
        si.write_k_cache(keys, kv, slots, backend=a.backend)
    return kv, table


def inputs(a, dev):
    g = torch.Generator(device=dev).manual_seed(7)
    q_fp8, q_scale = si.quantize_q(torch.randn(a.batch, a.heads, a.dim, generator=g, device=dev))
    w = (torch.randn(a.batch, a.heads, generator=g, device=dev) * a.heads**-0.5 * a.dim**-0.5 * q_scale).float()
    return q_fp8, w


def mean_ms(fn, iters: int, dev, group=None) -> float:
    """Mean milliseconds of ``fn()`` after two warm-up calls; the slowest rank's when ``group`` is given."""
    for _ in range(2):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    if group is not None:
        dist.barrier(group)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    ms = torch.tensor([(time.perf_counter() - t0) * 1e3 / iters], dtype=torch.float64)
    if group is not None:
        ms = ms.to(dev) if dev.type == "cuda" else ms
        dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return float(ms)


def worker(rank: int, a, port: int) -> None:
    dev = torch.device(a.device, rank) if a.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=a.world)
    try:
        run(rank, a, dev)
    finally:
        dist.destroy_process_group()


def run(rank: int, a, dev) -> None:
    W = a.world
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
    cp_ms = mean_ms(step, a.iters, dev, group=dist.group.WORLD)
    step()
    got = sel.clone()
    # the merge alone, on this rank's local top-k of the last step (recomputed once, then restored each call)
    dm = local.decode
    logits = bufs.logits_view(dm.num_rows, dm.width)
    local_sel = torch.empty_like(sel)
    si.fp8_paged_mqa_logits(q_fp8.view(a.batch, 1, a.heads, a.dim), kv, w, dm.context_lens, dm.block_table,
                            out=logits, clean=False, backend=a.backend)
    si.top_k_per_row(logits, dm.row_starts, dm.row_ends, out=local_sel, backend=a.backend)
    glens = md.decode.row_ends - md.decode.row_starts
    work = torch.empty_like(sel)

    def merge():
        work.copy_(local_sel)
        cp.merge_topk(work, logits, dm.row_starts, glens, bufs, rank=rank, world_size=W, block_size=a.block_size,
                      backend=a.backend)

    merge_ms = mean_ms(merge, a.iters, dev, group=dist.group.WORLD)
    graph_ms, graph_sel = None, None
    if a.graph and dev.type == "cuda":
        g = capture_cuda_graph(step)
        graph_ms = mean_ms(g.replay, a.iters, dev, group=dist.group.WORLD)
        sel.fill_(-2)
        g.replay()
        torch.cuda.synchronize(dev)
        graph_sel = sel.clone()  # checked against the one-device logits below, like the eager result
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
    one_ms = mean_ms(lambda: indexer_decode(q_fp8, w, kv1, md1, bufs1, sel1, backend=a.backend), a.iters, dev)
    indexer_decode(q_fp8, w, kv1, md1, bufs1, sel1, backend=a.backend)
    d1 = md1.decode
    logits1 = bufs1.logits_view(d1.num_rows, d1.width)  # in-window cells are the logits (clean=False)
    bad = topk_errors(got, logits1, d1.row_starts, d1.row_ends)
    bad += topk_errors(sel1, logits1, d1.row_starts, d1.row_ends)
    if graph_sel is not None:
        bad += topk_errors(graph_sel, logits1, d1.row_starts, d1.row_ends)
    row = dict(world=W, batch=a.batch, context=a.context, topk=a.topk, device=str(dev), backend=a.backend or "auto",
               one_device_ms=round(one_ms, 4), cp_ms=round(cp_ms, 4), speedup=round(one_ms / cp_ms, 3),
               merge_ms=round(merge_ms, 4), merge_share=round(merge_ms / cp_ms, 3),
               cp_graph_ms=None if graph_ms is None else round(graph_ms, 4), wrong_rows=len(bad))
    print(json.dumps(row))
    for e in bad[:3]:
        print("WRONG:", e)
    if a.out:
        Path(a.out).write_text(json.dumps(row, indent=1) + "\n")
    dist.barrier()
    if bad:
        raise SystemExit(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--backend", default=None, help="backend of every op (default: auto)")
    ap.add_argument("--graph", action="store_true", help="also time cp_decode replayed from a CUDA graph")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the reference backend)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.smoke:
        a.batch, a.context, a.topk, a.heads, a.dim, a.block_size, a.iters = 4, 600, 64, 8, 64, 16, 2
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
