"""Bad input that must not pass silently: metadata that contradicts itself, caches read in the wrong FP8 format,
caches no op can read, and the defined results of non-finite and int32 input (docs/spec.md §3, §4, §7)."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from buffers import IndexerLimits, allocate

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


def _limits(**kw):
    base = dict(max_model_len=1024, max_num_batched_tokens=64, max_num_seqs=4, n_heads=32, head_dim=64, topk=16,
                block_size=16)
    base.update(kw)
    return IndexerLimits(**base)


def _slots(block_table, seq, qry, bs):
    """The slot of every new token through the block table (docs/spec.md §4)."""
    out = []
    for i, (s, q) in enumerate(zip(seq, qry)):
        pos = torch.arange(s - q, s)[None, :]
        out.append(si.slots_from_block_table(block_table[i:i + 1], pos, bs)[0])
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


# --- build_metadata: every length, block id and slot -------------------------------------------------------


@pytest.mark.parametrize("next_n", [1, 2])
def test_query_longer_than_context_raises_before_the_step_writes(next_n):
    """query_len > seq_len (e.g. seq_lens [1, 500], query_lens [2, 2]) raises naming the request,
    before any key is written."""
    lim = _limits(next_n=next_n)
    bt = torch.arange(64, dtype=torch.int32).view(2, 32)
    with pytest.raises(ValueError, match=r"request 0: query_len 2 > seq_len 1"):
        si.build_metadata([1, 500], [2, 2], bt, torch.arange(4), lim, num_blocks=64)
    with pytest.raises(ValueError, match=r"request 0: query_len 2 > seq_len 1"):
        si.build_metadata([1, 500], [2, 2], bt, torch.arange(4), lim)  # without num_blocks too


def test_slot_that_contradicts_the_block_table_raises():
    lim = _limits()
    bt = torch.tensor([[3, 1, 0, 0], [2, 5, 4, 0]], dtype=torch.int32)
    seq, qry = [20, 40], [1, 5]
    sm = _slots(bt, seq, qry, 16)
    si.build_metadata(seq, qry, bt, sm, lim, num_blocks=8)  # consistent: passes
    for t, bad in ((0, int(sm[1])), (3, 0), (2, int(sm[2]) + 16 * 8)):
        s = sm.clone()
        s[t] = bad
        with pytest.raises(ValueError, match=rf"slot_mapping\[{t}\] = {bad}, but token {t} is request"):
            si.build_metadata(seq, qry, bt, s, lim)
        with pytest.raises(ValueError, match=rf"slot_mapping\[{t}\]"):
            si.build_metadata(seq, qry, bt, s, lim, num_blocks=8)
    s = sm.clone()
    s[4], s[5] = -1, -2  # negative: the token writes nothing (write_k_cache skips any negative slot)
    si.build_metadata(seq, qry, bt, s, lim)


def test_negative_block_ids():
    """A slot written through a negative block id raises (without num_blocks too); with num_blocks every block id
    in use is checked against the cache."""
    lim = _limits()
    bt = torch.tensor([[3, -1, 0, 0]], dtype=torch.int32)
    slots = torch.cat([torch.arange(48, 64), torch.arange(100, 104)])  # positions 16..19 written through block -1
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1 \(the block of request 0's position 16"):
        si.build_metadata([20], [20], bt, slots, lim)
    si.build_metadata([20], [20], bt, torch.full((20,), -1), lim)  # nothing written through block 1: unchecked
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1 \(a block request 0 uses\)"):
        si.build_metadata([20], [20], bt, torch.full((20,), -1), lim, num_blocks=8)
    si.build_metadata([16], [16], bt, torch.full((16,), -1), lim, num_blocks=8)  # block 1 unused: any id


def test_int32_slot_mapping_is_accepted_and_kept_as_int64():
    lim = _limits()
    bt = torch.tensor([[3, 1, 0, 0], [2, 5, 4, 0]], dtype=torch.int32)
    seq, qry = [20, 40], [1, 5]
    sm = _slots(bt, seq, qry, 16)
    a = si.build_metadata(seq, qry, bt, sm, lim, num_blocks=8)
    b = si.build_metadata(seq, qry, bt, sm.to(torch.int32), lim, num_blocks=8)
    assert b.slot_mapping.dtype == torch.int64 and torch.equal(a.slot_mapping, b.slot_mapping)
    kv32, kv64 = si.new_kv_cache(8, 16, 64), si.new_kv_cache(8, 16, 64)
    k = torch.randn(6, 64)
    si.write_k_cache(k, kv64, sm)
    si.write_k_cache(k, kv32, sm.to(torch.int32))
    assert torch.equal(kv32, kv64)


def test_one_step_rule_is_documented_where_build_metadata_is():
    doc = si.build_metadata.__doc__
    assert "One step only" in doc and "previous step's slots" in doc


# --- cache formats ------------------------------------------------------------------------------------------


def _paged_inputs(q_dtype, cache_dtype, g):
    kv = si.new_kv_cache(4, 16, 64)
    k = torch.randn(40, 64, generator=g)
    si.write_k_cache(k, kv, torch.arange(40), fp8_dtype=cache_dtype)
    # e4m3fn values of magnitude < 240: each is exactly an e4m3fnuz value too (§2)
    q = (torch.randn(2, 1, 32, 64, generator=g) * 4).to(FN).float().to(q_dtype)
    w = torch.randn(2, 32, generator=g)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    bt = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]], dtype=torch.int32)
    return q, kv, w, lens, bt


def test_fnuz_query_against_an_unstated_cache_format_raises_naming_both():
    q, kv, w, lens, bt = _paged_inputs(FNUZ, FN, torch.Generator().manual_seed(1))
    out = torch.full((2, 64), 7.0)
    with pytest.raises(TypeError, match="float8_e4m3fnuz.*float8_e4m3fn") as e:
        si.fp8_paged_mqa_logits(q, kv, w, lens, bt, out=out)
    assert "cache_fp8_dtype" in str(e.value)
    assert bool((out == 7.0).all()), "out was written"
    with pytest.raises(TypeError, match="cache_fp8_dtype"):
        si.fp8_paged_mqa_logits(q, kv, w, lens, bt, out=out, cache_fp8_dtype=torch.float16)


@pytest.mark.parametrize("cache_dtype", [FN, FNUZ])
def test_stated_cache_format_reads_each_operand_in_its_own_format(cache_dtype):
    """A stated format equal to q's is the plain case; a different one is an explicit mix (the reference computes
    it exactly: the cache's values read in the stated format)."""
    g = torch.Generator().manual_seed(2)
    q, kv, w, lens, bt = _paged_inputs(FNUZ, cache_dtype, g)
    out = si.fp8_paged_mqa_logits(q, kv, w, lens, bt, out=torch.empty(2, 64), cache_fp8_dtype=cache_dtype)
    values, scales = si.cache_views(kv, cache_dtype)
    k = values.reshape(-1, 64)[:40].double()
    ks = scales.reshape(-1)[:40].double()
    s = torch.einsum("bhd,nd->bhn", q[:, 0].double(), k).relu()
    want = (s * w.double()[:, :, None]).sum(1) * ks[None, :]
    for r, n in enumerate((40, 17)):
        torch.testing.assert_close(out[r, :n].double(), want[r, :n], rtol=1e-5, atol=1e-5)
        assert bool((out[r, n:] == float("-inf")).all())
    # the same numbers as the e4m3fn form of the same queries (the factor 2 between the formats, §2)
    if cache_dtype == FN:
        q_fn = q.float().to(FN)
        assert torch.equal(q_fn.float(), q.float())
        same = si.fp8_paged_mqa_logits(q_fn, kv, w, lens, bt, out=torch.empty(2, 64))
        torch.testing.assert_close(same, out)


def test_mixed_formats_are_left_to_the_reference_by_the_kernels():
    pytest.importorskip("triton")
    from sparse_indexer.ops.fp8_paged_mqa_logits import triton as tri

    q, kv, w, lens, bt = _paged_inputs(FNUZ, FN, torch.Generator().manual_seed(3))
    out = torch.full((2, 64), 7.0)
    with pytest.raises(NotImplementedError, match="mix"):
        tri.fp8_paged_mqa_logits(q, kv, w, lens, bt, out=out, clean=True, cache_fp8_dtype=FN)
    assert bool((out == 7.0).all())


def test_gather_out_k_must_be_in_the_cache_format():
    kv = si.new_kv_cache(2, 16, 64)
    si.write_k_cache(torch.randn(20, 64), kv, torch.arange(20))
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    out_k, out_s = torch.zeros(24, 64, dtype=FNUZ), torch.full((24,), 5.0)
    with pytest.raises(TypeError, match="out_k is torch.float8_e4m3fnuz.*torch.float8_e4m3fn") as e:
        si.gather_k_cache(kv, bt, cu, out_k=out_k, out_scale=out_s)
    assert "on purpose" not in str(e.value)  # (a gather copies bytes: no mix to offer)
    with pytest.raises(TypeError, match="copies the cache's bytes"):
        si.gather_k_cache(kv, bt, cu, out_k=out_k, out_scale=out_s, cache_fp8_dtype=FN)
    assert bool((out_s == 5.0).all()) and not bool(out_k.view(torch.uint8).any()), "outputs were written"
    si.gather_k_cache(kv, bt, cu, out_k=out_k, out_scale=out_s, cache_fp8_dtype=FNUZ)  # stated: the bytes as fnuz
    fn_k = torch.zeros(24, 64, dtype=FN)
    si.gather_k_cache(kv, bt, cu, out_k=fn_k, out_scale=out_s)
    assert torch.equal(fn_k.view(torch.uint8), out_k.view(torch.uint8))


def test_the_step_reads_the_cache_in_the_limits_format():
    lim = _limits(fp8_dtype=FNUZ)
    bufs = allocate(lim, "cpu")
    bt = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    md = si.build_metadata([30], [30], bt, _slots(bt, [30], [30], 16), lim, num_blocks=4)
    kv = si.new_kv_cache(4, 16, 64)
    q, _ = si.quantize_q(torch.randn(30, 32, 64), fp8_dtype=FNUZ)
    out = torch.empty(30, 16, dtype=torch.int32)
    si.sparse_attn_indexer(q, torch.randn(30, 64), torch.randn(30, 32), kv, md, bufs, out)
    assert out[29].ge(0).all() and out[0, 0] == 0 and bool((out[0, 1:] == -1).all())
    with pytest.raises(TypeError, match="float8_e4m3fn.*float8_e4m3fnuz"):
        si.sparse_attn_indexer(q.float().to(FN), None, torch.randn(30, 32), kv, md, bufs, out)


# --- caches no op can read, non-finite quantization -----------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(head_dim=96), "head_dim must be one of"),
    (dict(head_dim=256), "head_dim must be one of"),
    (dict(block_size=0), "block_size must be an int >= 1"),
    (dict(num_blocks=-1), "num_blocks must be an int >= 0"),
    (dict(block_size=2.0), "block_size must be an int"),
])
def test_new_kv_cache_rejects_what_no_op_reads(kw, match):
    args = dict(num_blocks=2, block_size=16, head_dim=64)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        si.new_kv_cache(args.pop("num_blocks"), args.pop("block_size"), **args)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
@pytest.mark.parametrize("dt", [FN, FNUZ])
def test_quantize_non_finite(dt, scale_fmt):
    """docs/spec.md §3: NaN -> scale NaN, values NaN; infinite amax -> scale +inf, NaN at the infinities, 0
    elsewhere (before the definition, ue8m0 turned a NaN scale into 1.0)."""
    x = torch.randn(3, 2, 64)
    x[0, 0, 5] = float("nan")
    x[1, 1, 3] = float("-inf")
    q, s = si.quantize_q(x, fp8_dtype=dt, scale_fmt=scale_fmt)
    assert s[0, 0].isnan() and bool(q[0, 0].float().isnan().all())
    assert s[1, 1] == float("inf") and q[1, 1, 3].float().isnan()
    assert bool((q[1, 1, :3].float() == 0).all()) and bool((q[1, 1, 4:].float() == 0).all())
    assert bool(torch.isfinite(s[2]).all()) and bool(torch.isfinite(s[0, 1]))
    k, ks = si.quantize_k(x[:, 0], fp8_dtype=dt, scale_fmt=scale_fmt)
    assert ks[0].isnan() and torch.isfinite(ks[1])
    nan_byte = 0x7F if dt == FN else 0x80
    assert bool((q[0, 0].view(torch.uint8) == nan_byte).all())
