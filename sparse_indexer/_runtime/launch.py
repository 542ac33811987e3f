"""Triton launches with the host work done once per specialization.

``kernel[grid](*args, **kwargs)`` (``JITFunction.run``) redoes, on every call, what only changes when the
kernel's *specialization* changes: it binds the arguments to the signature, specializes every argument (dtype,
16-byte alignment of pointers, divisibility by 16 and size class of integers), formats a cache key from the
specialization and the options, checks the globals the kernel read, and builds launch metadata for hooks. On an
H200's host that is 25-40 us per launch for this package's kernels, several times the launch itself.

:class:`Launcher` keeps the first launch of each specialization on that path (it compiles or finds the kernel
and launches it), remembers the compiled kernel under a key that determines the specialization, and from then
on calls the compiled kernel's launcher directly with the argument list ``JITFunction.run`` would pass (every
parameter of the signature in order, constexprs included: the launcher skips them). Usage mirrors Triton's::

    _LAUNCH = Launcher(_my_kernel)              # once, at import
    _LAUNCH[grid](x, y, n, BLOCK=128, num_warps=4)

The key holds everything Triton specializes on, or more (so two calls with one key always share a compiled
kernel): the current device; the keyword arguments (constexprs and options such as ``num_warps``) by name and
value; per tensor its dtype, whether it is a CUDA tensor and whether its data pointer is 16-byte aligned; per
integer whether it is 1, whether it is divisible by 16 and its size class (int32, int64 or uint64); the type of
other arguments (floats, bools; ``None``). A call with another specialization takes the full path once and is
bound in turn. Calls keep Triton's path whenever Triton's launch hooks or its debug mode are set (e.g. a
profiler), and always under ``TRITON_INTERPRET=1`` (an interpreted kernel has nothing to bind) and on ROCm
(where Triton also specializes pointers on their storage size).
"""

from __future__ import annotations

import functools

import torch

__all__ = ["LaunchConfig", "Launcher", "no_kernel_needed", "specialization_key"]

_Tensor = torch.Tensor
_I32_MIN, _I32_MAX, _I64_MAX = -(2**31), 2**31 - 1, 2**63 - 1


def _int_class(a: int) -> int:
    if a == 1:
        return 1
    if _I32_MIN <= a <= _I32_MAX:
        return 2 if a & 15 else 3
    if a > _I64_MAX:
        return 4 if a & 15 else 5
    return 6 if a & 15 else 7


def _prepare(args, ntensors: int | None = None) -> tuple[tuple, list]:
    """``(key, launch_args)``: the specialization key of ``args`` (see the module doc) and the arguments as the
    compiled launcher takes them (tensors as their data pointers). With ``ntensors``, the first ``ntensors``
    arguments are tensors and the rest ints (the wrappers' layout), which is cheaper to key."""
    if ntensors is not None:
        # plain loops, no comprehensions (each is a function call before Python 3.12): ~1 us for 11 arguments
        ptrs, key = [], []
        for a in args[:ntensors]:
            p = a.data_ptr()
            ptrs.append(p)
            key.append(a.dtype)
            key.append((not p & 15) + 2 * a.is_cuda)
        for a in args[ntensors:]:
            ptrs.append(a)
            if a == 1:
                key.append(2)
            elif _I32_MIN <= a <= _I32_MAX:
                key.append(not a & 15)  # True, False
            else:
                key.append(_int_class(a) + 8)  # 12..15: 64-bit classes
        return tuple(key), ptrs
    key = []
    out = list(args)
    for i, a in enumerate(args):
        t = type(a)
        if t is int:
            key.append(_int_class(a))
        elif isinstance(a, _Tensor):
            ptr = a.data_ptr()
            key.append((a.dtype, a.is_cuda, not ptr & 15))
            out[i] = ptr
        elif t is bool:
            key.append((bool, a))
        else:
            key.append(t)
    return tuple(key), out


def specialization_key(args) -> tuple:
    """A hashable key of ``args`` at least as fine as Triton's specialization of them (see the module doc)."""
    return _prepare(args)[0]


def _hooks_active(knobs) -> bool:
    """Whether Triton's launch hooks are set (a hook chain with entries, or a hook function), or its debug mode
    (which changes the compiled kernel: a binding made before it was switched on must not serve)."""
    if knobs is None or getattr(knobs.runtime, "debug", False):
        return True
    for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return True
    return False


class _Bound:
    """One compiled specialization: its launcher, function handle, packed metadata and constexpr values."""

    __slots__ = ("run", "function", "packed", "tail")

    def __init__(self, run, function, packed, tail):
        self.run = run
        self.function = function
        self.packed = packed
        self.tail = tail


_NOT_BINDABLE = object()


class LaunchConfig:
    """Constexprs and launch options of one kernel configuration, and its bindings (made by
    :meth:`Launcher.config`)."""

    __slots__ = ("kwargs", "bound")

    def __init__(self, kwargs: dict):
        self.kwargs = dict(kwargs)
        self.bound: dict = {}


def _raw_stream(dev: int) -> int:
    return torch._C._cuda_getCurrentRawStream(dev)


_cuda = torch.cuda


def _current_device() -> int:
    """``torch.cuda.current_device()`` without its lazy-init call once CUDA is initialised (~0.5 us a launch)."""
    if _cuda._initialized:
        return torch._C._cuda_getDevice()
    return _cuda.current_device()


class Launcher:
    """A ``@triton.jit`` kernel whose launches are bound once per specialization (see the module doc)."""

    def __init__(self, kernel):
        self.kernel = kernel
        # an interpreted kernel (TRITON_INTERPRET=1) has no compiled launcher: always Triton's own path. On ROCm
        # Triton also specializes each pointer on its storage size (buffer loads/stores with 32-bit offsets when
        # the storage is below 2 GiB), which the key does not hold: a kernel bound on a small tensor must not
        # serve a larger one, so ROCm keeps Triton's path too.
        self.bindable = (hasattr(kernel, "device_caches") and hasattr(kernel, "arg_names")
                         and torch.version.hip is None)
        self._bound: dict = {}
        try:
            from triton import knobs
        except ImportError:  # pragma: no cover - a Triton without knobs: keep Triton's path
            knobs = None
        self._knobs = knobs

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **kwargs) -> None:
        """``kernel[grid](*args, **kwargs)``, bound: ``args`` are the leading parameters (positional), ``kwargs``
        the rest (constexprs) and launch options; ``grid`` a tuple of 1 to 3 ints."""
        if not self.bindable or type(grid) is not tuple:
            self.kernel[grid](*args, **kwargs)
            return
        dev = _current_device()
        spec, launch_args = _prepare(args)
        self._launch(self._bound, (dev, tuple(kwargs.items()), spec), dev, grid, args, launch_args, kwargs)

    def config(self, **kwargs) -> LaunchConfig:
        """The constexprs and launch options of one configuration, for :meth:`launch_with` (make it once and keep
        it: the bindings of the configuration live in it)."""
        return LaunchConfig(kwargs)

    def launch_with(self, grid: tuple, cfg: LaunchConfig, args, ntensors: int | None = None) -> None:
        """``kernel[grid](*args, **cfg.kwargs)`` with the configuration made once (:meth:`config`): the cheapest
        call. ``ntensors``: the first ``ntensors`` of ``args`` are tensors and the rest ints (else any mix)."""
        if not self.bindable:
            self.kernel[grid](*args, **cfg.kwargs)
            return
        dev = _current_device()
        spec, launch_args = _prepare(args, ntensors)
        self._launch(cfg.bound, (dev, spec), dev, grid, args, launch_args, cfg.kwargs)

    def _launch(self, table: dict, key, dev: int, grid: tuple, args, launch_args: list, kwargs: dict) -> None:
        bound = table.get(key)
        if bound is None or bound is _NOT_BINDABLE or _hooks_active(self._knobs):
            compiled = self.kernel[grid](*args, **kwargs)
            if bound is None:
                table[key] = self._bind(compiled, len(args), kwargs)
            return
        n = len(grid)
        bound.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _raw_stream(dev), bound.function,
                  bound.packed, None, None, None, *launch_args, *bound.tail)

    def _bind(self, compiled, nargs: int, kwargs: dict):
        """The binding of ``compiled`` (what Triton's path returned), or ``_NOT_BINDABLE``."""
        if compiled is None or getattr(compiled, "function", None) is None or not hasattr(compiled, "run"):
            return _NOT_BINDABLE  # e.g. a compile still running asynchronously
        k = self.kernel
        names = k.arg_names
        constexprs = set(k.constexprs)
        tail = []
        for i in range(nargs, len(names)):
            if i not in constexprs:
                return _NOT_BINDABLE  # a runtime parameter passed by keyword: keep Triton's path
            name = names[i]
            if name in kwargs:
                tail.append(kwargs[name])
            else:
                default = k.signature.parameters[name].default
                if default is k.signature.empty:
                    return _NOT_BINDABLE
                tail.append(default)
        return _Bound(_with_encoded_maps(compiled.run), compiled.function, compiled.packed_metadata, tuple(tail))


def _with_encoded_maps(run):
    """``run`` (a compiled kernel's launcher) unchanged, or, for a Triton 3.6 NVIDIA launcher of a kernel that takes
    host ``TensorDescriptor`` arguments, a function with its signature that calls the C launch directly with
    each descriptor's encoded ``CUtensorMap`` kept on the descriptor object (encoded on its first launch with
    Triton's own ``make_tensordesc_arg``; sparse_indexer/_runtime/tma.py keeps the objects). Triton's launcher encodes
    every descriptor on every launch. Anything that does not look exactly like Triton 3.6's launcher (another
    version, global or profile scratch to allocate, descriptors without lowering metadata) keeps ``run``."""
    launch = getattr(run, "launch", None)
    code = getattr(launch, "__code__", None)
    if code is None or not launch.__closure__ or getattr(run, "global_scratch_size", 1) or \
            getattr(run, "profile_scratch_size", 1):
        return run
    cells = dict(zip(code.co_freevars, launch.__closure__))
    make = launch.__globals__.get("make_tensordesc_arg")
    try:
        raw = cells["launcher"].cell_contents
        metas = list(cells["tensordesc_meta"].cell_contents)
        positions = sorted(cells["tensordesc_indices"].cell_contents)
        coop, pdl = bool(run.launch_cooperative_grid), bool(run.launch_pdl)
    except (KeyError, ValueError, AttributeError, TypeError):
        return run
    if make is None or not positions or len(metas) != len(positions) or any(m is None for m in metas):
        return run
    descs = tuple(reversed(list(zip(positions, metas))))  # replaced from the last so positions stay valid

    def run_encoded(gx, gy, gz, stream, function, packed, launch_metadata, enter_hook, exit_hook, *args):
        args = list(args)
        for pos, meta in descs:
            d = args[pos]
            enc = getattr(d, "_si_encoded", None)
            if enc is None or enc[0] is not meta:
                enc = (meta, make(d, meta))
                d._si_encoded = enc
            args[pos:pos + 1] = enc[1]
        raw(gx, gy, gz, stream, function, coop, pdl, None, None, packed, launch_metadata, enter_hook, exit_hook,
            *args)

    return run_encoded


def no_kernel_needed(m: int, n: int, w: int, out: torch.Tensor, clean: bool) -> bool:
    """For the backends' kernel wrappers: ``True`` when a call of ``m`` queries, ``n`` keys and ``w`` logits columns
    needs no kernel, after doing what it does need: nothing without rows or columns; without keys (``compressed``
    only: a full ``out`` then has no column) every window is empty, so ``clean`` fills ``out`` with ``-inf``."""
    if m == 0 or w == 0:
        return True
    if n == 0:
        if clean:
            out.fill_(float("-inf"))
        return True
    return False
