"""Batches for the vLLM shim tests: a K cache holding every request's earlier keys, one step's tensors, a float64
model of the step's top-k (tests/oracle.py), and our own path (``build_metadata`` + ``sparse_attn_indexer``) on the
same inputs.

The vLLM metadata itself comes from vLLM's own builder (``tests/compat/vllm_builder.py``). The hand-built
namespaces kept here (:func:`vllm_metadata`) cover only what vLLM 0.33's builder never produces and the shim still
accepts: 1-D decode ``seq_lens`` (earlier vLLM versions), native ``[B, n]`` decode with mixed real decode lengths
and ``requires_padding`` (0.33 splits such a batch into one decode length plus prefills, or flattens it), and
fields of features the shim refuses (context parallelism, varlen decode).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

import sparse_indexer as si
from tests import oracle

SEVEN = 7  # what topk_out holds before a step: rows the step must not touch keep it


def make_batch(seq_lens, query_lens, limits, *, seed=0, extra_rows=0, num_blocks=None, layout_only=False,
               prewritten=None):
    """A random step of requests with context ``seq_lens`` (tokens, this step's tokens included) and
    ``query_lens`` new tokens each, ordered as vLLM orders them (decodes first).

    The cache (``limits.block_size`` keys per block, ``C = limits.compress_ratio`` tokens per key, so
    ``C * block_size`` tokens per page) has random permuted blocks; ``block_table [R, ceil(max_model_len / (C *
    block_size))]`` int32 gives each request ``ceil(seq_len / (C * block_size))`` pages, as vLLM's token-level
    block table does. ``keys[r]`` (``[seq_len // C, D]`` bfloat16, one per key of the request: per token when
    ``C == 1``, per compressed entry otherwise) keeps the request's whole history for the model.

    ``prewritten`` (default: ``C > 1``): the cache already holds every key of the step, this step's too (what
    DeepSeek-V4's compressor writes before the op), and ``k`` is ``None``. Otherwise it holds the earlier keys
    and ``k`` the new tokens' (``[tokens + extra_rows, D]``). ``q_fp8``/``weights`` (and ``k``) have
    ``extra_rows`` more rows than tokens (padding rows of a CUDA graph batch, random contents).

    Slots: ``slot_mapping`` ``[tokens]`` int64 are the tokens' own slots in a token-level cache of the same page
    table (``C * block_size`` tokens per page; what vLLM's model runner passes its builders), ``key_slots`` the
    slots of the keys the tokens write (``compressed_slot_mapping``: -1 where a token ends no group of ``C``;
    equal to ``slot_mapping`` when ``C == 1``). ``layout_only``: block table and slots only (no cache, keys or
    step tensors).
    """
    g = torch.Generator().manual_seed(seed)
    bs, d, h, cr = limits.block_size, limits.head_dim, limits.n_heads, limits.compress_ratio
    page = bs * cr  # tokens per page
    prewritten = cr > 1 if prewritten is None else prewritten
    n_req = len(seq_lens)
    max_blocks = (limits.max_model_len + page - 1) // page
    need = sum((s + page - 1) // page for s in seq_lens)
    num_blocks = num_blocks or need + 3
    perm = torch.randperm(num_blocks, generator=g)[:need].to(torch.int32)
    bt = torch.zeros(n_req, max_blocks, dtype=torch.int32)
    i = 0
    for r, s in enumerate(seq_lens):
        nb = (s + page - 1) // page
        bt[r, :nb] = perm[i : i + nb]
        i += nb
    t = sum(query_lens)
    pos = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens)]).long()
    req = torch.cat([torch.full((q,), r) for r, q in enumerate(query_lens)]).long()
    slot_mapping = bt.long()[req, pos // page] * page + pos % page
    key_slots = slot_mapping if cr == 1 else si.compressed_slot_mapping(bt, seq_lens, query_lens, bs,
                                                                       compress_ratio=cr)
    rows = t + extra_rows
    layout = SimpleNamespace(block_table=bt, slot_mapping=slot_mapping, key_slots=key_slots, seq_lens=list(seq_lens),
                             query_lens=list(query_lens), num_tokens=t, rows=rows, fp8_dtype=limits.fp8_dtype,
                             compress_ratio=cr, prewritten=prewritten)
    if layout_only:
        return layout
    kv = si.new_kv_cache(num_blocks, bs, d)
    keys = [torch.randn(s // cr, d, generator=g).to(torch.bfloat16) for s in seq_lens]
    for r, (s, q) in enumerate(zip(seq_lens, query_lens)):  # what the cache holds before the op
        n_keys = s // cr if prewritten else s - q
        if n_keys > 0:
            slots = si.slots_from_block_table(bt[r : r + 1], torch.arange(n_keys)[None], bs)[0]
            si.write_k_cache(keys[r][:n_keys], kv, slots, fp8_dtype=limits.fp8_dtype, backend="reference")
    q_fp8, q_scale = si.quantize_q(torch.randn(rows, h, d, generator=g), fp8_dtype=limits.fp8_dtype)
    weights = (torch.randn(rows, h, generator=g) * h**-0.5 * d**-0.5 * q_scale).float()
    k = None
    if not prewritten:
        k = torch.cat([torch.cat([keys[r][s - q :] for r, (s, q) in enumerate(zip(seq_lens, query_lens))]),
                       torch.randn(extra_rows, d, generator=g).to(torch.bfloat16)])
    layout.__dict__.update(kv=kv, q_fp8=q_fp8, weights=weights, k=k, keys=keys)
    return layout


# ------------------------------------------------------------------------------------------------ the model
def model_scores(batch) -> list[torch.Tensor]:
    """float64 scores of every real token over its causal window (docs/spec.md §3, §5), in token order: keys
    quantized by the oracle from ``batch.keys`` (ue8m0 scales, as the step writes them), queries decoded from
    their FP8 bytes. The token at position ``p`` sees the first ``(p + 1) // C`` keys of its request
    (``C = batch.compress_ratio``; an empty window gives an empty tensor). Reads neither the cache nor anything
    the library computed."""
    out = []
    t = 0
    cr = getattr(batch, "compress_ratio", 1)
    for r, (s, q) in enumerate(zip(batch.seq_lens, batch.query_lens)):
        vals, scale = None, None
        if batch.keys[r].shape[0]:
            vals, scale, _ = oracle.quantize(batch.keys[r], batch.fp8_dtype, "ue8m0")
        for j in range(q):
            lim = (s - q + j + 1) // cr
            if lim == 0:
                out.append(torch.empty(0, dtype=torch.float64))
            else:
                qv = oracle.decode(batch.q_fp8[t])[None]  # [1, H, D]
                out.append(oracle.scores(qv, vals[:lim], scale[:lim], batch.weights[t : t + 1])[0])
            t += 1
    return out


def model_logits(batch, q_fp8: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores of :func:`model_scores` as one matrix, computed per request (all its tokens at once):
    ``(logits [tokens, W] float64, ends [tokens] int64)``, row ``t`` token ``t``'s scores over its window
    ``[0, ends[t])`` (``W`` the longest window, at least 1; cells past a window ``-inf``). ``q_fp8``/``weights``
    (default: the batch's) are another layer's queries over the same keys; the keys' quantization is made once
    per batch."""
    q_fp8 = batch.q_fp8 if q_fp8 is None else q_fp8
    weights = batch.weights if weights is None else weights
    cr = getattr(batch, "compress_ratio", 1)
    quant = batch.__dict__.setdefault("_model_keys", {})
    ends = torch.tensor([(s - q + j + 1) // cr for s, q in zip(batch.seq_lens, batch.query_lens) for j in range(q)],
                        dtype=torch.long)
    width = max(1, int(ends.max()) if ends.numel() else 0)
    out = torch.full((ends.shape[0], width), float("-inf"), dtype=torch.float64)
    t = 0
    for r, q in enumerate(batch.query_lens):
        e = ends[t : t + q]
        n = int(e.max()) if q else 0
        if n:
            if r not in quant:
                quant[r] = oracle.quantize(batch.keys[r], batch.fp8_dtype, "ue8m0")[:2]
            vals, scale = quant[r]
            sc = oracle.scores(oracle.decode(q_fp8[t : t + q]), vals[:n], scale[:n], weights[t : t + q])
            inside = torch.arange(n)[None, :] < e[:, None]
            out[t : t + q, :n] = torch.where(inside, sc, float("-inf"))
        t += q
    return out, ends


def check_against_model(topk: torch.Tensor, batch, topk_width: int) -> None:
    """Rows ``[0, num_tokens)`` of ``topk`` are a correct top-k of the model's scores (docs/spec.md §6): a window
    of ``n <= topk`` gives ``0..n-1, -1...``; a longer one ``topk`` distinct positions whose scores are all at
    least the model's k-th best (less ``1e-5 x`` the largest score: float32 logits against float64)."""
    scores = model_scores(batch)
    assert topk.shape[0] >= len(scores)
    for i, s in enumerate(scores):
        n, row = s.shape[0], topk[i]
        if n <= topk_width:
            want = torch.cat([torch.arange(n), torch.full((topk_width - n,), -1)]).int()
            assert torch.equal(row, want), f"token {i} (window {n}): {row[:8].tolist()} != {want[:8].tolist()}"
            continue
        assert bool((row >= 0).all()) and bool((row < n).all()), f"token {i}: position outside [0, {n})"
        assert row.unique().numel() == topk_width, f"token {i}: repeated positions"
        kth = s.topk(topk_width).values[-1]
        got = s[row.long()]
        tol = 1e-5 * float(s.abs().max()) + 1e-30
        assert bool((got >= kth - tol).all()), f"token {i}: selected score {float(got.min())} < k-th best {kth}"


# ------------------------------------------------------------------------------------------------ our path
def run_ours(batch, lim, md=None, *, backend="reference", rows=None, q_fp8=None, weights=None, candidates=None,
             write_candidates=False):
    """``build_metadata`` (from the real lengths in tokens and the key slots) + ``sparse_attn_indexer`` on a copy
    of the cache (``k=None`` for a prewritten batch); ``topk_out`` has ``max_num_batched_tokens`` rows, pre-filled
    with 7. ``q_fp8``/``weights``: another layer's (default: the batch's); ``candidates``/``write_candidates``:
    the step's two-level indexer arguments (written in place by a source). Returns ``(topk_out, kv)``."""
    md = md or si.build_metadata(batch.seq_lens, batch.query_lens, batch.block_table, batch.key_slots, lim)
    q_fp8 = batch.q_fp8 if q_fp8 is None else q_fp8
    weights = batch.weights if weights is None else weights
    rows = q_fp8.shape[0] if rows is None else rows
    kv = batch.kv.clone()
    out = torch.full((lim.max_num_batched_tokens, lim.topk), SEVEN, dtype=torch.int32)
    k = None if batch.k is None else batch.k[:rows]
    kw = {} if candidates is None else {"candidates": candidates, "write_candidates": write_candidates}
    si.sparse_attn_indexer(q_fp8[:rows], k, weights[:rows], kv, md, si.allocate(lim), out, backend=backend, **kw)
    return out, kv


def same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as sets per row (docs/spec.md §6 allows any order)."""
    return a.shape == b.shape and torch.equal(a.sort(1).values, b.sort(1).values)


# ------------------------------------------------------------------------------------------------ hand-built
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


def vllm_metadata(batch, next_n, *, one_d=False, pad_reqs=0, pad_tokens=0):
    """A ``DeepseekV32IndexerMetadata`` namespace in layouts vLLM 0.33's builder does not produce: decode requests
    (query length <= ``next_n``, first) of any mixed lengths in the native layout, ``seq_lens [B, max d]`` =
    ``clamp(L - max_d + j + 1, 0)`` with ``requires_padding`` when the lengths differ, or ``[B]`` with
    ``one_d``; ``pad_reqs`` padding requests (length 0) and ``pad_tokens`` padding tokens (slot -1) as for a
    FULL CUDA graph; one prefill chunk with every prefill request."""
    seq, qry, bt = batch.seq_lens, batch.query_lens, batch.block_table
    nd_req = 0
    while nd_req < len(qry) and qry[nd_req] <= next_n:
        nd_req += 1
    nd_tok = sum(qry[:nd_req])
    decode = None
    if nd_req:
        s = torch.tensor(seq[:nd_req] + [0] * pad_reqs, dtype=torch.int32)
        d = torch.tensor(qry[:nd_req] + [0] * pad_reqs, dtype=torch.int32)
        max_d = int(d.max())
        lens = s if one_d else (s[:, None] - max_d + 1 + torch.arange(max_d)[None]).clamp(min=0).int()
        dbt = torch.cat([bt[:nd_req], torch.zeros(pad_reqs, bt.shape[1], dtype=torch.int32)])
        decode = SimpleNamespace(block_table=dbt, seq_lens=lens, decode_lens=d, requires_padding=int(d.min()) != max_d,
                                 schedule_metadata=None, indices=None)
    prefill = None
    if nd_req < len(seq):
        assert not pad_reqs and not pad_tokens, "padding goes with pure decode batches here"
        prefill = SimpleNamespace(chunks=[vllm_prefill_chunk(seq, qry, bt, nd_req, len(seq))],
                                  max_prefill_seq_len=max(seq[nd_req:]), row_shard_sizes=None)
    slots = torch.cat([batch.slot_mapping, torch.full((pad_tokens,), -1, dtype=torch.int64)])
    return SimpleNamespace(
        seq_lens=torch.tensor(seq, dtype=torch.int32), max_seq_len=max(seq), slot_mapping=slots,
        num_decodes=nd_req + pad_reqs, num_decode_tokens=nd_tok + pad_tokens, num_prefills=len(seq) - nd_req,
        num_prefill_tokens=sum(qry) - nd_tok, decode=decode, prefill=prefill, positions=None, block_table=bt,
    )
