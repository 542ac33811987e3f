"""The backend registry: one table of every backend, from which everything that lists backends is derived.

An entry (:class:`Backend`) holds the backend's name, the ops it implements, where its implementation of an op
lives (``sparse_indexer/ops/<op>/<name>.py`` by default), whether it can run on a device, and where ``auto``
tries it. Dispatch (:mod:`sparse_indexer._runtime.dispatch`: ``backend=`` of every op, the ``auto`` order), the
benchmark's backend list (``python -m sparse_indexer bench``), the tests' ``backend`` parametrization and skips
(``tests/conftest.py``), the README's backend table (checked by ``tests/sparse_indexer/test_backends.py``) and
the size of the top-k workspace in the buffer plan (``Buffers.topk_scratch``: the widest ``topk_workspace`` of
the registered backends, :func:`topk_workspace_cols`) all read this table.

Adding a backend ``foo`` of one op: write ``sparse_indexer/ops/<op>/foo.py`` with a function named like the op
and the signature of ``reference.py`` (arguments already checked by the public function; write the outputs in
place; raise :class:`NotImplementedError` before writing anything for a case it does not handle, and ``auto``
tries the next backend), then add one :class:`Backend` entry to :data:`_BUILTIN` (or, outside this package,
call :func:`register`). A top-k that needs global scratch takes ``workspace=`` and declares its width per row
with ``topk_workspace=`` in its entry; the plan then holds it (nothing in ``buffers/`` changes). An
implementation of a fused op (``fp8_paged_mqa_topk``, ``fp8_mqa_topk``: scoring and selection in one call) that is
one kernel sets ``FUSED = True`` in its module: ``auto`` tries only those for these ops and otherwise composes the
scoring op and the top-k, each through its own ``auto`` (:data:`sparse_indexer._runtime.dispatch.COMPOSITIONS`).
Check it with :mod:`sparse_indexer.testing` and ``SPARSE_INDEXER_TEST_BACKENDS=foo``.

The table is process-wide state by design (as a dispatch table is): :func:`register` and :func:`unregister`
change it; each change bumps :data:`generation`, which the dispatch caches are keyed on.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._runtime.triton_compat import interpreting

__all__ = ["OPS", "Backend", "auto_order", "generation", "get", "names", "register", "topk_workspace_cols",
           "unregister"]

OPS = ("write_k_cache", "gather_k_cache", "fp8_mqa_logits", "fp8_paged_mqa_logits", "top_k_per_row",
       "fp8_mqa_topk", "fp8_paged_mqa_topk", "select_candidate_blocks")
"""Every op, in the order of a step (the fused ops, scoring and selection in one call, after the two they fuse)."""

ANY_DEVICE = "*"


@dataclass(frozen=True)
class Backend:
    """One backend.

    ``unavailable_reason(device)``: ``None`` when it can run on ``device`` (a ``torch.device``), else a sentence
    saying what is missing (it is shown to users in :class:`~sparse_indexer.BackendUnavailable`).
    ``auto``: the device types (``torch.device.type``; ``"*"`` for every type) on which ``backend=None``/``"auto"``
    tries it; ``rank``: its place there, lower first (ties: table order). ``ops``: the ops it implements
    (``None``: every op of :data:`OPS`). ``module``: the module holding its implementation of an op, formatted
    with ``op`` and ``name``; the function is named like the op. ``where``: where it runs (one line, as in the
    README's table). ``topk_workspace(limits)``: for a backend whose ``top_k_per_row`` uses the ``workspace=``
    argument, the int32 columns per row it needs for the steps an :class:`~buffers.IndexerLimits` allows (``None``:
    it uses none); the plan's ``topk_scratch`` has ``decode_batch_rows`` rows of the widest such width
    (:func:`topk_workspace_cols`). It must be a pure function of the limits and must not import ``buffers``.
    """

    name: str
    unavailable_reason: Callable[[torch.device], str | None]
    auto: tuple[str, ...] = ()
    rank: int = 0
    ops: tuple[str, ...] | None = None
    module: str = "sparse_indexer.ops.{op}.{name}"
    where: str = ""
    topk_workspace: Callable[..., int] | None = None  # (limits: IndexerLimits) -> int

    def __post_init__(self):
        if not self.name.isidentifier() or self.name == "auto":
            raise ValueError(f"backend name must be an identifier other than 'auto', got {self.name!r}")
        bad = [op for op in self.ops or () if op not in OPS]
        if bad:
            raise ValueError(f"backend {self.name!r}: unknown ops {bad}; choose from {OPS}")
        if self.topk_workspace is not None and not self.implements("top_k_per_row"):
            raise ValueError(f"backend {self.name!r}: topk_workspace= needs a backend that implements top_k_per_row")

    def implements(self, op: str) -> bool:
        return self.ops is None or op in self.ops

    def module_of(self, op: str) -> str:
        return self.module.format(op=op, name=self.name)


@functools.cache
def _module_ok(name: str) -> str | None:
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return f"{name} does not import ({type(e).__name__}: {e})"
    return None


def _triton_topk_workspace(limits) -> int:
    from .ops.top_k_per_row.workspace import workspace_cols  # imports nothing of the package

    return workspace_cols(limits)


def _reference_reason(device: torch.device) -> str | None:
    return None


def _triton_reason(device: torch.device) -> str | None:
    why = _module_ok("triton")
    if why:
        return why
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return None
    return f"the Triton backend runs on CUDA/ROCm devices (or on the CPU with TRITON_INTERPRET=1), not {device}"


def _aiter_reason(device: torch.device) -> str | None:
    if device.type != "cuda" or torch.version.hip is None:
        return f"the aiter backend runs on ROCm GPUs only, not on {device} (torch.version.hip={torch.version.hip})"
    return _module_ok("aiter")


def _cuda_reason(device: torch.device) -> str | None:
    if device.type != "cuda" or torch.version.hip is not None:
        return f"the CUDA backend runs on NVIDIA GPUs only, not on {device} (torch.version.hip={torch.version.hip})"
    from .ops.top_k_per_row import cuda as topk_cuda

    return topk_cuda.unavailable_reason()


def _gluon_reason(device: torch.device) -> str | None:
    if device.type != "cuda" or torch.version.hip is not None:
        return (f"the Gluon backend runs on NVIDIA Hopper GPUs only, not on {device} "
                f"(torch.version.hip={torch.version.hip})")
    if interpreting():
        return "the Gluon backend has no interpreter (TRITON_INTERPRET is set)"
    why = _module_ok("triton.experimental.gluon.language.nvidia.hopper")
    if why:
        return why
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"the Gluon backend's kernels use Hopper's wgmma and TMA (sm_90), not sm_{major}{minor}"
    return None


_BUILTIN = (
    Backend("reference", _reference_reason, auto=(ANY_DEVICE,), rank=30,
            where="CPU and GPU, pure torch"),
    Backend("triton", _triton_reason, auto=("cuda",), rank=20, topk_workspace=_triton_topk_workspace,
            where="NVIDIA (Hopper tested on an H200) and AMD GPUs; the CPU under `TRITON_INTERPRET=1`"),
    Backend("aiter", _aiter_reason, auto=("cuda",), rank=0,
            where="ROCm GPUs with AMD's aiter installed"),
    Backend("cuda", _cuda_reason, auto=("cuda",), rank=10,
            ops=("top_k_per_row", "fp8_paged_mqa_topk", "select_candidate_blocks", "fp8_paged_mqa_logits"),
            where="NVIDIA GPUs (sm_80+; the fused `fp8_paged_mqa_topk` and the paged logits on Hopper, sm_90), the "
                  "top-k ops and the paged logits"),
    Backend("gluon", _gluon_reason, auto=("cuda",), rank=15, ops=("fp8_mqa_logits", "fp8_paged_mqa_logits"),
            where="NVIDIA Hopper (sm_90), the logits ops only"),
)

_table: dict[str, Backend] = {b.name: b for b in _BUILTIN}
BUILTIN = tuple(b.name for b in _BUILTIN)
"""The backends that ship with the package, in table order."""
generation = 0
"""Bumped by every :func:`register`/:func:`unregister` (the dispatch caches are keyed on it)."""


def names() -> tuple[str, ...]:
    """Every registered backend, in table order (the built-in ones first, then registration order)."""
    return tuple(_table)


def get(name: str) -> Backend:
    """The entry of ``name``; ``ValueError`` naming the known backends when there is none."""
    try:
        return _table[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown backend {name!r}; choose one of {names()} or 'auto'") from None


def register(backend: Backend, *, replace: bool = False) -> Backend:
    """Add ``backend`` to the table (``replace=True``: also over an entry of the same name). Returns it."""
    global generation
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a Backend, got {type(backend).__name__}")
    if backend.name in _table and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered (pass replace=True)")
    _table[backend.name] = backend
    generation += 1
    return backend


def unregister(name: str) -> None:
    """Remove ``name`` from the table (a built-in backend included)."""
    global generation
    get(name)
    del _table[name]
    generation += 1


def auto_order(device_type: str) -> tuple[str, ...]:
    """The backends ``auto`` considers on devices of ``device_type``, best first (availability not checked)."""
    entries = [b for b in _table.values() if ANY_DEVICE in b.auto or device_type in b.auto]
    return tuple(b.name for b in sorted(entries, key=lambda b: b.rank))


def topk_workspace_cols(limits) -> int | None:
    """int32 columns per row of the top-k workspace (``Buffers.topk_scratch``) for ``limits``: the widest
    ``topk_workspace`` of the registered backends (``None`` when none declares one). :func:`buffers.plan.plan`
    calls this; the width depends on the table, so plan after registering a backend."""
    widths = []
    for b in _table.values():
        if b.topk_workspace is not None:
            w = b.topk_workspace(limits)
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"backend {b.name!r}: topk_workspace(limits) must return a positive int (int32 "
                                 f"columns per row), got {w!r}")
            widths.append(w)
    return max(widths, default=None)
