"""An engine built on vLLM's workspace manager: reserve the indexer's buffers at profiling time, lock, then
run steps on buffers carved from the workspace, directly and through the drop-in for vLLM's
``rocm_aiter_sparse_attn_indexer`` op. Runs on the CPU with the reference backend.

Needs ``pip install -e ".[vllm-compat]" && pip install --no-deps vllm==0.33.0``.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.worker import workspace as ws

import sparse_indexer as si
from sparse_indexer.compat.vllm import VllmIndexer, buffers_from_workspace, held_bytes, reserve

if not torch.accelerator.is_available():
    # vLLM 0.33 calls torch.accelerator.empty_cache() whenever the workspace grows; without an accelerator
    # that raises. It only returns cached device memory to the driver: a no-op is equivalent on the CPU.
    torch.accelerator.empty_cache = lambda: None

ws.init_workspace_manager(torch.device("cpu"))
limits = si.IndexerLimits(max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, n_heads=8, head_dim=64,
                          topk=32, block_size=16, prefill_k_tokens=512, max_logits_bytes=64 * 256 * 4)

# 1. profiling run: grow the workspace to the indexer's plan (one get_simultaneous call), then lock it
p = reserve(limits)
assert held_bytes() == p.total_bytes
print(f"reserved {p.total_bytes} bytes of vLLM's workspace for the indexer")
ws.lock_workspace()

# 2. a step: two decode requests, one prefill request
g = torch.Generator().manual_seed(0)
seq_lens, query_lens = [40, 90, 30], [1, 1, 20]
num_blocks = 32
kv = si.new_kv_cache(num_blocks, limits.block_size, limits.head_dim)
block_table = torch.randperm(num_blocks, generator=g)[:24].view(3, 8).int()
for r, (s, q) in enumerate(zip(seq_lens, query_lens)):  # earlier context already in the cache
    slots = si.slots_from_block_table(block_table[r : r + 1], torch.arange(s - q)[None], limits.block_size)[0]
    si.write_k_cache(torch.randn(s - q, limits.head_dim, generator=g), kv, slots)
pos = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens)])
slot_mapping = si.slots_from_block_table(block_table[[0, 1] + [2] * 20], pos[:, None], limits.block_size)[:, 0]
t = sum(query_lens)
q_fp8, q_scale = si.quantize_q(torch.randn(t, limits.n_heads, limits.head_dim, generator=g))
weights = torch.randn(t, limits.n_heads, generator=g) * q_scale * (limits.n_heads * limits.head_dim) ** -0.5
k = torch.randn(t, limits.head_dim, generator=g)
topk_out = torch.empty(limits.max_num_batched_tokens, limits.topk, dtype=torch.int32)

# 2a. directly: our metadata, buffers carved from the (locked) workspace right before the step
md = si.build_metadata(seq_lens, query_lens, block_table, slot_mapping, limits)
bufs = buffers_from_workspace(limits)  # views valid until the workspace's next get_simultaneous
kv_direct = kv.clone()
si.sparse_attn_indexer(q_fp8, k, weights, kv_direct, md, bufs, topk_out, backend="reference")
direct = topk_out[:t].clone()

# 2b. through the drop-in op, with vLLM's indexer metadata (here a namespace with its field names, laid out as
# vLLM 0.33's DeepseekV32IndexerMetadataBuilder lays it out: decode seq_lens [B, 1] at one token per request)
i32 = lambda x: torch.tensor(x, dtype=torch.int32)
vllm_md = SimpleNamespace(
    slot_mapping=slot_mapping, num_decodes=2, num_decode_tokens=2, num_prefills=1, num_prefill_tokens=20,
    decode=SimpleNamespace(block_table=block_table[:2], seq_lens=i32([[40], [90]]), decode_lens=i32([1, 1]),
                           requires_padding=False),
    prefill=SimpleNamespace(chunks=[SimpleNamespace(
        block_table=block_table[2:], cu_seq_lens=i32([0, 30]), cu_seqlen_ks=i32([0] * 20),
        cu_seqlen_ke=i32(list(range(11, 31))), total_seq_lens=30, token_start=2, token_end=22)]),
)
op = VllmIndexer(max_num_seqs=limits.max_num_seqs, max_logits_bytes=limits.max_logits_bytes, backend="reference",
                 attn_metadata=lambda: {"layers.0.indexer": vllm_md})
op(torch.empty(t, 1), "layers.0.indexer", kv, q_fp8, k, weights, limits.head_dim, "ue8m0", limits.topk,
   limits.head_dim, limits.max_model_len, limits.prefill_k_tokens, topk_out)
assert torch.equal(topk_out[:t].sort(1).values, direct.sort(1).values) and torch.equal(kv, kv_direct)
assert held_bytes() == p.total_bytes  # nothing grew while locked
print("decode token 1 selects", topk_out[1, :8].tolist(), "...")

# 3. a decode step padded for a FULL CUDA graph of 3 requests, as vLLM pads it: a padding request (query and
# sequence length 0, null block 0) and its token (slot -1) get a -1 row and write nothing to the cache
padded_md = SimpleNamespace(
    slot_mapping=torch.cat([slot_mapping[:2], torch.tensor([-1])]), num_decodes=3, num_decode_tokens=3,
    num_prefills=0, num_prefill_tokens=0, prefill=None,
    decode=SimpleNamespace(block_table=torch.cat([block_table[:2], torch.zeros(1, 8, dtype=torch.int32)]),
                           seq_lens=i32([[40], [90], [0]]), decode_lens=i32([1, 1, 0]), requires_padding=True),
)
op = VllmIndexer(max_num_seqs=limits.max_num_seqs, max_logits_bytes=limits.max_logits_bytes, backend="reference",
                 attn_metadata=lambda: {"layers.0.indexer": padded_md})
kv_before = kv.clone()
op(torch.empty(3, 1), "layers.0.indexer", kv, q_fp8[:3], k[:3], weights[:3], limits.head_dim, "ue8m0",
   limits.topk, limits.head_dim, limits.max_model_len, limits.prefill_k_tokens, topk_out)
assert torch.equal(topk_out[:2].sort(1).values, direct[:2].sort(1).values) and (topk_out[2] == -1).all()
assert torch.equal(kv, kv_before)  # the decode tokens' keys were already written in step 2; the padding wrote none
print("ok")
