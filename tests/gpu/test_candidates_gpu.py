"""The two-level indexer (docs/spec.md §6a) on the GPU at DeepSeek-V4.1's shapes (blocks of 8, 2048 candidate
blocks, topk 512): the ops of every GPU backend against the exact checkers on hard value distributions, against
vLLM's own ``select_candidate_blocks`` and ``apply_candidate_mask`` + top-k on the same logits when its functions
are at hand (``SPARSE_INDEXER_VLLM_CANDIDATES``: a ``vllm_candidates.py`` runnable without vLLM, see the bench's
``--anchors``), and a source and a consumer step captured in one CUDA graph, replayed equal to eager."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

import sparse_indexer as si
from buffers import IndexerLimits, allocate
from sparse_indexer.testing import (
    TOPK_DISTRIBUTIONS,
    assert_candidates,
    assert_topk,
    candidate_errors,
    candidate_topk_errors,
    capture_cuda_graph,
    topk_values,
)
from tests.sparse_indexer.test_compressed import Compressed

pytestmark = pytest.mark.gpu
DEV = "cuda"
B, KB, TOPK = 8, 2048, 512
GPU_BACKENDS = (None, "triton", "cuda")


def _vllm():
    path = os.environ.get("SPARSE_INDEXER_VLLM_CANDIDATES")
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("vllm_candidates", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(r, w, g):
    s = torch.zeros(r, dtype=torch.int32)
    e = torch.randint(w // 2, w + 1, (r,), generator=g).int()
    e[0], e[-1] = w, 3  # a full row and a short one
    return s.to(DEV), e.to(DEV)


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dist", TOPK_DISTRIBUTIONS)
def test_ops_on_every_distribution(backend, dist):
    g = torch.Generator().manual_seed(len(dist))
    r, w = 16, 65536
    src = topk_values(dist, r, w, generator=g).to(DEV)
    con = topk_values(dist, r, w, generator=g).to(DEV)
    s, e = _rows(r, w, g)
    cand = torch.full((r, KB), 99, dtype=torch.int32, device=DEV)
    si.select_candidate_blocks(src, s, e, out=cand, block_size=B, backend=backend)
    errs = candidate_errors(cand.cpu(), src.cpu(), s.cpu(), e.cpu(), B, limit=1)
    assert not errs, errs
    out = torch.full((r, TOPK), 99, dtype=torch.int32, device=DEV)
    before = con.clone()
    si.top_k_per_row(con, s, e, out=out, candidates=cand, candidate_block_size=B, backend=backend)
    errs = candidate_topk_errors(out.cpu(), con.cpu(), s.cpu(), e.cpu(), cand.cpu(), B, limit=1)
    assert not errs, errs
    assert torch.equal(con.view(torch.int32), before.view(torch.int32))


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,kb,w", [(8, 2048, 131072), (8, 2048, 8192), (4, 300, 20000), (1, 700, 5000),
                                    (8, 2048, 1 << 20), (3, 5, 1000)])
def test_shapes(backend, dtype, b, kb, w):
    g = torch.Generator().manual_seed(w + b)
    r = 8 if w < 1 << 20 else 2  # (1M positions: the CUDA select keeps the block scores in the workspace)
    src = torch.randn(r, w, generator=g).to(dtype).to(DEV)
    con = torch.randn(r, w, generator=g).to(dtype).to(DEV)
    s = torch.randint(0, 50, (r,), generator=g).int().to(DEV)
    e = torch.full((r,), w, dtype=torch.int32, device=DEV)
    cand = torch.empty(r, kb, dtype=torch.int32, device=DEV)
    si.select_candidate_blocks(src, s, e, out=cand, block_size=b, backend=backend)
    assert_candidates(cand.cpu(), src.float().cpu(), s.cpu(), e.cpu(), b)
    out = torch.empty(r, min(TOPK, (kb - 1) * b + 1), dtype=torch.int32, device=DEV)
    si.top_k_per_row(con, s, e, out=out, candidates=cand, candidate_block_size=b, backend=backend)
    assert_topk(out.cpu(), con.float().cpu(), s.cpu(), e.cpu(), candidates=cand.cpu(), candidate_block_size=b)


def test_equals_vllm_on_the_same_logits():
    vc = _vllm()
    if vc is None:
        pytest.skip("SPARSE_INDEXER_VLLM_CANDIDATES is not set (vLLM's candidate functions)")
    g = torch.Generator().manual_seed(1)
    r, w = 64, 65536
    src = torch.randn(r, w, generator=g).to(DEV)
    con = torch.randn(r, w, generator=g).to(DEV)
    e = torch.randint(1, w + 1, (r,), generator=g).int().to(DEV)
    e[:8] = w
    s = torch.zeros(r, dtype=torch.int32, device=DEV)
    ours = torch.empty(r, KB, dtype=torch.int32, device=DEV)
    theirs = torch.empty(r, KB, dtype=torch.int32, device=DEV)
    si.select_candidate_blocks(src, s, e, out=ours, block_size=B)
    vc.select_candidate_blocks(src, None, e, KB, B, theirs)
    for i in range(r):
        assert set(ours[i].tolist()) == set(theirs[i].tolist()), f"row {i}: candidate sets differ"
    out = torch.empty(r, TOPK, dtype=torch.int32, device=DEV)
    si.top_k_per_row(con, s, e, out=out, candidates=ours, candidate_block_size=B)
    masked = con.clone()
    vc.apply_candidate_mask(masked, None, e, theirs, B)
    want = torch.empty_like(out)
    si.top_k_per_row(masked, s, e, out=want, backend="reference")
    for i in range(r):
        a = sorted(con[i, out[i][out[i] >= 0].long()].tolist())
        b = sorted(masked[i, want[i][want[i] >= 0].long()].tolist())
        b = [x for x in b if x != float("-inf")]  # vLLM's short rows keep masked cells: positions, not values
        assert a == b, f"row {i}: selected multisets differ"


def _lim(next_n):
    return IndexerLimits(max_model_len=65536, max_num_batched_tokens=4096, max_num_seqs=8, next_n=next_n,
                         n_heads=32, head_dim=128, topk=TOPK, block_size=64, compress_ratio=2,
                         max_logits_bytes=4 * 1_000_000, candidate_blocks=KB, candidate_block_size=B)


@pytest.mark.parametrize("next_n", [1, 2])
def test_source_and_consumer_steps_in_one_graph(next_n):
    seq = [60000, 40000, 9, 50001][: 4]
    sc = Compressed(seq, [next_n] * 4, lim=_lim(next_n), seed=next_n)
    md = si.build_metadata(sc.seq, sc.qry, sc.block_table.to(DEV), sc.slot_mapping.to(DEV), sc.lim,
                           num_blocks=sc.kv.shape[0])
    kv = sc.all_keys_written().to(DEV)
    bufs = allocate(sc.lim, device=DEV)
    t = md.num_tokens
    q2 = (torch.randn_like(sc.q.float()) * 2).to(sc.q.dtype)
    w2 = torch.randn_like(sc.w) / math.sqrt(32 * 128)
    q1, w1, q2, w2 = sc.q.to(DEV), sc.w.to(DEV), q2.to(DEV), w2.to(DEV)
    cand = torch.full((t, KB), 5, dtype=torch.int32, device=DEV)
    o1 = torch.empty(t, TOPK, dtype=torch.int32, device=DEV)
    o2 = torch.empty_like(o1)

    def step():
        si.sparse_attn_indexer(q1, None, w1, kv, md, bufs, o1, candidates=cand, write_candidates=True)
        si.sparse_attn_indexer(q2, None, w2, kv, md, bufs, o2, candidates=cand)

    step()
    eager = (cand.clone(), o1.clone(), o2.clone())
    scores1 = sc.model_scores()
    assert_topk(eager[1].cpu(), scores1, rtol=1e-3, threshold=True)
    errs = candidate_errors(eager[0].cpu(), scores1, None, None, B, rtol=1e-3, limit=1)
    assert not errs, errs
    sc.q, sc.w = q2.cpu(), w2.cpu()
    errs = candidate_topk_errors(eager[2].cpu(), sc.model_scores(), None, None, eager[0].cpu(), B, rtol=1e-3,
                                 limit=1)
    assert not errs, errs
    cand.fill_(-7)
    o1.fill_(-7)
    o2.fill_(-7)
    graph = capture_cuda_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, (cand, o1, o2)):
        assert all(set(x.tolist()) == set(y.tolist()) for x, y in zip(a.cpu(), b.cpu()))
