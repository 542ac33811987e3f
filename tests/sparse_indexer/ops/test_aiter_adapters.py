"""The aiter backend's adapters, on the CPU against the reference (no AMD hardware, no aiter).

Pure adapters are checked directly (preshuffled cache writer/gather, fn -> fnuz operands, absolute -> local
top-k indices). The op functions of ``ops/<op>/aiter.py`` run with ``gcn_arch`` patched and a stand-in
``aiter`` package whose kernels follow aiter's documented conventions (paged: one causal length per request,
preshuffled or plain cache, cells outside the windows left alone; prefill top-k: absolute indices).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import sparse_indexer as si
from buffers import CacheFormat
from sparse_indexer.ops.fp8_mqa_logits import aiter as mqa_aiter
from sparse_indexer.ops.fp8_mqa_logits import reference as mqa_ref
from sparse_indexer.ops.fp8_paged_mqa_logits import aiter as paged_aiter
from sparse_indexer.ops.fp8_paged_mqa_logits import reference as paged_ref
from sparse_indexer.ops.gather_k_cache import aiter as gather_aiter
from sparse_indexer.ops.gather_k_cache import reference as gather_ref
from sparse_indexer.ops.top_k_per_row import aiter as topk_aiter
from sparse_indexer.ops.top_k_per_row import reference as topk_ref
from sparse_indexer.ops.write_k_cache import aiter as write_aiter
from sparse_indexer.ops.write_k_cache import reference as write_ref

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


def unshuffle(kv: torch.Tensor) -> torch.Tensor:
    """A preshuffled 3-D cache -> the plain layout, by reshaping the 16x16 tiles (independent of the writer)."""
    nb, bs, width = kv.shape
    d = width - 4
    raw = kv.reshape(nb, bs * width)
    vals = raw[:, : bs * d].reshape(nb, bs // 16, d // 16, 16, 16).permute(0, 1, 3, 2, 4).reshape(nb, bs * d)
    return torch.cat([vals, raw[:, bs * d :]], 1).reshape(nb, bs, width)


def random_cache_step(g, nb, bs, d, fp8, n_tok):
    slots = torch.randperm(nb * bs, generator=g)[:n_tok].long()
    slots[::7] = -1
    k = torch.randn(n_tok + 2, d, generator=g).to(torch.bfloat16)
    return k, slots


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("fp8", [FN, FNUZ], ids=["e4m3fn", "e4m3fnuz"])
def test_preshuffled_writer_and_gather(bs, d, fp8):
    g = torch.Generator().manual_seed(bs + d)
    nb = 5
    k, slots = random_cache_step(g, nb, bs, d, fp8, 3 * bs)
    shuffled = si.new_kv_cache(nb, bs, d, block_pad=8)
    plain = si.new_kv_cache(nb, bs, d, block_pad=8)
    write_aiter.write_k_cache_preshuffled(k, shuffled, slots, scale_fmt="ue8m0", fp8_dtype=fp8)
    write_ref.write_k_cache(k, plain, slots, scale_fmt="ue8m0", fp8_dtype=fp8)
    assert not torch.equal(shuffled, plain)
    assert torch.equal(unshuffle(shuffled.contiguous()), plain.contiguous())
    bt = torch.randperm(nb, generator=g)[None, :4].int().repeat(2, 1)
    cu = torch.tensor([0, 2 * bs + 3, 3 * bs + 4], dtype=torch.int32)
    outs = [(torch.zeros(4 * bs, d, dtype=fp8), torch.zeros(4 * bs)) for _ in range(2)]
    gather_aiter.gather_k_cache_preshuffled(shuffled, bt, cu, out_k=outs[0][0], out_scale=outs[0][1])
    gather_ref.gather_k_cache(plain, bt, cu, out_k=outs[1][0], out_scale=outs[1][1])
    assert torch.equal(outs[0][0].view(torch.uint8), outs[1][0].view(torch.uint8))
    assert torch.equal(outs[0][1], outs[1][1])


def test_preshuffle_offsets_is_a_permutation_of_the_value_region():
    offs = write_aiter.preshuffle_offsets(64, 128)
    assert torch.equal(offs.flatten().sort().values, torch.arange(64 * 128))
    assert offs[17, 33].item() == 1 * 16 * 128 + 2 * 256 + 1 * 16 + 1


@pytest.mark.parametrize("arch,fp8,bs,expect", [
    ("gfx942", FNUZ, 64, True), ("gfx942", FN, 64, False), ("gfx950", FN, 16, True), ("gfx950", FN, 1, False),
    ("gfx950", FN, 8, False), ("gfx90a", FN, 64, False), (None, FN, 64, False)])
def test_layout_rule(arch, fp8, bs, expect):
    assert write_aiter.preshuffled(bs, fp8, arch) is expect


def test_fnuz_operands_give_identical_logits():
    g = torch.Generator().manual_seed(1)
    m, n, h, d = 6, 40, 8, 64
    q, _ = si.quantize_q(torch.randn(m, h, d, generator=g))
    k, ks = si.quantize_k(torch.randn(n, d, generator=g))
    k[0, 0] = -0.0  # -0 is NaN's byte in e4m3fnuz: the conversion must not reinterpret bytes
    w = torch.randn(m, h, generator=g)
    s, e = torch.zeros(m, dtype=torch.int32), torch.full((m,), n, dtype=torch.int32)
    out = [torch.empty(m, n) for _ in range(2)]
    mqa_ref.fp8_mqa_logits(q, k, ks, w, s, e, out=out[0], clean=True)
    ops = mqa_aiter.fnuz_operands(q, k, ks, w)
    assert ops[0].dtype == ops[1].dtype == FNUZ
    mqa_ref.fp8_mqa_logits(*ops, s, e, out=out[1], clean=True)
    assert torch.equal(out[0], out[1])
    v, sc = si.fn_to_fnuz(k, ks)
    assert torch.equal(v.view(torch.uint8), ops[1].view(torch.uint8)) and torch.equal(sc, ops[2])


def test_localize_absolute_topk():
    g = torch.Generator().manual_seed(2)
    r, w, topk = 6, 50, 8
    logits = torch.randn(r, w, generator=g)
    starts = torch.tensor([0, 3, 10, 20, 40, 45], dtype=torch.int32)
    ends = torch.tensor([50, 30, 15, 20, 50, 46], dtype=torch.int32)  # lens 50, 27, 5, 0, 10, 1
    expected = torch.empty(r, topk, dtype=torch.int32)
    topk_ref.top_k_per_row(logits, starts, ends, out=expected)
    absolute = torch.where(expected >= 0, expected + starts[:, None], -1)
    absolute[2] = absolute[2].flip(0)  # a kernel may order a short row's entries any way
    topk_aiter.localize_topk(absolute, starts)
    topk_aiter.short_rows(absolute, starts, ends)
    assert torch.equal(absolute, expected)


def test_per_sequence_context_lens():
    nn = 3
    full = torch.tensor([10, 2, 0, 7])
    causal = (full[:, None] - nn + 1 + torch.arange(nn)).clamp(min=0).int()
    assert torch.equal(paged_aiter.per_sequence_context_lens(causal, nn), full.int())
    packed = torch.tensor([[8, 9, 0], [0, 0, 0], [5, 6, 7]], dtype=torch.int32)  # d = 2, 0, 3
    assert paged_aiter.per_sequence_context_lens(packed, nn).tolist() == [10, 0, 7]


# ------------------------------------------------------------------------------------------------ stand-in aiter
def fake_paged(q, kv4, weights, out, ctx, block_table, max_model_len, Preshuffle=False, KVBlockSize=1, **_):
    kv = kv4[:, :, 0, :]
    assert kv.shape[1] == KVBlockSize
    plain = unshuffle(kv.contiguous()) if Preshuffle else kv
    tmp = torch.empty_like(out)
    paged_ref.fp8_paged_mqa_logits(q, plain, weights, ctx, block_table, out=tmp, clean=True)
    inside = torch.arange(out.shape[1])[None] < si.row_limits(ctx, q.shape[1])[:, None]
    out.copy_(torch.where(inside, tmp, out))  # writes only inside the windows


def fake_stage1(q, kv4, weights, out_qk, ctx, block_table, max_model_len, ChunkQ=64, **_):
    b, nn, h, d = q.shape
    for head in range(h):
        tmp = torch.empty(b * nn, out_qk.shape[2])
        w = torch.zeros_like(weights)
        w[:, head] = weights[:, head]
        paged_ref.fp8_paged_mqa_logits(q, kv4[:, :, 0, :], w, ctx, block_table, out=tmp, clean=True)
        out_qk[head] = tmp


def fake_cache_format(num_heads, head_size, page_size):  # aiter's published rule
    return {"n_per_tile": 32 if head_size <= 64 or num_heads >= 32 else 16, "d_per_tile": 16,
            "block_kv": min(64, page_size)}


def fake_paged_mxfp4(q, q_scale, kv4, weights, context_lens, block_table, max_model_len, *, out_logits,
                     clean_logits=True, row_ends=None, **_):
    """aiter's semantics: ``context_lens`` one per sequence, ``row_ends`` (when given) each row's own bound;
    writes only inside the windows with ``clean_logits=False``."""
    b, nn, h, half = q.shape
    f = fake_cache_format(h, 2 * half, kv4.shape[1])
    order = f"tiled:{f['n_per_tile']},{f['d_per_tile']},{64 // f['n_per_tile']}"
    ends = row_ends.view(b, nn) if row_ends is not None else context_lens
    tmp = torch.empty_like(out_logits)
    paged_ref.fp8_paged_mqa_logits(q, kv4[:, :, 0, :], weights, ends, block_table, out=tmp, clean=True,
                                   cache_values="mxfp4", cache_order=order, q_scale=q_scale)
    inside = torch.arange(out_logits.shape[1])[None] < si.row_limits(ends, nn)[:, None]
    out_logits.copy_(torch.where(inside, tmp, out_logits if not clean_logits else float("-inf")))


def fake_mqa(q, k, ks, w, s, e, clean_logits=True):
    assert q.dtype == k.dtype
    full = torch.full((q.shape[0], (k.shape[0] + 255) // 256 * 256), 123.0)
    mqa_ref.fp8_mqa_logits(q, k, ks, w, s, e, out=full[:, : k.shape[0]], clean=clean_logits)
    return full[:, : k.shape[0]]


def fake_topk_prefill(logits, starts, ends, indices, values, num_rows, stride0, stride1, k=2048, stable=False):
    topk_ref.top_k_per_row(logits, starts, ends, out=indices)
    indices.copy_(torch.where(indices >= 0, indices + starts[:, None], -1))  # absolute, like aiter


@pytest.fixture
def fake_aiter(monkeypatch):
    def mod(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    for name in ("aiter", "aiter.ops", "aiter.ops.triton", "aiter.ops.triton.attention"):
        mod(name)
    mod("aiter.ops.triton.attention.pa_mqa_logits", deepgemm_fp8_paged_mqa_logits=fake_paged,
        deepgemm_fp8_paged_mqa_logits_stage1=fake_stage1)
    mod("aiter.ops.triton.attention.fp8_mqa_logits", fp8_mqa_logits=fake_mqa)
    mod("aiter.ops.triton.attention.pa_mqa_logits_mxfp4", cache_format=fake_cache_format,
        paged_mxfp4_mqa_logits=fake_paged_mxfp4)
    mod("aiter.ops.topk", top_k_per_row_prefill=fake_topk_prefill)

    def set_arch(arch):
        for m in (write_aiter, gather_aiter, paged_aiter, mqa_aiter, topk_aiter):
            monkeypatch.setattr(m, "gcn_arch", lambda device, a=arch: a)

    return set_arch


@pytest.mark.parametrize("arch,fp8,bs", [("gfx942", FNUZ, 16), ("gfx950", FN, 64), ("gfx950", FN, 1),
                                          ("gfx90a", FN, 1)])
@pytest.mark.parametrize("clean", [True, False])
def test_paged_logits_through_aiter_adapter(fake_aiter, arch, fp8, bs, clean):
    fake_aiter(arch)
    g = torch.Generator().manual_seed(bs)
    b, nn, h, d, nb = 3, 2, 8, 64, 40
    kv_a, kv_r = si.new_kv_cache(nb, bs, d), si.new_kv_cache(nb, bs, d)
    slots = torch.arange(nb * bs).long()
    k = torch.randn(nb * bs, d, generator=g)
    write_aiter.write_k_cache(k, kv_a, slots, scale_fmt="ue8m0", fp8_dtype=fp8)  # preshuffled when the rule says
    write_ref.write_k_cache(k, kv_r, slots, scale_fmt="ue8m0", fp8_dtype=fp8)
    q, _ = si.quantize_q(torch.randn(b, nn, h, d, generator=g).view(b * nn, h, d), fp8_dtype=fp8)
    q = q.view(b, nn, h, d)
    w = torch.randn(b * nn, h, generator=g)
    width = 4 * 16 * 3
    ctx = torch.tensor([5, 100, 0], dtype=torch.int32)
    bt = torch.randint(0, nb, (b, (width + bs - 1) // bs), generator=g, dtype=torch.int32)
    out_a, out_r = torch.full((b * nn, width), 9.0), torch.full((b * nn, width), 9.0)
    qk = torch.empty(h, b * nn, width) if arch == "gfx90a" else None
    paged_aiter.fp8_paged_mqa_logits(q, kv_a, w, ctx, bt, out=out_a, clean=clean, qk=qk)
    paged_ref.fp8_paged_mqa_logits(q, kv_r, w, ctx, bt, out=out_r, clean=clean)
    inside = torch.arange(width)[None] < si.row_limits(ctx, nn)[:, None]
    torch.testing.assert_close(out_a[inside], out_r[inside], rtol=1e-6, atol=1e-6)
    if clean:
        assert (out_a[~inside] == float("-inf")).all()


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("clean", [True, False])
def test_mxfp4_paged_logits_through_aiter_adapter(fake_aiter, two_d, clean):
    fake_aiter("gfx950")
    g = torch.Generator().manual_seed(7)
    b, nn, h, d, bs, nb = 3, 2, 64, 128, 64, 12
    fmt = CacheFormat.tiled_mxfp4(32)
    assert paged_aiter.mxfp4_order(h, d, bs) == fmt.order
    kv = si.new_kv_cache(nb, bs, d, mxfp4=True)
    si.write_k_cache(torch.randn(nb * bs, d, generator=g), kv, torch.arange(nb * bs), cache_format=fmt,
                     backend="reference")
    qv, qs = si.quantize_q_mxfp4(torch.randn(b * nn, h, d, generator=g))
    qv, qs = qv.view(b, nn, h, d // 2), qs.view(b, nn, h, d // 32)
    w = torch.randn(b * nn, h, generator=g)
    cl = torch.tensor([70, 250, 1], dtype=torch.int32)
    if two_d:  # a packed decode: request 1 has one real row
        cl = torch.tensor([[69, 70], [250, 0], [0, 1]], dtype=torch.int32)
    bt = torch.randperm(nb, generator=g)[: b * 4].view(b, 4).int()
    want = torch.full((b * nn, 300), 9.0)
    got = want.clone()
    paged_ref.fp8_paged_mqa_logits(qv, kv, w, cl, bt, out=want, clean=clean, cache_values="mxfp4",
                                   cache_order=fmt.order, q_scale=qs)
    paged_aiter.fp8_paged_mqa_logits(qv, kv, w, cl, bt, out=got, clean=clean, cache_values="mxfp4",
                                     cache_order=fmt.order, q_scale=qs)
    inside = torch.arange(300)[None] < si.row_limits(cl, nn)[:, None]
    torch.testing.assert_close(got[inside], want[inside], rtol=0, atol=0)
    assert (got[~inside] == (float("-inf") if clean else 9.0)).all()
    with pytest.raises(NotImplementedError, match="order"):
        paged_aiter.fp8_paged_mqa_logits(qv, kv, w, cl, bt, out=got, clean=clean, cache_values="mxfp4", q_scale=qs)
    fake_aiter("gfx942")
    with pytest.raises(NotImplementedError, match="gfx950"):
        paged_aiter.fp8_paged_mqa_logits(qv, kv, w, cl, bt, out=got, clean=clean, cache_values="mxfp4",
                                         cache_order=fmt.order, q_scale=qs)


def test_paged_adapter_refuses_what_aiter_cannot_read(fake_aiter):
    q = torch.zeros(1, 1, 8, 64, dtype=FN)
    args = (si.new_kv_cache(2, 64, 64), torch.zeros(1, 8), torch.tensor([3], dtype=torch.int32),
            torch.zeros(1, 2, dtype=torch.int32))
    fake_aiter("gfx942")
    with pytest.raises(NotImplementedError, match="float8_e4m3fnuz"):
        paged_aiter.fp8_paged_mqa_logits(q, *args, out=torch.empty(1, 128), clean=False)
    fake_aiter("gfx90a")
    with pytest.raises(NotImplementedError, match="block_size 1"):
        paged_aiter.fp8_paged_mqa_logits(q, *args, out=torch.empty(1, 128), clean=False)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_prefill_logits_and_topk_through_aiter_adapters(fake_aiter, arch):
    fake_aiter(arch)
    g = torch.Generator().manual_seed(3)
    m, n, h, d, topk = 5, 3000, 8, 64, 2048
    q, _ = si.quantize_q(torch.randn(m, h, d, generator=g))
    k, ks = si.quantize_k(torch.randn(n, d, generator=g))
    w = torch.randn(m, h, generator=g)
    s = torch.tensor([0, 0, 100, 2500, 10], dtype=torch.int32)
    e = torch.tensor([3000, 2100, 2900, 2600, 10], dtype=torch.int32)
    out_a, out_r = torch.empty(m, n), torch.empty(m, n)
    mqa_aiter.fp8_mqa_logits(q, k, ks, w, s, e, out=out_a, clean=True)
    mqa_ref.fp8_mqa_logits(q, k, ks, w, s, e, out=out_r, clean=True)
    assert torch.equal(out_a, out_r)
    if arch != "gfx950":
        with pytest.raises(NotImplementedError, match="gfx950"):
            topk_aiter.top_k_per_row(out_r, s, e, out=torch.empty(m, topk, dtype=torch.int32))
        return
    sel_a, sel_r = torch.empty(m, topk, dtype=torch.int32), torch.empty(m, topk, dtype=torch.int32)
    topk_aiter.top_k_per_row(out_r, s, e, out=sel_a)
    topk_ref.top_k_per_row(out_r, s, e, out=sel_r)
    assert torch.equal(sel_a.sort(1).values, sel_r.sort(1).values)


def test_aiter_backend_unavailable_here_names_what_is_missing():
    assert "aiter" not in si.available("cpu")
    with pytest.raises(si.BackendUnavailable, match="aiter"):
        si.top_k_per_row(torch.zeros(1, 4), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                         out=torch.empty(1, 2, dtype=torch.int32), backend="aiter")


@pytest.mark.parametrize("arch, want", [("gfx942", FNUZ), ("gfx940", FNUZ), ("gfx950", FN), (None, FN)])
def test_native_fp8_per_arch(monkeypatch, arch, want):
    """The one arch -> FP8 rule (the bench and the self-check pick their format with it)."""
    from sparse_indexer.ops import _aiter

    monkeypatch.setattr(_aiter, "gcn_arch", lambda device: arch)
    assert _aiter.native_fp8(torch.device("cpu")) == want
