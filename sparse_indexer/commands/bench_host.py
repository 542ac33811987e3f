"""``python -m sparse_indexer bench --host``: host time per eager call of every op and of the indexer steps.

Engines run the indexer eagerly once per layer (61 layers in DeepSeek-V3.2), so the Python time of one call is
paid once per layer and step. This measures it as a user sees it: the wall time of one call on the host
(``time.perf_counter_ns`` around the call, after warm-up; the smallest of :data:`ROUNDS` round medians; on a GPU
the device is synchronised *before* each timed call, so the launch queue is empty and the time is the host's
alone), for

* every public op (argument checks included; the default ``check_values``), beside its backend implementation
  called directly, the two timed in turn (the added cost of the public function is the difference) and the custom op
  ``torch.ops.sparse_indexer.<op>`` (the route ``torch.compile`` records);
* the decode step (``sparse_attn_indexer`` with K: cache write, paged logits, top-k) and a prefill step of one
  chunk (cache write, gather, ragged logits, top-k), with the step's metadata built once (as every layer of a
  step shares it);
* the same public calls with every backend implementation replaced by a no-op (the library's own Python:
  checks, routing, the step's views; the backend's wrapper and launch excluded);
* in the same run, ``torch.topk`` of the top-k case and an empty op (``x.add_(0)`` on one element) as floors.

Shapes: on CUDA DeepSeek-V3.2's (H=64, D=128, block 64, topk 2048): top-k and paged logits ``4 x 4096``, decode
step ``B=4, L=4K``, prefill step one request of 256 new tokens at context 4K (logits ``256 x 4096``), cache
write of 4 tokens, gather of 4096 tokens. On the CPU (reference backend) tiny shapes (H=16, D=64, block 16,
topk 8; ``4 x 64``), where the work is negligible and the host overhead is what is left.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from buffers import IndexerLimits, allocate

from .._runtime import dispatch as _dispatch
from .._runtime import library
from ..fp8 import quantize_k, quantize_q
from ..indexer import sparse_attn_indexer
from ..kcache import as_3d, new_kv_cache, slots_from_block_table
from ..metadata import build_metadata
from ..ops.fp8_mqa_logits import fp8_mqa_logits
from ..ops.fp8_paged_mqa_logits import fp8_paged_mqa_logits
from ..ops.gather_k_cache import gather_k_cache
from ..ops.top_k_per_row import top_k_per_row
from ..ops.write_k_cache import write_k_cache

__all__ = ["add_arguments", "cpu_model", "measure", "run"]

SHAPES = {
    # heads, head dim, block, topk, decode B, context L (decode and prefill), prefill new tokens, gather tokens
    "cuda": dict(h=64, d=128, bs=64, topk=2048, b=4, ctx=4096, new=256, gather=4096),
    "cpu": dict(h=16, d=64, bs=16, topk=8, b=4, ctx=64, new=16, gather=64),
}


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``), and its core count."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} logical CPUs"


ROUNDS = 5
"""Timed calls are split into this many rounds; a row is the smallest of the rounds' medians. Host noise (other
tenants of a shared, virtualised host, frequency changes) only adds time, so the quietest round is the closest
to the call's own cost; one median over all calls moves by tens of percent between starts of the same machine."""


def _median_us(fn: Callable[[], object], iters: int, warmup: int, sync: Callable[[], None]) -> float:
    """Host time (us) of one call of ``fn``: the smallest of :data:`ROUNDS` medians of ``iters / ROUNDS`` calls,
    each timed alone after a device synchronisation."""
    return _paired_median_us((fn,), iters, warmup, sync)[0]


def _paired_median_us(fns: tuple[Callable[[], object], ...], iters: int, warmup: int,
                      sync: Callable[[], None]) -> list[float]:
    """Host time (us) of each of ``fns`` (see :func:`_median_us`), timed in turn within every iteration: the
    calls share the host's state of the moment (clock, caches, neighbours on a shared host), so the difference of
    two of them is not the drift between two separate timing windows (the added cost of the public function
    is such a difference)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync()
    best = [float("inf")] * len(fns)
    clock = time.perf_counter_ns
    per_round = max(1, iters // ROUNDS)
    for _ in range(ROUNDS):
        ts = [[] for _ in fns]
        for _ in range(per_round):
            for fn, t in zip(fns, ts):
                sync()
                t0 = clock()
                fn()
                t.append(clock() - t0)
        sync()
        best = [min(b, statistics.median(t) / 1e3) for b, t in zip(best, ts)]
    return best


class _Inputs:
    """Every case's tensors on ``device``: a paged cache with a history, the step's metadata and buffers."""

    def __init__(self, device: torch.device, shapes: dict, seed: int = 0):
        torch.manual_seed(seed)
        self.resolved: dict[str, str] = {}  # op -> the backend its timed call runs (filled by _cases)
        s = self.s = shapes
        h, d, bs, topk, b, ctx, new = s["h"], s["d"], s["bs"], s["topk"], s["b"], s["ctx"], s["new"]
        self.device = device
        fp8 = torch.float8_e4m3fn
        i32 = dict(dtype=torch.int32, device=device)
        blocks = (ctx + bs - 1) // bs
        reqs = b + 1  # the decode requests, then one prefill request
        nb = reqs * blocks + 1
        self.kv = new_kv_cache(nb, bs, d, device=device)
        self.block_table = torch.arange(reqs * blocks, **i32).view(reqs, blocks)
        hist = torch.arange(ctx, device=device)[None, :].expand(reqs, ctx)
        slots = slots_from_block_table(self.block_table, hist, bs).reshape(-1)
        write_k_cache(torch.randn(slots.numel(), d, device=device), self.kv, slots, backend="reference")

        # ops
        self.logits = torch.randn(b, ctx, device=device)
        self.row_starts = torch.zeros(b, **i32)
        self.row_ends = torch.full((b,), ctx, **i32)
        self.topk_out = torch.empty(b, topk, **i32)
        q, qs = quantize_q(torch.randn(b, h, d, device=device), fp8_dtype=fp8)
        self.q4 = q.view(b, 1, h, d)
        self.w = (torch.randn(b, h, device=device) * qs).contiguous()
        self.ctx_lens = torch.full((b,), ctx, **i32)
        self.bt_dec = self.block_table[:b]
        self.paged_out = torch.empty(b, ctx, device=device)
        self.k_new = torch.randn(b, d, device=device, dtype=torch.bfloat16)
        self.slots_new = torch.arange(b, device=device) * (blocks * bs) + ctx - 1  # each request's last slot
        self.gather_bt = self.block_table[b:]
        self.gather_cu = torch.tensor([0, s["gather"]], **i32)
        self.out_k = torch.empty(s["gather"], d, dtype=fp8, device=device)
        self.out_scale = torch.empty(s["gather"], device=device)
        qm, qms = quantize_q(torch.randn(new, h, d, device=device), fp8_dtype=fp8)
        self.qm = qm
        self.wm = (torch.randn(new, h, device=device) * qms).contiguous()
        kf, ksc = quantize_k(torch.randn(ctx, d, device=device), fp8_dtype=fp8)
        self.kf, self.ksc = kf, ksc
        self.ks = torch.zeros(new, **i32)
        self.ke = torch.arange(ctx - new + 1, ctx + 1, **i32)
        self.mqa_out = torch.empty(new, ctx, device=device)

        # steps: decode (B requests, one new token each) and prefill (one request, `new` tokens), separately
        self.lim = IndexerLimits(max_model_len=ctx, max_num_batched_tokens=max(b, new), max_num_seqs=reqs,
                                 n_heads=h, head_dim=d, topk=topk, block_size=bs, prefill_k_tokens=ctx)
        self.bufs = allocate(self.lim, device)
        self.md_dec = build_metadata([ctx] * b, [1] * b, self.block_table[:b], self.slots_new, self.lim,
                                     num_blocks=nb)
        self.q_dec, self.w_dec = self.q4.view(b, h, d), self.w
        self.topk_dec = torch.empty(b, topk, **i32)
        pre_slots = slots_from_block_table(self.block_table[b:], torch.arange(ctx - new, ctx, device=device)[None],
                                           bs).reshape(-1)
        self.md_pre = build_metadata([ctx], [new], self.block_table[b:], pre_slots, self.lim, num_blocks=nb)
        assert len(self.md_pre.prefill_chunks) == 1
        self.k_pre = torch.randn(new, d, device=device, dtype=torch.bfloat16)
        self.topk_pre = torch.empty(new, topk, **i32)


def _cases(x: _Inputs, backend: str | None,
           check_values: bool | None = None) -> list[tuple[str, Callable, Callable | None, Callable | None]]:
    """(name, public call, backend implementation call, custom-op call); ``check_values`` of the public ops."""
    cv = check_values
    op = library.op
    be = backend or "auto"
    kv3 = as_3d(x.kv)

    def impl(name: str, *args, **kwargs) -> Callable[[], None]:
        """A call of the implementation the public call runs for these arguments (the timed call is it alone),
        resolved here: the first candidate that imports and, under auto, takes the call (``auto_when``;
        sparse_indexer/_runtime/dispatch.py)."""
        route = _dispatch.chosen(_dispatch.routes(name, backend, x.device), backend, args, kwargs)
        x.resolved[name] = route.name
        fn = route.fn
        return lambda: fn(*args, **kwargs)

    return [
        ("top_k_per_row", lambda: top_k_per_row(x.logits, x.row_starts, x.row_ends, out=x.topk_out, backend=backend,
                                                 check_values=cv),
         impl("top_k_per_row", x.logits, x.row_starts, x.row_ends, out=x.topk_out),
         lambda: op("top_k_per_row")(x.logits, x.row_starts, x.row_ends, x.topk_out, backend=be)),
        ("fp8_paged_mqa_logits",
         lambda: fp8_paged_mqa_logits(x.q4, x.kv, x.w, x.ctx_lens, x.bt_dec, out=x.paged_out, clean=False,
                                      backend=backend, check_values=cv),
         impl("fp8_paged_mqa_logits", x.q4, kv3, x.w, x.ctx_lens, x.bt_dec, out=x.paged_out, clean=False),
         lambda: op("fp8_paged_mqa_logits")(x.q4, kv3, x.w, x.ctx_lens, x.bt_dec, x.paged_out, False, backend=be)),
        ("fp8_mqa_logits",
         lambda: fp8_mqa_logits(x.qm, x.kf, x.ksc, x.wm, x.ks, x.ke, out=x.mqa_out, clean=False, backend=backend,
                                check_values=cv),
         impl("fp8_mqa_logits", x.qm, x.kf, x.ksc, x.wm, x.ks, x.ke, out=x.mqa_out, clean=False),
         lambda: op("fp8_mqa_logits")(x.qm, x.kf, x.ksc, x.wm, x.ks, x.ke, x.mqa_out, False, backend=be)),
        ("write_k_cache", lambda: write_k_cache(x.k_new, x.kv, x.slots_new, backend=backend, check_values=cv),
         impl("write_k_cache", x.k_new, kv3, x.slots_new, scale_fmt="ue8m0", fp8_dtype=torch.float8_e4m3fn),
         lambda: op("write_k_cache")(x.k_new, kv3, x.slots_new, "ue8m0", torch.float8_e4m3fn, backend=be)),
        ("gather_k_cache",
         lambda: gather_k_cache(x.kv, x.gather_bt, x.gather_cu, out_k=x.out_k, out_scale=x.out_scale,
                                backend=backend, check_values=cv),
         impl("gather_k_cache", kv3, x.gather_bt, x.gather_cu, out_k=x.out_k, out_scale=x.out_scale),
         lambda: op("gather_k_cache")(kv3, x.gather_bt, x.gather_cu, x.out_k, x.out_scale, backend=be)),
        ("decode step (write + logits + top-k)",
         lambda: sparse_attn_indexer(x.q_dec, x.k_new, x.w_dec, x.kv, x.md_dec, x.bufs, x.topk_dec, backend=backend),
         None, None),
        ("prefill step, one chunk (write + gather + logits + top-k)",
         lambda: sparse_attn_indexer(x.qm, x.k_pre, x.wm, x.kv, x.md_pre, x.bufs, x.topk_pre, backend=backend),
         None, None),
    ]


def backend_label(backend: str | None, resolved: dict[str, str]) -> str:
    """``backend`` as the rows ran it: a named one as is; auto as what it resolved to on the device
    (``"reference (auto)"`` when every op runs one backend, else ``"auto (op: backend, ...)"``)."""
    if backend not in (None, "auto"):
        return backend
    names = sorted(set(resolved.values()))
    if len(names) == 1:
        return f"{names[0]} (auto)"
    return "auto (" + ", ".join(f"{op}: {b}" for op, b in resolved.items()) + ")" if names else "auto"


def _no_op(*args, **kwargs) -> None:
    return None


def _outputs(x: _Inputs) -> dict[str, torch.Tensor]:
    return {"top_k_per_row": x.topk_out, "fp8_paged_mqa_logits": x.paged_out, "fp8_mqa_logits": x.mqa_out,
            "write_k_cache": x.kv, "gather_k_cache": x.out_k.view(torch.uint8),
            "decode step (write + logits + top-k)": x.topk_dec,
            "prefill step, one chunk (write + gather + logits + top-k)": x.topk_pre}


def _same(name: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    if "top" in name or "step" in name:  # a selection: the same set per row (the order is free)
        return torch.equal(a.sort(dim=1).values, b.sort(dim=1).values)
    return torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                       b.view(torch.uint8) if b.is_floating_point() else b)


def self_check(x: _Inputs, backend: str | None) -> dict[str, str]:
    """Every case called twice on the same inputs: the first call of a specialization takes Triton's own launch
    path, the next ones the bound launcher (sparse_indexer/_runtime/launch.py); the outputs must agree (selections as
    sets). The ops' outputs are also compared with the reference backend (logits within 1e-3 of the largest
    magnitude, selections as sets). Returns ``{case: "ok" | what differs}``."""
    res = {}
    outs = _outputs(x)
    ref = dict((name, public) for name, public, _, _ in _cases(x, "reference"))
    for name, public, _, _ in _cases(x, backend):
        out = outs[name]
        public()
        first = out.clone()
        public()
        second = out.clone()
        public()
        if not (_same(name, first, second) and _same(name, first, out)):
            res[name] = "FAIL: repeated calls (bound launches) differ from the first call"
            continue
        res[name] = "ok"
        if name in ("write_k_cache",) or "step" in name:
            continue  # the cache write is idempotent and checked above; steps combine the checked ops
        ref[name]()
        want = out.clone()
        public()
        if out.is_floating_point():
            fin = torch.isfinite(want)
            err = (out[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
            tol = 1e-3 * want[fin].abs().max().item() if fin.any() else 0.0
            if err > tol or not torch.equal(torch.isfinite(out), fin):
                res[name] = f"FAIL: max |diff| {err:.3g} vs the reference (tolerance {tol:.3g})"
        elif not _same(name, out, want):
            res[name] = "FAIL: differs from the reference"
    # another specialization of the same kernels (outputs 4 bytes off 16-byte alignment, odd row strides): the
    # launcher binds it separately; twice, so the second call is a bound launch (clean=True: every cell defined)
    paged = lambda o: fp8_paged_mqa_logits(x.q4, x.kv, x.w, x.ctx_lens, x.bt_dec, out=o, backend=backend)  # noqa: E731
    mqa = lambda o: fp8_mqa_logits(x.qm, x.kf, x.ksc, x.wm, x.ks, x.ke, out=o, backend=backend)  # noqa: E731
    for name, want, call in (("fp8_paged_mqa_logits, unaligned out", x.paged_out, paged),
                             ("fp8_mqa_logits, unaligned out", x.mqa_out, mqa)):
        call(want)
        o = torch.zeros(want.shape[0], want.shape[1] + 1, device=x.device)[:, 1:]
        call(o)  # Triton's path (a new specialization)
        first = o.clone()
        o.zero_()
        call(o)  # bound
        fin = torch.isfinite(want)
        close = torch.equal(torch.isfinite(o), fin) and (
            not fin.any() or (o[fin] - want[fin]).abs().max().item() <= 1e-5 * want[fin].abs().max().item())
        res[name] = ("ok" if _same(name, o, first) and close else
                     "FAIL: the bound launch differs from the first" if not _same(name, o, first) else
                     "FAIL: differs from the aligned output")
    return res


def measure(device: torch.device, backend: str | None, iters: int = 300, warmup: int = 20,
            shapes: dict | None = None) -> dict:
    """Median host time (us) per call of every case; see the module doc. Returns a JSON-able dict."""
    shapes = shapes or SHAPES["cuda" if device.type == "cuda" else "cpu"]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    x = _Inputs(device, shapes)
    checks = self_check(x, backend)
    sync()
    gc.collect()
    gc_was = gc.isenabled()
    gc.disable()  # a collection inside a timed call is not the call's cost
    try:
        one = torch.zeros(1, device=device)
        floors = {
            "empty op (x.add_(0), one element)": _median_us(lambda: one.add_(0), iters, warmup, sync),
            f"torch.topk {tuple(x.logits.shape)}, k={shapes['topk']}":
                _median_us(lambda: torch.topk(x.logits, shapes["topk"], dim=1, sorted=False), iters, warmup, sync),
        }
        rows = []
        for name, public, impl, op in _cases(x, backend):
            if impl is None:
                row = {"case": name, "public_us": _median_us(public, iters, warmup, sync)}
            else:  # the public call and its implementation in turn: their difference is the added cost
                pub, imp = _paired_median_us((public, impl), iters, warmup, sync)
                row = {"case": name, "public_us": pub, "impl_us": imp, "added_us": pub - imp,
                       "op_us": _median_us(op, iters, warmup, sync)}
            rows.append(row)
        # the same public calls with every backend implementation replaced by a no-op: what the library's own
        # Python (checks, routing, the step's views) costs, without the backend's host work and launches
        real = _dispatch.implementation
        _dispatch.implementation = lambda op, name: _no_op
        try:
            for row, (_name, public, _, _) in zip(rows, _cases(x, backend)):
                row["library_us"] = _median_us(public, iters, warmup, sync)
            # and without value checks (the default on a GPU, where they would synchronise): what a GPU caller's
            # public call adds; the steps check no values when their metadata was checked against the cache
            for row, (_name, public, impl, _) in zip(rows, _cases(x, backend, check_values=False)):
                if impl is not None:
                    row["library_novalues_us"] = _median_us(public, iters, warmup, sync)
        finally:
            _dispatch.implementation = real
    finally:
        if gc_was:
            gc.enable()
    x.resolved.clear()
    _cases(x, backend)  # the routes of the timed calls, once more: what auto resolved to
    return dict(device=str(device), backend=backend_label(backend, x.resolved), shapes=shapes, cpu=cpu_model(),
                checks=checks,
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                torch=torch.__version__, triton=_version("triton"), iters=iters, rounds=ROUNDS, warmup=warmup,
                floors=floors, rows=rows, command=" ".join(["python", "-m", "sparse_indexer", *sys.argv[1:]]))


def _version(module: str) -> str:
    try:
        return str(__import__(module).__version__)
    except Exception:  # noqa: BLE001 - not installed
        return "not installed"


def format_markdown(r: dict) -> str:
    s = r["shapes"]
    rounds = r.get("rounds", 1)
    pin = f", pinned to CPU {r['pinned_cpu']}" if r.get("pinned_cpu") is not None else ""
    if pin and r.get("started_on_pinned_cpu") is False:
        pin += " after start-up (not started under taskset)"
    head = (f"Host time per eager call, the smallest of {rounds} medians of {r['iters'] // rounds} calls "
            f"(`{r['command']}`{pin}): {r['device']}, backend "
            f"{r['backend']}, host CPU {r['cpu']}" + (f", GPU {r['gpu']}" if r["gpu"] else "") +
            f"; torch {r['torch']}, triton {r['triton']}. Shapes H={s['h']}, D={s['d']}, block {s['bs']}, "
            f"topk {s['topk']}, B={s['b']}, L={s['ctx']}, prefill {s['new']} new tokens, gather {s['gather']}.")
    lines = [head, "", "| call | public (us) | backend implementation (us) | added by the public function (us) | "
             "library alone: no-op implementation (us) | library alone, check_values=False (us) | "
             "through torch.ops (us) |", "|---|---:|---:|---:|---:|---:|---:|"]
    f = lambda v: "" if v is None else f"{v:.1f}"  # noqa: E731
    for row in r["rows"]:
        lines.append(f"| {row['case']} | {f(row['public_us'])} | {f(row.get('impl_us'))} | "
                     f"{f(row.get('added_us'))} | {f(row.get('library_us'))} | {f(row.get('library_novalues_us'))} | "
                     f"{f(row.get('op_us'))} |")
    for name, v in r["floors"].items():
        lines.append(f"| floor: {name} | {v:.1f} | | | | | |")
    bad = {k: v for k, v in r["checks"].items() if v != "ok"}
    lines += ["", "Self-check (repeated calls equal the first, ops equal the reference backend): "
              + ("all ok" if not bad else "; ".join(f"{k}: {v}" for k, v in bad.items()))]
    return "\n".join(lines) + "\n"


HOST_ITERS, SMOKE_HOST_ITERS = 300, 20
"""``--host-iters`` by default, and under ``--smoke`` (a quick run: a few seconds on the CPU)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", action="store_true",
                        help="host time per eager call of every op and step (sparse_indexer/commands/bench_host.py)")
    parser.add_argument("--host-iters", type=int, default=None,
                        help=f"timed calls per row of --host (default {HOST_ITERS}; {SMOKE_HOST_ITERS} under --smoke)")
    parser.add_argument("--host-cpu", type=int, default=None, metavar="N",
                        help="--host: pin the process (every thread) to logical CPU N first, one of the CPUs this "
                             "process may run on (os.sched_getaffinity; Linux; default: not pinned). Start the "
                             "process there too (taskset -c N python -m sparse_indexer bench --host --host-cpu N): "
                             "a process pinned only here, after torch's import placed its memory, ran 1.5-1.7x "
                             "slower in about half the runs on the H200's host; unpinned runs differed by up to "
                             "1.5x, processes started under taskset by ~5%%")


def cpu_list(cpus) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (as ``taskset -c`` takes them)."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def check_host_cpu(cpu: int) -> str | None:
    """``None`` when ``--host-cpu cpu`` can be used here, else a one-line error naming the CPUs this process may
    run on (``os.sched_getaffinity``)."""
    if not hasattr(os, "sched_setaffinity"):
        return "--host-cpu needs os.sched_setaffinity (Linux)"
    allowed = os.sched_getaffinity(0)
    if cpu not in allowed:
        return (f"cannot pin to CPU {cpu} (--host-cpu): this process may run on CPU {cpu_list(allowed)} only "
                f"(os.sched_getaffinity)")
    return None


def _pin_process(cpu: int) -> None:
    """Pin every thread of this process to logical CPU ``cpu`` (``sched_setaffinity`` of one id pins that thread
    only; the CUDA driver's and torch's threads started before this call are pinned too, as ``taskset`` does), the
    calling thread first, so a bad CPU raises before anything changed."""
    os.sched_setaffinity(0, {cpu})
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread only
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {cpu})
        except OSError:  # a thread that ended meanwhile
            pass


def run(args: argparse.Namespace) -> int:
    """``bench --host``: uses ``--device`` (default auto: cuda when a GPU is visible, else the CPU, which runs the
    reference backend), ``--backends`` (the first one; default auto), ``--host-iters`` (fewer under ``--smoke``)
    and ``--out``. A CPU ``--host-cpu`` cannot use and a device that is not there are one line on stderr, exit 2."""
    from .cli import UsageError, auto_device_note, resolve_device

    cpu = getattr(args, "host_cpu", None)
    if cpu is not None and (why := check_host_cpu(cpu)) is not None:
        print(f"bench --host: {why}", file=sys.stderr)
        return 2
    name = getattr(args, "device", None) or "auto"
    try:
        device = resolve_device(name)
    except UsageError as e:
        print(f"bench --host: {e}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    names = getattr(args, "backends", None)
    backend = names.split(",")[0].strip() if names else None
    iters = getattr(args, "host_iters", None)
    iters = iters if iters is not None else SMOKE_HOST_ITERS if getattr(args, "smoke", False) else HOST_ITERS
    print(f"sparse-indexer bench --host on {auto_device_note(name, device)}, "
          f"{iters} timed calls per row", flush=True)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny ops: no thread pool wake-ups in the measured time
    started_there = None
    if cpu is not None:
        started_there = os.sched_getaffinity(0) == {cpu}
        try:
            _pin_process(cpu)
        except (OSError, ValueError) as e:
            print(f"bench --host: cannot pin to CPU {cpu}: {e}", file=sys.stderr)
            return 2
        if not started_there:
            print(f"bench --host: pinned to CPU {cpu} after start-up; the memory the interpreter and torch placed "
                  f"before may sit on another NUMA node (about half such runs were 1.5x slower on the H200's "
                  f"host): start the process with `taskset -c {cpu}` for stable numbers", file=sys.stderr)
    try:
        r = measure(device, backend, iters=iters, warmup=2 if getattr(args, "smoke", False) else 20)
        if cpu is not None:
            r["pinned_cpu"] = cpu
            r["started_on_pinned_cpu"] = started_there
    except (_dispatch.BackendUnavailable, ValueError) as e:
        print(f"bench --host: {e}", file=sys.stderr)
        return 2
    md = format_markdown(r)
    print(md)
    out = getattr(args, "out", None)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "host.md"), "w") as f:
            f.write(md)
        with open(os.path.join(out, "host.json"), "w") as f:
            json.dump(r, f, indent=1)
        print(f"wrote {os.path.join(out, 'host.md')}, {os.path.join(out, 'host.json')}")
    return 0 if all(v == "ok" for v in r["checks"].values()) else 1
