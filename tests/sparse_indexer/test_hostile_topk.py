"""Hostile values with value checks off (docs/spec.md §10) for the selection ops: ``top_k_per_row`` (plain, split
workspace, candidate blocks), ``select_candidate_blocks``, ``fp8_paged_mqa_topk`` and ``fp8_mqa_topk``.

Windows are clamped (``row_starts >= 0``, ``row_ends <= W``, an end at or below its start is an empty row; decode
limits into ``[0, min(W, max_blocks * block_size)]``), candidate ids outside the window's blocks select nothing,
block ids outside the cache score as zero keys. Every case passes exact-size inputs (so memcheck sees a stray
read), writes its outputs into the middle of a guard buffer (a stray write changes the guard), and checks the
inputs unchanged and the result right for the clamped windows, as the reference's is. On the CPU it runs the
reference and Triton (``TRITON_INTERPRET=1``); on a GPU also the CUDA kernels (the top-k, the candidate kernels
and the fused decode kernel), with GPU-only shapes for their other launch paths (clusters, many rows, the block
scores in the workspace)."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from sparse_indexer import backends as registry
from sparse_indexer.ops.fp8_paged_mqa_logits.reference import row_limits
from sparse_indexer.ops.fp8_paged_mqa_topk import FUSED_WORKSPACE_COLS
from sparse_indexer.ops.top_k_per_row.workspace import workspace_shape
from sparse_indexer.testing import (
    assert_fused_topk,
    assert_topk,
    candidate_errors,
    candidate_topk_errors,
    topk_errors,
)
from tests.cases import gen, paged_case, random_fp8, random_scales, random_weights

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
GPU = DEV.type == "cuda"
FN = torch.float8_e4m3fn
BF16 = torch.bfloat16
I32_MIN, I32_MAX, HUGE = -(2**31), 2**31 - 1, 2**30
gpu_only = pytest.mark.skipif(not GPU, reason="a GPU-only launch path (too slow for the interpreter)")


def _skip(backend: str) -> None:
    if DEV.type == "cpu" and backend in ("gluon", "cuda"):
        pytest.skip(f"{backend} runs on a GPU only")
    why = registry.get(backend).unavailable_reason(DEV)
    if why is not None:
        pytest.skip(f"{backend} is unavailable here: {why}")


def _i32(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int32).to(DEV)


class Guarded:
    """A ``shape`` view in the middle of a larger buffer filled with ``fill``: ``pad`` columns on each side and
    a row above and below (the view's row stride is its width + ``2 pad``)."""

    def __init__(self, shape, dtype, fill, pad: int = 8):
        rows, cols = shape
        self.buf = torch.full((rows + 2, cols + 2 * pad), fill, dtype=dtype, device=DEV)
        self.view = self.buf[1 : rows + 1, pad : pad + cols]
        self.outside = torch.ones(self.buf.shape, dtype=torch.bool, device=DEV)
        self.outside[1 : rows + 1, pad : pad + cols] = False
        self.before = self.buf.clone()

    def check(self, what: str) -> None:
        a, b = self.buf[self.outside], self.before[self.outside]
        same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
        assert bool(same.all()), f"{what}: {int((~same).sum())} guard cells written"


def _unchanged(inputs: dict, before: dict) -> None:
    for name, t in inputs.items():
        assert torch.equal(t.view(torch.uint8) if t.dtype == FN else t, before[name]), f"input {name} changed"


def _snapshot(inputs: dict) -> dict:
    return {k: (t.view(torch.uint8) if t.dtype == FN else t).clone() for k, t in inputs.items()}


def _clamped(starts: torch.Tensor, ends: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The windows the kernels use: starts clamped to >= 0, ends to <= ``w`` (int64)."""
    return starts.long().clamp(min=0), ends.long().clamp(max=w)


def _windows(rows: int, w: int, topk: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Hostile windows first (past W, negative starts, int32 extremes, 2**30, ends below starts, starts past W),
    then random valid ones."""
    hostile = [(-5, w), (3, w + 7), (I32_MIN, I32_MAX), (-HUGE, HUGE), (w // 3, w // 3 - 2), (w + 3, w + 50),
               (HUGE, HUGE + 10), (w - 2, HUGE), (-1, 2), (5, 5 + topk), (0, -7), (-7, topk - 9), (0, w)]
    s, e = [], []
    for i in range(rows):
        if i < len(hostile):
            a, b = hostile[i]
        else:
            a = int(torch.randint(0, w, (1,), generator=g))
            b = int(torch.randint(a, w + 1, (1,), generator=g))
        s.append(a)
        e.append(b)
    return _i32(s), _i32(e)


def _logits(rows: int, w: int, dtype, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, w, generator=g)
    x = torch.where(torch.rand(rows, w, generator=g) < 0.1, torch.round(x), x)  # some ties
    x[:, ::17] = float("-inf")
    return x.to(dtype).to(DEV)


# ---------------------------------------------------------------------------------------- top_k_per_row
# (rows, W, topk, workspace): the one-program-per-row path; the Triton split path (a workspace, few wide rows);
# on a GPU the CUDA top-k's launches: rows in shared memory, sampled rows over clusters of 4 and 8 CTAs, more
# rows than SMs (256 threads in shared memory, 512 sampled).
TOPK_CASES = [
    pytest.param(13, 40, 4, False, id="rows"),
    pytest.param(3, 16384, 64, True, id="split"),
    pytest.param(6, 40000, 64, False, id="cluster4", marks=gpu_only),
    pytest.param(4, 70000, 128, True, id="cluster8", marks=gpu_only),
    pytest.param(300, 3000, 16, False, id="many-small", marks=gpu_only),
    pytest.param(200, 20000, 16, False, id="many-sampled", marks=gpu_only),
]


def _guarded_run(rows: int, w: int, k: int, dtype, salt: int, ws_shape, call):
    """``call(logits, starts, ends, out, workspace)`` on hostile windows of ``[rows, w]`` logits with an ``[rows,
    k]`` output (and a workspace of ``ws_shape``, or none) inside guard buffers: the guards and the inputs are
    checked unchanged; returns ``(logits, starts, ends, out)``."""
    g = gen(salt)
    logits = _logits(rows, w, dtype, g)
    starts, ends = _windows(rows, w, k, g)
    inputs = {"logits": logits, "row_starts": starts, "row_ends": ends}
    before = _snapshot(inputs)
    out = Guarded((rows, k), torch.int32, -7)
    ws = Guarded(ws_shape, torch.int32, 5) if ws_shape is not None else None
    call(logits, starts, ends, out.view, None if ws is None else ws.view)
    out.check("out")
    if ws is not None:
        ws.check("workspace")
    _unchanged(inputs, before)
    return logits, starts, ends, out


@pytest.mark.uses_ops("top_k_per_row")
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows, w, topk, with_ws", TOPK_CASES)
def test_top_k_per_row_hostile_windows(backend, rows, w, topk, with_ws, dtype):
    _skip(backend)
    logits, starts, ends, out = _guarded_run(
        rows, w, topk, dtype, rows + w + topk, workspace_shape(rows, w, topk) if with_ws else None,
        lambda x, s, e, o, ws: si.top_k_per_row(x, s, e, out=o, workspace=ws, backend=backend, check_values=False))
    cs, ce = _clamped(starts, ends, w)
    assert topk_errors(out.view, logits, cs, ce, limit=3) == []
    want = torch.full((rows, topk), -7, dtype=torch.int32, device=DEV)
    si.top_k_per_row(logits, starts, ends, out=want, backend="reference", check_values=False)
    assert topk_errors(want, logits, cs, ce, limit=3) == []  # the reference clamps alike


def _candidates(rows: int, kb: int, nb: int, g: torch.Generator) -> torch.Tensor:
    """Candidate ids per row: hostile ones (-5, int32 extremes, 2**30, the first id past the logits' blocks,
    ids past the window) among valid ones; no id twice in a row (-1 apart)."""
    hostile = [-5, I32_MIN, HUGE, I32_MAX, nb, nb + 3, -1]
    c = torch.full((rows, kb), -1, dtype=torch.int32)
    for r in range(rows):
        ids = torch.randperm(nb, generator=g)[: kb - 2].tolist()
        ids += [hostile[r % len(hostile)], hostile[(r + 3) % len(hostile)]]
        perm = torch.randperm(kb, generator=g).tolist()
        c[r] = torch.tensor([ids[p] for p in perm], dtype=torch.int32)
    return c.to(DEV)


@pytest.mark.uses_ops("top_k_per_row")
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
def test_candidate_top_k_hostile(backend, dtype):
    _skip(backend)
    rows, w, b, kb, topk = 13, 64, 4, 6, 5
    g = gen(3)
    logits = _logits(rows, w, dtype, g)
    starts, ends = _windows(rows, w, topk, g)
    cand = _candidates(rows, kb, -(-w // b), g)
    inputs = {"logits": logits, "row_starts": starts, "row_ends": ends, "candidates": cand}
    before = _snapshot(inputs)
    out = Guarded((rows, topk), torch.int32, -7)
    si.top_k_per_row(logits, starts, ends, out=out.view, candidates=cand, candidate_block_size=b, backend=backend,
                     check_values=False)
    out.check("out")
    _unchanged(inputs, before)
    cs, ce = _clamped(starts, ends, w)
    assert candidate_topk_errors(out.view, logits, cs, ce, cand, b, limit=3) == []
    want = torch.full((rows, topk), -7, dtype=torch.int32, device=DEV)
    si.top_k_per_row(logits, starts, ends, out=want, candidates=cand, candidate_block_size=b, backend="reference",
                     check_values=False)
    assert candidate_topk_errors(want, logits, cs, ce, cand, b, limit=3) == []


# ---------------------------------------------------------------------------------------- select_candidate_blocks
# (rows, W, b, K_b, workspace): block scores in shared memory / in a given workspace; on a GPU a row of more
# blocks than the CUDA kernel's shared memory holds (its scores go to the workspace).
SELECT_CASES = [
    pytest.param(13, 50, 4, 5, False, id="no-workspace"),
    pytest.param(13, 50, 4, 5, True, id="workspace"),
    pytest.param(13, 33, 1, 40, True, id="b1-all-blocks"),
    pytest.param(3, 60000, 1, 16, True, id="scores-in-workspace", marks=gpu_only),
]


@pytest.mark.uses_ops("select_candidate_blocks")
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows, w, b, kb, with_ws", SELECT_CASES)
def test_select_candidate_blocks_hostile(backend, rows, w, b, kb, with_ws, dtype):
    _skip(backend)
    logits, starts, ends, out = _guarded_run(
        rows, w, kb, dtype, rows + w + b, (rows, -(-w // b)) if with_ws else None,
        lambda x, s, e, o, ws: si.select_candidate_blocks(x, s, e, out=o, block_size=b, workspace=ws,
                                                          backend=backend, check_values=False))
    cs, ce = _clamped(starts, ends, w)
    assert candidate_errors(out.view, logits, cs, ce, b, limit=3) == []
    want = torch.full((rows, kb), -7, dtype=torch.int32, device=DEV)
    si.select_candidate_blocks(logits, starts, ends, out=want, block_size=b, backend="reference", check_values=False)
    assert candidate_errors(want, logits, cs, ce, b, limit=3) == []


# ---------------------------------------------------------------------------------------- fp8_paged_mqa_topk
H, D, BS, TOPK = 32, 128, 64, 16  # a shape the fused CUDA kernel takes (H 32/64, D 128, blocks of 64 keys)


def _decode(next_n: int, two_d: bool, g: torch.Generator):
    """Four requests over a table of 3 blocks (192 positions) into a 7-block cache, with hostile block ids (the
    first past the cache, -5, int32 extremes, 2**30) and hostile lengths (past the table, 2**30, int32 extremes,
    negative)."""
    case = paged_case(g, [192, 128, 64], BS, D, FN, pow2_scales=False, spare_blocks=1, spare_cols=0)
    nb = case.kv.shape[0]
    bt = torch.cat([case.block_table, torch.zeros(1, 3, dtype=torch.int32)])
    bt[0, 1] = nb  # the first id past the cache
    bt[1, 0] = -5
    bt[1, 2] = I32_MIN
    bt[2, 1] = HUGE
    bt[3] = torch.tensor([I32_MAX, 1, -1], dtype=torch.int32)
    b = bt.shape[0]
    if two_d:
        cl = torch.tensor([[150, HUGE, 0, 2], [I32_MAX, -3, 130, 17], [100, 250, 64, 1], [I32_MIN, 170, 5, 190]],
                          dtype=torch.int32)[:, :next_n].contiguous()
    else:
        cl = torch.tensor([250, I32_MIN, HUGE, 140][:b], dtype=torch.int32)
    q = random_fp8((b, next_n, H, D), FN, g, amp=4.0)
    w = random_weights(b * next_n, H, g)
    return [t.to(DEV) for t in (q, case.kv, w, cl, bt)]


def _foreign_cells(bt: torch.Tensor, nb: int, next_n: int, width: int) -> torch.Tensor:
    """``[rows, width]``: the cells of decode rows whose key's block id is outside ``[0, nb)``."""
    cols = torch.arange(width, device=bt.device)
    inside = cols // BS < bt.shape[1]
    ids = torch.full((bt.shape[0], width), -1, dtype=torch.int64, device=bt.device)
    ids[:, inside] = bt.long()[:, (cols // BS)[inside]]
    return ((ids < 0) | (ids >= nb)).repeat_interleave(next_n, dim=0)


def _with_foreign(want: torch.Tensor, own: torch.Tensor, foreign: torch.Tensor) -> torch.Tensor:
    """``want`` with the ``foreign`` cells taken from the kernel's ``own`` scores, which must be finite there."""
    assert bool(torch.isfinite(own.float()[foreign]).all()), "a cell of a block outside the cache is not finite"
    return torch.where(foreign, own, want)


@pytest.mark.uses_ops("fp8_paged_mqa_topk")
@pytest.mark.parametrize("width", ["wide", "narrow", "none"])
@pytest.mark.parametrize("next_n, two_d, dtype", [(1, False, torch.float32), (2, False, BF16), (2, True, torch.float32),
                                                  (1, True, BF16)], ids=["n1-1d", "n2-1d-bf16", "n2-2d", "n1-2d-bf16"])
def test_paged_topk_hostile(backend, next_n, two_d, dtype, width):
    """``logits`` wider than the table's 192 positions (the limits clamp to the table), narrower (they clamp to
    W), or absent (the backend's scratch; the fused kernel's workspace)."""
    _skip(backend)
    q, kv, w, cl, bt = _decode(next_n, two_d, gen(next_n + 2 * two_d))
    rows, cap = q.shape[0] * next_n, bt.shape[1] * BS
    lw = {"wide": cap + 64, "narrow": cap - 64, "none": cap}[width]
    inputs = {"q": q, "kv_cache": kv, "weights": w, "context_lens": cl, "block_table": bt}
    before = _snapshot(inputs)
    want = torch.full((rows, TOPK), -7, dtype=torch.int32, device=DEV)
    want_logits = torch.zeros(rows, lw, dtype=dtype, device=DEV)
    si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=want, logits=want_logits, backend="reference", check_values=False)
    ends = row_limits(cl, next_n).clamp(max=min(lw, cap))
    starts = torch.zeros_like(ends)
    assert topk_errors(want, want_logits, starts, ends, limit=3) == []
    out = Guarded((rows, TOPK), torch.int32, -7)
    ws = Guarded((rows, FUSED_WORKSPACE_COLS), torch.int32, 3)
    # the Triton composition's scales-ahead paged kernel clamps a foreign block id into the cache (docs/spec.md
    # §10): its cells of such blocks score cached keys, judged by the kernel's own scores (finite) instead
    foreign = None
    if backend == "triton":  # (in-window cells only: the others are the windows' business)
        inside = torch.arange(lw, device=DEV)[None, :] < ends.to(DEV)[:, None]
        foreign = _foreign_cells(bt, kv.shape[0], next_n, lw) & inside
    if width == "none":
        si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out.view, workspace=ws.view, logits_dtype=dtype, backend=backend,
                              check_values=False)
        rtol = (1e-3 if dtype == torch.float32 else 8e-3) if GPU else 1e-5
        if foreign is not None:
            own = torch.zeros(rows, lw, dtype=dtype, device=DEV)
            si.fp8_paged_mqa_logits(q, kv, w, cl, bt, out=own, backend=backend, check_values=False)
            want_logits = _with_foreign(want_logits, own, foreign)
        assert_topk(out.view, want_logits, starts, ends, rtol=rtol, threshold=True)
    else:
        lg = Guarded((rows, lw), dtype, 5.0)
        si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out.view, logits=lg.view, workspace=ws.view, backend=backend,
                              check_values=False)
        lg.check("logits")
        if foreign is not None:
            want_logits = _with_foreign(want_logits, lg.view, foreign)
        assert_fused_topk(out.view, lg.view, starts, ends, expected=want_logits)
    out.check("out")
    ws.check("workspace")
    _unchanged(inputs, before)


def test_paged_topk_reference_scores_foreign_blocks_zero():
    """The reference composition's cells read through a block id outside the cache are 0 (a zero key) and the
    limits clamp to the table (docs/spec.md §10), so the kernels above are compared with these semantics."""
    q, kv, w, cl, bt = _decode(1, False, gen(1))
    rows, cap = q.shape[0], bt.shape[1] * BS
    lg = torch.full((rows, cap), 5.0, device=DEV)
    out = torch.empty(rows, TOPK, dtype=torch.int32, device=DEV)
    si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out, logits=lg, backend="reference", check_values=False)
    assert bool((lg[0, BS : 2 * BS] == 0).all())  # request 0, block 1: the first id past the cache
    assert bool((lg[2, BS : 2 * BS] == 0).all())  # request 2, block 1: 2**30 (limit 2**30 clamped to 192)
    assert bool((lg[0, 2 * BS :] != 0).any())  # request 0, block 2: a valid block, scored


# ---------------------------------------------------------------------------------------- fp8_mqa_topk
@pytest.mark.uses_ops("fp8_mqa_topk")
@pytest.mark.parametrize("scratch_rows", [None, 4, 13])
def test_ragged_topk_hostile(backend, scratch_rows):
    """Windows past N, negative starts, int32 extremes, ends below starts, scored and selected ``R`` rows at a
    time (the scratch) or all at once."""
    _skip(backend)
    g = gen(7)
    m, n, h, d = 13, 40, 8, 64
    ks, ke = _windows(m, n, TOPK, g)
    q = random_fp8((m, h, d), FN, g, amp=4.0).to(DEV)
    k = random_fp8((n, d), FN, g).to(DEV)
    k_scale, w = random_scales(n, g).to(DEV), random_weights(m, h, g).to(DEV)
    inputs = {"q": q, "k_fp8": k, "k_scale": k_scale, "weights": w, "cu_seqlen_ks": ks, "cu_seqlen_ke": ke}
    before = _snapshot(inputs)
    args = (q, k, k_scale, w, ks, ke)
    want = torch.full((m, TOPK), -7, dtype=torch.int32, device=DEV)
    want_logits = torch.zeros(m, n, device=DEV)
    si.fp8_mqa_topk(*args, out=want, logits=want_logits, backend="reference", check_values=False)
    cs, ce = _clamped(ks, ke, n)
    assert topk_errors(want, want_logits, cs, ce, limit=3) == []
    out = Guarded((m, TOPK), torch.int32, -7)
    if scratch_rows is None:
        si.fp8_mqa_topk(*args, out=out.view, backend=backend, check_values=False)
        assert_topk(out.view, want_logits, cs, ce, rtol=1e-3 if GPU else 1e-5, threshold=True)
    else:
        lg = Guarded((scratch_rows, n), torch.float32, 5.0)
        si.fp8_mqa_topk(*args, out=out.view, logits=lg.view, backend=backend, check_values=False)
        lg.check("logits")
        if scratch_rows == m:
            assert_fused_topk(out.view, lg.view, cs, ce, expected=want_logits)
        else:
            assert_topk(out.view, want_logits, cs, ce, rtol=1e-3 if GPU else 1e-5, threshold=True)
    out.check("out")
    _unchanged(inputs, before)
