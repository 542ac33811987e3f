"""Declared cache formats (``buffers.CacheFormat``, docs/spec.md §4): the FP8 format of the values, the scale
encoding (``"float32"`` or ``"ue8m0x4"``) and the byte order (``"flat"`` or ``"preshuffled"``).

Bytes of every format are built here by hand from a cache in the plain format (written by the library): the scale
bytes rewritten as four UE8M0 exponents (vLLM's ``pack_ue8m0_x4``), the values of each block moved to the 16 x 16
tile offsets. The readers (``fp8_paged_mqa_logits``, ``gather_k_cache``) must give exactly what they give for the
plain cache; the step with e4m3fnuz queries against an e4m3fn cache (DeepSeek-V4 on gfx942) must match a float64
model. Run with ``SPARSE_INDEXER_TEST_BACKENDS=triton TRITON_INTERPRET=1`` for the Triton kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

import sparse_indexer as si
from buffers import CacheFormat, IndexerLimits, allocate
from sparse_indexer import kcache
from sparse_indexer.testing import assert_topk

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
D = 64
FORMATS = [(scale, order) for scale in ("float32", "ue8m0x4") for order in ("flat", "preshuffled")]


def reads(backend: str, fmt: CacheFormat, q_dtype=None) -> bool:
    """Whether ``backend``'s readers take ``fmt`` (queries in ``q_dtype``; ``None``: the cache's format)."""
    mixed = q_dtype is not None and q_dtype != fmt.fp8_dtype
    if backend == "reference" or (fmt.scale == "float32" and fmt.order == "flat" and not mixed):
        return True
    return backend == "triton" and fmt.order == "flat" and not mixed


def by_hand(plain: torch.Tensor, scale: str, order: str) -> torch.Tensor:
    """A new cache holding ``plain``'s keys (a 3-D plain-format cache, unpadded) in ``scale`` / ``order``, byte by
    byte: UE8M0 bytes ``(bits(scale) >> 23) & 0xFF`` four times; value ``(t, d)`` at ``(t // 16) * 16 * D + (d //
    16) * 256 + (t % 16) * 16 + d % 16`` inside its block (loops over the tiles, not the library's formula)."""
    nb, bs, width = plain.shape
    d = width - 4
    src = plain.reshape(nb, bs * width)
    out = src.clone()
    if order == "preshuffled":
        vals = src[:, : bs * d].reshape(nb, bs, d)
        dst = out[:, : bs * d]
        for t in range(bs):
            for d0 in range(0, d, 16):
                at = (t // 16) * 16 * d + (d0 // 16) * 256 + (t % 16) * 16
                dst[:, at : at + 16] = vals[:, t, d0 : d0 + 16]
    if scale == "ue8m0x4":
        bits = src[:, bs * d :].contiguous().view(torch.int32)  # [nb, bs]
        e = ((bits >> 23) & 0xFF).to(torch.uint8)
        out[:, bs * d :] = e.unsqueeze(-1).expand(nb, bs, 4).reshape(nb, bs * 4)
    return out.reshape(nb, bs, width)


def plain_cache(nb: int, bs: int, fp8, g) -> torch.Tensor:
    """A cache of ``nb`` blocks, every slot written (ue8m0 power-of-two scales, as ue8m0x4 needs)."""
    kv = si.new_kv_cache(nb, bs, D)
    si.write_k_cache(torch.randn(nb * bs, D, generator=g), kv, torch.randperm(nb * bs, generator=g),
                     fp8_dtype=fp8, backend="reference")
    return kv


# ------------------------------------------------------------------------------------------------ the encodings


def test_ue8m0_bytes_decode_exactly():
    e = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = kcache.decode_ue8m0(e).double()
    want = torch.tensor([2.0 ** (b - 127) for b in range(255)], dtype=torch.float64)
    assert torch.equal(got[:255], want)  # (byte 0: the subnormal 2 ** -127)
    assert math.isnan(got[255].item())  # 0xFF: NaN (OCP MX), what pack_ue8m0_x4 stores for a NaN or inf scale
    s = want[1:255].float()
    words = kcache.encode_ue8m0x4(s)
    assert torch.equal(words.view(torch.uint8).view(-1, 4), e[1:255, None].expand(-1, 4))
    assert torch.equal(kcache.decode_ue8m0((words & 0xFF).to(torch.uint8)), s)


def test_preshuffled_offsets_are_aiters_and_a_permutation():
    from sparse_indexer.ops._aiter import preshuffle_offsets

    for bs in (16, 64):
        offs = kcache.preshuffled_offsets(bs, D)
        assert torch.equal(offs, preshuffle_offsets(bs, D))
        assert torch.equal(offs.flatten().sort().values, torch.arange(bs * D))
    with pytest.raises(ValueError, match="multiples of 16"):
        kcache.preshuffled_offsets(8, D)


@pytest.mark.parametrize("scale,order", FORMATS)
@pytest.mark.parametrize("fp8", [FN, FNUZ])
def test_write_k_cache_in_a_format_writes_the_hand_built_bytes(scale, order, fp8):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(70, D, generator=g)
    slots = torch.randperm(4 * 32, generator=g)[:70]
    slots[5] = -1  # skipped
    plain, kv = si.new_kv_cache(4, 32, D), si.new_kv_cache(4, 32, D)
    si.write_k_cache(k, plain, slots, fp8_dtype=fp8)
    si.write_k_cache(k, kv, slots, cache_format=CacheFormat(fp8_dtype=fp8, scale=scale, order=order))
    assert torch.equal(kv, by_hand(plain, scale, order))


def test_write_k_cache_refuses_what_a_format_cannot_hold():
    kv, k, slots = si.new_kv_cache(2, 16, D), torch.randn(4, D), torch.arange(4)
    with pytest.raises(ValueError, match="powers of two"):
        si.write_k_cache(k, kv, slots, scale_fmt=None, cache_format=CacheFormat(scale="ue8m0x4"))
    with pytest.raises(ValueError, match="disagrees"):
        si.write_k_cache(k, kv, slots, fp8_dtype=FNUZ, cache_format=CacheFormat(fp8_dtype=FN, scale="ue8m0x4"))
    with pytest.raises(ValueError, match="multiple of 16"):
        si.write_k_cache(k, si.new_kv_cache(2, 8, D), slots, cache_format=CacheFormat(order="preshuffled"))
    assert not bool(kv.any())
    if "triton" in si.available("cpu"):  # (the Triton writer writes the plain format only)
        with pytest.raises(NotImplementedError):
            si.write_k_cache(k, kv, slots, cache_format=CacheFormat(scale="ue8m0x4"), backend="triton")


# --------------------------------------------------------------------------------------------------- the readers


@pytest.mark.uses_ops("fp8_paged_mqa_logits", "gather_k_cache")
@pytest.mark.parametrize("scale,order", FORMATS)
@pytest.mark.parametrize("fp8", [FN, FNUZ])
@pytest.mark.parametrize("next_n,bs", [(1, 64), (2, 16)])
def test_readers_read_every_format_as_the_plain_cache(backend, scale, order, fp8, next_n, bs):
    g = torch.Generator().manual_seed(2)
    nb, b, h = 6, 3, 16
    plain = plain_cache(nb, bs, fp8, g)
    fmt = CacheFormat(fp8_dtype=fp8, scale=scale, order=order)
    kv = by_hand(plain, scale, order)
    bt = torch.randint(0, nb, (b, 4), generator=g, dtype=torch.int32)
    lens = torch.tensor([min(4 * bs, 100), 37, 0], dtype=torch.int32)
    q = (torch.randn(b, next_n, h, D, generator=g) * 3).to(fp8)
    w = torch.randn(b * next_n, h, generator=g)
    cu = torch.tensor([0, int(lens[0]), int(lens[0]) + 37, int(lens[0]) + 37], dtype=torch.int32)
    width = 4 * bs
    # the plain cache read by the same backend (the reference for the backends that do not read the format)
    same = backend if reads(backend, fmt) else "reference"
    want = si.fp8_paged_mqa_logits(q, plain, w, lens, bt, out=torch.empty(b * next_n, width),
                                   cache_fp8_dtype=fp8, backend=same)
    want_k, want_s = torch.zeros(cu[-1] + 3, D, dtype=fp8), torch.full((cu[-1] + 3,), 5.0)
    si.gather_k_cache(plain, bt, cu, out_k=want_k, out_scale=want_s, cache_fp8_dtype=fp8, backend=same)
    if not reads(backend, fmt):
        out = torch.full((b * next_n, width), 7.0)
        with pytest.raises(NotImplementedError):
            si.fp8_paged_mqa_logits(q, kv, w, lens, bt, out=out, cache_format=fmt, backend=backend)
        with pytest.raises(NotImplementedError):
            si.gather_k_cache(kv, bt, cu, out_k=torch.zeros_like(want_k), out_scale=torch.zeros_like(want_s),
                              cache_format=fmt, backend=backend)
        assert bool((out == 7.0).all())
        backend = None  # auto: falls back to the reference
    got = si.fp8_paged_mqa_logits(q, kv, w, lens, bt, out=torch.empty(b * next_n, width), cache_format=fmt,
                                  backend=backend)
    assert torch.equal(got, want)
    got_k, got_s = torch.zeros_like(want_k), torch.full_like(want_s, 5.0)
    si.gather_k_cache(kv, bt, cu, out_k=got_k, out_scale=got_s, cache_format=fmt, backend=backend)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8)) and torch.equal(got_s, want_s)
    # a second call of the same layout (the public functions' memo of a proven layout) reads the same
    again = si.fp8_paged_mqa_logits(q, kv, w, lens, bt, out=torch.empty(b * next_n, width), cache_format=fmt,
                                    backend=backend)
    assert torch.equal(again, want)


def test_ue8m0x4_reads_the_first_byte_only():
    """The four bytes of a key's ue8m0x4 scale are equal when vLLM writes them; readers read byte 0 alone."""
    g = torch.Generator().manual_seed(3)
    plain = plain_cache(2, 16, FN, g)
    kv = by_hand(plain, "ue8m0x4", "flat")
    odd = kv.clone()
    odd.view(2, -1)[:, 16 * D :].view(2, 16, 4)[:, :, 1:] = 0x55  # (bytes 1-3 of every scale)
    fmt = CacheFormat(scale="ue8m0x4")
    bt, cu = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([0, 32], dtype=torch.int32)
    outs = []
    for cache in (kv, odd):
        ok, os_ = torch.zeros(32, D, dtype=FN), torch.zeros(32)
        si.gather_k_cache(cache, bt, cu, out_k=ok, out_scale=os_, cache_format=fmt)
        outs.append(os_)
    assert torch.equal(outs[0], outs[1])


def test_undeclared_and_contradictory_formats_raise_before_writing():
    g = torch.Generator().manual_seed(4)
    kv = plain_cache(2, 16, FN, g)
    q = (torch.randn(1, 1, 16, D, generator=g) * 2).to(FN).float().to(FNUZ)
    w, lens, bt = torch.randn(1, 16), torch.tensor([20], dtype=torch.int32), torch.tensor([[0, 1]], dtype=torch.int32)
    out = torch.full((1, 32), 7.0)
    with pytest.raises(TypeError, match="float8_e4m3fnuz.*float8_e4m3fn"):
        si.fp8_paged_mqa_logits(q, kv, w, lens, bt, out=out)
    with pytest.raises(ValueError, match="disagrees"):
        si.fp8_paged_mqa_logits(q, kv, w, lens, bt, out=out, cache_fp8_dtype=FNUZ,
                                cache_format=CacheFormat(fp8_dtype=FN))
    with pytest.raises(TypeError, match="CacheFormat"):
        si.fp8_paged_mqa_logits(q, kv, w, lens, bt, out=out, cache_format="ue8m0x4")
    with pytest.raises(ValueError, match="multiple of 16"):
        si.fp8_paged_mqa_logits(q.view(torch.uint8).view(FN), si.new_kv_cache(4, 8, D), w, lens,
                                bt, out=out, cache_format=CacheFormat(order="preshuffled"))
    assert bool((out == 7.0).all())
    cu = torch.tensor([0, 20], dtype=torch.int32)
    ok, os_ = torch.zeros(20, D, dtype=FNUZ), torch.full((20,), 5.0)
    with pytest.raises(TypeError, match="out_k is torch.float8_e4m3fnuz"):
        si.gather_k_cache(kv, bt, cu, out_k=ok, out_scale=os_)
    with pytest.raises(TypeError, match="copies the cache's bytes"):
        si.gather_k_cache(kv, bt, cu, out_k=ok, out_scale=os_, cache_format=CacheFormat(scale="ue8m0x4"))
    assert bool((os_ == 5.0).all())
    # declared: fnuz queries against the e4m3fn cache, each read in its own format (the reference)
    got = si.fp8_paged_mqa_logits(q, kv, w, lens, bt, out=torch.empty(1, 32), cache_format=CacheFormat())
    same = si.fp8_paged_mqa_logits(q.float().to(FN), kv, w, lens, bt, out=torch.empty(1, 32))
    assert torch.equal(got, same)


@pytest.mark.uses_ops("fp8_mqa_logits")
def test_ragged_logits_of_mixed_operands(backend):
    """e4m3fnuz queries against e4m3fn keys (tensors carry their formats): each read exactly in its own."""
    g = torch.Generator().manual_seed(5)
    q_fn = (torch.randn(6, 16, D, generator=g) * 3).to(FN)
    q = q_fn.float().to(FNUZ)  # (|values| < 240: each e4m3fn value is an e4m3fnuz value too)
    assert torch.equal(q.float(), q_fn.float())
    k = (torch.randn(40, D, generator=g) * 3).to(FN)
    ks, w = torch.rand(40, generator=g) + 0.5, torch.randn(6, 16, generator=g)
    lo = torch.tensor([0, 0, 5, 10, 39, 3], dtype=torch.int32)
    hi = torch.tensor([40, 1, 30, 10, 40, 20], dtype=torch.int32)
    want = si.fp8_mqa_logits(q_fn, k, ks, w, lo, hi, backend="reference")
    if backend != "reference":
        out = torch.full((6, 40), 7.0)
        with pytest.raises(NotImplementedError, match="mix"):
            si.fp8_mqa_logits(q, k, ks, w, lo, hi, out=out, backend=backend)
        assert bool((out == 7.0).all())
        backend = None
    assert torch.equal(si.fp8_mqa_logits(q, k, ks, w, lo, hi, backend=backend), want)


# ------------------------------------------------------------------------------------------------------ the step


def model_keys(k: torch.Tensor, fp8) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 dequantized keys (their FP8 values) and ue8m0 scales, docs/spec.md §3 directly."""
    qmax = si.quant_max(fp8)
    k = k.double()
    amax = k.abs().amax(-1).clamp(min=1e-4)
    scale = torch.tensor([2.0 ** math.ceil(math.log2(a / qmax)) for a in amax.tolist()], dtype=torch.float64)
    return (k / scale[:, None]).clamp(-qmax, qmax).float().to(fp8).double(), scale


STEP_FORMATS = [
    ("v4-gfx942", dict(fp8_dtype=FNUZ), CacheFormat(fp8_dtype=FN)),  # fnuz queries, the e4m3fn bytes of V4's writers
    ("sm100", dict(), CacheFormat(scale="ue8m0x4")),
    ("rocm-c1", dict(fp8_dtype=FNUZ), CacheFormat(fp8_dtype=FN, order="preshuffled")),
    ("plain-declared", dict(), CacheFormat()),
]


@pytest.mark.parametrize("name,lim_kw,fmt", STEP_FORMATS, ids=[s[0] for s in STEP_FORMATS])
@pytest.mark.parametrize("write", [True, False], ids=["k", "k-none"])
def test_step_in_a_declared_format_matches_a_float64_model(name, lim_kw, fmt, write):
    """Decode and prefill requests in one step (the reference backend), history in the cache written in the
    format, this step's keys written by the step (``k``) or beforehand (``k=None``)."""
    g = torch.Generator().manual_seed(6)
    lim = IndexerLimits(max_model_len=256, max_num_batched_tokens=256, max_num_seqs=4, n_heads=16, head_dim=D,
                        topk=16, block_size=16, next_n=2, cache_format=fmt, **lim_kw)
    assert lim.cache == fmt
    qf = lim.fp8_dtype
    seq, qry = [40, 9, 70, 23], [2, 1, 30, 23]  # two decode requests (one with fewer than next_n tokens), two prefill
    nb = sum(-(-s // 16) for s in seq) + 2
    perm = torch.randperm(nb, generator=g).int()
    bt = torch.zeros(len(seq), 8, dtype=torch.int32)
    o = 0
    for r, s in enumerate(seq):
        n = -(-s // 16)
        bt[r, :n] = perm[o : o + n]
        o += n
    kv = si.new_kv_cache(nb, 16, D)
    keys = [torch.randn(s, D, generator=g).to(torch.bfloat16) for s in seq]
    new_k, slots = [], []
    for r, (s, q) in enumerate(zip(seq, qry)):
        pos = torch.arange(s)[None, :]
        sl = si.slots_from_block_table(bt[r : r + 1], pos, 16)[0]
        done = s if not write else s - q
        if done:
            si.write_k_cache(keys[r][:done], kv, sl[:done], cache_format=fmt)
        new_k.append(keys[r][s - q :])
        slots.append(sl[s - q :])
    k, slot_mapping = torch.cat(new_k), torch.cat(slots)
    t = sum(qry)
    q_fp8 = (torch.randn(t, 16, D, generator=g) * 2).to(qf)
    w = torch.randn(t, 16, generator=g) / 32
    md = si.build_metadata(seq, qry, bt, slot_mapping, lim, num_blocks=nb)
    buf = allocate(lim)
    assert buf.k_fp8.dtype == fmt.fp8_dtype
    topk_out = torch.full((t + 2, 16), 7, dtype=torch.int32)
    si.sparse_attn_indexer(q_fp8, k if write else None, w, kv, md, buf, topk_out, backend="reference")
    assert bool((topk_out[t:] == 7).all())
    model, row = [], 0
    for r, (s, q) in enumerate(zip(seq, qry)):
        kk, ks = model_keys(keys[r], fmt.fp8_dtype)
        for j in range(q):
            n = s - q + j + 1
            sc = (q_fp8[row].double() @ kk[:n].T).clamp(min=0)
            model.append((w[row].double() @ sc) * ks[:n])
            row += 1
    assert_topk(topk_out[:t], model, rtol=1e-5, threshold=True)
    # a second layer (the step's memo of what it proved): the same selection
    again = torch.full_like(topk_out, 7)
    si.sparse_attn_indexer(q_fp8, None, w, kv, md, buf, again, backend="reference")
    assert torch.equal(again[:t], topk_out[:t])


def test_step_refuses_undeclared_and_unwritable_formats_before_writing():
    g = torch.Generator().manual_seed(7)
    kw = dict(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=2, n_heads=16, head_dim=D, topk=16,
              block_size=16)
    declared = IndexerLimits(fp8_dtype=FNUZ, cache_format=CacheFormat(fp8_dtype=FN), **kw)
    md = si.build_metadata([20], [20], torch.tensor([[0, 1]], dtype=torch.int32), torch.arange(20), declared,
                           num_blocks=2)
    kv = si.new_kv_cache(2, 16, D)
    q = (torch.randn(20, 16, D, generator=g)).to(FNUZ)
    w, k = torch.randn(20, 16, generator=g), torch.randn(20, D, generator=g)
    out = torch.full((20, 16), 7, dtype=torch.int32)
    # buffers planned for other limits (fnuz k_fp8): the gather copies e4m3fn bytes
    with pytest.raises(TypeError, match="buffers.k_fp8"):
        si.sparse_attn_indexer(q, k, w, kv, md, allocate(IndexerLimits(fp8_dtype=FNUZ, **kw)), out)
    buf = allocate(declared)
    with pytest.raises(TypeError, match="declare"):  # e4m3fn queries where the limits declare fnuz ones
        si.sparse_attn_indexer(q.float().to(FN), k, w, kv, md, buf, out)
    # the same bytes, undeclared: fnuz queries against an fnuz-format step need fnuz buffers
    plain = IndexerLimits(fp8_dtype=FNUZ, **kw)
    md_plain = si.build_metadata([20], [20], torch.tensor([[0, 1]], dtype=torch.int32), torch.arange(20), plain,
                                 num_blocks=2)
    with pytest.raises(TypeError, match="buffers.k_fp8"):
        si.sparse_attn_indexer(q, k, w, kv, md_plain, buf, out)
    sm100 = IndexerLimits(cache_format=CacheFormat(scale="ue8m0x4"), **kw)
    md_sm = si.build_metadata([20], [20], torch.tensor([[0, 1]], dtype=torch.int32), torch.arange(20), sm100,
                              num_blocks=2)
    with pytest.raises(ValueError, match="scale_fmt='ue8m0'"):
        si.sparse_attn_indexer(q.float().to(FN), k, w, kv, md_sm, allocate(sm100), out, scale_fmt=None)
    if "triton" in si.available("cpu"):
        with pytest.raises(si.BackendUnavailable, match="mix"):
            si.sparse_attn_indexer(q, k, w, kv, md, buf, out, backend="triton")
    assert not bool(kv.any()) and bool((out == 7).all()), "the step wrote before raising"
