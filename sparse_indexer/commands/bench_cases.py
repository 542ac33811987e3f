"""What the benchmark's cases share (``python -m sparse_indexer bench``): the case record, the run context, the
case interface and input helpers. The cases of each op live beside it (``sparse_indexer/ops/<op>/bench.py``:
``specs(smoke)`` and ``build(spec, ctx)``); the harness (timing, floors, CLI, reports) is
:mod:`sparse_indexer.commands.bench`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..fp8 import quantize_q
from ..ops.write_k_cache import write_k_cache
from ..testing import topk_errors

__all__ = ["LOGITS_RTOL", "Case", "CaseSpec", "Ctx", "SweepEnv"]

LOGITS_RTOL = 1e-3  # relative L2 error allowed on in-window logits (float32 accumulation, any order)
HEADS, HEAD_DIM, BLOCK_SIZE = 64, 128, 64


@dataclass(frozen=True)
class CaseSpec:
    """One benchmark case: ``group`` (``--cases`` selects by group or key), ``key`` and a readable title."""

    group: str
    key: str
    title: str
    params: dict = field(default_factory=dict, hash=False, compare=False)


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def k_str(n: int) -> str:
    """``65536`` -> ``"64K"`` (case keys)."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


@dataclass
class Ctx:
    device: torch.device
    fp8: torch.dtype
    heads: int = HEADS
    head_dim: int = HEAD_DIM
    block_size: int = BLOCK_SIZE


@dataclass
class SweepEnv:
    """What ``python -m sparse_indexer bench --sweep NAME`` hands a kernel sweep (``ops/<op>/sweep.py``:
    ``run(env) -> (rows, results)``): the device, the bench's timer (``timer.times_us(fn, iters, warmup)``: CUDA
    events, L2 flushed; ``time.perf_counter`` on the CPU) and the floors it measured in the same run
    (``floors["bandwidth"]["value"]`` TB/s, ``floors["compute"]["value"]`` TFLOP/s, ``None`` when unmeasured),
    ``--smoke`` (tiny shapes, also on the CPU), ``--sections`` (``None``: all), ``--configs`` (the sweep's launch
    configurations, its own syntax; ``None``: its default list) and the vLLM anchor module (``--anchors``)."""

    device: torch.device
    timer: object
    floors: dict
    iters: int
    warmup: int
    smoke: bool
    sections: frozenset[str] | None = None
    configs: str | None = None
    anchors: object = None

    def median_us(self, fn: Callable[[], object]) -> float:
        """Median time of ``fn`` in microseconds (the bench's timer, ``iters`` after ``warmup``)."""
        return statistics.median(self.timer.times_us(fn, self.iters, self.warmup))

    def want(self, section: str) -> bool:
        return self.sections is None or section in self.sections


def take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` along dim 0, also for FP8 tensors (indexed through a uint8 view)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        return t.view(torch.uint8)[idx].view(t.dtype).contiguous()
    return t[idx].contiguous()


def spread(n: int, count: int, device) -> torch.Tensor:
    """Up to ``count`` distinct row indices spread over ``[0, n)``, first and last included."""
    return torch.linspace(0, n - 1, min(n, count)).round().long().unique().to(device)


def fill_cache(ctx: Ctx, cache: torch.Tensor, num_slots: int, chunk: int = 1 << 20) -> None:
    """Quantize random normal keys into slots ``[0, num_slots)`` (reference backend, in chunks)."""
    for t0 in range(0, num_slots, chunk):
        t1 = min(num_slots, t0 + chunk)
        k = torch.randn(t1 - t0, ctx.head_dim, device=ctx.device, dtype=torch.bfloat16)
        slots = torch.arange(t0, t1, device=ctx.device, dtype=torch.int64)
        write_k_cache(k, cache, slots, fp8_dtype=ctx.fp8, backend="reference")
        del k, slots


def queries(ctx: Ctx, rows: int):
    """FP8 queries ``[rows, H, D]`` and weights ``[rows, H]`` with the query scale folded in (docs/spec.md §5)."""
    h, d = ctx.heads, ctx.head_dim
    q8, q_scale = quantize_q(torch.randn(rows, h, d, device=ctx.device), fp8_dtype=ctx.fp8)
    weights = (torch.randn(rows, h, device=ctx.device) * (h ** -0.5) * (d ** -0.5) * q_scale).contiguous()
    return q8, weights


class Case:
    """A built case: inputs, a preallocated output, its traffic/FLOP model, a check against the reference."""

    unit = "TB/s"  # or "TFLOP/s"
    amount = 0.0  # bytes moved or FLOPs of one call
    note = ""

    def fn(self, backend: str) -> Callable[[], object]:
        raise NotImplementedError

    def reset(self) -> None:
        """Poison the output before a backend runs, so that cells it fails to write are caught."""

    def check(self, backend: str) -> tuple[bool, str]:
        raise NotImplementedError


def same_bytes_copy(amount: float, device) -> Callable[[], object]:
    half = max(1, int(amount) // 2)
    src = torch.ones(half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def topk_verdict(got, lg, s, e) -> tuple[bool, str]:
    """docs/spec.md §6 on a subset of rows (:func:`sparse_indexer.testing.topk_errors`): short rows exact, long rows
    the value multiset of the window's top-k."""
    errors = topk_errors(got, lg, s, e)
    first = f"; {errors[0]}" if errors else ""
    return not errors, f"{got.shape[0] - len(errors)}/{got.shape[0]} rows equal (multiset){first}"
