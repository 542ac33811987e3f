"""gather_k_cache (docs/spec.md §4): paged keys of several requests into one dense workspace."""

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from sparse_indexer import gather_k_cache
from tests import oracle
from tests.cases import (
    FP8,
    empty_cache,
    expect_error,
    gen,
    hyp_settings,
    int32,
    paged_case,
    supported,
)

SENTINEL_BYTE = 0x55
SENTINEL_SCALE = -7.0


def _outs(n, d, dt):
    out_k = torch.full((n, d), SENTINEL_BYTE, dtype=torch.uint8).view(dt)
    out_s = torch.full((n,), SENTINEL_SCALE)
    return out_k, out_s


def _check(case, out_k, out_s):
    total = sum(case.lens)
    want_k, want_s = case.dense()
    assert torch.equal(out_k[:total].view(torch.uint8), want_k.view(torch.uint8)), "gathered values differ"
    assert torch.equal(out_s[:total], want_s), "gathered scales differ"
    assert bool((out_k[total:].view(torch.uint8) == SENTINEL_BYTE).all()), "rows >= cu_seq_lens[-1] were written"
    assert bool((out_s[total:] == SENTINEL_SCALE).all()), "scales >= cu_seq_lens[-1] were written"


def test_hand_computed(backend):
    kv = empty_cache(3, 2, 64, pad=4)
    codes = torch.arange(6 * 64, dtype=torch.int32).remainder(0x70).to(torch.uint8).view(6, 64)
    oracle.write_slots(kv, torch.arange(6), codes, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]))
    bt = int32([[2, 0], [1, 1]])
    cu = int32([0, 3, 4])
    out_k, out_s = _outs(6, 64, torch.float8_e4m3fn)
    gather_k_cache(kv, bt, cu, out_k=out_k, out_scale=out_s, backend=backend,
                  cache_fp8_dtype=out_k.dtype)
    # request 0: slots 4, 5 (block 2) then 0 (block 0); request 1: slot 2 (block 1, offset 0)
    assert out_s.tolist() == [5.0, 6.0, 1.0, 3.0, SENTINEL_SCALE, SENTINEL_SCALE]
    assert torch.equal(out_k[:4].view(torch.uint8), codes[[4, 5, 0, 2]])
    assert bool((out_k[4:].view(torch.uint8) == SENTINEL_BYTE).all())


@hyp_settings()
@given(
    lens=st.lists(st.integers(0, 70), min_size=0, max_size=4),
    d=st.sampled_from([64, 128]),
    bs=st.sampled_from([1, 16, 32, 64]),
    pad=st.sampled_from([0, 4, 20]),
    four_d=st.booleans(),
    dt=st.sampled_from(FP8),
    extra=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_matches_oracle(backend, lens, d, bs, pad, four_d, dt, extra, seed):
    assume(supported(backend, dt))
    case = paged_case(gen(seed), lens, bs, d, dt, pad=pad, four_d=four_d, pow2_scales=False)
    out_k, out_s = _outs(sum(lens) + extra, d, dt)
    gather_k_cache(case.kv, case.block_table, case.cu_seq_lens, out_k=out_k, out_scale=out_s, backend=backend,
                  cache_fp8_dtype=out_k.dtype)
    _check(case, out_k, out_s)


def test_junk_in_unused_block_table_entries(backend):
    case = paged_case(gen(5), [17, 0, 33, 16], 16, 128, torch.float8_e4m3fn, spare_cols=2, junk_unused=True)
    out_k, out_s = _outs(80, 128, torch.float8_e4m3fn)
    gather_k_cache(case.kv, case.block_table, case.cu_seq_lens, out_k=out_k, out_scale=out_s, backend=backend,
                  cache_fp8_dtype=out_k.dtype)
    _check(case, out_k, out_s)


def test_workspace_views_of_one_arena(backend):
    """out_k and out_scale as disjoint views of one byte arena (as Buffers hands them out) are fine."""
    case = paged_case(gen(6), [40, 9], 16, 64, torch.float8_e4m3fn)
    arena = torch.full((64 * 64 + 256 + 64 * 4,), SENTINEL_BYTE, dtype=torch.uint8)
    out_k = arena[: 64 * 64].view(torch.float8_e4m3fn).view(64, 64)
    out_s = arena[64 * 64 + 256 :].view(torch.float32)
    out_s.fill_(SENTINEL_SCALE)
    gather_k_cache(case.kv, case.block_table, case.cu_seq_lens, out_k=out_k, out_scale=out_s, backend=backend,
                  cache_fp8_dtype=out_k.dtype)
    _check(case, out_k, out_s)
    assert bool((arena[64 * 64 : 64 * 64 + 256] == SENTINEL_BYTE).all())


def _base():
    case = paged_case(gen(7), [20, 5], 16, 64, torch.float8_e4m3fn, spare_cols=1)
    out_k, out_s = _outs(30, 64, torch.float8_e4m3fn)
    return dict(kv_cache=case.kv, block_table=case.block_table, cu_seq_lens=case.cu_seq_lens, out_k=out_k,
                out_scale=out_s)


def _kv_flat(a):
    return torch.empty(0, dtype=torch.uint8).set_(a["kv_cache"].untyped_storage())


BAD = [
    ("kv dtype", lambda a: {"kv_cache": a["kv_cache"].view(torch.int8)}, TypeError, "kv_cache"),
    ("kv width", lambda a: {"kv_cache": torch.zeros(3, 16, 100, dtype=torch.uint8)}, ValueError, "kv_cache"),
    ("bt int64", lambda a: {"block_table": a["block_table"].long()}, TypeError, "block_table"),
    ("bt 1-D", lambda a: {"block_table": a["block_table"][0]}, ValueError, "block_table"),
    ("bt strided", lambda a: {"block_table": a["block_table"].T.contiguous().T}, ValueError, "block_table"),
    ("bt meta", lambda a: {"block_table": a["block_table"].to("meta")}, ValueError, "block_table"),
    ("bt id beyond cache", lambda a: {"block_table": int32([[0, 99, 0], [1, 0, 0]])}, ValueError, "block_table"),
    ("bt negative id", lambda a: {"block_table": int32([[0, 1, 0], [-1, 0, 0]])}, ValueError, "block_table"),
    ("cu int64", lambda a: {"cu_seq_lens": a["cu_seq_lens"].long()}, TypeError, "cu_seq_lens"),
    ("cu shape", lambda a: {"cu_seq_lens": int32([0, 20])}, ValueError, "cu_seq_lens"),
    ("cu meta", lambda a: {"cu_seq_lens": a["cu_seq_lens"].to("meta")}, ValueError, "cu_seq_lens"),
    ("cu[0] != 0", lambda a: {"cu_seq_lens": int32([1, 20, 25])}, ValueError, "cu_seq_lens"),
    ("cu decreasing", lambda a: {"cu_seq_lens": int32([0, 20, 15])}, ValueError, "cu_seq_lens"),
    ("request too long", lambda a: {"cu_seq_lens": int32([0, 49, 50])}, ValueError, "cu_seq_lens"),
    ("total > N", lambda a: {"cu_seq_lens": int32([0, 20, 31])}, ValueError, "cu_seq_lens"),
    ("out_k float32", lambda a: {"out_k": torch.zeros(30, 64)}, TypeError, "out_k"),
    ("out_k wrong D", lambda a: {"out_k": torch.zeros(30, 128, dtype=torch.float8_e4m3fn)}, ValueError, "out_k"),
    ("out_k 3-D", lambda a: {"out_k": torch.zeros(30, 1, 64, dtype=torch.float8_e4m3fn)}, ValueError, "out_k"),
    ("out_k strided", lambda a: {"out_k": torch.zeros(64, 30, dtype=torch.float8_e4m3fn).T}, ValueError,
     "out_k"),
    ("out_k meta", lambda a: {"out_k": torch.empty(30, 64, dtype=torch.float8_e4m3fn, device="meta")},
     ValueError, "out_k"),
    ("out_scale shape", lambda a: {"out_scale": torch.zeros(29)}, ValueError, "out_scale"),
    ("out_scale dtype", lambda a: {"out_scale": torch.zeros(30, dtype=torch.float64)}, TypeError, "out_scale"),
    ("out_scale meta", lambda a: {"out_scale": torch.zeros(30, device="meta")}, ValueError, "out_scale"),
    ("out_k aliases kv", lambda a: {"out_k": _kv_flat(a)[: 30 * 64].view(torch.float8_e4m3fn).view(30, 64)},
     ValueError, "out_k"),
    ("out_scale aliases kv", lambda a: {"out_scale": _kv_flat(a)[:120].view(torch.float32)}, ValueError,
     "out_scale"),
    ("out_scale aliases out_k", lambda a: {"out_scale": a["out_k"].view(torch.uint8).view(-1)[:120].view(
        torch.float32)}, ValueError, "out_k"),
]


@pytest.mark.parametrize("what, change, exc, name", BAD, ids=[b[0] for b in BAD])
def test_validation(backend, what, change, exc, name):
    a = _base()
    a.update(change(a))
    watch = [t for t in a.values() if t.device.type != "meta"]
    expect_error(exc, name, lambda: gather_k_cache(**a, backend=backend), watch=watch)
