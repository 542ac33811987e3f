"""The fused ops ``fp8_paged_mqa_topk`` and ``fp8_mqa_topk`` (docs/spec.md §6b): the reference against the float64
oracle (next_n 1 to 4, H 32 and 64, topk 512 and 2048 with windows shorter than, as long as and longer than topk,
1-D and 2-D context lengths, bfloat16 scores), the backend under test against the reference on small shapes (the
Triton compositions in the interpreter pass), the prefill op's row blocks, ``auto``'s dispatch (fused
implementations only, then the two ops' own ``auto``), the custom ops, and bad input."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import sparse_indexer as si
from sparse_indexer import backends
from sparse_indexer._runtime import dispatch as _dispatch
from sparse_indexer._runtime import library
from sparse_indexer.ops.fp8_paged_mqa_topk import FUSED_WORKSPACE_COLS
from sparse_indexer.ops.fp8_paged_mqa_topk import reference as paged_topk_ref
from sparse_indexer.testing import (
    TOPK_DISTRIBUTIONS,
    assert_fused_topk,
    fused_topk_errors,
    paged_inputs_for_scores,
    paged_windows,
    topk_values,
)
from tests import oracle
from tests.cases import (
    INTERPRET,
    assert_logits,
    assert_topk,
    causal_windows,
    expect_error,
    gen,
    int32,
    paged_case,
    random_fp8,
    random_scales,
    random_weights,
)
from tests.sparse_indexer.ops.test_aiter_adapters import fake_aiter  # noqa: F401 - a fixture

FN = torch.float8_e4m3fn
BF16 = torch.bfloat16
NINF = float("-inf")
reference_only = pytest.mark.skipif(INTERPRET, reason="reference-only: runs in the main pass")


def oracle_selection(sel: torch.Tensor, scores: torch.Tensor, starts, ends, tol: float) -> None:
    """docs/spec.md §6 checked directly on float64 ``scores [R, W]``: a window of ``n <= topk`` cells gives
    exactly ``0..n-1, -1, ...``; a longer one ``topk`` distinct positions inside it, none of whose scores is more
    than ``tol x max|score|`` below the window's ``topk``-th largest (NaN as ``-inf``)."""
    topk = sel.shape[1]
    for r in range(sel.shape[0]):
        s, e = int(starts[r]), int(ends[r])
        n = max(0, e - s)
        row = sel[r].tolist()
        if n <= topk:
            assert row == list(range(n)) + [-1] * (topk - n), f"row {r} (window {n} <= {topk}): {row[:12]}..."
            continue
        assert len(set(row)) == topk and min(row) >= 0 and max(row) < n, f"row {r}: positions {sorted(row)[:8]}..."
        win = scores[r, s:e].double()
        win = torch.where(torch.isnan(win), NINF, win)
        kth = win.sort(descending=True).values[topk - 1]
        lowest = win[torch.tensor(row)].min()
        fin = win[torch.isfinite(win)]
        scale = float(fin.abs().max()) if fin.numel() else 0.0
        if bool(torch.isfinite(kth)):
            assert float(lowest) >= float(kth) - tol * scale, f"row {r}: selected {float(lowest)!r} < {float(kth)!r}"


# ------------------------------------------------------------------------------------ decode: reference vs oracle
def _decode_lens(next_n: int, topk: int, two_d: bool):
    """Context lengths whose rows' windows are shorter than, exactly, and longer than ``topk``, and empty."""
    if not two_d:
        return [topk + next_n - 1, topk - 1, topk + 300, 0, 5]  # limits topk..; < topk; > topk; padding; short
    cycle = [topk + 37, topk, topk - 1, 0, 3, topk + 1, 1]
    flat = [cycle[i % len(cycle)] for i in range(5 * next_n)]
    return [flat[i * next_n : (i + 1) * next_n] for i in range(5)]


DECODE = [  # next_n, H, D, block_size, topk, 2-D lengths, scores dtype, logits given
    (1, 32, 64, 16, 512, False, torch.float32, True),
    (2, 64, 128, 64, 2048, False, torch.float32, True),
    (3, 32, 64, 16, 512, True, BF16, True),
    (4, 64, 64, 32, 512, True, torch.float32, False),
    (4, 32, 128, 64, 2048, False, BF16, True),
    (2, 32, 64, 16, 512, True, BF16, False),
]


@reference_only
@pytest.mark.parametrize("next_n, h, d, bs, topk, two_d, dtype, given", DECODE,
                         ids=[f"n{c[0]}-h{c[1]}-d{c[2]}-k{c[4]}-{'2d' if c[5] else '1d'}-{str(c[6])[6:]}"
                              f"{'' if c[7] else '-scratch'}" for c in DECODE])
def test_decode_reference_matches_oracle(next_n, h, d, bs, topk, two_d, dtype, given):
    g = gen(next_n * 100 + h + topk)
    cl = _decode_lens(next_n, topk, two_d)
    need = [max(x) for x in cl] if two_d else cl
    case = paged_case(g, need, bs, d, FN, pow2_scales=False)
    b = len(cl)
    q = random_fp8((b, next_n, h, d), FN, g, amp=4.0)
    w = random_weights(b * next_n, h, g)
    context_lens = int32(cl)
    width = case.block_table.shape[1] * bs
    out = torch.full((b * next_n, topk), 7, dtype=torch.int32)
    logits = torch.full((b * next_n, width), 3.0, dtype=dtype) if given else None
    res = si.fp8_paged_mqa_topk(q, case.kv, w, context_lens, case.block_table, out=out, logits=logits,
                                logits_dtype=dtype, backend="reference")
    assert res is out
    want = oracle.paged_logits(q, case.kv, w, context_lens, case.block_table, width)
    starts, ends = paged_windows(context_lens, next_n)
    assert sorted(set(ends.tolist()) & {topk - 1, topk, topk + 1}) and 0 in ends.tolist()
    oracle_selection(out, want, starts, ends, 1e-5 if dtype == torch.float32 else 8e-3)
    if given:
        if dtype == torch.float32:
            assert_logits(logits, want, clean=False)
        else:  # rounded once from the float32 score: at most one bfloat16 step from the float64 one
            assert_logits(logits, want, clean=False, rtol_l2=4e-3)
        assert_fused_topk(out, logits, starts, ends)  # exact on the scores it returned


@reference_only
def test_decode_value_distributions():
    """Every top-k value distribution fed through the scores (:func:`paged_inputs_for_scores`): ties, ``-inf``,
    NaN and ``+inf`` rank as docs/spec.md §6 says; the returned scores are the values exactly."""
    g = gen(5)
    for name in TOPK_DISTRIBUTIONS:
        values = topk_values(name, 3, 700, generator=g)
        lens = [700, 512, 100]
        q, kv, w, cl, bt = paged_inputs_for_scores(values, lens, heads=32, head_dim=64, block_size=16, generator=g)
        out = torch.full((3, 512), 7, dtype=torch.int32)
        logits = torch.empty(3, bt.shape[1] * 16)
        si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out, logits=logits, backend="reference")
        starts, ends = paged_windows(cl, 1)
        assert_fused_topk(out, logits[:, :700], starts, ends, expected=values)
        assert_topk(out, values, starts, ends)


# ------------------------------------------------------------------------------------ prefill: reference vs oracle
PREFILL = [(32, 64, 512), (64, 128, 2048)]


@reference_only
@pytest.mark.parametrize("h, d, topk", PREFILL, ids=[f"h{c[0]}-d{c[1]}-k{c[2]}" for c in PREFILL])
def test_prefill_reference_matches_oracle(h, d, topk):
    g = gen(h + topk)
    cu, ks, ke = causal_windows([topk + 40, topk + 3], [4, 3])  # causal windows around topk
    n = cu[-1]
    ks += [0, 5, 100, n - 1, 30]  # then: empty, len topk - 1, len topk, len 1, len > topk
    ke += [0, topk + 4, topk + 100, n, n]
    m = len(ks)
    q = random_fp8((m, h, d), FN, g, amp=4.0)
    k = random_fp8((n, d), FN, g)
    k_scale = random_scales(n, g)
    w = random_weights(m, h, g)
    out = torch.full((m, topk), 7, dtype=torch.int32)
    logits = torch.full((m, n), 3.0)
    si.fp8_mqa_topk(q, k, k_scale, w, int32(ks), int32(ke), out=out, logits=logits, backend="reference")
    want = oracle.ragged_logits(oracle.decode(q), oracle.decode(k), k_scale, w, int32(ks), int32(ke))
    oracle_selection(out, want, ks, ke, 1e-5)
    assert_logits(logits, want, clean=False)
    assert_fused_topk(out, logits, ks, ke)
    blocked = torch.full_like(out, 7)
    si.fp8_mqa_topk(q, k, k_scale, w, int32(ks), int32(ke), out=blocked, logits=torch.empty(3, n, dtype=BF16),
                    backend="reference")
    oracle_selection(blocked, want, ks, ke, 8e-3)


# ------------------------------------------------------------------------------------ backend under test, small
def _small_decode(next_n: int, two_d: bool, topk: int = 16, seed: int = 0):
    g = gen(seed + next_n)
    lens = [[40, topk, 0, topk - 1][:next_n] + [5] * max(0, next_n - 4), [topk + 1] * next_n] if two_d else \
        [40, topk + next_n - 1, 0, topk - 2]
    need = [max(x) for x in lens] if two_d else lens
    case = paged_case(g, need, 16, 64, FN, pow2_scales=False)
    b = len(lens)
    q = random_fp8((b, next_n, 8, 64), FN, g, amp=4.0)
    w = random_weights(b * next_n, 8, g)
    return q, case.kv, w, int32(lens), case.block_table


@pytest.mark.uses_ops("fp8_paged_mqa_topk")
@pytest.mark.parametrize("next_n, two_d, dtype", [(1, False, torch.float32), (2, True, BF16), (4, False, BF16),
                                                  (3, True, torch.float32)])
def test_decode_backend_matches_reference(backend, next_n, two_d, dtype):
    q, kv, w, cl, bt = _small_decode(next_n, two_d)
    rows, width = q.shape[0] * next_n, bt.shape[1] * 16
    starts, ends = paged_windows(cl, next_n)
    want = torch.full((rows, 16), 7, dtype=torch.int32)
    want_logits = torch.zeros(rows, width, dtype=dtype)
    si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=want, logits=want_logits, backend="reference")
    out = torch.full_like(want, 7)
    logits = torch.full((rows, width), 5.0, dtype=dtype)
    ws = torch.full((rows, FUSED_WORKSPACE_COLS), 3, dtype=torch.int32)
    si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out, logits=logits, workspace=ws, backend=backend)
    assert_fused_topk(out, logits, starts, ends, expected=want_logits)
    scratch = torch.full_like(want, 7)  # no logits: the backend's own scratch, in logits_dtype
    si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=scratch, logits_dtype=dtype, backend=backend)
    assert_topk(scratch, want_logits, starts, ends, rtol=1e-5, threshold=True)


@pytest.mark.uses_ops("fp8_mqa_topk")
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_prefill_row_blocks_equal_unblocked(backend, dtype):
    """A scratch of ``R < M`` rows gives the result of the whole ``[M, N]`` one (and of the reference)."""
    g = gen(11)
    cu, ks, ke = causal_windows([60, 40], [5, 4])
    ks, ke = ks + [3, 0], ke + [3, 19]  # an empty window, one of topk + 3
    m, n, h, d, topk = len(ks), cu[-1], 8, 64, 16
    q = random_fp8((m, h, d), FN, g, amp=4.0)
    k = random_fp8((n, d), FN, g)
    k_scale, w = random_scales(n, g), random_weights(m, h, g)
    args = (q, k, k_scale, w, int32(ks), int32(ke))
    want = torch.full((m, topk), 7, dtype=torch.int32)
    want_logits = torch.zeros(m, n, dtype=dtype)
    si.fp8_mqa_topk(*args, out=want, logits=want_logits, backend="reference")
    whole = torch.full_like(want, 7)
    logits = torch.full((m, n), 5.0, dtype=dtype)
    si.fp8_mqa_topk(*args, out=whole, logits=logits, backend=backend)
    assert_fused_topk(whole, logits, ks, ke, expected=want_logits)
    for r in (1, 4, m - 1):
        blocked = torch.full_like(want, 7)
        si.fp8_mqa_topk(*args, out=blocked, logits=torch.empty(r, n, dtype=dtype), backend=backend)
        assert torch.equal(blocked.sort(dim=1).values, whole.sort(dim=1).values), r
    auto = torch.full_like(want, 7)
    si.fp8_mqa_topk(*args, out=auto, logits_dtype=dtype, backend=backend)
    assert torch.equal(auto.sort(dim=1).values, whole.sort(dim=1).values)


# ------------------------------------------------------------------------------------ dispatch
FUSED = True  # this module is the toy fused backend's implementation module (the registry's ``module=``)
TOY_CALLS: list[str] = []
TOY_TAKES = [True]


def fp8_paged_mqa_topk(q, kv_cache, weights, context_lens, block_table, *, out, logits=None, workspace=None):
    """The toy fused backend: the reference composition when ``TOY_TAKES[0]``, else ``NotImplementedError``."""
    TOY_CALLS.append("fused")
    if not TOY_TAKES[0]:
        raise NotImplementedError("the toy fused kernel declines this call")
    paged_topk_ref.fp8_paged_mqa_topk(q, kv_cache, weights, context_lens, block_table, out=out, logits=logits)


def top_k_per_row(logits, row_starts, row_ends, *, out):
    """The toy top-k backend: the reference's, counted."""
    TOY_CALLS.append("top_k_per_row")
    _dispatch.implementation("top_k_per_row", "reference")(logits, row_starts, row_ends, out=out)


def _cpu_entry(name, ops, module=__name__):
    return backends.Backend(name, lambda device: None if device.type == "cpu" else "toys run on the CPU",
                            auto=("cpu",), rank=0, ops=ops, module=module, where="the CPU (a test's toy)")


@pytest.fixture
def toys():
    """Three toy CPU backends tried by ``auto`` before the reference: a fused one (this module, ``FUSED = True``),
    a composing one (a module without ``FUSED``), one whose module does not exist; and a toy top-k."""
    composed = types.ModuleType("tests._toy_composed_topk")

    def composing(q, kv_cache, weights, context_lens, block_table, *, out, logits=None, workspace=None):
        TOY_CALLS.append("composing")
        paged_topk_ref.fp8_paged_mqa_topk(q, kv_cache, weights, context_lens, block_table, out=out, logits=logits)

    composed.fp8_paged_mqa_topk = composing
    sys.modules[composed.__name__] = composed
    entries = [_cpu_entry("toyfused", ("fp8_paged_mqa_topk",)),
               _cpu_entry("toycomposing", ("fp8_paged_mqa_topk",), composed.__name__),
               _cpu_entry("toymissing", ("fp8_paged_mqa_topk",), "tests._no_such_module_{op}"),
               _cpu_entry("toytopk", ("top_k_per_row",))]
    for e in entries:
        backends.register(e)
    TOY_CALLS.clear()
    TOY_TAKES[0] = True
    try:
        yield
    finally:
        for e in entries:
            backends.unregister(e.name)
        del sys.modules[composed.__name__]


def _want(q, kv, w, cl, bt, topk=16):
    out = torch.full((q.shape[0] * q.shape[1], topk), 7, dtype=torch.int32)
    si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out, backend="reference")
    return out


def test_auto_tries_fused_implementations_only_then_composes(toys):
    cpu = torch.device("cpu")
    assert _dispatch.candidates("fp8_paged_mqa_topk", None, cpu)[:3] == ("toyfused", "toycomposing", "toymissing")
    assert [r.name for r in _dispatch.routes("fp8_paged_mqa_topk", None, cpu)] == ["toyfused", _dispatch.COMPOSED]
    assert _dispatch.fused("fp8_paged_mqa_topk", "toyfused") and not _dispatch.fused("fp8_paged_mqa_topk", "triton")
    args = _small_decode(2, False)
    want = _want(*args)
    TOY_CALLS.clear()
    out = torch.full_like(want, 7)
    si.fp8_paged_mqa_topk(*args, out=out)  # the fused toy takes it
    assert TOY_CALLS == ["fused"] and torch.equal(out, want)
    TOY_TAKES[0] = False
    TOY_CALLS.clear()
    out = torch.full_like(want, 7)
    si.fp8_paged_mqa_topk(*args, out=out)  # declined: the logits' auto (reference), then the top-k's (the toy)
    assert TOY_CALLS == ["fused", "top_k_per_row"] and torch.equal(out, want)
    TOY_CALLS.clear()
    si.fp8_paged_mqa_topk(*args, out=out, backend="toycomposing")  # named: runs, though not fused
    assert TOY_CALLS == ["composing"] and torch.equal(out, want)
    with pytest.raises(si.BackendUnavailable, match="has no implementation of fp8_paged_mqa_topk"):
        si.fp8_paged_mqa_topk(*args, out=out, backend="toymissing")
    with pytest.raises(NotImplementedError, match="declines"):
        si.fp8_paged_mqa_topk(*args, out=out, backend="toyfused")  # named: its refusal is the answer


def test_auto_composes_each_ops_auto_on_the_cpu():
    cpu = torch.device("cpu")
    for op in ("fp8_paged_mqa_topk", "fp8_mqa_topk"):
        routes = _dispatch.routes(op, None, cpu)
        assert [r.name for r in routes] == [_dispatch.COMPOSED], routes
    args = _small_decode(3, True)
    out = torch.full((args[0].shape[0] * 3, 16), 7, dtype=torch.int32)
    si.fp8_paged_mqa_topk(*args, out=out)
    assert torch.equal(out, _want(*args))


@pytest.mark.parametrize("name", ["cuda", "gluon", "nonesuch"])
def test_unavailable_backends_raise_before_writing(name):
    q, kv, w, cl, bt = _small_decode(1, False)
    out = torch.full((4, 16), 7, dtype=torch.int32)
    exc = ValueError if name == "nonesuch" else si.BackendUnavailable
    expect_error(exc, name, lambda: si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out, backend=name), watch=[out])


# ------------------------------------------------------------------------------------ aiter, on a stand-in
@reference_only
@pytest.mark.parametrize("arch", ["gfx950", "gfx942"])
def test_aiter_compositions(fake_aiter, arch):  # noqa: F811 - the stand-in aiter fixture
    """The aiter compositions through the stand-in aiter of ``test_aiter_adapters`` (gfx950: both kernels;
    elsewhere aiter's top-k is missing, so they decline before writing anything)."""
    from sparse_indexer.ops.fp8_mqa_topk import aiter as prefill_aiter
    from sparse_indexer.ops.fp8_paged_mqa_topk import aiter as decode_aiter
    from sparse_indexer.ops.write_k_cache import aiter as write_aiter
    from sparse_indexer.ops.write_k_cache import reference as write_ref

    fake_aiter(arch)
    g = gen(21)
    fp8, topk, bs, h, d = FN if arch == "gfx950" else torch.float8_e4m3fnuz, 2048, 16, 8, 64
    lens = [2100, 2048, 0]
    nb = 3 * 132  # a table of 132 distinct blocks per request (2112 positions)
    k = torch.randn(nb * bs, d, generator=g)
    kv_a, kv_r = si.new_kv_cache(nb, bs, d), si.new_kv_cache(nb, bs, d)
    write_aiter.write_k_cache(k, kv_a, torch.arange(nb * bs), scale_fmt=None, fp8_dtype=fp8)  # preshuffled
    write_ref.write_k_cache(k, kv_r, torch.arange(nb * bs), scale_fmt=None, fp8_dtype=fp8)  # the plain layout
    bt = torch.randperm(nb, generator=g).view(3, 132).int()
    q = random_fp8((3, 1, h, d), fp8, g, amp=4.0)
    w = random_weights(3, h, g)
    cl = int32(lens)
    out = torch.full((3, topk), 7, dtype=torch.int32)
    if arch != "gfx950":
        expect_error(NotImplementedError, "gfx950", lambda: decode_aiter.fp8_paged_mqa_topk(
            q, kv_a, w, cl, bt, out=out), watch=[out])
        return
    want = torch.full_like(out, 7)
    paged_topk_ref.fp8_paged_mqa_topk(q, kv_r, w, cl, bt, out=want)
    logits = torch.zeros(3, 132 * bs)
    decode_aiter.fp8_paged_mqa_topk(q, kv_a, w, cl, bt, out=out, logits=logits)
    assert torch.equal(out.sort(dim=1).values, want.sort(dim=1).values)
    assert_fused_topk(out, logits, *paged_windows(cl, 1))
    expect_error(NotImplementedError, "float32", lambda: decode_aiter.fp8_paged_mqa_topk(
        q, kv_a, w, cl, bt, out=out, logits_dtype=BF16), watch=[out])
    m, n = 4, 2200
    qp, kp = random_fp8((m, h, d), fp8, g, amp=4.0), random_fp8((n, d), fp8, g)
    ksc, wp = random_scales(n, g), random_weights(m, h, g)
    ks, ke = int32([0, 100, 5, 0]), int32([2200, 2148, 10, 0])
    got, ref = torch.full((m, topk), 7, dtype=torch.int32), torch.full((m, topk), 7, dtype=torch.int32)
    prefill_aiter.fp8_mqa_topk(qp, kp, ksc, wp, ks, ke, out=got, logits=torch.zeros(3, n))
    si.fp8_mqa_topk(qp, kp, ksc, wp, ks, ke, out=ref, backend="reference")
    assert torch.equal(got.sort(dim=1).values, ref.sort(dim=1).values)


# ------------------------------------------------------------------------------------ custom ops
def test_custom_ops_registered_with_their_writes():
    want = {"fp8_mqa_topk": {"out"}, "fp8_mqa_topk_with_logits": {"out", "logits"},
            "fp8_paged_mqa_topk": {"out"}, "fp8_paged_mqa_topk_with_logits": {"out", "logits"},
            "fp8_paged_mqa_topk_with_workspace": {"out", "workspace"},
            "fp8_paged_mqa_topk_with_logits_workspace": {"out", "logits", "workspace"}}
    for name, writes in want.items():
        schema = library.op(name)._schema
        assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == writes


def test_opcheck_and_compile():
    from tests.sparse_indexer.test_library import _opcheck

    q, kv, w, cl, bt = _small_decode(2, False)
    rows, width = q.shape[0] * 2, bt.shape[1] * 16
    want = _want(q, kv, w, cl, bt)
    out = torch.zeros(rows, 16, dtype=torch.int32)
    base = (q, kv, w, cl, bt)
    _opcheck("fp8_paged_mqa_topk", base, dict(out=out, backend="auto"))
    _opcheck("fp8_paged_mqa_topk_with_logits_workspace", base,
             dict(out=out, backend="reference", logits=torch.zeros(rows, width),
                  workspace=torch.zeros(rows, FUSED_WORKSPACE_COLS, dtype=torch.int32)))
    m, n = 5, 50
    g = gen(3)
    pre = (random_fp8((m, 8, 64), FN, g), random_fp8((n, 64), FN, g), random_scales(n, g), random_weights(m, 8, g),
           int32([0, 0, 10, 20, 49]), int32([50, 3, 40, 20, 50]))
    _opcheck("fp8_mqa_topk_with_logits", pre, dict(out=torch.zeros(m, 8, dtype=torch.int32), backend="auto",
                                                   logits=torch.zeros(2, n)))

    def f(q, kv, w, cl, bt, out, logits):
        si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out, logits=logits)
        return out

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    got = torch.compile(f, backend=capture, fullgraph=True)(q, kv, w, cl, bt, torch.zeros_like(out),
                                                            torch.zeros(rows, width))
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.sparse_indexer.fp8_paged_mqa_topk_with_logits], targets  # one opaque node
    assert torch.equal(got, want)

    def g_(q, kv, w, cl, bt, out):
        si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out)
        return out

    assert torch.equal(torch.func.functionalize(g_)(q, kv, w, cl, bt, torch.zeros_like(out)), want)


# ------------------------------------------------------------------------------------ the checks themselves
def test_fused_check_catches_wrong_results():
    g = gen(9)
    logits = torch.randn(3, 40, generator=g)
    starts, ends = torch.zeros(3, dtype=torch.long), torch.tensor([40, 5, 0])
    sel = torch.full((3, 8), -1, dtype=torch.int32)
    sel[0] = logits[0].topk(8).indices.int()
    sel[1, :5] = torch.arange(5)
    assert fused_topk_errors(sel, logits, starts, ends, expected=logits) == []
    bad = sel.clone()
    bad[0, 0] = int(logits[0].argmin())  # not among the top-8 of the scores it returned
    assert "row 0" in fused_topk_errors(bad, logits, starts, ends)[0]
    off = logits.clone()
    off[0, 3] += 1.0  # returned scores that are not the expected ones
    assert "relative L2" in fused_topk_errors(sel, logits, starts, ends, expected=off)[0]
    inf = logits.clone()
    inf[1, 2] = NINF
    assert "non-finite" in fused_topk_errors(sel, logits, starts, ends, expected=inf)[0]
    with pytest.raises(AssertionError, match="row 0"):
        assert_fused_topk(bad, logits, starts, ends)


# ------------------------------------------------------------------------------------ bad input
def _decode_base():
    q, kv, w, cl, bt = _small_decode(2, False)
    rows, width = q.shape[0] * 2, bt.shape[1] * 16
    return dict(q=q, kv_cache=kv, weights=w, context_lens=cl, block_table=bt,
                out=torch.full((rows, 16), 7, dtype=torch.int32), logits=torch.full((rows, width), 5.0),
                workspace=torch.full((rows, FUSED_WORKSPACE_COLS), 3, dtype=torch.int32))


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


DECODE_BAD = [
    ("q bfloat16", lambda a: {"q": a["q"].to(BF16)}, TypeError, "q"),
    ("q e4m3fnuz", lambda a: {"q": a["q"].float().to(torch.float8_e4m3fnuz)}, TypeError, "q"),
    ("q 3-D", lambda a: {"q": a["q"][0]}, ValueError, "q"),
    ("kv_cache head dim", lambda a: {"kv_cache": si.new_kv_cache(40, 16, 128)}, ValueError, "kv_cache"),
    ("weights shape", lambda a: {"weights": a["weights"][:-1]}, ValueError, "weights"),
    ("weights meta", lambda a: {"weights": _meta(a["weights"])}, ValueError, "weights"),
    ("context_lens int64", lambda a: {"context_lens": a["context_lens"].long()}, TypeError, "context_lens"),
    ("context_lens beyond the table", lambda a: {"context_lens": int32([40, 17, 0, 1000])}, ValueError,
     "context_lens"),
    ("block_table rows", lambda a: {"block_table": a["block_table"][:-1]}, ValueError, "block_table"),
    ("block id beyond the cache", lambda a: {"block_table": a["block_table"].clone().fill_(10 ** 6)}, ValueError,
     "block_table"),
    ("out int64", lambda a: {"out": a["out"].long()}, TypeError, "out"),
    ("out rows", lambda a: {"out": a["out"][:-1]}, ValueError, "out"),
    ("out topk 0", lambda a: {"out": a["out"][:, :0]}, ValueError, "out"),
    ("out strided", lambda a: {"out": torch.zeros(16, a["out"].shape[0], dtype=torch.int32).T}, ValueError, "out"),
    ("out meta", lambda a: {"out": _meta(a["out"])}, ValueError, "out"),
    ("logits float16", lambda a: {"logits": a["logits"].half()}, TypeError, "logits"),
    ("logits rows", lambda a: {"logits": a["logits"][:-1]}, ValueError, "logits"),
    ("logits too narrow", lambda a: {"logits": a["logits"][:, :39].contiguous()}, ValueError, "logits"),
    ("logits strided", lambda a: {"logits": torch.zeros(a["logits"].shape[::-1]).T}, ValueError, "logits"),
    ("logits dtype mismatch", lambda a: {"logits_dtype": BF16}, TypeError, "logits"),
    ("logits_dtype float16", lambda a: {"logits": None, "logits_dtype": torch.float16}, TypeError, "logits_dtype"),
    ("out aliases logits", lambda a: {"out": a["logits"].view(torch.int32)[:, :16]}, ValueError, "logits"),
    ("workspace int64", lambda a: {"workspace": a["workspace"].long()}, TypeError, "workspace"),
    ("workspace narrow", lambda a: {"workspace": a["workspace"][:, :100]}, si.BufferTooSmall, "workspace"),
    ("workspace rows", lambda a: {"workspace": a["workspace"][:1]}, si.BufferTooSmall, "workspace"),
    ("out aliases workspace", lambda a: {"out": a["workspace"][:, :16]}, ValueError, "workspace"),
    ("backend unknown", lambda a: {"backend": "nonesuch"}, ValueError, "nonesuch"),
]


@pytest.mark.parametrize("what, change, exc, name", DECODE_BAD, ids=[b[0] for b in DECODE_BAD])
def test_decode_bad_input_raises_before_writing(what, change, exc, name):
    a = _decode_base()
    a.update(change(a))
    watch = [t for k, t in a.items() if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    expect_error(exc, name, lambda: si.fp8_paged_mqa_topk(**a), watch=watch)


def _prefill_base():
    g = gen(4)
    m, n = 5, 60
    return dict(q=random_fp8((m, 8, 64), FN, g), k_fp8=random_fp8((n, 64), FN, g), k_scale=random_scales(n, g),
                weights=random_weights(m, 8, g), cu_seqlen_ks=int32([0, 0, 10, 20, 59]),
                cu_seqlen_ke=int32([60, 3, 40, 20, 60]), out=torch.full((m, 8), 7, dtype=torch.int32),
                logits=torch.full((2, n), 5.0))


PREFILL_BAD = [
    ("q bfloat16", lambda a: {"q": a["q"].to(BF16)}, TypeError, "q"),
    ("k_fp8 head dim", lambda a: {"k_fp8": a["k_fp8"].view(torch.uint8)[:, :32].contiguous().view(FN)}, ValueError,
     "k_fp8"),
    ("k_scale shape", lambda a: {"k_scale": a["k_scale"][:-1]}, ValueError, "k_scale"),
    ("weights shape", lambda a: {"weights": a["weights"][:-1]}, ValueError, "weights"),
    ("ks int64", lambda a: {"cu_seqlen_ks": a["cu_seqlen_ks"].long()}, TypeError, "cu_seqlen_ks"),
    ("ke shape", lambda a: {"cu_seqlen_ke": a["cu_seqlen_ke"][:-1]}, ValueError, "cu_seqlen_ke"),
    ("ke beyond N", lambda a: {"cu_seqlen_ke": int32([61, 3, 40, 20, 60])}, ValueError, "cu_seqlen_ke"),
    ("out int64", lambda a: {"out": a["out"].long()}, TypeError, "out"),
    ("out rows", lambda a: {"out": a["out"][:-1]}, ValueError, "out"),
    ("logits columns", lambda a: {"logits": torch.zeros(2, 59)}, ValueError, "logits"),
    ("logits more rows than M", lambda a: {"logits": torch.zeros(6, 60)}, ValueError, "logits"),
    ("logits no rows", lambda a: {"logits": torch.zeros(0, 60)}, ValueError, "logits"),
    ("logits dtype mismatch", lambda a: {"logits_dtype": BF16}, TypeError, "logits"),
    ("out aliases logits", lambda a: _prefill_aliased(), ValueError, "logits"),
]


def _prefill_aliased():
    logits = torch.full((5, 60), 5.0)
    return {"logits": logits, "out": logits.view(torch.int32)[:, :8]}


@pytest.mark.parametrize("what, change, exc, name", PREFILL_BAD, ids=[b[0] for b in PREFILL_BAD])
def test_prefill_bad_input_raises_before_writing(what, change, exc, name):
    a = _prefill_base()
    a.update(change(a))
    watch = [t for t in a.values() if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    expect_error(exc, name, lambda: si.fp8_mqa_topk(**a), watch=watch)


def test_fused_kernel_capacity_plan():
    """The fused CUDA kernel's host plan (no GPU needed): the ring depth it picks beside the CTA's tile list, and
    the cases it declines before anything is written."""
    from sparse_indexer.ops.fp8_paged_mqa_topk import cuda as fused

    smem = 232448  # the H200's opt-in shared memory per CTA
    # 64 requests x 64K keys over 132 SMs: 497 tiles per CTA, listed beside rings of 4 tiles for each of 4
    # warpgroups (5 leave room for 352)
    per = -(-(64 * 1024) // 132)
    assert per == 497
    assert fused.warpgroups(1) == fused.warpgroups(2) == 4 and fused.warpgroups(3) == fused.warpgroups(4) == 2
    assert fused.stages_for(per, 1, 64, 64, smem, 4) == 4
    assert fused.capacity_tiles(1, 64, 64, smem, 4, 4) >= per > fused.capacity_tiles(1, 64, 64, smem, 5, 4)
    assert fused.stages_for(-(-(16 * 1024) // 132), 1, 64, 16, smem, 4) == 5  # 124 tiles per CTA
    # next_n = 2 needs no more list: 64 x 64K fits (the scores are never kept)
    assert fused.stages_for(per, 2, 64, 64, smem, 4) is not None
    # too many tiles per CTA for any ring: 1024 requests x 1M keys
    assert fused.stages_for(-(-(1024 * 16384) // 132), 1, 64, 1024, smem, 4) is None
    # the bytes carved in fused_kernel.cu never exceed the budget; the final select's list fits the idle ring
    for st in fused.STAGES:
        for nwg in (2, 4):
            cap = fused.capacity_tiles(1, 64, 64, smem, st, nwg)
            if cap:  # (0: the ring alone does not fit)
                assert fused._fixed_smem(1, 64, 64, st, nwg) + cap * 12 <= smem
            if fused.stages_for(1, 1, 64, 64, smem, nwg) == st:
                assert st * nwg * 8192 >= fused.LIST_BYTES
    # on the CPU it declines (auto then composes), and auto would not run it anyway
    q = torch.zeros(1, 1, 64, 128, dtype=torch.float8_e4m3fn)
    kv = si.new_kv_cache(2, 64, 128)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    out = torch.zeros(1, 2048, dtype=torch.int32)
    why = fused.takes(q, kv, torch.zeros(1, 64), torch.ones(1, dtype=torch.int32), bt, out)
    assert why is not None and "NVIDIA" in why
    assert fused.MAX_TOPK == 2048
    assert fused.fp8_paged_mqa_topk.auto_when(q, kv, None, None, bt, out=out) is False


def test_step_runs_the_fused_decode_op_where_auto_picks_it(toys):
    """``sparse_attn_indexer`` under ``auto`` runs a decode sub-batch through the fused implementation ``auto``
    picks (here the toy: no logits op, no top-k), composes the logits and the top-k where that implementation
    declines, and never fuses under a named backend or for a source layer of candidate blocks."""
    from buffers import IndexerLimits, allocate
    from tests.sparse_indexer.test_indexer import Scenario

    lim = IndexerLimits(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, next_n=2, n_heads=16,
                        head_dim=64, topk=8)
    sc = Scenario([40, 7, 100, 64], [2, 2, 2, 1], lim=lim, seed=31)  # decode only, one request packed
    md = sc.metadata()
    bufs = allocate(lim)
    want = torch.full((md.num_tokens, lim.topk), 7, dtype=torch.int32)
    si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, bufs, want, backend="reference")
    assert not TOY_CALLS

    def step(**kw):
        got = torch.full_like(want, 7)
        TOY_CALLS.clear()
        si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, bufs, got, **kw)
        assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
        return list(TOY_CALLS)

    assert step() == ["fused"]
    assert step() == ["fused"]  # (the route is kept with the step's plan)
    TOY_TAKES[0] = False
    assert step() == ["fused", "top_k_per_row"]  # declined before writing: composed (the toy top-k's auto)
    TOY_TAKES[0] = True
    assert step(backend="reference") == []
