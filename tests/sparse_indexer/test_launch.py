"""``sparse_indexer._runtime.launch.Launcher``: Triton launches bound once per specialization.

The bound path needs a GPU; here a stand-in kernel (the attributes of a ``JITFunction`` that the launcher reads,
and a compiled kernel that records its launches) checks the binding rules: the first call of a specialization
takes Triton's path, later calls of the same specialization call the compiled launcher with the argument list
``JITFunction.run`` passes (constexprs included, tensors as data pointers), and anything Triton specializes on
(dtype, pointer alignment, integer divisibility and size class, the value 1, constexprs and options) starts a
new binding. The real wrappers' argument lists are checked against their kernels' signatures.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

from sparse_indexer._runtime import launch as _launch
from sparse_indexer._runtime.launch import Launcher, specialization_key
from tests.cases import INTERPRET


class FakeCompiled:
    def __init__(self, log):
        self.function = 0xF00
        self.packed_metadata = (4, 1, 0)
        self.run = lambda *a: log.append(("bound", a))


def _fake_kernel():
    def sig(x_ptr, n, stride, BLOCK, FLAG=True):  # noqa: N803 - Triton's constexpr style
        pass

    log = []
    compiled = FakeCompiled(log)

    class Kernel:
        device_caches = {}
        arg_names = ["x_ptr", "n", "stride", "BLOCK", "FLAG"]
        constexprs = [3, 4]
        signature = inspect.signature(sig)

        def __getitem__(self, grid):
            def run(*a, **k):
                log.append(("jit", grid, a, k))
                return compiled

            return run

    return Kernel(), log


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 77, raising=False)


def test_binds_once_per_specialization(fake_gpu):
    kernel, log = _fake_kernel()
    launch = Launcher(kernel)
    assert launch.bindable
    x = torch.zeros(64)
    launch[(3,)](x, 32, 5, BLOCK=16)
    assert [e[0] for e in log] == ["jit"]
    launch[(4, 2)](x, 48, 7, BLOCK=16)  # same classes: 48 % 16 == 0, 7 is an odd int32
    assert log[-1] == ("bound", (4, 2, 1, 77, 0xF00, (4, 1, 0), None, None, None, x.data_ptr(), 48, 7, 16, True))

    def jit_again(*args, **kw):
        n = len(log)
        launch[(1,)](*args, **kw)
        return log[n][0] == "jit"

    assert jit_again(x[1:], 32, 5, BLOCK=16)  # pointer no longer 16-byte aligned
    assert jit_again(x.double(), 32, 5, BLOCK=16)  # dtype
    assert jit_again(x, 33, 5, BLOCK=16)  # not divisible by 16
    assert not jit_again(x, 35, 5, BLOCK=16)  # the same class as 33
    assert jit_again(x, 32, 1, BLOCK=16)  # the value 1
    assert jit_again(x, 2**40, 5, BLOCK=16)  # int64
    assert jit_again(x, 32, 5, BLOCK=32)  # constexpr
    assert jit_again(x, 32, 5, BLOCK=16, num_warps=8)  # launch option
    assert not jit_again(x, 32, 5, BLOCK=16)


def test_keyword_runtime_argument_hooks_and_callable_grid_keep_tritons_path(fake_gpu):
    kernel, log = _fake_kernel()
    launch = Launcher(kernel)
    x = torch.zeros(64)
    for _ in range(2):
        launch[(1,)](x, 32, stride=5, BLOCK=16)  # a runtime parameter by keyword: never bound
    assert [e[0] for e in log] == ["jit", "jit"]
    launch[(1,)](x, 32, 5, BLOCK=16)
    launch.launch(lambda meta: (1,), x, 32, 5, BLOCK=16)
    assert log[-1][0] == "jit"
    chain = types.SimpleNamespace(calls=[print])
    launch._knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(launch_enter_hook=chain,
                                                                        launch_exit_hook=None))
    launch[(1,)](x, 32, 5, BLOCK=16)
    assert log[-1][0] == "jit"  # a launch hook is set (a profiler): Triton's path, which calls it
    launch._knobs.runtime.launch_enter_hook = types.SimpleNamespace(calls=[])
    launch[(1,)](x, 32, 5, BLOCK=16)
    assert log[-1][0] == "bound"


def test_launch_with_a_config_binds_per_specialization(fake_gpu):
    kernel, log = _fake_kernel()
    launch = Launcher(kernel)
    cfg = launch.config(BLOCK=16, FLAG=False)
    x = torch.zeros(64)

    def kinds(*calls):
        n = len(log)
        for args in calls:
            launch.launch_with((2,), cfg, args, 1)
        return [e[0] for e in log[n:]]

    assert kinds((x, 32, 5), (x, 64, 7)) == ["jit", "bound"]
    assert log[-1] == ("bound", (2, 1, 1, 77, 0xF00, (4, 1, 0), None, None, None, x.data_ptr(), 64, 7, 16, False))
    assert kinds((x[1:], 32, 5), (x[1:], 48, 9)) == ["jit", "bound"]  # unaligned pointer: its own binding
    assert kinds((x, 32, 1), (x, 2**40, 5), (x, 2**40 + 16, 5)) == ["jit", "jit", "bound"]  # 1; int64 class
    assert kinds((x.double(), 32, 5)) == ["jit"]
    other = launch.config(BLOCK=32)
    launch.launch_with((2,), other, (x, 32, 5), 1)
    assert log[-1][0] == "jit" and log[-1][3] == {"BLOCK": 32}


def test_rocm_and_debug_mode_keep_tritons_path(fake_gpu, monkeypatch):
    """ROCm: Triton specializes pointers on their storage size too (not in the key), so nothing is bound there;
    Triton's debug mode (another compiled kernel) also keeps its path."""
    kernel, log = _fake_kernel()
    with monkeypatch.context() as m:
        m.setattr(torch.version, "hip", "6.4")
        assert not Launcher(kernel).bindable
    launch = Launcher(kernel)
    x = torch.zeros(64)
    launch[(1,)](x, 32, 5, BLOCK=16)
    launch._knobs = types.SimpleNamespace(runtime=types.SimpleNamespace(debug=True, launch_enter_hook=None,
                                                                        launch_exit_hook=None))
    launch[(1,)](x, 32, 5, BLOCK=16)
    assert [e[0] for e in log] == ["jit", "jit"]
    launch._knobs.runtime.debug = False
    launch[(1,)](x, 32, 5, BLOCK=16)
    assert log[-1][0] == "bound"


def test_interpreted_kernel_is_not_bound():
    calls = []

    class Interpreted:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(grid)

    launch = Launcher(Interpreted())
    assert not launch.bindable
    launch[(2,)](torch.zeros(1), 3)
    assert calls == [(2,)]


def test_specialization_key_separates_bool_and_one():
    assert specialization_key([True]) != specialization_key([1])
    assert specialization_key([1.0]) != specialization_key([1])
    assert specialization_key([None]) == specialization_key([None])


@pytest.mark.skipif(INTERPRET, reason="the interpreter's kernels are not bound")
def test_wrappers_pass_every_parameter_in_signature_order(monkeypatch):
    """Each wrapper's launch binds: its positional arguments then its keywords cover the kernel's signature,
    and the bound argument list equals the one ``JITFunction.run`` builds (``signature.bind`` + defaults)."""
    import sparse_indexer as si
    from sparse_indexer.ops.fp8_mqa_logits import triton as mqa
    from sparse_indexer.ops.fp8_paged_mqa_logits import triton as paged
    from sparse_indexer.ops.gather_k_cache import triton as gather
    from sparse_indexer.ops.write_k_cache import triton as write

    seen = {}

    def record(self, grid, cfg, args, ntensors=None):
        assert ntensors is None or (all(isinstance(a, torch.Tensor) for a in args[:ntensors])
                                    and all(type(a) is int for a in args[ntensors:]))
        seen[self.kernel.fn.__name__] = (self, tuple(args), cfg.kwargs)

    monkeypatch.setattr(Launcher, "launch_with", record)
    fn8 = torch.float8_e4m3fn
    kv = si.new_kv_cache(4, 16, 64)
    write.write_k_cache(torch.randn(5, 64), kv, torch.arange(5), scale_fmt="ue8m0", fp8_dtype=fn8)
    bt = torch.zeros(2, 3, dtype=torch.int32)
    gather.gather_k_cache(kv, bt, torch.tensor([0, 4, 9], dtype=torch.int32),
                          out_k=torch.zeros(9, 64, dtype=fn8), out_scale=torch.zeros(9))
    q = torch.zeros(3, 16, 64, dtype=fn8)
    ks = torch.zeros(3, dtype=torch.int32)
    mqa.fp8_mqa_logits(q, torch.zeros(7, 64, dtype=fn8), torch.zeros(7), torch.zeros(3, 16), ks, ks + 7,
                       out=torch.zeros(3, 7), clean=True)
    paged.fp8_paged_mqa_logits(torch.zeros(2, 2, 16, 64, dtype=fn8), kv, torch.zeros(4, 16),
                               torch.tensor([5, 9], dtype=torch.int32), bt, out=torch.zeros(4, 48), clean=False)
    assert len(seen) == 4, seen.keys()
    log = []
    for name, (launcher, args, kwargs) in seen.items():
        bound = launcher._bind(FakeCompiled(log), len(args), kwargs)
        assert isinstance(bound, _launch._Bound), name
        k = launcher.kernel
        params = {n: v for n, v in kwargs.items() if n in k.arg_names}
        ba = k.signature.bind(*args, **params)
        ba.apply_defaults()
        assert list(ba.arguments.values())[len(args):] == list(bound.tail), name
        assert len(args) + len(bound.tail) == len(k.arg_names), name


ENCODED: list = []


def make_tensordesc_arg(arg, meta):
    """Stand-in of Triton 3.6's ``make_tensordesc_arg`` (read from the launcher's globals: this module's)."""
    ENCODED.append((arg.name, meta["swizzle"]))
    return [f"map:{arg.name}", *arg.shape, *arg.strides]


class _Desc:
    def __init__(self, name):
        self.name, self.shape, self.strides = name, [8, 4], [4, 1]


def _triton36_launcher(raw, indices, metas, *, scratch=0):
    """A launcher with the structure of Triton 3.6's ``CudaLauncher``: ``launch`` a closure over the C launch, the
    descriptor positions and their lowering metadata."""
    launcher, tensordesc_indices, tensordesc_meta = raw, set(indices), metas

    def inner(*args):  # Triton's expands each descriptor here, on every launch
        return launcher, tensordesc_indices, tensordesc_meta, args

    return types.SimpleNamespace(launch=inner, global_scratch_size=scratch, profile_scratch_size=0,
                                 launch_cooperative_grid=False, launch_pdl=True)


def test_bound_launch_keeps_each_descriptors_encoded_map():
    """``_launch._with_encoded_maps``: a kernel taking host TMA descriptors is launched through the C launch with
    each descriptor replaced by its encoded map, shape and strides, encoded once per descriptor object (Triton 3.6
    encodes on every launch); a launcher of any other shape, or with scratch to allocate, is kept as it is."""
    calls = []
    run = _triton36_launcher(lambda *a: calls.append(a), [1, 3], [{"swizzle": 128}, {"swizzle": 0}])
    fast = _launch._with_encoded_maps(run)
    assert fast is not run
    ENCODED.clear()
    a, b = _Desc("a"), _Desc("b")
    for _ in range(3):
        fast(2, 1, 1, 7, 0xF00, "packed", None, None, None, "out", a, 5, b, 16)
    assert sorted(ENCODED) == [("a", 128), ("b", 0)]  # once per descriptor
    assert calls[-1] == (2, 1, 1, 7, 0xF00, False, True, None, None, "packed", None, None, None,
                         "out", "map:a", 8, 4, 4, 1, 5, "map:b", 8, 4, 4, 1, 16)
    fast(2, 1, 1, 7, 0xF00, "packed", None, None, None, "out", _Desc("c"), 5, b, 16)
    assert ENCODED[-1] == ("c", 128) and len(ENCODED) == 3 and calls[-1][14] == "map:c"
    scratch = _triton36_launcher(None, [1], [{"swizzle": 128}], scratch=64)
    assert _launch._with_encoded_maps(scratch) is scratch
    plain = types.SimpleNamespace(launch=lambda *a: None, global_scratch_size=0, profile_scratch_size=0)
    assert _launch._with_encoded_maps(plain) is plain
    no_meta = _triton36_launcher(None, [1], [None])
    assert _launch._with_encoded_maps(no_meta) is no_meta
