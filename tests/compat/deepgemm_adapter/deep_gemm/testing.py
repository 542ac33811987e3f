"""``deep_gemm.testing``: the helpers DeepGEMM's attention test imports, written for the adapter."""

from __future__ import annotations

import torch

__all__ = ["assert_bitwise_equal", "bench_kineto", "calc_diff", "count_bytes", "get_arch_major", "ignore_env",
           "test_filter"]


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity error: ``1 - 2 <x, y> / (|x|^2 + |y|^2)`` in float64 (0 for equal tensors)."""
    x, y = x.double(), y.double()
    denom = float((x * x + y * y).sum())
    if denom == 0:
        return 0.0
    return 1.0 - 2.0 * float((x * y).sum()) / denom


def count_bytes(*items) -> int:
    """Bytes of the tensors among ``items`` (tuples and lists are walked, ``None`` skipped)."""
    total = 0
    for t in items:
        if isinstance(t, (tuple, list)):
            total += count_bytes(*t)
        elif isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def get_arch_major() -> int:
    return torch.cuda.get_device_capability()[0]


def ignore_env(name: str, condition):
    """DeepGEMM's decorator that ignores an environment variable on some architectures: nothing to ignore here."""

    def wrap(fn):
        return fn

    return wrap


def test_filter(*args, **kwargs):  # noqa: D401 - DeepGEMM's name; selects tests by a pattern there
    """Always true: every test the caller asks for runs."""
    return True


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), what


def bench_kineto(fn, kernel_names, num_tests: int = 5, suppress_kineto_output: bool = False, **kwargs):
    """Median time of ``fn()`` in seconds over ``num_tests`` calls (CUDA events, after one warm-up call). DeepGEMM
    profiles named kernels; this library has one fused kernel per op (its ``-inf`` fill included), so every name
    of a tuple gets that same time."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(num_tests):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    t = sorted(times)[len(times) // 2]
    return tuple(t for _ in kernel_names) if isinstance(kernel_names, (tuple, list)) else t


