"""GPU checks of the fused ops (docs/spec.md §6b) against the reference, through the public functions with
``backend=None`` (the fused CUDA kernel where it takes the call, else the two ops' own ``auto``) and
``backend="triton"`` (the Triton compositions):

- every top-k value distribution of ``tests/gpu/test_topk_cuda_gpu.py`` fed through the scores
  (:func:`sparse_indexer.testing.paged_inputs_for_scores`, ``ragged_inputs_for_scores``: the scores are the
  values exactly), so the selection is judged exactly, for float32 and bfloat16 scores, with and without
  ``logits`` (the fused kernel's test mode) and ``workspace``;
- random FP8 decode at DeepSeek-V3.2's shapes (H 64, D 128, block 64, topk 2048) and V4's (topk 512), ``next_n`` 1
  to 4, 1-D and 2-D lengths: the selection exact on the returned scores, the scores within
  :data:`~sparse_indexer.testing.FUSED_LOGITS_RTOL_L2` (bfloat16: ``FUSED_LOGITS_RTOL_L2_BF16``) of the
  reference composition's;
- the prefill op in row blocks, and a CUDA-graph replay of the decode op with new lengths.

Run: ``PYTHONPATH=. python3 -m pytest tests/gpu/test_fused_topk_gpu.py``."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from sparse_indexer._runtime import dispatch as _dispatch
from sparse_indexer.ops.fp8_paged_mqa_topk import FUSED_WORKSPACE_COLS
from sparse_indexer.testing import (
    TOPK_DISTRIBUTIONS,
    assert_fused_topk,
    assert_topk,
    capture_cuda_graph,
    paged_inputs_for_scores,
    paged_windows,
    ragged_inputs_for_scores,
    topk_values,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"
FN = torch.float8_e4m3fn
BF16 = torch.bfloat16
BACKENDS = [None, "triton"]
BACKEND_IDS = ["auto", "triton"]
DECODE_BACKENDS = [None, "triton", "cuda"]  # "cuda": the fused kernel (auto composes: it is slower today)
DECODE_BACKEND_IDS = ["auto", "triton", "cuda"]
DTYPES = [torch.float32, BF16]
DTYPE_IDS = ["f32", "bf16"]


def _lens(rows: int, width: int, topk: int, g: torch.Generator) -> torch.Tensor:
    """Window lengths in ``[width // 2, width]``, with the full width, exactly ``topk``, ``topk - 1`` and 0 among
    the first rows."""
    lens = torch.randint(width // 2, width + 1, (rows,), device=DEV, generator=g, dtype=torch.int32)
    for i, n in enumerate([width, topk, topk - 1, 0][:rows]):
        lens[i] = n
    return lens


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,width,topk", [(64, 16384, 2048), (7, 70001, 512), (200, 4096, 512)])
@pytest.mark.parametrize("dist", TOPK_DISTRIBUTIONS)
@pytest.mark.parametrize("backend", DECODE_BACKENDS, ids=DECODE_BACKEND_IDS)
def test_decode_distributions(backend, dist, rows, width, topk, dtype):
    _skip_without_cuda_backend(backend)
    g = torch.Generator(device=DEV).manual_seed(rows + width + topk)
    values = topk_values(dist, rows, width, device=DEV, generator=g)
    lens = _lens(rows, width, topk, g)
    q, kv, w, cl, bt = paged_inputs_for_scores(values, lens, generator=g)
    starts, ends = paged_windows(cl, 1)
    cap = bt.shape[1] * 64
    out = torch.full((rows, topk), -7, dtype=torch.int32, device=DEV)
    logits = torch.full((rows, cap), 3.0, dtype=dtype, device=DEV)
    ws = torch.full((rows, FUSED_WORKSPACE_COLS), 5, dtype=torch.int32, device=DEV)
    si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out, logits=logits, workspace=ws, backend=backend)
    assert_fused_topk(out, logits[:, :width], starts, ends, expected=values.to(dtype))
    out = torch.full_like(out, -7)
    si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out, logits_dtype=dtype, backend=backend)
    assert_topk(out, values.to(dtype), starts, ends)


def _selection_rtol(dtype: torch.dtype) -> float:
    """How far below the reference's ``topk``-th largest score a selected one may lie, in ``max|score|``: the
    tensor cores' float32 sums (``1e-3``), or for bfloat16 scores one bfloat16 step (``2**-7`` of a value at most
    ``max|score|``: each side rounds its own float32 score)."""
    return 1e-3 if dtype == torch.float32 else 8e-3


def _random_decode(b: int, next_n: int, h: int, lens, two_d: bool, g: torch.Generator):
    """Random FP8 decode inputs (D 128, block 64): ``lens`` the requests' contexts; 2-D lengths give each token
    ``lens[b] - next_n + j + 1`` except a padded last slot (0) in every other request."""
    d, bs = 128, 64
    per = -(-max(lens) // bs) + 1
    nb = b * per
    kv = si.new_kv_cache(nb, bs, d, device=DEV)
    si.write_k_cache(torch.randn(nb * bs, d, device=DEV, generator=g), kv, torch.arange(nb * bs, device=DEV))
    bt = torch.randperm(nb, device=DEV, generator=g).view(b, per).int()
    q = (torch.randn(b, next_n, h, d, device=DEV, generator=g) * 2).to(FN)
    w = torch.randn(b * next_n, h, device=DEV, generator=g) / (h * d) ** 0.5
    cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    if two_d:
        j = torch.arange(next_n, device=DEV)
        cl = (cl[:, None] - next_n + j[None, :] + 1).clamp(min=0).int()
        cl[::2, -1] = 0
    return q, kv, w, cl, bt


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("h,topk", [(64, 2048), (32, 512)])
@pytest.mark.parametrize("backend", DECODE_BACKENDS, ids=DECODE_BACKEND_IDS)
def test_decode_matches_reference(backend, h, topk, next_n, two_d, dtype):
    _skip_without_cuda_backend(backend)
    g = torch.Generator(device=DEV).manual_seed(next_n * 10 + topk + h)
    b = 16
    lens = torch.randint(topk + 1, 9000, (b,), generator=torch.Generator().manual_seed(next_n)).tolist()
    lens[:4] = [topk + next_n - 1, topk - 1, 0, 3]
    q, kv, w, cl, bt = _random_decode(b, next_n, h, lens, two_d, g)
    rows, cap = b * next_n, bt.shape[1] * 64
    starts, ends = paged_windows(cl, next_n)
    want = torch.full((rows, topk), -7, dtype=torch.int32, device=DEV)
    want_logits = torch.zeros(rows, cap, dtype=dtype, device=DEV)
    si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=want, logits=want_logits, backend="reference")
    out = torch.full_like(want, -7)
    logits = torch.full((rows, cap), 3.0, dtype=dtype, device=DEV)
    ws = torch.full((rows, FUSED_WORKSPACE_COLS), 5, dtype=torch.int32, device=DEV)
    si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out, logits=logits, workspace=ws, backend=backend)
    assert_fused_topk(out, logits, starts, ends, expected=want_logits)
    out = torch.full_like(want, -7)
    si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out, logits_dtype=dtype, backend=backend)
    assert_topk(out, want_logits.float(), starts, ends, rtol=_selection_rtol(dtype), threshold=True)


def _skip_without_cuda_backend(backend):
    if backend == "cuda" and "cuda" not in si.available(torch.device(DEV)):
        pytest.skip("the CUDA backend is not available here")


def test_auto_routes_on_cuda():
    """``auto`` on an NVIDIA GPU: the fused CUDA kernel (where the backend is available; its ``auto_when`` passes
    every call on today), then the composition; the prefill op composes."""
    dev = torch.device(DEV)
    names = [r.name for r in _dispatch.routes("fp8_paged_mqa_topk", None, dev)]
    fused = "cuda" in si.available(dev) and _dispatch.fused("fp8_paged_mqa_topk", "cuda")
    assert names == (["cuda"] if fused else []) + [_dispatch.COMPOSED], names
    assert [r.name for r in _dispatch.routes("fp8_mqa_topk", None, dev)] == [_dispatch.COMPOSED]


def _ragged_windows(m: int, n: int, topk: int, g: torch.Generator):
    ks = torch.randint(0, n // 3, (m,), device=DEV, generator=g, dtype=torch.int32)
    ke = torch.randint(n // 3, n + 1, (m,), device=DEV, generator=g, dtype=torch.int32)
    ks[:4] = torch.tensor([0, 10, 0, 500], dtype=torch.int32)
    ke[:4] = torch.tensor([n, 10 + topk, topk - 1, 500], dtype=torch.int32)  # full, exactly topk, shorter, empty
    return ks, ke


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("topk", [512, 2048])
@pytest.mark.parametrize("dist", TOPK_DISTRIBUTIONS)
@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_prefill_distributions_in_row_blocks(backend, dist, topk, dtype):
    g = torch.Generator(device=DEV).manual_seed(topk)
    m, n = 48, 20000
    values = topk_values(dist, 1, n, device=DEV, generator=g)[0]
    q, k, k_scale, w = ragged_inputs_for_scores(values, m)
    ks, ke = _ragged_windows(m, n, topk, g)
    expected = values.to(dtype)[None, :].expand(m, n)
    out = torch.full((m, topk), -7, dtype=torch.int32, device=DEV)
    logits = torch.full((m, n), 3.0, dtype=dtype, device=DEV)
    si.fp8_mqa_topk(q, k, k_scale, w, ks, ke, out=out, logits=logits, backend=backend)
    assert_fused_topk(out, logits, ks, ke, expected=expected)
    out = torch.full_like(out, -7)
    si.fp8_mqa_topk(q, k, k_scale, w, ks, ke, out=out, logits=torch.empty(16, n, dtype=dtype, device=DEV),
                    backend=backend)
    assert_topk(out, expected, ks, ke)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("backend", BACKENDS, ids=BACKEND_IDS)
def test_prefill_matches_reference(backend, dtype):
    g = torch.Generator(device=DEV).manual_seed(7)
    m, n, h, d, topk = 100, 9000, 64, 128, 2048
    q = (torch.randn(m, h, d, device=DEV, generator=g) * 2).to(FN)
    k, k_scale = si.quantize_k(torch.randn(n, d, device=DEV, generator=g))
    w = torch.randn(m, h, device=DEV, generator=g) / (h * d) ** 0.5
    ks, ke = _ragged_windows(m, n, topk, g)
    want = torch.full((m, topk), -7, dtype=torch.int32, device=DEV)
    want_logits = torch.zeros(m, n, dtype=dtype, device=DEV)
    si.fp8_mqa_topk(q, k, k_scale, w, ks, ke, out=want, logits=want_logits, backend="reference")
    out = torch.full_like(want, -7)
    logits = torch.full((m, n), 3.0, dtype=dtype, device=DEV)
    si.fp8_mqa_topk(q, k, k_scale, w, ks, ke, out=out, logits=logits, backend=backend)
    assert_fused_topk(out, logits, ks, ke, expected=want_logits)
    out = torch.full_like(want, -7)
    si.fp8_mqa_topk(q, k, k_scale, w, ks, ke, out=out, logits=torch.empty(32, n, dtype=dtype, device=DEV),
                    backend=backend)
    assert_topk(out, want_logits.float(), ks, ke, rtol=_selection_rtol(dtype), threshold=True)


@pytest.mark.parametrize("backend", DECODE_BACKENDS, ids=DECODE_BACKEND_IDS)
def test_decode_in_a_cuda_graph(backend):
    """Captured once (after an eager call), replayed with new lengths written into the captured tensor."""
    _skip_without_cuda_backend(backend)
    g = torch.Generator(device=DEV).manual_seed(3)
    b, next_n, topk = 32, 2, 2048
    lens = [8000] * b
    q, kv, w, cl, bt = _random_decode(b, next_n, 64, lens, False, g)
    rows, cap = b * next_n, bt.shape[1] * 64
    out = torch.full((rows, topk), -7, dtype=torch.int32, device=DEV)
    logits = torch.zeros(rows, cap, device=DEV)
    ws = torch.zeros(rows, FUSED_WORKSPACE_COLS, dtype=torch.int32, device=DEV)

    def step():
        si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=out, logits=logits, workspace=ws, backend=backend)

    step()
    graph = capture_cuda_graph(step)
    for new in ([8000] * b, torch.randint(1, 8001, (b,), generator=torch.Generator().manual_seed(5)).tolist()):
        cl.copy_(torch.tensor(new, dtype=torch.int32))
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        want = torch.full_like(out, -7)
        want_logits = torch.zeros_like(logits)
        si.fp8_paged_mqa_topk(q, kv, w, cl, bt, out=want, logits=want_logits, backend="reference")
        assert_fused_topk(out, logits, *paged_windows(cl, next_n), expected=want_logits)


@pytest.mark.parametrize("next_n", [1, 2])
def test_step_through_the_fused_kernel(monkeypatch, next_n):
    """``sparse_attn_indexer`` under ``auto`` with the fused kernel's ``auto_when`` forced true and the CUDA entry
    declaring the fused workspace (so the plan's ``topk_scratch`` holds it; the built-in entry declares none while
    ``auto`` composes): every decode sub-batch runs ``fp8_paged_mqa_topk`` on the CUDA backend (counted) and the
    top-k is right on the reference logits, eagerly and replayed in a CUDA graph."""
    from dataclasses import replace

    from buffers import IndexerLimits, allocate
    from sparse_indexer import backends
    from sparse_indexer.ops.fp8_paged_mqa_topk import cuda as fused
    from tests.gpu.test_engine_gpu import World

    _skip_without_cuda_backend("cuda")
    lim = IndexerLimits(max_model_len=16384, max_num_batched_tokens=64, max_num_seqs=8, next_n=next_n, n_heads=64,
                        head_dim=128, topk=512, block_size=64)
    calls = []
    real = fused.fp8_paged_mqa_topk

    def counted(q, kv_cache, weights, context_lens, block_table, *, out, logits=None, workspace=None,
                logits_dtype=None):
        calls.append(workspace is not None and logits is None)
        real(q, kv_cache, weights, context_lens, block_table, out=out, logits=logits, workspace=workspace,
             logits_dtype=logits_dtype)

    counted.auto_when = lambda *a, out, logits=None, workspace=None, **_: fused.takes(*a, out, logits,
                                                                                     workspace) is None
    monkeypatch.setattr(fused, "fp8_paged_mqa_topk", counted)
    entry = backends.get("cuda")
    backends.register(replace(entry, topk_workspace=lambda limits: FUSED_WORKSPACE_COLS), replace=True)
    try:
        world = World(lim, 8, seed=next_n)
        seq = [16384, 9000, 513, 512, 12000, 70, 16000, 4000]
        q, _, w, md = world.inputs(seq, [next_n] * 8)
        bufs = allocate(lim, device=DEV)
        assert bufs.topk_scratch.shape[1] >= FUSED_WORKSPACE_COLS
        got = torch.full((md.num_tokens, lim.topk), -7, dtype=torch.int32, device=DEV)
        si.sparse_attn_indexer(q, None, w, world.kv, md, bufs, got)
        torch.cuda.synchronize()
        assert calls and all(calls), calls
        logits = torch.zeros(md.num_tokens, lim.max_model_len, device=DEV)
        si.fp8_paged_mqa_logits(q.view(8, next_n, 64, 128), world.kv, w, md.decode.context_lens,
                                md.decode.block_table, out=logits, backend="reference")
        ends = md.decode.row_ends
        rtol = _selection_rtol(torch.float32)
        assert_topk(got, logits, torch.zeros_like(ends), ends, rtol=rtol, threshold=True)
        graph = capture_cuda_graph(lambda: si.sparse_attn_indexer(q, None, w, world.kv, md, bufs, got))
        got.fill_(-7)
        n = len(calls)
        graph.replay()
        torch.cuda.synchronize()
        assert len(calls) == n  # (the replay runs the captured kernel, no Python)
        assert_topk(got, logits, torch.zeros_like(ends), ends, rtol=rtol, threshold=True)
    finally:
        backends.register(entry, replace=True)
