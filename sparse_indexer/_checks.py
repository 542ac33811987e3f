"""Argument checks shared by the public entry points. Every check runs before anything is written.

The success path of every check reads tensor metadata only (no tensor op, no string built): messages are
formatted when a check fails. The value checks (:func:`values_in`, opt-in on GPUs) first test the whole
tensor's range with one reduction and fall back to the exact, masked test only when that range is out of
bounds, so a passing check costs one ``aminmax``.
"""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPES

INDEX_DTYPES = (torch.int32,)

_Tensor = torch.Tensor
_Device = torch.device
_is_compiling = torch.compiler.is_compiling
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_functional = getattr(torch, "_is_functional_tensor", None)
_functorch_level = torch._C._functorch.peek_interpreter_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack


def _dtype_error(name: str, t: torch.Tensor, dtypes) -> TypeError:
    want = dtypes[0] if isinstance(dtypes, tuple) and len(dtypes) == 1 else dtypes
    return TypeError(f"{name} must have dtype {want}, got {t.dtype}")


def _shape_error(name: str, t: torch.Tensor, shape) -> ValueError:
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    return ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


def tensor(name: str, t, *, ndim: int | None = None, dtypes=None, device=None, shape=None,
           last_contiguous: bool = False, contiguous: bool = False) -> torch.Tensor:
    """Check one tensor argument; ``shape`` may hold ``None`` wildcards. Returns ``t``."""
    if not isinstance(t, _Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None:
        if type(dtypes) is tuple:
            if t.dtype not in dtypes:
                raise _dtype_error(name, t, dtypes)
        elif t.dtype != dtypes:
            raise _dtype_error(name, t, dtypes)
    if device is not None:
        if type(device) is not _Device:
            device = _Device(device)
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} (the device of the other inputs)")
    if shape is not None:
        have = t.shape
        if have != shape:  # equal: the common case, one comparison (else wildcards or a mismatch)
            if len(shape) != len(have):
                raise _shape_error(name, t, shape)
            for s, a in zip(shape, have):
                if s is not None and s != a:
                    raise _shape_error(name, t, shape)
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
    if last_contiguous:
        st = t.stride()
        if st and st[-1] != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must have unit stride in its last dimension, got strides {st}")
    return t


def fp8(name: str, t, **kw) -> torch.Tensor:
    return tensor(name, t, dtypes=FP8_DTYPES, **kw)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[start, end)`` that ``t`` can touch (``(0, 0)`` when empty); strides are never negative."""
    n = t.numel()
    if n == 0:
        return (0, 0)
    start = t.data_ptr()
    if t.is_contiguous():
        return start, start + n * t.element_size()
    extent = 1
    for s, st in zip(t.shape, t.stride()):
        extent += (s - 1) * st
    return start, start + extent * t.element_size()


def no_alias(out_name: str, out: torch.Tensor, **inputs) -> None:
    """Raise if ``out``'s bytes overlap any input's bytes (byte ranges, so disjoint views of one arena pass)."""
    if is_traced(out):
        return
    o0, o1 = _span(out)
    if o0 == o1:
        return
    dev = out.device
    for name, t in inputs.items():
        if t is None:
            continue
        i0, i1 = _span(t)
        if i0 < o1 and o0 < i1 and t.device == dev:
            raise ValueError(f"{out_name} overlaps the memory of input {name}; outputs must not alias inputs")


def disjoint(outputs: dict, inputs: dict) -> None:
    """Raise unless every output's bytes are disjoint from every other output's and every input's (inputs may
    overlap each other: reading twice is fine). ``None`` entries are skipped. One span per tensor and one
    sweep in address order, so checking a whole step's tensors costs about one :func:`no_alias` per tensor.

    The message names the output and the other tensor, as :func:`no_alias` does."""
    if _is_compiling():
        return
    careful = _functorch_level() is not None or _dispatch_modes() > 0  # wrapped or functional tensors possible
    spans = []
    for group, is_out in ((outputs, True), (inputs, False)):
        for name, t in group.items():
            if t is None:
                continue
            if (careful or type(t) is not _Tensor or t.is_meta) and is_traced(t):
                return
            n = t.numel()
            if n == 0:
                continue
            lo = t.data_ptr()
            if t.is_contiguous():
                hi = lo + n * t.element_size()
            else:
                hi = _span(t)[1]
            spans.append((lo, hi, is_out, name, t))
    spans.sort(key=_first)
    for a, b in zip(spans, spans[1:]):
        if b[0] < a[1]:
            break
    else:
        return  # no two spans overlap at all (the common case)
    open_ = []  # spans that may still overlap the next one (end beyond its start)
    for lo, hi, is_out, name, t in spans:
        open_ = [o for o in open_ if o[1] > lo]
        for o in open_:
            if (is_out or o[2]) and o[4].device == t.device:
                out_name, other = (name, o[3]) if is_out else (o[3], name)
                kind = "output" if (is_out and o[2]) else "input"
                raise ValueError(f"{out_name} overlaps the memory of {kind} {other}; outputs must not alias inputs "
                                 "or other outputs")
        open_.append((lo, hi, is_out, name, t))


def _first(x):
    return x[0]


def is_traced(t: torch.Tensor) -> bool:
    """True for fake, meta, functional or functorch-wrapped tensors, and while Dynamo traces."""
    if _is_compiling():
        return True
    if t.is_meta or _functorch_wrapped(t):
        return True
    if type(t) is not _Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(t, FakeTensor):
            return True
    return _functional(t) if _functional is not None else False


def want_value_checks(check_values: bool | None, *tensors: torch.Tensor) -> bool:
    """Whether to run checks that read tensor *values* (they synchronise with the device).

    ``None`` (the default) checks when every tensor is a plain CPU tensor: free there, and a GPU caller that
    builds its metadata on the host (as :func:`sparse_indexer.sparse_attn_indexer` does) has checked it already.
    ``True`` forces the checks (one device sync), ``False`` skips them.
    """
    if check_values is not None and not check_values:
        return False
    if check_values is None and not _is_compiling():
        for t in tensors:  # the default on a GPU (or meta) tensor: no value checks, decided without more reads
            if t is not None and not t.is_cpu:
                return False
    for t in tensors:
        if t is not None and is_traced(t):
            return False
    return True


def values_in(name: str, t: torch.Tensor, lo: int | None, hi: int | None, what: str, mask=None) -> None:
    """Raise unless ``lo <= t < hi`` for every element (where ``mask``); names the first offender.

    ``mask`` is a bool tensor of ``t``'s shape, or a function returning one, and ``what`` a string or a function
    returning one: both are only built when some value lies outside the range (one ``aminmax`` of ``t``
    decides that first)."""
    if t.numel() == 0:
        return
    tmin, tmax = torch.aminmax(t)
    if (lo is None or int(tmin) >= lo) and (hi is None or int(tmax) < hi):
        return
    if callable(mask):
        mask = mask()
    bad = torch.zeros_like(t, dtype=torch.bool)
    if lo is not None:
        bad |= t < lo
    if hi is not None:
        bad |= t >= hi
    if mask is not None:
        bad &= mask
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        where = idx[0] if len(idx) == 1 else list(idx)
        v = int(t[idx])
        rng = f"is >= {hi}" if lo is None else f"is < {lo}" if hi is None else f"is outside [{lo}, {hi})"
        what = what() if callable(what) else what
        raise ValueError(f"{name}[{where}] = {v} {rng}: {what}")
