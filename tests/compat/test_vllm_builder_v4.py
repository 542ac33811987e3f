"""The vLLM shim on DeepSeek-V4/V4.1 compressed indexer caches, with metadata from vLLM 0.33's own
``DeepseekV32IndexerMetadataBuilder.build()`` for a V4 indexer cache spec (``MLAAttentionSpec(tokens_per_state=C)``).

The op runs as V4's indexer layer calls it: the model's compressor has written every key of the step into the
cache (one key per ``C`` tokens, at vLLM's compressed slots) before the op, which gets ``k=None``,
``skip_k_cache_insert=True``, ``compress_ratio=C`` and the lengths ``max_model_len // C``,
``get_max_prefill_buffer_size // C``. Every case must match the float64 model of the compressed indexer (a
token at position ``p`` sees the first ``(p + 1) // C`` keys of its request; windows of at most ``topk`` keys
give exactly ``0..n-1, -1, ...``) and our own path (``build_metadata`` from the lengths in tokens with
``compressed_slot_mapping``'s slots + ``sparse_attn_indexer``). vLLM's compressed slot mapping must be the
library's.

Own process (tests/run.sh): ``TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= VLLM_SPARSE_INDEXER_MAX_LOGITS_MB=1``
(tests/compat/vllm_builder.py says why). Skipped elsewhere and where vLLM is not installed.
"""

from __future__ import annotations

import pytest
import torch

from tests.compat.vllm_builder import env_problem

if env_problem():
    pytest.skip(env_problem(), allow_module_level=True)
pytest.importorskip("vllm.v1.attention.backends.mla.indexer")
ws = pytest.importorskip("vllm.v1.worker.workspace")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402

from sparse_indexer.compat import vllm as shim  # noqa: E402
from sparse_indexer.compat.vllm import VllmIndexer, metadata_from_vllm  # noqa: E402
from tests.compat.vllm_batches import SEVEN, check_against_model, make_batch, run_ours, same_rows  # noqa: E402
from tests.compat.vllm_builder import Engine  # noqa: E402

# engines of the cases below (block_size: tokens per page, a multiple of C; vLLM's V4 pages hold 256)
ENGINES = {
    # C=4: up to 64 keys per request (top-16: windows above and below topk); C=2: up to 128
    "small": dict(max_model_len=256, block_size=16),
    # 1 MiB of logits = 262144 float32 cells: chunks of 64 queries x 4096 keys
    "logits": dict(max_model_len=16384, block_size=64, max_num_batched_tokens=512),
    # vLLM's prefill key workspace 64 * 8 * 2 // 4 = 256 keys
    "workspace": dict(max_model_len=64, max_num_seqs=32, max_num_batched_tokens=128),
}

# name: (engine, C, next_n, seq_lens, query_lens, padding requests, padding tokens, extra query rows, expect)
# "expect" checks that vLLM's builder produced the layout the case is about.
CASES = {
    "c4_uniform_decode_n1": ("small", 4, 1, [160, 67, 250], [1, 1, 1], 0, 0, 0, "native [B, 1]"),
    "c4_uniform_decode_n2": ("small", 4, 2, [160, 133, 250], [2, 2, 2], 0, 0, 0, "native [B, 2]"),
    "c4_one_token_decodes_n2": ("small", 4, 2, [160, 133, 250], [1, 1, 1], 0, 0, 0, "native [B, 1]"),
    "c4_uniform_decode_n3": ("small", 4, 3, [160, 133, 250], [3, 3, 3], 0, 0, 0, "flat"),
    # FULL CUDA graphs: padding requests (length 0) and their tokens; requires_padding at one token too
    "c4_full_graph_padded_decode_n1": ("small", 4, 1, [160, 2, 250], [1, 1, 1], 1, 1, 1, "padded"),
    "c4_full_graph_padded_decode_n2": ("small", 4, 2, [3, 133, 250], [2, 2, 2], 1, 2, 2, "padded"),
    "c4_full_graph_padded_decode_n2_two_pads": ("small", 4, 2, [160, 7], [2, 2], 2, 4, 4, "padded"),
    # padding tokens without padding requests: one length row per decode token, one block-table row per request
    "c4_full_graph_padded_tokens_decode_n1": ("small", 4, 1, [160, 67, 250], [1, 1, 1], 0, 2, 2, "rows > requests"),
    "c4_decode_and_prefill_n2": ("small", 4, 2, [160, 61, 30, 75], [2, 2, 30, 12], 0, 0, 0, "native [B, 2]"),
    # at next_n <= 2 vLLM keeps one decode length: [2, 1, 2] is one decode and two short prefills
    "c4_mixed_decode_lengths_n2": ("small", 4, 2, [160, 133, 250], [2, 1, 2], 0, 0, 0, "split"),
    # requests shorter than C (no key: all -1) beside others in one chunk, a decode with an empty window
    "c4_requests_shorter_than_c": ("small", 4, 1, [2, 3, 7, 40], [1, 3, 7, 20], 0, 0, 0, "chunks 1"),
    # every prefill request shorter than C: vLLM drops the only chunk
    "c4_prefill_without_keys": ("small", 4, 1, [40, 3, 2], [1, 3, 2], 0, 0, 0, "chunks 0"),
    # prefill chunks by the logits budget, by the key workspace, and a key-less chunk dropped between two
    # others (request 1 is alone in its chunk: with request 0 or 2 the logits would exceed the budget; request
    # 2 is then split along its queries)
    "c4_prefill_split_by_logits": ("logits", 4, 1, [8192, 6000, 4000], [128, 100, 64], 0, 0, 0, "chunks 3"),
    "c4_prefill_split_by_key_workspace": ("workspace", 4, 1, [60] * 18, [4] * 18, 0, 0, 0, "chunks 2"),
    "c4_key_less_chunk_between_two": ("logits", 4, 1, [16384, 3, 16384], [64, 3, 100], 0, 0, 0, "gap"),
    # DeepSeek-V4.1's ratio-2 layers
    "c2_uniform_decode_n1": ("small", 2, 1, [160, 67, 250], [1, 1, 1], 0, 0, 0, "native [B, 1]"),
    "c2_full_graph_padded_decode_n2": ("small", 2, 2, [2, 133, 250], [2, 2, 2], 1, 2, 2, "padded"),
    "c2_decode_and_prefill_n2": ("small", 2, 2, [161, 61, 1, 75], [2, 2, 1, 12], 0, 0, 0, "native [B, 2]"),
}

_ENGINES: dict = {}


def engine(name: str, compress_ratio: int, next_n: int, **kw) -> Engine:
    key = (name, compress_ratio, next_n, tuple(sorted(kw.items())))
    if key not in _ENGINES:
        _ENGINES[key] = Engine(next_n, compress_ratio=compress_ratio, **{**ENGINES[name], **kw})
    return _ENGINES[key]


def check_layout(vmd, expect: str, eng: Engine, batch) -> None:
    """The builder produced the layout the case is named for (so the case tests what it says), with vLLM's
    compressed lengths as the shim reads them."""
    cr, d = eng.compress_ratio, vmd.decode
    chunks = vmd.prefill.chunks if vmd.prefill is not None else []
    n_dec = vmd.num_decodes
    if expect.startswith("native"):
        nn = int(expect[-2])
        assert d.seq_lens.shape == (n_dec, nn) and not d.requires_padding
        want = [max(0, s - nn + j + 1) // cr for s in batch.seq_lens[:n_dec] for j in range(nn)]
        assert d.seq_lens.reshape(-1).tolist() == want, "native decode lengths are clamp(L - n + j + 1, 0) // C"
    elif expect == "flat":
        assert d.seq_lens.shape == (vmd.num_decode_tokens, 1) and bool((d.decode_lens == 1).all())
    elif expect == "padded":
        assert d.requires_padding and bool((d.decode_lens[len(batch.seq_lens) :] == 0).all())
        assert vmd.num_decode_tokens > batch.num_tokens
        assert vmd.seq_lens.shape[0] >= n_dec  # the lengths in tokens the padded windows are made from
    elif expect == "rows > requests":
        assert d.seq_lens.shape == (vmd.num_decode_tokens, 1) and d.block_table.shape[0] == n_dec
        assert vmd.num_decode_tokens > n_dec and bool((d.seq_lens[n_dec:] == 0).all())
    elif expect == "split":
        assert vmd.num_decodes == 1 and vmd.num_prefills == 2
    elif expect.startswith("chunks"):
        assert len(chunks) == int(expect.split()[1]) and not any(c.skip_kv_gather for c in chunks)
        assert vmd.num_prefills > 0
    elif expect == "gap":
        assert [c.skip_kv_gather for c in chunks] == [False, False, True]
        assert chunks[1].token_start == chunks[0].token_end + batch.query_lens[1], "the key-less chunk is dropped"
    assert all(0 < c.total_seq_lens <= eng.workspace_keys for c in chunks)
    assert all((c.token_end - c.token_start) * c.total_seq_lens * 4 <= eng.limits.max_logits_bytes for c in chunks)
    # vLLM's compressed slot mapping is the library's (padding tokens -1)
    n = batch.num_tokens
    assert torch.equal(vmd.slot_mapping[:n], batch.key_slots)
    assert bool((vmd.slot_mapping[n : vmd.num_decode_tokens + vmd.num_prefill_tokens] == -1).all())


def op_args(batch, eng, kv, out, layer=None):
    """The op's arguments as DeepSeek-V4's indexer layer passes them (keys already in the cache)."""
    lim = eng.limits
    rows = batch.q_fp8.shape[0]
    return (torch.zeros(rows, 16), layer or eng.layer, kv, batch.q_fp8, None, batch.weights, lim.head_dim, "ue8m0",
            lim.topk, lim.head_dim, eng.op_max_model_len, eng.op_total_seq_lens, out, True, eng.compress_ratio)


@pytest.mark.parametrize("name", list(CASES))
def test_shim_on_vllm_builder_v4(name, manager, backend):
    eng_name, cr, nn, seq, qry, pad_reqs, pad_tokens, extra, expect = CASES[name]
    eng = engine(eng_name, cr, nn)
    lim = eng.limits
    batch = make_batch(seq, qry, lim, seed=len(name), extra_rows=extra)
    assert batch.k is None  # the compressor wrote every key of the step
    vmd = eng.build(batch, pad_reqs=pad_reqs, pad_tokens=pad_tokens)
    check_layout(vmd, expect, eng, batch)

    op = VllmIndexer.from_vllm_config(eng.vllm_config, backend=backend)
    assert op.limits(batch.kv, batch.q_fp8, lim.topk, lim.head_dim, eng.op_max_model_len, eng.op_total_seq_lens,
                     torch.empty(lim.max_num_batched_tokens, lim.topk, dtype=torch.int32), compress_ratio=cr,
                     skip_k_cache_insert=True) == lim
    kv = batch.kv.clone()
    out = torch.full((lim.max_num_batched_tokens, lim.topk), SEVEN, dtype=torch.int32)
    with set_forward_context(None, eng.vllm_config):  # profiling run: reserves the plan in the workspace
        op(*op_args(batch, eng, kv, out))
    ws.lock_workspace()
    with set_forward_context({eng.layer: vmd}, eng.vllm_config):
        assert op(*op_args(batch, eng, kv, out)) is out

    n, rows = batch.num_tokens, batch.q_fp8.shape[0]
    check_against_model(out[:n], batch, lim.topk)
    assert bool((out[n:rows] == -1).all()), "padding rows must be -1"
    assert bool((out[rows:] == SEVEN).all()), "rows beyond the query rows were written"
    expected, kv_expected = run_ours(batch, lim, backend=backend)
    assert same_rows(out, expected)
    assert torch.equal(kv, batch.kv) and torch.equal(kv_expected, batch.kv), "k=None writes nothing"


def _fake(mode, x):
    if isinstance(x, torch.Tensor):
        return mode.from_tensor(x)
    if hasattr(x, "__dict__") and not isinstance(x, type):
        ns = type("NS", (), {})()
        ns.__dict__.update({k: _fake(mode, v) for k, v in vars(x).items()})
        return ns
    if isinstance(x, list):
        return [_fake(mode, v) for v in x]
    return x


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][0] == "small"])
def test_v4_conversion_reads_no_device_values(name):
    """The conversion must not synchronise (it runs inside captured CUDA graphs), also where it makes the
    compressed padded windows: under FakeTensorMode every read of a tensor's values raises."""
    eng_name, cr, nn, seq, qry, pad_reqs, pad_tokens, extra, _ = CASES[name]
    eng = engine(eng_name, cr, nn)
    batch = make_batch(seq, qry, eng.limits, seed=1, extra_rows=extra, layout_only=True)
    vmd = eng.build(batch, pad_reqs=pad_reqs, pad_tokens=pad_tokens)
    real = metadata_from_vllm(vmd, eng.limits)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    with mode:
        conv = metadata_from_vllm(_fake(mode, vmd), eng.limits)
    assert conv.num_decode_tokens == real.num_decode_tokens and conv.num_tokens == real.num_tokens
    assert conv.empty_rows == real.empty_rows
    if real.decode is not None:
        assert conv.decode.row_ends.shape == real.decode.row_ends.shape
        assert conv.decode.uniform == real.decode.uniform


def test_padded_compressed_decode_windows_come_from_the_lengths_in_tokens():
    """A padded decode of real requests with fewer than next_n tokens (hand-shortened from the builder's padded
    layout): vLLM's [B, n] grid holds the windows of n tokens, so the packed windows must come from the
    metadata's lengths in tokens, (L - d + j + 1) // C, not from the grid's last column (already // C)."""
    eng = engine("small", 4, 2)
    batch = make_batch([3, 133, 250], [2, 2, 2], eng.limits, layout_only=True)
    vmd = eng.build(batch, pad_reqs=1, pad_tokens=2)
    vmd.decode.decode_lens = torch.tensor([2, 1, 2, 0], dtype=torch.int32)  # request 1: one token
    vmd.num_decode_tokens = 7
    dm = metadata_from_vllm(vmd, eng.limits).decode
    assert not dm.uniform
    assert dm.context_lens.tolist() == [[0, 0], [133 // 4, 0], [249 // 4, 250 // 4], [0, 0]]
    vmd.seq_lens = None
    with pytest.raises(ValueError, match="seq_lens in tokens"):
        metadata_from_vllm(vmd, eng.limits)


def test_two_groups_alternate_through_one_indexer(manager, monkeypatch, backend):
    """DeepSeek-V4.1-like: layers of two K-cache groups (compress ratios 1 and 4, each with its own cache, block
    size and vLLM metadata object) alternate through one drop-in. Each group gets its own limits and plan, the
    profiling run leaves the workspace as large as the larger plan, each metadata object is converted once per
    step however the layers alternate, and every layer's result is its group's."""
    seq, qry = [160, 67, 250, 90], [1, 1, 1, 30]
    groups = []
    for cr, bs, layer in ((1, 8, "model.layers.1.self_attn.indexer.k_cache"),
                          (4, 16, "model.layers.2.self_attn.indexer.k_cache")):
        eng = engine("small", cr, 1, block_size=bs, layer=layer)
        batch = make_batch(seq, qry, eng.limits, seed=cr, prewritten=True)  # the compressor's keys, also at C=1
        groups.append((eng, batch, eng.build(batch)))
    op = VllmIndexer.from_vllm_config(groups[0][0].vllm_config, backend=backend)
    outs = [torch.full((e.limits.max_num_batched_tokens, e.limits.topk), SEVEN, dtype=torch.int32)
            for e, _, _ in groups]
    kvs = [b.kv.clone() for _, b, _ in groups]
    with set_forward_context(None, groups[0][0].vllm_config):  # profiling: every layer once
        for (eng, batch, _), kv, out in zip(groups, kvs, outs):
            op(*op_args(batch, eng, kv, out))
    plans = [v[1] for v in op._memo["limits"].values()]
    assert len(plans) == 2 and sorted(p.limits.compress_ratio for p in plans) == [1, 4]
    assert shim.held_bytes(manager) == max(p.total_bytes for p in plans)
    ws.lock_workspace()

    calls = []
    real = shim.metadata_from_vllm
    monkeypatch.setattr(shim, "metadata_from_vllm", lambda md, lim: (calls.append(md), real(md, lim))[1])
    ctx = {eng.layer: vmd for eng, _, vmd in groups}
    with set_forward_context(ctx, groups[0][0].vllm_config):
        for _ in range(3):  # layers 1, 2, 1, 2, ...: one conversion per group
            for (eng, batch, _), kv, out in zip(groups, kvs, outs):
                op(*op_args(batch, eng, kv, out))
    assert len(calls) == 2 and {id(c) for c in calls} == {id(v) for _, _, v in groups}
    for (eng, batch, _), kv, out in zip(groups, kvs, outs):
        n = batch.num_tokens
        check_against_model(out[:n], batch, eng.limits.topk)
        expected, _ = run_ours(batch, eng.limits, backend=backend)
        assert same_rows(out, expected) and torch.equal(kv, batch.kv)
