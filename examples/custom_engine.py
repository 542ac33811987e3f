"""A custom engine loop that owns one ``Buffers`` record and calls the indexer step for several layers.

Run: ``python examples/custom_engine.py`` (CPU, reference backend; ``--device cuda --backend triton`` on a GPU).
The engine sizes the scratch once from its static limits, builds the step metadata once per step on the host,
and threads the same record through every layer; nothing is allocated inside the layer loop.
"""

from __future__ import annotations

import argparse

import torch

import sparse_indexer as si
from buffers import IndexerLimits, allocate, plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--layers", type=int, default=3)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    torch.manual_seed(0)

    # 1. Static limits -> plan -> one arena, at start-up.
    limits = IndexerLimits(max_model_len=4096, max_num_batched_tokens=512, max_num_seqs=8, next_n=1,
                           n_heads=64, head_dim=128, topk=256, block_size=64)
    bufs = allocate(plan(limits), dev)
    num_blocks = 8 * 4096 // 64
    caches = [si.new_kv_cache(num_blocks, 64, 128, device=dev) for _ in range(args.layers)]
    topk_out = torch.empty(limits.max_num_batched_tokens, limits.topk, dtype=torch.int32, device=dev)

    # 2. One step: request 0 and 1 decode one token each, request 2 prefills a 300-token prompt.
    seq_lens, query_lens = [700, 1500, 300], [1, 1, 300]
    block_table = torch.arange(3 * 64, dtype=torch.int32).view(3, 64)  # request r owns blocks 64r..64r+63
    positions = [torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens)]
    slot_mapping = torch.cat([si.slots_from_block_table(block_table[r : r + 1], p[None], 64)[0]
                              for r, p in enumerate(positions)])
    md = si.build_metadata(seq_lens, query_lens, block_table, slot_mapping, limits, device=dev,
                           num_blocks=num_blocks)  # host planning, once per step, shared by every layer
    t = md.num_tokens

    for layer, kv in enumerate(caches):
        q = torch.randn(t, 64, 128, device=dev)
        q_fp8, q_scale = si.quantize_q(q)
        weights = torch.randn(t, 64, device=dev) * 64**-0.5 * 128**-0.5 * q_scale
        k = torch.randn(t, 128, device=dev, dtype=torch.bfloat16)
        si.sparse_attn_indexer(q_fp8, k, weights, kv, md, bufs, topk_out, backend=args.backend)
        sel = topk_out[:t]
        valid = (sel >= 0).sum(1)
        print(f"layer {layer}: {t} tokens, selected per token min {int(valid.min())} max {int(valid.max())} "
              f"(decode rows see {seq_lens[0]} / {seq_lens[1]} keys, topk {limits.topk})")
        assert int(valid[0]) == min(limits.topk, seq_lens[0])
        assert int(valid[2]) == 1  # the first prompt token sees only itself
    print("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
