"""The two-level indexer in the step (docs/spec.md §6a, §7): a source layer writes every token row's candidate
blocks and selects over whole windows; consumer layers select inside the candidate blocks only. Each layer is
judged against the float64 model of its own queries and weights (the cache shared)."""

from __future__ import annotations

import math

import pytest
import torch

import sparse_indexer as si
from buffers import IndexerLimits, allocate
from sparse_indexer.testing import assert_topk, candidate_errors, candidate_topk_errors
from tests.cases import SLOW_BACKEND, expect_error
from tests.sparse_indexer.test_compressed import Compressed
from tests.sparse_indexer.test_indexer import FN

B, KB, TOPK = 4, 6, 16  # (KB - 1) * B + 1 = 21 >= TOPK


def limits(**kw) -> IndexerLimits:
    base = dict(max_model_len=400, max_num_batched_tokens=512, max_num_seqs=8, n_heads=8, head_dim=64, topk=TOPK,
                block_size=8, compress_ratio=1, candidate_blocks=KB, candidate_block_size=B)
    base.update(kw)
    return IndexerLimits(**base)


def other_layer(sc: Compressed, seed: int):
    """Queries and weights of another layer over the same keys."""
    g = torch.Generator().manual_seed(seed)
    t, h, d = sc.q.shape
    return (torch.randn(t, h, d, generator=g) * 2).to(FN), torch.randn(t, h, generator=g) / math.sqrt(h * d)


def windows(sc: Compressed) -> list[int]:
    return sc.windows()


def run_layers(sc: Compressed, backend: str, consumers: int = 2, extra: int = 2):
    """One source layer (writes the keys and the candidates) and ``consumers`` consumer layers; checks each."""
    md = sc.metadata()
    t = md.num_tokens
    bufs = allocate(sc.lim)
    cand = torch.full((t + extra, KB), 77, dtype=torch.int32)
    out = torch.full((t + extra, TOPK), 7, dtype=torch.int32)
    si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, bufs, out, backend=backend, candidates=cand,
                           write_candidates=True)
    scores = sc.model_scores()
    assert bool((out[t:] == 7).all()) and bool((cand[t:] == 77).all()), "rows beyond the step's tokens written"
    assert_topk(out[:t], scores, rtol=1e-5, threshold=True)  # the source: ordinary top-k over whole windows
    errs = candidate_errors(cand[:t], scores, None, None, B, rtol=1e-5)
    assert not errs, errs[:3]
    outs = []
    q0, w0 = sc.q, sc.w
    for j in range(consumers):
        sc.q, sc.w = other_layer(sc, 100 + j)
        sel = torch.full((t + extra, TOPK), 7, dtype=torch.int32)
        si.sparse_attn_indexer(sc.q, None, sc.w, sc.kv, md, bufs, sel, backend=backend, candidates=cand)
        errs = candidate_topk_errors(sel[:t], sc.model_scores(), None, None, cand[:t], B, rtol=1e-5)
        assert not errs, errs[:3]
        for row, n in zip(sel[:t], windows(sc)):  # the prefix contract of compressed caches
            valid = int((row >= 0).sum())
            assert valid == min(n, TOPK) and bool((row[:valid] >= 0).all()), (row.tolist(), n)
        outs.append(sel[:t])
    sc.q, sc.w = q0, w0
    return md, cand[:t], outs


# (seq_lens, query_lens, next_n, compress ratio)
CASES = {
    "mixed_c1": ([37, 3, 90, 200, 7, 61], [1, 1, 1, 150, 7, 20], 1, 1),
    "mixed_c2": ([41, 5, 90, 33, 120], [1, 1, 1, 1, 60], 1, 2),
    "decode_next_n2_c2": ([40, 5, 90, 300], [2, 2, 2, 2], 2, 2),
    "nonuniform_decode_next_n2_c1": ([41, 5, 90, 33, 150], [2, 1, 2, 1, 40], 2, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_source_then_consumers_match_the_model(name, backend):
    if SLOW_BACKEND and name != "nonuniform_decode_next_n2_c1":
        pytest.skip("the CPU interpreter runs one case (prefill and a non-uniform decode); all run in the reference "
                    "pass and on the GPU")
    seq, qry, nn, c = CASES[name]
    sc = Compressed(seq, qry, lim=limits(next_n=nn, compress_ratio=c), seed=len(name))
    md, cand, outs = run_layers(sc, backend)
    # token-row order: every row's candidates are those of its own window (blocks inside it)
    for row, n in zip(cand, windows(sc)):
        ids = row[row >= 0]
        assert bool((ids * B < max(n, 1)).all()) and (n == 0) == (ids.numel() == 0)
    assert max(windows(sc)) > KB * B  # some windows are longer than the candidates cover


def test_restriction_changes_the_selection():
    """Windows longer than KB * B cells: the consumer selects inside the candidates, not the dense top-k."""
    sc = Compressed([300, 250], [1, 1], lim=limits(), seed=4)
    md, cand, outs = run_layers(sc, "reference", consumers=1)
    dense = torch.full((2, TOPK), 7, dtype=torch.int32)
    q, w = other_layer(sc, 100)
    si.sparse_attn_indexer(q, None, w, sc.kv, md, allocate(sc.lim), dense, backend="reference")
    assert any(set(a.tolist()) != set(b.tolist()) for a, b in zip(outs[0], dense))


def test_bad_candidate_arguments_write_nothing():
    sc = Compressed([40, 90], [1, 30], lim=limits(), seed=2)
    md = sc.metadata()
    t = md.num_tokens
    bufs = allocate(sc.lim)
    out = torch.full((t, TOPK), 7, dtype=torch.int32)
    cand = torch.full((t, KB), 5, dtype=torch.int32)
    kv = sc.kv
    step = lambda **kw: si.sparse_attn_indexer(**{"q_fp8": sc.q, "k": sc.k, "weights": sc.w, "kv_cache": kv,  # noqa
                                                  "metadata": md, "buffers": bufs, "topk_out": out,
                                                  "candidates": cand, "write_candidates": True, **kw})
    watch = (out, cand, kv)
    expect_error(ValueError, "candidates", lambda: step(candidates=cand[:, :KB - 1].contiguous()), watch=watch)
    expect_error(ValueError, "candidates", lambda: step(candidates=cand[: t - 1]), watch=watch)
    expect_error(TypeError, "candidates", lambda: step(candidates=cand.long()), watch=watch)
    expect_error(ValueError, "candidates", lambda: step(candidates=out.view(-1)[: t * KB].view(t, KB)), watch=watch)
    expect_error(ValueError, "write_candidates", lambda: step(candidates=None), watch=watch)
    expect_error(si.BackendUnavailable, "aiter", lambda: step(backend="aiter"), watch=watch)
    lim0 = limits(candidate_blocks=0)
    sc0 = Compressed([40, 90], [1, 30], lim=lim0, seed=2)
    md0 = sc0.metadata()
    expect_error(ValueError, "candidate_blocks",
                 lambda: si.sparse_attn_indexer(sc0.q, sc0.k, sc0.w, sc0.kv, md0, allocate(lim0), out,
                                                candidates=cand, write_candidates=True), watch=(out, cand, sc0.kv))


def test_limits_reject_too_few_candidate_positions():
    with pytest.raises(ValueError, match="candidate_blocks"):
        limits(candidate_blocks=3)  # (3 - 1) * 4 + 1 = 9 < 16
    with pytest.raises(ValueError, match="must divide block_size=6 with context parallel"):
        limits(world_size=2, block_size=6)  # a candidate block of 4 positions would straddle two ranks' blocks
    assert limits(world_size=2).world_size == 2  # (blocks of 8 keys: each candidate block on one rank)
    with pytest.raises(TypeError, match="candidate_blocks"):
        limits(candidate_blocks=2.0)


def test_plan_holds_the_candidate_fields():
    from buffers import plan
    from buffers.plan import block_scores_elems

    p = plan(limits(next_n=2))
    assert p["cand_pack"].shape == (16, KB)
    assert p["block_scores"].shape == (block_scores_elems(limits(next_n=2)),)
    assert "block_scores" not in plan(limits(candidate_blocks=0))
    assert "cand_pack" not in plan(limits())  # next_n == 1: no packed decode


@pytest.mark.skipif(SLOW_BACKEND, reason="the reference backend under torch.compile: runs in the reference pass")
def test_source_and_consumer_compile_to_the_same_result():
    """``torch.compile(fullgraph=True)`` of a source and a consumer layer (a non-uniform decode: the packed
    candidate rows) writes what eager writes: ``topk_out`` of both layers, the candidates, the cache."""
    sc = Compressed([41, 5, 90, 150], [2, 1, 2, 40], lim=limits(next_n=2), seed=3)
    md = sc.metadata()
    t = md.num_tokens
    bufs = allocate(sc.lim).split_storages()  # (compiled mutation of the arena's fields: docs/integration.md)

    def step(q, k, w, kv, out, cand, out2):
        si.sparse_attn_indexer(q, k, w, kv, md, bufs, out, backend="reference", candidates=cand,
                               write_candidates=True)
        si.sparse_attn_indexer(q, None, w, kv, md, bufs, out2, backend="reference", candidates=cand)

    kv0 = sc.kv.clone()
    res = []
    for f in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        kv = kv0.clone()
        out = torch.full((t, TOPK), 7, dtype=torch.int32)
        out2 = out.clone()
        cand = torch.full((t, KB), 5, dtype=torch.int32)
        f(sc.q, sc.k, sc.w, kv, out, cand, out2)
        res.append((out, out2, cand, kv))
    assert all(torch.equal(a, b) for a, b in zip(*res))
