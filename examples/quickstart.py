"""The README's API tour as a program that runs as written.

Run: ``python examples/quickstart.py`` (CPU, reference backend); on a GPU ``python examples/quickstart.py --device
cuda`` (auto: the best backend of each op); ``--backend triton`` on the CPU needs ``TRITON_INTERPRET=1``.

It walks through: static limits -> buffer plan -> one arena; quantizing keys and queries and folding the query
scale into the weights; writing the paged K cache; gathering keys; ragged (prefill) and paged (decode) logits;
top-k; and one whole indexer step built with ``build_metadata(..., num_blocks=...)``. Each part is checked
against the parts before it, and the program prints ``ok`` at the end. Formulas and layouts: docs/spec.md.
"""

from __future__ import annotations

import argparse
import sys

import torch

import sparse_indexer as si
from buffers import IndexerLimits, allocate, plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    ap.add_argument("--backend", default="auto", choices=("auto", *si.BACKENDS),
                    help="backend of every op; auto = the reference on the CPU, Triton/aiter on a GPU "
                         "(default: %(default)s)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("quickstart: --device cuda, but no GPU is visible; run without --device", file=sys.stderr)
        return 2
    backend = None if args.backend == "auto" else args.backend  # None: the best backend for the device
    torch.manual_seed(0)

    # ---- 1. Memory: static engine limits -> plan -> one arena -> Buffers (an immutable record of views).
    # n_heads=64, head_dim=128, topk=2048, block_size=64 are IndexerLimits' defaults (DeepSeek-V3.2); every
    # tensor below must match them. max_logits_bytes and prefill_k_tokens (the prefill chunk caps, defaults
    # 2 GiB and max(max_model_len, 128K) tokens) are lowered to keep this example small.
    limits = IndexerLimits(max_model_len=4096, max_num_batched_tokens=512, max_num_seqs=4, next_n=2,
                           max_logits_bytes=16 * 2**20, prefill_k_tokens=8192)
    H, D, TOPK, BS = limits.n_heads, limits.head_dim, limits.topk, limits.block_size
    print(plan(limits))  # every field's shape, dtype and 256-byte aligned offset; the total to reserve
    bufs = allocate(limits, dev)  # the only allocation the indexer needs

    # ---- 2. The paged K cache: uint8 [num_blocks, block_size, D + 4]; a block table maps each request's token
    # positions to blocks (int32 [num_reqs, max_blocks]); slot = block * block_size + offset.
    num_blocks = 256
    kv = si.new_kv_cache(num_blocks, BS, D, device=dev)
    max_blocks = limits.max_model_len // BS
    block_table = torch.randperm(num_blocks)[: 2 * max_blocks].view(2, max_blocks).int().to(dev)
    lens = [3000, 2500]  # two requests already hold this many tokens
    keys = [torch.randn(n, D, dtype=torch.bfloat16) for n in lens]  # the model's indexer keys (unquantized)
    slots = torch.cat([si.slots_from_block_table(block_table[r : r + 1].cpu(), torch.arange(n)[None, :], BS)[0]
                       for r, n in enumerate(lens)])  # int64, -1 would mean "do not write"
    si.write_k_cache(torch.cat(keys).to(dev), kv, slots.to(dev), backend=backend)  # quantize (ue8m0), store

    # ---- 3. Quantization and weight folding. Keys: one float32 scale per token (the cache write does this).
    # Queries: one scale per (token, head), folded into the weights together with H**-0.5 * D**-0.5:
    #   weights = w_proj(x) * H**-0.5 * D**-0.5 * q_scale      (w_proj(x): the model's per-head weights, W below)
    def queries(n: int, near: torch.Tensor):
        q = torch.randn(n, H, D) + near.float()[:, None, :] * 0.5  # queries that resemble some keys
        q_fp8, q_scale = si.quantize_q(q)  # [n, H, D] float8_e4m3fn, [n, H] float32
        W = torch.randn(n, H)  # stand-in for w_proj(x)
        weights = W * H**-0.5 * D**-0.5 * q_scale
        return q_fp8.to(dev), weights.float().to(dev)

    # ---- 4. Prefill of request 0's last M tokens: gather its keys, ragged logits, top-k.
    L, M = lens[0], 100
    cu_seq_lens = torch.tensor([0, L], dtype=torch.int32, device=dev)
    k_fp8, k_scale = bufs.k_view(L)  # [L, D] fp8 and [L] float32 views of the arena
    si.gather_k_cache(kv, block_table[:1], cu_seq_lens, out_k=k_fp8, out_scale=k_scale, backend=backend)
    want_k, want_scale = si.quantize_k(keys[0])
    assert torch.equal(k_fp8.cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(k_scale.cpu(), want_scale)
    q_fp8, weights = queries(M, keys[0][L - M :])
    ks = torch.zeros(M, dtype=torch.int32, device=dev)  # causal windows [ks, ke) over the gathered keys
    ke = (L - M + 1 + torch.arange(M, device=dev)).int()
    logits = bufs.logits_view(M, L)  # [M, L] float32 view of the arena
    si.fp8_mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke, out=logits, clean=True, backend=backend)
    assert bool((logits[0, int(ke[0]) :] == float("-inf")).all())  # clean=True: -inf outside every window
    prefill_topk = torch.empty(M, TOPK, dtype=torch.int32, device=dev)
    si.top_k_per_row(logits, ks, ke, out=prefill_topk, backend=backend)  # positions relative to ks
    row = logits[-1, : int(ke[-1])]
    assert torch.equal(torch.sort(row[prefill_topk[-1].long()]).values, torch.sort(row.topk(TOPK).values).values)

    # ---- 5. Decode: next_n = 2 tokens of each request, scored straight from the paged cache.
    # context_lens [B] int32 counts the keys including this step's tokens; token j of request b sees
    # positions [0, context_lens[b] - next_n + j + 1). (A [B, next_n] tensor gives each token its own length.)
    B, NN = 2, limits.next_n
    q_dec, w_dec = queries(B * NN, torch.cat([k[-NN:] for k in keys]))
    context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    W = limits.max_model_len  # logits columns, at least the longest context
    dec_logits = torch.empty(B * NN, W, device=dev)
    si.fp8_paged_mqa_logits(q_dec.view(B, NN, H, D), kv, w_dec, context_lens, block_table, out=dec_logits,
                            clean=True, backend=backend)
    ends = si.row_limits(context_lens, NN).int()  # [B * next_n] window ends
    dec_topk = torch.empty(B * NN, TOPK, dtype=torch.int32, device=dev)
    si.top_k_per_row(dec_logits, torch.zeros_like(ends), ends, out=dec_topk, backend=backend)
    # a consumer that needs cache slots maps position p of request b through the block table:
    dec_slots = si.slots_from_block_table(block_table.repeat_interleave(NN, 0), dec_topk, BS)
    assert bool((dec_slots >= 0).all())  # every window is longer than topk here

    # ---- 6. One step of one layer: the decode tokens above (their keys are already cached) and a new
    # prefill request of 300 tokens, decode tokens first. build_metadata runs on the host once per step (shared
    # by every layer); num_blocks lets it check every block id and slot there, so the GPU step never syncs.
    P = 300
    new_keys = torch.randn(P, D, dtype=torch.bfloat16)
    bt_step = torch.cat([block_table.cpu(), torch.randperm(num_blocks)[None, :max_blocks].int()])
    bt_step[2] = torch.tensor(sorted(set(range(num_blocks)) - set(block_table.view(-1).tolist())))[:max_blocks]
    seq_lens, query_lens = [lens[0], lens[1], P], [NN, NN, P]
    step_slots = torch.cat([torch.full((2 * NN,), -1),  # decode keys already in the cache: -1 skips the write
                            si.slots_from_block_table(bt_step[2:], torch.arange(P)[None, :], BS)[0]])
    md = si.build_metadata(seq_lens, query_lens, bt_step.to(dev), step_slots.to(dev), limits, device=dev,
                           num_blocks=num_blocks)
    q_pre, w_pre = queries(P, new_keys)
    q_step = torch.cat([q_dec, q_pre])  # [T, H, D], decode rows first
    w_step = torch.cat([w_dec, w_pre])  # [T, H]
    k_step = torch.cat([torch.zeros(2 * NN, D, dtype=torch.bfloat16), new_keys]).to(dev)  # [T, D]
    topk_out = torch.empty(limits.max_num_batched_tokens, TOPK, dtype=torch.int32, device=dev)
    si.sparse_attn_indexer(q_step, k_step, w_step, kv, md, bufs, topk_out, backend=backend)
    for r in range(B * NN):  # the step's decode rows select what step 5's ops selected (same logits)
        got = torch.sort(dec_logits[r, topk_out[r].long()]).values
        assert torch.equal(got, torch.sort(dec_logits[r, dec_topk[r].long()]).values), f"decode row {r}"
    first_prompt_row = topk_out[2 * NN]  # the new request's first token sees only itself
    assert first_prompt_row[0] == 0 and bool((first_prompt_row[1:] == -1).all())
    print(f"step: {md.num_decode_tokens} decode + {md.num_prefill_tokens} prefill tokens in "
          f"{len(md.prefill_chunks)} prefill chunk(s); topk_out[:{md.num_tokens}] holds request-local positions")
    print("ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
