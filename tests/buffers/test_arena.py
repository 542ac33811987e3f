"""allocate / carve / Buffers.from_arena: one arena, views at the planned offsets (docs/spec.md §9)."""

import pytest
import torch

from buffers import ALIGN, Buffers, IndexerLimits, allocate, carve, plan

LIM = IndexerLimits(max_model_len=64, max_num_batched_tokens=8, max_num_seqs=2, next_n=2, n_heads=32,
                    head_dim=64, prefill_k_tokens=70, max_logits_bytes=1000, with_qk=True)
PLAN = plan(LIM)


def aligned_arena(nbytes, extra=0):
    raw = torch.zeros(nbytes + 2 * ALIGN + extra, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    return raw, raw[start : start + nbytes + extra]


def check_views(bufs, arena):
    base = arena.data_ptr()
    for f in PLAN.fields:
        t = getattr(bufs, f.name)
        assert t.shape == f.shape and t.dtype == f.dtype, f.name
        assert t.data_ptr() == base + f.offset, f.name
        assert t.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr(), f.name


@pytest.mark.parametrize("arg", [LIM, PLAN], ids=["limits", "plan"])
def test_allocate(arg):
    b = allocate(arg)
    assert b.k_fp8.data_ptr() % ALIGN == 0
    for f in PLAN.fields:
        t = getattr(b, f.name)
        assert t.shape == f.shape and t.dtype == f.dtype
        assert t.data_ptr() - b.k_fp8.data_ptr() == f.offset
    assert len({t.untyped_storage().data_ptr() for t in b.tensors().values()}) == 1


def test_allocate_meta_device():
    b = allocate(LIM, device="meta")
    assert b.device == torch.device("meta")
    assert all(t.device.type == "meta" for t in b.tensors().values())


@pytest.mark.parametrize("how", ["from_arena", "carve"])
def test_from_arena_views_share_storage(how):
    _, arena = aligned_arena(PLAN.total_bytes, extra=512)
    b = Buffers.from_arena(PLAN, arena) if how == "from_arena" else carve(PLAN, arena)
    check_views(b, arena)
    b.logits[3] = 1.5
    off = PLAN["logits"].offset + 12
    assert torch.equal(arena[off : off + 4].view(torch.float32), torch.tensor([1.5]))
    b.k_scale.fill_(2.0)
    assert b.logits[3] == 1.5  # fields do not overlap
    arena[PLAN["k_fp8"].offset] = 0x38  # 1.0 in e4m3fn
    assert float(b.k_fp8[0, 0]) == 1.0


def test_from_arena_exact_size():
    _, arena = aligned_arena(PLAN.total_bytes)
    check_views(Buffers.from_arena(PLAN, arena), arena)


def test_from_arena_meta():
    b = Buffers.from_arena(PLAN, torch.empty(PLAN.total_bytes, dtype=torch.uint8, device="meta"))
    assert b.device.type == "meta" and b.logits.shape == PLAN["logits"].shape


def test_too_small():
    _, arena = aligned_arena(PLAN.total_bytes)
    with pytest.raises(ValueError, match="total_bytes") as info:
        Buffers.from_arena(PLAN, arena[: PLAN.total_bytes - 1])
    assert str(PLAN.total_bytes) in str(info.value)


def test_misaligned():
    _, arena = aligned_arena(PLAN.total_bytes, extra=ALIGN)
    for shift in (1, 4, 64, 128):
        with pytest.raises(ValueError, match="align"):
            Buffers.from_arena(PLAN, arena[shift : shift + PLAN.total_bytes])


@pytest.mark.parametrize(
    "bad, exc",
    [
        (lambda a: a.view(torch.int8), ValueError),
        (lambda a: a[: PLAN.total_bytes // 4 * 4].view(torch.float32), ValueError),
        (lambda a: a.view(2, -1), ValueError),
        (lambda a: a.tolist(), TypeError),
    ],
    ids=["int8", "float32", "2d", "list"],
)
def test_wrong_dtype_shape_type(bad, exc):
    _, arena = aligned_arena(PLAN.total_bytes)
    with pytest.raises(exc, match="arena"):
        Buffers.from_arena(PLAN, bad(arena))


def test_non_contiguous():
    raw = torch.zeros(2 * PLAN.total_bytes + 4 * ALIGN, dtype=torch.uint8)
    start = (-raw.data_ptr()) % ALIGN
    with pytest.raises(ValueError, match="contiguous"):
        Buffers.from_arena(PLAN, raw[start : start + 2 * PLAN.total_bytes : 2])


def test_plan_type_checked():
    _, arena = aligned_arena(PLAN.total_bytes)
    with pytest.raises(TypeError, match="plan"):
        carve(LIM, arena)
