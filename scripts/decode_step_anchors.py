# ruff: noqa: B023  (the timed closures run within their loop iteration)
"""The decode step's two kernels beside the engine's: ours (``fp8_paged_mqa_logits`` under ``auto``, then the CUDA
``top_k_per_row``) against DeepGEMM's paged logits and vLLM's top-k, on the same inputs, each pair replayed from a
CUDA graph (``triton.testing.do_bench`` medians, L2 flushed), with each kernel alone beside it; the CUDA paged
logits are timed alone too.

Usage on an NVIDIA Hopper GPU, with vLLM's top-k kernels (a prebuilt ``vllm_topk.py`` and its shared library, the
measuring instrument the benchmarks use) in a git-ignored folder and DeepGEMM built from source on its path::

    PYTHONPATH=/tmp/dg_site:. python3 scripts/decode_step_anchors.py --anchors .anchors/vllm_topk

Without DeepGEMM importable the DeepGEMM columns are left out (said once). ``--logits-sweep`` (no anchors
needed) times instead the Triton, Gluon and CUDA paged logits alone, graphed, on the shapes behind ``auto``'s
thresholds (Gluon's ``AUTO_MIN_KEY_BLOCKS_GRAPHED``, the CUDA kernel's ``AUTO_MIN_KEY_BLOCKS`` at H = 32), with each
one's host time per eager call. vLLM's top-k is its cooperative
kernel for at most 16 rows and its persistent one above (vLLM's own choice on Hopper). The Gluon and Triton
logits are timed alone too (``auto`` runs Gluon in a graph from 8192 key blocks). Each of our selections is
checked against the top-k of the logits it read (exits 1 on a mismatch); the anchors' outputs are not checked.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fused_decode_topk import bench, make  # noqa: E402

from sparse_indexer import fp8_paged_mqa_logits, row_limits, top_k_per_row  # noqa: E402
from sparse_indexer.testing import capture_cuda_graph, logits_error, topk_errors  # noqa: E402

CASES = [  # (B, next_n, H, keys per request, topk)
    (64, 1, 64, 16384, 512), (64, 2, 64, 16384, 512), (64, 1, 64, 16384, 1024), (32, 1, 64, 16384, 512),
    (128, 1, 64, 8192, 512), (1, 1, 64, 16384, 512), (64, 1, 64, 65536, 2048), (64, 2, 64, 65536, 2048),
    (16, 2, 64, 65536, 2048), (1, 1, 64, 65536, 2048), (16, 1, 64, 65536, 2048)]


SWEEP = [  # (B, next_n, H, keys per request)
    (1, 1, 64, 65536), (4, 1, 64, 65536), (16, 1, 64, 65536), (32, 1, 64, 65536), (1, 1, 64, 16384),
    (16, 1, 64, 16384), (32, 1, 64, 16384), (64, 1, 64, 16384), (64, 2, 64, 16384), (32, 2, 64, 16384),
    (48, 1, 64, 16384), (96, 1, 64, 16384), (128, 1, 64, 16384), (64, 1, 64, 8192), (128, 1, 64, 8192),
    (8, 2, 64, 65536), (16, 2, 64, 65536), (32, 1, 64, 32768), (64, 1, 64, 32768), (256, 1, 64, 4096),
    (64, 1, 64, 4096), (64, 1, 64, 65536), (64, 2, 64, 65536),
    (64, 1, 32, 65536), (64, 2, 32, 65536), (64, 2, 32, 16384), (128, 2, 32, 8192), (16, 2, 32, 65536),
    (8, 2, 32, 65536), (1, 2, 32, 65536), (64, 1, 32, 16384), (16, 1, 32, 65536)]


def logits_sweep() -> int:
    """The Triton, Gluon and CUDA paged logits alone on :data:`SWEEP` (each where it takes the shape; Gluon: H = 64
    only): graphed device time and eager host time per call, each checked against the Triton kernel's (relative L2
    of the in-window cells)."""
    dev = torch.device("cuda")
    bad = 0
    for (B, nn, H, L) in SWEEP:
        q4, cache, w, cl, bt = make(B, nn, H, L)
        lg = torch.empty(B * nn, bt.shape[1] * 64, device=dev)
        ref = torch.empty_like(lg)
        fp8_paged_mqa_logits(q4, cache, w, cl, bt, out=ref, clean=True, backend="triton")
        res = {}
        for be in ("triton", "gluon", "cuda"):
            def fn():
                fp8_paged_mqa_logits(q4, cache, w, cl, bt, out=lg, clean=False, backend=be)

            try:
                fn()
            except NotImplementedError:
                continue
            res[be] = bench(capture_cuda_graph(fn).replay)
            fp8_paged_mqa_logits(q4, cache, w, cl, bt, out=lg, clean=True, backend=be)
            err, mask_bad = logits_error(lg, ref)
            bad += not (err < 2e-4 and mask_bad == 0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            res[be + " host"] = (time.perf_counter() - t0) / 200 * 1e6
            torch.cuda.synchronize()
        print(f"B={B} next_n={nn} H={H} keys={L} key blocks={B * nn * bt.shape[1]}: "
              + " ".join(f"{k}={v:.1f}" for k, v in res.items()), flush=True)
    print("bad:", bad, flush=True)
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--anchors", help="the folder holding vllm_topk.py (vLLM's top-k kernels, prebuilt)")
    ap.add_argument("--logits-sweep", action="store_true", help="the Gluon and Triton logits alone (no anchors)")
    args = ap.parse_args()
    if args.logits_sweep:
        return logits_sweep()
    if args.anchors is None:
        ap.error("--anchors DIR is needed (or --logits-sweep)")
    sys.path.insert(0, args.anchors)
    import vllm_topk as V

    try:
        import deep_gemm as DG
    except ImportError as e:
        DG = None
        print(f"DeepGEMM does not import ({e}): its columns are left out", flush=True)
    dev = torch.device("cuda")
    bad = 0
    for (B, nn, H, L, topk) in CASES:
        q4, cache, w, cl, bt = make(B, nn, H, L)
        rows = B * nn
        W = bt.shape[1] * 64
        lg = torch.empty(rows, W, device=dev)
        lim = row_limits(cl, nn).int()
        z = torch.zeros_like(lim)
        out = torch.empty(rows, topk, dtype=torch.int32, device=dev)

        def ours():
            fp8_paged_mqa_logits(q4, cache, w, cl, bt, out=lg, clean=False)
            top_k_per_row(lg, z, lim, out=out)

        ours()
        fp8_paged_mqa_logits(q4, cache, w, cl, bt, out=lg, clean=False, backend="gluon")  # (compile outside)
        graph = capture_cuda_graph(ours)
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        lgm = torch.where(torch.arange(W, device=dev)[None, :] < lim[:, None], lg, float("-inf"))
        errs = topk_errors(out, lgm, z, lim, limit=2)
        bad += bool(errs)
        res = {"ours": bench(graph.replay)}
        for be in ("gluon", "triton", "cuda"):
            try:
                g = capture_cuda_graph(lambda: fp8_paged_mqa_logits(q4, cache, w, cl, bt, out=lg, clean=False,
                                                                    backend=be))
            except NotImplementedError:
                continue
            res[f"logits[{be}]"] = bench(g.replay)
        res["top-k"] = bench(capture_cuda_graph(lambda: top_k_per_row(lg, z, lim, out=out)).replay)
        vout = torch.empty_like(out)
        vtopk = V.cooperative if rows <= 16 else V.persistent
        if DG is not None:
            kv4 = cache.view(cache.shape[0], 64, 1, 132)  # our cache is DeepGEMM's layout
            ctx = (cl[:, None] if nn == 1 else torch.stack([cl - nn + 1 + j for j in range(nn)], 1)).int().contiguous()
            sched = DG.get_paged_mqa_logits_metadata(ctx, 64, DG.get_num_sms())

            def engine():
                vtopk(DG.fp8_paged_mqa_logits(q4, kv4, w, ctx, bt, sched, W, False), lim, vout)

            engine()
            res["DeepGEMM+vLLM"] = bench(capture_cuda_graph(engine).replay)
            res["DeepGEMM logits"] = bench(capture_cuda_graph(
                lambda: DG.fp8_paged_mqa_logits(q4, kv4, w, ctx, bt, sched, W, False)).replay)
        vtopk(lg, lim, vout)
        res["vLLM top-k"] = bench(capture_cuda_graph(lambda: vtopk(lg, lim, vout)).replay)
        print(f"B={B} next_n={nn} H={H} keys={L} topk={topk}: " + " ".join(f"{k}={v:.1f}" for k, v in res.items())
              + ("" if not errs else f" MISMATCH {errs[:1]}"), flush=True)
    print("bad:", bad, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
