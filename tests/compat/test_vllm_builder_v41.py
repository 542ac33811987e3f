"""The vLLM shim on DeepSeek-V4.1's two-level ("candidate block") indexer, with metadata from vLLM 0.33's own
``DeepseekV32IndexerMetadataBuilder.build()`` for V4.1's indexer caches (``MLAAttentionSpec(tokens_per_state=C)``,
C = 1 and 2, 64-token pages).

The op runs as V4.1's index layers call it: the compressor has written every key of the step (``k=None``,
``skip_k_cache_insert=True``), ``compress_ratio=C``, lengths ``// C``, and on the candidate source layer and the
index layers after it ``candidate_blocks=<the model's [max_num_batched_tokens, K_b] int32 buffer>``,
``candidate_block_size=8``, ``candidate_write=(layer is the source)``. One model holds both ratios: index layers
without candidates (before the source), and for each ratio a source and two consumers (V4.1 ships one source, at
ratio 1; the ratio-2 source here has its own buffer), each layer with its own queries and weights over its
group's cache, the layers of the ratios interleaved. Every layer is checked against a float64 model of its
scores (``tests/compat/vllm_batches.py:model_logits``): a dense layer's and a source's top-k with
``assert_topk(threshold=True)``, a source's candidates with ``candidate_errors``, a consumer's top-k with
``candidate_topk_errors`` given the candidates the source wrote, and each against our own path
(``build_metadata`` + ``sparse_attn_indexer(candidates=...)``). ``K_b = 65`` blocks of 8 keys (``(65 - 1) * 8 + 1
>= topk = 512``) and contexts of up to 5000 keys, so the consumers' selection is really restricted.

Own process (tests/run.sh): ``TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=1``
(tests/compat/vllm_builder.py says why). Skipped elsewhere and where vLLM is not installed.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.compat.vllm_builder import env_problem

if env_problem():
    pytest.skip(env_problem(), allow_module_level=True)
pytest.importorskip("vllm.v1.attention.backends.mla.indexer")
ws = pytest.importorskip("vllm.v1.worker.workspace")

from vllm.forward_context import set_forward_context  # noqa: E402

import sparse_indexer as si  # noqa: E402
from sparse_indexer.compat import vllm as shim  # noqa: E402
from sparse_indexer.compat.vllm import VllmIndexer  # noqa: E402
from sparse_indexer.testing import assert_topk, candidate_errors, candidate_topk_errors, topk_errors  # noqa: E402
from tests.compat.test_vllm_builder_v4 import check_layout  # noqa: E402
from tests.compat.vllm_batches import SEVEN, make_batch, model_logits, run_ours, same_rows, vllm_metadata  # noqa: E402
from tests.compat.vllm_builder import Engine  # noqa: E402

# V4.1-like: 32 heads, top-512, 64-token pages (SM90's), next_n 2; 65 candidate blocks of 8 keys
V41 = dict(max_model_len=8192, block_size=64, max_num_seqs=8, max_num_batched_tokens=256, n_heads=32, head_dim=128,
           topk=512)
K_B, B_C = 65, 8
# a small engine for the Triton interpreter and the argument errors: 3 blocks of 8 keys, top-16
SMALL = dict(max_model_len=512, block_size=16, max_num_seqs=8, max_num_batched_tokens=64, n_heads=8, head_dim=64,
             topk=16)
K_B_SMALL = 3
# the K-cache layer of each ratio's group (the prefix its index layers pass; its key in the forward context)
GROUP = {1: "model.layers.1.self_attn.indexer.k_cache", 2: "model.layers.0.self_attn.indexer.k_cache"}

# the model's index layers in order: (C, candidate buffer or None, candidate source)
LAYERS = (
    (2, None, False),  # index layers before the candidate source: no candidates
    (1, None, False),
    (1, "a", True),  # V4.1's source (ratio 1)
    (2, "b", True),  # a ratio-2 source with a buffer of its own
    (1, "a", False),
    (2, "b", False),
    (1, "a", False),
    (2, "b", False),
)

# name: (seq_lens in tokens, query_lens, padding requests, padding tokens, extra query rows, layout of the decode)
STEPS = {
    # two native [B, 2] decodes, then prefill chunks (by the 1 MiB logits budget): a one-token request (no key at
    # C = 2: its rows all -1), a request whose windows are 581..700 keys at C = 1 (around K_b * b = 520) and
    # 290..350 at C = 2 (every block a candidate)
    "decode_and_prefill": ([3001, 2200, 1, 5000, 1800, 700], [2, 2, 1, 40, 24, 120], 0, 0, 0, "native [B, 2]"),
    # a FULL CUDA graph's padded decode (requires_padding: the packed path, cand_pack), a request of 5 tokens
    "padded_decode": ([3001, 5, 4200], [2, 2, 2], 1, 2, 2, "padded"),
    # one token per request at next_n 2
    "one_token_decodes": ([3001, 2200, 5000, 1800], [1, 1, 1, 1], 0, 0, 0, "native [B, 1]"),
}

_ENGINES: dict = {}


def engine(cr: int, cfg: dict = V41, next_n: int = 2) -> Engine:
    key = (cr, tuple(cfg.items()), next_n)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(next_n, compress_ratio=cr, v41=True, layer=GROUP[cr], **cfg)
    return _ENGINES[key]


def layer_inputs(rows: int, lim, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's queries ``[rows, H, D]`` FP8 and folded weights ``[rows, H]`` float32."""
    g = torch.Generator().manual_seed(seed)
    h, d = lim.n_heads, lim.head_dim
    q, qs = si.quantize_q(torch.randn(rows, h, d, generator=g), fp8_dtype=lim.fp8_dtype)
    return q, (torch.randn(rows, h, generator=g) * h**-0.5 * d**-0.5 * qs).float()


def op_args(eng, batch, q, w, out, cand=None, cand_size=B_C, write=False):
    """The op's arguments as a V4.1 index layer passes them (keys already in the cache)."""
    lim = eng.limits
    return ((torch.zeros(q.shape[0], 16), eng.layer, batch.kv, q, None, w, lim.head_dim, "ue8m0", lim.topk,
             lim.head_dim, eng.op_max_model_len, eng.op_total_seq_lens, out, True, eng.compress_ratio),
            {"candidate_blocks": cand, "candidate_block_size": cand_size, "candidate_write": write})


class Model:
    """The layers of :data:`LAYERS` (or ``layers``) over one step: each ratio's engine, batch (cache, keys) and
    vLLM metadata; each layer's queries, weights and top-k buffer; a candidate buffer per name."""

    def __init__(self, seq, qry, *, cfg=V41, kb=K_B, pad_reqs=0, pad_tokens=0, extra=0, layers=LAYERS, seed=0,
                 vllm_md=None):
        self.layers, self.kb = layers, kb
        self.engs = {cr: engine(cr, cfg) for cr in {c for c, _, _ in layers}}
        self.batches, self.vmds = {}, {}
        for cr, eng in self.engs.items():
            b = make_batch(seq, qry, eng.limits, seed=seed + cr, extra_rows=extra, prewritten=True)
            self.batches[cr] = b
            self.vmds[cr] = eng.build(b, pad_reqs=pad_reqs, pad_tokens=pad_tokens) if vllm_md is None else vllm_md(b)
        any_eng = next(iter(self.engs.values()))
        rows, t_max = next(iter(self.batches.values())).q_fp8.shape[0], any_eng.limits.max_num_batched_tokens
        self.rows, self.n = rows, sum(qry)
        self.inputs = [layer_inputs(rows, self.engs[cr].limits, 100 * seed + i) for i, (cr, _, _) in enumerate(layers)]
        self.outs = [torch.full((t_max, any_eng.limits.topk), SEVEN, dtype=torch.int32) for _ in layers]
        self.cands = {name: torch.full((t_max, kb), SEVEN, dtype=torch.int32) for _, name, _ in layers if name}
        self.kv0 = {cr: b.kv.clone() for cr, b in self.batches.items()}
        self.vllm_config = any_eng.vllm_config

    def call(self, op, i: int):
        cr, name, write = self.layers[i]
        q, w = self.inputs[i]
        args, kw = op_args(self.engs[cr], self.batches[cr], q, w, self.outs[i],
                           None if name is None else self.cands[name], write=write)
        return op(*args, **kw)

    def run(self, op) -> None:
        """A profiling run of every layer, ``lock_workspace()``, then the step through every layer."""
        with set_forward_context(None, self.vllm_config):
            for i in range(len(self.layers)):
                self.call(op, i)
        ws.lock_workspace()
        ctx = {self.engs[cr].layer: self.vmds[cr] for cr in self.engs}
        with set_forward_context(ctx, self.vllm_config):
            for i in range(len(self.layers)):
                assert self.call(op, i) is self.outs[i]

    def limits(self, i: int):
        cr, name, _ = self.layers[i]
        eng = self.engs[cr]
        return eng.limits if name is None else eng.candidate_limits(self.kb, B_C)


def check_layers(m: Model, backend: str, rtol: float = 1e-5, ours: bool = True) -> dict:
    """Every layer of ``m`` against the float64 model and (``ours``) our own path; returns per consumer layer the
    number of its rows whose selection is no unrestricted top-k."""
    n, rows = m.n, m.rows
    restricted = {}
    for i, (cr, name, write) in enumerate(m.layers):
        batch, lim = m.batches[cr], m.limits(i)
        q, w = m.inputs[i]
        logits, ends = model_logits(batch, q, w)
        starts = torch.zeros_like(ends)
        out = m.outs[i]
        what = f"layer {i} (C={cr}, {'source' if write else 'consumer' if name else 'dense'})"
        assert bool((out[n:rows] == -1).all()), f"{what}: padding rows are not -1"
        assert bool((out[rows:] == SEVEN).all()), f"{what}: rows past the step's were written"
        if name is None or write:
            assert_topk(out[:n], logits, starts, ends, rtol=rtol, threshold=True)
        if name is None:
            if ours:
                expected, _ = run_ours(batch, lim, backend=backend, q_fp8=q, weights=w)
                assert same_rows(out, expected), f"{what}: differs from build_metadata + sparse_attn_indexer"
            continue
        cand = m.cands[name]
        if write:
            errors = candidate_errors(cand[:n], logits, starts, ends, B_C, rtol=rtol, limit=3)
            assert not errors, f"{what}: {errors}"
            assert bool((cand[n:rows] == -1).all()), f"{what}: candidate rows of padding tokens are not -1"
            assert bool((cand[rows:] == SEVEN).all()), f"{what}: candidate rows past the step's were written"
            if ours:
                mine = torch.full_like(cand, SEVEN)
                expected, _ = run_ours(batch, lim, backend=backend, q_fp8=q, weights=w, candidates=mine,
                                       write_candidates=True)
                assert same_rows(cand, mine), f"{what}: candidates differ from build_metadata + sparse_attn_indexer"
        else:
            errors = candidate_topk_errors(out[:n], logits, starts, ends, cand[:n], B_C, rtol=rtol, limit=3)
            assert not errors, f"{what}: {errors}"
            restricted[i] = len(topk_errors(out[:n], logits, starts, ends, rtol=rtol, threshold=True))
            if ours:
                expected, _ = run_ours(batch, lim, backend=backend, q_fp8=q, weights=w, candidates=cand.clone())
        if ours:
            assert same_rows(out, expected), f"{what}: differs from build_metadata + sparse_attn_indexer"
        assert torch.equal(batch.kv, m.kv0[cr]), f"{what}: k=None must write nothing"
    return restricted


@pytest.mark.parametrize("name", list(STEPS))
def test_v41_model_on_vllm_builder(name, manager, monkeypatch, backend):
    """One V4.1-like model (ratios 1 and 2, dense layers, a source and two consumers per ratio) through one
    drop-in: one plan per (ratio, candidate configuration), the profiling run reserving the largest (a candidate
    plan, its block_scores and cand_pack included), one conversion per (metadata object, limits), every layer
    right against the float64 model, the consumers' selection really restricted."""
    seq, qry, pad_reqs, pad_tokens, extra, expect = STEPS[name]
    m = Model(seq, qry, pad_reqs=pad_reqs, pad_tokens=pad_tokens, extra=extra, seed=len(name))
    for cr in (1, 2):
        check_layout(m.vmds[cr], expect, m.engs[cr], m.batches[cr])
    op = VllmIndexer.from_vllm_config(m.vllm_config, backend=backend)
    calls = []
    real = shim.metadata_from_vllm
    monkeypatch.setattr(shim, "metadata_from_vllm", lambda md, lim: (calls.append((id(md), id(lim))), real(md, lim))[1])
    m.run(op)

    plans = {(p.limits.compress_ratio, p.limits.candidate_blocks): p for _, p in op._memo["limits"].values()}
    assert len(op._memo["limits"]) == 4 and sorted(plans) == [(1, 0), (1, K_B), (2, 0), (2, K_B)]
    for i, (cr, cand, _) in enumerate(LAYERS):  # the limits a layer's arguments give are the engine's
        assert plans[cr, K_B if cand else 0].limits == m.limits(i)
    for p in plans.values():
        names = {f.name for f in p.fields}
        assert ({"block_scores", "cand_pack"} <= names) == bool(p.limits.candidate_blocks)
    largest = max(plans.values(), key=lambda p: p.total_bytes)
    assert largest.limits.candidate_blocks == K_B and shim.held_bytes(manager) == largest.total_bytes
    assert len(calls) == len(set(calls)) == 4, "one conversion per (metadata object, limits)"

    # the padded decode takes the packed path (cand_pack), the others token rows directly
    for cr in (1, 2):
        assert real(m.vmds[cr], m.engs[cr].limits).decode.uniform == (name != "padded_decode")
    restricted = check_layers(m, backend)
    assert all(v > 0 for v in restricted.values()), f"consumer rows never restricted: {restricted}"


def test_v41_padded_decode_with_prefill_keeps_token_rows(manager, backend):
    """The layout where vLLM's own op loses candidates: a padded decode grid (decode lengths 2, 1, 2 at next_n
    2: ``requires_padding``, 5 tokens in a [3, 2] grid) in a step with prefill tokens (from row 5). vLLM writes
    the decode's candidate rows in grid order, ``[:6]``, after the prefill chunk's, so row 5 (the first prefill
    token's) would hold a decode slot's candidates. Here every row is its token's: the first prefill token's row
    holds the candidates of its own window, which the consumers read. (vLLM 0.33's builder never sends this
    layout; the namespace has its field names, ``vllm_batches.vllm_metadata``.)"""
    seq, qry = [3001, 2200, 1800, 900], [2, 1, 2, 30]
    layers = ((1, "a", True), (1, "a", False), (1, "a", False))
    m = Model(seq, qry, layers=layers, seed=5, vllm_md=lambda b: vllm_metadata(b, 2))
    vmd = m.vmds[1]
    assert vmd.decode.requires_padding and vmd.num_decode_tokens == 5 and vmd.decode.seq_lens.shape == (3, 2)
    assert vmd.prefill.chunks[0].token_start == 5
    op = VllmIndexer.from_vllm_config(m.vllm_config, backend=backend)
    m.run(op)
    restricted = check_layers(m, backend)
    assert all(v > 0 for v in restricted.values())
    # row 5 is the first prefill token's: its newest block is that of its window (871 keys), not a decode's
    assert int(m.cands["a"][5].max()) == (900 - 30 + 1 - 1) // B_C


def test_v41_triton_interpreter(manager):
    """The Triton backend (in Triton's interpreter) on a small model of both ratios: a source and a consumer
    each, decodes and prefills in one step, windows longer than K_b * b = 24 keys. Against the float64 model only
    (the interpreter is slow; the reference cases compare the shim with our own path)."""
    layers = ((1, "a", True), (2, "b", True), (1, "a", False), (2, "b", False))
    m = Model([160, 67, 250, 90], [2, 2, 2, 30], cfg=SMALL, kb=K_B_SMALL, layers=layers, seed=3)
    op = VllmIndexer.from_vllm_config(m.vllm_config, backend="triton")
    m.run(op)
    restricted = check_layers(m, "triton", ours=False)
    assert all(v > 0 for v in restricted.values())


def _small_call(op, m, i, **kw):
    cr, name, write = m.layers[i]
    q, w = m.inputs[i]
    args, ckw = op_args(m.engs[cr], m.batches[cr], q, w, m.outs[i], None if name is None else m.cands[name],
                        write=write)
    return op(*args, **{**ckw, **kw})


@pytest.mark.parametrize("profiling", [True, False])
def test_v41_bad_candidate_arguments(manager, profiling):
    """Bad candidate arguments raise a ValueError (TypeError for a wrong dtype) naming them, in the profiling run
    and in a step, and nothing is written: not the top-k rows, not the candidate buffer, not the cache."""
    layers = ((1, "a", True),)
    m = Model([160, 67, 90], [2, 2, 30], cfg=SMALL, kb=K_B_SMALL, layers=layers, seed=4)
    eng = m.engs[1]
    op = VllmIndexer.from_vllm_config(m.vllm_config, backend="reference")
    ctx = None if profiling else {eng.layer: m.vmds[1]}
    t_max = eng.limits.max_num_batched_tokens
    cand = m.cands["a"]
    bad = {
        "candidate_block_size": ({"candidate_block_size": 0}, ValueError),
        "candidate_block_size=True": ({"candidate_block_size": True}, ValueError),
        "candidate_write=True needs candidate_blocks": ({"candidate_blocks": None, "candidate_write": True},
                                                        ValueError),
        "must be a \\[max_num_batched_tokens, K_b": ({"candidate_blocks": cand[:, 0]}, ValueError),
        # 2 blocks of 8 keys cannot hold the top-16
        "cannot hold topk": ({"candidate_blocks": torch.full((t_max, 2), SEVEN, dtype=torch.int32)}, ValueError),
    }
    if not profiling:  # the step's own checks
        bad.update({
            "int32": ({"candidate_blocks": torch.full((t_max, K_B_SMALL), SEVEN, dtype=torch.int64)},
                      (TypeError, ValueError)),
            "rows of q_fp8": ({"candidate_blocks": cand[:10]}, ValueError),
            # the top-k buffer's bytes (contiguous): the source would write over its own output
            "topk_out": ({"candidate_blocks": m.outs[0].view(-1)[: t_max * K_B_SMALL].view(t_max, K_B_SMALL)},
                         ValueError),
        })
    kv = m.batches[1].kv.clone()
    with set_forward_context(None, m.vllm_config):  # a good profiling run: reserves
        _small_call(op, m, 0)
    ws.lock_workspace()
    assert bool((cand == SEVEN).all()) and bool((m.outs[0] == SEVEN).all())
    with set_forward_context(ctx, m.vllm_config):
        for match, (kw, exc) in bad.items():
            with pytest.raises(exc, match=match):
                _small_call(op, m, 0, **kw)
            assert bool((m.outs[0] == SEVEN).all()), f"{match}: top-k rows written"
            assert bool((cand == SEVEN).all()), f"{match}: candidate rows written"
            assert torch.equal(m.batches[1].kv, kv)


def test_mutates_args_are_vllms():
    """MUTATES_ARGS are the arguments vLLM 0.33 registers its indexer ops as writing (``vllm::sparse_attn_indexer``
    is registered on every platform; the ROCm op, the one the drop-in replaces, lists the same names), and the
    drop-in's __call__ and fake take the ROCm op's argument list."""
    pytest.importorskip("vllm.model_executor.layers.sparse_attn_indexer")
    from vllm.v1.attention.ops import rocm_aiter_mla_sparse as rocm

    schema = torch.ops.vllm.sparse_attn_indexer.default._schema
    written = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
    assert written == shim.MUTATES_ARGS
    want = list(inspect.signature(rocm.rocm_aiter_sparse_attn_indexer).parameters)
    assert list(inspect.signature(rocm.rocm_aiter_sparse_attn_indexer_fake).parameters) == want
    op = VllmIndexer(max_num_seqs=8)
    assert list(inspect.signature(op.__call__).parameters) == want
    assert list(inspect.signature(op.fake).parameters) == want
    assert set(shim.MUTATES_ARGS) <= set(want)
