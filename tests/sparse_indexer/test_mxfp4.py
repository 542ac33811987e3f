"""MXFP4 quantization and scores (docs/spec.md §3a, §5) against an independent model written from the definition
with exact rational arithmetic (``fractions``), and a float64 oracle for the scores."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from sparse_indexer import mxfp4

GRID = [Fraction(v).limit_denominator() for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)]


def model_block(xs: list[float]) -> tuple[int, list[int]]:
    """(scale byte, 32 codes) of one block, from the definition: e = clamp(ceil(log2(max(amax, 6 * 2**-126) / 6)),
    -127, 127); codes e2m1 of x / 2**e to nearest, ties to the even code, saturating; the sign kept; a block with
    a NaN or an infinity: byte 255, codes 0."""
    if any(not math.isfinite(x) for x in xs):
        return 255, [0] * len(xs)
    amax = max(abs(Fraction(x)) for x in xs)
    a = max(amax, 6 * Fraction(2) ** -126)
    e = -127
    while 6 * Fraction(2) ** e < a:  # the smallest e with 6 * 2**e >= a
        e += 1
    e = max(-127, min(127, e))
    codes = []
    for x in xs:
        v = abs(Fraction(x)) / Fraction(2) ** e
        best = min(range(8), key=lambda c: (abs(GRID[c] - v), c % 2))  # nearest; a tie goes to the even code
        codes.append(best + (8 if math.copysign(1.0, x) < 0 else 0))
    return e + 127, codes


def model(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.float().reshape(-1, x.shape[-1]).tolist()
    vals, scs = [], []
    for row in rows:
        codes, sc = [], []
        for b in range(0, len(row), 32):
            s, c = model_block(row[b : b + 32])
            sc.append(s)
            codes += c
        vals.append([codes[2 * j] | codes[2 * j + 1] << 4 for j in range(len(codes) // 2)])
        scs.append(sc)
    shape = x.shape[:-1]
    return (torch.tensor(vals, dtype=torch.uint8).reshape(*shape, -1),
            torch.tensor(scs, dtype=torch.uint8).reshape(*shape, -1))


def _hard_rows(g: torch.Generator) -> torch.Tensor:
    """Rows of 64: random magnitudes over float32's range, exact e2m1 midpoints and grid points at random
    scales, zeros of both signs, subnormals, the largest finite values, blocks of one nonzero element."""
    rows = []
    for s in (1e-42, 1e-38, 3e-30, 1e-3, 1.0, 7.5, 1e20, 3.0e38):
        rows.append(torch.randn(64, generator=g) * s)
    for e in (-126, -100, -3, 0, 5, 100, 125):
        mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 8)
        sign = torch.where(torch.rand(64, generator=g) < 0.5, -1.0, 1.0)
        rows.append(mids * sign * 2.0 ** e)  # amax 6 * 2**e: e exactly; every midpoint a tie
        grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6.0] * 8)[torch.randperm(64, generator=g)]
        rows.append(grid * 2.0 ** e * 1.0000001)  # amax just above 6 * 2**e: the next exponent
    rows.append(torch.zeros(64))
    rows.append(-torch.zeros(64))
    one = torch.zeros(64)
    one[3], one[40] = -2.5e-7, 3.0
    rows.append(one)
    rows.append(torch.full((64,), 3.4028234663852886e38))
    rows.append(torch.full((64,), -1.1754943508222875e-38))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_bit_exact_against_the_definition(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.cat([_hard_rows(g), torch.randn(40, 64, generator=g) * torch.rand(40, 1, generator=g) * 50])
    if dtype != torch.float32:
        x = x.clamp(-6e4, 6e4) if dtype == torch.float16 else x
        x = x.to(dtype)
    got_v, got_s = mxfp4.quantize_mxfp4(x)
    want_v, want_s = model(x)
    assert got_v.dtype == got_s.dtype == torch.uint8
    assert got_v.shape == (x.shape[0], 32) and got_s.shape == (x.shape[0], 2)
    assert torch.equal(got_s, want_s), (got_s != want_s).nonzero()[:5]
    assert torch.equal(got_v, want_v), (got_v != want_v).nonzero()[:5]


def test_non_finite_blocks_and_their_scores():
    x = torch.randn(3, 64)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    x[2, 33] = -float("inf")
    v, s = mxfp4.quantize_mxfp4(x)
    assert s.tolist() == [[255, s[0, 1].item()], [s[1, 0].item(), 255], [s[2, 0].item(), 255]]
    assert (v[0, :16] == 0).all() and (v[1, 16:] == 0).all()
    back = mxfp4.dequantize_mxfp4(v, s)
    assert back[0, :32].isnan().all() and not back[0, 32:].isnan().any()
    qv, qs = mxfp4.quantize_q_mxfp4(torch.randn(2, 4, 64))
    sc = mxfp4.mxfp4_scores(qv, qs, v, s, torch.ones(2, 4))
    assert sc.isnan().all()  # every key has a NaN block, and relu keeps NaN


def test_dequantize_is_exact_and_round_trips():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, 128, generator=g) * torch.logspace(-20, 20, 50).unsqueeze(1)
    v, s = mxfp4.quantize_k_mxfp4(x)
    back = mxfp4.dequantize_mxfp4(v, s, torch.float64)
    # the represented values quantize to themselves (their block scale may drop: a block whose amax rounded
    # down to 3 * 2**e is 6 * 2**(e - 1))
    again = mxfp4.dequantize_mxfp4(*mxfp4.quantize_mxfp4(back.float()), torch.float64)
    assert torch.equal(again, back)
    # within half a grid step of the block scale: |x - back| <= 2**e (the widest step, 4 -> 6, is 2 * 2**e)
    e = s.to(torch.float64).sub(127).repeat_interleave(32, dim=1)
    assert ((x.double() - back).abs() <= torch.ldexp(torch.ones_like(e), e) + 1e-300).all()


def test_scores_against_a_float64_oracle():
    g = torch.Generator().manual_seed(11)
    m, h, n, d = 5, 8, 33, 128
    q = torch.randn(m, h, d, generator=g) * torch.logspace(-3, 3, h).view(1, h, 1)
    k = torch.randn(n, d, generator=g)
    k[:, :32] *= 1e3  # blocks of very different scales in one row
    w = torch.randn(m, h, generator=g)
    qv, qs = mxfp4.quantize_q_mxfp4(q)
    kv, ks = mxfp4.quantize_k_mxfp4(k)
    got = mxfp4.mxfp4_scores(qv, qs, kv, ks, w)
    q64 = mxfp4.dequantize_mxfp4(qv, qs, torch.float64)
    k64 = mxfp4.dequantize_mxfp4(kv, ks, torch.float64)
    want = (w.double()[:, :, None] * torch.relu(torch.einsum("mhd,nd->mhn", q64, k64))).sum(1)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    err = (got.double() - want).norm() / want.norm()
    assert err < 1e-6, err
    # the V3.2 factorisation (one key scale outside the dot) does not hold: scales differ per block
    assert not torch.equal(ks[:, 0], ks[:, 1])


def test_scores_order_on_a_hand_case():
    """One head, one key: blocks scaled 2**-254 and 2**0 (the first underflows float32 alone), summed in order."""
    qv = torch.zeros(1, 1, 32, dtype=torch.uint8)
    kv = torch.zeros(1, 32, dtype=torch.uint8)
    qv[0, 0, 0] = 0x7  # q[0] = 6 in block 0; kv[0] = 6 * ...: 36 * 2**(sq + sk - 254)
    kv[0, 0] = 0x7
    qv[0, 0, 16] = 0x2  # q[32] = 1 in block 1
    kv[0, 16] = 0xA  # k[32] = -1
    qs = torch.tensor([[[127 - 127, 127]]], dtype=torch.uint8)  # block 0: 2**-127; block 1: 2**0
    ks = torch.tensor([[0, 130]], dtype=torch.uint8)  # block 0: 2**-127; block 1: 2**3
    got = mxfp4.mxfp4_scores(qv, qs, kv, ks, torch.tensor([[2.0]]))
    assert got.item() == 0.0  # relu(36 * 2**-254 (rounds to 0 in float32) - 8) = 0
    ks[0, 1] = 127
    qv[0, 0, 16] = 0x0
    got = mxfp4.mxfp4_scores(qv, qs, kv, ks, torch.tensor([[2.0]]))
    assert got.item() == 0.0  # 36 * 2**-254 alone: below float32's smallest subnormal, one rounding gives 0


@pytest.mark.parametrize("bad", ["dim", "dtype", "width"])
def test_bad_input(bad):
    x = {"dim": torch.zeros(64), "dtype": torch.zeros(2, 64, dtype=torch.float64),
         "width": torch.zeros(2, 48)}[bad]
    if bad == "dim":
        with pytest.raises(ValueError, match="2-D"):
            mxfp4.quantize_k_mxfp4(x)
        with pytest.raises(ValueError, match="3-D"):
            mxfp4.quantize_q_mxfp4(x)
    elif bad == "dtype":
        with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
            mxfp4.quantize_k_mxfp4(x)
    else:
        with pytest.raises(ValueError, match="multiple of 32"):
            mxfp4.quantize_k_mxfp4(x)
    v, s = mxfp4.quantize_k_mxfp4(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="must agree"):
        mxfp4.dequantize_mxfp4(v[:, :16], s)
    with pytest.raises(TypeError, match="uint8"):
        mxfp4.dequantize_mxfp4(v.int(), s)
    qv, qs = mxfp4.quantize_q_mxfp4(torch.zeros(1, 2, 64))
    with pytest.raises(ValueError, match="weights"):
        mxfp4.mxfp4_scores(qv, qs, v, s, torch.zeros(1, 3))


# ------------------------------------------------------------------ the ragged logits op with MXFP4 operands
import sparse_indexer as si  # noqa: E402


def _ragged(g, m=6, h=4, n=50, d=64):
    q = torch.randn(m, h, d, generator=g)
    k = torch.randn(n, d, generator=g) * torch.logspace(-2, 2, n).unsqueeze(1)
    w = torch.randn(m, h, generator=g) * (h * d) ** -0.5
    qv, qs = si.quantize_q_mxfp4(q)
    kv, ks = si.quantize_k_mxfp4(k)
    starts = torch.tensor([0, 3, 10, 49, 20, 0][:m], dtype=torch.int32)
    ends = torch.tensor([50, 40, 10, 50, 35, 1][:m], dtype=torch.int32)  # full, middle, empty, last key, ...
    return qv, qs, kv, ks, w, starts, ends


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", [None, "reference"])
def test_ragged_logits_op_with_mxfp4_operands(backend, dtype):
    g = torch.Generator().manual_seed(5)
    qv, qs, kv, ks, w, a, b = _ragged(g)
    want = mxfp4.mxfp4_scores(qv, qs, kv, ks, w)
    cols = torch.arange(kv.shape[0])[None, :]
    inside = (cols >= a[:, None].long()) & (cols < b[:, None].long())
    out = torch.full((qv.shape[0], kv.shape[0]), 7.0, dtype=dtype)
    got = si.fp8_mqa_logits(qv, kv, ks, w, a, b, out=out, q_scale=qs, backend=backend)
    assert got is out
    assert torch.equal(out[inside].float(), want[inside].to(dtype).float())
    assert (out[~inside] == float("-inf")).all()
    out.fill_(7.0)
    si.fp8_mqa_logits(qv, kv, ks, w, a, b, out=out, q_scale=qs, backend=backend, clean=False)
    assert torch.equal(out[inside].float(), want[inside].to(dtype).float()) and (out[~inside] == 7).all()
    # compressed rows: row m's keys from column 0
    width = int((b - a).clamp(min=0).max())
    comp = si.fp8_mqa_logits(qv, kv, ks, w, a, b, q_scale=qs, backend=backend, max_seqlen_k=width,
                             logits_dtype=dtype)
    for r in range(qv.shape[0]):
        n_r = max(0, int(b[r] - a[r]))
        assert torch.equal(comp[r, :n_r].float(), want[r, a[r] : a[r] + n_r].to(dtype).float()), r
        assert (comp[r, n_r:] == float("-inf")).all()


def test_ragged_mxfp4_through_the_custom_op_and_other_backends():
    g = torch.Generator().manual_seed(6)
    qv, qs, kv, ks, w, a, b = _ragged(g)
    want = si.fp8_mqa_logits(qv, kv, ks, w, a, b, q_scale=qs, backend="reference")
    out = torch.empty_like(want)
    torch.ops.sparse_indexer.fp8_mqa_logits(qv, kv, ks, w, a, b, out, True, False, qs, backend="reference")
    assert torch.equal(out, want)
    for name in ("gluon", "aiter"):  # no MXFP4 kernel (or not here): refused, nothing written
        out.fill_(3.0)
        with pytest.raises((NotImplementedError, si.BackendUnavailable)):
            si.fp8_mqa_logits(qv, kv, ks, w, a, b, out=out, q_scale=qs, backend=name)
        assert (out == 3.0).all()


def test_ragged_mxfp4_bad_input():
    g = torch.Generator().manual_seed(8)
    qv, qs, kv, ks, w, a, b = _ragged(g)
    with pytest.raises(TypeError, match="q"):
        si.fp8_mqa_logits(qv, kv, ks, w, a, b)  # uint8 queries without their scales: not FP8
    with pytest.raises(ValueError, match="q_scale"):
        si.fp8_mqa_logits(qv, kv, ks, w, a, b, q_scale=qs[:, :, :1])
    with pytest.raises(TypeError, match="k_scale"):
        si.fp8_mqa_logits(qv, kv, ks.float(), w, a, b, q_scale=qs)
    with pytest.raises(ValueError, match="k_fp8"):
        si.fp8_mqa_logits(qv, kv[:, :16], ks, w, a, b, q_scale=qs)
    fp8_k, fp8_s = si.quantize_k(torch.randn(kv.shape[0], 64))
    with pytest.raises(TypeError, match="k_fp8"):
        si.fp8_mqa_logits(qv, fp8_k, fp8_s, w, a, b, q_scale=qs)  # FP8 keys against MXFP4 queries
    out = torch.zeros(qv.shape[0], kv.shape[0])
    with pytest.raises(ValueError, match="window ends"):
        si.fp8_mqa_logits(qv, kv, ks, w, a, b + 100, out=out, q_scale=qs)
    assert (out == 0).all()


def test_ragged_mxfp4_under_functionalize_and_compile():
    """The MXFP4 call through the custom op: ``torch.func.functionalize`` (the reference route) and
    ``torch.compile(fullgraph=True)`` give the eager bytes."""
    g = torch.Generator().manual_seed(9)
    qv, qs, kv, ks, w, a, b = _ragged(g)
    want = si.fp8_mqa_logits(qv, kv, ks, w, a, b, q_scale=qs, backend="reference")

    def f(out):
        si.fp8_mqa_logits(qv, kv, ks, w, a, b, out=out, q_scale=qs)
        return out

    got = torch.func.functionalize(f)(torch.zeros_like(want))
    assert torch.equal(got, want)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(torch.zeros_like(want)), want)


# ------------------------------------------------------------------ MXFP4 caches: format, write, gather
from buffers import CacheFormat, IndexerLimits  # noqa: E402
from sparse_indexer.kcache import cache_layout  # noqa: E402

MX = CacheFormat(values="mxfp4")


def test_mxfp4_cache_format_and_layout():
    assert MX.mxfp4 and not MX.is_default and MX.key_bytes(128) == 68 and MX.key_bytes(64) == 34
    assert CacheFormat().key_bytes(128) == 132
    with pytest.raises(ValueError, match="own scale bytes"):
        CacheFormat(values="mxfp4", scale="ue8m0x4")
    with pytest.raises(ValueError, match="own scale bytes"):
        CacheFormat(values="mxfp4", fp8_dtype=torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="values must be one of"):
        CacheFormat(values="fp4")
    assert IndexerLimits(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=2, cache_format=MX).mxfp4
    with pytest.raises(ValueError, match="not supported with context parallel"):
        IndexerLimits(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=2, cache_format=MX, world_size=2)
    for d, width in ((128, 68), (64, 34)):
        kv = si.new_kv_cache(3, 16, d, mxfp4=True)
        assert kv.shape == (3, 16, width) and kv.dtype == torch.uint8
        assert cache_layout(kv, mxfp4=True).head_dim == d
    assert cache_layout(si.new_kv_cache(3, 16, 128, mxfp4=True)).head_dim == 64  # the bytes carry no format
    odd = si.new_kv_cache(2, 5, 64, mxfp4=True)  # 5 x 34 bytes: blocks padded to 4-byte alignment
    assert odd.stride(0) % 4 == 0 and cache_layout(odd, mxfp4=True).block_stride == odd.stride(0)
    with pytest.raises(ValueError, match="MXFP4 cache must be D / 2 \\+ D / 32"):
        cache_layout(si.new_kv_cache(2, 16, 128), mxfp4=True)


@pytest.mark.parametrize("layout", ["plain", "padded", "four_d"])
def test_mxfp4_cache_write_and_gather_round_trip(layout):
    g = torch.Generator().manual_seed(21)
    nb, bs, d = 7, 16, 128
    kv = si.new_kv_cache(nb, bs, d, mxfp4=True, block_pad=8 if layout == "padded" else 0,
                         four_d=layout == "four_d")
    before = kv.clone()
    k = torch.randn(60, d, generator=g).to(torch.bfloat16)
    slots = torch.randperm(nb * bs, generator=g)[:60]
    slots[[4, 17]] = -1  # skipped
    si.write_k_cache(k, kv, slots, cache_format=MX)
    v, s = si.quantize_k_mxfp4(k)
    bt = torch.randperm(nb, generator=g).int().view(1, nb)
    lens = [40, 0, 50]
    table = torch.stack([bt[0], bt[0].roll(3), bt[0].roll(1)]).int()
    cu = torch.tensor([0, 40, 40, 90], dtype=torch.int32)
    out_k = torch.full((95, d // 2), 7, dtype=torch.uint8)
    out_s = torch.full((95, d // 32), 7, dtype=torch.uint8)
    si.gather_k_cache(kv, table, cu, out_k=out_k, out_scale=out_s, cache_format=MX)
    written = {int(sl): i for i, sl in enumerate(slots) if sl >= 0}
    row = 0
    for r, n in enumerate(lens):
        for p in range(n):
            slot = int(table[r, p // bs]) * bs + p % bs
            if slot in written:
                assert torch.equal(out_k[row], v[written[slot]]) and torch.equal(out_s[row], s[written[slot]])
            else:  # never written: the zeroed cache's bytes
                assert (out_k[row] == 0).all() and (out_s[row] == 0).all()
            row += 1
    assert (out_k[90:] == 7).all() and (out_s[90:] == 7).all()  # rows past cu_seq_lens[-1]: untouched
    # only the written slots' bytes changed
    kv3 = kv.view(nb, bs, -1) if layout == "four_d" else kv
    changed = (kv3.reshape(nb, -1) != before.reshape(nb, -1))
    assert changed.any() and int(changed.sum()) <= len(written) * 68
    # the gathered keys are what the ragged MXFP4 scores read
    q = torch.randn(3, 4, d, generator=g)
    qv, qs = si.quantize_q_mxfp4(q)
    w = torch.randn(3, 4, generator=g)
    ks = torch.zeros(3, dtype=torch.int32)
    ke = torch.full((3,), 90, dtype=torch.int32)
    got = si.fp8_mqa_logits(qv, out_k[:90], out_s[:90], w, ks, ke, q_scale=qs)
    assert torch.equal(got, mxfp4.mxfp4_scores(qv, qs, out_k[:90], out_s[:90], w))


def test_mxfp4_cache_refusals_and_bad_input():
    kv = si.new_kv_cache(4, 16, 128, mxfp4=True)
    k = torch.randn(5, 128)
    slots = torch.arange(5)
    for name in ("aiter", "gluon"):
        with pytest.raises((NotImplementedError, si.BackendUnavailable)):
            si.write_k_cache(k, kv, slots, cache_format=MX, backend=name)
    assert (kv == 0).all()
    with pytest.raises(ValueError, match="does not apply to an MXFP4 cache"):
        si.write_k_cache(k, kv, slots, cache_format=MX, fp8_dtype=torch.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="k.shape\\[1\\]"):
        si.write_k_cache(torch.randn(5, 64), kv, slots, cache_format=MX)
    with pytest.raises(ValueError, match="slot"):
        si.write_k_cache(k, kv, torch.tensor([0, 1, 2, 3, 64]), cache_format=MX)
    assert (kv == 0).all()
    bt = torch.arange(4, dtype=torch.int32).view(1, 4)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    out_k = torch.zeros(10, 64, dtype=torch.uint8)
    out_s = torch.zeros(10, 4, dtype=torch.uint8)
    with pytest.raises(TypeError, match="out_k"):
        si.gather_k_cache(kv, bt, cu, out_k=out_k.view(torch.float8_e4m3fn), out_scale=out_s, cache_format=MX)
    with pytest.raises(ValueError, match="out_scale"):
        si.gather_k_cache(kv, bt, cu, out_k=out_k, out_scale=out_s[:, :2], cache_format=MX)
    with pytest.raises(ValueError, match="cache_fp8_dtype"):
        si.gather_k_cache(kv, bt, cu, out_k=out_k, out_scale=out_s, cache_format=MX,
                          cache_fp8_dtype=torch.float8_e4m3fn)


def test_mxfp4_cache_write_under_functionalize():
    """The MXFP4 write through the custom op (``torch.func.functionalize``: the reference route) stores the eager
    bytes."""
    k = torch.randn(9, 64)
    slots = torch.tensor([3, 0, 17, -1, 8, 30, 31, 2, 16])
    want = si.new_kv_cache(2, 16, 64, mxfp4=True)
    si.write_k_cache(k, want, slots, cache_format=MX)

    def f(kv):
        si.write_k_cache(k, kv, slots, cache_format=MX)
        return kv

    got = torch.func.functionalize(f)(si.new_kv_cache(2, 16, 64, mxfp4=True))
    assert torch.equal(got, want)


# ------------------------------------------------------------------ the paged logits op on an MXFP4 cache
def _paged(g, b=3, nn=2, h=8, d=128, bs=16, nb=20, two_d=False):
    kv = si.new_kv_cache(nb, bs, d, mxfp4=True)
    keys = torch.randn(nb * bs, d, generator=g) * torch.logspace(-1, 1, nb * bs).unsqueeze(1)
    si.write_k_cache(keys, kv, torch.arange(nb * bs), cache_format=MX)
    bt = torch.randperm(nb, generator=g)[: b * 4].view(b, 4).int()
    cl = torch.tensor([64, 5, 30, 0, 17][:b], dtype=torch.int32)
    if two_d:
        cl = torch.stack([(cl - nn + j + 1 - j % 2).clamp(min=0) for j in range(nn)], 1).int()
    qv, qs = si.quantize_q_mxfp4(torch.randn(b * nn, h, d, generator=g))
    w = torch.randn(b * nn, h, generator=g)
    return qv.view(b, nn, h, d // 2), qs.view(b, nn, h, d // 32), kv, w, cl, bt, si.quantize_k_mxfp4(keys)


def _paged_want(qv, qs, w, cl, bt, keys, bs=16):
    b, nn, h, _ = qv.shape
    lim = si.row_limits(cl, nn)
    out = torch.full((b * nn, bt.shape[1] * bs), float("-inf"))
    for r in range(b * nn):
        n = int(lim[r])
        pos = torch.arange(n)
        slots = bt[r // nn, pos // bs].long() * bs + pos % bs
        out[r, :n] = mxfp4.mxfp4_scores(qv.reshape(b * nn, h, -1)[r : r + 1], qs.reshape(b * nn, h, -1)[r : r + 1],
                                        keys[0][slots], keys[1][slots], w[r : r + 1])[0]
    return out


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_logits_on_an_mxfp4_cache(two_d, dtype):
    g = torch.Generator().manual_seed(30 + two_d)
    qv, qs, kv, w, cl, bt, keys = _paged(g, b=4, two_d=two_d)
    want = _paged_want(qv, qs, w, cl, bt, keys)
    out = torch.full_like(want, 9.0, dtype=dtype)
    si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, out=out, cache_format=MX, q_scale=qs)
    assert torch.equal(out.float(), want.to(dtype).float())
    out.fill_(9.0)
    si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, out=out, cache_format=MX, q_scale=qs, clean=False)
    inside = want != float("-inf")
    assert torch.equal(out[inside].float(), want[inside].to(dtype).float()) and (out[~inside] == 9.0).all()
    # indices: entry b reads block-table row indices[b]
    idx = torch.tensor([2, 0, 2, 1], dtype=torch.int32)
    q1, s1 = qv[:, :1].contiguous(), qs[:, :1].contiguous()
    cl1 = cl if cl.dim() == 1 else cl[:, 0].contiguous()
    got = si.fp8_paged_mqa_logits(q1, kv, w[::2].contiguous(), cl1, bt, cache_format=MX, q_scale=s1, indices=idx)
    assert torch.equal(got, _paged_want(q1, s1, w[::2].contiguous(), cl1, bt[idx.long()], keys))


def test_paged_mxfp4_refusals_and_bad_input():
    g = torch.Generator().manual_seed(40)
    qv, qs, kv, w, cl, bt, _ = _paged(g)
    out = torch.zeros(qv.shape[0] * qv.shape[1], 64)
    for name in ("gluon", "aiter"):
        with pytest.raises((NotImplementedError, si.BackendUnavailable)):
            si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, out=out, cache_format=MX, q_scale=qs, backend=name)
    assert (out == 0).all()
    with pytest.raises(ValueError, match="pass q_scale"):
        si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, cache_format=MX)
    with pytest.raises(ValueError, match="needs cache_format"):
        si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, q_scale=qs)
    with pytest.raises(TypeError, match="q"):
        si.fp8_paged_mqa_logits(qv.view(torch.float8_e4m3fn), kv, w, cl, bt, cache_format=MX, q_scale=qs)
    with pytest.raises(ValueError, match="q_scale"):
        si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, cache_format=MX, q_scale=qs[..., :2].contiguous())
    with pytest.raises(ValueError, match="D=128 but q has D=64"):
        si.fp8_paged_mqa_logits(qv[..., :32].contiguous(), kv, w, cl, bt, cache_format=MX,
                                q_scale=qs[..., :2].contiguous())
    with pytest.raises(ValueError, match="context"):
        si.fp8_paged_mqa_logits(qv, kv, w, cl + 100, bt, out=out, cache_format=MX, q_scale=qs)
    assert (out == 0).all()


def test_paged_mxfp4_under_functionalize():
    g = torch.Generator().manual_seed(41)
    qv, qs, kv, w, cl, bt, _ = _paged(g)
    want = si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, cache_format=MX, q_scale=qs)

    def f(out):
        si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, out=out, cache_format=MX, q_scale=qs)
        return out

    assert torch.equal(torch.func.functionalize(f)(torch.zeros_like(want)), want)


def test_self_check_mxfp4_cases_run():
    """``python -m sparse_indexer check``'s MXFP4 rows (on a GPU they compare the backend under test with the CPU
    reference; here both sides are the reference, so every row must pass)."""
    from sparse_indexer.commands import check

    ctx = check.Ctx("reference", torch.device("cpu"), torch.float8_e4m3fn, check.SMALL, 3)
    rows = [c for c in check.cases(check.SMALL) if "MXFP4" in c[1]]
    assert len(rows) == 5  # ragged x 2, the cache, the tiled cache, the step
    for _, name, fn in rows:
        text, _, ok = fn(ctx)
        assert ok, (name, text)


def test_auto_predicates_pass_mxfp4_calls_on():
    """Under ``auto``, implementations with an ``auto_when`` see every keyword: Gluon's (tried before Triton on
    Hopper) must accept the MXFP4 ones and decline, so the call goes on to a backend that scores MXFP4."""
    import importlib

    try:
        ragged = importlib.import_module("sparse_indexer.ops.fp8_mqa_logits.gluon")
        paged = importlib.import_module("sparse_indexer.ops.fp8_paged_mqa_logits.gluon")
    except Exception as e:  # noqa: BLE001 - no Gluon in this Triton
        pytest.skip(f"the Gluon modules do not import here: {e}")
    g = torch.Generator().manual_seed(50)
    qv, qs, kv, ks, w, a, b = _ragged(g)
    big = torch.zeros(1 << 14, 4, 64, dtype=torch.uint8)  # (large enough for the size rule alone)
    assert not ragged._auto_when(big, kv, ks, w, a, b, out=None, clean=True, q_scale=qs)
    pq, pqs, pkv, pw, cl, bt, _ = _paged(g)
    assert not paged._auto_when(pq, pkv, pw, cl, bt, out=None, clean=True, cache_values="mxfp4", q_scale=pqs)


def test_single_block_mxfp4_caches_and_qk_refusal():
    for bs in (1, 3):
        kv = si.new_kv_cache(1, bs, 64, mxfp4=True)  # 34 bytes per key: one block of 34 * bs bytes
        assert cache_layout(kv, mxfp4=True).block_stride % 4 == 0
        si.write_k_cache(torch.randn(bs, 64), kv, torch.arange(bs), cache_format=MX)
        assert kv.any()
    g = torch.Generator().manual_seed(51)
    qv, qs, kv, w, cl, bt, _ = _paged(g)
    qk = torch.zeros(qv.shape[2], qv.shape[0] * qv.shape[1], 64)
    with pytest.raises(ValueError, match="qk"):
        si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, cache_format=MX, q_scale=qs, qk=qk)


TOY_LOGITS_CALLS: list[str] = []


def fp8_mqa_logits(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, *, out, clean, compressed=False):
    """A toy backend's ragged logits that knows nothing of MXFP4 (no ``q_scale`` parameter): the reference's."""
    from sparse_indexer._runtime import dispatch

    TOY_LOGITS_CALLS.append("toy")
    dispatch.implementation("fp8_mqa_logits", "reference")(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke,
                                                           out=out, clean=clean, compressed=compressed)


def test_backends_without_the_mxfp4_keywords_are_passed_over():
    """A registered backend whose implementation lacks ``q_scale`` is never handed MXFP4 operands: ``auto`` goes on
    to the next backend, the backend named explicitly raises ``NotImplementedError``; FP8 calls still reach it."""
    from sparse_indexer import backends

    entry = backends.Backend("toymx", lambda device: None if device.type == "cpu" else "CPU only", auto=("cpu",),
                             rank=0, ops=("fp8_mqa_logits",), module=__name__, where="the CPU (a test's toy)")
    backends.register(entry)
    try:
        g = torch.Generator().manual_seed(60)
        qv, qs, kv, ks, w, a, b = _ragged(g)
        TOY_LOGITS_CALLS.clear()
        got = si.fp8_mqa_logits(qv, kv, ks, w, a, b, q_scale=qs)
        assert TOY_LOGITS_CALLS == [] and torch.equal(got, mxfp4_ref(qv, qs, kv, ks, w, a, b))
        with pytest.raises(NotImplementedError, match="takes no \\['q_scale'\\]"):
            si.fp8_mqa_logits(qv, kv, ks, w, a, b, q_scale=qs, backend="toymx")
        q8, qs8 = si.quantize_q(torch.randn(3, 4, 64, generator=g))
        k8, ks8 = si.quantize_k(torch.randn(20, 64, generator=g))
        si.fp8_mqa_logits(q8, k8, ks8, torch.randn(3, 4, generator=g), torch.zeros(3, dtype=torch.int32),
                          torch.full((3,), 20, dtype=torch.int32))
        assert TOY_LOGITS_CALLS == ["toy"]
    finally:
        backends.unregister("toymx")


def mxfp4_ref(qv, qs, kv, ks, w, a, b):
    return si.fp8_mqa_logits(qv, kv, ks, w, a, b, q_scale=qs, backend="reference")
