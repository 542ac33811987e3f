"""Backend resolution, derived from the registry (:mod:`sparse_indexer.backends`: name, ops, module,
availability check and ``auto`` order of every backend).

Every op has the same implementation signature in every backend file
(``sparse_indexer/ops/<op>/<backend>.py``): arguments already checked, outputs written in place.
``backend=None``/``"auto"`` tries the best available backend for the device, falling back to the next when one
raises :class:`NotImplementedError` for a case (before writing anything); an explicitly requested backend that
is not available raises :class:`BackendUnavailable`.

An implementation may carry an ``auto_when`` attribute: a predicate on the call's arguments (the
implementation's own signature, shapes only: no device read) that says whether ``auto`` should run it for this
call. ``auto`` passes the call on to the next candidate when it is false (no exception raised: a cheap size test,
e.g. a kernel whose launch costs more host time than its device time gains on small problems); an explicitly
requested backend always runs. Its answer is remembered for later calls of a layout the public function has
proven (:func:`sparse_indexer._runtime.library.run_direct`'s ``memo``), so it may read nothing but the tensors' dtypes,
shapes and strides and constants (a threshold changed at run time reaches a proven layout only after the
routes are resolved again: ``_dispatch._resolved.clear()`` and ``_dispatch._routes.cache_clear()``). A predicate
with a true ``graph_aware`` attribute may also read whether the current stream is capturing a CUDA graph (a
kernel whose launch costs more host time, taken at smaller sizes in a graph, where the host time is paid once):
its answers are never remembered (:func:`graph_aware`).

The fused ops (scoring and selection in one call: ``fp8_paged_mqa_topk``, ``fp8_mqa_topk``) have a
*composition* (:data:`COMPOSITIONS`, set by the op's public module): under ``auto`` only their fused
implementations (those whose module sets ``FUSED = True``) are tried, in ``auto`` order, and the composition,
which runs the scoring op and the top-k each through its own ``auto``, takes every call they leave (a fused
implementation that does not import, or raises :class:`NotImplementedError`, or whose ``auto_when`` is false). An
explicitly named backend runs its own implementation of the op (the reference, Triton and aiter ones compose that
backend's kernels).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import backends as _registry
from ..backends import OPS
from .triton_compat import interpreting

__all__ = ["BACKENDS", "COMPOSED", "COMPOSITIONS", "OPS", "BackendUnavailable", "available", "call", "candidates",
           "chosen", "compose", "first", "fused", "graph_aware", "invoke", "invoke_at", "routes", "unavailable_reason"]

BACKENDS = _registry.BUILTIN
"""The built-in backends (``sparse_indexer.BACKENDS``); :func:`sparse_indexer.backends.names` adds registered ones."""


def __getattr__(name: str):
    if name == "PARTIAL_BACKENDS":  # derived from the registry on every read (a registered backend included)
        return {n: b.ops for n in _registry.names() if (b := _registry.get(n)).ops is not None}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run here; the message says what is missing."""


def unavailable_reason(backend: str, device: torch.device) -> str | None:
    """``None`` when ``backend`` can run on ``device``, else why not (the registry entry's check)."""
    if backend not in _registry.names():
        return f"unknown backend {backend!r}; choose one of {_registry.names()} or 'auto'"
    return _registry.get(backend).unavailable_reason(torch.device(device))


def available(device: torch.device | str) -> tuple[str, ...]:
    """The backends that can run on ``device``, best first (the order ``auto`` tries them)."""
    device = torch.device(device)
    return tuple(b for b in _registry.auto_order(device.type) if unavailable_reason(b, device) is None)


def candidates(op: str, backend: str | None, device: torch.device) -> tuple[str, ...]:
    """Backends to try for ``op``, in order."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    if backend is None or backend == "auto":
        return tuple(b for b in available(device) if _registry.get(b).implements(op))
    if backend not in _registry.names():
        raise ValueError(f"backend must be one of {_registry.names()}, 'auto' or None, got {backend!r}")
    why = unavailable_reason(backend, device)
    if why is not None:
        raise BackendUnavailable(f"backend {backend!r} is not available for {op}: {why}")
    return (backend,)


def implementation(op: str, backend: str) -> Callable:
    """The function implementing ``op`` in ``backend`` (imported from the module its registry entry names)."""
    return _implementation(op, backend, _registry.generation)


@functools.cache
def _implementation(op: str, backend: str, generation: int) -> Callable:
    module = importlib.import_module(_registry.get(backend).module_of(op))
    return getattr(module, op)


OPTIONAL_SCRATCH = ("qk", "workspace")
"""Keyword arguments that only some backends take (scratch views); the others never see them."""
OPTIONAL_KWARGS = (*OPTIONAL_SCRATCH, "logits_dtype")
"""Every keyword argument an implementation may leave out of its signature (then it never sees it): the scratch
views and the fused ops' ``logits_dtype`` (the dtype of the scores a selection runs on when no ``logits`` is
given)."""
FORMAT_KWARGS = ("q_scale", "cache_values")
"""Keyword arguments that change what the operands are (MXFP4, docs/spec.md §3a): an implementation whose
signature lacks one (and takes no ``**kwargs``) is never called with it: ``auto`` passes the call on, a named
backend raises :class:`NotImplementedError`."""
_FORMAT_OPS = frozenset({"write_k_cache", "gather_k_cache", "fp8_mqa_logits", "fp8_paged_mqa_logits"})

COMPOSITIONS: dict[str, Callable] = {}
"""``op -> composition`` of the fused ops (see the module docstring): a function of the op's implementation
signature that runs the scoring op and the top-k through their own ``auto``; set with :func:`compose`."""
COMPOSED = "composed"
"""The name of a composition's route (what :func:`chosen` names when ``auto`` composes)."""


def compose(op: str, fn: Callable) -> None:
    """Make ``fn`` the composition of ``op`` (see the module docstring); the resolved routes are resolved again."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    COMPOSITIONS[op] = fn
    _resolved.clear()
    _routes.cache_clear()


def fused(op: str, backend: str) -> bool:
    """Whether ``backend``'s implementation module of ``op`` sets ``FUSED = True`` (``False`` when it does not
    import)."""
    try:
        module = importlib.import_module(_registry.get(backend).module_of(op))
    except Exception:  # noqa: BLE001 - a module that does not import has no fused implementation
        return False
    return getattr(module, "FUSED", False) is True


@functools.cache
def _params(fn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _refused(op: str, fn: Callable) -> frozenset:
    """The :data:`FORMAT_KWARGS` ``fn`` cannot take (empty for the ops that never get them, and for a
    ``**kwargs`` signature)."""
    if op not in _FORMAT_OPS:
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()):
        return frozenset()
    return frozenset(k for k in FORMAT_KWARGS if k not in _params(fn))


class _Route(NamedTuple):
    """One candidate of a resolved call: the backend, its implementation (``None`` when it does not import:
    ``error`` says why), the optional scratch keywords the implementation does not take and its ``auto_when``
    predicate (``None``: ``auto`` always runs it; see the module doc)."""

    name: str
    fn: Callable | None
    error: BaseException | None
    drop: frozenset
    when: Callable | None = None
    refuse: frozenset = frozenset()  # FORMAT_KWARGS the implementation cannot take (_refused)


@functools.cache
def _routes(op: str, backend: str | None, device_type: str, interpret: bool | None, reason: Callable,
            impl: Callable, generation: int) -> tuple[_Route, ...]:
    """The candidates of one (op, backend, device type), resolved once.

    Keyed by everything the resolution reads: the environment switch (``TRITON_INTERPRET``) and the
    functions that decide availability and import implementations (so a replaced one, e.g. a test's
    monkeypatch, is never served from an entry made with the original) and the registry's generation. Raises
    what :func:`candidates` raises (not cached)."""
    routes = []
    composition = COMPOSITIONS.get(op) if backend is None or backend == "auto" else None
    for name in candidates(op, backend, torch.device(device_type)):
        if composition is not None and not fused(op, name):
            continue  # auto of a fused op: its fused implementations only, then the composition
        try:
            fn = impl(op, name)
        except (ImportError, AttributeError) as e:
            routes.append(_Route(name, None, e, frozenset()))
            continue
        drop = frozenset(k for k in OPTIONAL_KWARGS if k not in _params(fn))
        routes.append(_Route(name, fn, None, drop, getattr(fn, "auto_when", None), _refused(op, fn)))
    if composition is not None:
        routes.append(_Route(COMPOSED, composition, None,
                             frozenset(k for k in OPTIONAL_KWARGS if k not in _params(composition))))
    return tuple(routes)


_resolved: dict = {}
"""``(op, backend, device) -> (generation, unavailable_reason, implementation, routes)``: :func:`routes`'s memo of
:func:`_routes`, one dictionary look-up per call (the ``functools`` key of seven items and ``device.type`` cost about
0.6 us of host time per call). An entry holds the functions it was made with and is used only while they
are still the module's (a test's monkeypatch is never served a stale entry), as :func:`_routes`'s key does."""


def routes(op: str, backend: str | None, device: torch.device) -> tuple[_Route, ...]:
    """The candidates of ``op`` for ``backend`` on ``device``, best first (:func:`_routes`, resolved once); raises
    what :func:`candidates` raises for an unknown or unavailable backend."""
    hit = _resolved.get((op, backend, device)) if backend is None or type(backend) is str else None
    if (hit is not None and hit[0] == _registry.generation and hit[1] is unavailable_reason
            and hit[2] is implementation):
        return hit[3]
    if backend is not None and type(backend) is not str:
        candidates(op, backend, device)  # raises the error that names the argument (and keeps it unhashed)
    dev_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    # TRITON_INTERPRET only decides whether Triton runs on a non-CUDA device (reading it costs ~0.5 us): such
    # routes are resolved on every call (tests switch it), the others are kept
    interp = interpreting() if backend == "triton" and dev_type != "cuda" else None
    gen, reason, impl = _registry.generation, unavailable_reason, implementation
    found = _routes(op, backend, dev_type, interp, reason, impl, gen)
    if interp is None and isinstance(device, torch.device):
        _resolved[(op, backend, device)] = (gen, reason, impl, found)
    return found


def invoke(found: tuple[_Route, ...], op: str, backend: str | None, args: tuple, kwargs: dict):
    """Run ``op`` on the first of ``found`` (:func:`routes`) that accepts the case: an explicitly named backend
    raises what it raises; ``None``/``"auto"`` tries the next on :class:`NotImplementedError` (raised before
    anything is written)."""
    r = found[0] if found else None
    if r is not None and r.fn is not None and not (r.refuse and not r.refuse.isdisjoint(kwargs)):
        # (the common case: the first candidate runs)
        kw = kwargs if not r.drop or r.drop.isdisjoint(kwargs) else {k: v for k, v in kwargs.items() if k not in r.drop}
        if r.when is not None and (backend is None or backend == "auto") and not r.when(*args, **kw):
            return _invoke_from(found, 1, op, backend, args, kwargs, None)  # auto passes the call on
        try:
            return r.fn(*args, **kw)
        except NotImplementedError as e:
            if not (backend is None or backend == "auto"):
                raise
            return _invoke_from(found, 1, op, backend, args, kwargs, e)
    return _invoke_from(found, 0, op, backend, args, kwargs, None)


def _invoke_from(found: tuple[_Route, ...], start: int, op: str, backend: str | None, args: tuple, kwargs: dict,
                 last: BaseException | None):
    """:func:`invoke` from candidate ``start`` on (``last``: why the earlier ones did not run)."""
    explicit = not (backend is None or backend == "auto")
    for r in found[start:]:
        if r.fn is None:
            if explicit:
                raise BackendUnavailable(f"backend {r.name!r} has no implementation of {op}: {r.error}") from r.error
            last = r.error
            continue
        if r.refuse and not r.refuse.isdisjoint(kwargs):  # (an implementation that cannot take MXFP4 operands)
            last = NotImplementedError(f"backend {r.name!r}'s {op} takes no {sorted(r.refuse & kwargs.keys())}")
            if explicit:
                raise last
            continue
        kw = {k: v for k, v in kwargs.items() if k not in r.drop} if not r.drop.isdisjoint(kwargs) else kwargs
        if r.when is not None and not explicit and not r.when(*args, **kw):
            continue  # auto: a call this backend leaves to the next one (its auto_when)
        try:
            return r.fn(*args, **kw)
        except NotImplementedError as e:
            if explicit:
                raise
            last = e
    names = tuple(r.name for r in found)
    raise BackendUnavailable(f"no backend among {names} handles this {op} call: {last}")


def graph_aware(found: tuple[_Route, ...]) -> bool:
    """Whether a route of ``found`` has an ``auto_when`` that reads the CUDA-graph capture state (its answer for a
    layout may change between calls: see the module doc)."""
    return any(getattr(r.when, "graph_aware", False) for r in found)


def first(found: tuple[_Route, ...], backend: str | None, args: tuple, kwargs: dict) -> int | None:
    """The index in ``found`` of the route :func:`invoke` tries first for this call (the first that imports and,
    under ``auto``, whose ``auto_when`` accepts the call); ``None`` when none does."""
    auto = backend is None or backend == "auto"
    for i, r in enumerate(found):
        if r.fn is None:
            continue
        if r.refuse and not r.refuse.isdisjoint(kwargs):
            if not auto:
                return i  # (invoke_at raises what it cannot take)
            continue
        if r.when is None or not auto:
            return i
        if r.when(*args, **{k: v for k, v in kwargs.items() if k not in r.drop}):
            return i
    return None


def chosen(found: tuple[_Route, ...], backend: str | None, args: tuple, kwargs: dict) -> _Route | None:
    """The route :func:`invoke` tries first for this call (:func:`first`); ``None`` when none does. For benchmarks
    that time an implementation alone."""
    i = first(found, backend, args, kwargs)
    return None if i is None else found[i]


def invoke_at(found: tuple[_Route, ...], i: int, op: str, backend: str | None, args: tuple, kwargs: dict):
    """:func:`invoke` when :func:`first` has already named route ``i`` for a call of this layout (its
    ``auto_when`` is not asked again: predicates read shapes only); ``auto`` still falls back past it on
    :class:`NotImplementedError`."""
    r = found[i]
    if r.refuse and not r.refuse.isdisjoint(kwargs):
        return _invoke_from(found, i, op, backend, args, kwargs, None)  # (raises, or auto passes it on)
    kw = kwargs if not r.drop or r.drop.isdisjoint(kwargs) else {k: v for k, v in kwargs.items() if k not in r.drop}
    try:
        return r.fn(*args, **kw)
    except NotImplementedError as e:
        if not (backend is None or backend == "auto"):
            raise
        return _invoke_from(found, i + 1, op, backend, args, kwargs, e)


def call(op: str, backend: str | None, device: torch.device, *args, **kwargs):
    """Run ``op`` on the first candidate backend that accepts the case.

    The candidates of ``(op, backend, device)`` are resolved once (:func:`routes`); a call then costs a
    dictionary look-up before the implementation runs (:func:`invoke`)."""
    return invoke(routes(op, backend, device), op, backend, args, kwargs)
