"""A custom engine loop that owns one ``Buffers`` record and calls the indexer step for several layers, and checks
its selection against the reference backend.

Run: ``python examples/custom_engine.py`` (CPU, reference backend; ``--device cuda --backend triton`` on a GPU, or
``TRITON_INTERPRET=1 python examples/custom_engine.py --backend triton`` for the Triton kernels on the CPU).
The engine sizes the scratch once from its static limits, builds the step metadata once per step on the host,
and threads the same record through every layer; nothing is allocated inside the layer loop.

The check an engine author runs (in a test, not in serving; here on the first layer): the same step with
``backend="reference"`` (exact FP8 emulation, the specification), and both selections judged with
``sparse_indexer.testing.assert_topk`` on the reference's scores of every token's window. A window of at most
``topk`` keys must select exactly its positions ``0..n-1``; a longer one is compared as the multiset of selected
*values*, not positions: ties may be broken either way, so two correct backends may pick different positions of
equal scores.
"""

from __future__ import annotations

import argparse

import torch

import sparse_indexer as si
from buffers import IndexerLimits, allocate, plan
from sparse_indexer.testing import assert_topk


def reference_scores(q_fp8, weights, kv, block_table, req_of_token, positions):
    """Every token's causal window of scores (keys ``[0, position + 1)`` of its request), by the reference backend:
    ``(logits [T, W], starts [T], ends [T])``, each token read as a decode row of its own (``next_n = 1``)."""
    t, bs = q_fp8.shape[0], kv.shape[1]
    ends = (positions + 1).int()
    rows = block_table[req_of_token, : (int(ends.max()) + bs - 1) // bs]  # the blocks the longest window reads
    out = torch.empty(t, rows.shape[1] * bs, device=q_fp8.device)
    si.fp8_paged_mqa_logits(q_fp8.view(t, 1, *q_fp8.shape[1:]), kv, weights, ends, rows, out=out, backend="reference")
    return out, torch.zeros_like(ends), ends


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
    ref_out = torch.empty_like(topk_out)  # the check's selection (reference backend)

    # 2. One step: request 0 and 1 decode one token each, request 2 prefills a 300-token prompt.
    seq_lens, query_lens = [700, 1500, 300], [1, 1, 300]
    block_table = torch.arange(3 * 64, dtype=torch.int32).view(3, 64)  # request r owns blocks 64r..64r+63
    positions = [torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens)]
    slot_mapping = torch.cat([si.slots_from_block_table(block_table[r : r + 1], p[None], 64)[0]
                              for r, p in enumerate(positions)])
    md = si.build_metadata(seq_lens, query_lens, block_table, slot_mapping, limits, device=dev,
                           num_blocks=num_blocks)  # host planning, once per step, shared by every layer
    # the decode requests' earlier tokens, written into every layer's cache by the steps before this one
    history = torch.cat([si.slots_from_block_table(block_table[r : r + 1], torch.arange(seq_lens[r] - 1)[None], 64)[0]
                         for r in (0, 1)]).to(dev)
    for kv in caches:
        si.write_k_cache(torch.randn(history.numel(), 128, device=dev, dtype=torch.bfloat16), kv, history)
    t = md.num_tokens
    req_of_token = torch.repeat_interleave(torch.arange(3), torch.tensor(query_lens)).to(dev)
    token_pos = torch.cat(positions).to(dev)
    # scores from another computation (tensor cores, another summation order) may differ from the reference's by
    # ~1e-4 relative on a GPU: the selected values are compared within rtol * max|score| there
    rtol = 0.0 if args.backend == "reference" else 1e-5 if dev.type == "cpu" else 1e-3

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

        # 3. The check, on the first layer (a test's job, not serving's): the same step on the reference backend
        #    (it writes the same keys into the cache again), and both selections against the reference's scores of
        #    every token's window.
        if layer > 0:
            continue
        si.sparse_attn_indexer(q_fp8, k, weights, kv, md, bufs, ref_out, backend="reference")
        ref = ref_out[:t]
        logits, starts, ends = reference_scores(q_fp8, weights, kv, block_table.to(dev), req_of_token, token_pos)
        assert_topk(ref, logits, starts, ends)  # the reference: the exact top-k of its own scores
        assert_topk(sel, logits, starts, ends, rtol=rtol)  # the engine's backend: the same multisets of values
        same = int((sel.sort(1).values == ref.sort(1).values).all(1).sum())
        print(f"  {args.backend} vs reference: every token's top-{limits.topk} selects the same multiset of "
              f"scores (rtol {rtol:g}); {same}/{t} rows select the same positions (the others differ only in ties)")
    print("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
