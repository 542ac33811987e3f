"""Run every Triton kernel once on small DeepSeek-like shapes (for compute-sanitizer memcheck/racecheck).

Usage on a GPU machine: ``compute-sanitizer --tool memcheck python3 scripts/sanitize_kernels.py``
(``--cuda-topk-only``: only the CUDA top-k kernel, every path and cluster size; ``--gluon-paged-only``,
``--gluon-prefill-only``: only that Gluon logits kernel).
Checks each result against the reference backend and exits 1 on a mismatch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed

import sparse_indexer as si  # noqa: E402
from sparse_indexer.testing import logits_error, topk_errors  # noqa: E402


def main() -> int:
    torch.manual_seed(0)
    dev = "cuda"
    for flag, only in (("--cuda-topk-only", _cuda_topk), ("--gluon-paged-only", _gluon_paged),
                       ("--gluon-prefill-only", _gluon_prefill)):
        if flag in sys.argv:
            return _finish(only(dev))
    h, d, bs, nn = 64, 128, 64, 2
    lens = [300, 1, 0, 2100]
    b = len(lens)
    max_blocks = (max(lens) + bs - 1) // bs
    nb = b * max_blocks + 3
    kv = si.new_kv_cache(nb, bs, d, device=dev, block_pad=16)
    kv_ref = kv.clone()
    bt = torch.randperm(nb, device=dev)[: b * max_blocks].view(b, max_blocks).int()
    pos = torch.arange(max(lens), device=dev)[None].expand(b, -1)
    slots = si.slots_from_block_table(bt, pos, bs)
    slots = torch.where(pos < torch.tensor(lens, device=dev)[:, None], slots, -1).reshape(-1)
    k = torch.randn(slots.numel(), d, device=dev, dtype=torch.bfloat16)
    si.write_k_cache(k, kv, slots, backend="triton")
    si.write_k_cache(k, kv_ref, slots, backend="reference")
    ok = torch.equal(kv, kv_ref)
    print("write_k_cache bit-exact:", ok)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    n = int(cu[-1])
    outs = {}
    for be in ("triton", "reference"):
        ok_ = torch.empty(n + 5, d, dtype=torch.float8_e4m3fn, device=dev)
        os_ = torch.zeros(n + 5, device=dev)
        si.gather_k_cache(kv, bt, cu, out_k=ok_, out_scale=os_, backend=be)
        outs[be] = (ok_[:n].view(torch.uint8), os_[:n])
    g_ok = torch.equal(*[o[0] for o in outs.values()]) and torch.equal(*[o[1] for o in outs.values()])
    print("gather_k_cache bit-exact:", g_ok)
    ok &= g_ok
    q = torch.randn(b, nn, h, d, device=dev).to(torch.float8_e4m3fn)
    w = torch.randn(b * nn, h, device=dev)
    cl = torch.tensor(lens, dtype=torch.int32, device=dev)
    lt = si.fp8_paged_mqa_logits(q, kv, w, cl, bt, backend="triton")
    lr = si.fp8_paged_mqa_logits(q, kv, w, cl, bt, backend="reference")
    err, mask_bad = logits_error(lt, lr)
    p_ok = mask_bad == 0 and err < 1e-3
    print(f"paged logits: rel L2 {err:.2e}, -inf cells that differ {mask_bad}")
    ok &= p_ok
    m = 300
    kf, ks = outs["reference"][0].view(torch.float8_e4m3fn)[:2400], outs["reference"][1][:2400]
    qm = torch.randn(m, h, d, device=dev).to(torch.float8_e4m3fn)
    wm = torch.randn(m, h, device=dev)
    kse = torch.zeros(m, dtype=torch.int32, device=dev) + 301
    kee = (kse + 1800 + torch.arange(m, device=dev)).int()
    rt = si.fp8_mqa_logits(qm, kf, ks, wm, kse.int(), kee, backend="triton")
    rr = si.fp8_mqa_logits(qm, kf, ks, wm, kse.int(), kee, backend="reference")
    err, mask_bad = logits_error(rt, rr)
    r_ok = mask_bad == 0 and err < 1e-3
    print(f"ragged logits: rel L2 {err:.2e}, -inf cells that differ {mask_bad}")
    ok &= r_ok
    topk = 512
    sel = torch.empty(m, topk, dtype=torch.int32, device=dev)
    si.top_k_per_row(rr, kse, kee, out=sel, backend="triton")
    t_ok = not topk_errors(sel, rr, kse, kee)
    print("top_k_per_row multisets equal:", t_ok)
    # the split-row path (few rows + the planned workspace), as the decode step runs it
    from buffers import IndexerLimits, plan

    rows = torch.arange(0, m, 5, device=dev)[:60]
    lg, s_, e_ = rr[rows].contiguous(), kse[rows], kee[rows]
    lim = IndexerLimits(max_model_len=rr.shape[1], max_num_batched_tokens=64, max_num_seqs=64, topk=topk)
    ws = torch.empty(plan(lim)["topk_scratch"].shape, dtype=torch.int32, device=dev)
    sel2 = torch.empty(rows.numel(), topk, dtype=torch.int32, device=dev)
    si.top_k_per_row(lg, s_, e_, out=sel2, backend="triton", workspace=ws)
    w_ok = not topk_errors(sel2, lg, s_, e_)
    print("top_k_per_row (split path, workspace) multisets equal:", w_ok)
    t_ok &= w_ok
    t_ok &= _cuda_topk(dev)
    ok &= t_ok
    ok &= _gluon_paged(dev)
    ok &= _gluon_prefill(dev)
    return _finish(ok)


def _finish(ok: bool) -> int:
    """Wait for the kernels, print the verdict, and return the exit status."""
    torch.cuda.synchronize()
    print("ALL OK" if ok else "MISMATCH")
    return 0 if ok else 1


def _cuda_topk(dev) -> bool:
    """The NVRTC top-k kernel (sparse_indexer/ops/top_k_per_row/cuda.py) in every path and cluster size."""
    from sparse_indexer.ops.top_k_per_row import cuda as tkc

    why = tkc.unavailable_reason()
    if why:
        print("cuda top-k: not available:", why)
        return True
    g = torch.Generator(device=dev).manual_seed(5)
    r, w, topk = 6, 40000, 2048
    x = torch.randn(r, w + 1, device=dev, generator=g)[:, 1:]  # unaligned rows: scalar edges
    x[1] = torch.randint(0, 4, (w,), device=dev, generator=g).float()  # ties at the threshold
    x[2, ::3] = float("nan")
    x[2, 1::3] = float("-inf")
    x[3] *= 1e-3  # candidates overflow: the exact fallback over the whole window
    for o in (1, 2, 3):
        x[3, o::16] += 10
    s = torch.tensor([0, 5, 0, 0, 100, 7], dtype=torch.int32, device=dev)
    e = torch.tensor([w, w, w, w, 100 + 9000, 7 + 1000], dtype=torch.int32, device=dev)  # small, short rows
    ok = True
    for nt, cs in ((512, 1), (1024, 1), (512, 4), (1024, 2), (512, 8)):
        out = torch.full((r, topk), -7, dtype=torch.int32, device=dev)
        tkc.launch(x, s, e, out, nt=nt, cs=cs)
        ok &= not topk_errors(out, x, s, e)
    # rows loaded whole into shared memory (up to 32K cells), float32 and bfloat16, k 512 and 2048
    w2 = 16387
    x2 = torch.randn(4, w2 + 1, device=dev, generator=g)[:, 1:]
    x2[1] = torch.randint(0, 4, (w2,), device=dev, generator=g).float()
    x2[2, ::3] = float("nan")
    x2[2, 1::3] = float("-inf")
    s2 = torch.tensor([0, 3, 0, 11], dtype=torch.int32, device=dev)
    e2 = torch.tensor([w2, w2, w2, 11 + 9000], dtype=torch.int32, device=dev)
    for dtype in (torch.float32, torch.bfloat16):
        for nt, k in ((1024, 512), (512, 2048), (256, 512)):
            xx = x2.to(dtype)
            out = torch.full((4, k), -7, dtype=torch.int32, device=dev)
            tkc.launch(xx, s2, e2, out, nt=nt, cs=1, small=True)
            ok &= not topk_errors(out, xx, s2, e2)
    print("top_k_per_row (cuda backend, all paths) multisets equal:", ok)
    return ok


def _gluon_unavailable(dev, what: str) -> bool:
    """Whether the Gluon backend cannot run here (then said, and the kernel's check counts as passed)."""
    from sparse_indexer import backends

    why = backends.get("gluon").unavailable_reason(torch.device(dev))
    if why:
        print(f"gluon {what}: not available:", why)
    return bool(why)


def _gluon_verdict(what: str, got: torch.Tensor, ref: torch.Tensor, clean: bool, tol: float) -> bool:
    """``got`` (filled with 7777 before the call) against the float32 reference ``ref`` (``-inf`` outside the
    windows): relative L2 within ``tol``, the same ``-inf`` cells, and with ``clean=False`` the cells outside the
    windows untouched (7777 in ``got``'s dtype). Prints one line."""
    err, mask_bad = logits_error(got.float(), ref, clean=clean)
    inside = ref != float("-inf")
    sentinel = float(torch.tensor(7777.0, dtype=got.dtype))
    untouched = clean or bool((got.float()[~inside] == sentinel).all())
    print(f"gluon {what} clean={clean}: rel L2 {err:.2e}, -inf cells that differ {mask_bad}, outside untouched "
          f"{untouched}")
    return mask_bad == 0 and err <= tol and untouched


def _gluon_paged(dev) -> bool:
    """The Gluon paged-logits kernel (sparse_indexer/ops/fp8_paged_mqa_logits/gluon.py): next_n 1..4,
    ragged lengths (0, 1, non-multiples of 64), clean on and off, against the reference backend."""
    if _gluon_unavailable(dev, "paged logits"):
        return True
    g = torch.Generator(device=dev).manual_seed(7)
    h, d, bs = 64, 128, 64
    lens = [300, 1, 0, 2100, 64]
    b = len(lens)
    max_blocks = (max(lens) + bs - 1) // bs + 1
    nb = b * max_blocks + 3
    kv = si.new_kv_cache(nb, bs, d, device=dev)
    vals, scales = si.cache_views(kv, torch.float8_e4m3fn)
    vals.copy_((torch.randn(vals.shape, device=dev, generator=g) * 2).to(torch.float8_e4m3fn))
    scales.copy_(torch.rand(nb, bs, device=dev, generator=g) * 0.01)
    bt = torch.randperm(nb, device=dev, generator=g)[: b * max_blocks].view(b, max_blocks).int()
    cl = torch.tensor(lens, dtype=torch.int32, device=dev)
    ok = True
    for nn in (1, 2, 3, 4):
        q = torch.randn(b, nn, h, d, device=dev, generator=g).to(torch.float8_e4m3fn)
        w = torch.randn(b * nn, h, device=dev, generator=g)
        lr = si.fp8_paged_mqa_logits(q, kv, w, cl, bt, backend="reference")
        for clean in (True, False):
            lg = torch.full_like(lr, 7777.0)
            si.fp8_paged_mqa_logits(q, kv, w, cl, bt, out=lg, clean=clean, backend="gluon")
            ok &= _gluon_verdict(f"paged logits next_n={nn}", lg, lr, clean, 2e-4)
    return ok


def _gluon_prefill(dev) -> bool:
    """The Gluon ragged-logits kernel (sparse_indexer/ops/fp8_mqa_logits/gluon.py): windows of every
    kind (empty, ke < ks, full, a partial last tile, M not a multiple of the block), full and compressed rows,
    float32 and bfloat16 out, clean on and off, against the reference backend."""
    if _gluon_unavailable(dev, "prefill logits"):
        return True
    g = torch.Generator(device=dev).manual_seed(11)
    m, n, h, d = 131, 1000, 64, 128
    q = (torch.randn(m, h, d, device=dev, generator=g) * 2).to(torch.float8_e4m3fn)
    k = (torch.randn(n, d, device=dev, generator=g) * 2).to(torch.float8_e4m3fn)
    ksc = torch.rand(n, device=dev, generator=g) * 0.01
    w = torch.randn(m, h, device=dev, generator=g)
    j = torch.arange(m, device=dev)
    ks = (j * 3).int()
    ke = (j * 7 + 5).clamp(max=n).int()
    ke[::9] = ks[::9]
    ke[4::13] = ks[4::13] - 1
    ok = True
    for width in (None, 700):
        lr = torch.empty(m, width or n, device=dev)
        si.fp8_mqa_logits(q, k, ksc, w, ks, ke, out=lr, backend="reference", max_seqlen_k=width)
        for dt in (torch.float32, torch.bfloat16):
            for clean in (True, False):
                lg = torch.full_like(lr, 7777.0, dtype=dt)
                si.fp8_mqa_logits(q, k, ksc, w, ks, ke, out=lg, clean=clean, backend="gluon", max_seqlen_k=width)
                ok &= _gluon_verdict(f"prefill logits width={width} {dt}", lg, lr, clean,
                                     2e-4 if dt == torch.float32 else 4e-3)
    return ok


if __name__ == "__main__":
    sys.exit(main())
