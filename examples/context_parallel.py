"""Context parallel on the CPU: one step's keys over 2 gloo processes, the same top-k as one process.

Run: ``python examples/context_parallel.py`` (2 processes, gloo on 127.0.0.1, reference backend; prints ``ok``).

Every request's cache blocks are interleaved over the ranks (block ``j`` on rank ``j % 2``, docs/spec.md §11):
each rank holds only its blocks, writes only its keys, scores and selects over them, and one all-gather of the
``(value, position)`` candidates plus one top-k merge gives every rank the global top-k. Rank 0 compares it with
the single-process step on a cache holding every block: the same multiset of selected logits in every row.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparse_indexer as si
from buffers import IndexerLimits, allocate
from sparse_indexer import parallel as cp

WORLD = 2
SEQ = [700, 1500, 40, 2000]  # context lengths; the third has 40 keys < topk, all of them on ranks 0 and 1
QRY = [1, 1, 1, 64]  # three decode requests, one prefill request of 64 new tokens


def limits(world: int) -> IndexerLimits:
    return IndexerLimits(max_model_len=2048, max_num_batched_tokens=128, max_num_seqs=4, n_heads=8, head_dim=64,
                         topk=64, block_size=16, world_size=world)


def inputs():
    """The same step on every rank (seeded): block table, keys, slots of every token, queries, weights."""
    g = torch.Generator().manual_seed(0)
    lim = limits(1)
    bs, d, h = lim.block_size, lim.head_dim, lim.n_heads
    mb = lim.max_model_len // bs
    num_blocks = len(SEQ) * mb
    table = torch.randperm(num_blocks, generator=g)[: len(SEQ) * mb].view(len(SEQ), mb).int()
    keys = torch.cat([torch.randn(s, d, generator=g) for s in SEQ]).to(torch.bfloat16)
    pos = [torch.arange(s)[None, :] for s in SEQ]
    slots = torch.cat([si.slots_from_block_table(table[r : r + 1], p, bs)[0] for r, p in enumerate(pos)])
    owner = torch.cat([(p[0] // bs) % WORLD for p in pos])  # the rank that holds each key
    t = sum(QRY)
    q_fp8, q_scale = si.quantize_q(torch.randn(t, h, d, generator=g))
    w = (torch.randn(t, h, generator=g) * h**-0.5 * d**-0.5 * q_scale).float()
    new_slots = torch.cat([si.slots_from_block_table(table[r : r + 1], torch.arange(s - q, s)[None, :], bs)[0]
                           for r, (s, q) in enumerate(zip(SEQ, QRY))])
    return table, num_blocks, keys, slots, owner, q_fp8, w, new_slots


def step(rank: int, world: int):
    """This rank's context-parallel top-k of the step."""
    table, num_blocks, keys, slots, owner, q_fp8, w, new_slots = inputs()
    lim = limits(world)
    kv = si.new_kv_cache(num_blocks, lim.block_size, lim.head_dim)  # this rank's cache: only its blocks are written
    mine = torch.where(owner == rank, slots, torch.full_like(slots, -1))  # -1: another rank's key, skipped
    si.write_k_cache(keys, kv, mine)
    md = si.build_metadata(SEQ, QRY, table, new_slots, lim, num_blocks=num_blocks)  # global, the same on every rank
    local = cp.shard_metadata(md, rank, world)  # once per step, shared by every layer
    topk_out = torch.empty(sum(QRY), lim.topk, dtype=torch.int32)
    return cp.cp_sparse_attn_indexer(q_fp8, w, kv, md, local, allocate(lim), topk_out)


def single_process():
    """The same step on one process holding every block, and every token's request-local logits."""
    table, num_blocks, keys, slots, _, q_fp8, w, new_slots = inputs()
    lim = limits(1)
    kv = si.new_kv_cache(num_blocks, lim.block_size, lim.head_dim)
    si.write_k_cache(keys, kv, slots)
    md = si.build_metadata(SEQ, QRY, table, new_slots, lim, num_blocks=num_blocks)
    ref = si.sparse_attn_indexer(q_fp8, None, w, kv, md, allocate(lim),
                                 torch.empty(sum(QRY), lim.topk, dtype=torch.int32))
    ends = torch.tensor([s - q + i + 1 for s, q in zip(SEQ, QRY) for i in range(q)], dtype=torch.int32)
    req = [r for r, q in enumerate(QRY) for _ in range(q)]
    logits = si.fp8_paged_mqa_logits(q_fp8[:, None].contiguous(), kv, w, ends, table[req].contiguous())
    return ref, logits


def sorted_values(sel: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    v = torch.where(sel >= 0, logits.gather(1, sel.long().clamp(min=0)), torch.tensor(float("-inf")))
    return torch.sort(v, dim=1).values


def worker(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks of one host over 127.0.0.1: gloo on loopback
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        sel = step(rank, world)
        if rank == 0:
            ref, logits = single_process()
            assert torch.equal(sorted_values(sel, logits), sorted_values(ref, logits)), "top-k multisets differ"
            assert torch.equal((sel < 0).sum(1), (ref < 0).sum(1))
            print(f"{world} ranks: {sel.shape[0]} rows, the same top-{sel.shape[1]} multisets as one process")
    finally:
        dist.destroy_process_group()


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(WORLD, port), nprocs=WORLD, join=True)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
