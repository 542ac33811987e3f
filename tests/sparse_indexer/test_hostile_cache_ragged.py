"""Hostile values with value checks off (docs/spec.md §10): write_k_cache, gather_k_cache and the ragged
fp8_mqa_logits (FP8 and MXFP4) on slots, block ids, lengths and windows that the checks would refuse.

Each case gives the op exact-size input tensors (so compute-sanitizer's memcheck sees an out-of-bounds read) and
outputs that are a slice in the middle of a guard buffer filled with a sentinel (so a stray write shows), calls it
with ``check_values=False`` and checks that the guard bytes and the inputs are unchanged and that the result is
the reference backend's on the same inputs (exact on the CPU; the GPU tests' logits tolerance on a GPU).
Runs on the CPU (reference; Triton under ``TRITON_INTERPRET=1``) and on a CUDA GPU (triton, gluon, cuda)."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from buffers import CacheFormat
from sparse_indexer import backends as registry
from sparse_indexer.testing import LOGITS_RTOL_L2

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
GUARD = 64  # guard bytes before and after every output (a multiple of 16: the output keeps its alignment)
SENTINEL = 0x5A
OUT_SENTINEL = 1536.0  # logits cells outside the windows with clean=False keep it (exact in bfloat16)
NINF = float("-inf")
MX = CacheFormat(values="mxfp4")
MX_TILED = CacheFormat(values="mxfp4", order="tiled:4,16,2")  # runs of 4 keys, 16-byte chunks, 2 scale lanes
UE8M0X4 = CacheFormat(scale="ue8m0x4")
BIG = 2**30
I32_MIN = -(2**31)


def _usable(backend: str) -> None:
    if backend in ("gluon", "cuda") and DEV.type != "cuda":
        pytest.skip(f"{backend} runs on a CUDA GPU only")
    why = registry.get(backend).unavailable_reason(DEV)
    if why is not None:
        pytest.skip(f"{backend} is unavailable here: {why}")


def _guarded(shape, dtype=torch.uint8, fill=SENTINEL):
    """``(buffer, view)``: a uint8 buffer of sentinel bytes with ``view`` (``shape``, ``dtype``, contiguous) in its
    middle, ``GUARD`` bytes on either side; the view's own bytes are set to ``fill`` (a byte, or a value of
    ``dtype``)."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    buf = torch.full((GUARD + nbytes + GUARD,), SENTINEL, dtype=torch.uint8, device=DEV)
    view = buf[GUARD:GUARD + nbytes].view(dtype).view(shape)
    if dtype.itemsize == 1:  # (uint8 and FP8: a byte)
        view.view(torch.uint8).fill_(fill)
    else:
        view.fill_(fill)
    return buf, view


def _check_guard(buf: torch.Tensor, what: str) -> None:
    assert bool((buf[:GUARD] == SENTINEL).all()), f"{what}: bytes before the output were written"
    assert bool((buf[-GUARD:] == SENTINEL).all()), f"{what}: bytes after the output were written"


def _snap(*ts):
    return [t.detach().clone() for t in ts]


def _unchanged(ts, before) -> None:
    for i, (t, b) in enumerate(zip(ts, before)):
        assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t, b.view(torch.uint8)
                           if b.element_size() == 1 else b), f"input #{i} was written"


# ------------------------------------------------------------------------------------------------ write_k_cache
WRITE_SLOTS = [
    [0, -1, -5, 12, BIG, 5, I32_MIN, 11],  # (12 = num_blocks * block_size: the first slot past the cache)
    [-2, 13, 2**31 - 1, 3, -(2**20), 12, 0, 7],
]


@pytest.mark.uses_ops("write_k_cache")
@pytest.mark.parametrize("fmt", [None, MX, MX_TILED], ids=["fp8", "mxfp4", "mxfp4-tiled"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", range(len(WRITE_SLOTS)))
def test_write_k_cache_hostile_slots(backend, fmt, slot_dtype, case):
    _usable(backend)
    nb, bs, d = 3, 4, 64
    width = d + 4 if fmt is None else d // 2 + d // 32
    slots = WRITE_SLOTS[case]
    if slot_dtype == torch.int64:
        slots = [s if s != I32_MIN else -(2**40) for s in slots] + [2**40]
    g = torch.Generator().manual_seed(case)
    k = torch.randn(len(slots) + 1, d, generator=g).to(DEV)
    sm = torch.tensor(slots, dtype=slot_dtype, device=DEV)
    before = _snap(k, sm)
    kw = {} if fmt is None else {"cache_format": fmt}
    results = []
    for b in (backend, "reference"):
        buf, kv = _guarded((nb, bs, width))
        si.write_k_cache(k, kv, sm, backend=b, check_values=False, **kw)
        _check_guard(buf, f"write_k_cache[{b}]")
        results.append(buf)
    _unchanged((k, sm), before)
    assert torch.equal(results[0], results[1]), "the cache differs from the reference's"
    assert bool((results[1] != SENTINEL).any()), "the in-range slots were not written"


# ------------------------------------------------------------------------------------------------ gather_k_cache
NB, BS, MAXB = 3, 4, 2  # cache blocks, block size, block table width (8 keys per request at most)
GATHER_TABLE = [[0, 7], [-3, BIG], [1, 3]]  # (7, 2**30, 3: past the 3 blocks; -3: negative)
GATHER_CU = [
    [0, 5, 20, 23],  # request 1 longer than its table row (15 > 8 keys); request 2's last row past out_k's 22
    [0, 6, 3, 3],  # decreasing: requests 1 and 2 empty
    [0, BIG, BIG + 2, BIG + 4],  # huge: request 0 clamped to its 8 keys, the others' rows past out_k
    [-3, 4, 4, 10],  # a negative start: request 0's first 3 keys land before row 0
    [I32_MIN, 2**31 - 1, 0, 1],  # extremes: request 0 clamped to 8 keys, all before row 0; request 2 row 0
]
GATHER_ROWS = 22


def _mx_cache(fmt, g):
    d = 64
    kv = si.new_kv_cache(NB, BS, d, mxfp4=True).to(DEV)
    si.write_k_cache(torch.randn(NB * BS, d, generator=g).to(DEV), kv, torch.arange(NB * BS, device=DEV),
                     cache_format=fmt, backend="reference")
    return kv, d


@pytest.mark.uses_ops("gather_k_cache")
@pytest.mark.parametrize("fmt", [None, UE8M0X4, MX, MX_TILED], ids=["fp8", "ue8m0x4", "mxfp4", "mxfp4-tiled"])
@pytest.mark.parametrize("case", range(len(GATHER_CU)))
def test_gather_k_cache_hostile(backend, fmt, case):
    _usable(backend)
    g = torch.Generator().manual_seed(10 + case)
    if fmt is not None and fmt.values == "mxfp4":
        kv, d = _mx_cache(fmt, g)
        shapes = ((GATHER_ROWS, d // 2), torch.uint8), ((GATHER_ROWS, d // 32), torch.uint8)
    else:
        d = 64
        kv = si.new_kv_cache(NB, BS, d).to(DEV)
        # (powers of two: the ue8m0x4 encoding holds them exactly)
        si.write_k_cache(torch.randn(NB * BS, d, generator=g).to(DEV), kv, torch.arange(NB * BS, device=DEV),
                         cache_format=fmt, backend="reference")
        shapes = ((GATHER_ROWS, d), torch.float8_e4m3fn), ((GATHER_ROWS,), torch.float32)
    table = torch.tensor(GATHER_TABLE, dtype=torch.int32, device=DEV)
    cu = torch.tensor(GATHER_CU[case], dtype=torch.int32, device=DEV)
    before = _snap(kv, table, cu)
    kw = {} if fmt is None else {"cache_format": fmt}
    results = []
    for b in (backend, "reference"):
        kbuf, out_k = _guarded(*shapes[0])
        sbuf, out_s = _guarded(*shapes[1])
        si.gather_k_cache(kv, table, cu, out_k=out_k, out_scale=out_s, backend=b, check_values=False, **kw)
        _check_guard(kbuf, f"gather_k_cache[{b}] out_k")
        _check_guard(sbuf, f"gather_k_cache[{b}] out_scale")
        results.append((kbuf, sbuf))
    _unchanged((kv, table, cu), before)
    assert torch.equal(results[0][0], results[1][0]), "out_k differs from the reference's"
    assert torch.equal(results[0][1], results[1][1]), "out_scale differs from the reference's"


def test_gather_k_cache_reference_semantics():
    """The reference's rules, by hand: clamped lengths, zero keys for ids outside the cache, rows outside out_k
    and positions past the table row not written."""
    kv = si.new_kv_cache(2, 2, 64)
    si.write_k_cache(torch.randn(4, 64), kv, torch.arange(4), backend="reference")
    values, scales = si.cache_views(kv, torch.float8_e4m3fn)
    table = torch.tensor([[1, 5], [-1, 0]], dtype=torch.int32)
    cu = torch.tensor([0, 9, 6], dtype=torch.int32)  # request 0: 9 keys, 4 fit its row; request 1: decreasing
    out_k = torch.full((6, 64), 7, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out_s = torch.full((6,), -1.0)
    si.gather_k_cache(kv, table, cu, out_k=out_k, out_scale=out_s, backend="reference", check_values=False)
    assert out_s[:2].tolist() == scales[1].tolist()  # block 1
    assert torch.equal(out_k[:2].view(torch.uint8), values[1].view(torch.uint8))
    assert out_s[2:4].tolist() == [0.0, 0.0]  # block 5: a zero key
    assert bool((out_k[2:4].view(torch.uint8) == 0).all())
    assert out_s[4:].tolist() == [-1.0, -1.0]  # positions 4.. of request 0: past its table row, not written
    assert bool((out_k[4:].view(torch.uint8) == 7).all())


# ------------------------------------------------------------------------------------------------ fp8_mqa_logits
def _windows(n: int):
    """``(ks, ke)`` of 8 rows: negative starts, ends past N, ends below starts, huge and extreme values."""
    ks = [-5, 0, 3, BIG, 50, I32_MIN, 10, 0]
    ke = [10, n + 7, 2, BIG + 5, BIG, 5, I32_MIN, n]
    return ks, ke


def _ragged_inputs(mxfp4: bool, g):
    m = 8
    if mxfp4:
        h, d, n = 16, 64, 70
        q = si.quantize_q_mxfp4(torch.randn(m, h, d, generator=g))
        k = si.quantize_k_mxfp4(torch.randn(n, d, generator=g))
        ops = (q[0], k[0], k[1])
        extra = {"q_scale": q[1].to(DEV)}
    else:
        h, d, n = 64, 128, 90  # (the Gluon kernel's H and D)
        q = (torch.randn(m, h, d, generator=g) * 4).to(torch.float8_e4m3fn)
        k = (torch.randn(n, d, generator=g) * 4).to(torch.float8_e4m3fn)
        ops = (q, k, torch.rand(n, generator=g) + 0.5)
        extra = {}
    w = torch.randn(m, h, generator=g) * 0.25
    return [t.to(DEV) for t in ops] + [w.to(DEV)], extra, m, n


def _compare_logits(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``-inf`` and untouched cells exactly; scores within the op tests' tolerance: relative L2 ``LOGITS_RTOL_L2``
    on the CPU (float32; the Triton interpreter's dot sums in another order than torch), the GPU tests' ``2e-3``
    for a handful of cells (tests/gpu/test_prefill_gluon_gpu.py), and one bfloat16 rounding for bfloat16."""
    exact = (want == NINF) | (want == OUT_SENTINEL) | (got == NINF) | (got == OUT_SENTINEL)
    assert torch.equal(torch.where(exact, got, 0), torch.where(exact, want, 0)), "-inf / untouched cells differ"
    a, e = torch.where(exact, 0, got).double(), torch.where(exact, 0, want).double()
    err = float((a - e).norm()) / max(float(e.norm()), 1e-300)
    if dtype == torch.bfloat16:
        tol = 2.0**-8 if DEV.type == "cpu" else 4e-3
    else:
        tol = LOGITS_RTOL_L2 if DEV.type == "cpu" else 2e-3
    assert err <= tol, f"the logits differ from the reference's: relative L2 {err:.2e} > {tol:.0e}"


@pytest.mark.uses_ops("fp8_mqa_logits")
@pytest.mark.parametrize("mxfp4", [False, True], ids=["fp8", "mxfp4"])
@pytest.mark.parametrize("width", [None, 16], ids=["full", "compressed"])
@pytest.mark.parametrize("clean", [True, False], ids=["clean", "dirty"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fp8_mqa_logits_hostile_windows(backend, mxfp4, width, clean, dtype):
    _usable(backend)
    if mxfp4 and backend not in ("reference", "triton"):
        pytest.skip(f"{backend} has no MXFP4 scores")
    g = torch.Generator().manual_seed(20)
    (q, k, ksc, w), extra, m, n = _ragged_inputs(mxfp4, g)
    ks_l, ke_l = _windows(n)
    ks = torch.tensor(ks_l, dtype=torch.int32, device=DEV)
    ke = torch.tensor(ke_l, dtype=torch.int32, device=DEV)
    ins = (q, k, ksc, w, ks, ke, *extra.values())
    before = _snap(*ins)
    cols = n if width is None else width
    results = []
    for b in (backend, "reference"):
        buf, out = _guarded((m, cols), dtype, OUT_SENTINEL)
        si.fp8_mqa_logits(q, k, ksc, w, ks, ke, out=out, clean=clean, backend=b, check_values=False,
                          max_seqlen_k=width, **extra)
        _check_guard(buf, f"fp8_mqa_logits[{b}]")
        results.append((buf, out))
    _unchanged(ins, before)
    _compare_logits(results[0][1].float(), results[1][1].float(), dtype)
    want = results[1][1].float()
    # the reference's rules: windows clamped into [0, N]; rows 2, 3 (ks 2**30 -> N) and 6 (ke -2**31 -> 0) empty
    inside = [[c >= max(a, 0) and c < min(e, n) for c in range(n)] for a, e in zip(ks_l, ke_l)]
    for r in range(m):
        keys = [c for c in range(n) if inside[r][c]]
        row = want[r, keys] if width is None else want[r, : min(len(keys), width)]
        assert bool(torch.isfinite(row).all()), f"row {r}: a cell inside the clamped window was not scored"
        rest = (~torch.tensor(inside[r], device=DEV)).nonzero().flatten() if width is None else \
            torch.arange(min(len(keys), width), width, device=DEV)
        assert bool((want[r, rest] == (NINF if clean else OUT_SENTINEL)).all()), f"row {r}: cells outside"
