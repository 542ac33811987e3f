"""Decode under a logits budget (``IndexerLimits.max_decode_logits_bytes``): the step scores and selects its decode
requests in sub-batches over one budget-sized region of ``buffers.logits`` and gives the top-k of a single batch.

Runs on the reference backend and, in ``tests/run.sh``'s interpreter pass, on the Triton kernels.
``tests/gpu/test_budget_gpu.py`` replays a budgeted step in a CUDA graph on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

import sparse_indexer as si
from buffers import BufferTooSmall, IndexerLimits, allocate, plan
from sparse_indexer.indexer import decode_batch
from tests.sparse_indexer.test_indexer import Scenario, check_topk, limits


def same_selection(a: torch.Tensor, b: torch.Tensor, logits: torch.Tensor | None = None) -> None:
    """Row by row, the same top-k (positions in any order). Where the position sets differ, the multisets of the
    unbudgeted run's ``logits`` at them must agree to 1e-6 of the row's largest score: docs/spec.md §6 lets near-ties go
    either way, and the reference's float32 matmuls may round a cell's last bit differently for another batch
    shape (the Triton kernels compute every row alike)."""
    assert a.shape == b.shape
    sa, sb = a.sort(dim=1).values, b.sort(dim=1).values
    bad = (sa != sb).any(dim=1).nonzero().flatten().tolist()
    if logits is None:
        assert not bad, f"rows {bad[:8]} differ: {sa[bad[0], :8].tolist()} vs {sb[bad[0], :8].tolist()}"
        return
    for r in bad:
        ga, gb = sa[r][sa[r] >= 0].long(), sb[r][sb[r] >= 0].long()
        assert ga.numel() == gb.numel(), f"row {r}: {ga.numel()} vs {gb.numel()} positions"
        va, vb = logits[r, ga].sort().values, logits[r, gb].sort().values
        tol = 1e-6 * float(logits[r, gb].abs().max())
        assert torch.allclose(va, vb, rtol=0, atol=tol), f"row {r}: selected scores differ by {(va - vb).abs().max()}"


def run(sc: Scenario, lim: IndexerLimits, backend: str) -> tuple[object, torch.Tensor, torch.Tensor]:
    """The step on a copy of the cache; returns the metadata, the top-k rows and a copy of the last decode
    sub-batch's logits (all decode rows when there is one sub-batch)."""
    md = si.build_metadata(sc.seq, sc.qry, sc.block_table, sc.slot_mapping, lim, num_blocks=sc.kv.shape[0])
    topk_out = torch.full((md.num_tokens + 2, lim.topk), 7, dtype=torch.int32)
    kv = sc.kv.clone()  # each run writes the step's keys into its own copy of the cache
    bufs = allocate(lim)
    si.sparse_attn_indexer(sc.q, sc.k, sc.w, kv, md, bufs, topk_out, backend=backend)
    assert bool((topk_out[md.num_tokens :] == 7).all())
    rows = min(md.decode.num_reqs, decode_batch(md)) * md.decode.next_n
    return md, topk_out[: md.num_tokens], bufs.logits_view(rows, md.decode.width).clone()


@pytest.mark.parametrize(
    "next_n, qry, with_qk",
    [
        (1, [1, 1, 1, 1, 1, 1, 1, 12], False),  # uniform, 7 requests in sub-batches of 2
        (2, [2, 2, 2, 2, 2, 2, 2], True),  # uniform next_n 2, no prefill, with the per-head qk scratch
        (2, [2, 1, 2, 0, 1, 2, 2, 9], False),  # non-uniform (packed slots), a request without tokens
        (3, [3, 1, 2, 3, 3], False),  # non-uniform next_n 3, sub-batches of 2: 2 + 2 + 1
    ],
)
def test_budget_gives_the_top_k_of_one_batch(backend, next_n, qry, with_qk):
    n = len(qry)
    seq = [max(q, 20 + 67 * i) for i, q in enumerate(qry)]
    free = limits(next_n=next_n, with_qk=with_qk)
    budget = limits(next_n=next_n, with_qk=with_qk, max_decode_logits_bytes=2 * next_n * 512 * 4 + 100)
    assert budget.decode_batch == 2
    sc = Scenario(seq, qry, lim=free, seed=20 + next_n)
    md, want, logits = run(sc, free, backend)
    mdb, got, _ = run(sc, budget, backend)
    nreq, nd = md.decode.num_reqs, md.num_decode_tokens
    assert decode_batch(mdb) == 2 and nreq > 2 and decode_batch(md) >= nreq  # several sub-batches vs one
    assert torch.equal(got[nd:], want[nd:])  # prefill rows: the budget does not touch them
    if md.decode.uniform:
        same_selection(got[:nd], want[:nd], logits)
    else:  # packed slots: compare through the packing
        same_selection(got[:nd], want[:nd], logits[md.decode.unpack_src])
    check_topk(got, sc.model_scores(), free.topk)
    assert n == len(sc.seq)


def test_budget_buffers_are_smaller_and_hold_only_a_sub_batch():
    kw = dict(next_n=2, max_num_seqs=8, max_logits_bytes=4 * 2000)
    free, budget = limits(**kw), limits(**kw, max_decode_logits_bytes=3 * 2 * 512 * 4)
    assert plan(budget)["logits"].nbytes == 3 * 2 * 512 * 4 < plan(free)["logits"].nbytes == 8 * 2 * 512 * 4
    sc = Scenario([100] * 6, [2] * 6, lim=free, seed=3)
    md = sc.metadata()  # planned without a budget: one batch of 6 requests
    topk_out = torch.full((md.num_tokens, free.topk), 7, dtype=torch.int32)
    with pytest.raises(BufferTooSmall) as e:  # 6 requests do not fit the budget's logits: refused before writing
        si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, allocate(budget), topk_out, backend="reference")
    assert e.value.field == "logits" and bool((topk_out == 7).all())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                    reason="reference backend only: it runs in the suite's reference pass")
def test_budget_of_256_mib_at_1m_context():
    """max_model_len 1M, 256 sequences, next_n 2, a 256 MiB budget (sub-batches of 32 requests): a decode step of
    33 requests (two sub-batches), two of them with ~1M-token contexts, one in each, end to end on the reference
    backend. The same top-k as without a budget: every request's rows equal those of one unbudgeted batch (the
    two long requests together at width 1M, the 31 short ones together at width 4096; a 2 GiB plan for all 33
    at once would not fit CI, and rows are independent)."""
    MiB = 1 << 20
    L, bs, h, d, nn, b = 1 << 20, 64, 2, 64, 2, 33
    common = dict(max_model_len=L, max_num_batched_tokens=512, next_n=nn, n_heads=h, head_dim=d, topk=2048,
                  block_size=bs, prefill_k_tokens=L, max_logits_bytes=64 * MiB)
    lim = IndexerLimits(**common, max_num_seqs=256, max_decode_logits_bytes=256 * MiB)
    assert lim.decode_batch == 32
    p = plan(lim)
    assert p["logits"].nbytes == 256 * MiB and p["topk_scratch"].shape[0] == 64  # vs 2 GiB and 512 rows unbudgeted
    g = torch.Generator().manual_seed(0)
    nb = L // bs
    kv = si.new_kv_cache(nb, bs, d)
    si.write_k_cache(torch.randn(L, d, generator=g).to(torch.bfloat16), kv, torch.arange(L), backend="reference")
    seq = [int(x) for x in torch.randint(2, 4096, (b,), generator=g)]
    long = [3, 32]
    seq[3], seq[32] = L, L - 12345  # one long request in each sub-batch
    table = torch.stack([torch.randperm(nb, generator=g).int() for _ in range(b)])
    q = (torch.randn(b * nn, h, d, generator=g) * 2).to(torch.float8_e4m3fn)
    w = torch.randn(b * nn, h, generator=g) / (h * d) ** 0.5

    def step(lm, reqs, width=None):
        rows = torch.tensor([r * nn + j for r in reqs for j in range(nn)])
        md = si.build_metadata([seq[r] for r in reqs], [nn] * len(reqs), table[reqs],
                               torch.full((len(rows),), -1, dtype=torch.int64), lm, num_blocks=nb,
                               decode_width=width)
        topk_out = torch.empty(len(rows), 2048, dtype=torch.int32)
        bufs = allocate(lm)
        si.sparse_attn_indexer(q[rows], None, w[rows], kv, md, bufs, topk_out, backend="reference")
        rows_last = min(len(reqs), decode_batch(md)) * nn  # the last sub-batch's logits stay in the buffer
        return md, topk_out, bufs.logits_view(rows_last, md.decode.width)

    md, got, _ = step(lim, list(range(b)))
    assert decode_batch(md) == 32 and md.decode.num_reqs == 33
    short = [r for r in range(b) if r not in long]
    free = IndexerLimits(**{**common, "max_num_seqs": len(short), "max_model_len": 4096, "prefill_k_tokens": 4096})
    _, want_short, logits_short = step(free, short)
    same_selection(got.view(b, nn, -1)[short].flatten(0, 1), want_short, logits_short)
    _, want_long, logits_long = step(IndexerLimits(**common, max_num_seqs=2), long)
    same_selection(got.view(b, nn, -1)[long].flatten(0, 1), want_long, logits_long)
    assert bool((want_long >= 0).all()) and int(want_long.max()) > L // 2  # full windows, positions across 1M
