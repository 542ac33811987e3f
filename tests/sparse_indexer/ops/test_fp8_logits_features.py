"""Both logits ops' DeepGEMM features (docs/spec.md §5): bfloat16 logits (the dtype of ``out``),
compressed ragged logits (``max_seqlen_k``) and the paged row -> request map (``indices``), on every backend
under test against the float64 oracle, with exact ``-inf`` masks; the aiter adapters through the stand-in aiter.
"""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from sparse_indexer import fp8_mqa_logits, fp8_paged_mqa_logits
from sparse_indexer.kcache import as_3d
from sparse_indexer.ops.fp8_mqa_logits import aiter as mqa_aiter
from sparse_indexer.ops.fp8_paged_mqa_logits import aiter as paged_aiter
from sparse_indexer.ops.write_k_cache import aiter as write_aiter
from tests import oracle
from tests.cases import (
    assert_logits,
    assert_unchanged,
    causal_windows,
    expect_error,
    gen,
    int32,
    paged_case,
    random_fp8,
    random_scales,
    random_weights,
    snapshots,
)
from tests.sparse_indexer.ops.test_aiter_adapters import fake_aiter, unshuffle  # noqa: F401 - fake_aiter: a fixture
from tests.sparse_indexer.test_library import _opcheck

NINF = float("-inf")
FN = torch.float8_e4m3fn
BF16_REL = 2.0**-8  # one bfloat16 rounding (2**-9 relative) plus the float32 score's own error, with margin


def assert_bf16_logits(actual: torch.Tensor, expected: torch.Tensor, *, clean: bool) -> None:
    """A bfloat16 result against float64 logits: ``-inf`` masks exact (with ``clean``); inside the windows each
    cell within one bfloat16 rounding of the exact value (plus a float32-accumulation floor per row)."""
    assert actual.dtype == torch.bfloat16
    assert actual.shape == expected.shape
    a, e = actual.double(), expected.double()
    outside = e == NINF
    if clean:
        assert torch.equal(a == NINF, outside), "bf16 -inf mask differs"
    inside = ~outside
    ei = torch.where(inside, e, 0.0)
    ai = torch.where(inside, a, 0.0)
    assert bool(torch.isfinite(ai).all())
    floor = 1e-5 * ei.abs().amax(1, keepdim=True)
    bad = (ai - ei).abs() > BF16_REL * ei.abs() + floor
    assert not bool(bad.any()), f"{int(bad.sum())} bf16 cells beyond one rounding: {ai[bad][:5]} vs {ei[bad][:5]}"


def check(actual, expected, clean=True):
    if actual.dtype == torch.bfloat16:
        assert_bf16_logits(actual, expected, clean=clean)
    else:
        assert_logits(actual, expected, clean=clean)


def _ragged(seed, m, n, h=32, d=64):
    g = gen(seed)
    q = random_fp8((m, h, d), FN, g, amp=4.0)
    k = random_fp8((n, d), FN, g, amp=4.0)
    starts = torch.randint(0, n + 1, (m,), generator=g)
    ends = (starts + torch.randint(-2, n + 1, (m,), generator=g)).clamp(0, n)
    return q, k, random_scales(n, g), random_weights(m, h, g), int32(starts), int32(ends)


def compress(full: torch.Tensor, ks, ke, width: int) -> torch.Tensor:
    """float64 ``[M, N]`` logits -> compressed ``[M, width]`` (row m's window from column 0, ``-inf`` after)."""
    out = torch.full((full.shape[0], width), NINF, dtype=torch.float64)
    for i, (s, e) in enumerate(zip(ks.tolist(), ke.tolist())):
        if e > s:
            out[i, : e - s] = full[i, s:e]
    return out


# ------------------------------------------------------------------------------------------------ ragged
@pytest.mark.uses_ops("fp8_mqa_logits")
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ragged_bf16_logits(backend, clean, seed):
    q, k, ksc, w, ks, ke = _ragged(seed, 7, 150 + 40 * seed)
    out = torch.full((7, k.shape[0]), 5.0, dtype=torch.bfloat16)
    assert fp8_mqa_logits(q, k, ksc, w, ks, ke, out=out, clean=clean, backend=backend) is out
    want = oracle.ragged_logits(oracle.decode(q), oracle.decode(k), ksc, w, ks, ke)
    assert_bf16_logits(out, want, clean=clean)
    if not clean:  # cells outside the windows are not written
        outside = want == NINF
        assert bool((out[outside] == 5.0).all())


@pytest.mark.parametrize("payload", [0x7FFFFFFF, -1, 0x7FC00001])  # -1: 0xFFFFFFFF
def test_bf16_logits_keep_nan(backend, payload):
    """A NaN score (here from a NaN weight, with NaN payloads that carry into the exponent when rounded as a
    number) is a NaN in bfloat16 logits too, never a signed zero or an infinity (docs/spec.md §5, §6)."""
    g = gen(11)
    q, k = random_fp8((2, 4, 64), FN, g), random_fp8((6, 64), FN, g)
    w = torch.ones(2, 4)
    w.view(torch.int32)[0, 0] = payload
    ks, ke = int32([0, 0]), int32([6, 6])
    out = torch.zeros(2, 6, dtype=torch.bfloat16)
    fp8_mqa_logits(q, k, random_scales(6, g), w, ks, ke, out=out, backend=backend)
    assert bool(torch.isnan(out[0]).all()), out[0]
    assert not bool(torch.isnan(out[1]).any()), out[1]


@pytest.mark.uses_ops("fp8_mqa_logits")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("seed", [3, 4])
def test_ragged_compressed_logits(backend, dtype, clean, seed):
    q, k, ksc, w, ks, ke = _ragged(seed, 9, 200)
    width = int((ke - ks).clamp(min=0).max()) + 3  # wider than the longest window: the tail is past every window
    out = torch.full((9, width), 7.0, dtype=dtype)
    fp8_mqa_logits(q, k, ksc, w, ks, ke, out=out, clean=clean, max_seqlen_k=width, backend=backend)
    want = compress(oracle.ragged_logits(oracle.decode(q), oracle.decode(k), ksc, w, ks, ke), ks, ke, width)
    check(out, want, clean)


@pytest.mark.uses_ops("fp8_mqa_logits")
def test_ragged_compressed_causal_chunk_of_two_requests(backend):
    """A chunk holding two requests (the step's case): each query's window is its own request's keys."""
    g = gen(11)
    h, d = 64, 128
    _, ks, ke = causal_windows([70, 40], [5, 3])
    ks, ke = int32(ks), int32(ke)
    m, n = 8, 110
    q, k = random_fp8((m, h, d), FN, g), random_fp8((n, d), FN, g)
    ksc, w = random_scales(n, g), random_weights(m, h, g)
    out = fp8_mqa_logits(q, k, ksc, w, ks, ke, max_seqlen_k=70, backend=backend)
    assert out.shape == (8, 70) and out.dtype == torch.float32
    want = compress(oracle.ragged_logits(oracle.decode(q), oracle.decode(k), ksc, w, ks, ke), ks, ke, 70)
    check(out, want)
    out16 = fp8_mqa_logits(q, k, ksc, w, ks, ke, max_seqlen_k=70, logits_dtype=torch.bfloat16, backend=backend)
    check(out16, want)


@pytest.mark.uses_ops("fp8_mqa_logits")
def test_ragged_compressed_bad_input_writes_nothing(backend):
    q, k, ksc, w, _, _ = _ragged(5, 4, 60)
    ks, ke = int32([0, 10, 20, 0]), int32([30, 45, 20, 60])  # the last window is 60 long
    out = torch.full((4, 50), 3.0)
    expect_error(ValueError, "max_seqlen_k", lambda: fp8_mqa_logits(q, k, ksc, w, ks, ke, out=out, max_seqlen_k=50,
                                                                   backend=backend), watch=[out])
    expect_error(ValueError, "out", lambda: fp8_mqa_logits(q, k, ksc, w, ks, ke, out=out, max_seqlen_k=60,
                                                          backend=backend), watch=[out])
    expect_error(ValueError, "max_seqlen_k", lambda: fp8_mqa_logits(q, k, ksc, w, ks, ke, max_seqlen_k=-1,
                                                                   backend=backend))
    expect_error(TypeError, "out", lambda: fp8_mqa_logits(q, k, ksc, w, ks, ke, out=out.half(), max_seqlen_k=50,
                                                         backend=backend))
    expect_error(TypeError, "out", lambda: fp8_mqa_logits(q, k, ksc, w, ks, ke, out=torch.empty(4, 60),
                                                                  logits_dtype=torch.bfloat16, backend=backend))
    expect_error(TypeError, "logits_dtype", lambda: fp8_mqa_logits(q, k, ksc, w, ks, ke, logits_dtype=torch.float16,
                                                                  backend=backend))


# ------------------------------------------------------------------------------------------------ paged
@pytest.mark.uses_ops("fp8_paged_mqa_logits")
@pytest.mark.parametrize("cl_2d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("next_n", [1, 2])
def test_paged_bf16_logits(backend, cl_2d, clean, next_n):
    g = gen(20 + next_n)
    lens = [37, 0, 130, 64]
    pc = paged_case(g, lens, 16, 64, FN)
    kv, block_table = pc.kv, pc.block_table
    b, h, d = len(lens), 32, 64
    q = random_fp8((b, next_n, h, d), FN, g)
    w = random_weights(b * next_n, h, g)
    if cl_2d:
        ctx = int32([[max(0, L - next_n + j + 1 - (j % 2) * 3) for j in range(next_n)] for L in lens])
    else:
        ctx = int32(lens)
    width = block_table.shape[1] * 16
    out = torch.full((b * next_n, width), 2.0, dtype=torch.bfloat16)
    fp8_paged_mqa_logits(q, kv, w, ctx, block_table, out=out, clean=clean, backend=backend)
    want = oracle.paged_logits(q, kv, w, ctx, block_table, width)
    assert_bf16_logits(out, want, clean=clean)


def _varlen_case(seed, tokens_per_req, lens, bs=16, h=32, d=64):
    """DeepGEMM's variable tokens per request: request ``r`` has ``tokens_per_req[r]`` query tokens, token ``t``
    of it sees ``lens[r] + t`` keys; one query entry per token (``next_n = 1``) and ``indices`` its request."""
    g = gen(seed)
    longest = [L + t - 1 for L, t in zip(lens, tokens_per_req)]
    pc = paged_case(g, [max(x, 0) for x in longest], bs, d, FN)
    kv, block_table = pc.kv, pc.block_table
    indices = int32([r for r, t in enumerate(tokens_per_req) for _ in range(t)])
    ctx = int32([lens[r] + j for r, t in enumerate(tokens_per_req) for j in range(t)])
    rows = int(indices.numel())
    q = random_fp8((rows, 1, h, d), FN, g)
    w = random_weights(rows, h, g)
    return q, kv, w, ctx, block_table, indices


@pytest.mark.uses_ops("fp8_paged_mqa_logits")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("clean", [True, False])
def test_paged_indices_variable_tokens_per_request(backend, dtype, clean):
    q, kv, w, ctx, block_table, indices = _varlen_case(30, [1, 3, 2, 1, 4], [40, 17, 0, 90, 64])
    width = block_table.shape[1] * 16
    out = torch.full((q.shape[0], width), 4.0, dtype=dtype)
    fp8_paged_mqa_logits(q, kv, w, ctx, block_table, out=out, clean=clean, indices=indices, backend=backend)
    want = oracle.paged_logits(q, kv, w, ctx, block_table.index_select(0, indices.long()), width)
    check(out, want, clean)
    # the same rows without the map: the block table gathered by hand
    out2 = torch.full_like(out, 4.0)
    fp8_paged_mqa_logits(q, kv, w, ctx, block_table.index_select(0, indices.long()), out=out2, clean=clean,
                         backend=backend)
    if clean:
        assert torch.equal(out, out2)


@pytest.mark.uses_ops("fp8_paged_mqa_logits")
def test_paged_indices_with_next_n_and_2d_lengths(backend):
    """``indices`` maps query entries (of ``next_n`` tokens each) to block-table rows in any order."""
    g = gen(31)
    pc = paged_case(g, [50, 80, 20], 16, 64, FN)
    kv, block_table = pc.kv, pc.block_table
    indices = int32([2, 0, 1, 0])
    q = random_fp8((4, 2, 32, 64), FN, g)
    w = random_weights(8, 32, g)
    ctx = int32([[19, 20], [30, 31], [79, 80], [49, 50]])
    out = fp8_paged_mqa_logits(q, kv, w, ctx, block_table, indices=indices, backend=backend)
    check(out, oracle.paged_logits(q, kv, w, ctx, block_table.index_select(0, indices.long()), out.shape[1]))


@pytest.mark.uses_ops("fp8_paged_mqa_logits")
def test_paged_indices_bad_input_writes_nothing(backend):
    q, kv, w, ctx, block_table, indices = _varlen_case(32, [2, 1, 3], [10, 20, 30])
    out = torch.full((q.shape[0], block_table.shape[1] * 16), 1.0)

    def call(**kw):
        args = dict(out=out, indices=indices, backend=backend, check_values=True)
        args.update(kw)
        return lambda: fp8_paged_mqa_logits(q, kv, w, ctx, block_table, **args)

    before = snapshots(out)
    expect_error(ValueError, "indices", call(indices=int32([0, 0, 1, 2, 2, 3])), watch=[out])
    expect_error(ValueError, "indices", call(indices=int32([0, 0, -1, 2, 2, 2])), watch=[out])
    expect_error(TypeError, "indices", call(indices=indices.long()), watch=[out])
    expect_error(ValueError, "indices", call(indices=indices[:-1]), watch=[out])
    expect_error(ValueError, "indices", call(indices=torch.zeros(12, dtype=torch.int32)[::2]), watch=[out])
    expect_error(ValueError, "out", call(out=indices.view(torch.float32).view(-1, 1).expand(6, 1)))
    # a per-token length beyond its request's block-table row
    long_ctx = ctx.clone()
    long_ctx[0] = block_table.shape[1] * 16 + 1
    expect_error(ValueError, "context_lens", lambda: fp8_paged_mqa_logits(
        q, kv, w, long_ctx, block_table, out=out, indices=indices, backend=backend), watch=[out])
    expect_error(TypeError, "out", lambda: fp8_paged_mqa_logits(
        q, kv, w, ctx, block_table, out=out.half(), indices=indices, backend=backend))
    assert_unchanged([out], before)


@pytest.mark.uses_ops("fp8_paged_mqa_logits")
def test_paged_allocates_logits_dtype(backend):
    q, kv, w, ctx, block_table, indices = _varlen_case(33, [1, 2], [5, 9])
    out = fp8_paged_mqa_logits(q, kv, w, ctx, block_table, indices=indices, logits_dtype=torch.bfloat16,
                               backend=backend)
    assert out.dtype == torch.bfloat16 and out.shape == (3, block_table.shape[1] * 16)
    check(out, oracle.paged_logits(q, kv, w, ctx, block_table.index_select(0, indices.long()), out.shape[1]))


# ------------------------------------------------------------------------------------------------ custom ops
def test_custom_op_schemas_take_the_new_arguments():
    """opcheck (schema, fake, mutation and aliasing checks) on the compressed, bf16 and indices calls."""
    q, k, ksc, w, ks, ke = _ragged(40, 3, 30)
    out = torch.empty(3, 30, dtype=torch.bfloat16)
    _opcheck("fp8_mqa_logits", (q, k, ksc, w, ks, ke, out, True), {"compressed": True, "backend": "reference"})
    _opcheck("fp8_mqa_logits", (q, k, ksc, w, ks, ke, torch.empty(3, 30), False),
             {"compressed": False, "backend": "reference"})
    qp, kv, wp, ctx, bt, idx = _varlen_case(41, [2, 1], [8, 12])
    outp = torch.empty(3, bt.shape[1] * 16, dtype=torch.bfloat16)
    _opcheck("fp8_paged_mqa_logits", (qp, as_3d(kv), wp, ctx, bt, outp, True),
             {"indices": idx, "backend": "reference"})
    qk = torch.empty(32, 3, bt.shape[1] * 16)
    _opcheck("fp8_paged_mqa_logits_with_qk", (qp, as_3d(kv), wp, ctx, bt, outp, True),
             {"indices": idx, "backend": "reference", "qk": qk})


def test_compile_fullgraph_with_new_arguments():
    q, k, ksc, w, ks, ke = _ragged(42, 4, 40)
    qp, kv, wp, ctx, bt, idx = _varlen_case(43, [2, 2], [8, 12])
    width = int((ke - ks).clamp(min=0).max())

    def f(o1, o2):
        fp8_mqa_logits(q, k, ksc, w, ks, ke, out=o1, max_seqlen_k=width, check_values=False)
        fp8_paged_mqa_logits(qp, kv, wp, ctx, bt, out=o2, indices=idx, check_values=False)

    o1, o2 = torch.empty(4, width, dtype=torch.bfloat16), torch.empty(4, bt.shape[1] * 16, dtype=torch.bfloat16)
    e1, e2 = torch.empty_like(o1), torch.empty_like(o2)
    f(e1, e2)
    torch.compile(f, fullgraph=True, backend="eager")(o1, o2)
    assert torch.equal(o1, e1) and torch.equal(o2, e2)


# ------------------------------------------------------------------------------------------------ aiter
@pytest.mark.parametrize("clean", [True, False])
def test_aiter_prefill_compressed_and_bf16(fake_aiter, clean):  # noqa: F811 - the fixture
    fake_aiter("gfx950")
    q, k, ksc, w, ks, ke = _ragged(50, 6, 80)
    width = int((ke - ks).clamp(min=0).max())
    out = torch.full((6, width), 8.0, dtype=torch.bfloat16)
    mqa_aiter.fp8_mqa_logits(q, k, ksc, w, ks, ke, out=out, clean=clean, compressed=True)
    want = compress(oracle.ragged_logits(oracle.decode(q), oracle.decode(k), ksc, w, ks, ke), ks, ke, width)
    check(out, want, clean)


def test_aiter_paged_indices_and_refuses_bf16(fake_aiter):  # noqa: F811 - the fixture
    fake_aiter("gfx950")
    g = gen(51)
    bs, nb, d, h = 64, 12, 64, 8
    kv = si.new_kv_cache(nb, bs, d)
    write_aiter.write_k_cache(torch.randn(nb * bs, d, generator=g), kv, torch.arange(nb * bs), scale_fmt="ue8m0",
                              fp8_dtype=FN)
    bt = torch.randperm(nb, generator=g)[:6].to(torch.int32).view(3, 2)
    indices = int32([1, 1, 0, 2])
    ctx = int32([50, 51, 128, 7])
    q = random_fp8((4, 1, h, d), FN, g)
    w = random_weights(4, h, g)
    out = torch.full((4, 128), 0.0)
    paged_aiter.fp8_paged_mqa_logits(q, kv, w, ctx, bt, out=out, clean=True, indices=indices)
    ref = torch.full_like(out, 0.0)
    paged_aiter.fp8_paged_mqa_logits(q, kv, w, ctx, bt.index_select(0, indices.long()), out=ref, clean=True)
    assert torch.equal(out, ref)
    check(out, oracle.paged_logits(q, unshuffle(kv), w, ctx, bt.index_select(0, indices.long()), 128))
    with pytest.raises(NotImplementedError, match="float32"):
        paged_aiter.fp8_paged_mqa_logits(q, kv, w, ctx, bt, out=out.bfloat16(), clean=True, indices=indices)
