"""write_k_cache (docs/spec.md §3, 4): quantize and store, byte-exact against the oracle."""

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from sparse_indexer import cache_views, write_k_cache
from tests import oracle
from tests.cases import (
    FP8,
    FP8_IDS,
    empty_cache,
    expect_error,
    gen,
    hyp_settings,
    skip_unsupported,
    snapshots,
    storage_snapshot,
    supported,
)


def test_hand_computed(backend):
    # D = 64, block_size 2: slot 3 is block 1, offset 1. amax = 2 -> scale 2/448 -> ue8m0 2**-7.
    kv = empty_cache(2, 2, 64)
    k = torch.zeros(1, 64)
    k[0, :3] = torch.tensor([1.0, -2.0, 0.5])
    write_k_cache(k, kv, torch.tensor([3]), backend=backend)
    flat = kv.reshape(-1)
    stride0 = 2 * 68
    # values / 2**-7 = 128, -256, 64: e4m3fn bytes 0x70, 0xF8, 0x68
    assert flat[stride0 + 64 : stride0 + 67].tolist() == [0x70, 0xF8, 0x68]
    assert int(flat[stride0 + 67 : stride0 + 128].sum()) == 0
    # scale 2**-7 = 0x3C000000, little-endian, after the 2 * 64 value bytes, 4 bytes into the scale region
    assert flat[stride0 + 128 + 4 : stride0 + 136].tolist() == [0, 0, 0, 0x3C]
    flat[stride0 + 64 : stride0 + 67] = 0
    flat[stride0 + 132 : stride0 + 136] = 0
    assert int(flat.sum()) == 0, "bytes outside the slot were written"


def test_hand_computed_plain_scale_fnuz(backend):
    skip_unsupported(backend, torch.float8_e4m3fnuz)
    kv = empty_cache(1, 1, 64)
    k = torch.zeros(2, 64)
    k[0, 0], k[0, 1] = 2.24, -1.12  # scale = 2.24 / 224 = 0.01 (float32) -> values 224, -112
    write_k_cache(k, kv, torch.tensor([0]), fp8_dtype=torch.float8_e4m3fnuz, scale_fmt=None, backend=backend)
    row = kv.reshape(-1)
    # e4m3fnuz (bias 8): 224 = 1.75 * 2**7 -> exponent 15, mantissa 6 -> 0x7E; -112 -> 0x80 | 0x76
    assert row[:2].tolist() == [0x7E, 0xF6]
    assert float(row[64:68].view(torch.float32)) == oracle.f32(oracle.f32(2.24) / 224.0)


def _check_written(kv, before, k, slots, dt, scale_fmt):
    """Slots in ``slots`` (>= 0) hold the oracle's quantization of their row; every other byte is unchanged."""
    keep = [i for i, s in enumerate(slots.tolist()) if s >= 0]
    kept_slots = slots[keep].long()
    if keep:
        want_v, want_s, exact = oracle.quantize(k[keep], dt, scale_fmt)
        got_v, got_s = oracle.read_slots(kv, kept_slots, dt)
        assert torch.equal(got_s, want_s), "scales differ"
        bad = got_v != want_v
        if scale_fmt is None:
            bad &= oracle.midpoint_distance(exact, dt) > 2.0**-20
        assert not bool(bad.any()), f"{int(bad.sum())} values differ, first at {bad.nonzero()[0].tolist()}"
    # no other byte changed: copy the written slots' bytes into the snapshot and compare every byte
    now = storage_snapshot(kv)
    tmp = before.clone()
    vb, sb = oracle.read_slot_bytes(kv, kept_slots)
    oracle.write_slots(tmp.as_strided(kv.shape, kv.stride(), kv.storage_offset()), kept_slots, vb,
                       sb.contiguous().view(torch.float32).view(-1))
    assert torch.equal(now, tmp), f"{int((now != tmp).sum())} bytes outside the written slots changed"


@hyp_settings()
@given(
    d=st.sampled_from([64, 128]),
    bs=st.sampled_from([1, 16, 32, 64]),
    nb=st.integers(1, 4),
    pad=st.sampled_from([0, 4, 36]),
    four_d=st.booleans(),
    dt=st.sampled_from(FP8),
    scale_fmt=st.sampled_from(["ue8m0", None]),
    in_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    frac=st.floats(0, 1),
    extra_rows=st.integers(0, 3),
    neg=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_matches_oracle(backend, d, bs, nb, pad, four_d, dt, scale_fmt, in_dtype, frac, extra_rows, neg, seed):
    assume(supported(backend, dt))
    g = gen(seed)
    kv = empty_cache(nb, bs, d, pad=pad, four_d=four_d)
    flat = torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage())
    flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8))  # stale contents + padding
    n_slots = nb * bs
    s = int(round(frac * min(n_slots, 40)))
    slots = torch.randperm(n_slots, generator=g)[:s]
    if s:
        slots[torch.randperm(s, generator=g)[: min(neg, s)]] = -torch.randint(1, 5, (1,), generator=g)
    t = s + extra_rows
    k = (torch.randn(t, d, generator=g) * torch.exp2(torch.randint(-8, 8, (t, 1), generator=g).float()))
    k = k.to(in_dtype)
    before = storage_snapshot(kv)
    write_k_cache(k, kv, slots, fp8_dtype=dt, scale_fmt=scale_fmt, backend=backend)
    _check_written(kv, before, k[:s], slots, dt, scale_fmt)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_int32_slots_and_all_negative(backend, slot_dtype):
    kv = empty_cache(3, 16, 128, pad=8)
    k = torch.randn(5, 128, generator=gen(1))
    before = storage_snapshot(kv)
    write_k_cache(k, kv, torch.full((5,), -1, dtype=slot_dtype), backend=backend)
    assert torch.equal(storage_snapshot(kv), before)
    write_k_cache(k[:0], kv, torch.zeros(0, dtype=slot_dtype), backend=backend)
    assert torch.equal(storage_snapshot(kv), before)
    slots = torch.tensor([47, -1, 0, 16, -7], dtype=slot_dtype)
    write_k_cache(k, kv, slots, backend=backend)
    _check_written(kv, before, k, slots, torch.float8_e4m3fn, "ue8m0")


@pytest.mark.parametrize("dt", FP8, ids=FP8_IDS)
def test_large_slot_offsets(backend, dt):
    """The last slot of a cache whose byte size needs more than 2**24 (int64 offsets, docs/spec.md §4)."""
    skip_unsupported(backend, dt)
    nb, bs = 2100, 64
    kv = empty_cache(nb, bs, 128)
    k = torch.randn(2, 128, generator=gen(2))
    slots = torch.tensor([nb * bs - 1, (nb // 2) * bs + 5])
    before = storage_snapshot(kv)
    write_k_cache(k, kv, slots, fp8_dtype=dt, backend=backend)
    _check_written(kv, before, k, slots, dt, "ue8m0")


def _args():
    kv = empty_cache(2, 16, 64, pad=4)
    return torch.randn(4, 64), kv, torch.tensor([0, 5, -1, 31])


def _flat(kv):
    return torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage())


BAD = [
    ("k float64", lambda k, kv, s: (k.double(), kv, s), {}, TypeError, "k"),
    ("k 3-D", lambda k, kv, s: (k[None], kv, s), {}, ValueError, "k"),
    ("k strided", lambda k, kv, s: (torch.randn(64, 4).T, kv, s), {}, ValueError, "k"),
    ("k wrong D", lambda k, kv, s: (torch.randn(4, 128), kv, s), {}, ValueError, "k.shape[1]"),
    ("kv int8", lambda k, kv, s: (k, kv.view(torch.int8), s), {}, TypeError, "kv_cache"),
    ("kv 2-D", lambda k, kv, s: (k, _flat(kv)[: 2 * 16 * 68].view(2, -1), s), {}, ValueError, "kv_cache"),
    ("kv meta", lambda k, kv, s: (k, torch.empty(2, 16, 68, dtype=torch.uint8, device="meta"), s), {},
     ValueError, "kv_cache"),
    ("slots meta", lambda k, kv, s: (k, kv, s.to("meta")), {}, ValueError, "slot_mapping"),
    ("slots float", lambda k, kv, s: (k, kv, s.float()), {}, TypeError, "slot_mapping"),
    ("slots 2-D", lambda k, kv, s: (k, kv, s[None]), {}, ValueError, "slot_mapping"),
    ("slots longer than k", lambda k, kv, s: (k[:3], kv, s), {}, ValueError, "slot_mapping"),
    ("slot beyond cache", lambda k, kv, s: (k, kv, torch.tensor([0, 32, -1, 1])), {}, ValueError, "slot_mapping"),
    ("bad scale_fmt", lambda k, kv, s: (k, kv, s), {"scale_fmt": "ue4m3"}, ValueError, "scale_fmt"),
    ("bad fp8_dtype", lambda k, kv, s: (k, kv, s), {"fp8_dtype": torch.bfloat16}, ValueError, "fp8_dtype"),
    ("unknown backend", lambda k, kv, s: (k, kv, s), {"backend": "cuda-magic"}, ValueError, "backend"),
]


@pytest.mark.parametrize("what, mutate, kw, exc, name", BAD, ids=[b[0] for b in BAD])
def test_validation(backend, what, mutate, kw, exc, name):
    k, kv, s = _args()
    args = mutate(k, kv, s)
    kw = {"backend": backend, **kw}
    watch = [kv] + [a for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"]
    expect_error(exc, name, lambda: write_k_cache(*args, **kw), watch=watch)


def test_cache_aliasing_k_is_rejected(backend):
    kv = empty_cache(2, 16, 64)
    k = _flat(kv)[: 4 * 64 * 4].view(torch.float32).view(4, 64)
    k.fill_(1.0)
    expect_error(ValueError, "kv_cache", lambda: write_k_cache(k, kv, torch.tensor([20, 21, 22, 23]),
                                                              backend=backend), watch=[kv])


def test_nothing_written_on_error_snapshots(backend):
    # the slot check names the first offender and runs before any write
    k, kv, _ = _args()
    before = snapshots(kv)
    with pytest.raises(ValueError, match=r"slot_mapping\[2\]"):
        write_k_cache(k, kv, torch.tensor([0, 1, 99, 2]), backend=backend)
    assert torch.equal(storage_snapshot(kv), before[0])


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
@pytest.mark.parametrize("dt", FP8, ids=FP8_IDS)
def test_non_finite_rows(backend, dt, scale_fmt):
    """docs/spec.md §3: a row with a NaN stores scale NaN and NaN values; a row whose amax is infinite stores scale
    +inf, NaN at the infinite entries and 0 elsewhere; every NaN is one byte (0x7F e4m3fn, 0x80 e4m3fnuz)."""
    skip_unsupported(backend, dt)
    k = torch.randn(4, 64, generator=gen(21))
    k[0, 3] = float("nan")
    k[1, 7] = float("inf")
    k[2, 1] = float("-inf")
    k[3, 9] = -float("nan")  # a NaN with its sign bit set: the same stored bytes
    kv = empty_cache(2, 4, 64)
    write_k_cache(k, kv, torch.arange(4), backend=backend, scale_fmt=scale_fmt, fp8_dtype=dt)
    values, scales = (x[0] for x in cache_views(kv, dt))
    nan_byte = 0x7F if dt == torch.float8_e4m3fn else 0x80
    raw = values.view(torch.uint8)
    assert scales[0].isnan() and bool((raw[0] == nan_byte).all())
    for row, col in ((1, 7), (2, 1)):
        assert scales[row] == float("inf")
        assert int(raw[row, col]) == nan_byte
        others = torch.cat([values[row, :col], values[row, col + 1:]]).float()
        assert bool((others == 0).all())
    assert scales[3].isnan() and bool((raw[3] == nan_byte).all())
    assert int(scales[0].view(torch.int32)) == int(scales[3].view(torch.int32)) == 0x7FC00000
    want = empty_cache(2, 4, 64)
    write_k_cache(k, want, torch.arange(4), backend="reference", scale_fmt=scale_fmt, fp8_dtype=dt)
    assert torch.equal(kv, want), "bytes differ from the reference backend"
