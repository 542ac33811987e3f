"""GPU tests of the Gluon ragged logits kernel (``sparse_indexer/ops/fp8_mqa_logits/gluon.py``).

Against the reference backend on the contract (docs/spec.md §5): relative L2 <= 2e-4 inside the windows (float32
``out``; bfloat16: one rounding), exact ``-inf`` masks with ``clean=True``, untouched cells outside the windows
with ``clean=False``; causal and arbitrary windows (empty ones, windows past ``N`` clipped by the value rules,
``M`` not a multiple of the block), compressed rows, refused cases raising ``NotImplementedError`` with ``out``
untouched, and one call captured in a CUDA graph. Skipped without a Hopper GPU (``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from sparse_indexer import backends as registry
from sparse_indexer.testing import logits_error

FP8 = torch.float8_e4m3fn
SENTINEL = 7777.0
RTOL = 2e-4
pytestmark = pytest.mark.gpu


def _gluon_ok() -> bool:
    return torch.cuda.is_available() and "gluon" in registry.names() and \
        registry.get("gluon").unavailable_reason(torch.device("cuda")) is None


needs_gluon = pytest.mark.skipif(not _gluon_ok(), reason="gluon backend unavailable here (needs an sm_90 GPU)")


def _inputs(m, n, *, h=64, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(m, h, d, device="cuda", generator=g) * 2).to(FP8)
    k = (torch.randn(n, d, device="cuda", generator=g) * 2).to(FP8)
    ksc = torch.rand(n, device="cuda", generator=g) * 0.01 + 0.001
    w = torch.randn(m, h, device="cuda", generator=g) * 0.1
    return q, k, ksc, w


def _causal(m, n):
    j = torch.arange(m, device="cuda")
    return torch.zeros(m, dtype=torch.int32, device="cuda"), (n - m + j + 1).clamp(0, n).int()


def _random_windows(m, n, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randint(0, n + 1, (m,), device="cuda", generator=g)
    b = torch.randint(0, n + 1, (m,), device="cuda", generator=g)
    ks, ke = torch.minimum(a, b).int(), torch.maximum(a, b).int()
    ke[::7] = ks[::7]  # empty windows
    ke[3::11] = ks[3::11] - 1  # ke < ks: empty too
    ks[1::13] = 0
    ke[1::13] = n  # full rows
    ks[2::17] = n - 1
    ke[2::17] = n  # the last key alone
    return ks, ke


def _run(backend, q, k, ksc, w, ks, ke, *, clean, dtype=torch.float32, width=None):
    m = q.shape[0]
    out = torch.full((m, width if width is not None else k.shape[0]), SENTINEL, dtype=dtype, device="cuda")
    si.fp8_mqa_logits(q, k, ksc, w, ks, ke, out=out, clean=clean, backend=backend, max_seqlen_k=width,
                      check_values=True)
    return out


def _compare(got, ref, ks, ke, *, clean, compressed=False, rtol=RTOL):
    cols = torch.arange(got.shape[1], device="cuda")
    if compressed:
        inside = cols[None, :] < (ke.long() - ks.long()).clamp(min=0)[:, None]
    else:
        inside = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
    err, mask_bad = logits_error(got.float(), ref.float(), inside, clean=clean)
    if int(inside.sum()) < 4096:  # a handful of cells: the L2 ratio is one fp8 tensor-core sum's error
        rtol = max(rtol, 2e-3)
    assert err <= rtol, f"relative L2 {err:.2e} > {rtol:.0e}"
    if clean:
        assert mask_bad == 0, f"{mask_bad} cells with a wrong -inf mask"
        assert bool((got.float()[~inside] == float("-inf")).all())
    else:
        sentinel = float(torch.tensor(SENTINEL, dtype=got.dtype))  # 7776 in bfloat16
        assert bool((got.float()[~inside] == sentinel).all()), "clean=False wrote outside the windows"


@needs_gluon
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("m,n", [(1, 1), (5, 70), (64, 64), (131, 1000), (257, 4099), (1024, 8192)])
def test_causal(m, n, clean):
    q, k, ksc, w = _inputs(m, n)
    ks, ke = _causal(m, n)
    ref = _run("reference", q, k, ksc, w, ks, ke, clean=True)
    got = _run("gluon", q, k, ksc, w, ks, ke, clean=clean)
    _compare(got, ref, ks, ke, clean=clean)


@needs_gluon
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n", [(3, 17), (301, 2500), (600, 9000)])
def test_arbitrary_windows(m, n, dtype, clean):
    q, k, ksc, w = _inputs(m, n, seed=m)
    ks, ke = _random_windows(m, n, seed=n)
    ref = _run("reference", q, k, ksc, w, ks, ke, clean=True)
    got = _run("gluon", q, k, ksc, w, ks, ke, clean=clean, dtype=dtype)
    _compare(got, ref.to(dtype), ks, ke, clean=clean, rtol=RTOL if dtype == torch.float32 else 4e-3)


@needs_gluon
def test_all_windows_empty():
    m, n = 77, 300
    q, k, ksc, w = _inputs(m, n)
    z = torch.zeros(m, dtype=torch.int32, device="cuda")
    got = _run("gluon", q, k, ksc, w, z + 5, z + 5, clean=True)
    assert bool((got == float("-inf")).all())
    got = _run("gluon", q, k, ksc, w, z + 5, z + 5, clean=False)
    assert bool((got == SENTINEL).all())


@needs_gluon
@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed(dtype, clean):
    reqs, mq, nk = 3, 150, 1100  # 3 causal requests of 150 queries over 1100 keys each, plus a random tail
    m, n = reqs * mq, reqs * nk
    q, k, ksc, w = _inputs(m, n, seed=3)
    j = torch.arange(m, device="cuda")
    r = j // mq
    ks = (r * nk).int()
    ke = (r * nk + nk - mq + j % mq + 1).int()
    ke[5] = ks[5]  # one empty row
    width = nk + 3
    ref = _run("reference", q, k, ksc, w, ks, ke, clean=True, width=width)
    got = _run("gluon", q, k, ksc, w, ks, ke, clean=clean, width=width, dtype=dtype)
    _compare(got, ref.to(dtype), ks, ke, clean=clean, compressed=True,
             rtol=RTOL if dtype == torch.float32 else 4e-3)


@needs_gluon
def test_strided_keys_and_weights():
    m, n = 100, 700
    q, k, ksc, w = _inputs(m, n)
    k_wide = torch.zeros(n, 256, dtype=torch.uint8, device="cuda").view(FP8)
    k_wide[:, :128] = k
    w_wide = torch.zeros(m, 80, device="cuda")
    w_wide[:, :64] = w
    ks, ke = _random_windows(m, n)
    ref = _run("reference", q, k, ksc, w, ks, ke, clean=True)
    got = _run("gluon", q, k_wide[:, :128], ksc, w_wide[:, :64], ks, ke, clean=True)
    _compare(got, ref, ks, ke, clean=True)


@needs_gluon
@pytest.mark.parametrize("case", ["heads", "dim", "q_strided", "k_unaligned"])
def test_refused(case):
    from sparse_indexer.ops.fp8_mqa_logits import gluon as g

    m, n = 8, 64
    h, d = (32, 128) if case == "heads" else (64, 64) if case == "dim" else (64, 128)
    q, k, ksc, w = _inputs(m, n, h=h, d=d)
    if case == "q_strided":
        q = torch.zeros(m, h + 1, d, dtype=torch.uint8, device="cuda").view(FP8)[:, :h]
    if case == "k_unaligned":
        k = torch.zeros(n * d + 16, dtype=torch.uint8, device="cuda").view(FP8)[1:1 + n * d].view(n, d)
    ks, ke = _causal(m, n)
    out = torch.full((m, n), SENTINEL, device="cuda")
    with pytest.raises(NotImplementedError):
        g.fp8_mqa_logits(q, k, ksc, w, ks, ke, out=out, clean=True)
    torch.cuda.synchronize()
    assert bool((out == SENTINEL).all()), "a refused call wrote into out"
    # auto falls back (to triton) and is right
    got = _run(None, q, k, ksc, w, ks, ke, clean=True)
    ref = _run("reference", q, k, ksc, w, ks, ke, clean=True)
    _compare(got, ref, ks, ke, clean=True, rtol=1e-3)


@needs_gluon
def test_repeated_calls_reuse_the_encoded_descriptors():
    """The bound launch passes each TMA descriptor's encoded map kept on the descriptor (sparse_indexer/_runtime/tma.py,
    ``_launch._with_encoded_maps``): repeated calls on the same buffers stay right, and a query at another address
    gets its own descriptor. (A specialization's first launch takes Triton's own path, which encodes per call.)"""
    from sparse_indexer.ops.fp8_mqa_logits import gluon as G

    m, n = 200, 2000
    G._DESCS.clear()  # (earlier tests' descriptors: some only ever took Triton's first-launch path)
    q, k, ksc, w = _inputs(m, n, seed=3)
    ks, ke = _causal(m, n)
    ref = _run("reference", q, k, ksc, w, ks, ke, clean=True)
    for _ in range(3):
        _compare(_run("gluon", q, k, ksc, w, ks, ke, clean=True), ref, ks, ke, clean=True)
    bound = [b for p in G._PLANS.values() for b in p.cfg.bound.values()]
    assert bound and all(b.run.__name__ == "run_encoded" for b in bound), [b.run for b in bound]
    descs = list(G._DESCS._cache.values())
    assert descs and all(getattr(d, "_si_encoded", None) is not None for d in descs)
    q2 = _inputs(m, n, seed=4)[0]
    _compare(_run("gluon", q2, k, ksc, w, ks, ke, clean=True), _run("reference", q2, k, ksc, w, ks, ke, clean=True),
             ks, ke, clean=True)


@needs_gluon
def test_cuda_graph_capture():
    m, n = 300, 3000
    q, k, ksc, w = _inputs(m, n)
    ks, ke = _causal(m, n)
    out = torch.full((m, n), SENTINEL, device="cuda")
    call = lambda: si.fp8_mqa_logits(q, k, ksc, w, ks, ke, out=out, clean=True, backend="gluon")  # noqa: E731
    call()  # compile and bind outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.fill_(SENTINEL)
    ks2, ke2 = _random_windows(m, n, seed=5)
    ks.copy_(ks2)
    ke.copy_(ke2)
    graph.replay()
    torch.cuda.synchronize()
    ref = _run("reference", q, k, ksc, w, ks, ke, clean=True)
    _compare(out, ref, ks, ke, clean=True)


@needs_gluon
def test_auto_takes_gluon_for_large_calls_only():
    """``auto`` runs the Gluon kernel where ``M * N >= AUTO_MIN_CELLS`` (its ``auto_when``), Triton below."""
    from sparse_indexer._runtime import dispatch as _dispatch
    from sparse_indexer.ops.fp8_mqa_logits import gluon as G

    dev = torch.device("cuda")
    found = _dispatch.routes("fp8_mqa_logits", None, dev)
    assert found[0].name == "gluon" and found[0].when is not None
    for m, n, want in ((8192, 8192, "gluon"), (256, 4096, "triton"), (4096, 8192, "triton"), (8192, 16384, "gluon")):
        q = torch.empty(m, 64, 128, device=dev, dtype=torch.float8_e4m3fn)
        k = torch.empty(n, 128, device=dev, dtype=torch.float8_e4m3fn)
        args = (q, k, torch.empty(n, device=dev), torch.empty(m, 64, device=dev),
                torch.zeros(m, device=dev, dtype=torch.int32), torch.zeros(m, device=dev, dtype=torch.int32))
        kw = {"out": torch.empty(m, 1, device=dev), "clean": True}
        assert _dispatch.chosen(found, None, args, kw).name == want, (m, n)
        assert _dispatch.chosen(found, "gluon", args, kw).name == "gluon"
    assert G.AUTO_MIN_CELLS == 1 << 26
