"""End-to-end tests of ``sparse_attn_indexer`` against an independent dense float64 model of the whole step.

The model never reads the paged cache: it keeps every request's full key history as unquantized rows,
quantizes them itself (docs/spec.md §3, in float64), scores causally in float64 (§5) and ranks (§6).
"""

from __future__ import annotations

import math

import pytest
import torch

import sparse_indexer as si
from buffers import BufferTooSmall, IndexerLimits, allocate
from sparse_indexer.testing import assert_topk

FN = torch.float8_e4m3fn


def q64_keys(k: torch.Tensor, qmax: float = 448.0):
    """float64 dequantized keys and their ue8m0 scales, from docs/spec.md §3 directly."""
    k = k.double()
    amax = k.abs().amax(-1).clamp(min=1e-4)
    scale = torch.tensor([2.0 ** math.ceil(math.log2(a / qmax)) for a in amax.tolist()], dtype=torch.float64)
    vals = (k / scale[:, None]).clamp(-qmax, qmax).float().to(FN).double()
    return vals, scale


class Scenario:
    """Requests with key histories, a paged cache holding the history before this step, one step's tokens."""

    def __init__(self, seq_lens, query_lens, *, lim: IndexerLimits, seed=0, num_blocks=None, layout_seed=None):
        g = torch.Generator().manual_seed(seed)
        gl = torch.Generator().manual_seed(seed if layout_seed is None else layout_seed)
        self.lim = lim
        h, d, bs = lim.n_heads, lim.head_dim, lim.block_size
        self.seq, self.qry = list(seq_lens), list(query_lens)
        n_req = len(self.seq)
        max_blocks = max(1, max((s + bs - 1) // bs for s in self.seq))
        need = sum((s + bs - 1) // bs for s in self.seq)
        nb = num_blocks or need + 3
        perm = torch.randperm(nb, generator=gl)[:need].int()
        self.block_table = torch.full((n_req, max_blocks), 10**6, dtype=torch.int32)  # poison unused entries
        o = 0
        for r, s in enumerate(self.seq):
            nbk = (s + bs - 1) // bs
            self.block_table[r, :nbk] = perm[o : o + nbk]
            o += nbk
        self.kv = si.new_kv_cache(nb, bs, d, block_pad=4 * (seed % 3), four_d=seed % 2 == 1)
        self.keys = [torch.randn(s, d, generator=g).to(torch.bfloat16) for s in self.seq]
        # history (positions before this step's tokens) goes into the cache first
        for r, (s, q) in enumerate(zip(self.seq, self.qry)):
            if s - q > 0:
                pos = torch.arange(s - q)[None, :]
                slots = si.slots_from_block_table(self.block_table[r : r + 1], pos, bs)[0]
                si.write_k_cache(self.keys[r][: s - q], self.kv, slots, backend="reference")
        t = sum(self.qry)
        self.q = (torch.randn(t, h, d, generator=g) * 2).to(FN)
        self.w = torch.randn(t, h, generator=g) / math.sqrt(h * d)
        new_k, slots = [], []
        for r, (s, q) in enumerate(zip(self.seq, self.qry)):
            pad = max(0, q - s)  # padding requests (context 0) have tokens without keys: slot -1
            new_k.append(torch.cat([torch.zeros(pad, d, dtype=torch.bfloat16), self.keys[r][max(0, s - q) :]]))
            pos = torch.arange(s - q, s)[None, :]
            slots.append(si.slots_from_block_table(self.block_table[r : r + 1], pos, bs)[0])
        self.k = torch.cat(new_k) if new_k else torch.empty(0, d, dtype=torch.bfloat16)
        self.slot_mapping = torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)

    def metadata(self):
        return si.build_metadata(self.seq, self.qry, self.block_table, self.slot_mapping, self.lim,
                                 num_blocks=self.kv.shape[0])

    def model_scores(self):
        """Per token: (float64 scores of its window,) in token order."""
        out = []
        t = 0
        for r, (s, q) in enumerate(zip(self.seq, self.qry)):
            kv, ks = q64_keys(self.keys[r]) if s else (torch.zeros(0, self.lim.head_dim).double(), None)
            for j in range(q):
                lim = max(0, s - q + j + 1)
                qq = self.q[t].double()  # [H, D]
                sc = (qq @ kv[:lim].T).clamp(min=0)  # [H, lim]
                out.append((self.w[t].double() @ sc) * ks[:lim] if lim else torch.zeros(0, dtype=torch.float64))
                t += 1
        return out


def check_topk(sel: torch.Tensor, scores: list[torch.Tensor], topk: int):
    """Every row of ``sel`` is a top-k of its float64 model scores: short rows exact; long rows distinct in-window
    positions, each selected score within 1e-5 x max|score| of the ``topk``-th best."""
    assert sel.shape == (len(scores), topk), (tuple(sel.shape), len(scores), topk)
    assert_topk(sel, scores, rtol=1e-5, threshold=True)


def run_step(sc: Scenario, backend="reference", lim_buffers=None, extra_rows=3):
    md = sc.metadata()
    buf = allocate(lim_buffers or sc.lim)
    t = md.num_tokens
    topk_out = torch.full((t + extra_rows, sc.lim.topk), 7, dtype=torch.int32)
    si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, buf, topk_out, backend=backend)
    assert bool((topk_out[t:] == 7).all()), "rows beyond the step's tokens were written"
    return md, topk_out[:t]


def limits(**kw):
    base = dict(max_model_len=512, max_num_batched_tokens=1024, max_num_seqs=8, n_heads=32, head_dim=64,
                topk=32, block_size=16)
    base.update(kw)
    return IndexerLimits(**base)


@pytest.mark.parametrize("bs", [1, 16, 64])
def test_mixed_decode_and_prefill(backend, bs):
    lim = limits(block_size=bs, next_n=1)
    sc = Scenario([40, 7, 1, 100, 65], [1, 1, 1, 30, 65], lim=lim, seed=bs)
    md, sel = run_step(sc, backend)
    assert (md.num_decodes, md.num_prefills) == (3, 2)
    check_topk(sel, sc.model_scores(), lim.topk)


def test_several_prefill_chunks(backend):
    lim = limits(prefill_k_tokens=512, max_logits_bytes=4 * 3000)
    sc = Scenario([50, 60, 70, 20], [20, 30, 40, 10], lim=lim, seed=3)
    md, sel = run_step(sc, backend)
    assert len(md.prefill_chunks) >= 3
    check_topk(sel, sc.model_scores(), lim.topk)


def test_long_request_split_along_queries(backend):
    lim = limits(max_logits_bytes=4 * 1000)
    sc = Scenario([300, 40], [200, 40], lim=lim, seed=4)
    md, sel = run_step(sc, backend)
    pieces = [c for c in md.prefill_chunks if c.num_k_tokens == 300]
    assert len(pieces) > 1 and pieces[0].gather and not any(c.gather for c in pieces[1:])
    check_topk(sel, sc.model_scores(), lim.topk)


@pytest.mark.parametrize("next_n", [2, 3])
def test_nonuniform_decode(backend, next_n):
    lim = limits(next_n=next_n)
    qry = [next_n, 1, next_n - 1, 0, 2, 45]
    sc = Scenario([90, 33, 64, 0, 2, 80], qry, lim=lim, seed=next_n)
    md, sel = run_step(sc, backend)
    assert md.decode is not None and not md.decode.uniform
    check_topk(sel, sc.model_scores(), lim.topk)


def test_uniform_decode_next_n2_context_below_topk(backend):
    lim = limits(next_n=2, topk=64)
    sc = Scenario([10, 100, 2, 64], [2, 2, 2, 2], lim=lim, seed=5)
    md, sel = run_step(sc, backend)
    assert md.decode.uniform
    check_topk(sel, sc.model_scores(), lim.topk)


def test_step_too_big_for_buffers_writes_nothing(backend):
    lim = limits()
    sc = Scenario([200, 200], [150, 150], lim=lim, seed=6)
    small = limits(prefill_k_tokens=512, max_logits_bytes=4 * 100, max_model_len=64, max_num_seqs=1,
                   max_num_batched_tokens=8)
    md = sc.metadata()
    buf = allocate(small)
    kv_before = sc.kv.clone()
    topk_out = torch.full((md.num_tokens, lim.topk), 7, dtype=torch.int32)
    with pytest.raises(BufferTooSmall) as e:
        si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, buf, topk_out, backend=backend)
    assert e.value.field in ("k_fp8", "logits")  # the plan of `small` holds neither the keys nor the logits
    assert torch.equal(sc.kv, kv_before) and bool((topk_out == 7).all())


def test_several_layers_share_metadata(backend):
    lim = limits(next_n=1)
    # same request layout (block table, slots), different layer data: each layer has its own cache and keys
    scs = [Scenario([30, 90], [1, 50], lim=lim, seed=10 + i, layout_seed=10) for i in range(2)]
    md = scs[0].metadata()
    buf = allocate(lim)
    for sc in scs:
        topk_out = torch.empty(md.num_tokens, lim.topk, dtype=torch.int32)
        si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, buf, topk_out, backend=backend)
        check_topk(topk_out, sc.model_scores(), lim.topk)


def test_metadata_rejects_decode_after_prefill():
    lim = limits()
    with pytest.raises(ValueError, match="decode first"):
        si.build_metadata([20, 5], [10, 1], torch.zeros(2, 4, dtype=torch.int32),
                          torch.zeros(11, dtype=torch.int64), lim)


def test_padded_batch_rows_get_minus_one(backend):
    """A CUDA-graph padded batch: q has rows beyond the step's tokens; their top-k rows become -1, rows past
    q's length stay untouched."""
    lim = limits(next_n=1)
    sc = Scenario([40, 90], [1, 30], lim=lim, seed=12)
    md = sc.metadata()
    t, pad = md.num_tokens, 3
    q = torch.cat([sc.q, sc.q[:pad]])
    w = torch.cat([sc.w, sc.w[:pad]])
    k = torch.cat([sc.k, sc.k[:pad]])
    topk_out = torch.full((t + pad + 2, lim.topk), 7, dtype=torch.int32)
    si.sparse_attn_indexer(q, k, w, sc.kv, md, allocate(lim), topk_out, backend=backend)
    check_topk(topk_out[:t], sc.model_scores(), lim.topk)
    assert bool((topk_out[t : t + pad] == -1).all())
    assert bool((topk_out[t + pad :] == 7).all())


def test_step_with_qk_buffer(backend):
    """A record planned with the per-head ``qk`` scratch (aiter stage1) runs the same step; backends that don't
    need it ignore it, and a qk view of the wrong shape is refused by name."""
    lim = limits(next_n=2, with_qk=True)
    sc = Scenario([60, 33, 80], [2, 2, 40], lim=lim, seed=13)
    md, sel = run_step(sc, backend)
    check_topk(sel, sc.model_scores(), lim.topk)
    b = md.decode.num_reqs
    q = sc.q[: 2 * b].view(b, 2, lim.n_heads, lim.head_dim)
    w = sc.w[: 2 * b]
    out = torch.empty(2 * b, 128)
    with pytest.raises(ValueError, match="qk"):
        si.fp8_paged_mqa_logits(q, sc.kv, w, md.decode.context_lens, md.decode.block_table, out=out,
                                qk=torch.empty(lim.n_heads, 2 * b, 127), backend=backend)
    qk = torch.empty(lim.n_heads, 2 * b, 128)
    want = si.fp8_paged_mqa_logits(q, sc.kv, w, md.decode.context_lens, md.decode.block_table,
                                   out=torch.empty(2 * b, 128), backend=backend)
    si.fp8_paged_mqa_logits(q, sc.kv, w, md.decode.context_lens, md.decode.block_table, out=out, qk=qk,
                            backend=backend)
    assert torch.equal(out, want)


def _expect_nothing_written(sc, md, buf, topk_out, exc, match, backend, given_out=None):
    """The step raises ``exc`` and leaves the cache and ``topk_out`` as they were (``given_out`` replaces
    ``topk_out`` in the call)."""
    kv_before, out_before = sc.kv.clone(), topk_out.clone()
    with pytest.raises(exc, match=match):
        si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, buf, topk_out if given_out is None else given_out,
                               backend=backend)
    assert torch.equal(sc.kv, kv_before) and torch.equal(topk_out, out_before)


def test_step_refuses_bad_ids_and_layouts_before_writing(backend):
    lim = limits(next_n=1)
    sc = Scenario([40, 90], [1, 30], lim=lim, seed=14)
    md = sc.metadata()  # checked against sc.kv's block count
    buf = allocate(lim)
    out = torch.full((md.num_tokens, lim.topk), 7, dtype=torch.int32)
    # a smaller cache than the metadata was checked against
    small = Scenario([40, 90], [1, 30], lim=lim, seed=14, num_blocks=12)
    small.kv = small.kv[:3]
    _expect_nothing_written(small, md, buf, out, ValueError, "blocks", backend)
    # unchecked metadata (no num_blocks) with a block id beyond a CPU cache
    bt = sc.block_table.clone()
    bt[1, 0] = sc.kv.shape[0] + 5
    md_bad = si.build_metadata(sc.seq, sc.qry, bt, sc.slot_mapping, lim)
    _expect_nothing_written(sc, md_bad, buf, out, ValueError, "block_table", backend)
    # topk_out overlapping the buffers, or with the wrong number of columns
    alias = buf.logits[: md.num_tokens * lim.topk].view(torch.int32).view(md.num_tokens, lim.topk)
    _expect_nothing_written(sc, md, buf, out, ValueError, "topk_out", backend, given_out=alias)
    _expect_nothing_written(sc, md, buf, out, ValueError, "topk", backend,
                            given_out=torch.zeros(md.num_tokens, lim.topk + 1, dtype=torch.int32))


def test_zero_token_decode_requests_have_no_rows(backend):
    lim = limits(next_n=1)
    sc = Scenario([40, 25, 90], [1, 0, 30], lim=lim, seed=15)
    md, sel = run_step(sc, backend)
    assert md.decode.num_reqs == 1 and md.decode.uniform
    check_topk(sel, sc.model_scores(), lim.topk)


def test_metadata_argument_types():
    lim = limits()
    bt = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(TypeError, match="slot_mapping"):
        si.build_metadata([20], [10], bt, torch.zeros(10), lim)
    with pytest.raises(TypeError, match="block_table"):
        si.build_metadata([20], [10], bt.long(), torch.zeros(10, dtype=torch.int64), lim)


def test_k_none_skips_the_cache_write(backend):
    """``k=None``: the cache already holds the step's keys (an engine that inserts them itself)."""
    lim = limits(next_n=1)
    sc = Scenario([40, 90], [1, 30], lim=lim, seed=16)
    md = sc.metadata()
    si.write_k_cache(sc.k, sc.kv, md.slot_mapping, backend=backend)
    kv_before = sc.kv.clone()
    topk_out = torch.empty(md.num_tokens, lim.topk, dtype=torch.int32)
    si.sparse_attn_indexer(sc.q, None, sc.w, sc.kv, md, allocate(lim), topk_out, backend=backend)
    assert torch.equal(sc.kv, kv_before)
    check_topk(topk_out, sc.model_scores(), lim.topk)


def test_step_refuses_a_backend_that_cannot_run_it_before_writing():
    """An explicit backend that is unavailable here, or that lacks one of the step's ops, raises
    BackendUnavailable before the padding fill, the cache write or any op (docs/spec.md §10)."""
    from sparse_indexer import backends

    lim = limits(next_n=1)
    sc = Scenario([40, 90], [1, 30], lim=lim, seed=17)
    md = sc.metadata()
    buf = allocate(lim)
    out = torch.full((md.num_tokens + 4, lim.topk), 7, dtype=torch.int32)  # padded: rows [n, T) would get -1
    q = torch.cat([sc.q, sc.q[:4]])
    w = torch.cat([sc.w, sc.w[:4]])
    kv_before, out_before = sc.kv.clone(), out.clone()
    with pytest.raises(si.BackendUnavailable, match="aiter"):  # no aiter on the CPU
        si.sparse_attn_indexer(q, None, w, sc.kv, md, buf, out, backend="aiter")
    assert torch.equal(out, out_before)
    # a backend that runs here but implements top-k only
    backends.register(backends.Backend(name="topk_only", unavailable_reason=lambda dev: None,
                                       ops=("top_k_per_row",), module="sparse_indexer.ops.{op}.reference"))
    try:
        for k in (sc.k, None):
            with pytest.raises(si.BackendUnavailable, match="does not implement"):
                si.sparse_attn_indexer(q, k, w, sc.kv, md, buf, out, backend="topk_only")
            assert torch.equal(out, out_before) and torch.equal(sc.kv, kv_before)
    finally:
        backends.unregister("topk_only")
