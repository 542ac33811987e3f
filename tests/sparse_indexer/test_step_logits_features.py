"""The step with the limits' logits features: bfloat16 logits (``IndexerLimits.logits_dtype``) and
compressed prefill logits (``IndexerLimits.compressed_prefill_logits``). Every row's top-k is checked against the
float64 model: with bf16 logits a selected score may trail the k-th best by one bfloat16 rounding."""

from __future__ import annotations

import pytest
import torch

from tests.sparse_indexer.test_indexer import Scenario, check_topk, limits, run_step

BF16_RTOL = 2.0**-7  # two roundings of 2**-9 relative (the k-th and the selected score), x max|score|


def check(sel, sc, bf16: bool):
    if bf16:
        from sparse_indexer.testing import assert_topk

        assert_topk(sel, sc.model_scores(), rtol=BF16_RTOL, threshold=True)
    else:
        check_topk(sel, sc.model_scores(), sc.lim.topk)


STEPS = {
    "mixed": ([40, 7, 1, 100, 65], [1, 1, 1, 30, 65], 1, {}),
    "nonuniform-next_n2": ([90, 50, 33, 200, 120], [2, 1, 2, 40, 30], 2, {}),
    "several-chunks": ([300, 260, 90, 150], [40, 60, 30, 50], 1, dict(max_logits_bytes=4 * 300 * 70)),
    "split-request": ([500, 120], [200, 40], 1, dict(max_logits_bytes=4 * 500 * 30)),
}


@pytest.mark.parametrize("compressed", [False, True], ids=["full", "compressed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(STEPS))
def test_step_with_logits_features(backend, name, dtype, compressed):
    seq, qry, nn, extra = STEPS[name]
    lim = limits(next_n=nn, logits_dtype=dtype, compressed_prefill_logits=compressed, **extra)
    sc = Scenario(seq, qry, lim=lim, seed=len(name))
    md, sel = run_step(sc, backend)
    check(sel, sc, dtype == torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_compressed_step_fits_a_plan_too_small_for_full_rows(backend, dtype):
    """Two fresh 512-token prompts in one chunk: full logits are [1024, 1024], compressed [1024, 512]; the
    compressed plan holds only the latter, so the step must score compressed rows (and selects the same)."""
    lim = limits(logits_dtype=dtype, compressed_prefill_logits=True)
    sc = Scenario([512, 512], [512, 512], lim=lim, seed=7)
    md = sc.metadata()
    (c,) = md.prefill_chunks
    assert c.window == 512 and c.logits_cols == 512 and c.num_k_tokens == 1024
    from buffers import plan

    assert plan(lim)["logits"].shape[0] < 1024 * 1024
    md, sel = run_step(sc, backend)
    check(sel, sc, dtype == torch.bfloat16)


def test_compiled_step_with_bf16_and_compressed_logits():
    """torch.compile(fullgraph=True) of the step with bf16, compressed prefill logits: the same bytes as eager."""
    import sparse_indexer as si
    from buffers import allocate

    torch._dynamo.reset()
    lim = limits(next_n=2, n_heads=16, head_dim=64, topk=8, max_model_len=128, max_num_batched_tokens=96,
                 max_num_seqs=4, prefill_k_tokens=1024, logits_dtype=torch.bfloat16, compressed_prefill_logits=True)
    sc = Scenario([40, 7, 50, 30], [2, 1, 20, 30], lim=lim, seed=1)
    md = sc.metadata()
    assert md.prefill_chunks[0].window == 50

    def step(q, k, w, kv, md, bufs, out):
        si.sparse_attn_indexer(q, k, w, kv, md, bufs, out, backend="reference")

    bufs = allocate(lim)
    kv0 = sc.kv.clone()
    want = torch.full((md.num_tokens, lim.topk), 7, dtype=torch.int32)
    step(sc.q, sc.k, sc.w, sc.kv, md, bufs, want)
    sc.kv.copy_(kv0)
    got = torch.full_like(want, 7)
    torch.compile(step, fullgraph=True)(sc.q, sc.k, sc.w, sc.kv, md, bufs.split_storages(), got)
    assert torch.equal(got, want)


def test_compressed_chunk_windows_are_checked():
    """A compressed chunk whose window is narrower than its queries' key windows, or whose window fields are
    missing or of the wrong length, is refused when the metadata is built (before any step writes)."""
    import attrs

    lim = limits(compressed_prefill_logits=True)
    sc = Scenario([100, 60], [100, 60], lim=lim, seed=8)
    (c,) = sc.metadata().prefill_chunks
    assert c.window == 100
    with pytest.raises(ValueError, match="top-k windows"):
        attrs.evolve(c, window=50)
    with pytest.raises(ValueError, match="window = "):
        attrs.evolve(c, window=c.num_k_tokens + 1)
    with pytest.raises((TypeError, ValueError), match="window_ends"):
        attrs.evolve(c, window_ends=c.window_ends[:-1])
    with pytest.raises((TypeError, ValueError), match="window_starts"):
        attrs.evolve(c, window_starts=None)
