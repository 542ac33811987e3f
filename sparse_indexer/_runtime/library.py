"""The library's PyTorch custom ops: every op registered once, at import, under the ``sparse_indexer`` namespace.

Each op is a *mutating* op that returns ``None`` and lists exactly the tensors it writes in ``mutates_args``:

=========================  ==================================================================  =================
op                         schema (after ``sparse_indexer::``)                                 writes
=========================  ==================================================================  =================
``write_k_cache``          ``(k, kv_cache!, slot_mapping, str? scale_fmt, ScalarType fp8_dtype,  ``kv_cache``
                           str cache_scale="float32", str cache_order="flat", str
                           cache_values="fp8", *, str backend)``
``gather_k_cache``         ``(kv_cache, block_table, cu_seq_lens, out_k!, out_scale!,         ``out_k``,
                           str cache_scale="float32", str cache_order="flat", str             ``out_scale``
                           cache_values="fp8", *, str backend)``
``fp8_mqa_logits``         ``(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out!,   ``out``
                           bool clean, bool compressed=False, Tensor? q_scale=None, *, str
                           backend)`` (``q_scale``: MXFP4 operands)
``fp8_paged_mqa_logits``   ``(q, kv_cache, weights, context_lens, block_table, out!,          ``out``
                           bool clean, Tensor? indices=None, ScalarType?                      (and ``qk``)
                           cache_fp8_dtype=None, str cache_scale="float32", str
                           cache_order="flat", str cache_values="fp8", Tensor?
                           q_scale=None, *, str backend)``;
                           ``fp8_paged_mqa_logits_with_qk``: ``indices`` required (may be
                           ``None``), then ``str backend, qk!`` (aiter stage1's scratch; no
                           cache format: a call in any but the plain format passes no ``qk``)
``top_k_per_row``          ``(logits, row_starts, row_ends, out!, str backend)``;             ``out``
                           ``top_k_per_row_with_workspace`` adds ``workspace!`` (the split-   (and
                           row top-k's global scratch), ``top_k_per_row_with_candidates``     ``workspace``)
                           ``candidates, int candidate_block_size`` (read only)
``fp8_mqa_topk``            ``(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out!,   ``out`` (and
                           ScalarType? logits_dtype=None, *, str backend)``;                  ``logits``)
                           ``fp8_mqa_topk_with_logits``: ``(..., out!, str backend,
                           logits!)`` (the caller's scores scratch)
``fp8_paged_mqa_topk``      ``(q, kv_cache, weights, context_lens, block_table, out!,          ``out`` (and
                           ScalarType? logits_dtype=None, *, str backend)``;                  ``logits``,
                           ``fp8_paged_mqa_topk_with_logits``: ``(..., out!, str backend,     ``workspace``)
                           logits!)``; ``fp8_paged_mqa_topk_with_workspace``: ``(..., out!,
                           ScalarType? logits_dtype, str backend, workspace!)`` (the fused
                           kernels' scratch); ``fp8_paged_mqa_topk_with_logits_workspace``:
                           ``(..., out!, str backend, logits!, workspace!)``
``select_candidate_blocks`` ``(logits, row_starts, row_ends, out!, int block_size, *, str      ``out`` (and
                           backend)``; ``select_candidate_blocks_with_workspace``: ``(...,    ``workspace``)
                           out!, int block_size, str backend, workspace!)`` (block scores)
=========================  ==================================================================  =================

Arguments are plain tensors and scalars: a :class:`buffers.Buffers` record never crosses the op boundary (the
callers pass its views). ``kv_cache`` is always the 3-D ``[num_blocks, block_size, D + 4]`` view. ``backend``
is the name the caller asked for (``"auto"`` for ``None``); the op body resolves it with
:func:`sparse_indexer._runtime.dispatch.call`, which keeps the auto fallback between backends. The fake (meta)
implementation of every op does nothing: an op that returns ``None`` has no output to describe, and it never
touches real memory.

The public functions (``sparse_indexer.write_k_cache`` and the others) check their arguments and then call
:func:`call`, which picks one of three routes (a repeat call in plain eager mode whose tensors have the layout of
the op's last fully checked call checks only what can change and calls :func:`run_direct`: ``_checks.Layouts``):

* **through the custom op** ``torch.ops.sparse_indexer.<op>`` whenever anything could be watching or
  transforming the call: ``torch.compile``/``torch.export`` tracing (Dynamo), a ``TorchDispatchMode``
  (``FakeTensorMode``, ``make_fx``'s proxy mode, ``FunctionalTensorMode``, ``SchemaCheckMode``, user modes), a
  ``TorchFunctionMode`` other than ``torch.device(...)``'s, ``torch.jit.trace``, tensor subclasses (FakeTensor,
  FunctionalTensor, DTensor, ``nn.Parameter``, ...), meta tensors, or autograd (grad mode on and an input that
  requires grad). So ``torch.compile(fullgraph=True)`` sees one opaque node per call, and every mode sees the op;
* **the reference implementation directly** under ``torch.func`` transforms (``functionalize``, ``vmap``),
  which do not accept mutating custom ops;
* **the backend implementation directly** otherwise (:func:`runs_directly`: plain eager with plain tensors,
  the case of an engine's eager layers). The custom-op dispatch (argument re-binding, the autograd and
  ADInplaceOrView kernels, the Python implementation's wrapper) costs tens of microseconds per call and does
  nothing for a plain eager call of an op that returns ``None``; the result is the same bytes, and the
  version counters of the written tensors are bumped as the op's ADInplaceOrView kernel would. Under the
  autograd profiler the call is wrapped in ``record_function("sparse_indexer::<op>")``, so traces still name
  the op.

``tests/sparse_indexer/test_library.py`` checks each route (the op is seen under compile, every dispatch mode,
``torch.jit.trace``, subclasses, meta tensors and autograd; the implementation runs in plain eager) and
``tests/sparse_indexer/test_host_overhead.py`` bounds the added cost of the public function.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import dispatch as _dispatch

__all__ = ["NAMESPACE", "OPS", "bump_versions", "call", "functorch_active", "op", "plain_eager", "run_direct",
           "runs_directly"]

NAMESPACE = "sparse_indexer"
OPS = _dispatch.OPS
Tensor = torch.Tensor


def _run(name: str, backend: str, device: torch.device, *args, **kwargs) -> None:
    _dispatch.call(name, None if backend == "auto" else backend, device, *args, **kwargs)


def _format_extra(extra: dict, cache_scale: str, cache_order: str, cache_values: str = "fp8") -> dict:
    """``extra`` with the cache's scale encoding, byte order and value format added where they are not the
    backends' defaults (``"float32"``, ``"flat"``, ``"fp8"``: a plain call passes none)."""
    if cache_scale != "float32":
        extra["cache_scale"] = cache_scale
    if cache_order != "flat":
        extra["cache_order"] = cache_order
    if cache_values != "fp8":
        extra["cache_values"] = cache_values
    return extra


@torch.library.custom_op(f"{NAMESPACE}::write_k_cache", mutates_args=("kv_cache",))
def _write_k_cache(k: Tensor, kv_cache: Tensor, slot_mapping: Tensor, scale_fmt: Optional[str],
                   fp8_dtype: torch.dtype, cache_scale: str = "float32", cache_order: str = "flat",
                   cache_values: str = "fp8", *, backend: str) -> None:
    _run("write_k_cache", backend, k.device, k, kv_cache, slot_mapping, scale_fmt=scale_fmt, fp8_dtype=fp8_dtype,
         **_format_extra({}, cache_scale, cache_order, cache_values))


@torch.library.custom_op(f"{NAMESPACE}::gather_k_cache", mutates_args=("out_k", "out_scale"))
def _gather_k_cache(kv_cache: Tensor, block_table: Tensor, cu_seq_lens: Tensor, out_k: Tensor, out_scale: Tensor,
                    cache_scale: str = "float32", cache_order: str = "flat", cache_values: str = "fp8", *,
                    backend: str) -> None:
    _run("gather_k_cache", backend, kv_cache.device, kv_cache, block_table, cu_seq_lens, out_k=out_k,
         out_scale=out_scale, **_format_extra({}, cache_scale, cache_order, cache_values))


@torch.library.custom_op(f"{NAMESPACE}::fp8_mqa_logits", mutates_args=("out",))
def _fp8_mqa_logits(q: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor, cu_seqlen_ks: Tensor,
                    cu_seqlen_ke: Tensor, out: Tensor, clean: bool, compressed: bool = False,
                    q_scale: Optional[Tensor] = None, *, backend: str) -> None:
    # only compressed (MXFP4) calls pass it: the backends' default is full logits (FP8 operands)
    extra = {"compressed": True} if compressed else {}
    if q_scale is not None:
        extra["q_scale"] = q_scale
    _run("fp8_mqa_logits", backend, q.device, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out=out,
         clean=clean, **extra)


def _paged_extra(indices, cache_fp8_dtype) -> dict:
    """The optional arguments of the paged op that a call passes on only when set (the backends' defaults)."""
    extra = {} if indices is None else {"indices": indices}
    if cache_fp8_dtype is not None:
        extra["cache_fp8_dtype"] = cache_fp8_dtype
    return extra


@torch.library.custom_op(f"{NAMESPACE}::fp8_paged_mqa_logits", mutates_args=("out",))
def _fp8_paged_mqa_logits(q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor, block_table: Tensor,
                          out: Tensor, clean: bool, indices: Optional[Tensor] = None,
                          cache_fp8_dtype: Optional[torch.dtype] = None, cache_scale: str = "float32",
                          cache_order: str = "flat", cache_values: str = "fp8", q_scale: Optional[Tensor] = None,
                          *, backend: str) -> None:
    extra = _format_extra(_paged_extra(indices, cache_fp8_dtype), cache_scale, cache_order, cache_values)
    if q_scale is not None:
        extra["q_scale"] = q_scale
    _run("fp8_paged_mqa_logits", backend, q.device, q, kv_cache, weights, context_lens, block_table, out=out,
         clean=clean, **extra)


# The same op with the per-head scratch ``qk`` (aiter's stage1 kernel). A separate op rather than an optional
# mutated argument: torch 2.11's custom_op fails ("tuple index out of range") when an optional mutated
# argument is left out.
@torch.library.custom_op(f"{NAMESPACE}::fp8_paged_mqa_logits_with_qk", mutates_args=("out", "qk"))
def _fp8_paged_mqa_logits_with_qk(q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                                  block_table: Tensor, out: Tensor, clean: bool, indices: Optional[Tensor],
                                  backend: str, qk: Tensor) -> None:
    # (no cache format: a call in any format but the plain one passes no qk, which only aiter's stage1 kernel
    # reads)
    extra = {} if indices is None else {"indices": indices}
    _run("fp8_paged_mqa_logits", backend, q.device, q, kv_cache, weights, context_lens, block_table, out=out,
         clean=clean, qk=qk, **extra)


@torch.library.custom_op(f"{NAMESPACE}::top_k_per_row", mutates_args=("out",))
def _top_k_per_row(logits: Tensor, row_starts: Tensor, row_ends: Tensor, out: Tensor, backend: str) -> None:
    _run("top_k_per_row", backend, logits.device, logits, row_starts, row_ends, out=out)


# The candidate-restricted top-k (docs/spec.md §6a): candidates read, not written.
@torch.library.custom_op(f"{NAMESPACE}::top_k_per_row_with_candidates", mutates_args=("out",))
def _top_k_per_row_with_candidates(logits: Tensor, row_starts: Tensor, row_ends: Tensor, out: Tensor, backend: str,
                                   candidates: Tensor, candidate_block_size: int) -> None:
    _run("top_k_per_row", backend, logits.device, logits, row_starts, row_ends, out=out, candidates=candidates,
         candidate_block_size=candidate_block_size)


# The same op with the split-row top-k's global scratch (Triton, few rows); separate for the reason above.
@torch.library.custom_op(f"{NAMESPACE}::top_k_per_row_with_workspace", mutates_args=("out", "workspace"))
def _top_k_per_row_with_workspace(logits: Tensor, row_starts: Tensor, row_ends: Tensor, out: Tensor, backend: str,
                                  workspace: Tensor) -> None:
    _run("top_k_per_row", backend, logits.device, logits, row_starts, row_ends, out=out, workspace=workspace)


@torch.library.custom_op(f"{NAMESPACE}::select_candidate_blocks", mutates_args=("out",))
def _select_candidate_blocks(logits: Tensor, row_starts: Tensor, row_ends: Tensor, out: Tensor, block_size: int, *,
                             backend: str) -> None:
    _run("select_candidate_blocks", backend, logits.device, logits, row_starts, row_ends, out=out,
         block_size=block_size)


# The same op with its block-score scratch; separate for the reason above.
@torch.library.custom_op(f"{NAMESPACE}::select_candidate_blocks_with_workspace", mutates_args=("out", "workspace"))
def _select_candidate_blocks_with_workspace(logits: Tensor, row_starts: Tensor, row_ends: Tensor, out: Tensor,
                                            block_size: int, backend: str, workspace: Tensor) -> None:
    _run("select_candidate_blocks", backend, logits.device, logits, row_starts, row_ends, out=out,
         block_size=block_size, workspace=workspace)


def _dtype_extra(logits_dtype: Optional[torch.dtype]) -> dict:
    """``logits_dtype`` as the fused ops' keyword argument, only when set (the backends' default: float32)."""
    return {} if logits_dtype is None else {"logits_dtype": logits_dtype}


# The fused ops (scoring and selection in one call). The caller's logits (the scores scratch of composing
# backends; written by fused kernels only when given) and the fused kernels' workspace are mutated arguments that
# a call may leave out: one op per combination, for the reason above.
@torch.library.custom_op(f"{NAMESPACE}::fp8_mqa_topk", mutates_args=("out",))
def _fp8_mqa_topk(q: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor, cu_seqlen_ks: Tensor,
                  cu_seqlen_ke: Tensor, out: Tensor, logits_dtype: Optional[torch.dtype] = None, *,
                  backend: str) -> None:
    _run("fp8_mqa_topk", backend, q.device, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out=out,
         **_dtype_extra(logits_dtype))


@torch.library.custom_op(f"{NAMESPACE}::fp8_mqa_topk_with_logits", mutates_args=("out", "logits"))
def _fp8_mqa_topk_with_logits(q: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor, cu_seqlen_ks: Tensor,
                              cu_seqlen_ke: Tensor, out: Tensor, backend: str, logits: Tensor) -> None:
    _run("fp8_mqa_topk", backend, q.device, q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out=out,
         logits=logits)


@torch.library.custom_op(f"{NAMESPACE}::fp8_paged_mqa_topk", mutates_args=("out",))
def _fp8_paged_mqa_topk(q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor, block_table: Tensor,
                        out: Tensor, logits_dtype: Optional[torch.dtype] = None, *, backend: str) -> None:
    _run("fp8_paged_mqa_topk", backend, q.device, q, kv_cache, weights, context_lens, block_table, out=out,
         **_dtype_extra(logits_dtype))


@torch.library.custom_op(f"{NAMESPACE}::fp8_paged_mqa_topk_with_logits", mutates_args=("out", "logits"))
def _fp8_paged_mqa_topk_with_logits(q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                                    block_table: Tensor, out: Tensor, backend: str, logits: Tensor) -> None:
    _run("fp8_paged_mqa_topk", backend, q.device, q, kv_cache, weights, context_lens, block_table, out=out,
         logits=logits)


@torch.library.custom_op(f"{NAMESPACE}::fp8_paged_mqa_topk_with_workspace", mutates_args=("out", "workspace"))
def _fp8_paged_mqa_topk_with_workspace(q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                                       block_table: Tensor, out: Tensor, logits_dtype: Optional[torch.dtype],
                                       backend: str, workspace: Tensor) -> None:
    _run("fp8_paged_mqa_topk", backend, q.device, q, kv_cache, weights, context_lens, block_table, out=out,
         workspace=workspace, **_dtype_extra(logits_dtype))


@torch.library.custom_op(f"{NAMESPACE}::fp8_paged_mqa_topk_with_logits_workspace",
                         mutates_args=("out", "logits", "workspace"))
def _fp8_paged_mqa_topk_with_logits_workspace(q: Tensor, kv_cache: Tensor, weights: Tensor, context_lens: Tensor,
                                              block_table: Tensor, out: Tensor, backend: str, logits: Tensor,
                                              workspace: Tensor) -> None:
    _run("fp8_paged_mqa_topk", backend, q.device, q, kv_cache, weights, context_lens, block_table, out=out,
         logits=logits, workspace=workspace)


_DEFS = {
    "write_k_cache": _write_k_cache,
    "gather_k_cache": _gather_k_cache,
    "fp8_mqa_logits": _fp8_mqa_logits,
    "fp8_paged_mqa_logits": _fp8_paged_mqa_logits,
    "fp8_paged_mqa_logits_with_qk": _fp8_paged_mqa_logits_with_qk,
    "top_k_per_row": _top_k_per_row,
    "top_k_per_row_with_workspace": _top_k_per_row_with_workspace,
    "top_k_per_row_with_candidates": _top_k_per_row_with_candidates,
    "fp8_mqa_topk": _fp8_mqa_topk,
    "fp8_mqa_topk_with_logits": _fp8_mqa_topk_with_logits,
    "fp8_paged_mqa_topk": _fp8_paged_mqa_topk,
    "fp8_paged_mqa_topk_with_logits": _fp8_paged_mqa_topk_with_logits,
    "fp8_paged_mqa_topk_with_workspace": _fp8_paged_mqa_topk_with_workspace,
    "fp8_paged_mqa_topk_with_logits_workspace": _fp8_paged_mqa_topk_with_logits_workspace,
    "select_candidate_blocks": _select_candidate_blocks,
    "select_candidate_blocks_with_workspace": _select_candidate_blocks_with_workspace,
}


def _no_op_fake(*args, **kwargs) -> None:
    """Fake/meta implementation: the op only writes its ``mutates_args``; there is no output to describe."""
    return None


for _d in _DEFS.values():
    _d.register_fake(_no_op_fake)
del _d


def op(name: str):
    """The registered ``torch.ops.sparse_indexer.<name>.default`` overload."""
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def functorch_active(*tensors) -> bool:
    """True when any tensor is wrapped by a ``torch.func`` transform (functionalize, vmap, grad)."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
            return True
    return False


_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack  # user and infra (fake, proxy, functional) modes
_function_mode_on = torch._C._is_torch_function_mode_enabled
_functorch_level = torch._C._functorch.peek_interpreter_stack
_jit_tracing = torch._C._get_tracing_state
_grad_on = torch.is_grad_enabled
_profiling = torch._C._autograd._profiler_enabled


def _device_modes_only() -> bool:
    """Every active ``TorchFunctionMode`` is a ``torch.device(...)`` context (it only fills in the device of
    factory calls, and every implementation passes ``device=`` explicitly)."""
    from torch.utils._device import DeviceContext

    return all(isinstance(torch._C._get_function_stack_at(i), DeviceContext)
               for i in range(torch._C._len_torch_function_stack()))


def plain_eager() -> bool:
    """The mode half of :func:`runs_directly` (no tensor read): not while Dynamo traces, no dispatch mode, no
    torch-function mode other than ``torch.device(...)``, no ``torch.func`` transform, no ``torch.jit.trace``.
    The public functions test it before they use their memo of the last proven layout (``_checks.Layouts``)."""
    if _is_compiling() or _dispatch_modes() or _functorch_level() is not None or _jit_tracing() is not None:
        return False
    return not _function_mode_on() or _device_modes_only()


def runs_directly(device: torch.device, tensors) -> bool:
    """Whether a call on ``tensors`` (the op's arguments; non-tensors are skipped) may run the backend
    implementation directly.

    True only in plain eager mode, where the custom op would do nothing but dispatch (:func:`plain_eager`), every
    tensor exactly a ``torch.Tensor`` (no subclass), not on the meta device, and no input that autograd would
    record.
    """
    if _is_compiling() or _dispatch_modes() or _functorch_level() is not None or _jit_tracing() is not None:
        return False
    if _function_mode_on() and not _device_modes_only():
        return False
    if device.type == "meta":
        return False
    grad = _grad_on()
    for t in tensors:
        if type(t) is Tensor:
            if grad and t.requires_grad:
                return False
        elif isinstance(t, Tensor):  # a subclass: FakeTensor, FunctionalTensor, DTensor, Parameter, ...
            return False
    return True


_RECORD_NAMES = {name: f"{NAMESPACE}::{name}" for name in OPS}
# the keyword arguments each op writes (write_k_cache writes its positional kv_cache), as in mutates_args
_WRITES = {"write_k_cache": (), "gather_k_cache": ("out_k", "out_scale"), "fp8_mqa_logits": ("out",),
           "fp8_paged_mqa_logits": ("out", "qk"), "top_k_per_row": ("out", "workspace"),
           "fp8_mqa_topk": ("out", "logits"), "fp8_paged_mqa_topk": ("out", "logits", "workspace"),
           "select_candidate_blocks": ("out", "workspace")}
_MUTATED_OPTIONAL = ("logits", *_dispatch.OPTIONAL_SCRATCH)
"""The optional mutated keyword arguments, in the order the op variants name them (``<op>_with_<a>_<b>``)."""
_inference_mode = torch.is_inference_mode_enabled
_bump = torch._C._increment_version
_routes = _dispatch.routes
_invoke = _dispatch.invoke
_invoke_at = _dispatch.invoke_at
_first = _dispatch.first


def run_direct(name: str, backend: str | None, device: torch.device, args: tuple, kwargs: dict,
               written=(), memo: dict | None = None) -> None:
    """The direct route of :func:`call`: the backend implementation (:func:`_dispatch.invoke` on the resolved
    routes, auto fallback kept), inside a profiler range named ``sparse_indexer::<name>`` while a profiler records,
    then the version counters of ``written`` (a tuple or list of the tensors the call wrote; empty: the caller
    bumps them, :func:`bump_versions`) bumped as the op's ADInplaceOrView kernel would.

    ``memo``: a dict that lives as long as the layout of the call's tensors stays the same (the public functions
    keep one in their :class:`~.checks.Layouts` entry): the route ``auto`` picks (its ``auto_when``
    predicates read layouts only) is found once per backend argument and routes object, then run directly
    (:func:`_dispatch.invoke_at`).

    For a caller that has established :func:`runs_directly` for every tensor of the call: a public function
    after its checks, :func:`sparse_indexer.sparse_attn_indexer` once per layer for all its ops."""
    found = _routes(name, None if backend == "auto" else backend, device)
    i = None
    if memo is not None:
        hit = memo.get(backend)
        if hit is None or hit[0] is not found:  # a new backend argument, registry or monkeypatch: ask once
            # (routes whose auto_when reads the capture state are asked on every call)
            hit = memo[backend] = (found, None if _dispatch.graph_aware(found) else _first(found, backend, args,
                                                                                              kwargs))
        i = hit[1]
    if _profiling():
        with torch.autograd.profiler.record_function(_RECORD_NAMES[name]):
            if i is None:
                _invoke(found, name, backend, args, kwargs)
            else:
                _invoke_at(found, i, name, backend, args, kwargs)
    elif i is None:
        _invoke(found, name, backend, args, kwargs)
    else:
        _invoke_at(found, i, name, backend, args, kwargs)
    if written and not _inference_mode():
        _bump(written)


def _written(name: str, args: tuple, kwargs: dict) -> list:
    """The tensors op ``name`` writes among ``args``/``kwargs`` (its ``mutates_args``)."""
    written = [args[1]] if name == "write_k_cache" else []
    for k in _WRITES[name]:  # (a loop: a comprehension is a call before Python 3.12)
        t = kwargs.get(k)
        if t is not None:
            written.append(t)
    return written


def bump_versions(tensors) -> None:
    """Bump the version counters of ``tensors`` (a list or tuple) as the ops' ADInplaceOrView kernels do for the
    tensors they write (nothing under inference mode)."""
    if not _inference_mode():
        _bump(tensors)


def call(name: str, backend: str | None, device: torch.device, *args, **kwargs) -> None:
    """Run op ``name`` on checked arguments by one of the routes of the module docstring.

    ``args``/``kwargs`` follow the implementation signature of ``sparse_indexer/ops/<name>/reference.py``;
    ``device`` is the device of every tensor argument (the public function checked it).
    """
    if runs_directly(device, (*args, *kwargs.values())):
        run_direct(name, backend, device, args, kwargs, _written(name, args, kwargs))
        return
    if functorch_active(*args, *kwargs.values()):
        if backend not in (None, "auto", "reference"):
            raise _dispatch.BackendUnavailable(
                f"backend {backend!r} cannot run {name} under torch.func transforms; only 'reference' can")
        _dispatch.call(name, "reference", device, *args, **kwargs)
        return
    scratch = [k for k in _MUTATED_OPTIONAL if kwargs.get(k) is not None]
    target = f"{name}_with_{'_'.join(scratch)}" if scratch else name  # the op variant that mutates the scratch
    if kwargs.get("candidates") is not None:  # (never with a workspace: the candidate top-k needs none)
        target = "top_k_per_row_with_candidates"
    if target == "fp8_paged_mqa_logits_with_qk":  # (required arguments there: a mutated qk must follow them)
        kwargs.setdefault("indices", None)
    elif target == "fp8_paged_mqa_topk_with_workspace":  # (the same)
        kwargs.setdefault("logits_dtype", None)
    getattr(getattr(torch.ops, NAMESPACE), target)(*args, **kwargs, backend="auto" if backend is None else backend)
