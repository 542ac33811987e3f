"""vLLM's indexer metadata -> ours: the step run on converted metadata equals the step on build_metadata.

Needs no vLLM: the metadata objects are namespaces with the field names of vLLM 0.33's dataclasses, filled with
vLLM's conventions (tests/compat/vllm_batches.py). Reference backend, CPU.
"""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from sparse_indexer.compat.vllm import metadata_from_vllm
from tests.compat.vllm_batches import make_batch, vllm_metadata


def limits(next_n=2, **kw):
    base = dict(max_model_len=96, max_num_batched_tokens=64, max_num_seqs=8, next_n=next_n, n_heads=8,
                head_dim=64, topk=16, block_size=16, prefill_k_tokens=192, max_logits_bytes=64 * 96 * 4)
    base.update(kw)
    return si.IndexerLimits(**base)


def run_ours(batch, lim, md=None):
    md = md or si.build_metadata(batch.seq_lens, batch.query_lens, batch.block_table, batch.slot_mapping, lim)
    kv = batch.kv.clone()
    out = torch.full((lim.max_num_batched_tokens, lim.topk), 7, dtype=torch.int32)
    si.sparse_attn_indexer(batch.q_fp8, batch.k, batch.weights, kv, md, si.allocate(lim), out,
                           backend="reference")
    return out, kv


CASES = {
    # name: (seq_lens, query_lens, next_n, decode_mode, chunks)
    "decode_1d": ([40, 17, 90], [1, 1, 1], 1, "native", None),
    "decode_2d_uniform": ([40, 33, 90], [2, 2, 2], 2, "native", None),
    "decode_padded": ([40, 33, 90, 25], [3, 1, 2, 3], 3, "native", None),
    "decode_flat": ([40, 33, 90], [2, 1, 2], 2, "flat", None),
    "prefill_one_chunk": ([30, 50], [30, 20], 1, "native", None),
    "prefill_split_chunks": ([30, 50, 70], [30, 20, 9], 1, "native", [(0, 1, None), (1, 3, None)]),
    "prefill_query_pieces": ([80], [60], 1, "native", [(0, 1, (0, 25)), (0, 1, (25, 50)), (0, 1, (50, 60))]),
    "mixed": ([40, 61, 30, 75], [2, 1, 30, 12], 2, "native", [(2, 3, None), (3, 4, None)]),
    "mixed_flat": ([40, 61, 30, 75], [2, 1, 30, 12], 2, "flat", None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_converted_metadata_gives_the_same_step(name):
    seq, qry, nn, mode, chunks = CASES[name]
    lim = limits(next_n=nn)
    batch = make_batch(seq, qry, lim, seed=len(name))
    expected, kv_expected = run_ours(batch, lim)
    md = metadata_from_vllm(vllm_metadata(batch, nn, decode_mode=mode, chunks=chunks), lim)
    actual, kv_actual = run_ours(batch, lim, md)
    n = sum(qry)
    assert torch.equal(kv_actual, kv_expected)
    # top-k positions come in any order (docs/spec.md §6): compare each row as a set
    assert torch.equal(actual[:n].sort(1).values, expected[:n].sort(1).values)
    assert (actual[n:] == 7).all()
    assert (actual[:n] >= 0).any()


def test_padded_decode_fields():
    lim = limits(next_n=3)
    batch = make_batch([40, 33, 90, 25], [3, 1, 2, 3], lim)
    dm = metadata_from_vllm(vllm_metadata(batch, 3), lim).decode
    ours = si.build_metadata(batch.seq_lens, batch.query_lens, batch.block_table, batch.slot_mapping, lim).decode
    assert not dm.uniform and dm.next_n == 3
    for f in ("context_lens", "row_starts", "row_ends", "pack_src", "unpack_src"):
        assert torch.equal(getattr(dm, f).long(), getattr(ours, f).long()), f


def test_unsupported_vllm_features_are_named():
    lim = limits(next_n=1)
    batch = make_batch([30, 50], [30, 20], lim)
    vmd = vllm_metadata(batch, 1)
    vmd.prefill.chunks[0].pcp_deinterleave_idx = torch.zeros(1)
    with pytest.raises(NotImplementedError, match="pcp_deinterleave_idx"):
        metadata_from_vllm(vmd, lim)


def test_indexer_converts_each_steps_metadata_once():
    """Every layer of a step passes the same vLLM metadata object: the drop-in converts it once (its device
    tensors are made once per step, not per layer) and again for the next step's object."""
    from sparse_indexer.compat.vllm import VllmIndexer

    lim = limits(3)
    batch = make_batch([40, 33, 90, 25], [3, 1, 2, 3], lim)
    op = VllmIndexer(max_num_seqs=lim.max_num_seqs, next_n=3, attn_metadata=lambda: None)
    step1 = vllm_metadata(batch, 3)
    md = op._metadata(step1, lim)
    assert op._metadata(step1, lim) is md
    step2 = vllm_metadata(batch, 3)
    assert op._metadata(step2, lim) is not md
