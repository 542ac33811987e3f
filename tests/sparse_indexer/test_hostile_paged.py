"""Hostile values with value checks off (docs/spec.md §10): fp8_paged_mqa_logits (FP8 with float32 and ue8m0x4
scales, MXFP4 in the flat and a tiled order; next_n 1-4, 1-D and 2-D context lengths, ``indices``) on limits past
``W`` and past the block table, negative and huge lengths, block ids outside the cache and ``indices`` outside the
block table.

Each case gives the op exact-size input tensors (so compute-sanitizer's memcheck sees an out-of-bounds read) and an
``out`` that is a slice in the middle of a guard buffer of sentinel bytes (so a stray write shows), calls it with
``check_values=False`` and checks that the guard bytes and the inputs are unchanged and that the result is the
reference backend's on the same inputs (relative L2 ``LOGITS_RTOL_L2`` on the CPU, where the Triton interpreter's
dot sums in another order than torch; the paged GPU tests' ``2e-4``, ``4e-3`` for bfloat16, on a GPU; ``-inf`` and
untouched cells exactly). The semantics (the reference's, :func:`test_reference_semantics`): each row's limit
clamped to ``[0, min(W, max_blocks * block_size)]``, a block id outside ``[0, num_blocks)`` a zero key (its
in-window cells 0), an ``indices`` entry outside ``[0, num_requests)`` an empty window.
Runs on the CPU (reference; Triton under ``TRITON_INTERPRET=1``) and on a CUDA GPU (triton, gluon)."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from buffers import CacheFormat
from sparse_indexer import backends as registry
from sparse_indexer.testing import LOGITS_RTOL_L2

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
GUARD = 64  # guard bytes before and after the output (a multiple of 16: the output keeps its alignment)
SENTINEL = 0x5A
OUT_SENTINEL = 1536.0  # cells outside the windows with clean=False keep it (exact in bfloat16)
NINF = float("-inf")
BIG = 2**30
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
MX = CacheFormat(values="mxfp4")
MX_TILED = CacheFormat(values="mxfp4", order="tiled:4,16,2")  # runs of 4 keys, 16-byte chunks, 2 scale lanes
UE8M0X4 = CacheFormat(scale="ue8m0x4")
H, D = 64, 128  # FP8: the Gluon kernel's shape (block size 64)
MX_H, MX_D = 16, 64

pytestmark = pytest.mark.uses_ops("fp8_paged_mqa_logits")


def _usable(backend: str, bs: int = 64, fmt: CacheFormat | None = None) -> None:
    if backend in ("gluon", "cuda") and DEV.type != "cuda":
        pytest.skip(f"{backend} runs on a CUDA GPU only")
    why = registry.get(backend).unavailable_reason(DEV)
    if why is not None:
        pytest.skip(f"{backend} is unavailable here: {why}")
    if backend == "gluon" and (bs != 64 or fmt is not None):
        pytest.skip("the Gluon kernel reads block size 64, float32 scales, FP8 values only")


def _guarded(rows: int, width: int, dtype: torch.dtype):
    """``(buffer, out)``: a uint8 buffer of sentinel bytes with ``out [rows, width]`` (contiguous, every cell
    ``OUT_SENTINEL``) in its middle, ``GUARD`` bytes on either side."""
    nbytes = rows * width * torch.empty((), dtype=dtype).element_size()
    buf = torch.full((GUARD + nbytes + GUARD,), SENTINEL, dtype=torch.uint8, device=DEV)
    out = buf[GUARD:GUARD + nbytes].view(dtype).view(rows, width)
    out.fill_(OUT_SENTINEL)
    return buf, out


def _check_guard(buf: torch.Tensor) -> None:
    assert bool((buf[:GUARD] == SENTINEL).all()), "bytes before out were written"
    assert bool((buf[-GUARD:] == SENTINEL).all()), "bytes after out were written"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _compare(got: torch.Tensor, want: torch.Tensor) -> None:
    """``-inf`` and untouched cells exactly, scores within the tolerance (module docstring)."""
    exact = (want == NINF) | (want == OUT_SENTINEL) | (got == NINF) | (got == OUT_SENTINEL)
    assert torch.equal(torch.where(exact, got, 0), torch.where(exact, want, 0)), "-inf / untouched cells differ"
    a, e = torch.where(exact, 0, got).double(), torch.where(exact, 0, want).double()
    assert bool(torch.isfinite(a).all()), "non-finite scores inside the windows"
    err = float((a - e).norm()) / max(float(e.norm()), 1e-300)
    if got.dtype == torch.bfloat16:
        tol = 2.0**-8 if DEV.type == "cpu" else 4e-3
    else:
        tol = LOGITS_RTOL_L2 if DEV.type == "cpu" else 2e-4
    assert err <= tol, f"the logits differ from the reference's: relative L2 {err:.2e} > {tol:.0e}"


def _fp8_inputs(g, b: int, next_n: int, nb: int, bs: int, fmt: CacheFormat | None):
    kv = si.new_kv_cache(nb, bs, D)
    if nb:
        si.write_k_cache(torch.randn(nb * bs, D, generator=g) * 3, kv, torch.arange(nb * bs, dtype=torch.int32),
                         backend="reference", cache_format=fmt)
    q = (torch.randn(b, next_n, H, D, generator=g) * 4).to(torch.float8_e4m3fn)
    w = torch.randn(b * next_n, H, generator=g) * 0.25
    return q, kv, w, {} if fmt is None else {"cache_format": fmt}


def _mx_inputs(g, b: int, next_n: int, nb: int, bs: int, fmt: CacheFormat):
    kv = si.new_kv_cache(nb, bs, MX_D, mxfp4=True)
    if nb:
        si.write_k_cache(torch.randn(nb * bs, MX_D, generator=g), kv, torch.arange(nb * bs, dtype=torch.int32),
                         cache_format=fmt, backend="reference")
    qv, qs = si.quantize_q_mxfp4(torch.randn(b * next_n, MX_H, MX_D, generator=g))
    w = torch.randn(b * next_n, MX_H, generator=g) * (MX_H * MX_D) ** -0.5
    return (qv.view(b, next_n, MX_H, MX_D // 2), kv, w,
            {"cache_format": fmt, "q_scale": qs.view(b, next_n, MX_H, MX_D // 32)})


def _lengths(b: int, next_n: int, two_d: bool, cap: int, g) -> torch.Tensor:
    """Huge, negative (the int32 minimum too), past the block table, in range: ``[B]`` or ``[B, next_n]``."""
    hostile = [BIG, -5, I32_MIN, I32_MAX, cap + 3, cap, 70, 1, 0, cap - 1]
    n = b * next_n if two_d else b
    vals = torch.tensor([hostile[i % len(hostile)] for i in range(n)], dtype=torch.int64)
    vals = vals[torch.randperm(n, generator=g)]
    return vals.view(b, next_n).to(torch.int32) if two_d else vals.to(torch.int32)


def _table(rows: int, max_blocks: int, nb: int, g) -> torch.Tensor:
    """Valid ids mixed with ids past the cache, negative ones other than -1, huge ones."""
    bt = torch.randint(0, max(1, nb), (rows, max_blocks), generator=g, dtype=torch.int64)
    bad = torch.tensor([nb, nb + 3, BIG, -1, -7, I32_MIN, I32_MAX])
    pick = torch.rand(rows, max_blocks, generator=g) < 0.4
    bt = torch.where(pick, bad[torch.randint(0, len(bad), (rows, max_blocks), generator=g)], bt)
    return bt.to(torch.int32)


def _run(backend: str, q, kv, w, cl, bt, width: int, clean: bool, dtype: torch.dtype, indices=None, **kw):
    """The op on exact-size device copies of the inputs, ``out`` guarded; the inputs checked unchanged."""
    ins = [t.to(DEV).contiguous().clone() for t in (q, kv, w, cl, bt)]
    extra = {k: (v.to(DEV).clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    if indices is not None:
        extra["indices"] = indices.to(DEV).clone()
    watched = ins + [v for v in extra.values() if isinstance(v, torch.Tensor)]
    before = [_bytes(t).clone() for t in watched]
    buf, out = _guarded(q.shape[0] * q.shape[1], width, dtype)
    res = si.fp8_paged_mqa_logits(*ins, out=out, clean=clean, backend=backend, check_values=False, **extra)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    assert res is out
    _check_guard(buf)
    for i, (t, b_) in enumerate(zip(watched, before)):
        assert torch.equal(_bytes(t), b_), f"input #{i} was written"
    return out.clone()


def _foreign(q, kv, bt, width: int, indices=None) -> torch.Tensor:
    """``[rows, width]``: the cells whose key's block id is outside the cache (their scores are the kernel's:
    docs/spec.md §10; the Triton kernel's scales-ahead configuration clamps such an id into the cache)."""
    b, next_n = q.shape[0], q.shape[1]
    nb, bs = kv.shape[0], kv.shape[1]
    rows = indices.long().clamp(0, max(bt.shape[0] - 1, 0)) if indices is not None else torch.arange(b)
    cols = torch.arange(width)
    blk = cols // bs
    inside = blk < bt.shape[1]
    ids = torch.full((b, width), -1, dtype=torch.int64)
    if bt.shape[0] and bt.shape[1]:
        ids[:, inside] = bt.long()[rows][:, blk[inside]]
    bad = (ids < 0) | (ids >= nb)
    return bad.repeat_interleave(next_n, dim=0)


def _against_reference(backend, q, kv, w, cl, bt, width, clean, dtype, indices=None, **kw):
    got = _run(backend, q, kv, w, cl, bt, width, clean, dtype, indices, **kw)
    want = _run("reference", q, kv, w, cl, bt, width, clean, dtype, indices, **kw)
    if backend == "triton":
        _compare_known(got, want, _foreign(q, kv, bt, width, indices))
    else:
        _compare(got, want)
    return want


def _compare_known(got: torch.Tensor, want: torch.Tensor, foreign: torch.Tensor) -> None:
    """:func:`_compare` on every cell but the ``foreign`` ones (whose scores are the kernel's; they must still be
    finite or the reference's ``-inf``/untouched value)."""
    f = foreign.to(got.device)
    odd = f & ~torch.isfinite(got.float()) & (got.float() != want.float())
    assert not bool(odd.any()), "a cell of a block outside the cache is neither finite nor the reference's"
    _compare(torch.where(f, want, got), want)


# (next_n, 2-D lengths, block size, width, clean): width "past" = the table's capacity + 40 (limits past the table),
# "short" = 100 (limits past W, not a multiple of the 64-key tile)
FP8_CASES = [(nn, two_d, bs, width, (nn + two_d + (bs == 16) + (width == "short")) % 2 == 0)
             for nn in (1, 2, 3, 4) for two_d in (False, True) for bs in (64, 16) for width in ("past", "short")]


@pytest.mark.parametrize("next_n,two_d,bs,width,clean", FP8_CASES)
def test_fp8_hostile(backend, next_n, two_d, bs, width, clean):
    _usable(backend, bs)
    g = torch.Generator().manual_seed(next_n * 10 + two_d + bs)
    b, nb, max_blocks = 5, 4, 192 // bs
    q, kv, w, kw = _fp8_inputs(g, b, next_n, nb, bs, None)
    cap = max_blocks * bs
    cl = _lengths(b, next_n, two_d, cap, g)
    bt = _table(b, max_blocks, nb, g)
    _against_reference(backend, q, kv, w, cl, bt, cap + 40 if width == "past" else 100, clean, torch.float32, **kw)


@pytest.mark.parametrize("next_n", [1, 2])
@pytest.mark.parametrize("fmt", ["ue8m0x4", "bf16"])
def test_fp8_hostile_formats(backend, next_n, fmt):
    """ue8m0x4 scales (a bad block's scale 0, not the byte 0's 2**-127), a bfloat16 ``out``."""
    cf = UE8M0X4 if fmt == "ue8m0x4" else None
    _usable(backend, 64, cf)
    g = torch.Generator().manual_seed(7 + next_n)
    b, nb, bs, max_blocks = 4, 3, 64, 3
    q, kv, w, kw = _fp8_inputs(g, b, next_n, nb, bs, cf)
    cl = _lengths(b, next_n, next_n == 2, max_blocks * bs, g)
    bt = _table(b, max_blocks, nb, g)
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    _against_reference(backend, q, kv, w, cl, bt, 150, next_n == 1, dtype, **kw)


@pytest.mark.parametrize("mx", ["fp8", "mxfp4"])
@pytest.mark.parametrize("clean", [True, False], ids=["clean", "dirty"])
def test_indices_hostile(backend, mx, clean):
    """``indices`` past the requests, negative, huge (next_n = 1, per-token 1-D lengths)."""
    _usable(backend, 64, MX if mx == "mxfp4" else None)
    g = torch.Generator().manual_seed(11 + clean)
    b, nr, nb, bs, max_blocks = 8, 3, 4, 64, 2
    if mx == "mxfp4":
        q, kv, w, kw = _mx_inputs(g, b, 1, nb, bs, MX)
    else:
        q, kv, w, kw = _fp8_inputs(g, b, 1, nb, bs, None)
    cl = torch.tensor([100, 128, 70, BIG, 5, 90, 128, 60], dtype=torch.int32)
    idx = torch.tensor([0, nr, -1, 2, BIG, I32_MIN, 1, -3], dtype=torch.int32)
    bt = _table(nr, max_blocks, nb, g)
    want = _against_reference(backend, q, kv, w, cl, bt, 140, clean, torch.float32, indices=idx, **kw)
    for r in (1, 2, 4, 5, 7):  # the entries of bad indices: empty windows
        assert bool((want[r] == (NINF if clean else OUT_SENTINEL)).all())


MX_CASES = [(1, False, 16, "flat", "past"), (2, True, 16, "flat", "short"), (3, False, 64, "tiled", "short"),
            (4, True, 64, "tiled", "past"), (2, False, 64, "flat", "past"), (1, True, 16, "tiled", "short")]


@pytest.mark.parametrize("next_n,two_d,bs,order,width", MX_CASES)
def test_mxfp4_hostile(backend, next_n, two_d, bs, order, width):
    fmt = MX if order == "flat" else MX_TILED
    _usable(backend, bs, fmt)
    g = torch.Generator().manual_seed(next_n * 3 + bs)
    b, nb, max_blocks = 4, 5, 128 // bs
    q, kv, w, kw = _mx_inputs(g, b, next_n, nb, bs, fmt)
    cap = max_blocks * bs
    cl = _lengths(b, next_n, two_d, cap, g)
    bt = _table(b, max_blocks, nb, g)
    _against_reference(backend, q, kv, w, cl, bt, cap + 24 if width == "past" else 90, next_n % 2 == 1,
                       torch.float32, **kw)


@pytest.mark.parametrize("mx", ["fp8", "mxfp4"])
@pytest.mark.parametrize("what", ["no_blocks", "no_table"])
def test_empty_cache_or_table(backend, mx, what):
    """A cache of no blocks (every id outside it: in-window cells 0) or a block table of no columns (no window)."""
    _usable(backend, 64, MX if mx == "mxfp4" else None)
    g = torch.Generator().manual_seed(3)
    b, next_n = 3, 2
    nb, max_blocks = (0, 2) if what == "no_blocks" else (2, 0)
    if mx == "mxfp4":
        q, kv, w, kw = _mx_inputs(g, b, next_n, nb, 64, MX)
    else:
        q, kv, w, kw = _fp8_inputs(g, b, next_n, nb, 64, None)
    cl = torch.tensor([BIG, 70, -4], dtype=torch.int32)
    bt = _table(b, max_blocks, nb, g)
    want = _against_reference(backend, q, kv, w, cl, bt, 130, True, torch.float32, **kw)
    if what == "no_table":
        assert bool((want == NINF).all())


@pytest.mark.parametrize("config", [{"SPLIT": True}, {"KSC_PF": 2}, {"BLOCK_N": 32, "KSC_PF": 1}],
                         ids=["split", "pf2", "block32"])
def test_triton_configs(config):
    """The Triton kernel's other paths (one dot per token, the scales two tiles ahead, a smaller tile), called
    directly with the same hostile inputs as the public function's."""
    _usable("triton", 64)
    from sparse_indexer.kcache import as_3d
    from sparse_indexer.ops.fp8_paged_mqa_logits import triton as tri

    g = torch.Generator().manual_seed(5)
    b, next_n, nb, bs, max_blocks = 4, 2, 3, 64, 3
    q, kv, w, _ = _fp8_inputs(g, b, next_n, nb, bs, None)
    cl = _lengths(b, next_n, True, max_blocks * bs, g)
    bt = _table(b, max_blocks, nb, g)
    ins = [t.to(DEV).contiguous().clone() for t in (q, kv, w, cl, bt)]
    before = [_bytes(t).clone() for t in ins]
    buf, out = _guarded(b * next_n, 150, torch.float32)
    tri.fp8_paged_mqa_logits(ins[0], as_3d(ins[1]), *ins[2:], out=out, clean=True, config=config)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    _check_guard(buf)
    for t, b_ in zip(ins, before):
        assert torch.equal(_bytes(t), b_)
    want = _run("reference", q, kv, w, cl, bt, 150, True, torch.float32)
    _compare_known(out, want, _foreign(q, kv, bt, 150))


def test_reference_semantics():
    """The reference backend's reading of hostile values, cell by cell against the same call with the values made
    valid: bad block ids score 0, limits clamp to min(W, capacity), bad indices give empty windows."""
    g = torch.Generator().manual_seed(1)
    b, nb, bs, max_blocks, width = 3, 3, 16, 4, 56  # capacity 64 > W = 56
    q, kv, w, _ = _fp8_inputs(g, b, 1, nb, bs, None)
    good_bt = torch.randint(0, nb, (b, max_blocks), generator=g, dtype=torch.int32)
    bad_bt = good_bt.clone()
    bad_bt[0, 1] = nb
    bad_bt[1, 2] = -7
    bad_bt[2, 0] = BIG
    cl = torch.tensor([BIG, 40, I32_MIN], dtype=torch.int32)

    def call(cl_, bt_, check_values=False, **kw):
        out = torch.full((b, width), OUT_SENTINEL)
        si.fp8_paged_mqa_logits(q, kv, w, cl_, bt_, out=out, backend="reference", check_values=check_values, **kw)
        return out

    got = call(cl, bad_bt)
    ok = call(torch.tensor([width, 40, 0], dtype=torch.int32), good_bt, check_values=True)
    zero = torch.zeros(b, width, dtype=torch.bool)
    zero[0, 16:32] = True  # request 0's block 1
    zero[1, 32:40] = True  # request 1's block 2, inside its window [0, 40)
    assert bool((got[zero] == 0).all())
    assert torch.equal(got[~zero], ok[~zero])
    idx = torch.tensor([2, -1, 3], dtype=torch.int32)
    got_i = call(torch.tensor([30, 30, 30], dtype=torch.int32), good_bt, indices=idx)
    assert bool((got_i[1:] == NINF).all())
    assert torch.equal(got_i[0], call(torch.tensor([30, 30, 30], dtype=torch.int32), good_bt[[2, 2, 2]])[0])
