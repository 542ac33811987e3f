"""GPU checks of the Triton top_k_per_row, write_k_cache and gather_k_cache against the reference."""

from __future__ import annotations

import pytest
import torch

import sparse_indexer as si
from sparse_indexer.kcache import new_kv_cache
from sparse_indexer.testing import assert_topk

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("workspace", [None, 4096, 4])  # candidate slots per row (4: every long row overflows)
@pytest.mark.parametrize("rows,width,topk", [(64, 65536, 2048), (37, 5000, 512), (9, 3000, 1024), (130, 40000, 2048)])
def test_top_k_per_row_gpu(rows, width, topk, workspace, dtype):
    """The Triton top-k (bound launches: each case is called twice, the second call takes the bound path)."""
    logits = torch.randn(rows, width + 3, device=DEV)[:, :width]
    logits[1, : width // 2] = float("-inf")
    logits[2, ::3] = float("nan")
    logits[3] = 1.0
    starts = torch.randint(0, width // 4, (rows,), device=DEV, dtype=torch.int32)
    ends = torch.randint(width // 2, width + 1, (rows,), device=DEV, dtype=torch.int32)
    ends[4] = starts[4] + topk  # exactly topk
    ends[5] = starts[5]  # empty
    out = torch.full((rows, topk), -7, dtype=torch.int32, device=DEV)
    ws = None
    if workspace is not None:
        ws = torch.full((rows, 32 + 2 * workspace), -5, dtype=torch.int32, device=DEV)
        logits[6] = torch.randint(0, 3, (width,), device=DEV).float()  # ties: the threshold bucket overflows
        logits[7, ::2] = float("-inf")
        logits[7, 1::4] = float("nan")
    logits = logits.to(dtype)
    for _ in range(2):
        out.fill_(-7)
        si.top_k_per_row(logits, starts, ends, out=out, backend="triton", workspace=ws)
        assert_topk(out, logits, starts, ends)  # short rows exact; long rows the top-k value multiset


@pytest.mark.gpu
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("block_size,head_dim", [(64, 128), (1, 128), (16, 64)])
def test_write_k_cache_gpu(scale_fmt, fp8_dtype, block_size, head_dim):
    t, nb = 3000, 3000 // block_size + 8
    k = (torch.randn(t, head_dim, device=DEV) * torch.rand(t, 1, device=DEV) * 8).to(torch.bfloat16)
    k[0] = 0
    slots = torch.randperm(nb * block_size, device=DEV)[: t - 10]
    slots[::7] = -1
    # The reference runs on the CPU: on CUDA, torch divides by the Python scalar qmax as a multiplication by
    # float32(1 / qmax), which is not docs/spec.md §3's division (it differs in the last bit for plain scales).
    ref = new_kv_cache(nb, block_size, head_dim, block_pad=12)
    si.write_k_cache(k.cpu(), ref, slots.cpu(), scale_fmt=scale_fmt, fp8_dtype=fp8_dtype, backend="reference")
    kv = new_kv_cache(nb, block_size, head_dim, device=DEV, block_pad=12)
    si.write_k_cache(k, kv, slots, scale_fmt=scale_fmt, fp8_dtype=fp8_dtype, backend="triton")
    assert torch.equal(kv.cpu(), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size,head_dim", [(64, 128), (1, 128), (16, 64), (32, 128)])
def test_gather_k_cache_gpu(block_size, head_dim):
    lens = [1000, 0, 1, 2049, 333]
    nb = sum((x + block_size - 1) // block_size for x in lens) + 5
    kv = new_kv_cache(nb, block_size, head_dim, device=DEV, block_pad=8)
    kv.copy_(torch.randint(0, 256, kv.shape, dtype=torch.uint8, device=DEV))
    mb = max((x + block_size - 1) // block_size for x in lens) + 1
    perm = torch.randperm(nb, device=DEV).int()
    bt = torch.zeros(len(lens), mb, dtype=torch.int32, device=DEV)
    c = 0
    for i, x in enumerate(lens):
        kk = (x + block_size - 1) // block_size
        bt[i, :kk] = perm[c : c + kk]
        c += kk
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    n = int(cu[-1]) + 50
    outs = []
    for backend in ("reference", "triton"):
        out_k = torch.full((n, head_dim), 7, dtype=torch.uint8, device=DEV).view(torch.float8_e4m3fn)
        out_s = torch.full((n,), 3.0, device=DEV)
        si.gather_k_cache(kv, bt, cu, out_k=out_k, out_scale=out_s, backend=backend)
        outs.append((out_k.view(torch.uint8), out_s.view(torch.int32)))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
