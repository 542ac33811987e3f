"""MXFP4 (docs/spec.md §3a) on a GPU: the Triton write and gather byte for byte the reference's, the ragged scores
of Triton and ``auto`` (which must pass Gluon over on Hopper) within tolerance of the reference, and an MXFP4
cache's paged scores on Triton and under ``auto``.

Run: ``PYTHONPATH=. python3 -m pytest tests/gpu/test_mxfp4_gpu.py``."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from buffers import CacheFormat
from sparse_indexer.testing import assert_logits

pytestmark = pytest.mark.gpu
DEV = "cuda"
MX = CacheFormat(values="mxfp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d,bs", [(128, 64), (64, 16)])
def test_write_and_gather_bytes(dtype, d, bs):
    g = torch.Generator(device=DEV).manual_seed(d + bs)
    nb = 40
    n = nb * bs - 7
    x = (torch.randn(n, d, device=DEV, generator=g) * torch.logspace(-30, 30, n, device=DEV)[:, None])
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    x = x.to(dtype)
    x[3, 5] = float("nan")
    slots = torch.randperm(nb * bs, device=DEV, generator=g)[:n]
    want = si.new_kv_cache(nb, bs, d, device=DEV, mxfp4=True)
    got = si.new_kv_cache(nb, bs, d, device=DEV, mxfp4=True)
    si.write_k_cache(x, want, slots, cache_format=MX, backend="reference")
    si.write_k_cache(x, got, slots, cache_format=MX, backend="triton")
    assert torch.equal(got, want), int((got != want).sum())
    table = torch.stack([torch.randperm(nb, device=DEV, generator=g) for _ in range(3)]).int()
    lens = [nb * bs, 1, 5 * bs + 3]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    outs = {}
    for backend in ("reference", "triton", None):
        k = torch.zeros(sum(lens), d // 2, dtype=torch.uint8, device=DEV)
        s = torch.zeros(sum(lens), d // 32, dtype=torch.uint8, device=DEV)
        si.gather_k_cache(got, table, cu, out_k=k, out_scale=s, cache_format=MX, backend=backend)
        outs[backend] = (k, s)
    for backend in ("triton", None):
        assert torch.equal(outs[backend][0], outs["reference"][0]) and torch.equal(outs[backend][1],
                                                                                  outs["reference"][1])


@pytest.mark.parametrize("h", [64, 32])
@pytest.mark.parametrize("backend", ["triton", None])
def test_ragged_scores(backend, h):
    g = torch.Generator(device=DEV).manual_seed(h)
    m, n, d = 300, 5000, 128  # large enough for Gluon's size rule under auto on Hopper
    qv, qs = si.quantize_q_mxfp4(torch.randn(m, h, d, device=DEV, generator=g))
    kv, ks = si.quantize_k_mxfp4(torch.randn(n, d, device=DEV, generator=g))
    w = torch.randn(m, h, device=DEV, generator=g) * (h * d) ** -0.5
    a = torch.randint(0, n // 2, (m,), device=DEV, generator=g, dtype=torch.int32)
    b = torch.randint(n // 2, n + 1, (m,), device=DEV, generator=g, dtype=torch.int32)
    want = si.fp8_mqa_logits(qv, kv, ks, w, a, b, q_scale=qs, backend="reference")
    got = si.fp8_mqa_logits(qv, kv, ks, w, a, b, q_scale=qs, backend=backend)
    assert_logits(got, want.double(), rtol_l2=1e-6)


def test_paged_scores_under_auto():
    g = torch.Generator(device=DEV).manual_seed(1)
    b, nn, h, d, bs, nb = 8, 2, 64, 128, 64, 70
    kv = si.new_kv_cache(nb, bs, d, device=DEV, mxfp4=True)
    si.write_k_cache(torch.randn(nb * bs, d, device=DEV, generator=g), kv, torch.arange(nb * bs, device=DEV),
                     cache_format=MX)
    bt = torch.randperm(nb, device=DEV, generator=g)[: b * 8].view(b, 8).int()
    cl = torch.randint(1, 8 * bs + 1, (b,), device=DEV, generator=g, dtype=torch.int32)
    qv, qs = si.quantize_q_mxfp4(torch.randn(b * nn, h, d, device=DEV, generator=g))
    qv, qs = qv.view(b, nn, h, d // 2), qs.view(b, nn, h, d // 32)
    w = torch.randn(b * nn, h, device=DEV, generator=g)
    want = si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, cache_format=MX, q_scale=qs, backend="reference")
    for backend in ("triton", None):
        got = si.fp8_paged_mqa_logits(qv, kv, w, cl, bt, cache_format=MX, q_scale=qs, backend=backend)
        assert_logits(got, want.double(), rtol_l2=1e-6)
