"""``python -m sparse_indexer bench``: time every op on every backend, side by side, against measured floors.

One run measures the Triton backend, the reference backend on the same device and aiter (where installed) on

* decode logits (``fp8_paged_mqa_logits``, ``clean=False`` as the indexer step uses): ``(B, next_n, L)`` in
  ``(64, 1, 64K), (64, 2, 64K), (128, 1, 32K), (256, 1, 16K), (32, 1, 128K)``, ``H=64, D=128``, block 64;
* prefill logits (``fp8_mqa_logits``, ``clean=False``): 8K queries, causal over 8K and 64K keys (query ``j``
  of ``M`` attends keys ``[0, N - M + j + 1)``);
* top-k (``top_k_per_row``, topk 2048): decode 64 x 64K (full rows, ragged windows, with the planned workspace
  as the step passes it and without), 16 x 64K, 1 x 64K; prefill 8K x 64K (tail windows ``[0, 56K + j]`` and
  causal ``[0, 8 (j + 1))``) and 8K x 8K causal; 64 x 64K on every value distribution of
  :data:`TOPK_DISTRIBUTIONS`;
* the decode step (``indexer_decode``: paged logits + top-k as the step runs them), eager and replayed in a CUDA
  graph: ``(B, next_n, L)`` in ``(64, 1, 64K), (64, 2, 64K), (256, 1, 16K), (64, 1, 16K), (64, 2, 16K),
  (1, 1, 64K), (4, 1, 64K), (16, 1, 64K)``; a backend of some ops means ``auto`` there (``cuda``: the Gluon or
  Triton logits ``auto`` picks, CUDA top-k);
* ``write_k_cache`` and ``gather_k_cache`` of 64K tokens.

The cases of each op live beside it (``sparse_indexer/ops/<op>/bench.py``: ``specs(smoke)``, ``build(spec, ctx)``,
on the shared case interface of ``sparse_indexer/commands/bench_cases.py``); this module holds the decode step's cases,
the timer, the floors, the CLI and the reports. The backends are the registry's (``sparse_indexer.backends``).

``--anchors DIR`` times other projects' kernels beside ours on the same inputs, as measuring instruments never
imported otherwise: vLLM's CUDA top-k kernels (``DIR/vllm_topk.py``) on the top-k cases, and DeepGEMM's logits
kernels (``deep_gemm``, when it imports: build it from source and put it on ``PYTHONPATH``) on the decode and
prefill cases it takes (H 32/64, next_n 1-2, float32 full logits).

Each row holds the median time (CUDA events around the op only, L2 flushed by zeroing a 256 MiB buffer before
every iteration), the achieved TB/s or TFLOP/s of the op's traffic/FLOP model and its fraction of a floor
measured in the same run (a device-to-device copy for bandwidth, an FP8 ``torch._scaled_mm`` for compute),
and a spot check of the output against the reference backend on a subset of rows. The table goes to stdout;
``--out`` receives ``results.md``, ``results.json`` and ``results.png`` (matplotlib, when installed).

``--device`` defaults to ``auto``: the GPU when one is visible, else the CPU (the first line says which). ``--smoke``
uses tiny shapes and also runs on the CPU (``time.perf_counter``, no L2 flush); it is a quick run (seconds for the
case table, under a minute for each sweep on a 2-core CPU): iterations, warmup and reference iterations default
to their minimum (:data:`SMOKE_TIMING`) unless given. On a device without CUDA graphs (the CPU) the decode step's
CUDA-graph cases are left out (said once); they need a CUDA device.

``--sweep topk|logits`` runs a kernel sweep instead of the case table, on the same timer and floors
(:data:`SWEEPS`: ``ops/top_k_per_row/sweep.py``: the CUDA top-k's launch configurations checked and timed beside
Triton, vLLM's kernels and ``torch.topk``, and the decode step; ``ops/fp8_paged_mqa_logits/sweep.py``: the Triton
logits kernels checked against float64 and their configurations timed); ``--sections`` picks parts of it,
``--configs`` the top-k launch configurations. It writes ``sweep-<name>.md`` and ``sweep-<name>.json`` to
``--out``. On the CPU the logits sweep runs the Triton kernels in Triton's interpreter (``TRITON_INTERPRET=1`` is
set for the process, as ``check`` does).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import backends as _registry
from .._runtime.dispatch import BackendUnavailable, unavailable_reason
from ..fp8 import fp8_name
from ..ops._aiter import native_fp8
from ..ops.fp8_mqa_logits import bench as prefill_cases
from ..ops.fp8_paged_mqa_logits import bench as decode_cases
from ..ops.fp8_paged_mqa_logits import sweep as logits_sweep
from ..ops.gather_k_cache import bench as gather_cases
from ..ops.select_candidate_blocks import bench as candidate_cases
from ..ops.top_k_per_row import bench as topk_cases
from ..ops.top_k_per_row import sweep as topk_sweep
from ..ops.write_k_cache import bench as write_cases
from ..testing import capture_cuda_graph
from .bench_cases import LOGITS_RTOL, Case, CaseSpec, Ctx, SweepEnv, k_str, spread, topk_verdict
from .cli import UsageError, auto_device_note, resolve_device, use_triton_interpreter

__all__ = ["SWEEPS", "CaseSpec", "add_arguments", "case_specs", "run", "timing_options"]

GROUPS = ("decode", "prefill", "topk", "step", "cache", "candidates")
# a partial backend runs a group if it has this op
CASE_OPS = {"decode": "fp8_paged_mqa_logits", "prefill": "fp8_mqa_logits", "topk": "top_k_per_row",
            "step": "top_k_per_row", "cache": "write_k_cache", "candidates": "select_candidate_blocks"}
CASE_MODULES = {"decode": {"": decode_cases}, "prefill": {"": prefill_cases}, "topk": {"": topk_cases},
                "cache": {"write": write_cases, "gather": gather_cases}, "candidates": {"": candidate_cases}}
"""The modules of each group's cases (``ops/<op>/bench.py``: ``specs(smoke)``, ``build(spec, ctx)``), by the
``op`` parameter of their specs; the step's cases are :class:`StepCase`."""
SWEEPS = {"topk": topk_sweep, "logits": logits_sweep}
"""The kernel sweeps of ``--sweep NAME`` (each ``run(SweepEnv) -> (rows, results)``, ``SECTIONS``)."""
TOPK_DISTRIBUTIONS = topk_cases.TOPK_DISTRIBUTIONS
L2_FLUSH_BYTES = 256 << 20
TIMING = dict(iters=30, warmup=5, ref_iters=3)
"""``--iters``, ``--warmup`` and ``--ref-iters`` by default."""
SMOKE_TIMING = dict(iters=1, warmup=0, ref_iters=1)
"""The same under ``--smoke``, unless given: the fewest that run every row once (a quick check of the bench)."""
GRAPHS_NEED_CUDA = "the decode step's CUDA-graph cases are left out: CUDA graphs need a CUDA device"


# --------------------------------------------------------------------------------------------- cases


def case_specs(smoke: bool = False, graphs: bool = True) -> list[CaseSpec]:
    """The cases of a full run (or of ``--smoke``), in run order: each op's (from ``ops/<op>/bench.py``) and the
    decode step's (eager, and replayed from a CUDA graph unless ``graphs`` is false)."""
    step = ([(2, 1, 4096), (2, 2, 4096)] if smoke else
            [(64, 1, 65536), (64, 2, 65536), (256, 1, 16384), (64, 1, 16384), (64, 2, 16384), (1, 1, 65536),
             (4, 1, 65536), (16, 1, 65536)])
    steps = [CaseSpec("step", f"step-{how}-{b}x{n}x{k_str(seq)}", f"step ({how}) B={b} next_n={n} L={seq}",
                      dict(B=b, next_n=n, L=seq, graph=graph))
             for graph, how in ((False, "eager"), (True, "graph")) for b, n, seq in step if graphs or not graph]
    specs = []
    for group in GROUPS:
        if group == "step":
            specs += steps
        else:
            for mod in CASE_MODULES[group].values():
                specs += mod.specs(smoke)
    return specs


class StepCase(Case):
    """The decode step as ``indexer_decode`` runs it (paged logits into ``Buffers.logits``, top-k with
    ``Buffers.topk_scratch``), eager or replayed from a CUDA graph captured once per backend. Traffic model:
    the decode logits' bytes plus the logits read again by the top-k."""

    def __init__(self, ctx: Ctx, B: int, next_n: int, L: int, graph: bool):  # noqa: N803
        from buffers import IndexerLimits, allocate

        from ..indexer import indexer_decode
        from ..metadata import build_metadata

        dev, bs = ctx.device, ctx.block_size
        self.graph = graph and dev.type == "cuda"
        self.note = "CUDA graph replay" if self.graph else "eager"
        self.logits_case = decode_cases.DecodeCase(ctx, B, next_n, L)
        lc = self.logits_case
        lim = IndexerLimits(max_model_len=L, max_num_batched_tokens=B * next_n, max_num_seqs=B, next_n=next_n,
                            n_heads=ctx.heads, head_dim=ctx.head_dim, block_size=bs, topk=2048 if L >= 8192 else 256,
                            prefill_k_tokens=L, max_logits_bytes=B * next_n * lc.out.shape[1] * 4, fp8_dtype=ctx.fp8)
        self.bufs = allocate(lim, dev)
        lc.out = None  # the step writes Buffers.logits
        pos = torch.cat([torch.arange(L - next_n, L) for _ in range(B)])
        req = torch.arange(B).repeat_interleave(next_n)
        bt = lc.block_table.cpu().long()
        slots = (bt[req, pos // bs] * bs + pos % bs).to(dev)
        self.md = build_metadata([L] * B, [next_n] * B, lc.block_table, slots, lim)
        self.q = lc.q.view(B * next_n, ctx.heads, ctx.head_dim)
        self.out = torch.empty(B * next_n, lim.topk, dtype=torch.int32, device=dev)
        self.rows = B * next_n
        self._decode = indexer_decode
        self._graphs = {}
        self.amount = lc.amount + float(int(lc.limits.sum()) * 4)

    def _step(self, backend):
        # a backend of some ops (cuda: top-k only) runs the step through auto (cuda: auto's logits, CUDA top-k)
        be = None if _registry.get(backend).ops is not None else backend
        if backend == "reference":
            self.note = "eager (the reference backend is not captured)"
        return lambda: self._decode(self.q, self.logits_case.weights, self.logits_case.cache, self.md, self.bufs,
                                    self.out, backend=be)

    def fn(self, backend):
        step = self._step(backend)
        if not self.graph or backend == "reference":
            return step
        if backend not in self._graphs:
            step()  # compile / load outside the capture
            self._graphs[backend] = capture_cuda_graph(step)
        return self._graphs[backend].replay

    def reset(self):
        self.out.fill_(-2)

    def check(self, backend):
        self.fn(backend)()  # one more step, then judge its selection on its own logits
        logits = self.bufs.logits_view(self.rows, self.md.decode.width)
        rows = spread(self.rows, 16, logits.device)
        s, e = self.md.decode.row_starts[rows], self.md.decode.row_ends[rows]
        return topk_verdict(self.out[rows], logits[rows], s, e)


def build_case(spec: CaseSpec, ctx: Ctx) -> Case:
    """The case of ``spec``, built by the module of its group (:data:`CASE_MODULES`) or the step's."""
    if spec.group == "step":
        p = spec.params
        return StepCase(ctx, p["B"], p["next_n"], p["L"], p["graph"])
    return CASE_MODULES[spec.group][spec.params.get("op", "")].build(spec, ctx)


# --------------------------------------------------------------------------------------------- timing


SLEEP_CYCLES = 1_000_000  # ~0.5 ms at 1.98 GHz: longer than the host's per-call overhead


L2_FLUSHES = {
    "zero": "zero_ of a 256 MiB buffer (as triton's do_bench and DeepGEMM's bench: leaves L2 full of dirty lines, "
            "which the timed op writes back)",
    "read": "a read of a 256 MiB buffer (L2 left clean)",
}
"""The ``--l2-flush`` methods. ``zero`` is the default (the published numbers were taken with it); on an H200 it
adds about 7 us (5%) to a 150 us memory-bound kernel and 1% to the 500 us copy that sets the bandwidth floor
(docs/benchmarks.md, "Method"), so ``read`` gives the fairer fraction of the floor."""


class Timer:
    """Median-of-N timing: CUDA events around the op only, L2 flushed before every iteration (GPU; ``flush``: a
    key of :data:`L2_FLUSHES`); ``time.perf_counter`` without a flush on the CPU."""

    def __init__(self, device: torch.device, flush: str = "zero"):
        if flush not in L2_FLUSHES:
            raise ValueError(f"flush must be one of {tuple(L2_FLUSHES)}, got {flush!r}")
        self.device = device
        self.gpu = device.type == "cuda"
        self.method = flush
        self.flush = None
        if self.gpu:
            dtype = torch.uint8 if flush == "zero" else torch.float32
            self.flush = torch.ones(L2_FLUSH_BYTES // dtype.itemsize, dtype=dtype, device=device)
            self._sink = torch.empty((), dtype=torch.float32, device=device)

    def flush_l2(self) -> None:
        """Evict what earlier work left in L2 (GPU), by :attr:`method`."""
        if self.method == "zero":
            self.flush.zero_()
        else:
            torch.sum(self.flush, dim=0, out=self._sink)

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize(self.device)

    def times_us(self, fn: Callable[[], object], iters: int, warmup: int) -> list[float]:
        iters = max(1, iters)
        for _ in range(max(0, warmup)):
            fn()
        self.sync()
        if not self.gpu:
            out = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                out.append((time.perf_counter() - t0) * 1e6)
            return out
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            # a GPU-side wait first, so the host enqueues the op before the GPU reaches the start event:
            # the time is the op's device time, not the host's launch overhead (as in triton's do_bench)
            torch.cuda._sleep(SLEEP_CYCLES)
            self.flush_l2()
            starts[i].record()
            fn()
            ends[i].record()
        self.sync()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]


def _copy_floor(ctx: Ctx, timer: Timer, iters: int) -> dict:
    nbytes = (1 << 30) if timer.gpu else (64 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    t = statistics.median(timer.times_us(lambda: dst.copy_(src), iters, 3))
    return dict(value=2 * nbytes / (t * 1e-6) / 1e12, unit="TB/s", median_us=t,
                how=f"device-to-device copy of {nbytes >> 20} MiB (read + write)")


def _mm_floor(ctx: Ctx, timer: Timer, iters: int) -> dict:
    n = 8192 if timer.gpu else 512
    a = torch.randn(n, n, device=ctx.device).to(ctx.fp8)
    b = torch.randn(n, n, device=ctx.device).to(ctx.fp8).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), dtype=torch.float32, device=ctx.device)
    best, detail = None, {}
    for fast in (False, True):
        try:
            f = lambda fast=fast: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                   use_fast_accum=fast)
            t = statistics.median(timer.times_us(f, iters, 3))
            tf = 2.0 * n ** 3 / (t * 1e-6) / 1e12
            detail[f"fast_accum={fast}"] = tf
            best = tf if best is None else max(best, tf)
        except Exception as e:  # noqa: BLE001
            detail[f"fast_accum={fast}"] = _err(e)
    how = f"torch._scaled_mm {fp8_name(ctx.fp8)} {n}x{n}x{n}, bf16 out, best of fast_accum off/on"
    res = dict(value=best, unit="TFLOP/s", how=how, detail=detail)
    if best is None:
        res["error"] = "; ".join(f"{k}: {v}" for k, v in detail.items())
    return res


def measure_floors(ctx: Ctx, timer: Timer, iters: int) -> dict:
    """Bandwidth floor (device-to-device copy, bytes read + written per second) and compute floor
    (FP8 ``torch._scaled_mm``, best of plain and fast accumulation) measured on this device now."""
    floors: dict = {}
    for name, unit, fn in (("bandwidth", "TB/s", _copy_floor), ("compute", "TFLOP/s", _mm_floor)):
        try:
            floors[name] = fn(ctx, timer, iters)
        except Exception as e:  # noqa: BLE001 - a floor that cannot be measured is reported, not fatal
            floors[name] = dict(value=None, unit=unit, how=fn.__name__, error=_err(e))
        _free(ctx.device)
    return floors


# --------------------------------------------------------------------------------------------- run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m sparse_indexer bench``."""
    from . import bench_host

    bench_host.add_arguments(parser)  # --host: host time per eager call (sparse_indexer/commands/bench_host.py)
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated groups ({','.join(GROUPS)}) or case keys "
                             "(e.g. decode-64x1x64K); default: all")
    parser.add_argument("--backends", default=None,
                        help=f"comma-separated subset of {','.join(_registry.names())}; default: all "
                             "(unavailable ones show as n/a with the reason)")
    smoke = "{} under --smoke"
    parser.add_argument("--iters", type=int, default=None,
                        help=f"timed iterations per row (default {TIMING['iters']}; "
                             f"{smoke.format(SMOKE_TIMING['iters'])})")
    parser.add_argument("--warmup", type=int, default=None,
                        help=f"warmup calls per row (default {TIMING['warmup']}; "
                             f"{smoke.format(SMOKE_TIMING['warmup'])})")
    parser.add_argument("--ref-iters", type=int, default=None,
                        help=f"timed iterations for the (slow) reference backend, at most --iters (default "
                             f"{TIMING['ref_iters']}, 1 warmup; {smoke.format(SMOKE_TIMING['ref_iters'])}, no warmup)")
    parser.add_argument("--skip-reference", action="store_true",
                        help="do not time the reference backend (it still serves the correctness checks)")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness spot checks")
    parser.add_argument("--l2-flush", choices=tuple(L2_FLUSHES), default="zero",
                        help="how L2 is flushed before each timed call on a GPU: zero (default: zero_ of 256 MiB, "
                             "as triton's do_bench; leaves dirty lines the op writes back) or read (a 256 MiB read: "
                             "L2 left clean)")
    parser.add_argument("--out", default="bench-out", help="output directory (default bench-out/)")
    parser.add_argument("--device", default="auto",
                        help="device to run on: auto (a GPU when one is visible, else the CPU; the first line says "
                             "which), cpu, cuda or cuda:N (default auto)")
    parser.add_argument("--smoke", action="store_true",
                        help="a quick run: tiny shapes (decode B=2 L=256, prefill 64x256, top-k 4x4096 topk 256, "
                             "cache 1K tokens) and the fewest iterations unless given (--iters 1 --warmup 0 "
                             "--ref-iters 1; --host-iters 20); also runs on the CPU")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--anchors", default=None,
                        help="folder holding vllm_topk.py (vLLM's CUDA top-k kernels, a measuring instrument): "
                             "timed beside ours on the top-k cases and in --sweep topk; with it, DeepGEMM's logits "
                             "kernels (deep_gemm, when it imports) on the decode and prefill cases (default: none)")
    parser.add_argument("--sweep", choices=tuple(SWEEPS), default=None,
                        help="run a kernel sweep instead of the case table: topk (the CUDA top-k's launch "
                             "configurations checked and timed beside Triton, vLLM and torch.topk; the decode "
                             "step) or logits (the Triton logits kernels checked against float64, configurations "
                             "timed); same timer and floors; writes sweep-<name>.md/.json to --out (default: "
                             "none, the case table)")
    parser.add_argument("--sections", default=None,
                        help="comma-separated parts of the sweep: topk: " + ",".join(topk_sweep.SECTIONS)
                             + " (default all); logits: " + ",".join(logits_sweep.SECTIONS)
                             + " (default " + ",".join(logits_sweep.DEFAULT_SECTIONS) + ")")
    parser.add_argument("--configs", default=None,
                        help="--sweep topk: the CUDA kernel's launch configurations, threads x CTAs per row "
                             f"(default {topk_sweep.DEFAULT_CONFIGS})")


def _err(e: BaseException, limit: int = 300) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _select(specs: list[CaseSpec], cases: str | None) -> list[CaseSpec]:
    if not cases:
        return specs
    want = [c.strip() for c in cases.split(",") if c.strip()]
    known = set(GROUPS) | {s.key for s in specs}
    unknown = [c for c in want if c not in known]
    if unknown:
        keys = [s.key for s in specs]
        raise ValueError(f"unknown --cases {unknown}; choose groups {GROUPS} or keys {keys}")
    return [s for s in specs if s.group in want or s.key in want]


def _command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        return shlex.join(["python", "-m", "sparse_indexer", *argv[1:]])
    if argv and argv[0].endswith("bench.py"):
        return shlex.join(["python", "-m", "sparse_indexer.commands.bench", *argv[1:]])
    return shlex.join(argv)


def _version(module: str) -> str:
    try:
        from importlib import metadata

        for dist in (module, f"pytorch-{module}", f"pytorch-{module}-rocm", f"{module}-rocm"):
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
    except Exception:  # noqa: BLE001, S110 - fall through to the module's own attribute
        pass
    try:
        return str(__import__(module).__version__)
    except Exception:  # noqa: BLE001
        return "not installed"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"


class Anchors(NamedTuple):
    """The measuring instruments of ``--anchors``: vLLM's top-k kernels and DeepGEMM (either may be ``None``)."""

    vllm_topk: object
    deep_gemm: object
    vllm_candidates: object = None


def _load_anchors(folder: str, name: str = "vllm_topk"):
    """``DIR/<name>.py`` from ``folder``: ``vllm_topk`` (vLLM's top-k kernels prebuilt for the H200) or
    ``vllm_candidates`` (vLLM's candidate-block functions, runnable without vLLM); measuring only."""
    import importlib.util

    path = os.path.join(folder, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{name}_anchor", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_deep_gemm():
    """DeepGEMM (``deep_gemm``, built from source; measuring only): the module, or raises why it is missing."""
    import importlib

    dg = importlib.import_module("deep_gemm")
    dg.get_num_sms()  # (a build without a usable GPU fails here, not inside a timed case)
    return dg


def _resolve_device(name: str) -> torch.device:
    """``--device``: ``auto`` (a GPU when one is visible, else the CPU) or a device that is there (a CUDA one made
    current, with its index); ``ValueError`` otherwise."""
    try:
        device = resolve_device(name)
    except UsageError as e:
        raise ValueError(str(e)) from None
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def _backend_list(names: str | None) -> list[str]:
    """``--backends`` (default: every registered backend) in the registry's order, the row order of every case;
    ``ValueError`` naming an unknown one."""
    known = _registry.names()
    want = [b.strip() for b in (names or ",".join(known)).split(",") if b.strip()]
    bad = [b for b in want if b not in known]
    if bad:
        raise ValueError(f"unknown --backends {bad}; choose from {known}")
    return [b for b in known if b in want]


def timing_options(args: argparse.Namespace) -> dict:
    """``iters``, ``warmup`` and ``ref_iters`` (at most ``iters``) of ``args``: each as given, else
    :data:`SMOKE_TIMING`'s under ``--smoke`` and :data:`TIMING`'s otherwise."""
    defaults = SMOKE_TIMING if getattr(args, "smoke", False) else TIMING
    out = {k: int(v) if (v := getattr(args, k, None)) is not None else defaults[k] for k in TIMING}
    out["ref_iters"] = min(out["iters"], out["ref_iters"])
    return out


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see :func:`add_arguments`). Returns 0 when every check
    passed and every available backend ran, 1 otherwise, 2 on a usage error."""
    if getattr(args, "host", False):
        from . import bench_host

        return bench_host.run(args)
    opt = lambda name, default: getattr(args, name, default)
    smoke = bool(opt("smoke", False))
    timing = timing_options(args)
    iters, warmup, ref_iters = timing["iters"], timing["warmup"], timing["ref_iters"]
    skip_ref, no_check = bool(opt("skip_reference", False)), bool(opt("no_check", False))
    device_name = opt("device", None) or "auto"
    try:
        device = _resolve_device(device_name)
        specs = _select(case_specs(smoke), opt("cases", None))
        backends = _backend_list(opt("backends", None))
        sweep, sections = _sweep_options(opt("sweep", None), opt("sections", None), opt("configs", None))
        left_out = [s for s in specs if s.params.get("graph")] if device.type != "cuda" and sweep is None else []
        specs = [s for s in specs if s not in left_out]
        if left_out and not specs:
            raise ValueError(f"--cases: {GRAPHS_NEED_CUDA}, and nothing else was asked for")
    except (ValueError, RuntimeError) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    interpreter = use_triton_interpreter(device) if sweep == "logits" else None  # before triton is imported
    reasons = {b: why for b in backends if (why := unavailable_reason(b, device)) is not None}
    anchors = None
    if opt("anchors", None):
        found = {}
        for key, name, load in (("vllm_topk", "vLLM anchors", lambda: _load_anchors(opt("anchors", None))),
                                ("deep_gemm", "DeepGEMM anchors", _load_deep_gemm),
                                ("vllm_candidates", "vLLM candidate anchors",
                                 lambda: _load_anchors(opt("anchors", None), "vllm_candidates"))):
            try:
                found[key] = load()
            except Exception as e:  # noqa: BLE001 - the anchors are optional; say why one is missing
                reasons[name] = _err(e)
                found[key] = None
        anchors = Anchors(**found)
    torch.manual_seed(int(opt("seed", 0)))
    ctx = Ctx(device=device, fp8=native_fp8(device))
    timer = Timer(device, opt("l2_flush", "zero"))

    meta = dict(device=_device_name(device), device_str=str(device), torch=torch.__version__,
                triton=_version("triton"), aiter=_version("aiter"), hip=torch.version.hip,
                cuda=torch.version.cuda,
                fp8=fp8_name(ctx.fp8), heads=ctx.heads, head_dim=ctx.head_dim, block_size=ctx.block_size,
                iters=iters, warmup=warmup, ref_iters=ref_iters, ref_warmup=min(warmup, 1), smoke=smoke,
                skip_reference=skip_ref, device_choice=auto_device_note(device_name, device),
                left_out=GRAPHS_NEED_CUDA if left_out else None,
                timing=(f"CUDA events around the op, L2 flushed ({L2_FLUSHES[timer.method]}) before each "
                        "iteration" if timer.gpu else "time.perf_counter around the op, no L2 flush (CPU)"),
                command=_command_line(), unavailable=reasons,
                started=time.strftime("%Y-%m-%d %H:%M:%S"))
    print(f"sparse-indexer bench on {meta['device_choice']}: {meta['device']}, torch {meta['torch']}, "
          f"triton {meta['triton']}; per row {iters} timed iteration{'s' * (iters != 1)} after {warmup} warmup"
          + (" (--smoke)" if smoke else ""), flush=True)
    if interpreter:
        print(f"  {interpreter}", flush=True)
    if device.type != "cuda" and not smoke:
        print("  note: the full shapes on the CPU take long (--smoke: tiny shapes, a quick run)", flush=True)
    if left_out:
        print(f"  {GRAPHS_NEED_CUDA}", flush=True)
    for b, why in reasons.items():
        print(f"  {b}: n/a ({why})", flush=True)
    print("measuring floors ...", end=" ", flush=True)
    floors = measure_floors(ctx, timer, iters)
    print(", ".join(_floor_str(f) for f in floors.values()), flush=True)
    if sweep is not None:
        env = SweepEnv(device=device, timer=timer, floors=floors, iters=iters, warmup=warmup, smoke=smoke,
                       sections=sections, configs=opt("configs", None),
                       anchors=None if anchors is None else anchors.vllm_topk)
        return run_sweep(sweep, env, meta, floors, opt("out", "bench-out") or "bench-out")

    table = _Table(ctx=ctx, timer=timer, floors=floors, backends=backends, reasons=reasons, iters=iters,
                   warmup=warmup, ref_iters=ref_iters, skip_ref=skip_ref, no_check=no_check, anchors=anchors)
    rows: list[dict] = []
    for i, spec in enumerate(specs, 1):
        torch.manual_seed(int(opt("seed", 0)) + i)
        rows += _run_case(table, spec, f"[{i}/{len(specs)}] {spec.title}")
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    _write_reports(meta, floors, rows, opt("out", "bench-out") or "bench-out")
    failed = [r for r in rows if r["check"] in ("FAIL", "error") or r["status"] == "error"]
    return 1 if failed else 0


@dataclass(frozen=True)
class _Table:
    """What the case table's rows share: the device context, the timer and floors, the backends (with the
    reasons of those unavailable here) and the timing and checking options."""

    ctx: Ctx
    timer: Timer
    floors: dict
    backends: list[str]
    reasons: dict
    iters: int
    warmup: int
    ref_iters: int
    skip_ref: bool
    no_check: bool
    anchors: object = None


def _run_case(t: _Table, spec: CaseSpec, tag: str) -> list[dict]:
    """Every row of one case: its inputs built once, then each backend that has the case's op (timed and
    checked), vLLM's kernels (``--anchors``) and the copy of the same bytes where the case has one."""
    print(f"{tag}: building inputs ...", flush=True)
    case = None
    try:
        case = build_case(spec, t.ctx)
        t.timer.sync()
        build_error = None
    except Exception as e:  # noqa: BLE001 - report and go on with the next case
        build_error = _err(e)
        print(f"{tag}: input construction failed: {build_error}", flush=True)
    rows = [_backend_row(t, spec, case, build_error, b, tag) for b in t.backends
            if _registry.get(b).implements(CASE_OPS[spec.group])]  # a backend of some ops runs some groups
    if case is not None:
        rows += _measure_only_rows(t, spec, case, tag)
    del case
    _free(t.ctx.device)
    return rows


def _backend_row(t: _Table, spec: CaseSpec, case: Case | None, build_error: str | None, b: str, tag: str) -> dict:
    """The row of backend ``b`` on ``case``: n/a, skipped or an input error, else its median time, the achieved
    rate and fraction of the floor, and the spot check against the reference backend."""
    row = dict(case=spec.title, key=spec.key, group=spec.group, backend=b, status="ok",
               median_us=None, iters=None, times_us=None, amount=None, achieved=None,
               unit=case.unit if case else None, floor_fraction=None, check="", check_detail="",
               note=case.note if case else "")
    if b in t.reasons:
        row.update(status="n/a", check="n/a", check_detail=t.reasons[b], detail_in_header=True)
        print(f"{tag} {b} ... n/a", flush=True)
        return row
    if b == "reference" and t.skip_ref:
        row.update(status="skipped", check="skipped", check_detail="--skip-reference")
        print(f"{tag} {b} ... skipped", flush=True)
        return row
    if case is None:
        row.update(status="error", check="error", check_detail=f"inputs: {build_error}")
        print(f"{tag} {b} ... error (inputs)", flush=True)
        return row
    print(f"{tag} {b} ...", end=" ", flush=True)
    ref = b == "reference"
    its, wu = (t.ref_iters, min(t.warmup, 1)) if ref else (t.iters, t.warmup)
    try:
        case.reset()
        times = t.timer.times_us(case.fn(b), its, wu)
    except (BackendUnavailable, NotImplementedError) as e:  # this backend lacks the op or the case
        row.update(status="n/a", check="n/a", check_detail=_err(e))
        print(f"n/a ({row['check_detail']})", flush=True)
        return row
    except Exception as e:  # noqa: BLE001
        row.update(status="error", check="error", check_detail=_err(e))
        print(f"error: {row['check_detail']}", flush=True)
        _free(t.ctx.device)
        return row
    med = statistics.median(times)
    achieved = case.amount / (med * 1e-6) / 1e12  # TB/s or TFLOP/s
    floor = t.floors["compute" if case.unit == "TFLOP/s" else "bandwidth"]["value"]
    row.update(median_us=med, iters=its, times_us=times, amount=case.amount, achieved=achieved,
               floor_fraction=(achieved / floor) if floor else None)
    if ref:
        row.update(check="ref", check_detail="the reference backend is the baseline of the checks")
    elif t.no_check:
        row.update(check="-", check_detail="--no-check")
    else:
        try:
            ok, detail = case.check(b)
            row.update(check="ok" if ok else "FAIL", check_detail=detail)
        except Exception as e:  # noqa: BLE001
            row.update(check="error", check_detail=_err(e))
    frac = f", {row['floor_fraction']:.2f} of floor" if row["floor_fraction"] is not None else ""
    extra = f" ({row['check_detail']})" if row["check"] not in ("ok", "ref", "-") else ""
    print(f"{med:.1f} us  {achieved:.3g} {case.unit}{frac}  check {row['check']}{extra}", flush=True)
    return row


def _measure_only_rows(t: _Table, spec: CaseSpec, case: Case, tag: str) -> list[dict]:
    """Rows that are measured, not checked: vLLM's kernels on the case's inputs (``--anchors``, cases with
    ``anchors``) and a torch copy of the bytes the op moves (cases with ``copy_baseline``)."""
    rows = []
    floor = t.floors["compute" if case.unit == "TFLOP/s" else "bandwidth"]["value"]

    def timed(backend: str, fn, check: str, detail: str) -> None:
        times = t.timer.times_us(fn, t.iters, t.warmup)
        med = statistics.median(times)
        achieved = case.amount / (med * 1e-6) / 1e12
        rows.append(dict(case=spec.title, key=spec.key, group=spec.group, backend=backend, status="ok",
                         median_us=med, iters=t.iters, times_us=times, amount=case.amount, achieved=achieved,
                         unit=case.unit, floor_fraction=(achieved / floor) if floor else None,
                         check=check, check_detail=detail, note=case.note))

    for name, fn in (case.anchors(t.anchors) if t.anchors is not None and hasattr(case, "anchors") else []):
        try:
            timed(name, fn, "anchor", f"{name.split()[0]}'s kernel, measuring only")
        except Exception as e:  # noqa: BLE001
            print(f"{tag} {name} ... error: {_err(e)}", flush=True)
            continue
        print(f"{tag} {name} ... {rows[-1]['median_us']:.1f} us", flush=True)
    if hasattr(case, "copy_baseline"):
        timed("copy (same bytes)", case.copy_baseline(), "floor", "torch copy_ of the bytes the op reads + writes")
        print(f"{tag} copy of the same bytes ... {rows[-1]['median_us']:.1f} us", flush=True)
    return rows


def _write_reports(meta: dict, floors: dict, rows: list[dict], out_dir: str) -> None:
    """Print the table; write ``results.json``, ``results.md`` and ``results.png`` (with matplotlib) to
    ``out_dir``."""
    print()
    print(format_table(rows))
    os.makedirs(out_dir, exist_ok=True)
    result = dict(meta=meta, floors=floors, rows=rows)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(format_markdown(meta, floors, rows))
    png = write_chart(rows, os.path.join(out_dir, "results.png"))
    written = ["results.md", "results.json"] + (["results.png"] if png else [])
    print(f"\nwrote {', '.join(os.path.join(out_dir, w) for w in written)}", flush=True)


def _sweep_options(sweep: str | None, sections: str | None, configs: str | None):
    """``(sweep, sections)`` from the options; ``ValueError`` naming the option on a bad value."""
    if sweep is None:
        if sections or configs:
            raise ValueError("--sections and --configs are options of --sweep")
        return None, None
    if sweep not in SWEEPS:
        raise ValueError(f"unknown --sweep {sweep!r}; choose from {tuple(SWEEPS)}")
    if configs and sweep != "topk":
        raise ValueError("--configs is an option of --sweep topk")
    if configs:
        for c in configs.split(","):
            parts = c.split("x")
            if len(parts) != 2 or not all(v.isdigit() and int(v) > 0 for v in parts):
                raise ValueError(f"--configs: {c!r} is not THREADSxCTAS (e.g. 1024x2)")
    if not sections:
        return sweep, None
    want = frozenset(x.strip() for x in sections.split(",") if x.strip())
    bad = sorted(want - set(SWEEPS[sweep].SECTIONS))
    if bad:
        raise ValueError(f"unknown --sections {bad} of --sweep {sweep}; choose from {SWEEPS[sweep].SECTIONS}")
    return sweep, want


def run_sweep(name: str, env: SweepEnv, meta: dict, floors: dict, out_dir: str) -> int:
    """Run the sweep ``name`` (:data:`SWEEPS`) on ``env`` and write its table and results beside the bench's
    metadata and floors (``sweep-<name>.md``, ``sweep-<name>.json`` in ``out_dir``). Returns 1 when a check
    failed or a section raised, else 0."""
    try:
        rows, results = SWEEPS[name].run(env)
    except Exception as e:  # noqa: BLE001 - the sweep could not start (e.g. the logits sweep on the CPU sans interpreter)
        print(f"bench --sweep {name}: {_err(e)}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, RuntimeError) else 1
    meta = dict(meta, sweep=name, sections=sorted(env.sections) if env.sections else "default",
                finished=time.strftime("%Y-%m-%d %H:%M:%S"))
    failed = [r for r in rows if r[1] == "FAILED" or "MISMATCH" in r[3] or r[1].startswith("BAD")
              or " FAIL" in r[1]]
    failed += [k for k, v in results.items() if (k == "check_bad_rows" and v) or (k.startswith("check_ok") and not v)]
    heads = ("case", "what", "us", "note")
    widths = [max([len(h)] + [len(str(r[i])) for r in rows]) for i, h in enumerate(heads)]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    print("\n" + "\n".join([line(heads), line(["-" * w for w in widths]), *(line(r) for r in rows)]), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"sweep-{name}.json"), "w") as f:
        json.dump(dict(meta=meta, floors=floors, rows=rows, results=results), f, indent=1, default=str)
    md = lambda c: str(c).replace("|", "\\|")  # noqa: E731
    text = [f"# sparse-indexer bench --sweep {name}", "", f"- device: {meta['device']} (`{meta['device_str']}`)",
            f"- versions: torch {meta['torch']}, triton {meta['triton']}", f"- timing: {meta['timing']}",
            *(f"- {k} floor: " + _floor_str(f) for k, f in floors.items()),
            f"- command: `{meta['command']}`", f"- run: {meta['started']} .. {meta['finished']}", "",
            "| " + " | ".join(heads) + " |", "|---|---|---:|---|",
            *("| " + " | ".join(md(c) for c in r) + " |" for r in rows)]
    with open(os.path.join(out_dir, f"sweep-{name}.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    print(f"\nwrote {os.path.join(out_dir, f'sweep-{name}.md')}, {os.path.join(out_dir, f'sweep-{name}.json')}"
          + (f"; {len(failed)} failure(s)" if failed else ""), flush=True)
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------- output


def _floor_str(f: dict) -> str:
    if f.get("value") is None:
        return f"{f['unit']} floor n/a ({f.get('error', '')})"
    return f"{f['value']:.3g} {f['unit']} ({f['how']})"


def _cells(r: dict) -> list[str]:
    if r["median_us"] is None:
        dash = r["status"] if r["status"] != "ok" else "-"
        check = r["check"]
        if r["status"] in ("n/a", "error") and r["check_detail"] and not r.get("detail_in_header"):
            check = f"{check}: {r['check_detail']}"
        return [r["case"], r["backend"], dash, dash, r["unit"] or "", "-", check]
    check = r["check"]
    if check == "ok" and r["check_detail"]:
        check = f"ok ({r['check_detail']})"
    elif check not in ("ok", "ref", "-", "n/a", "skipped", "anchor"):
        check = f"{check}: {r['check_detail']}"
    frac = f"{r['floor_fraction']:.3f}" if r["floor_fraction"] is not None else "n/a"
    return [r["case"], r["backend"], f"{r['median_us']:.1f}", f"{r['achieved']:.3g}", r["unit"], frac, check]


HEADERS = ["case", "backend", "median us", "achieved", "unit", "floor fraction", "check"]


def format_table(rows: list[dict]) -> str:
    """The result table as aligned plain text."""
    body = [_cells(r) for r in rows]
    body = [[c if len(c) <= 70 else c[:67] + "..." for c in line] for line in body]
    widths = [max([len(h)] + [len(line[i]) for line in body]) for i, h in enumerate(HEADERS)]
    fmt = lambda line: "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
    return "\n".join([fmt(HEADERS), fmt(["-" * w for w in widths]), *(fmt(line) for line in body)])


def format_markdown(meta: dict, floors: dict, rows: list[dict]) -> str:
    md = lambda s: str(s).replace("|", "\\|")
    lines = [
        "# sparse-indexer benchmark",
        "",
        f"- device: {meta['device']} (`{meta['device_str']}`)",
        f"- versions: torch {meta['torch']}, triton {meta['triton']}, aiter {meta['aiter']}"
        + (f", HIP {meta['hip']}" if meta.get("hip") else "")
        + (f", CUDA {meta['cuda']}" if meta.get("cuda") else ""),
        f"- shapes: H={meta['heads']}, D={meta['head_dim']}, block_size={meta['block_size']}, "
        f"fp8 {meta['fp8']}" + (" (--smoke)" if meta["smoke"] else ""),
        f"- timing: median of {meta['iters']} iterations after {meta['warmup']} warmup (reference backend: "
        f"{meta['ref_iters']} after {meta.get('ref_warmup', 1)}); {meta['timing']}",
    ]
    if meta.get("left_out"):
        lines.append(f"- {meta['left_out']}")
    for name, f in floors.items():
        lines.append(f"- {name} floor: " + _floor_str(f))
    lines += [
        "- logits ops timed with `clean=False` (what the indexer step uses); only in-window cells are "
        "checked",
        "- models: decode = cache bytes read sum(L)*(D+4) + q + weights + block table + logits written "
        "sum(limit)*4; prefill = 2*H*D*(in-window (query, key) pairs); top-k = window bytes read; "
        "step = decode logits + the logits read again by the top-k; "
        "cache write = k read + slots read + cache written; gather = cache read + out written",
        "- checks against the reference backend on a subset of rows: relative L2 on in-window logits "
        f"(<= {LOGITS_RTOL:g}), top-k multiset equality on the same logits, byte equality for cache ops",
    ]
    for b, why in meta.get("unavailable", {}).items():
        lines.append(f"- {b}: n/a ({md(why)})")
    lines += [f"- command: `{meta['command']}`", f"- run: {meta['started']} .. {meta.get('finished', '')}",
              ""]
    lines.append("| " + " | ".join(HEADERS) + " |")
    lines.append("|" + "|".join(["---", "---", "---:", "---:", "---", "---:", "---"]) + "|")
    for r in rows:
        lines.append("| " + " | ".join(md(c) for c in _cells(r)) + " |")
    return "\n".join(lines) + "\n"


def write_chart(rows: list[dict], path: str) -> bool:
    """Bar chart of the fraction of the floor per case and backend; False (and a warning) sans matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        print(f"warning: no PNG chart, matplotlib is not usable ({_err(e)})", file=sys.stderr, flush=True)
        return False
    cases = list(dict.fromkeys(r["key"] for r in rows))
    backends = [b for b in _registry.names() if any(r["backend"] == b and r["floor_fraction"] is not None
                                                for r in rows)]
    val = {(r["key"], r["backend"]): r["floor_fraction"] for r in rows}
    fig, ax = plt.subplots(figsize=(max(8.0, 1.0 * len(cases) + 2), 5))
    width = 0.8 / max(1, len(backends))
    for j, b in enumerate(backends):
        xs = [i + (j - (len(backends) - 1) / 2) * width for i in range(len(cases))]
        ys = [val.get((c, b)) or 0.0 for c in cases]
        bars = ax.bar(xs, ys, width, label=b)
        for bar, y in zip(bars, ys):
            if y:
                ax.annotate(f"{y:.2f}", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom",
                            fontsize=7)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("fraction of measured floor (copy BW / FP8 _scaled_mm)")
    ax.set_title("sparse-indexer: achieved / floor")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    if backends:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":  # pragma: no cover - the CLI is python -m sparse_indexer bench
    p = argparse.ArgumentParser(prog="sparse_indexer.commands.bench")
    add_arguments(p)
    sys.exit(run(p.parse_args()))

