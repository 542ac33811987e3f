"""The indexer step on an MXFP4 cache (docs/spec.md §3a, §7) on the backend under test: MXFP4 queries with their
scale bytes, the MXFP4 cache write of the new keys, the prefill gather of MXFP4 bytes, both logits ops and the
top-k, against a float64 oracle of the scores (exact products of the dequantized codes; the quantizer itself is
proven bit-exact against an independent model in ``tests/sparse_indexer/test_mxfp4.py``); the plan's MXFP4
fields; the checks of the MXFP4 arguments before anything is written."""

from __future__ import annotations

import math

import pytest
import torch

import sparse_indexer as si
from buffers import CacheFormat, IndexerLimits, allocate, plan
from sparse_indexer.indexer import decode_batch
from tests.sparse_indexer.test_indexer import check_topk

pytestmark = pytest.mark.uses_ops("write_k_cache", "gather_k_cache", "fp8_mqa_logits", "fp8_paged_mqa_logits",
                                  "top_k_per_row")

MX = CacheFormat(values="mxfp4")


def limits(**kw):
    base = dict(max_model_len=512, max_num_batched_tokens=1024, max_num_seqs=8, n_heads=16, head_dim=64,
                topk=32, block_size=16, cache_format=MX)
    base.update(kw)
    return IndexerLimits(**base)


def _dequant(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 ``[..., D]`` from MXFP4 codes: e2m1 value times ``2 ** (byte - 127)``, exact."""
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    codes = torch.stack([values & 15, values >> 4], -1).flatten(-2).long()
    v = grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0).double()
    scale = torch.exp2(scales.double() - 127).repeat_interleave(32, -1)
    return v * scale


class MxScenario:
    """Requests with key histories in an MXFP4 paged cache, one step's tokens: MXFP4 queries and weights."""

    def __init__(self, seq_lens, query_lens, *, lim: IndexerLimits, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.lim = lim
        h, d, bs = lim.n_heads, lim.head_dim, lim.block_size
        self.seq, self.qry = list(seq_lens), list(query_lens)
        max_blocks = max(1, max(-(-s // bs) for s in self.seq))
        need = sum(-(-s // bs) for s in self.seq)
        nb = need + 3
        perm = torch.randperm(nb, generator=g)[:need].int()
        self.block_table = torch.full((len(self.seq), max_blocks), 10**6, dtype=torch.int32)
        o = 0
        for r, s in enumerate(self.seq):
            self.block_table[r, : -(-s // bs)] = perm[o : o + -(-s // bs)]
            o += -(-s // bs)
        self.kv = si.new_kv_cache(nb, bs, d, mxfp4=True, four_d=seed % 2 == 1)
        # keys over several decades, so the per-32 scales differ inside a key and between keys
        self.keys = [(torch.randn(s, d, generator=g) * torch.logspace(-2, 1, d)[torch.randperm(d, generator=g)])
                     .to(torch.bfloat16) for s in self.seq]
        for r, (s, q) in enumerate(zip(self.seq, self.qry)):
            if s - q > 0:
                slots = si.slots_from_block_table(self.block_table[r : r + 1], torch.arange(s - q)[None, :], bs)[0]
                si.write_k_cache(self.keys[r][: s - q], self.kv, slots, cache_format=MX, backend="reference")
        t = sum(self.qry)
        self.q_float = torch.randn(t, h, d, generator=g) * 2
        self.q, self.q_scale = si.quantize_q_mxfp4(self.q_float)
        self.w = torch.randn(t, h, generator=g) / math.sqrt(h * d)
        new_k, slots = [], []
        for r, (s, q) in enumerate(zip(self.seq, self.qry)):
            pad = max(0, q - s)
            new_k.append(torch.cat([torch.zeros(pad, d, dtype=torch.bfloat16), self.keys[r][max(0, s - q) :]]))
            slots.append(si.slots_from_block_table(self.block_table[r : r + 1], torch.arange(s - q, s)[None, :],
                                                   bs)[0])
        self.k = torch.cat(new_k)
        self.slot_mapping = torch.cat(slots)

    def metadata(self):
        return si.build_metadata(self.seq, self.qry, self.block_table, self.slot_mapping, self.lim,
                                 num_blocks=self.kv.shape[0])

    def model_scores(self):
        """Per token, the float64 scores of its window: ``sum_h w * relu(q . k)`` over the MXFP4 codes."""
        q64 = _dequant(*si.quantize_q_mxfp4(self.q_float))  # [T, H, D]
        out, t = [], 0
        for r, (s, q) in enumerate(zip(self.seq, self.qry)):
            k64 = _dequant(*si.quantize_k_mxfp4(self.keys[r])) if s else torch.zeros(0, self.lim.head_dim).double()
            for j in range(q):
                n = max(0, s - q + j + 1)
                out.append(self.w[t].double() @ (q64[t] @ k64[:n].T).clamp(min=0))
                t += 1
        return out


def run_step(sc: MxScenario, backend, k=True, extra_rows=3):
    md = sc.metadata()
    buf = allocate(sc.lim)
    t = md.num_tokens
    topk_out = torch.full((t + extra_rows, sc.lim.topk), 7, dtype=torch.int32)
    si.sparse_attn_indexer(sc.q, sc.k if k else None, sc.w, sc.kv, md, buf, topk_out, q_scale=sc.q_scale,
                           backend=backend)
    assert bool((topk_out[t:] == 7).all()), "rows beyond the step's tokens were written"
    return md, topk_out[:t]


def test_plan_sizes_mxfp4_keys():
    lim = limits(next_n=2)
    p = plan(lim)
    k, ks = p["k_fp8"], p["k_scale"]
    assert (k.dtype, k.shape[1], ks.dtype, ks.shape[1]) == (torch.uint8, 32, torch.uint8, 2)
    assert p["q_pack"].dtype == torch.uint8 and p["q_pack"].shape[1:] == (16, 32)
    assert p["q_scale_pack"].shape[1:] == (16, 2)
    fp8 = plan(limits(next_n=2, cache_format=None))
    assert k.nbytes + ks.nbytes == k.shape[0] * (32 + 2) < fp8["k_fp8"].nbytes + fp8["k_scale"].nbytes
    assert "q_scale_pack" not in fp8 and "q_scale_pack" not in plan(limits())
    buf = allocate(lim)
    assert buf.mxfp4 and buf.head_dim == 64 and buf.q_scale_pack is not None


def test_mixed_decode_and_prefill(backend):
    lim = limits()
    sc = MxScenario([40, 100, 7, 150], [1, 1, 5, 40], lim=lim, seed=1)
    md, sel = run_step(sc, backend)
    assert md.decode is not None and md.prefill_chunks
    check_topk(sel, sc.model_scores(), lim.topk)


def test_several_prefill_chunks(backend):
    lim = limits(max_logits_bytes=4 * 40 * 100, max_num_batched_tokens=512)
    sc = MxScenario([70, 100, 50], [30, 40, 20], lim=lim, seed=2)
    md, sel = run_step(sc, backend)
    assert len(md.prefill_chunks) > 1
    check_topk(sel, sc.model_scores(), lim.topk)


@pytest.mark.parametrize("next_n", [2, 4])
def test_nonuniform_decode_packs_query_scales(backend, next_n):
    lim = limits(next_n=next_n)
    sc = MxScenario([90, 33, 64, 5, 80], [next_n, 1, next_n - 1, 2, 40], lim=lim, seed=next_n)
    md, sel = run_step(sc, backend)
    assert md.decode is not None and not md.decode.uniform
    check_topk(sel, sc.model_scores(), lim.topk)


def test_uniform_decode_under_a_budget_without_the_cache_write(backend):
    lim = limits(next_n=2, max_decode_logits_bytes=2 * 512 * 4 * 2)
    sc = MxScenario([70, 130, 20, 512, 9], [2] * 5, lim=lim, seed=7)
    si.write_k_cache(sc.k, sc.kv, sc.slot_mapping, cache_format=MX, backend="reference")
    md, sel = run_step(sc, backend, k=False)
    assert md.decode.uniform and decode_batch(md) < 5
    check_topk(sel, sc.model_scores(), lim.topk)


def test_the_same_step_as_the_reference(backend):
    lim = limits(next_n=2)
    sc = MxScenario([60, 200, 43], [2, 1, 40], lim=lim, seed=11)
    kv0 = sc.kv.clone()
    _, got = run_step(sc, backend)
    kv_got, sc.kv = sc.kv, kv0
    _, want = run_step(sc, "reference")
    assert torch.equal(kv_got, sc.kv), "the MXFP4 cache write differs from the reference's"
    assert torch.equal(got.sort(1).values, want.sort(1).values)


@pytest.mark.parametrize("bad", ["no_q_scale", "fp8_queries", "fp8_buffers", "q_scale_shape", "scale_on_fp8",
                                 "fp8_cache_width"])
def test_bad_mxfp4_arguments_write_nothing(bad):
    lim = limits()
    sc = MxScenario([40, 100], [1, 30], lim=lim, seed=3)
    md = sc.metadata()
    buf = allocate(lim)
    q, qs, kv = sc.q, sc.q_scale, sc.kv
    exc = ValueError
    if bad == "no_q_scale":
        qs = None
    elif bad == "fp8_queries":
        q, exc = torch.zeros(q.shape[0], 16, 64, dtype=torch.float8_e4m3fn), TypeError
    elif bad == "fp8_buffers":
        buf, exc = allocate(limits(cache_format=None)), TypeError
    elif bad == "q_scale_shape":
        qs = qs[:, :, :1].contiguous()
    elif bad == "scale_on_fp8":
        md = si.build_metadata(sc.seq, sc.qry, sc.block_table, sc.slot_mapping, limits(cache_format=None))
    elif bad == "fp8_cache_width":
        kv = si.new_kv_cache(kv.shape[0], 16, 64)
    before = kv.clone()
    topk_out = torch.full((md.num_tokens, lim.topk), 7, dtype=torch.int32)
    with pytest.raises(exc):
        si.sparse_attn_indexer(q, sc.k, sc.w, kv, md, buf, topk_out, q_scale=qs, backend="reference")
    assert torch.equal(kv, before) and bool((topk_out == 7).all())


def test_named_fp8_only_backends_refuse_mxfp4_before_writing():
    lim = limits()
    sc = MxScenario([40], [1], lim=lim, seed=4)
    md, buf = sc.metadata(), allocate(lim)
    topk_out = torch.full((1, lim.topk), 7, dtype=torch.int32)
    before = sc.kv.clone()
    with pytest.raises(si.BackendUnavailable):
        si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, buf, topk_out, q_scale=sc.q_scale, backend="aiter")
    assert torch.equal(sc.kv, before) and bool((topk_out == 7).all())
