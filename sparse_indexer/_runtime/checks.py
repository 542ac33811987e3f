"""Argument checks shared by the public entry points. Every check runs before anything is written.

The success path of every check reads tensor metadata only (no tensor op, no string built): messages are
formatted when a check fails. The value checks (:func:`values_in`, opt-in on GPUs) first test the whole
tensor's range with one reduction and fall back to the exact, masked test only when that range is out of
bounds, so a passing check costs one ``aminmax``. :class:`Layouts` lets a public op skip the layout checks of a
call whose tensors have the layout of its last fully checked call.
"""

from __future__ import annotations

import operator

import torch

from buffers.limits import CacheFormat

from ..fp8 import FP8_DTYPES

INDEX_DTYPES = (torch.int32,)

_Tensor = torch.Tensor
_grad_on = torch.is_grad_enabled
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


DEFAULT_CACHE_FP8 = torch.float8_e4m3fn
"""The FP8 format of a cache whose reader does not name one: what ``write_k_cache`` writes by default."""


def cache_format(name: str, dtype: torch.dtype, cache_fp8_dtype, *, mix: bool = True) -> torch.dtype:
    """The FP8 format of a cache read against ``name`` (an FP8 tensor of ``dtype``), docs/spec.md §4.

    A cache carries no format of its own, so its reader states it: ``cache_fp8_dtype`` (one of the FP8 dtypes),
    or ``None`` for :data:`DEFAULT_CACHE_FP8`. Without a statement ``dtype`` must be that default; a stated format
    that differs from ``dtype`` is the caller's explicit choice to mix formats (``mix``: the op can read a mix;
    the message offers it only then). Raises ``TypeError`` naming both.
    """
    if cache_fp8_dtype is None:
        if dtype != DEFAULT_CACHE_FP8:
            hint = (f", or cache_fp8_dtype={DEFAULT_CACHE_FP8} to score {dtype} against {DEFAULT_CACHE_FP8} keys on "
                    "purpose") if mix else ""
            raise TypeError(
                f"{name} is {dtype} but the cache is read as {DEFAULT_CACHE_FP8} (write_k_cache's default; the "
                f"cache bytes carry no format): pass cache_fp8_dtype={dtype} if the cache was written in "
                f"{dtype}{hint}")
        return DEFAULT_CACHE_FP8
    if cache_fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"cache_fp8_dtype must be one of {FP8_DTYPES} or None, got {cache_fp8_dtype!r}")
    return cache_fp8_dtype


DEFAULT_FORMAT = CacheFormat()
"""The format of a cache whose reader does not declare one: e4m3fn values, float32 scales, flat order."""


def read_format(name: str, dtype: torch.dtype, fmt, cache_fp8_dtype, *, mix: bool = True) -> CacheFormat:
    """The :class:`~buffers.CacheFormat` a reader reads a cache in (docs/spec.md §4): ``fmt`` (a declaration, a
    ``CacheFormat``), else ``cache_fp8_dtype`` (the shorthand for ``CacheFormat(fp8_dtype=...)``), else the
    default, which ``name`` (the reader's FP8 operand, of ``dtype``) must then match (:func:`cache_format`:
    ``TypeError`` naming both). Both given and disagreeing: ``ValueError``."""
    if fmt is None:
        fp8 = cache_format(name, dtype, cache_fp8_dtype, mix=mix)
        return DEFAULT_FORMAT if fp8 == DEFAULT_CACHE_FP8 else CacheFormat(fp8_dtype=fp8)
    if type(fmt) is not CacheFormat:
        raise TypeError(f"cache_format must be a CacheFormat (sparse_indexer.CacheFormat) or None, got "
                        f"{type(fmt).__name__}")
    if cache_fp8_dtype is not None and cache_fp8_dtype != fmt.fp8_dtype:
        raise ValueError(f"cache_fp8_dtype={cache_fp8_dtype} disagrees with cache_format.fp8_dtype={fmt.fp8_dtype} "
                         "(give one of them)")
    return fmt


def check_order(fmt: CacheFormat, block_size: int, head_dim: int) -> None:
    """The ``"preshuffled"`` order lays a block out in 16 x 16 tiles: its block size must be a multiple of 16; an
    MXFP4 ``"tiled:N,C,L"`` order needs runs of ``N`` keys in a block, chunks of ``C`` value bytes and ``L`` scale
    lanes that divide a key's bytes."""
    if fmt.order == "preshuffled" and (block_size % 16 or head_dim % 16):
        raise ValueError(f"a cache in the preshuffled order needs a block_size multiple of 16 (16 x 16 tiles), got "
                         f"block_size={block_size}")
    if fmt.mxfp4 and fmt.order != "flat":
        n, c, lanes = fmt.tile
        if block_size % n or (head_dim // 2) % c or (head_dim // 32) % lanes:
            raise ValueError(f"an MXFP4 cache in the order {fmt.order!r} needs a block_size multiple of {n} (runs of "
                             f"{n} keys), D / 2 = {head_dim // 2} a multiple of {c} and D / 32 = {head_dim // 32} of "
                             f"{lanes}; got block_size={block_size}")


def format_kwargs(fmt: CacheFormat, dtype: torch.dtype | None) -> dict:
    """The keyword arguments the backends of a cache reader take for ``fmt`` (each only when it is not the
    backends' default): ``cache_fp8_dtype`` when it differs from ``dtype`` (the reader's FP8 operand; ``None``: never
    passed), ``cache_scale`` unless ``"float32"``, ``cache_order`` unless ``"flat"``, ``cache_values`` unless ``"fp8"``.
    Empty for the plain case."""
    kw = {}
    if dtype is not None and fmt.fp8_dtype != dtype:
        kw["cache_fp8_dtype"] = fmt.fp8_dtype
    if fmt.scale != "float32":
        kw["cache_scale"] = fmt.scale
    if fmt.order != "flat":
        kw["cache_order"] = fmt.order
    if fmt.values != "fp8":
        kw["cache_values"] = fmt.values
    return kw


def selection(out, rows: int, device, logits, logits_dtype, dtypes, logits_shape: tuple) -> None:
    """The fused ops' checks of their selection and scores: ``out [rows, topk >= 1]`` int32 (unit last stride),
    ``logits_dtype`` one of ``dtypes``, and ``logits`` (optional) 2-D of shape ``logits_shape`` (``None``: any),
    in ``logits_dtype`` when both are given, else one of ``dtypes``."""
    tensor("out", out, ndim=2, dtypes=torch.int32, device=device, shape=(rows, None), last_contiguous=True)
    if out.shape[1] < 1:
        raise ValueError(f"out.shape[1] (topk) must be >= 1, got {out.shape[1]}")
    if logits_dtype is not None and logits_dtype not in dtypes:
        raise TypeError(f"logits_dtype must be one of {dtypes}, got {logits_dtype}")
    if logits is not None:
        tensor("logits", logits, ndim=2, dtypes=dtypes if logits_dtype is None else logits_dtype, device=device,
               shape=logits_shape, last_contiguous=True)


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


def values_wanted(check_values: bool | None, cpu: bool) -> bool:
    """:func:`want_value_checks` for a call whose layout a :class:`Layouts` memo proved (plain eager, plain
    tensors): ``cpu`` says whether the proven call's tensors were on the CPU."""
    return bool(check_values) or (check_values is None and cpu)


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


_HOST_VALUES = 32  # values_in reads up to this many values of a 1-D CPU tensor as a list (more: aminmax)


def values_in(name: str, t: torch.Tensor, lo: int | None, hi: int | None, what: str, mask=None) -> None:
    """Raise unless ``lo <= t < hi`` for every element (where ``mask``) of the integer tensor ``t``; names the first
    offender.

    ``mask`` is a bool tensor of ``t``'s shape, or a function returning one, and ``what`` a string or a function
    returning one: both are only built when some value lies outside the range (one ``aminmax`` of ``t``, or a
    list of its values for a few CPU values, decides that first)."""
    n = t.numel()
    if n == 0:
        return
    if n <= _HOST_VALUES and t.dim() == 1 and t.is_cpu:  # a few CPU values as Python ints: ~0.5 us vs 1.5
        vals = t.tolist()
        tmin, tmax = min(vals), max(vals)
    else:
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


def _guard_class():
    """PyTorch's C++ tensor-layout guard (``torch._C._dynamo.guards.TensorGuards``, what ``torch.compile``'s guards
    check: exact Python type, dispatch keys, dtype, device, sizes, strides, ``requires_grad``) or ``None`` where
    this PyTorch lacks it. One check of six tensors costs about 0.4 us against 2.5 us of attribute reads in Python
    (host overhead per call); :class:`Layouts` falls back to those reads when it is missing or refuses a layout."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except Exception:  # noqa: BLE001 - any failure: the Python reads
        return None
    return TensorGuards


_TensorGuards = _guard_class()


class Layouts:
    """One public op's memo of the layout of its last fully checked call (host overhead per call): per tensor argument
    (or ``None``) its dtype, shape, strides, device and byte extent, the non-tensor arguments the layout checks
    read (``key``), and values derived from them (``extra``: sizes, the cache layout).

    A later call whose tensors have exactly that layout (:meth:`match`: one C++ ``TensorGuards`` check where
    PyTorch has it, else plain attribute reads) passes every layout check the full checks would run (they read
    nothing else), so the op runs only what can change with the same layout: that no output's bytes overlap
    another argument's (data pointers), and the value checks where they are on. Only in plain eager mode with
    plain tensors (:func:`.library.plain_eager`; :meth:`remember` is called only when the call runs
    directly); anything else, or any miss, runs the full checks, which raise what they always raised. The memo
    holds no tensor (no reference keeps memory alive); replacing it is one attribute store, so concurrent callers
    see one whole entry or the other."""

    __slots__ = ("_last",)

    def __init__(self):
        self._last = None

    def remember(self, tensors: tuple, n_out: int, key=None, extra=None) -> None:
        """Keep the layout of ``tensors`` (the outputs first: ``n_out`` of them, each disjoint from every other
        argument) after every check of the call passed on plain tensors."""
        outs, ins, nones, present = [], [], [], []
        for i, t in enumerate(tensors):
            if t is None:
                nones.append(i)
                continue
            if type(t) is not _Tensor or is_traced(t):
                return
            ext = (_span(t)[1] - t.data_ptr()) if t.numel() else 0
            (outs if i < n_out else ins).append((i, t.dtype, t.shape, t.stride(), t.device, ext))
            present.append(t)
        if not present:
            return  # nothing to read back
        guard = None
        if _TensorGuards is not None:
            try:
                guard = _TensorGuards(*present, dynamic_dims_sizes=[list(t.shape) for t in present],
                                      dynamic_dims_strides=[list(t.stride()) for t in present])
            except Exception:  # noqa: BLE001 - a layout the guard refuses: the Python reads
                guard = None
        entries = tuple(outs + ins)  # the outputs first (their byte ranges are compared with every later one)
        pick = operator.itemgetter(*[e[0] for e in entries])
        if len(present) == 1:
            pick = (lambda f: lambda ts: (f(ts),))(pick)
        self._last = (key, entries, len(outs), tuple(nones), len(tensors), extra, guard, pick,
                      any(t.requires_grad for t in present))

    def match(self, tensors: tuple, key=None):
        """``(True, extra)`` when ``tensors`` (plain tensors or ``None`` as remembered; ``key`` equal) have the
        remembered layout and no output overlaps another argument's bytes, else ``(False, None)``: the caller
        then runs the full checks. The caller has checked :func:`~sparse_indexer._runtime.library.plain_eager`.

        A tensor that requires grad matches only outside grad mode (where the op would not be recorded), as in
        :func:`sparse_indexer._runtime.library.runs_directly`."""
        last = self._last
        if last is None or last[0] != key or len(tensors) != last[4]:
            return _MISS
        for i in last[3]:
            if tensors[i] is not None:
                return _MISS
        if last[8] and _grad_on():
            return _MISS
        guard = last[6]
        try:
            if guard is not None:
                if not guard.check(*last[7](tensors)):
                    return _MISS
            elif not _same_layout(tensors, last[1]):
                return _MISS
            if _overlap(tensors, last[1], last[2]):
                return _MISS  # maybe overlapping: the full checks name the tensors
        except RuntimeError:  # a tensor without storage (a functional wrapper outside its transform)
            return _MISS
        return True, last[5]


def _same_layout(tensors: tuple, entries: tuple) -> bool:
    """:meth:`Layouts.match` without the C++ guard: each remembered ``(i, dtype, shape, stride, device, extent)``
    read back from ``tensors[i]`` by attribute access (a tensor that requires grad only outside grad mode)."""
    grad = _grad_on()
    for i, dt, shape, stride, dev, _ in entries:
        t = tensors[i]
        if (type(t) is not _Tensor or t.dtype is not dt or t.shape != shape or t.stride() != stride
                or t.device != dev or (grad and t.requires_grad)):
            return False
    return True


def _overlap(tensors: tuple, entries: tuple, n_out: int) -> bool:
    """Whether an output's byte range (its remembered extent from its data pointer) may meet another output's or
    an input's; ``entries``: the outputs' then the inputs' ``(i, ..., extent)``, the first ``n_out`` outputs."""
    spans = []
    for k, e in enumerate(entries):
        ext = e[5]
        if not ext:
            continue
        if k >= n_out and not spans:
            return False  # no output bytes to meet
        lo = tensors[e[0]].data_ptr()
        for a, b in spans:
            if lo < b and a < lo + ext:
                return True
        if k < n_out:
            spans.append((lo, lo + ext))
    return False


_MISS = (False, None)
