"""vLLM's indexer metadata -> ours, on the layouts vLLM 0.33's own builder never produces (the builder's layouts
are tested in tests/compat/test_vllm_builder.py): 1-D decode ``seq_lens`` (earlier vLLM versions), native
``[B, n]`` decode with mixed real decode lengths and ``requires_padding`` (0.33 splits or flattens such batches),
with and without FULL-graph padding; and the shim's errors.

Needs no vLLM: the metadata objects are namespaces with the field names of vLLM 0.33's dataclasses
(tests/compat/vllm_batches.py). Each step must match the float64 model and our own path on the same inputs.
Reference backend, CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import sparse_indexer as si
from sparse_indexer.compat.vllm import VllmIndexer, metadata_from_vllm
from tests.compat.vllm_batches import SEVEN, check_against_model, make_batch, run_ours, same_rows, vllm_metadata
from tests.compat.vllm_graph import check_padded_decode_replay


def limits(next_n=2, **kw):
    base = dict(max_model_len=96, max_num_batched_tokens=64, max_num_seqs=8, next_n=next_n, n_heads=8,
                head_dim=64, topk=16, block_size=16, prefill_k_tokens=192, max_logits_bytes=64 * 96 * 4,
                min_prefill_query_len=1)  # as VllmIndexer.limits: vLLM's chunks may hold one-token prefills
    base.update(kw)
    return si.IndexerLimits(**base)


CASES = {
    # name: (seq_lens, query_lens, next_n, 1-D seq_lens, padding requests, padding tokens)
    "decode_1d_n1": ([40, 17, 90], [1, 1, 1], 1, True, 0, 0),
    "decode_1d_n2": ([40, 33, 90], [2, 2, 2], 2, True, 0, 0),
    "decode_1d_n2_padded": ([40, 33], [2, 2], 2, True, 1, 2),
    "decode_1d_n1_padded": ([40, 33], [1, 1], 1, True, 2, 2),
    "decode_native_mixed_lengths": ([40, 33, 90, 25], [3, 1, 2, 3], 3, False, 0, 0),
    "decode_native_mixed_lengths_padded": ([40, 33, 90], [3, 1, 2], 3, False, 2, 4),
    "decode_native_mixed_lengths_and_prefill": ([40, 61, 30, 75], [2, 1, 30, 12], 2, False, 0, 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_converted_metadata_gives_the_same_step(name):
    seq, qry, nn, one_d, pad_reqs, pad_tokens = CASES[name]
    lim = limits(next_n=nn)
    batch = make_batch(seq, qry, lim, seed=len(name), extra_rows=pad_tokens)
    expected, kv_expected = run_ours(batch, lim)
    vmd = vllm_metadata(batch, nn, one_d=one_d, pad_reqs=pad_reqs, pad_tokens=pad_tokens)
    actual, kv_actual = run_ours(batch, lim, metadata_from_vllm(vmd, lim))
    n, rows = batch.num_tokens, batch.q_fp8.shape[0]
    assert torch.equal(kv_actual, kv_expected)
    check_against_model(actual[:n], batch, lim.topk)
    assert same_rows(actual, expected)
    assert bool((actual[n:rows] == -1).all()) and bool((actual[rows:] == SEVEN).all())


def test_padded_decode_fields():
    """The packed decode of mixed lengths is the one build_metadata makes (slots, windows, pack/unpack maps)."""
    lim = limits(next_n=3)
    batch = make_batch([40, 33, 90, 25], [3, 1, 2, 3], lim)
    dm = metadata_from_vllm(vllm_metadata(batch, 3), lim).decode
    ours = si.build_metadata(batch.seq_lens, batch.query_lens, batch.block_table, batch.slot_mapping, lim).decode
    assert not dm.uniform and dm.next_n == 3
    for f in ("context_lens", "row_starts", "row_ends", "pack_src", "unpack_src"):
        assert torch.equal(getattr(dm, f).long(), getattr(ours, f).long()), f


def test_padding_tokens_read_an_empty_slot():
    """FULL-graph padding tokens unpack from a slot with an empty window, never past the last request."""
    lim = limits(next_n=3)
    batch = make_batch([40, 33, 90], [3, 1, 2], lim, extra_rows=4)
    md = metadata_from_vllm(vllm_metadata(batch, 3, pad_reqs=2, pad_tokens=4), lim)
    dm = md.decode
    assert md.num_decode_tokens == 10 and dm.num_reqs == 5 and dm.unpack_src.shape == (10,)
    assert bool((dm.unpack_src < dm.num_rows).all())
    assert bool((dm.row_ends[dm.unpack_src[6:]] == 0).all())


def test_unsupported_vllm_features_are_named():
    lim = limits(next_n=1)
    batch = make_batch([30, 50], [30, 20], lim)
    vmd = vllm_metadata(batch, 1)
    vmd.prefill.chunks[0].pcp_deinterleave_idx = torch.zeros(1)
    with pytest.raises(NotImplementedError, match="pcp_deinterleave_idx"):
        metadata_from_vllm(vmd, lim)
    dec = vllm_metadata(make_batch([30, 50], [1, 1], lim), 1)
    dec.decode.indices = torch.arange(2, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="indices"):
        metadata_from_vllm(dec, lim)


def test_chunks_must_follow_the_decode_rows():
    lim = limits(next_n=2)
    batch = make_batch([40, 30, 75], [2, 30, 12], lim)
    vmd = vllm_metadata(batch, 2)
    c = vmd.prefill.chunks[0]
    c.token_start, c.token_end = c.token_start + 1, c.token_end + 1
    with pytest.raises(ValueError, match="do not start at row 2"):
        metadata_from_vllm(vmd, lim)


def test_indexer_converts_each_steps_metadata_once():
    """Every layer of a step passes the same vLLM metadata object: the drop-in converts it once (its device
    tensors are made once per step, not per layer) and again for the next step's object."""
    lim = limits(3)
    batch = make_batch([40, 33, 90, 25], [3, 1, 2, 3], lim)
    op = VllmIndexer(max_num_seqs=lim.max_num_seqs, next_n=3, attn_metadata=lambda: None)
    step1 = vllm_metadata(batch, 3)
    md = op._metadata(step1, lim)
    assert op._metadata(step1, lim) is md
    step2 = vllm_metadata(batch, 3)
    assert op._metadata(step2, lim) is not md


@pytest.mark.parametrize("next_n,compress_ratio", [(1, 1), (2, 1), (3, 1), (1, 4), (2, 4)],
                         ids=["n1", "n2", "n3", "v4_c4_n1", "v4_c4_n2"])
@pytest.mark.parametrize("capture_step", [0, 1], ids=["capture_uniform", "capture_padded"])
def test_padded_decode_replay_on_cpu(next_n, compress_ratio, capture_step):
    """The CUDA-graph test's steps (vLLM's builder output, tests/compat/vllm_padded_decode.json) on the CPU: the
    metadata of the captured step's flags over persistent tensors holding each new step gives the eager result
    (DeepSeek-V3.2, and DeepSeek-V4's compressed cache at compress ratio 4)."""
    check_padded_decode_replay("cpu", next_n, capture_step, compress_ratio)


# ------------------------------------------------------------------------------------------------ compressed caches
def _op_call(op, lim, kv, q, out, *, compress_ratio, skip=True, k=None):
    keys = lim.max_model_len // max(1, int(compress_ratio))
    return op(torch.zeros(q.shape[0], 1), "layer", kv, q, k, torch.zeros(q.shape[0], lim.n_heads), lim.head_dim,
              "ue8m0", lim.topk, lim.head_dim, keys, lim.prefill_k_tokens, out, skip, compress_ratio)


def test_compress_ratios_the_op_takes():
    """vLLM sends compress ratios 1, 2 and 4 to the op (its ratio-128 layers have no indexer); a compressed cache
    always holds the compressor's keys (``skip_k_cache_insert``)."""
    lim = limits(next_n=1)
    op = VllmIndexer(max_num_seqs=lim.max_num_seqs, attn_metadata=lambda: None)
    kv = si.new_kv_cache(4, lim.block_size, lim.head_dim)
    q = torch.zeros(2, lim.n_heads, lim.head_dim, dtype=torch.float8_e4m3fn)
    out = torch.empty(lim.max_num_batched_tokens, lim.topk, dtype=torch.int32)
    for bad in (128, 3, 0, True):
        with pytest.raises(ValueError, match="compress_ratio"):
            _op_call(op, lim, kv, q, out, compress_ratio=bad)
    with pytest.raises(NotImplementedError, match="skip_k_cache_insert=False"):
        _op_call(op, lim, kv, q, out, compress_ratio=4, skip=False, k=torch.zeros(2, lim.head_dim))


def test_limits_of_a_compressed_op():
    """The op's max_model_len and total_seq_lens are // C; the limits count tokens: the model's length when it
    has that many keys, else the longest length that has."""
    kv = si.new_kv_cache(4, 64, 128)
    q = torch.zeros(1, 64, 128, dtype=torch.float8_e4m3fn)
    out = torch.empty(256, 512, dtype=torch.int32)
    for model_len, cr, want in ((8192, 4, 8192), (8194, 4, 8194), (None, 4, 8195), (4096, 4, 8195), (8193, 2, 8193)):
        op = VllmIndexer(max_num_seqs=8, model_max_model_len=model_len)
        lim = op.limits(kv, q, 512, 128, 8192 // cr if cr == 2 else 2048, 4096, out, compress_ratio=cr,
                        skip_k_cache_insert=True)
        assert (lim.max_model_len, lim.compress_ratio, lim.block_size) == (want, cr, 64)
        assert lim.max_keys == (2048 if cr == 4 else 4096) and lim.prefill_k_tokens == max(4096, lim.max_keys)
        assert lim.cache_format is None  # the CPU: V4's writers produce what the step assumes


def test_v4_cache_format(monkeypatch):
    """V4-FAMILY §2.2: e4m3fn values everywhere, UE8M0 x4 scales where vLLM's logits take MX scales (SM100),
    16 x 16 tiles on ROCm for ratios 1 and 2 with more than one entry per block."""
    from buffers import CacheFormat
    from sparse_indexer.compat import vllm as shim

    cpu, fn, fnuz = torch.device("cpu"), torch.float8_e4m3fn, torch.float8_e4m3fnuz
    assert shim.v4_cache_format(4, 64, cpu, fn) is None
    assert shim.v4_cache_format(4, 64, cpu, fnuz) == CacheFormat(fp8_dtype=fn)  # gfx942 queries, e4m3fn keys
    monkeypatch.setattr(shim, "_is_rocm", lambda: True)
    assert shim.v4_cache_format(4, 64, cpu, fn) is None
    assert shim.v4_cache_format(2, 32, cpu, fn) == CacheFormat(order="preshuffled")
    assert shim.v4_cache_format(1, 64, cpu, fnuz) == CacheFormat(fp8_dtype=fn, order="preshuffled")
    assert shim.v4_cache_format(1, 1, cpu, fn) is None
    monkeypatch.setattr(shim, "_is_rocm", lambda: False)
    monkeypatch.setattr(shim, "_uses_mx_scales", lambda device: True)
    assert shim.v4_cache_format(4, 64, cpu, fn) == CacheFormat(scale="ue8m0x4")
    # the limits of a compressor-written cache carry the format; a cache the op writes itself does not
    op = VllmIndexer(max_num_seqs=8)
    args = (si.new_kv_cache(4, 64, 128), torch.zeros(1, 64, 128, dtype=fn), 512, 128, 2048, 4096,
            torch.empty(256, 512, dtype=torch.int32))
    assert op.limits(*args, compress_ratio=4, skip_k_cache_insert=True).cache_format == CacheFormat(scale="ue8m0x4")
    assert op.limits(*args).cache_format is None


def _compressed_chunk(batch, r: int, token_start: int, cr: int):
    """A ``DeepseekV32IndexerPrefillChunkMetadata`` namespace of request ``r`` alone on a cache of ``cr`` tokens per
    key, as ``build_prefill_chunk_metadata`` makes it (compressed key counts and windows)."""
    s, q = batch.seq_lens[r], batch.query_lens[r]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return SimpleNamespace(block_table=batch.block_table[r : r + 1], cu_seq_lens=i32([0, s // cr]),
                           cu_seqlen_ks=i32([0] * q), cu_seqlen_ke=i32([(s - q + j + 1) // cr for j in range(q)]),
                           total_seq_lens=s // cr, token_start=token_start, token_end=token_start + q,
                           skip_kv_gather=False)


def test_compressed_chunks_may_leave_rows_to_dropped_chunks():
    """With C > 1 vLLM drops key-less chunks: rows before and between the remaining chunks become empty rows
    (-1); a chunk over the previous one's rows is an error whatever C."""
    lim = limits(next_n=1, compress_ratio=4, max_model_len=384, block_size=4, prefill_k_tokens=96)
    batch = make_batch([40, 3, 30, 2, 75], [1, 3, 30, 2, 12], lim)
    md = si.build_metadata(batch.seq_lens, batch.query_lens, batch.block_table, batch.key_slots, lim)
    vmd = vllm_metadata(batch, 1)
    vmd.slot_mapping = batch.key_slots
    vmd.decode.seq_lens = vmd.decode.seq_lens // 4  # vLLM's compressed decode lengths
    # the chunks vLLM makes when requests 1 and 3 (shorter than C, no key) are alone in theirs: rows 1-3 and 34-35
    # dropped
    pieces = [_compressed_chunk(batch, 2, 4, 4), _compressed_chunk(batch, 4, 36, 4)]
    vmd.prefill.chunks = pieces
    conv = metadata_from_vllm(vmd, lim)
    assert conv.empty_rows == ((1, 4), (34, 36)) and conv.num_tokens == 48
    actual, _ = run_ours(batch, lim, conv)
    expected, _ = run_ours(batch, lim, md)
    check_against_model(actual[:48], batch, lim.topk)
    assert same_rows(actual, expected)
    pieces[1].token_start, pieces[1].token_end = 33, 45
    with pytest.raises(ValueError, match="or after it"):
        metadata_from_vllm(vmd, lim)
