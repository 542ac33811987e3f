"""Buffers: the record's validators, views and BufferTooSmall (docs/spec.md §9)."""

import attrs
import pytest
import torch

from buffers import Buffers, BufferTooSmall, IndexerLimits, allocate

LIM = IndexerLimits(max_model_len=100, max_num_batched_tokens=8, max_num_seqs=4, next_n=2, n_heads=32,
                    head_dim=64, prefill_k_tokens=150, max_logits_bytes=4000, with_qk=True)


@pytest.fixture
def bufs():
    return allocate(LIM)


def fields(**over):
    kw = dict(k_fp8=torch.zeros(10, 64, dtype=torch.float8_e4m3fn), k_scale=torch.zeros(10),
              logits=torch.zeros(50), qk=None)
    kw.update(over)
    return kw


def test_buffer_too_small_is_value_error_and_names_everything():
    e = BufferTooSmall("logits", 1234, 99, "decode logits")
    assert isinstance(e, ValueError)
    assert (e.field, e.needed, e.available) == ("logits", 1234, 99)
    msg = str(e)
    for part in ("'logits'", "1234", "99", "decode logits"):
        assert part in msg


def test_properties(bufs):
    assert bufs.device == torch.device("cpu")
    assert bufs.fp8_dtype == torch.float8_e4m3fn
    assert bufs.head_dim == 64
    assert bufs.k_capacity == 150
    assert bufs.logits_capacity == max(4 * 2 * 100, 1000)
    spec = {"k_fp8", "k_scale", "logits", "qk"}
    tensors = bufs.tensors()
    assert spec <= set(tensors)  # backends may add scratch fields (docs/spec.md §9)
    assert bufs.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert bufs.nbytes >= 150 * 64 + 150 * 4 + 800 * 4 + 32 * 8 * 100 * 4


def test_k_view(bufs):
    k, s = bufs.k_view(37)
    assert k.shape == (37, 64) and s.shape == (37,)
    assert k.data_ptr() == bufs.k_fp8.data_ptr() and s.data_ptr() == bufs.k_scale.data_ptr()
    assert bufs.k_view(150)[0].shape[0] == 150
    with pytest.raises(BufferTooSmall) as info:
        bufs.k_view(151)
    assert (info.value.field, info.value.needed, info.value.available) == ("k_fp8", 151, 150)


def test_logits_view(bufs):
    v = bufs.logits_view(8, 100)
    assert v.shape == (8, 100) and v.is_contiguous() and v.data_ptr() == bufs.logits.data_ptr()
    v.fill_(3.0)
    assert bool((bufs.logits[:800] == 3.0).all())
    assert bufs.logits_view(0, 5).shape == (0, 5)
    with pytest.raises(BufferTooSmall) as info:
        bufs.logits_view(11, 100)
    assert (info.value.field, info.value.needed, info.value.available) == ("logits", 1100, 1000)
    assert bufs.logits_view(10, 100).shape == (10, 100)
    with pytest.raises(ValueError, match="rows"):
        bufs.logits_view(-1, 3)


def test_qk_view(bufs):
    v = bufs.qk_view(3, 50)
    assert v.shape == (32, 3, 50) and v.data_ptr() == bufs.qk.data_ptr()
    v[1, 0, 0] = 7.0
    assert float(bufs.qk.view(32, -1)[1, 0]) == 7.0
    with pytest.raises(BufferTooSmall) as info:
        bufs.qk_view(9, 100)
    assert info.value.field == "qk" and info.value.needed == 32 * 900 and info.value.available == 32 * 800


def test_qk_absent():
    b = allocate(attrs.evolve(LIM, with_qk=False))
    assert b.qk is None and "qk" not in b.tensors()
    with pytest.raises(BufferTooSmall, match="qk") as info:
        b.qk_view(1, 1)
    assert info.value.available == 0


def test_frozen_and_identity_equality(bufs):
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        bufs.logits = torch.zeros(3)
    other = Buffers(**bufs.tensors())
    assert other != bufs and bufs == bufs


def test_fnuz_record():
    b = allocate(attrs.evolve(LIM, fp8_dtype=torch.float8_e4m3fnuz))
    assert b.fp8_dtype == torch.float8_e4m3fnuz


@pytest.mark.parametrize(
    "over, exc, name",
    [
        (dict(k_fp8=torch.zeros(10, 64)), TypeError, "k_fp8"),
        (dict(k_fp8=torch.zeros(10, 64, 1, dtype=torch.float8_e4m3fn)), ValueError, "k_fp8"),
        (dict(k_fp8=torch.zeros(64, 10, dtype=torch.float8_e4m3fn).T), ValueError, "k_fp8"),
        (dict(k_fp8="not a tensor"), TypeError, "k_fp8"),
        (dict(k_scale=torch.zeros(10, dtype=torch.float64)), TypeError, "k_scale"),
        (dict(k_scale=torch.zeros(11)), ValueError, "k_scale"),
        (dict(k_scale=torch.zeros(20)[::2]), ValueError, "k_scale"),
        (dict(logits=torch.zeros(5, 10)), ValueError, "logits"),
        (dict(logits=torch.zeros(50, dtype=torch.float16)), TypeError, "logits"),  # float32 or bfloat16 only
        (dict(qk=torch.zeros(2, 3)), ValueError, "qk"),
        (dict(qk=torch.zeros(2, 3, 4, dtype=torch.int32)), TypeError, "qk"),
        (dict(logits=torch.zeros(50, device="meta")), ValueError, "logits"),
        (dict(k_scale=torch.zeros(10, device="meta")), ValueError, "k_scale"),
        (dict(qk=torch.zeros(2, 3, 4, device="meta")), ValueError, "qk"),
    ],
)
def test_validators_name_the_field(over, exc, name):
    with pytest.raises(exc, match=name):
        Buffers(**fields(**over))


def test_valid_record_from_plain_tensors():
    b = Buffers(**fields(qk=torch.zeros(2, 3, 4)))
    assert b.k_capacity == 10 and b.qk_view(1, 12).shape == (2, 1, 12)


def test_topk_scratch_view(bufs):
    ws = bufs.topk_scratch
    assert ws is not None and ws.dtype == torch.int32 and ws.dim() == 2 and ws.shape[0] == 4 * 2
    v = bufs.topk_scratch_view(3)
    assert v.shape == (3, ws.shape[1]) and v.data_ptr() == ws.data_ptr()
    with pytest.raises(BufferTooSmall) as info:
        bufs.topk_scratch_view(9)
    assert info.value.field == "topk_scratch"
    assert "topk_scratch" in bufs.tensors() and bufs.split_storages().topk_scratch.data_ptr() == ws.data_ptr()


def test_topk_scratch_optional_and_not_a_pytree_leaf(bufs):
    from torch.utils import _pytree

    b = Buffers(k_fp8=bufs.k_fp8, k_scale=bufs.k_scale, logits=bufs.logits)
    assert b.topk_scratch is None and "topk_scratch" not in b.tensors()
    with pytest.raises(BufferTooSmall):
        b.topk_scratch_view(1)
    leaves, spec = _pytree.tree_flatten(bufs)
    assert all(x is not bufs.topk_scratch for x in leaves)
    assert _pytree.tree_unflatten(leaves, spec).topk_scratch is None
