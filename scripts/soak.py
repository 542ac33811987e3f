"""A serving soak: thousands of random indexer steps as an engine runs them, every ``--check-every``-th checked
against the reference backend, with the device and host memory watched.

Each step draws a batch and runs it on one layer pair (two ``sparse_attn_indexer`` calls sharing the step's
metadata, as every layer of a step does):

- *graph decode* (half the steps): a uniform decode batch of ``b`` requests padded to the smallest captured size
  ``G >= b`` (sizes 1, 4 and 16 are captured once, at warm-up). The padding requests have ``next_n`` keys in a
  block of their own and write nothing (slot -1). The new metadata's tensors, queries, weights and keys are
  copied into the captured ones, and the CUDA graph is replayed. On the CPU the same path runs eagerly.
- *mixed* (the other half): decode requests with 1 to ``next_n`` new tokens (packed when not uniform) and 0-2
  prefill requests, run eagerly. Long prefills are cut into chunks by the gather and logits caps.

The decode logits have a budget of ``decode_batch`` requests (``IndexerLimits.max_decode_logits_bytes``), so
large decode batches run in sub-batches, in the graphs too. The requests of a step get disjoint random blocks of
one paged cache. The cache keeps what earlier steps wrote; every step writes its new keys into it.

A checked step runs again on the reference backend from a copy of the cache taken before it, and must match:

- the cache bytes exactly;
- rows past the step's tokens ``-1``;
- every real row's selection, judged on float64-exact scores of the reference's gathered keys
  (:func:`sparse_indexer.testing.topk_errors` with ``threshold=True``: every selected key within ``rtol`` of the
  row's ``topk``-th largest score; ``rtol`` 1e-3 on a GPU, where tensor cores sum in another order, 1e-6 on the
  CPU).

Memory: after the warm-up steps (captures included), ``torch.cuda.memory_allocated()`` must be the same at every
step's end (the check's own tensors are freed before it is read), and the process's resident memory (VmRSS) may
grow by at most ``--rss-slack-mib`` from the end of the warm-up to the last step.

    PYTHONPATH=. python3 scripts/soak.py --steps 2000            # on a GPU: backend auto, CUDA graphs
    python scripts/soak.py --device cpu --steps 40 --small        # the CPU reference, eager, seconds

Prints progress every 10% and a summary. Exit status 0 when every check passed and memory stayed flat, 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed

import sparse_indexer as si  # noqa: E402
from buffers import IndexerLimits, allocate  # noqa: E402
from sparse_indexer.testing import topk_errors  # noqa: E402

FN = torch.float8_e4m3fn
GRAPH_SIZES = (1, 4, 16)


def limits(small: bool) -> IndexerLimits:
    """The engine's limits: V3.2's heads and top-k scaled to the run (``small``: the CPU's sizes)."""
    if small:
        return IndexerLimits(max_model_len=512, max_num_batched_tokens=256, max_num_seqs=16, next_n=2, n_heads=8,
                             head_dim=64, topk=32, block_size=16, prefill_k_tokens=640,
                             max_logits_bytes=4 * 64 * 512, max_decode_logits_bytes=4 * 2 * 512 * 6)
    return IndexerLimits(max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=32, next_n=2, n_heads=64,
                         head_dim=128, topk=512, block_size=64, prefill_k_tokens=16384,
                         max_logits_bytes=4 * 512 * 8192, max_decode_logits_bytes=4 * 2 * 8192 * 8)


def rss_mib() -> float:
    """This process's resident memory (VmRSS), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class World:
    """One paged cache (block 0 reserved for the padding requests) and the step's random draws."""

    def __init__(self, lim: IndexerLimits, device: torch.device, rng: random.Random, backend: str | None):
        self.lim, self.dev, self.rng, self.backend = lim, device, rng, backend
        self.g = torch.Generator().manual_seed(rng.randrange(2**62))  # block tables
        self.gd = torch.Generator(device=device).manual_seed(rng.randrange(2**62))  # values, drawn where they live
        self.max_blocks = math.ceil(lim.max_model_len / lim.block_size)
        self.nb = lim.max_num_seqs * self.max_blocks + 1
        self.kv = si.new_kv_cache(self.nb, lim.block_size, lim.head_dim, device=device)
        n = self.nb * lim.block_size
        si.write_k_cache(torch.randn(n, lim.head_dim, generator=self.gd, device=device), self.kv,
                         torch.arange(n, device=device), backend=backend)

    def batch(self, seq: list[int], qry: list[int], pad: int = 0, pad_rows: int = 0):
        """Inputs of a step of requests ``seq``/``qry`` (context lengths, new tokens) followed by ``pad`` padding
        requests and ``pad_rows`` padding tokens (rows past the metadata's): ``(q [T, H, D], k [T, D], w [T, H],
        metadata, block_table)``."""
        lim, g, bs = self.lim, self.g, self.lim.block_size
        perm = torch.randperm(self.nb - 1, generator=g)[: len(seq) * self.max_blocks] + 1
        table = perm.view(len(seq), self.max_blocks).int()
        seq, qry = list(seq) + [lim.next_n] * pad, list(qry) + [lim.next_n] * pad
        table = torch.cat([table, torch.zeros(pad, self.max_blocks, dtype=torch.int32)])  # padding: block 0
        t = sum(qry)
        pos = torch.cat([torch.arange(s - n, s) for s, n in zip(seq, qry)])
        req = torch.cat([torch.full((n,), r) for r, n in enumerate(qry)])
        slots = table[req, pos // bs].long() * bs + pos % bs
        slots[sum(qry[: len(qry) - pad]):] = -1  # padding requests write nothing
        h, d, gd, dev = lim.n_heads, lim.head_dim, self.gd, self.dev
        q = (torch.randn(t + pad_rows, h, d, generator=gd, device=dev) * 2).to(FN)
        k = torch.randn(t + pad_rows, d, generator=gd, device=dev).to(torch.bfloat16)
        w = torch.randn(t + pad_rows, h, generator=gd, device=dev) / math.sqrt(h * d)
        md = si.build_metadata(seq, qry, table.to(dev), slots.to(dev), lim, num_blocks=self.nb)
        return q, k, w, md, table

    def decode_lens(self, b: int, uniform: bool) -> tuple[list[int], list[int]]:
        lim, rng = self.lim, self.rng
        qry = [lim.next_n if uniform else rng.randint(1, lim.next_n) for _ in range(b)]
        seq = [rng.choice((n, n + 1, lim.topk, lim.topk + 1, rng.randint(n, lim.max_model_len), lim.max_model_len))
               for n in qry]
        return seq, qry


class GraphDecode:
    """A uniform decode batch of ``size`` requests captured once (a CUDA graph on a GPU), replayed with new
    inputs copied into its tensors."""

    def __init__(self, world: World, bufs, size: int):
        self.world, self.size = world, size
        lim = world.lim
        seq, qry = world.decode_lens(size, uniform=True)
        self.q, self.k, self.w, self.md, _ = world.batch(seq, qry)
        self.bufs = bufs
        self.out = torch.full((size * lim.next_n, lim.topk), -7, dtype=torch.int32, device=world.dev)
        self.graph = None
        self._run()  # warm-up (first compiles outside the capture)
        if world.dev.type == "cuda":
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._run()
            torch.cuda.synchronize()

    def _run(self) -> None:
        for _ in range(2):  # two layers of one step
            si.sparse_attn_indexer(self.q, self.k, self.w, self.world.kv, self.md, self.bufs, self.out,
                                   backend=self.world.backend)

    def replay(self, q, k, w, md) -> torch.Tensor:
        """Copy a new padded batch (same shapes) into the captured tensors and replay; returns the output."""
        mine, new = self.md.tensors(), md.tensors()
        if mine.keys() != new.keys() or any(mine[n].shape != new[n].shape for n in mine):
            raise AssertionError(f"a padded batch of {self.size} does not have the captured metadata's shapes")
        for n, t in new.items():
            mine[n].copy_(t)
        self.q.copy_(q), self.k.copy_(k), self.w.copy_(w)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run()
        return self.out


def check_step(world: World, kv_before: torch.Tensor, q, k, w, md, table, seq, qry, got: torch.Tensor,
               rtol: float) -> list[str]:
    """The step again on the reference backend from ``kv_before``; what differs (see the module docstring).
    ``seq``/``qry`` are the real requests only (a padded graph decode's padding requests come after them)."""
    lim = world.lim
    kv_ref = kv_before.clone()
    bufs = allocate(lim, world.dev)
    want = torch.full_like(got, -7)
    for _ in range(2):
        si.sparse_attn_indexer(q, k, w, kv_ref, md, bufs, want, backend="reference")
    errors = []
    if not torch.equal(kv_ref, world.kv):
        errors.append(f"cache: {int((kv_ref != world.kv).sum())} bytes differ from the reference's")
    if not bool((got[md.num_tokens:] == -1).all()):
        errors.append("padding rows (past the metadata's tokens) are not -1")
    if not torch.equal(got[md.num_tokens:], want[md.num_tokens:]):
        errors.append("padding rows differ from the reference's")
    row = 0
    for r, (s, nq) in enumerate(zip(seq, qry)):
        out_k = torch.empty(s, lim.head_dim, dtype=FN, device=world.dev)
        out_s = torch.empty(s, device=world.dev)
        cu = torch.tensor([0, s], dtype=torch.int32, device=world.dev)
        si.gather_k_cache(kv_ref, table[r : r + 1].to(world.dev), cu, out_k=out_k, out_scale=out_s,
                          backend="reference")
        keys = out_k.double() * out_s.double()[:, None]
        scores = torch.empty(nq, s, dtype=torch.float64, device=world.dev)
        for j in range(0, nq, 32):  # float64 scores, 32 tokens at a time (their [32, H, s] products)
            qq, ww = q[row + j : row + min(nq, j + 32)].double(), w[row + j : row + min(nq, j + 32)].double()
            scores[j : j + 32] = (torch.relu(torch.einsum("thd,nd->thn", qq, keys)) * ww[:, :, None]).sum(1)
        ends = torch.tensor([s - nq + j + 1 for j in range(nq)])
        errs = topk_errors(got[row : row + nq].cpu(), scores.cpu(), torch.zeros_like(ends), ends, rtol=rtol,
                           threshold=True, limit=1)
        errors += [f"request {r} (context {s}, {nq} new): {e}" for e in errs]
        row += nq
    return errors


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--check-every", type=int, default=10)
    p.add_argument("--warmup", type=int, default=None, help="steps before memory is watched (default: 5%%, >= 10)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: %(default)s)")
    p.add_argument("--backend", default=None, help="the steps' backend (default: auto on a GPU, reference on the CPU)")
    p.add_argument("--small", action="store_true", help="the CPU's sizes (default on the CPU)")
    p.add_argument("--seed", type=int, default=20261202)
    p.add_argument("--rss-slack-mib", type=float, default=32.0)
    a = p.parse_args(argv)
    dev = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if a.device == "auto" else a.device))
    cuda = dev.type == "cuda"
    small = a.small or not cuda
    backend = a.backend if a.backend not in (None, "auto") else (None if cuda else "reference")
    rtol = 1e-3 if cuda and backend != "reference" else 1e-6
    warmup = a.warmup if a.warmup is not None else max(10, a.steps // 20)
    rng = random.Random(a.seed)
    lim = limits(small)
    print(f"soak: {a.steps} steps on {dev} ({torch.cuda.get_device_name(dev) if cuda else 'CPU'}), backend "
          f"{backend or 'auto'}, {'small' if small else 'full'} limits (max_model_len {lim.max_model_len}, H "
          f"{lim.n_heads}, topk {lim.topk}, decode sub-batches of {lim.decode_batch}), every {a.check_every}th "
          f"step checked, seed {a.seed}", flush=True)
    world = World(lim, dev, rng, backend)
    bufs = allocate(lim, dev)
    graphs = {gs: GraphDecode(world, bufs, gs) for gs in GRAPH_SIZES if gs <= lim.max_num_seqs}
    if cuda:
        torch.cuda.synchronize()
    kinds = {"graph": 0, "mixed": 0, "sub-batched": 0, "chunked": 0}
    failures: list[str] = []
    mem0 = rss0 = None
    mem_bad = 0
    t0 = time.perf_counter()
    checked = 0
    out = torch.full((lim.max_num_batched_tokens, lim.topk), -7, dtype=torch.int32, device=dev)
    for i in range(a.steps):
        check = i % a.check_every == a.check_every - 1
        if rng.random() < 0.5:  # a padded graph decode
            b = rng.randint(1, max(graphs))
            gs = min(x for x in graphs if x >= b)
            seq, qry = world.decode_lens(b, uniform=True)
            q, k, w, md, table = world.batch(seq, qry, pad=gs - b)
            kv_before = world.kv.clone() if check else None
            got = graphs[gs].replay(q, k, w, md)
            kinds["graph"] += 1
            kinds["sub-batched"] += gs > lim.decode_batch
        else:  # a mixed step, eager
            nd = rng.randint(0, lim.max_num_seqs - 2)
            seq, qry = world.decode_lens(nd, uniform=rng.random() < 0.3)
            room = lim.max_num_batched_tokens - 3 - sum(qry)  # 3: the padding rows
            for _ in range(rng.randint(0 if nd else 1, 2)):
                if room <= lim.next_n:
                    break
                nq = rng.randint(lim.next_n + 1, min(room, lim.max_num_batched_tokens // 2))
                seq.append(rng.randint(nq, lim.max_model_len))
                qry.append(nq)
                room -= nq
            if not seq:
                seq, qry = [lim.next_n], [lim.next_n]
            q, k, w, md, table = world.batch(seq, qry, pad_rows=rng.randint(0, 3))
            kv_before = world.kv.clone() if check else None
            got = out[: q.shape[0]]
            for _ in range(2):
                si.sparse_attn_indexer(q, k, w, world.kv, md, bufs, got, backend=backend)
            kinds["mixed"] += 1
            kinds["sub-batched"] += md.decode is not None and md.decode.num_reqs > lim.decode_batch
            kinds["chunked"] += len(md.prefill_chunks) > 1
        if cuda:
            torch.cuda.synchronize()
        if check:
            errs = check_step(world, kv_before, q, k, w, md, table, seq, qry, got, rtol)
            checked += 1
            for e in errs:
                failures.append(f"step {i}: {e}")
                print(f"  FAILED step {i}: {e}", flush=True)
            del kv_before
        del q, k, w, md, table, got
        if cuda:
            torch.cuda.synchronize()
        if i + 1 == warmup:
            mem0 = torch.cuda.memory_allocated(dev) if cuda else 0
            rss0 = rss_mib()
        elif mem0 is not None and cuda:
            now = torch.cuda.memory_allocated(dev)
            if now != mem0:
                mem_bad += 1
                if mem_bad <= 3:
                    print(f"  step {i}: device memory {now} B, after the warm-up {mem0} B", flush=True)
        if (i + 1) % max(1, a.steps // 10) == 0 or i + 1 == a.steps:
            print(f"  {i + 1}/{a.steps} steps, {time.perf_counter() - t0:.0f} s: {checked} checked, "
                  f"{len(failures)} failures, RSS {rss_mib():.0f} MiB"
                  + (f", device {torch.cuda.memory_allocated(dev) / 2**20:.1f} MiB" if cuda else ""), flush=True)
    rss1 = rss_mib()
    grew = rss1 - rss0 if rss0 is not None else 0.0
    print(f"\nsoak: {a.steps} steps in {time.perf_counter() - t0:.1f} s ({kinds['graph']} graph decodes at sizes "
          f"{sorted(graphs)}, {kinds['mixed']} mixed; {kinds['sub-batched']} sub-batched decodes, {kinds['chunked']} "
          f"steps of several prefill chunks); {checked} checked, {len(failures)} failures")
    print(f"memory after the warm-up ({warmup} steps): device "
          + (f"{mem0} B, different at {mem_bad} step ends" if cuda else "n/a (CPU)")
          + f"; host RSS {rss0:.1f} -> {rss1:.1f} MiB ({grew:+.1f}, slack {a.rss_slack_mib})")
    ok = not failures and mem_bad == 0 and grew <= a.rss_slack_mib
    print("soak passed" if ok else "soak FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
