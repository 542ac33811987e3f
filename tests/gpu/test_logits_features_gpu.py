"""GPU tests of the logits ops' DeepGEMM features on the Triton backend at DeepSeek-V3.2 shapes
(H=64, D=128, block 64): bfloat16 logits (each cell the float32 result rounded to nearest even: compared with
the Triton float32 result rounded by torch, and that with the reference), compressed ragged logits equal to
the full ones' windows, the paged row -> request map equal to a gathered block table, and CUDA-graph replay of
the bf16/indices calls. Skipped without a GPU (``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from sparse_indexer.kcache import cache_views, new_kv_cache
from sparse_indexer.testing import capture_cuda_graph, logits_error

FP8 = torch.float8_e4m3fn
NINF = float("-inf")
pytestmark = pytest.mark.gpu


def _fp8(*shape):
    return (torch.randn(*shape, device="cuda") * 2).to(FP8)


def _cache(nb, bs=64, d=128):
    kv = new_kv_cache(nb, bs, d, device="cuda")
    vals, scales = cache_views(kv, FP8)
    vals.copy_(_fp8(nb, bs, d))
    scales.copy_(torch.rand(nb, bs, device="cuda") * 0.01 + 0.001)
    return kv


def _bf16_matches(got16: torch.Tensor, f32: torch.Tensor, inside: torch.Tensor) -> None:
    """Inside the windows the bf16 cells are the float32 result rounded by torch (the same rounding): equal, or
    (where the float32 kernel's summation order differs by an ulp at a rounding midpoint) one bf16 ulp apart in
    at most 0.1% of the cells."""
    assert got16.dtype == torch.bfloat16
    a = torch.where(inside, got16.float(), 0.0)
    b = torch.where(inside, f32.bfloat16().float(), 0.0)
    differ = a != b
    ulp = b.abs().clamp(min=1e-30) * 2.0**-7
    assert bool(((a - b).abs() <= ulp)[differ].all()), "bf16 cells more than one ulp from the rounded float32"
    assert int(differ.sum()) <= max(1, int(inside.sum()) // 1000), f"{int(differ.sum())} bf16 cells differ"


@pytest.mark.parametrize("next_n,cl2d", [(1, False), (2, False), (2, True), (4, True)])
def test_paged_bf16_is_rounded_f32(next_n, cl2d):
    b, L = 48, 20000
    max_blocks = (L + 63) // 64
    kv = _cache(b * max_blocks + 3)
    bt = torch.randperm(b * max_blocks, device="cuda").view(b, max_blocks).int()
    lens = torch.randint(0, L + 1, (b,), device="cuda").int()
    cl = (lens[:, None] - torch.randint(0, 3, (b, next_n), device="cuda")).clamp(min=0).int() if cl2d else lens
    q, w = _fp8(b, next_n, 64, 128), torch.randn(b * next_n, 64, device="cuda") * 0.1
    f32 = si.fp8_paged_mqa_logits(q, kv, w, cl, bt, clean=True, backend="triton")
    ref = si.fp8_paged_mqa_logits(q, kv, w, cl, bt, clean=True, backend="reference")
    inside = ref != NINF
    assert logits_error(f32, ref, inside, clean=True)[0] < 1e-3
    for clean in (True, False):
        out = torch.full_like(f32, 3.0, dtype=torch.bfloat16)
        si.fp8_paged_mqa_logits(q, kv, w, cl, bt, out=out, clean=clean, backend="triton")
        _bf16_matches(out, f32, inside)
        if clean:
            assert torch.equal(out == NINF, ~inside)
        else:
            assert bool((out[~inside] == 3.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_paged_indices_equal_gathered_block_table(dtype):
    """Speculative decode with 1 to 4 tokens per request, scored row by row through ``indices``."""
    reqs, L = 40, 30000
    tokens = torch.randint(1, 5, (reqs,)).tolist()
    max_blocks = (L + 4 + 63) // 64
    kv = _cache(reqs * max_blocks + 3)
    bt = torch.randperm(reqs * max_blocks, device="cuda").view(reqs, max_blocks).int()
    base = torch.randint(1, L, (reqs,)).tolist()
    indices = torch.tensor([r for r, t in enumerate(tokens) for _ in range(t)], dtype=torch.int32, device="cuda")
    ctx = torch.tensor([base[r] + j for r, t in enumerate(tokens) for j in range(t)], dtype=torch.int32,
                       device="cuda")
    rows = indices.numel()
    q, w = _fp8(rows, 1, 64, 128), torch.randn(rows, 64, device="cuda") * 0.1
    out = torch.empty(rows, max_blocks * 64, dtype=dtype, device="cuda")
    si.fp8_paged_mqa_logits(q, kv, w, ctx, bt, out=out, indices=indices, backend="triton", check_values=True)
    want = si.fp8_paged_mqa_logits(q, kv, w, ctx, bt.index_select(0, indices.long()), out=torch.empty_like(out),
                                   backend="triton")
    assert torch.equal(out, want)
    ref = si.fp8_paged_mqa_logits(q, kv, w, ctx, bt, indices=indices, backend="reference")
    assert logits_error(out.float(), ref, ref != NINF, clean=True)[0] < 4e-3

    # the same call captured in a CUDA graph and replayed on new lengths
    g = capture_cuda_graph(lambda: si.fp8_paged_mqa_logits(q, kv, w, ctx, bt, out=out, indices=indices,
                                                           clean=True, backend="triton", check_values=False))
    ctx.copy_((ctx - 7).clamp(min=0))
    g.replay()
    torch.cuda.synchronize()
    want = si.fp8_paged_mqa_logits(q, kv, w, ctx, bt.index_select(0, indices.long()), out=torch.empty_like(out),
                                   backend="triton")
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("clean", [True, False])
def test_ragged_compressed_equals_full_windows(dtype, clean):
    """A chunk of three causal requests (keys 3000, 9000, 1200; queries 700, 1500, 300): compressed rows hold the
    full logits' windows from column 0."""
    lens, qlens = [3000, 9000, 1200], [700, 1500, 300]
    ks, ke, c = [], [], 0
    for L_, q_ in zip(lens, qlens):
        for j in range(q_):
            ks.append(c)
            ke.append(c + L_ - q_ + j + 1)
        c += L_
    ks = torch.tensor(ks, dtype=torch.int32, device="cuda")
    ke = torch.tensor(ke, dtype=torch.int32, device="cuda")
    m, n = ks.numel(), c
    q, k = _fp8(m, 64, 128), _fp8(n, 128)
    ksc, w = torch.rand(n, device="cuda") * 0.01 + 0.001, torch.randn(m, 64, device="cuda") * 0.1
    full = si.fp8_mqa_logits(q, k, ksc, w, ks, ke, clean=True, backend="triton")
    width = max(lens)
    out = torch.full((m, width), 5.0, dtype=dtype, device="cuda")
    si.fp8_mqa_logits(q, k, ksc, w, ks, ke, out=out, clean=clean, max_seqlen_k=width, backend="triton")
    lens_r = (ke - ks).long()
    j = torch.arange(width, device="cuda")[None, :]
    inside = j < lens_r[:, None]
    want = torch.gather(full, 1, (ks.long()[:, None] + j).clamp(max=n - 1))
    if dtype == torch.bfloat16:
        _bf16_matches(out, want, inside)
    else:  # the same arithmetic as the full kernel's (a different specialization: allow float32 reordering)
        torch.testing.assert_close(torch.where(inside, out, 0.0), torch.where(inside, want, 0.0), rtol=1e-5,
                                   atol=1e-6)
    if clean:
        assert torch.equal(out == NINF, ~inside)
    else:
        assert bool((out[~inside] == 5.0).all())
    ref = si.fp8_mqa_logits(q[::97].contiguous(), k, ksc, w[::97].contiguous(), ks[::97].contiguous(),
                            ke[::97].contiguous(), max_seqlen_k=width, backend="reference")
    assert logits_error(out[::97].float(), ref, inside[::97], clean=False)[0] < (4e-3 if dtype == torch.bfloat16
                                                                                  else 1e-3)


@pytest.mark.parametrize("dtype,compressed", [(torch.bfloat16, False), (torch.float32, True),
                                              (torch.bfloat16, True)], ids=["bf16", "compressed", "bf16-compressed"])
def test_step_with_logits_features(dtype, compressed):
    """The step on the GPU (auto backends) with bf16 and/or compressed prefill logits: every row a top-k of its
    float64 model scores, each selected score within a tolerance of the k-th: bf16 two roundings (2^-7); float32
    1e-3 x max|score|, the FP8 tensor cores' accumulation (a float32 run on the H200 selected a score 7.6e-5 x max
    below the k-th, over check_topk's CPU tolerance of 1e-5)."""
    from sparse_indexer.testing import assert_topk
    from tests.sparse_indexer.test_indexer import Scenario, limits

    lim = limits(next_n=2, logits_dtype=dtype, compressed_prefill_logits=compressed)
    sc = Scenario([300, 90, 41, 512, 512, 200], [2, 1, 2, 300, 250, 120], lim=lim, seed=3)
    md = si.build_metadata(sc.seq, sc.qry, sc.block_table.cuda(), sc.slot_mapping.cuda(), lim,
                           num_blocks=sc.kv.shape[0])
    from buffers import allocate

    buf = allocate(lim, "cuda")
    out = torch.full((md.num_tokens, lim.topk), 7, dtype=torch.int32, device="cuda")
    si.sparse_attn_indexer(sc.q.cuda(), sc.k.cuda(), sc.w.cuda(), sc.kv.cuda(), md, buf, out)
    assert out.shape == (md.num_tokens, lim.topk)
    rtol = 2.0**-7 if dtype == torch.bfloat16 else 1e-3
    assert_topk(out.cpu(), sc.model_scores(), rtol=rtol, threshold=True)
