"""fp8_mqa_logits (docs/spec.md §5, ragged): against float64 math on the FP8 inputs, exact -inf masks."""

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from sparse_indexer import fp8_mqa_logits, top_k_per_row
from tests import oracle
from tests.cases import (
    FP8,
    FP8_IDS,
    assert_logits,
    assert_topk,
    causal_windows,
    expect_error,
    gen,
    hyp_settings,
    int32,
    random_fp8,
    random_scales,
    random_weights,
    skip_unsupported,
    supported,
)

NINF = float("-inf")


def test_hand_computed(backend):
    # one live head (head 0) of H = 32: the others have q = 0 and weight 0, so they add relu(0) * 0 = 0
    d, h = 64, 32
    q = torch.zeros(2, h, d)
    q[0, 0, :2] = torch.tensor([1.0, 2.0])
    q[1, 0, 0] = 1.0
    k = torch.zeros(4, d)
    k[0, :2] = 1.0  # q0.k0 = 3, q1.k0 = 1
    k[1, 0] = -4.0  # negative dot products: relu -> 0
    k[2, :2] = torch.tensor([2.0, -1.0])  # q0.k2 = 0, q1.k2 = 2
    k[3, 1] = 3.0  # q0.k3 = 6, q1.k3 = 0
    k_scale = torch.tensor([1.0, 2.0, 0.5, 0.25])
    w = torch.zeros(2, h)
    w[:, 0] = torch.tensor([0.5, -2.0])
    out = torch.full((2, 4), 123.0)
    fp8_mqa_logits(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), k_scale, w, int32([1, 0]), int32([4, 3]),
                   out=out, backend=backend)
    want = torch.tensor([[NINF, 0.0, 0.0, 0.5 * 6 * 0.25], [-2.0 * 1 * 1.0, 0.0, -2.0 * 2 * 0.5, NINF]])
    assert torch.equal(out, want), out


def _inputs(g, m, n, h, d, dt):
    q = random_fp8((m, h, d), dt, g, amp=4.0)
    k = random_fp8((n, d), dt, g, amp=4.0)
    return q, k, random_scales(n, g), random_weights(m, h, g)


@hyp_settings()
@given(
    m=st.integers(1, 6),
    n=st.integers(0, 300),
    h=st.sampled_from([32, 64]),
    d=st.sampled_from([64, 128]),
    dt=st.sampled_from(FP8),
    clean=st.booleans(),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_matches_oracle(backend, m, n, h, d, dt, clean, data, seed):
    assume(supported(backend, dt))
    g = gen(seed)
    q, k, ks_, w = _inputs(g, m, n, h, d, dt)
    starts, ends = [], []
    for _ in range(m):
        s = data.draw(st.integers(0, n))
        e = data.draw(st.integers(max(0, s - 3), n))  # e < s: an empty window
        starts.append(s)
        ends.append(e)
    ks, ke = int32(starts), int32(ends)
    out = torch.full((m, n), float("nan"))  # whatever was there before must not matter
    res = fp8_mqa_logits(q, k, ks_, w, ks, ke, out=out, clean=clean, backend=backend)
    assert res is out
    want = oracle.ragged_logits(oracle.decode(q), oracle.decode(k), ks_, w, ks, ke)
    assert_logits(out, want, clean=clean)


@pytest.mark.parametrize("dt", FP8, ids=FP8_IDS)
def test_allocates_when_out_is_none(backend, dt):
    skip_unsupported(backend, dt)
    g = gen(1)
    q, k, ks_, w = _inputs(g, 3, 50, 32, 64, dt)
    out = fp8_mqa_logits(q, k, ks_, w, int32([0, 10, 49]), int32([50, 20, 50]), backend=backend)
    assert out.shape == (3, 50) and out.dtype == torch.float32
    assert_logits(out, oracle.ragged_logits(oracle.decode(q), oracle.decode(k), ks_, w, int32([0, 10, 49]),
                                            int32([50, 20, 50])))


def test_out_view_with_row_stride(backend):
    """out may be a row-strided view (unit last stride), e.g. a slice of a wider logits buffer."""
    g = gen(2)
    q, k, ks_, w = _inputs(g, 4, 70, 64, 128, torch.float8_e4m3fn)
    big = torch.full((4, 100), 9.0)
    out = big[:, 10:80]
    ks, ke = int32([0, 0, 30, 5]), int32([70, 1, 60, 5])
    fp8_mqa_logits(q, k, ks_, w, ks, ke, out=out, backend=backend)
    assert_logits(out, oracle.ragged_logits(oracle.decode(q), oracle.decode(k), ks_, w, ks, ke))
    assert bool((big[:, :10] == 9.0).all()) and bool((big[:, 80:] == 9.0).all())


@pytest.mark.uses_ops("fp8_mqa_logits", "top_k_per_row")
@pytest.mark.parametrize("clean", [True, False])
def test_causal_prefill_then_topk(backend, clean):
    """docs/spec.md §5 causal windows of two requests; top-k of the result judged by the oracle's float64 logits."""
    g = gen(3)
    cu, starts, ends = causal_windows([150, 90], [6, 5])
    m, n = len(starts), cu[-1]
    q, k, ks_, w = _inputs(g, m, n, 64, 128, torch.float8_e4m3fn)
    ks, ke = int32(starts), int32(ends)
    out = torch.full((m, n), float("nan"))
    fp8_mqa_logits(q, k, ks_, w, ks, ke, out=out, clean=clean, backend=backend)
    want = oracle.ragged_logits(oracle.decode(q), oracle.decode(k), ks_, w, ks, ke)
    assert_logits(out, want, clean=clean)
    for topk in (16, 100):
        idx = torch.full((m, topk), -5, dtype=torch.int32)
        top_k_per_row(out, ks, ke, out=idx, backend=backend)
        assert_topk(idx, want, ks, ke, rtol=1e-5)


def _base():
    g = gen(4)
    q, k, ks_, w = _inputs(g, 3, 20, 32, 64, torch.float8_e4m3fn)
    return dict(q=q, k_fp8=k, k_scale=ks_, weights=w, cu_seqlen_ks=int32([0, 5, 19]),
                cu_seqlen_ke=int32([20, 10, 20]), out=torch.zeros(3, 20))


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _alias_weights(a):
    buf = torch.zeros(200)
    w = buf[:96].view(3, 32)
    w.copy_(a["weights"])
    return {"weights": w, "out": buf[90:150].view(3, 20)}


BAD = [
    ("q bf16", lambda a: {"q": a["q"].to(torch.bfloat16)}, TypeError, "q"),
    ("q 2-D", lambda a: {"q": a["q"][:, 0]}, ValueError, "q"),
    ("q strided", lambda a: {"q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)}, ValueError, "q"),
    ("k not fp8", lambda a: {"k_fp8": a["k_fp8"].view(torch.uint8)}, TypeError, "k_fp8"),  # (another FP8: a mix)
    ("k wrong D", lambda a: {"k_fp8": torch.zeros(20, 128, dtype=torch.float8_e4m3fn)}, ValueError, "k_fp8"),
    ("k strided", lambda a: {"k_fp8": torch.zeros(64, 20, dtype=torch.float8_e4m3fn).T}, ValueError, "k_fp8"),
    ("k meta", lambda a: {"k_fp8": _meta(a["k_fp8"])}, ValueError, "k_fp8"),
    ("k_scale shape", lambda a: {"k_scale": torch.ones(19)}, ValueError, "k_scale"),
    ("k_scale dtype", lambda a: {"k_scale": torch.ones(20, dtype=torch.bfloat16)}, TypeError, "k_scale"),
    ("k_scale meta", lambda a: {"k_scale": _meta(a["k_scale"])}, ValueError, "k_scale"),
    ("weights shape", lambda a: {"weights": torch.ones(3, 64)}, ValueError, "weights"),
    ("weights dtype", lambda a: {"weights": a["weights"].half()}, TypeError, "weights"),
    ("weights strided", lambda a: {"weights": torch.ones(32, 3).T}, ValueError, "weights"),
    ("weights meta", lambda a: {"weights": _meta(a["weights"])}, ValueError, "weights"),
    ("ks int64", lambda a: {"cu_seqlen_ks": a["cu_seqlen_ks"].long()}, TypeError, "cu_seqlen_ks"),
    ("ks shape", lambda a: {"cu_seqlen_ks": int32([0, 0])}, ValueError, "cu_seqlen_ks"),
    ("ks meta", lambda a: {"cu_seqlen_ks": _meta(a["cu_seqlen_ks"])}, ValueError, "cu_seqlen_ks"),
    ("ks negative", lambda a: {"cu_seqlen_ks": int32([0, -1, 19])}, ValueError, "cu_seqlen_ks"),
    ("ke int64", lambda a: {"cu_seqlen_ke": a["cu_seqlen_ke"].long()}, TypeError, "cu_seqlen_ke"),
    ("ke meta", lambda a: {"cu_seqlen_ke": _meta(a["cu_seqlen_ke"])}, ValueError, "cu_seqlen_ke"),
    ("ke beyond N", lambda a: {"cu_seqlen_ke": int32([20, 21, 20])}, ValueError, "cu_seqlen_ke"),
    ("out shape", lambda a: {"out": torch.zeros(3, 21)}, ValueError, "out"),
    ("out dtype", lambda a: {"out": torch.zeros(3, 20, dtype=torch.float64)}, TypeError, "out"),
    ("out strided", lambda a: {"out": torch.zeros(20, 3).T}, ValueError, "out"),
    ("out meta", lambda a: {"out": _meta(a["out"])}, ValueError, "out"),
    ("out aliases weights", _alias_weights, ValueError, "out"),
    ("out aliases k_scale", lambda a: {"out": torch.zeros(60), "k_scale": None}, ValueError, "out"),
]


@pytest.mark.parametrize("what, change, exc, name", BAD, ids=[b[0] for b in BAD])
def test_validation(backend, what, change, exc, name):
    a = _base()
    upd = change(a)
    if what == "out aliases k_scale":
        buf = upd["out"]
        upd = {"out": buf.view(3, 20), "k_scale": buf[40:60]}
    a.update(upd)
    watch = [t for t in a.values() if t.device.type != "meta"]
    expect_error(exc, name, lambda: fp8_mqa_logits(**a, backend=backend), watch=watch)
