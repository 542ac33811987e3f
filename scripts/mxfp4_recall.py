"""Selection quality of MXFP4 indexer keys and queries against FP8 (docs/benchmarks.md, "MXFP4 selection quality").

For the same bfloat16 queries and keys, quantized once to FP8 (e4m3fn, UE8M0 scales, the query scale folded into
the weights) and once to MXFP4 (docs/spec.md §3a), both ragged logits ops (reference backend) score every key,
and the script prints, per value distribution and top-k size, the fraction of the FP8 top-k that the MXFP4 top-k
recovers, and the fraction of the exact (float64, unquantized) top-k each recovers.

Usage: ``python3 scripts/mxfp4_recall.py [--keys N] [--rows M] [--device cpu|cuda] [--seed S]`` (default 16384 keys,
8 query rows, H = 64, D = 128, on the CPU in about a minute).
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed

import sparse_indexer as si  # noqa: E402

H, D = 64, 128


def inputs(dist: str, m: int, n: int, g: torch.Generator, dev: str):
    """Queries ``[m, H, D]``, keys ``[n, D]`` and head weights ``[m, H]`` (float32) of one distribution."""
    if dist == "gaussian":
        q = torch.randn(m, H, D, generator=g)
        k = torch.randn(n, D, generator=g)
    elif dist == "low-rank":  # keys near a few directions the queries share, plus noise
        basis = torch.randn(8, D, generator=g)
        k = torch.randn(n, 8, generator=g) @ basis + 0.3 * torch.randn(n, D, generator=g)
        q = torch.randn(m, H, 8, generator=g) @ basis + 0.3 * torch.randn(m, H, D, generator=g)
    elif dist == "outlier-channels":  # a few channels 20x larger, as in transformer activations
        scale = torch.ones(D)
        scale[torch.randperm(D, generator=g)[:4]] = 20.0
        q = torch.randn(m, H, D, generator=g) * scale
        k = torch.randn(n, D, generator=g) * scale
    else:
        raise ValueError(dist)
    w = torch.randn(m, H, generator=g) * H ** -0.5 * D ** -0.5
    return q.to(torch.bfloat16).to(dev), k.to(torch.bfloat16).to(dev), w.to(dev)


def scores(q, k, w):
    """(exact float64, FP8, MXFP4) scores ``[m, n]`` of every key."""
    m, n = q.shape[0], k.shape[0]
    ks = torch.zeros(m, dtype=torch.int32, device=q.device)
    ke = torch.full((m,), n, dtype=torch.int32, device=q.device)
    exact = (w.double()[:, :, None] * torch.relu(torch.einsum("mhd,nd->mhn", q.double(), k.double()))).sum(1)
    q8, qs8 = si.quantize_q(q)
    k8, ks8 = si.quantize_k(k)
    fp8 = si.fp8_mqa_logits(q8, k8, ks8, w * qs8, ks, ke, backend="reference")
    qv, qs = si.quantize_q_mxfp4(q)
    kv, kscale = si.quantize_k_mxfp4(k)
    mx = si.fp8_mqa_logits(qv, kv, kscale, w, ks, ke, q_scale=qs, backend="reference")
    return exact, fp8, mx


def recall(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    """Mean over rows of |top-k(a) & top-k(b)| / k."""
    ta = a.topk(k, dim=1).indices
    tb = b.topk(k, dim=1).indices
    hit = torch.zeros(a.shape, dtype=torch.bool, device=a.device).scatter_(1, ta, True).gather(1, tb)
    return hit.float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    print(f"{args.rows} query rows x {args.keys} keys, H = {H}, D = {D}, seed {args.seed}")
    print("| distribution | k | MXFP4 recovers of FP8 top-k | FP8 of exact | MXFP4 of exact |")
    print("|---|---:|---:|---:|---:|")
    for dist in ("gaussian", "low-rank", "outlier-channels"):
        q, k, w = inputs(dist, args.rows, args.keys, g, args.device)
        exact, fp8, mx = scores(q, k, w)
        for top in (512, 2048):
            print(f"| {dist} | {top} | {recall(fp8, mx, top):.3f} | {recall(exact, fp8.double(), top):.3f} | "
                  f"{recall(exact, mx.double(), top):.3f} |", flush=True)


if __name__ == "__main__":
    main()
