"""The vLLM shim on metadata from vLLM 0.33's own ``DeepseekV32IndexerMetadataBuilder.build()``.

Every case runs the drop-in op (:class:`VllmIndexer`) as vLLM calls it: vLLM's forward context holds the
builder's metadata, buffers come from vLLM's workspace manager, ``hidden_states`` has the step's query rows. The
top-k must match the float64 model (tests/compat/vllm_batches.py) and our own path (``build_metadata`` +
``sparse_attn_indexer`` from the real lengths) on the same inputs; padding rows are -1 and rows beyond the query
rows untouched.

Own process (tests/run.sh): ``TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=1``
(tests/compat/vllm_builder.py says why). Skipped elsewhere and where vLLM is not installed.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.compat.vllm_builder import FIXTURE, env_problem

if env_problem():
    pytest.skip(env_problem(), allow_module_level=True)
pytest.importorskip("vllm.v1.attention.backends.mla.indexer")
ws = pytest.importorskip("vllm.v1.worker.workspace")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402

from sparse_indexer.compat.vllm import VllmIndexer, metadata_from_vllm  # noqa: E402
from tests.compat.vllm_batches import SEVEN, check_against_model, make_batch, run_ours, same_rows  # noqa: E402
from tests.compat.vllm_builder import Engine, fixture_steps  # noqa: E402

LAYER = "model.layers.0.self_attn.indexer.k_cache"

# engines (next_n and sizes) of the cases below; vLLM's prefill workspace is max_model_len * 8 * 2 keys
ENGINES = {
    "small": dict(max_model_len=96),
    "logits": dict(max_model_len=640, max_num_batched_tokens=1024),
    "workspace": dict(max_model_len=64, max_num_seqs=32, max_num_batched_tokens=128),
}

# name: (engine, next_n, seq_lens, query_lens, padding requests, padding tokens, extra query rows, expect)
# "expect" checks that vLLM's builder produced the layout the case is about.
CASES = {
    "uniform_decode_n1": ("small", 1, [40, 17, 90], [1, 1, 1], 0, 0, 0, "native [B, 1]"),
    "uniform_decode_n2": ("small", 2, [40, 33, 90], [2, 2, 2], 0, 0, 0, "native [B, 2]"),
    "uniform_decode_n3": ("small", 3, [40, 33, 90], [3, 3, 3], 0, 0, 0, "flat"),
    "one_token_decodes_n2": ("small", 2, [40, 33, 90], [1, 1, 1], 0, 0, 0, "native [B, 1]"),
    # at next_n <= 2 vLLM keeps one decode length: [2, 1, 2] is one decode and two short prefills
    "mixed_decode_lengths_n2": ("small", 2, [40, 33, 90], [2, 1, 2], 0, 0, 0, "split"),
    "mixed_decode_lengths_n3": ("small", 3, [40, 33, 90, 25], [3, 1, 2, 3], 0, 0, 0, "flat"),
    "decode_and_prefill_n2": ("small", 2, [40, 61, 30, 75], [2, 2, 30, 12], 0, 0, 0, "native [B, 2]"),
    "decode_and_prefill_n3": ("small", 3, [40, 61, 30, 75], [3, 1, 30, 12], 0, 0, 0, "flat"),
    # FULL CUDA graphs: a decode step padded to the captured batch (padding requests of length 0)
    "full_graph_padded_decode_n1": ("small", 1, [40, 17, 90], [1, 1, 1], 1, 1, 1, "padded"),
    "full_graph_padded_decode_n2": ("small", 2, [40, 33, 90], [2, 2, 2], 1, 2, 2, "padded"),
    "full_graph_padded_decode_n2_two_pads": ("small", 2, [40, 33], [2, 2], 2, 4, 4, "padded"),
    "full_graph_padded_decode_n3": ("small", 3, [40, 33, 90], [3, 3, 3], 1, 3, 3, "flat"),
    # FULL graphs of other batches pad tokens only (the flattened builder supports every batch in a graph)
    "full_graph_padded_tokens_mixed_n3": ("small", 3, [40, 61, 30], [3, 1, 20], 0, 3, 3, "flat"),
    "full_graph_padded_tokens_decode_n1": ("small", 1, [40, 17, 90], [1, 1, 1], 0, 1, 1, "native [B, 1]"),
    # PIECEWISE graphs: more query rows than the metadata's tokens
    "piecewise_extra_rows_n2": ("small", 2, [40, 61, 30, 75], [2, 2, 30, 12], 0, 0, 5, "native [B, 2]"),
    "piecewise_extra_rows_decode_n1": ("small", 1, [40, 17], [1, 1], 0, 0, 3, "native [B, 1]"),
    # prefill chunks: by the logits budget (1 MiB = 262144 float32), by the key workspace (64 * 16 = 1024
    # keys), and along the queries of one long request (500 x 640 logits)
    "prefill_split_by_logits": ("logits", 1, [600, 500, 300], [300, 250, 100], 0, 0, 0, "chunks 3"),
    "prefill_split_by_key_workspace": ("workspace", 1, [60] * 18, [4] * 18, 0, 0, 0, "chunks 2"),
    "prefill_split_along_queries": ("logits", 1, [640, 80], [500, 40], 0, 0, 0, "pieces"),
}

_ENGINES: dict = {}


def engine(name: str, next_n: int) -> Engine:
    key = (name, next_n)
    if key not in _ENGINES:
        _ENGINES[key] = Engine(next_n, **ENGINES[name])
    return _ENGINES[key]


def check_layout(vmd, expect: str, eng: Engine, batch) -> None:
    """The builder produced the layout the case is named for (so the case tests what it says)."""
    d = vmd.decode
    chunks = vmd.prefill.chunks if vmd.prefill is not None else []
    if expect.startswith("native"):
        assert d.seq_lens.dim() == 2 and d.seq_lens.shape == (vmd.num_decodes, int(expect[-2]))
        assert not d.requires_padding
    elif expect == "flat":
        assert d.seq_lens.shape == (vmd.num_decode_tokens, 1) and bool((d.decode_lens == 1).all())
    elif expect == "padded":
        assert d.requires_padding and bool((d.decode_lens[len(batch.seq_lens) :] == 0).all())
        assert vmd.num_decode_tokens > batch.num_tokens
    elif expect == "split":
        assert vmd.num_decodes == 1 and vmd.num_prefills == 2
    elif expect.startswith("chunks"):
        assert len(chunks) == int(expect.split()[1]) and not any(c.skip_kv_gather for c in chunks)
    elif expect == "pieces":
        assert [c.skip_kv_gather for c in chunks] == [False, True, False]
    assert all(c.total_seq_lens <= eng.workspace_keys for c in chunks)
    assert all((c.token_end - c.token_start) * c.total_seq_lens * 4 <= eng.limits.max_logits_bytes for c in chunks)


def op_args(batch, eng, kv, out):
    lim = eng.limits
    rows = batch.q_fp8.shape[0]
    return (torch.zeros(rows, 16), LAYER, kv, batch.q_fp8, batch.k, batch.weights, lim.head_dim, "ue8m0", lim.topk,
            lim.head_dim, lim.max_model_len, eng.workspace_keys, out)


@pytest.mark.parametrize("name", list(CASES))
def test_shim_on_vllm_builder(name, manager, backend):
    eng_name, nn, seq, qry, pad_reqs, pad_tokens, extra, expect = CASES[name]
    eng = engine(eng_name, nn)
    lim = eng.limits
    batch = make_batch(seq, qry, lim, seed=len(name), extra_rows=extra)
    vmd = eng.build(batch, pad_reqs=pad_reqs, pad_tokens=pad_tokens)
    check_layout(vmd, expect, eng, batch)

    op = VllmIndexer.from_vllm_config(eng.vllm_config, backend=backend)
    assert op.limits(batch.kv, batch.q_fp8, lim.topk, lim.head_dim, lim.max_model_len, eng.workspace_keys,
                     torch.empty(lim.max_num_batched_tokens, lim.topk, dtype=torch.int32)) == lim
    kv = batch.kv.clone()
    out = torch.full((lim.max_num_batched_tokens, lim.topk), SEVEN, dtype=torch.int32)
    with set_forward_context(None, eng.vllm_config):  # profiling run: reserves the plan in the workspace
        op(*op_args(batch, eng, kv, out))
    ws.lock_workspace()
    with set_forward_context({LAYER: vmd}, eng.vllm_config):
        assert op(*op_args(batch, eng, kv, out)) is out

    n, rows = batch.num_tokens, batch.q_fp8.shape[0]
    check_against_model(out[:n], batch, lim.topk)
    assert bool((out[n:rows] == -1).all()), "padding rows must be -1"
    assert bool((out[rows:] == SEVEN).all()), "rows beyond the query rows were written"
    expected, kv_expected = run_ours(batch, lim, backend=backend)
    assert same_rows(out, expected)
    assert torch.equal(kv, kv_expected)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][0] == "small"])
def test_conversion_reads_no_device_values(name):
    """The conversion must not synchronise (it runs inside captured CUDA graphs): under FakeTensorMode every
    read of a tensor's values (``.item()``, ``.tolist()``, ``bool()``, a data-dependent shape) raises."""
    eng_name, nn, seq, qry, pad_reqs, pad_tokens, extra, _ = CASES[name]
    eng = engine(eng_name, nn)
    batch = make_batch(seq, qry, eng.limits, seed=1, extra_rows=extra)
    vmd = eng.build(batch, pad_reqs=pad_reqs, pad_tokens=pad_tokens)
    real = metadata_from_vllm(vmd, eng.limits)
    mode = FakeTensorMode(allow_non_fake_inputs=False)

    def fake(x):
        if isinstance(x, torch.Tensor):
            return mode.from_tensor(x)
        if hasattr(x, "__dict__") and not isinstance(x, type):
            ns = type("NS", (), {})()
            ns.__dict__.update({k: fake(v) for k, v in vars(x).items()})
            return ns
        if isinstance(x, list):
            return [fake(v) for v in x]
        return x

    with mode:
        conv = metadata_from_vllm(fake(vmd), eng.limits)
    assert conv.num_decode_tokens == real.num_decode_tokens and conv.num_tokens == real.num_tokens
    if real.decode is not None:
        assert conv.decode.row_ends.shape == real.decode.row_ends.shape


def test_gpu_fixture_is_vllm_builder_output():
    """tests/compat/vllm_padded_decode.json (read by the GPU test, where vLLM is not installed) is what vLLM's
    builder produces today: regenerate it with ``python -m tests.compat.vllm_builder`` if this fails."""
    assert json.loads(FIXTURE.read_text()) == json.loads(json.dumps(fixture_steps()))
