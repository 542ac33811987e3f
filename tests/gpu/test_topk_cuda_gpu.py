"""GPU checks of the CUDA top_k_per_row backend (NVRTC kernel) against the reference backend (docs/spec.md §6):
every value distribution and window shape, every launch configuration and its exact fallback, topk up to the
backend's limit (and the auto fallback above it), and a CUDA-graph replay of the decode step with new lengths.
Run: ``PYTHONPATH=. python3 -m pytest tests/gpu/test_topk_cuda_gpu.py``."""

from __future__ import annotations

import math

import pytest
import torch

import sparse_indexer as si
from sparse_indexer.testing import TOPK_DISTRIBUTIONS as DISTRIBUTIONS
from sparse_indexer.testing import assert_topk, capture_cuda_graph, topk_values

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _cuda():
    from sparse_indexer.ops.top_k_per_row import cuda as tkc

    why = tkc.unavailable_reason() if torch.cuda.is_available() and torch.version.hip is None else "not NVIDIA"
    if why:
        pytest.skip(f"CUDA top-k backend unavailable: {why}")
    return tkc


def _dist(name, r, w, g):
    return topk_values(name, r, w, device=DEV, generator=g)


def _windows(kind, r, w, topk, g):
    z = torch.zeros(r, dtype=torch.int32, device=DEV)
    if kind == "full":
        return z, torch.full((r,), w, dtype=torch.int32, device=DEV)
    if kind == "ragged":  # decode: [0, L_r)
        return z, torch.randint(w // 2, w + 1, (r,), device=DEV, dtype=torch.int32, generator=g)
    if kind == "causal":  # prefill: [0, (j + 1) w / r)
        return z, ((torch.arange(r, device=DEV) + 1) * w // r).int()
    if kind == "short":  # every window <= topk, some empty
        return z, torch.randint(0, topk + 1, (r,), device=DEV, dtype=torch.int32, generator=g)
    s = torch.randint(0, w // 3, (r,), device=DEV, dtype=torch.int32, generator=g)  # "starts": [ks, ke)
    e = torch.randint(w // 3, w + 1, (r,), device=DEV, dtype=torch.int32, generator=g)
    e[::5] = s[::5]  # empty
    e[1::5] = torch.clamp(s[1::5] + topk, max=w)  # exactly topk
    return s, e


def _check(x, s, e, out):
    """Short rows exact; long rows distinct in-window positions with the top-k value multiset (as the
    reference's)."""
    assert_topk(out, x, s, e)


@pytest.mark.parametrize("kind", ["full", "ragged", "causal", "short", "starts"])
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("rows,width,topk", [(64, 65536, 2048), (300, 9000, 2048), (7, 70001, 512)])
def test_cuda_topk_matches_reference(rows, width, topk, dist, kind):
    _cuda()
    g = torch.Generator(device=DEV).manual_seed(rows + width)
    x = _dist(dist, rows, width + 1, g)[:, 1:]  # unaligned rows and an odd stride (scalar edges)
    s, e = _windows(kind, rows, width, topk, g)
    out = torch.full((rows, topk), -7, dtype=torch.int32, device=DEV)
    si.top_k_per_row(x, s, e, out=out, backend="cuda")
    _check(x, s, e, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["full", "ragged", "starts"])
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("rows,width,topk", [(64, 16384, 512), (3, 16385, 1024), (64, 32768, 2048), (200, 16384, 512),
                                             (140, 12000, 1024)])
def test_cuda_topk_rows_in_shared_memory(rows, width, topk, dist, kind, dtype):
    """DeepSeek-V4's shapes: rows of up to 32K cells loaded whole into shared memory (one CTA of 1024 threads per
    row for at most one row per SM, 512 threads for more rows), every distribution, unaligned rows with an odd
    stride, windows from column 0 and ragged ``[ks, ke)``."""
    tkc = _cuda()
    assert tkc.config(rows, width, torch.device(DEV), topk)[2], "expected the in-shared-memory path"
    g = torch.Generator(device=DEV).manual_seed(rows + width + topk)
    x = _dist(dist, rows, width + 1, g).to(dtype)[:, 1:]
    s, e = _windows(kind, rows, width, topk, g)
    out = torch.full((rows, topk), -7, dtype=torch.int32, device=DEV)
    si.top_k_per_row(x, s, e, out=out, backend="cuda")
    _check(x, s, e, out)


@pytest.mark.parametrize("nt", [256, 512, 1024])
@pytest.mark.parametrize("width", [16384, 32768])
def test_cuda_topk_list_edges_long_rows(width, nt):
    """The small-row list's edges (capacity, one past it, ties, a whole bin, a k-th largest of -inf / NaN) on rows
    of 16K and 32K cells in shared memory, at every thread count."""
    tkc = _cuda()
    x = _list_edge_rows(width).to(device=DEV)
    r, w = x.shape
    s = torch.zeros(r, dtype=torch.int32, device=DEV)
    e = torch.full((r,), w, dtype=torch.int32, device=DEV)
    out = torch.full((r, 2048), -7, dtype=torch.int32, device=DEV)
    tkc.launch(x, s, e, out, nt=nt, cs=1, small=True)
    _check(x, s, e, out)


@pytest.mark.parametrize("kind", ["full", "ragged", "causal", "short", "starts"])
@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("rows,width,topk", [(64, 65536, 2048), (300, 9000, 2048), (7, 70001, 512), (1, 65536, 2048)])
def test_cuda_topk_bfloat16(rows, width, topk, dist, kind):
    """bfloat16 logits: exact on the values given, every distribution and window shape, unaligned
    rows and an odd stride (8 cells per 16-byte load: up to 14 scalar edge cells)."""
    _cuda()
    g = torch.Generator(device=DEV).manual_seed(rows + width + 1)
    x = _dist(dist, rows, width + 3, g).to(torch.bfloat16)[:, 3:]
    s, e = _windows(kind, rows, width, topk, g)
    out = torch.full((rows, topk), -7, dtype=torch.int32, device=DEV)
    si.top_k_per_row(x, s, e, out=out, backend="cuda")
    _check(x, s, e, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(64, 65536), (4, 65536), (2000, 8192)])
def test_cuda_topk_compressed_rows(rows, width, dtype):
    """Compressed logits (windows ``[0, len_i)`` from column 0, cells past ``len_i`` unspecified: NaN, +inf, huge)
    are read in place, without a copy."""
    _cuda()
    g = torch.Generator(device=DEV).manual_seed(rows)
    x = torch.randn(rows, width, device=DEV, generator=g)
    lens = torch.randint(0, width + 1, (rows,), device=DEV, dtype=torch.int32, generator=g)
    lens[0] = width
    cols = torch.arange(width, device=DEV)
    junk = torch.tensor([float("nan"), float("inf"), 3e38], device=DEV)[torch.arange(rows, device=DEV) % 3]
    x = torch.where(cols[None, :] < lens[:, None], x, junk[:, None]).to(dtype)
    s = torch.zeros(rows, dtype=torch.int32, device=DEV)
    out = torch.full((rows, 2048), -7, dtype=torch.int32, device=DEV)
    si.top_k_per_row(x, s, lens, out=out, backend="cuda")
    _check(x, s, lens, out)


@pytest.mark.parametrize("nt,cs,small", [(256, 1, None), (512, 1, None), (1024, 1, None), (1024, 2, None),
                                         (1024, 4, None), (512, 8, None), (1024, 16, None), (512, 1, False)])
@pytest.mark.parametrize("dist", ["gaussian", "ints0-3", "nan+inf", "adv-overflow", "adv-miss"])
def test_cuda_topk_every_config(nt, cs, small, dist):
    """Every thread count and cluster size, the sampled path for small rows, and both exact fallbacks."""
    tkc = _cuda()
    if cs > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    g = torch.Generator(device=DEV).manual_seed(nt + cs)
    for w in (65536, 6000):
        for dtype in (torch.float32, torch.bfloat16):
            x = _dist(dist, 9, w, g).to(dtype)
            s, e = _windows("starts" if w == 6000 else "full", 9, w, 2048, g)
            out = torch.full((9, 2048), -7, dtype=torch.int32, device=DEV)
            tkc.launch(x, s, e, out, nt=nt, cs=cs, small=small)
            _check(x, s, e, out)


def _list_edge_rows(n: int = 8000, k: int = 2048) -> torch.Tensor:
    """Small rows (``n`` cells, selected in shared memory) at the edges of the small-row list (topk_kernel.cu,
    LIST): 1000 cells above the bin [2, 2.5) (one first digit), ``cnt`` cells in it, the rest in [-1, 1), so the
    k-th largest lies in that bin: ``cnt`` 2048 (the list's capacity), 2049 (over it: the radix select over every
    key), 2048 with repeated values (ties in the list), 1048 (the bin holds exactly the cells still needed); and a
    row whose k-th largest is -inf / NaN (first digit 0: all equal, selected without further digits)."""
    g = torch.Generator().manual_seed(11)
    rows = []
    for cnt, ties in ((2048, False), (2049, False), (2048, True), (k - 1000, False)):
        hi = 100.0 + torch.arange(1000, dtype=torch.float32)
        # in [2, 2.49): stays in the bin when rounded to bfloat16 (2 + m / 64 plus less than half its step)
        mid = (2.0 + torch.randint(0, 32, (cnt,), generator=g) / 64 + torch.rand(cnt, generator=g) / 256
               if not ties else 2.0 + (torch.arange(cnt) % 7).float() / 16)
        lo = torch.rand(n - 1000 - cnt, generator=g) * 2 - 1
        rows.append(torch.cat([hi, mid, lo]))
    junk = torch.tensor([float("-inf"), float("nan"), -float("nan")]).repeat(n)[: n - 1000]
    rows.append(torch.cat([torch.randn(1000, generator=g), junk]))
    x = torch.stack(rows)
    return x.gather(1, torch.stack([torch.randperm(n, generator=g) for _ in rows]))  # cells in random order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nt", [256, 512, 1024])
def test_cuda_topk_small_row_list_edges(nt, dtype):
    """The small-row list at its capacity and one past it, with ties, a first-digit bin taken whole, and a k-th
    largest of -inf / NaN, at every thread count."""
    tkc = _cuda()
    x = _list_edge_rows().to(device=DEV, dtype=dtype)
    r, w = x.shape
    s = torch.zeros(r, dtype=torch.int32, device=DEV)
    e = torch.full((r,), w, dtype=torch.int32, device=DEV)
    out = torch.full((r, 2048), -7, dtype=torch.int32, device=DEV)
    tkc.launch(x, s, e, out, nt=nt, cs=1)
    _check(x, s, e, out)


@pytest.mark.parametrize("topk", [1, 100, 3000, 4096, 5000])
def test_cuda_topk_sizes(topk):
    """topk up to the backend's limit; above it ``auto`` falls back (to Triton) and an explicit request raises."""
    tkc = _cuda()
    g = torch.Generator(device=DEV).manual_seed(topk)
    x = torch.randn(20, 40000, device=DEV, generator=g)
    s, e = _windows("starts", 20, 40000, topk, g)
    out = torch.full((20, topk), -7, dtype=torch.int32, device=DEV)
    if topk > tkc.MAX_TOPK:
        with pytest.raises(NotImplementedError, match="topk"):
            si.top_k_per_row(x, s, e, out=out, backend="cuda")
        si.top_k_per_row(x, s, e, out=out)  # auto
    else:
        si.top_k_per_row(x, s, e, out=out, backend="cuda")
    _check(x, s, e, out)


def test_cases_the_gpu_cannot_run_fall_back(monkeypatch):
    """Shared memory beyond the device's opt-in limit, or a kernel that cannot be built or loaded, raise
    NotImplementedError before writing (an explicit request), and ``auto`` takes Triton instead."""
    tkc = _cuda()
    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(8, 30000, device=DEV, generator=g)
    s, e = _windows("starts", 8, 30000, 2048, g)
    for patch, match in ((("_smem_optin", lambda index: 1024)), "shared memory"), \
                        ((("_usable", lambda *a: "could not be built (test)")), "could not be built"):
        tkc._plan.cache_clear()  # plans are cached per shape: make this one afresh under the patch
        with monkeypatch.context() as m:
            m.setattr(tkc, *patch)
            out = torch.full((8, 2048), -7, dtype=torch.int32, device=DEV)
            with pytest.raises(NotImplementedError, match=match):
                si.top_k_per_row(x, s, e, out=out, backend="cuda")
            assert bool((out == -7).all())
            si.top_k_per_row(x, s, e, out=out)  # auto: Triton
            _check(x, s, e, out)
        tkc._plan.cache_clear()


def test_auto_picks_cuda_on_nvidia():
    _cuda()
    avail = si.available(DEV)
    assert avail[0] in ("cuda", "aiter") and "cuda" in avail[:2] and "triton" in avail  # (gluon: the logits only)
    from sparse_indexer._runtime import dispatch as _dispatch

    assert _dispatch.candidates("top_k_per_row", None, torch.device(DEV))[0] == "cuda"
    assert "cuda" not in _dispatch.candidates("fp8_paged_mqa_logits", None, torch.device(DEV))


def test_decode_step_graph_replay_with_new_lengths():
    """The decode step (paged logits + CUDA top-k, auto backend) captured once in a CUDA graph, replayed with new
    context lengths and queries: every replay's selection equals the reference top-k of that step's logits."""
    _cuda()
    from buffers import IndexerLimits, allocate

    b, nn, L, bs, d, h = 8, 2, 20000, 64, 128, 64
    lim = IndexerLimits(max_model_len=L, max_num_batched_tokens=b * nn, max_num_seqs=b, next_n=nn, topk=2048,
                        prefill_k_tokens=L)
    mb = (L + bs - 1) // bs
    g = torch.Generator(device="cpu").manual_seed(9)
    kv = si.new_kv_cache(b * mb, bs, d, device=DEV)
    si.write_k_cache(torch.randn(b * mb * bs, d, generator=g).to(DEV), kv, torch.arange(b * mb * bs, device=DEV))
    bt = torch.randperm(b * mb, generator=g).int().view(b, mb).to(DEV)
    bufs = allocate(lim, DEV)
    q = torch.empty(b * nn, h, d, dtype=torch.float8_e4m3fn, device=DEV)
    w = torch.empty(b * nn, h, device=DEV)
    out = torch.full((b * nn, lim.topk), -7, dtype=torch.int32, device=DEV)

    def inputs(seq):
        q.copy_((torch.randn(b * nn, h, d, generator=g) * 2).to(torch.float8_e4m3fn).to(DEV))
        w.copy_((torch.randn(b * nn, h, generator=g) / math.sqrt(h * d)).to(DEV))
        pos = torch.cat([torch.arange(s - nn, s) for s in seq])
        req = torch.arange(b).repeat_interleave(nn)
        slots = (bt.cpu().long()[req, pos // bs] * bs + pos % bs).to(DEV)
        return si.build_metadata(seq, [nn] * b, bt, slots, lim)

    md = inputs([L] * b)

    def step():
        si.indexer_decode(q, w, kv, md, bufs, out)

    step()
    torch.cuda.synchronize()
    graph = capture_cuda_graph(step)
    for trial in range(3):
        seq = [int(v) for v in torch.randint(nn, L + 1, (b,), generator=g)]
        seq[0] = 2048 - trial  # a window <= topk
        md2 = inputs(seq)
        md.decode.context_lens.copy_(md2.decode.context_lens)  # the captured step reads these tensors
        md.decode.row_ends.copy_(md2.decode.row_ends)
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        logits = bufs.logits_view(b * nn, md.decode.width)
        _check(logits, md.decode.row_starts, md.decode.row_ends, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_topk_aligned_base_odd_stride(dtype):
    """A 16-byte aligned first row with a row stride that is not a multiple of 16 bytes: later rows start
    unaligned, so the vector loads of each row take scalar edge cells (the per-row alignment arithmetic)."""
    _cuda()
    g = torch.Generator(device=DEV).manual_seed(5)
    rows, width = 64, 65536
    x = _dist("gaussian", rows, width + 3, g).to(dtype)[:, :width]
    assert x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 != 0
    for kind in ("full", "starts", "ragged"):
        s, e = _windows(kind, rows, width, 2048, g)
        out = torch.full((rows, 2048), -7, dtype=torch.int32, device=DEV)
        si.top_k_per_row(x, s, e, out=out, backend="cuda")
        _check(x, s, e, out)


def test_cuda_topk_from_a_fresh_thread():
    """A thread whose first CUDA call is the top-k has no current driver context: the launch makes the device's
    primary context current instead of failing with CUDA_ERROR_INVALID_CONTEXT."""
    import threading

    _cuda()
    g = torch.Generator(device=DEV).manual_seed(6)
    x = _dist("gaussian", 4, 65536, g)
    s, e = _windows("full", 4, 65536, 2048, g)
    out = torch.full((4, 2048), -7, dtype=torch.int32, device=DEV)
    si.top_k_per_row(x, s, e, out=out, backend="cuda")  # warm: compiled and planned in this thread
    torch.cuda.synchronize()
    out.fill_(-7)
    errors = []

    def run():
        try:
            si.top_k_per_row(x, s, e, out=out, backend="cuda")
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
    _check(x, s, e, out)
