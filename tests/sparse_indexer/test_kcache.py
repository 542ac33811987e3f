"""The paged K cache layout (docs/spec.md §4): block-major bytes, padded strides, the 4-D shape."""

import pytest
import torch

from sparse_indexer import cache_layout, cache_views, new_kv_cache, slots_from_block_table
from tests import oracle
from tests.cases import empty_cache, gen, random_fp8, random_scales

LAYOUTS = [(1, 64, 0, False), (16, 128, 0, False), (64, 64, 12, False), (16, 64, 4, True), (1, 128, 8, True),
           (64, 128, 0, True), (32, 64, 0, False)]
IDS = [f"bs{b}-D{d}-pad{p}-{'4d' if f else '3d'}" for b, d, p, f in LAYOUTS]


def by_hand(kv_bytes: torch.Tensor, b, t, bs, d, stride0):
    """Values and scale bytes of (block b, token t) straight from the docs/spec.md §4 formula."""
    v0 = b * stride0 + t * d
    s0 = b * stride0 + bs * d + 4 * t
    return kv_bytes[v0 : v0 + d], kv_bytes[s0 : s0 + 4]


@pytest.mark.parametrize("bs, d, pad, four_d", LAYOUTS, ids=IDS)
def test_new_kv_cache(bs, d, pad, four_d):
    kv = new_kv_cache(5, bs, d, block_pad=pad, four_d=four_d)
    want_shape = (5, bs, 1, d + 4) if four_d else (5, bs, d + 4)
    assert tuple(kv.shape) == want_shape and kv.dtype == torch.uint8
    assert kv.stride(0) == bs * (d + 4) + pad
    assert kv.stride(-1) == 1
    assert bool((kv == 0).all())
    lay = cache_layout(kv)
    assert (lay.num_blocks, lay.block_size, lay.head_dim, lay.block_stride) == (5, bs, d, bs * (d + 4) + pad)
    assert lay.num_slots == 5 * bs and lay.scale_offset == bs * d


def test_new_kv_cache_rejects_unaligned_pad():
    with pytest.raises(ValueError, match="block_pad"):
        new_kv_cache(2, 16, 64, block_pad=3)


@pytest.mark.parametrize("bs, d, pad, four_d", LAYOUTS, ids=IDS)
@pytest.mark.parametrize("dt", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["fn", "fnuz"])
def test_cache_views_write_the_spec_bytes(bs, d, pad, four_d, dt):
    nb = 3
    kv = empty_cache(nb, bs, d, pad=pad, four_d=four_d)
    g = gen(bs + d + pad)
    vals = random_fp8((nb, bs, d), dt, g)
    scales = random_scales(nb * bs, g).view(nb, bs)
    v, s = cache_views(kv, dt)
    assert v.shape == (nb, bs, d) and v.dtype == dt and s.shape == (nb, bs) and s.dtype == torch.float32
    v.copy_(vals)
    s.copy_(scales)
    flat = torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage())
    stride0 = bs * (d + 4) + pad
    for b in range(nb):
        for t in range(bs):
            vb, sb = by_hand(flat, b, t, bs, d, stride0)
            assert torch.equal(vb, vals[b, t].view(torch.uint8)), (b, t)
            assert torch.equal(sb, scales[b, t : t + 1].view(torch.uint8)), (b, t)
        assert bool((flat[b * stride0 + bs * (d + 4) : (b + 1) * stride0] == 0).all()), "padding was written"
    if bs == 1:  # only then is the layout "D values then 4 scale bytes" per token
        for b in range(nb):
            row = kv[b, 0].reshape(-1)
            assert torch.equal(row[:d], vals[b, 0].view(torch.uint8))
            assert torch.equal(row[d:], scales[b, :1].view(torch.uint8))
    # and the oracle's reader (which uses only the storage offset and stride) agrees
    slots = torch.arange(nb * bs)
    ov, osc = oracle.read_slots(kv, slots, dt)
    assert torch.equal(ov, oracle.decode(vals.reshape(-1, d)))
    assert torch.equal(osc, scales.reshape(-1).double())


def test_block_major_is_not_token_interleaved():
    kv = empty_cache(1, 16, 64)
    v, s = cache_views(kv, torch.float8_e4m3fn)
    s[0, 0] = 1.0  # bytes 00 00 80 3f at 16 * 64, not at 64
    flat = kv.reshape(-1)
    assert flat[16 * 64 : 16 * 64 + 4].tolist() == [0, 0, 0x80, 0x3F]
    assert flat[64:68].tolist() == [0, 0, 0, 0]


def test_views_of_a_cache_slice_of_a_bigger_allocation():
    # a per-layer cache carved out of a larger buffer: nonzero storage offset
    big = torch.zeros(4096 + 2 * 17 * 68, dtype=torch.uint8)
    kv = big[4096:].as_strided((2, 16, 68), (17 * 68, 68, 1), 4096)
    v, s = cache_views(kv, torch.float8_e4m3fn)
    s[1, 3] = 2.0
    off = 4096 + 17 * 68 + 16 * 64 + 12
    assert big[off : off + 4].tolist() == [0, 0, 0, 0x40]
    assert int(big[:4096].sum()) == 0


@pytest.mark.parametrize(
    "make, exc, match",
    [
        (lambda: torch.zeros(2, 16, 68, dtype=torch.int8), TypeError, "uint8"),
        (lambda: torch.zeros(2, 16, 100, dtype=torch.uint8), ValueError, "D"),
        (lambda: torch.zeros(2, 16, 2, 68, dtype=torch.uint8), ValueError, "kv_cache"),
        (lambda: torch.zeros(2, 16 * 68, dtype=torch.uint8), ValueError, "kv_cache"),
        (lambda: torch.zeros(2, 68, 16, dtype=torch.uint8).transpose(1, 2), ValueError, "contiguous"),
        (lambda: torch.zeros(2, 16, 136, dtype=torch.uint8)[:, :, ::2], ValueError, "contiguous"),
        (lambda: torch.zeros(2 * 16 * 68 + 2, dtype=torch.uint8).as_strided((2, 16, 68), (16 * 68 + 2, 68, 1)),
         ValueError, "multiple of 4"),
        (lambda: torch.zeros(2 * 16 * 68 + 8, dtype=torch.uint8)[2:].as_strided((2, 16, 68), (16 * 68, 68, 1), 2),
         ValueError, "aligned"),
        (lambda: [1, 2], TypeError, "kv_cache"),
    ],
)
def test_cache_layout_rejects(make, exc, match):
    with pytest.raises(exc, match=match):
        cache_layout(make())


def test_slots_from_block_table():
    bt = torch.tensor([[5, 2, 9], [0, 7, 1]], dtype=torch.int32)
    pos = torch.tensor([[0, 15, 16, 40], [3, 17, -1, 47]])
    got = slots_from_block_table(bt, pos, 16)
    assert got.dtype == torch.int64
    assert got.tolist() == [[80, 95, 32, 152], [3, 113, -1, 31]]
