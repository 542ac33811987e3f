"""top_k_per_row (docs/spec.md §6): multiset semantics, short rows, ties, -inf/NaN, cells outside never read."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from buffers import BufferTooSmall
from sparse_indexer import top_k_per_row
from sparse_indexer.testing import TOPK_DISTRIBUTIONS, topk_values
from tests.cases import assert_topk, expect_error, gen, hyp_settings, int32

NINF, NAN, INF = float("-inf"), float("nan"), float("inf")


def test_hand_computed(backend):
    logits = torch.tensor([
        [5.0, 1.0, 3.0, 2.0, 4.0],  # window [1, 5) = 1, 3, 2, 4 -> positions of 4 and 3: {3, 1}
        [9.0, 9.0, 0.0, 0.0, 0.0],  # window [2, 4): len 2 <= topk -> [0, 1]
        [1.0, 2.0, 3.0, 4.0, 5.0],  # empty window (end < start) -> [-1, -1]
        [NAN, -1.0, NINF, -7.0, 8.0],  # window [0, 4): NaN and -inf rank last -> -1 and -7: {1, 3}
    ])
    out = torch.full((4, 2), 99, dtype=torch.int32)
    res = top_k_per_row(logits, int32([1, 2, 4, 0]), int32([5, 4, 3, 4]), out=out, backend=backend)
    assert res is out
    assert sorted(out[0].tolist()) == [1, 3]
    assert out[1].tolist() == [0, 1]
    assert out[2].tolist() == [-1, -1]
    assert sorted(out[3].tolist()) == [1, 3]


def _fill(g, n, kind):
    if kind == "distinct":
        return torch.randn(n, generator=g)
    if kind == "ties":
        return torch.randint(-3, 3, (n,), generator=g).float()
    x = torch.randn(n, generator=g)  # mixed: ties, -inf and NaN sprinkled in
    u = torch.rand(n, generator=g)
    x = torch.where(u < 0.2, torch.round(x), x)
    x = torch.where(u > 0.9, torch.full_like(x, NINF), x)
    return torch.where((u > 0.8) & (u <= 0.9), torch.full_like(x, NAN), x)


def _draw_rows(data, g, r, w, topk, kind, outside):
    """``r`` rows of width ``w``: windows drawn around ``topk`` (shorter, equal, one longer, anything) filled by
    ``_fill(kind)``, the cells outside the windows set to ``outside``. Returns (logits, starts, ends)."""
    starts, ends = [], []
    logits = torch.full((r, w), outside)
    for i in range(r):
        s = data.draw(st.integers(0, w))
        e = data.draw(st.integers(max(0, s - 2), w) | st.just(min(w, s + topk)) | st.just(min(w, s + topk + 1)))
        starts.append(s)
        ends.append(e)
        if e > s:
            logits[i, s:e] = _fill(g, e - s, kind)
    return logits, starts, ends


@hyp_settings()
@given(
    r=st.integers(1, 5),
    w=st.integers(0, 300),
    topk=st.sampled_from([1, 16, 64]),
    kind=st.sampled_from(["distinct", "ties", "mixed"]),
    outside=st.sampled_from([INF, NAN, 1e30, 0.0]),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_matches_multiset(backend, r, w, topk, kind, outside, data, seed):
    logits, starts, ends = _draw_rows(data, gen(seed), r, w, topk, kind, outside)
    out = torch.full((r, topk), 12345, dtype=torch.int32)
    top_k_per_row(logits, int32(starts), int32(ends), out=out, backend=backend)
    assert_topk(out, logits, starts, ends)


def test_all_ties_and_all_masked(backend):
    logits = torch.stack([torch.full((100,), 2.5), torch.full((100,), NINF), torch.full((100,), NAN),
                          torch.cat([torch.full((50,), NAN), torch.full((50,), NINF)])])
    out = torch.empty(4, 16, dtype=torch.int32)
    top_k_per_row(logits, int32([0, 3, 0, 10]), int32([100, 90, 100, 95]), out=out, backend=backend)
    assert_topk(out, logits, [0, 3, 0, 10], [100, 90, 100, 95])


def test_fewer_finite_than_topk(backend):
    g = gen(3)
    x = torch.full((2, 200), NINF)
    x[0, torch.randperm(200, generator=g)[:10]] = torch.randn(10, generator=g)
    x[1, ::7] = NAN
    x[1, 3:40:9] = torch.arange(5.0)
    out = torch.empty(2, 64, dtype=torch.int32)
    top_k_per_row(x, int32([0, 0]), int32([200, 200]), out=out, backend=backend)
    assert_topk(out, x, [0, 0], [200, 200])


def test_topk_2048(backend):
    g = gen(4)
    w = 4100
    x = torch.randn(4, w, generator=g)
    x[1] = torch.randint(0, 50, (w,), generator=g).float()  # heavy ties
    x[2, ::3] = NINF
    starts, ends = [0, 4, 1000, 7], [4096, 4100, 3048, 107]  # len 4096, 4096, 2048 (== topk), 100
    out = torch.empty(4, 2048, dtype=torch.int32)
    top_k_per_row(x, int32(starts), int32(ends), out=out, backend=backend)
    assert_topk(out, x, starts, ends)


def test_row_strided_logits(backend):
    g = gen(5)
    big = torch.randn(3, 500, generator=g)
    logits = big[:, 100:400]
    out = torch.empty(3, 32, dtype=torch.int32)
    top_k_per_row(logits, int32([0, 50, 299]), int32([300, 120, 300]), out=out, backend=backend)
    assert_topk(out, logits, [0, 50, 299], [300, 120, 300])


def test_zero_rows(backend):
    out = torch.empty(0, 16, dtype=torch.int32)
    top_k_per_row(torch.empty(0, 10), int32([]), int32([]), out=out, backend=backend)


def _base():
    return dict(logits=torch.randn(3, 40, generator=gen(6)), row_starts=int32([0, 5, 39]),
                row_ends=int32([40, 10, 40]), out=torch.zeros(3, 8, dtype=torch.int32))


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


BAD = [
    ("logits dtype", lambda a: {"logits": a["logits"].double()}, TypeError, "logits"),
    ("logits float16", lambda a: {"logits": a["logits"].half()}, TypeError, "logits"),
    ("logits 1-D", lambda a: {"logits": a["logits"][0]}, ValueError, "logits"),
    ("logits strided", lambda a: {"logits": torch.zeros(40, 3).T}, ValueError, "logits"),
    ("starts int64", lambda a: {"row_starts": a["row_starts"].long()}, TypeError, "row_starts"),
    ("starts shape", lambda a: {"row_starts": int32([0, 0])}, ValueError, "row_starts"),
    ("starts meta", lambda a: {"row_starts": _meta(a["row_starts"])}, ValueError, "row_starts"),
    ("starts negative", lambda a: {"row_starts": int32([0, -1, 39])}, ValueError, "row_starts"),
    ("ends int64", lambda a: {"row_ends": a["row_ends"].long()}, TypeError, "row_ends"),
    ("ends shape", lambda a: {"row_ends": int32([[40, 10, 40]])}, ValueError, "row_ends"),
    ("ends meta", lambda a: {"row_ends": _meta(a["row_ends"])}, ValueError, "row_ends"),
    ("ends beyond W", lambda a: {"row_ends": int32([41, 10, 40])}, ValueError, "row_ends"),
    ("out int64", lambda a: {"out": torch.zeros(3, 8, dtype=torch.int64)}, TypeError, "out"),
    ("out rows", lambda a: {"out": torch.zeros(2, 8, dtype=torch.int32)}, ValueError, "out"),
    ("out topk 0", lambda a: {"out": torch.zeros(3, 0, dtype=torch.int32)}, ValueError, "out"),
    ("out 1-D", lambda a: {"out": torch.zeros(3, dtype=torch.int32)}, ValueError, "out"),
    ("out strided", lambda a: {"out": torch.zeros(8, 3, dtype=torch.int32).T}, ValueError, "out"),
    ("out meta", lambda a: {"out": _meta(a["out"])}, ValueError, "out"),
    ("out aliases logits", lambda a: {"out": a["logits"].view(torch.int32)[:, :8]}, ValueError, "out"),
]


@pytest.mark.parametrize("what, change, exc, name", BAD, ids=[b[0] for b in BAD])
def test_validation(backend, what, change, exc, name):
    a = _base()
    a.update(change(a))
    watch = [t for t in a.values() if t.device.type != "meta"]
    expect_error(exc, name, lambda: top_k_per_row(**a, backend=backend), watch=watch)


# ---------------------------------------------------------------- with a workspace (split-row path on Triton)
WS_COLS = 32 + 2 * 512  # counters + 512 candidates


@pytest.fixture(scope="module", autouse=True)
def _split_any_width():
    """The tests here use narrow rows: let them take the Triton split path anyway (on the GPU rows narrower
    than ``SPLIT_MIN_WIDTH`` take the one-launch kernel; :func:`test_split_min_width` checks that)."""
    try:
        from sparse_indexer.ops.top_k_per_row import triton as tkt
    except ImportError:  # no Triton: only other backends run
        yield
        return
    was = tkt.SPLIT_MIN_WIDTH
    tkt.SPLIT_MIN_WIDTH = 0
    yield
    tkt.SPLIT_MIN_WIDTH = was


def test_split_min_width(backend):
    """Triton: few rows narrower than ``SPLIT_MIN_WIDTH`` take the one-program-per-row kernel (one launch, the
    workspace untouched), wider ones the split path; the selection is exact either way."""
    if backend != "triton":
        pytest.skip("the split path is the Triton backend's")
    from sparse_indexer.ops.top_k_per_row import triton as tkt

    cpu = torch.device("cpu")
    wide = 1 << 20  # wider than any SPLIT_MIN_WIDTH: the rows decide
    assert tkt.use_split(4, cpu, wide) and not tkt.use_split(0, cpu, wide) and not tkt.use_split(2 * 64, cpu, wide)
    g = gen(12)
    x = torch.randn(3, 700, generator=g)
    starts, ends = [0, 5, 0], [700, 650, 100]
    for min_width, split in ((701, False), (700, True)):
        tkt.SPLIT_MIN_WIDTH = min_width
        try:
            assert tkt.use_split(3, cpu, 700) is split
            ws = _ws(3)
            out = torch.full((3, 128), 7, dtype=torch.int32)
            top_k_per_row(x, int32(starts), int32(ends), out=out, backend=backend, workspace=ws)
        finally:
            tkt.SPLIT_MIN_WIDTH = 0
        assert_topk(out, x, starts, ends)
        assert bool((ws[:2, :4] != -12345).all()) is split


def _ws(r, cols=WS_COLS):
    return torch.full((r, cols), -12345, dtype=torch.int32)


def _split_taken(backend, ws, n, topk):
    """On Triton (few rows), every long row's counters were written by the split path."""
    if backend == "triton":
        long_rows = torch.as_tensor(n) > topk
        assert (ws[long_rows, :4] != -12345).all(), "the split path did not run"


@hyp_settings()
@given(
    r=st.integers(1, 5),
    w=st.integers(0, 300),
    topk=st.sampled_from([1, 16, 64]),
    kind=st.sampled_from(["distinct", "ties", "mixed"]),
    cols=st.sampled_from([34, 40, WS_COLS]),  # 1, 4, 512 candidate slots (the narrow ones overflow)
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_workspace_matches_multiset(backend, r, w, topk, kind, cols, data, seed):
    logits, starts, ends = _draw_rows(data, gen(seed), r, w, topk, kind, NAN)
    out = torch.full((r, topk), 12345, dtype=torch.int32)
    ws = _ws(r + data.draw(st.integers(0, 2)), cols)
    top_k_per_row(logits, int32(starts), int32(ends), out=out, backend=backend, workspace=ws)
    assert_topk(out, logits, starts, ends)
    _split_taken(backend, ws[:r], [e - s for s, e in zip(starts, ends)], topk)


def test_workspace_topk_2048(backend):
    """DeepSeek topk over long rows: distinct, heavy ties (threshold-bin overflow), -inf/NaN heavy, fewer finite
    cells than topk, exactly topk, short and empty windows, unaligned starts and ends."""
    g = gen(7)
    w = 12003
    x = torch.randn(10, w, generator=g)
    x[1] = torch.randint(0, 4, (w,), generator=g).float()  # ~3000 ties per value: candidates overflow
    x[2] = 1.0  # all equal
    x[3, ::2] = NINF
    x[3, 1::4] = NAN  # 3/4 -inf/NaN, ~3000 finite
    x[4] = NINF
    x[4, torch.randperm(w, generator=g)[:1000]] = torch.randn(1000, generator=g)  # 1000 finite < topk
    x[5] = NAN
    starts = [0, 1, 2, 3, 0, 5, 100, 7, 12000, 13]
    ends = [12003, 12002, 12001, 12000, 12003, 12003, 2148, 107, 12000, 9999]  # row 6: len == topk
    out = torch.full((10, 2048), 12345, dtype=torch.int32)
    ws = _ws(10, 32 + 2 * 2048)
    top_k_per_row(x, int32(starts), int32(ends), out=out, backend=backend, workspace=ws)
    assert_topk(out, x, starts, ends)
    _split_taken(backend, ws, [e - s for s, e in zip(starts, ends)], 2048)


def test_workspace_bracket_fallback(backend):
    """Rows whose candidates overflow a tiny workspace row, or whose sample bracket is off, are still exact."""
    g = gen(8)
    x = torch.randn(3, 5000, generator=g)
    x[1, :4000] = 3.0  # 4000 cells tie above every other one
    x[2] = torch.linspace(-1, 1, 5000)
    starts, ends = [0, 0, 17], [5000, 5000, 4999]
    for cols in (34, 36, WS_COLS):
        out = torch.full((3, 256), 12345, dtype=torch.int32)
        top_k_per_row(x, int32(starts), int32(ends), out=out, backend=backend, workspace=_ws(3, cols))
        assert_topk(out, x, starts, ends)


def test_workspace_row_strided_logits(backend):
    g = gen(9)
    big = torch.randn(3, 5003, generator=g)
    logits = big[:, 1:5001]
    out = torch.empty(3, 300, dtype=torch.int32)
    ws = torch.full((3, WS_COLS + 5), 0, dtype=torch.int32)[:, 3:]  # row stride != columns
    top_k_per_row(logits, int32([0, 50, 1]), int32([5000, 4000, 302]), out=out, backend=backend, workspace=ws)
    assert_topk(out, logits, [0, 50, 1], [5000, 4000, 302])


def test_workspace_zero_rows(backend):
    out = torch.empty(0, 16, dtype=torch.int32)
    top_k_per_row(torch.empty(0, 10), int32([]), int32([]), out=out, backend=backend, workspace=_ws(0))


BAD_WS = [
    ("rows", lambda a: {"workspace": _ws(2)}, BufferTooSmall, "workspace"),
    ("columns", lambda a: {"workspace": _ws(3, 33)}, BufferTooSmall, "workspace"),
    ("dtype", lambda a: {"workspace": _ws(3).float()}, TypeError, "workspace"),
    ("1-D", lambda a: {"workspace": _ws(3)[0]}, ValueError, "workspace"),
    ("strided", lambda a: {"workspace": _ws(WS_COLS, 3).T}, ValueError, "workspace"),
    ("meta", lambda a: {"workspace": _meta(_ws(3))}, ValueError, "workspace"),
    ("aliases out", lambda a: {"workspace": a["out"].view(3, 8)}, (ValueError, BufferTooSmall), "workspace"),
    ("aliases logits", lambda a: {"workspace": a["logits"].view(torch.int32)}, ValueError, "workspace"),
]


@pytest.mark.parametrize("what, change, exc, name", BAD_WS, ids=[b[0] for b in BAD_WS])
def test_workspace_validation(backend, what, change, exc, name):
    a = _base()
    a["workspace"] = _ws(3)
    a.update(change(a))
    watch = [t for t in a.values() if t.device.type != "meta"]
    expect_error(exc, name, lambda: top_k_per_row(**a, backend=backend), watch=watch)


def test_workspace_alias_checked():
    a = _base()
    big = torch.zeros(3 * WS_COLS + 100, dtype=torch.int32)
    out = big[: 3 * 8].view(3, 8)
    ws = big[:3 * WS_COLS].view(3, WS_COLS)
    expect_error(ValueError, "workspace", lambda: top_k_per_row(a["logits"], a["row_starts"], a["row_ends"],
                                                                out=out, workspace=ws), watch=[big])


# ---------------------------------------------------------------- the step passes Buffers.topk_scratch
@pytest.mark.uses_ops()  # the whole step
def test_step_uses_topk_scratch_and_checks_it(backend):
    import attrs

    import sparse_indexer as si
    from buffers import allocate
    from tests.sparse_indexer.test_indexer import Scenario, limits

    lim = limits(next_n=2, n_heads=16, head_dim=64, topk=8, max_model_len=128, max_num_batched_tokens=64,
                 max_num_seqs=4)
    sc = Scenario([40, 7, 100, 64], [2, 2, 2, 1], lim=lim, seed=31)
    md = sc.metadata()
    bufs = allocate(lim)
    bufs.topk_scratch.fill_(-12345)
    got = torch.full((md.num_tokens, lim.topk), 7, dtype=torch.int32)
    si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, bufs, got, backend=backend)
    want = torch.full_like(got, 7)
    kv = sc.kv.clone()
    si.sparse_attn_indexer(sc.q, sc.k, sc.w, kv, md, attrs.evolve(bufs, topk_scratch=None), want, backend=backend)
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)  # any order (docs/spec.md §6)
    if backend == "triton":  # long decode rows went through the split path
        assert (bufs.topk_scratch[: md.decode.num_rows, :2] != -12345).any()

    small = attrs.evolve(bufs, topk_scratch=bufs.topk_scratch[:1])
    narrow = attrs.evolve(bufs, topk_scratch=torch.zeros(bufs.topk_scratch.shape[0], 33, dtype=torch.int32))
    for b in (small, narrow):
        out = torch.full_like(got, 7)
        kv0 = sc.kv.clone()
        with pytest.raises(BufferTooSmall) as info:
            si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, b, out, backend=backend)
        assert info.value.field == "topk_scratch"
        assert torch.equal(sc.kv, kv0) and bool((out == 7).all())


# the top-k value distributions (the CUDA and Triton kernels are timed and checked on the GPU on the same
# ones: bench --sweep topk, tests/gpu/test_topk_cuda_gpu.py)
DISTRIBUTIONS = TOPK_DISTRIBUTIONS


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_value_distributions(backend, dist):
    """Every distribution, full / ragged / short windows, with and without the workspace (split path)."""
    g = gen(11)
    w, topk = 3000, 256
    x = topk_values(dist, 4, w, generator=g)
    starts, ends = [0, 0, 17, 5], [w, 2500, 2999, 200]
    for ws in (None, torch.empty(4, 32 + 2 * 1024, dtype=torch.int32)):
        out = torch.full((4, topk), 7, dtype=torch.int32)
        top_k_per_row(x, int32(starts), int32(ends), out=out, backend=backend, workspace=ws)
        assert_topk(out, x, starts, ends)


def test_cuda_backend_reported_unavailable_off_nvidia():
    """The CUDA backend is never faked: on the CPU it is unavailable (explicitly: an error naming why) and
    ``auto`` never tries it; for ops it does not implement ``auto`` skips it."""
    import sparse_indexer as si
    from sparse_indexer._runtime import dispatch as _dispatch

    assert "cuda" in si.BACKENDS
    assert "cuda" not in si.available("cpu")
    assert "NVIDIA" in _dispatch.unavailable_reason("cuda", torch.device("cpu"))
    x = torch.randn(2, 50)
    out = torch.empty(2, 4, dtype=torch.int32)
    with pytest.raises(si.BackendUnavailable, match="cuda"):
        top_k_per_row(x, int32([0, 0]), int32([50, 50]), out=out, backend="cuda")
    assert _dispatch.PARTIAL_BACKENDS["cuda"] == ("top_k_per_row", "fp8_paged_mqa_topk", "select_candidate_blocks",
                                                  "fp8_paged_mqa_logits")


def test_cuda_backend_layout():
    """Shared-memory layout of the CUDA kernel (host arithmetic only; the kernel is checked on the GPU)."""
    from sparse_indexer.ops.top_k_per_row import cuda as tkc

    cap, samp, small_max, smem = tkc.layout(2048, 65536)
    assert (cap, samp, small_max) == (8192, tkc.SAMPLE_SHORT, 8192)
    assert smem == 4 * (tkc.SM_WORDS - tkc.SMAX + tkc.SAMPLE_SHORT + 2 * 8192 + 2048) <= 227 * 1024
    cap, samp, small_max, smem = tkc.layout(2048, 65537)  # longer rows: the larger sample
    assert (cap, samp, small_max) == (8192, tkc.SMAX, 8192)
    assert smem == 4 * (tkc.SM_WORDS + 2 * 8192 + 2048) <= 227 * 1024
    cap, samp, small_max, smem = tkc.layout(2048, 8192)  # every window fits: no sample, keys only
    assert (cap, samp, small_max) == (8192, 0, 8192) and smem < 48 * 1024
    assert tkc.layout(2048, 8192, small=False)[2] == 0  # every long row sampled
    assert 4 * (tkc.SM_WORDS + 2 * tkc.cap_for(tkc.MAX_TOPK) + tkc.MAX_TOPK) <= 227 * 1024
    cap, samp, small_max, smem = tkc.layout(512, 16383, small=True)  # a row in shared memory: whole 16-byte words
    assert (cap, samp, small_max) == (16384, 0, 16383) and smem == 4 * (tkc.SM_WORDS - tkc.SMAX + 16384)
    assert tkc.layout(512, tkc.SMALL_MAX_CELLS, small=True)[3] <= 227 * 1024
    with pytest.raises(ValueError, match="small layout"):
        tkc.layout(2048, tkc.SMALL_MAX_CELLS + 1, small=True)
    # the L2 request before the bounds: the row's share per CTA, whole lines inside the row, capped; rows in
    # shared memory and at most one row per SM only
    assert tkc.speculative_bytes(64, 65536, 1, 132, True) == 65536
    assert tkc.speculative_bytes(1, 100000, 2, 132, True) == 50000 // 128 * 128
    assert tkc.speculative_bytes(1, 1 << 20, 1, 132, True) == tkc.SPEC_ROW_BYTES
    assert tkc.speculative_bytes(133, 65536, 1, 132, True) == 0
    assert tkc.speculative_bytes(64, 65536, 2, 132, False) == 0


# ---------------------------------------------------------------- bfloat16 logits, compressed rows
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
def test_bfloat16_logits(backend, dist):
    """bfloat16 logits: exact on the values given (rounding to bfloat16 makes ties; the multiset rule takes any of
    them), full / ragged / short / unaligned windows, with and without the workspace."""
    g = gen(12)
    w, topk = 3001, 256
    x = topk_values(dist, 5, w, generator=g).to(torch.bfloat16)
    starts, ends = [0, 0, 17, 5, 3], [w, 2500, 2999, 200, 3000]
    for ws in (None, torch.empty(5, 32 + 2 * 1024, dtype=torch.int32)):
        out = torch.full((5, topk), 7, dtype=torch.int32)
        top_k_per_row(x, int32(starts), int32(ends), out=out, backend=backend, workspace=ws)
        assert_topk(out, x, starts, ends)


def test_bfloat16_ties_at_the_kth_value(backend):
    """Distinct float32 values that round to the same bfloat16 value are ties: any of them completes the top-k,
    judged on the bfloat16 values (a float32 order would be a different, also valid, answer for float32 input)."""
    g = gen(13)
    x32 = 1.0 + torch.rand(2, 4000, generator=g) * 2 ** -6  # 1 + [0, 1/64): 3 bfloat16 values for 4000 cells
    x = x32.to(torch.bfloat16)
    assert x.unique().numel() <= 4
    out = torch.full((2, 100), 7, dtype=torch.int32)
    top_k_per_row(x, int32([0, 1]), int32([4000, 3999]), out=out, backend=backend)
    assert_topk(out, x, [0, 1], [4000, 3999])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_rows(backend, dtype):
    """Compressed logits (DeepGEMM's ``max_seqlen_k``): row ``i`` holds its window's scores from column 0 and the
    cells past its length are unspecified (here NaN, +inf and huge values): windows ``[0, len_i)``, no copy."""
    g = gen(14)
    lens = [1500, 700, 1, 0, 1200, 300, 1499]
    w, topk = 1500, 512
    x = torch.randn(len(lens), w, generator=g)
    for i, n in enumerate(lens):
        x[i, n:] = (float("nan"), float("inf"), 3e38)[i % 3]
    x = x.to(dtype)
    starts, ends = [0] * len(lens), lens
    for ws in (None, torch.empty(len(lens), 32 + 2 * 1024, dtype=torch.int32)):
        out = torch.full((len(lens), topk), 7, dtype=torch.int32)
        top_k_per_row(x, int32(starts), int32(ends), out=out, backend=backend, workspace=ws)
        assert_topk(out, x, starts, ends)
