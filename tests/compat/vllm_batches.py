"""Batches for the vLLM shim tests: our inputs, and vLLM-style metadata built with vLLM 0.33's conventions
(``vllm/v1/attention/backends/mla/indexer.py``), as plain namespaces with the dataclasses' field names."""

from __future__ import annotations

from types import SimpleNamespace

import torch

import sparse_indexer as si


def make_batch(seq_lens, query_lens, limits, *, seed=0, num_blocks=None):
    """Random step: a K cache already holding every request's earlier keys, and this step's tensors."""
    g = torch.Generator().manual_seed(seed)
    bs, d, h = limits.block_size, limits.head_dim, limits.n_heads
    n_req = len(seq_lens)
    max_blocks = (limits.max_model_len + bs - 1) // bs
    need = sum((s + bs - 1) // bs for s in seq_lens)
    num_blocks = num_blocks or need + 3
    perm = torch.randperm(num_blocks, generator=g)[:need].to(torch.int32)
    bt = torch.zeros(n_req, max_blocks, dtype=torch.int32)
    i = 0
    for r, s in enumerate(seq_lens):
        nb = (s + bs - 1) // bs
        bt[r, :nb] = perm[i : i + nb]
        i += nb
    kv = si.new_kv_cache(num_blocks, bs, d)
    # earlier context of every request
    for r, (s, q) in enumerate(zip(seq_lens, query_lens)):
        if s - q > 0:
            pos = torch.arange(s - q)[None]
            slots = si.slots_from_block_table(bt[r : r + 1], pos, bs)[0]
            si.write_k_cache(torch.randn(s - q, d, generator=g), kv, slots, fp8_dtype=limits.fp8_dtype)
    pos = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens)])
    req = torch.cat([torch.full((q,), r) for r, q in enumerate(query_lens)])
    slot_mapping = (bt.long()[req, pos // bs] * bs + pos % bs).to(torch.int64)
    t = sum(query_lens)
    q_fp8, q_scale = si.quantize_q(torch.randn(t, h, d, generator=g), fp8_dtype=limits.fp8_dtype)
    weights = (torch.randn(t, h, generator=g) * h**-0.5 * d**-0.5 * q_scale).float()
    k = torch.randn(t, d, generator=g).to(torch.bfloat16)
    return SimpleNamespace(kv=kv, block_table=bt, slot_mapping=slot_mapping, q_fp8=q_fp8, weights=weights, k=k,
                           seq_lens=list(seq_lens), query_lens=list(query_lens))


def vllm_prefill_chunk(seq, qry, bt, start, end, qs=None):
    """``DeepseekV32IndexerPrefillChunkMetadata`` of requests ``[start, end)`` (absolute indices), optionally
    only queries ``qs = (q0, q1)`` of the chunk's concatenated queries (``build_prefill_chunk_metadata``)."""
    qsl = [0]
    for q in qry:
        qsl.append(qsl[-1] + q)
    cu = [0]
    ks, ke = [], []
    for r in range(start, end):
        for j in range(qry[r]):
            ks.append(cu[-1])
            ke.append(cu[-1] + seq[r] - qry[r] + j + 1)
        cu.append(cu[-1] + seq[r])
    q0, q1 = qs if qs is not None else (0, len(ks))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    cu_t = i32(cu)
    return SimpleNamespace(
        block_table=bt[start:end], cu_seqlen_ks=i32(ks[q0:q1]), cu_seqlen_ke=i32(ke[q0:q1]), cu_seq_lens=cu_t,
        token_to_seq=None, total_seq_lens=cu[-1], max_seqlen_k=max(seq[start:end]), token_start=qsl[start] + q0,
        token_end=qsl[start] + q1, num_reqs=end - start, skip_kv_gather=q0 > 0, local_cu_seq_lens=cu_t,
        local_total_seq_lens=cu[-1], max_local_total_seq_lens=cu[-1], pcp_deinterleave_idx=None,
    )


def vllm_decode(seq, qry, bt, num_decodes, mode):
    """``DeepSeekV32IndexerDecodeMetadata`` as ``_prepare_decode_tensors`` builds it.

    mode ``"native"``: ``seq_lens`` ``[B]`` when the longest decode is 1 token, else ``[B, max_d]`` with
    ``clamp(L - max_d + j + 1, 0)``; ``requires_padding`` when decode lengths differ (queries packed
    left-aligned). mode ``"flat"``: one row per token, ``seq_lens[i] = L - d + j + 1``, block table repeated.
    """
    s = torch.tensor(seq[:num_decodes], dtype=torch.int32)
    d = torch.tensor(qry[:num_decodes], dtype=torch.int32)
    nd = int(d.sum())
    if mode == "flat":
        lens = torch.cat([torch.arange(L - dd + 1, L + 1) for L, dd in zip(s.tolist(), d.tolist())]).int()
        return SimpleNamespace(block_table=torch.repeat_interleave(bt[:num_decodes], d.long(), dim=0),
                               seq_lens=lens, decode_lens=torch.ones(nd, dtype=torch.int32), requires_padding=False,
                               schedule_metadata=None, indices=None)
    max_d, min_d = int(d.max()), int(d.min())
    lens = s
    if max_d > 1:
        lens = (s[:, None] - max_d + 1 + torch.arange(max_d)[None]).clamp(min=0).int()
    return SimpleNamespace(block_table=bt[:num_decodes], seq_lens=lens, decode_lens=d, requires_padding=min_d != max_d,
                           schedule_metadata=None, indices=None)


def vllm_metadata(batch, next_n, *, decode_mode="native", chunks=None):
    """``DeepseekV32IndexerMetadata`` of a batch; ``chunks``: list of ``(start, end, (q0, q1) or None)`` over
    absolute request indices (default: one chunk with every prefill request)."""
    seq, qry, bt = batch.seq_lens, batch.query_lens, batch.block_table
    nd_req = 0
    while nd_req < len(qry) and qry[nd_req] <= next_n:
        nd_req += 1
    nd_tok = sum(qry[:nd_req])
    decode = vllm_decode(seq, qry, bt, nd_req, decode_mode) if nd_req else None
    prefill = None
    if nd_req < len(seq):
        chunks = chunks if chunks is not None else [(nd_req, len(seq), None)]
        prefill = SimpleNamespace(chunks=[vllm_prefill_chunk(seq, qry, bt, a, b, qs) for a, b, qs in chunks],
                                  max_prefill_seq_len=max(seq[nd_req:]), row_shard_sizes=None)
    return SimpleNamespace(
        seq_lens=torch.tensor(seq, dtype=torch.int32), max_seq_len=max(seq), slot_mapping=batch.slot_mapping,
        num_decodes=nd_req, num_decode_tokens=nd_tok, num_prefills=len(seq) - nd_req,
        num_prefill_tokens=sum(qry) - nd_tok, decode=decode, prefill=prefill, positions=None, block_table=bt,
    )
