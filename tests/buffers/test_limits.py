"""IndexerLimits: defaults, validation, derived sizes (docs/spec.md §9)."""

import pytest
import torch

from buffers import IndexerLimits

BASE = dict(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=16)


def test_defaults_are_deepseek_v32():
    lim = IndexerLimits(**BASE)
    assert (lim.next_n, lim.n_heads, lim.head_dim, lim.topk, lim.block_size) == (1, 64, 128, 2048, 64)
    assert lim.fp8_dtype == torch.float8_e4m3fn
    assert lim.prefill_k_tokens == 131072  # max(max_model_len, 128K tokens): measured, docs/memory.md
    assert IndexerLimits(**{**BASE, "max_model_len": 1 << 20}).prefill_k_tokens == 1 << 20
    assert lim.max_logits_bytes == 2 << 30  # measured, docs/memory.md
    assert lim.with_qk is False
    assert lim.max_decode_logits_bytes is None


def test_derived_sizes():
    lim = IndexerLimits(**BASE, next_n=3, max_logits_bytes=4096)
    assert lim.max_decode_rows == 48
    assert lim.prefill_logits_elems == 1024
    assert (lim.decode_batch, lim.decode_batch_rows) == (16, 48)  # no budget: every request at once


def test_decode_budget():
    per_req = 3 * 1024 * 4  # next_n * max_model_len float32
    # a budget that holds every row changes nothing
    assert IndexerLimits(**BASE, next_n=3, max_decode_logits_bytes=16 * per_req).decode_batch == 16
    assert IndexerLimits(**BASE, next_n=3, max_decode_logits_bytes=10**12).decode_batch == 16
    lim = IndexerLimits(**BASE, next_n=3, max_decode_logits_bytes=5 * per_req + per_req - 1)
    assert (lim.decode_batch, lim.decode_batch_rows) == (5, 15)
    assert IndexerLimits(**BASE, next_n=3, max_decode_logits_bytes=per_req).decode_batch == 1
    with pytest.raises(ValueError, match="max_decode_logits_bytes=12287 must hold one decode request"):
        IndexerLimits(**BASE, next_n=3, max_decode_logits_bytes=per_req - 1)
    with pytest.raises(ValueError, match="max_decode_logits_bytes"):
        IndexerLimits(**BASE, max_decode_logits_bytes=0)
    with pytest.raises(TypeError, match="max_decode_logits_bytes"):
        IndexerLimits(**BASE, max_decode_logits_bytes=1.5)


def test_frozen():
    lim = IndexerLimits(**BASE)
    with pytest.raises(AttributeError):
        lim.topk = 1


@pytest.mark.parametrize(
    "field, value, exc",
    [
        ("max_model_len", 0, ValueError),
        ("max_model_len", -1, ValueError),
        ("max_model_len", 1.5, TypeError),
        ("max_num_seqs", True, TypeError),
        ("n_heads", 0, ValueError),
        ("topk", "2048", TypeError),
        ("block_size", 0, ValueError),
        ("max_logits_bytes", 0, ValueError),
        ("next_n", 5, ValueError),
        ("next_n", 0, ValueError),
        ("head_dim", 96, ValueError),
        ("fp8_dtype", torch.bfloat16, ValueError),
        ("with_qk", 1, TypeError),
    ],
)
def test_invalid_field_is_named(field, value, exc):
    kw = dict(BASE)
    kw[field] = value
    with pytest.raises(exc, match=field):
        IndexerLimits(**kw)


def test_prefill_k_tokens_must_hold_one_request():
    with pytest.raises(ValueError, match="prefill_k_tokens"):
        IndexerLimits(**BASE, prefill_k_tokens=1023)
    assert IndexerLimits(**BASE, prefill_k_tokens=1024).prefill_k_tokens == 1024


def test_batched_tokens_at_least_seqs():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        IndexerLimits(max_model_len=8, max_num_batched_tokens=3, max_num_seqs=4)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_accepted_shapes(fp8):
    for h in (32, 64):
        for d in (64, 128):
            for n in (1, 2, 3, 4):
                IndexerLimits(**BASE, n_heads=h, head_dim=d, next_n=n, fp8_dtype=fp8)
