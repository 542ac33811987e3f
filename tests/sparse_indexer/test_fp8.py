"""FP8 formats and quantization (docs/spec.md §2, 3) against the float64 oracle."""

import math

import pytest
import torch

from sparse_indexer import FP8_MAX, QUANT_MAX, fn_to_fnuz, fp8_max, quant_max, quantize_k, quantize_q
from tests import oracle
from tests.cases import FP8, FP8_IDS, SCALE_FMTS, gen

# absolute rounding error bound in units of the scale in the subnormal range: half the subnormal spacing
SUBNORMAL_HALF_ULP = {torch.float8_e4m3fn: 2.0**-10, torch.float8_e4m3fnuz: 2.0**-11}


def test_constants():
    assert FP8_MAX == {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
    assert QUANT_MAX == {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 224.0}
    assert fp8_max(torch.float8_e4m3fn) == 448.0 and fp8_max(torch.float8_e4m3fnuz) == 240.0
    assert quant_max(torch.float8_e4m3fn) == 448.0 and quant_max(torch.float8_e4m3fnuz) == 224.0
    for fn in (fp8_max, quant_max):
        with pytest.raises(ValueError, match="fp8_dtype"):
            fn(torch.bfloat16)


@pytest.mark.parametrize("dt", FP8, ids=FP8_IDS)
def test_oracle_decode_matches_torch_on_all_bytes(dt):
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = oracle.decode(b, dt)
    theirs = b.view(dt).double()
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    ok = ~torch.isnan(ours)
    assert torch.equal(ours[ok], theirs[ok])
    assert float(ours[ok].max()) == FP8_MAX[dt]
    # the same byte decodes to half the value in e4m3fnuz (docs/spec.md §2)
    if dt == torch.float8_e4m3fnuz:
        fn = oracle.decode(b, torch.float8_e4m3fn)
        both = ok & ~torch.isnan(fn) & (b != 0x80)
        assert torch.equal(ours[both], fn[both] / 2)


@pytest.mark.parametrize("dt", FP8, ids=FP8_IDS)
def test_oracle_rounding_matches_torch_cast(dt):
    x = torch.randn(20000, generator=gen(1), dtype=torch.float64) * torch.exp2(
        torch.randint(-12, 8, (20000,), generator=gen(2)).double())
    x = x.float().double().clamp(-FP8_MAX[dt], FP8_MAX[dt])
    vals, codes = oracle.round_to_fp8(x, dt)
    assert torch.equal(vals, x.float().to(dt).double())


def _inputs(dtype, g):
    rows = [
        torch.randn(64, generator=g) * 3,
        torch.randn(64, generator=g) * 1e-3,
        torch.randn(64, generator=g) * 1e3,
        torch.zeros(64),  # amax 0 -> floor
        torch.full((64,), 3e-5),  # below the floor
        torch.linspace(-7, 7, 64),
        torch.tensor([448.0 * 2.0**-5] + [1.0] * 63),  # amax / qmax exactly a power of two
        torch.tensor([-2.5] + [0.0] * 63),
    ]
    x = torch.stack(rows + [torch.randn(64, generator=g) * float(s) for s in (0.01, 0.3, 17, 200)])
    x = torch.cat([x, x], 1)  # D = 128
    return x.to(dtype)


def _check_quantized(values, scale, x, dt, scale_fmt, floor):
    want_v, want_s, exact = oracle.quantize(x, dt, scale_fmt, floor)
    got_s = scale.double()
    assert scale.dtype == torch.float32
    assert torch.equal(got_s, want_s), f"scales differ: {got_s[got_s != want_s]} vs {want_s[got_s != want_s]}"
    got_v = oracle.decode(values)
    bad = got_v != want_v
    if scale_fmt is None:
        # float32 division before the FP8 cast may land exactly on a midpoint: allow a one-step difference there
        bad &= oracle.midpoint_distance(exact, dt) > 2.0**-20
    assert not bool(bad.any()), (
        f"{int(bad.sum())} values differ, first at {bad.nonzero()[0].tolist()}: "
        f"got {float(got_v[bad][0])} want {float(want_v[bad][0])} (exact {float(exact[bad][0])})")


@pytest.mark.parametrize("dt", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_k_matches_oracle(dt, scale_fmt, in_dtype):
    x = _inputs(in_dtype, gen(3))
    values, scale = quantize_k(x, fp8_dtype=dt, scale_fmt=scale_fmt)
    assert values.dtype == dt and values.shape == x.shape and scale.shape == (x.shape[0],)
    _check_quantized(values, scale, x, dt, scale_fmt, oracle.K_FLOOR)


@pytest.mark.parametrize("dt", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
def test_quantize_q_matches_oracle(dt, scale_fmt):
    x = _inputs(torch.float32, gen(4))[:, :64].reshape(3, 4, 64).clone()
    x[0, 0] = 0  # floor 1e-10
    x[0, 1] = 1e-9
    values, scale = quantize_q(x, fp8_dtype=dt, scale_fmt=scale_fmt)
    assert values.shape == x.shape and scale.shape == (3, 4)
    _check_quantized(values, scale, x, dt, scale_fmt, oracle.Q_FLOOR)
    plain = oracle.f32(oracle.f32(1e-10) / QUANT_MAX[dt])
    assert float(scale[0, 0]) == (oracle.pow2_ceil(plain) if scale_fmt else plain)


@pytest.mark.parametrize("dt", FP8, ids=FP8_IDS)
def test_ue8m0_is_power_of_two_and_rounds_up(dt):
    x = torch.randn(300, 128, generator=gen(5)) * torch.exp2(torch.randint(-20, 12, (300, 1), generator=gen(6)))
    _, s8 = quantize_k(x, fp8_dtype=dt, scale_fmt="ue8m0")
    _, sp = quantize_k(x, fp8_dtype=dt, scale_fmt=None)
    for a, b in zip(s8.tolist(), sp.tolist()):
        m, _ = math.frexp(a)
        assert m == 0.5, f"ue8m0 scale {a} is not a power of two"
        assert b <= a < 2 * b


@pytest.mark.parametrize("dt", FP8, ids=FP8_IDS)
@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
def test_quantization_error_bound(dt, scale_fmt):
    """Normal range: relative error <= 2**-4 (3 mantissa bits, round to nearest). Subnormal range: absolute
    error <= half the subnormal spacing times the scale."""
    x = torch.randn(200, 128, generator=gen(7), dtype=torch.float32) * torch.exp2(
        torch.randint(-16, 10, (200, 128), generator=gen(8)).float())
    values, scale = quantize_k(x, fp8_dtype=dt, scale_fmt=scale_fmt)
    deq = oracle.decode(values) * scale.double()[:, None]
    err = (x.double() - deq).abs()
    bound = torch.maximum(x.double().abs() * 2.0**-4, scale.double()[:, None] * SUBNORMAL_HALF_ULP[dt])
    bad = err > bound * (1 + 1e-12)
    assert not bool(bad.any()), f"{int(bad.sum())} values exceed the bound, e.g. {x[bad][:3]} -> {deq[bad][:3]}"
    # |k / scale| never exceeds the quantization bound
    assert float(oracle.decode(values).abs().max()) <= QUANT_MAX[dt]


def test_fn_to_fnuz_exact_on_all_bytes():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    fn_vals = oracle.decode(b, torch.float8_e4m3fn)
    finite = ~torch.isnan(fn_vals)
    values = b[finite].view(torch.float8_e4m3fn)
    scale = torch.full((int(finite.sum()),), 0.375)
    v2, s2 = fn_to_fnuz(values, scale)
    assert v2.dtype == torch.float8_e4m3fnuz
    assert torch.equal(s2, scale * 2)
    assert torch.equal(oracle.decode(v2) * s2.double(), fn_vals[finite] * scale.double())


def test_fn_to_fnuz_rejects_other_dtypes():
    with pytest.raises(TypeError, match="values"):
        fn_to_fnuz(torch.zeros(3, dtype=torch.float8_e4m3fnuz), torch.ones(3))


@pytest.mark.parametrize(
    "call, exc, name",
    [
        (lambda: quantize_k(torch.zeros(4)), ValueError, "k"),
        (lambda: quantize_k(torch.zeros(2, 4, dtype=torch.float64)), TypeError, "k"),
        (lambda: quantize_k(torch.zeros(2, 4), scale_fmt="e8m0"), ValueError, "scale_fmt"),
        (lambda: quantize_k(torch.zeros(2, 4), fp8_dtype=torch.float16), ValueError, "fp8_dtype"),
        (lambda: quantize_q(torch.zeros(2, 4)), ValueError, "q"),
        (lambda: quantize_q(torch.zeros(2, 2, 4, dtype=torch.int32)), TypeError, "q"),
    ],
)
def test_quantize_validation(call, exc, name):
    with pytest.raises(exc, match=name):
        call()
