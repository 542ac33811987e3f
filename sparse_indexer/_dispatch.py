"""Backend resolution: one immutable table from (op, backend) to the implementation's import path.

Every op has the same implementation signature in every backend file
(``sparse_indexer/ops/<op>/{reference,triton,aiter}.py``): arguments already checked, outputs written in place.
``backend=None``/``"auto"`` tries the best available backend for the device, falling back to the next when one
raises :class:`NotImplementedError` for a case (before writing anything); an explicitly requested backend that
is not available raises :class:`BackendUnavailable`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["BACKENDS", "BackendUnavailable", "available", "candidates", "call", "unavailable_reason"]

BACKENDS = ("reference", "triton", "aiter", "cuda")
PARTIAL_BACKENDS = {"cuda": ("top_k_per_row",)}
"""Backends that implement only some ops: ``auto`` tries them for those ops only."""
OPS = ("write_k_cache", "gather_k_cache", "fp8_mqa_logits", "fp8_paged_mqa_logits", "top_k_per_row")


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here; the message says what is missing."""


@functools.cache
def _module_ok(name: str) -> str | None:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return f"{name} does not import ({type(e).__name__}: {e})"
    return None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unavailable_reason(backend: str, device: torch.device) -> str | None:
    """``None`` when ``backend`` can run on ``device``, else why not."""
    device = torch.device(device)
    if backend == "reference":
        return None
    if backend == "triton":
        why = _module_ok("triton")
        if why:
            return why
        if device.type == "cuda":
            return None
        if device.type == "cpu" and _interpret():
            return None
        return f"the Triton backend runs on CUDA/ROCm devices (or on the CPU with TRITON_INTERPRET=1), not {device}"
    if backend == "aiter":
        if device.type != "cuda" or torch.version.hip is None:
            return f"the aiter backend runs on ROCm GPUs only, not on {device} (torch.version.hip={torch.version.hip})"
        return _module_ok("aiter")
    if backend == "cuda":
        if device.type != "cuda" or torch.version.hip is not None:
            return f"the CUDA backend runs on NVIDIA GPUs only, not on {device} (torch.version.hip={torch.version.hip})"
        from .ops.top_k_per_row import cuda as topk_cuda

        return topk_cuda.unavailable_reason()
    return f"unknown backend {backend!r}; choose one of {BACKENDS} or 'auto'"


def available(device: torch.device | str) -> tuple[str, ...]:
    """The backends that can run on ``device``, best first (the order ``auto`` tries them)."""
    device = torch.device(device)
    order = ("aiter", "cuda", "triton", "reference") if device.type == "cuda" else ("reference",)
    return tuple(b for b in order if unavailable_reason(b, device) is None)


def candidates(op: str, backend: str | None, device: torch.device) -> tuple[str, ...]:
    """Backends to try for ``op``, in order."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    if backend is None or backend == "auto":
        return tuple(b for b in available(device) if op in PARTIAL_BACKENDS.get(b, (op,)))
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, 'auto' or None, got {backend!r}")
    why = unavailable_reason(backend, device)
    if why is not None:
        raise BackendUnavailable(f"backend {backend!r} is not available for {op}: {why}")
    return (backend,)


@functools.cache
def implementation(op: str, backend: str) -> Callable:
    module = importlib.import_module(f"sparse_indexer.ops.{op}.{backend}")
    return getattr(module, op)


OPTIONAL_SCRATCH = ("qk", "workspace")
"""Keyword arguments that only some backends take (scratch views); the others never see them."""


@functools.cache
def _params(fn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


class _Route(NamedTuple):
    """One candidate of a resolved call: the backend, its implementation (``None`` when it does not import:
    ``error`` says why) and the optional scratch keywords the implementation does not take."""

    name: str
    fn: Callable | None
    error: BaseException | None
    drop: frozenset


@functools.cache
def _routes(op: str, backend: str | None, device_type: str, interpret: bool | None, reason: Callable,
            impl: Callable) -> tuple[_Route, ...]:
    """The candidates of one (op, backend, device type), resolved once.

    Keyed by everything the resolution reads: the environment switch (``TRITON_INTERPRET``) and the
    functions that decide availability and import implementations (so a replaced one, e.g. a test's
    monkeypatch, is never served from an entry made with the original). Raises what :func:`candidates` raises
    (not cached)."""
    routes = []
    for name in candidates(op, backend, torch.device(device_type)):
        try:
            fn = impl(op, name)
        except (ImportError, AttributeError) as e:
            routes.append(_Route(name, None, e, frozenset()))
            continue
        drop = frozenset(k for k in OPTIONAL_SCRATCH if k not in _params(fn))
        routes.append(_Route(name, fn, None, drop))
    return tuple(routes)


def call(op: str, backend: str | None, device: torch.device, *args, **kwargs):
    """Run ``op`` on the first candidate backend that accepts the case.

    The candidates of ``(op, backend, device.type)`` are resolved once (:func:`_routes`); a call then costs a
    dictionary look-up before the implementation runs."""
    if backend is not None and type(backend) is not str:
        candidates(op, backend, device)  # raises the error that names the argument (and keeps it unhashed)
    dev_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    # TRITON_INTERPRET only decides whether Triton runs on a non-CUDA device (reading it costs ~0.5 us)
    interp = _interpret() if backend == "triton" and dev_type != "cuda" else None
    routes = _routes(op, backend, dev_type, interp, unavailable_reason, implementation)
    explicit = not (backend is None or backend == "auto")
    last = None
    for r in routes:
        if r.fn is None:
            if explicit:
                raise BackendUnavailable(f"backend {r.name!r} has no implementation of {op}: {r.error}") from r.error
            last = r.error
            continue
        kw = {k: v for k, v in kwargs.items() if k not in r.drop} if not r.drop.isdisjoint(kwargs) else kwargs
        try:
            return r.fn(*args, **kw)
        except NotImplementedError as e:
            if explicit:
                raise
            last = e
    names = tuple(r.name for r in routes)
    raise BackendUnavailable(f"no backend among {names} handles this {op} call: {last}")
