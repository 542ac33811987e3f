"""Error texts name the bound that was crossed and what to change."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from buffers import BufferTooSmall, IndexerLimits, allocate


def _paged(context_lens, width):
    kv = si.new_kv_cache(4, 64, 128)
    q = torch.zeros(2, 1, 64, 128).to(torch.float8_e4m3fn)
    si.fp8_paged_mqa_logits(q, kv, torch.zeros(2, 64), torch.tensor(context_lens, dtype=torch.int32),
                            torch.zeros(2, 64, dtype=torch.int32), out=torch.empty(2, width))


def test_one_sided_range_has_no_infinity():
    kv = si.new_kv_cache(4, 64, 128)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 12288 is >= 256") as e:
        si.write_k_cache(torch.randn(2, 128), kv, torch.tensor([0, 12288]))
    assert "inf" not in str(e.value)
    with pytest.raises(ValueError, match=r"row_starts\[0\] = -1 is < 0") as e:
        si.top_k_per_row(torch.zeros(2, 10), torch.tensor([-1, 0], dtype=torch.int32),
                         torch.tensor([5, 3], dtype=torch.int32), out=torch.empty(2, 4, dtype=torch.int32))
    assert "inf" not in str(e.value)


def test_context_too_long_names_only_the_bound_crossed():
    with pytest.raises(ValueError, match="context_lens") as e:
        _paged([4097, 3], 5000)  # within W = 5000, beyond the block table's 64 * 64 = 4096 positions
    assert "block_table covers" in str(e.value) and "W =" not in str(e.value)
    with pytest.raises(ValueError, match="context_lens") as e:
        _paged([5001, 3], 5000)  # beyond both
    assert "W = 5000" in str(e.value) and "block_table covers" in str(e.value)
    with pytest.raises(ValueError, match="context_lens") as e:
        _paged([301, 3], 300)  # beyond W only
    assert "W = 300" in str(e.value) and "block_table" not in str(e.value)


def test_buffer_too_small_says_which_limit_to_raise():
    lim = IndexerLimits(max_model_len=256, max_num_batched_tokens=8, max_num_seqs=2, topk=64, block_size=16)
    bufs = allocate(lim)
    with pytest.raises(BufferTooSmall, match=r"topk_scratch.*max_num_seqs \* next_n"):
        bufs.topk_scratch_view(3)
    with pytest.raises(BufferTooSmall, match=r"k_fp8.*prefill_k_tokens"):
        bufs.k_view(lim.prefill_k_tokens + 1)
    with pytest.raises(BufferTooSmall, match=r"logits.*max_logits_bytes"):
        bufs.logits_view(bufs.logits_capacity, 2)
