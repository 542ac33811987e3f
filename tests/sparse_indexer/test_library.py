"""The custom ops of :mod:`sparse_indexer._runtime.library`: registration, ``torch.library.opcheck`` on every op
(including empty and non-contiguous inputs where the op allows them), and the eager overhead per call."""

from __future__ import annotations

import time

import pytest
import torch

import sparse_indexer as si
from sparse_indexer._runtime import dispatch as _dispatch
from sparse_indexer._runtime import library
from sparse_indexer.kcache import new_kv_cache
from sparse_indexer.ops.top_k_per_row import reference as topk_reference

FN = torch.float8_e4m3fn
H, D, BS = 16, 64, 16


def _fp8(*shape, g):
    return (torch.randn(*shape, generator=g) * 2).to(FN)


def _cache(nb=6, pad=0, four_d=False):
    kv = new_kv_cache(nb, BS, D, block_pad=pad)
    g = torch.Generator().manual_seed(1)
    si.write_k_cache(torch.randn(nb * BS, D, generator=g), kv, torch.arange(nb * BS))
    return kv


def _cases(device="cpu"):
    """(op name, args, kwargs) per case: plain, empty and non-contiguous where legal."""
    g = torch.Generator().manual_seed(0)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    kv = _cache()
    kv_pad = _cache(pad=8)  # padded block stride: a non-contiguous cache
    bt = torch.tensor([[3, 1, 4], [0, 5, 2]], dtype=torch.int32)
    big = torch.zeros(8, 200)  # outputs with a row stride larger than their width
    out = {
        "write_k_cache": [
            ((torch.randn(5, D, generator=g), new_kv_cache(4, BS, D), torch.tensor([0, 17, -1, 40, 63])),
             dict(scale_fmt="ue8m0", fp8_dtype=FN)),
            ((torch.randn(0, D), new_kv_cache(4, BS, D), torch.zeros(0, dtype=torch.int64)),
             dict(scale_fmt=None, fp8_dtype=FN)),
            ((torch.randn(5, 2 * D, generator=g)[:, ::2].contiguous()[:, :D], new_kv_cache(4, BS, D, block_pad=4),
              torch.tensor([0, 17, -1, 40, 63])), dict(scale_fmt="ue8m0", fp8_dtype=FN)),
        ],
        "gather_k_cache": [
            ((kv, bt, i32([0, 20, 45])), dict(out_k=torch.zeros(50, D, dtype=FN), out_scale=torch.zeros(50))),
            ((kv, bt[:0], i32([0])), dict(out_k=torch.zeros(0, D, dtype=FN), out_scale=torch.zeros(0))),
            ((kv_pad, bt, i32([0, 20, 45])),
             dict(out_k=torch.zeros(50, 2 * D, dtype=torch.uint8).view(FN)[:, :D], out_scale=torch.zeros(50))),
        ],
        "fp8_mqa_logits": [
            ((_fp8(6, H, D, g=g), _fp8(30, D, g=g), torch.rand(30) + 0.1, torch.randn(6, H),
              i32([0, 0, 5, 10, 10, 29]), i32([3, 30, 5, 20, 30, 30])), dict(out=torch.zeros(6, 30), clean=True)),
            ((_fp8(0, H, D, g=g), _fp8(0, D, g=g), torch.zeros(0), torch.zeros(0, H), i32([]), i32([])),
             dict(out=torch.zeros(0, 0), clean=False)),
            ((_fp8(6, 2 * H, D, g=g)[:, ::2], _fp8(30, D, g=g), torch.rand(30), torch.randn(6, 2 * H)[:, :H],
              i32([0, 0, 5, 10, 10, 29]), i32([3, 30, 5, 20, 30, 30])), dict(out=big[:6, :30], clean=True)),
        ],
        "fp8_paged_mqa_logits": [
            ((_fp8(2, 2, H, D, g=g), kv, torch.randn(4, H), i32([40, 7]), bt), dict(out=torch.zeros(4, 48),
                                                                                      clean=True)),
            ((_fp8(0, 2, H, D, g=g), kv, torch.randn(0, H), i32([]), bt[:0]), dict(out=torch.zeros(0, 48),
                                                                                   clean=True)),
            ((_fp8(2, 2, 2 * H, D, g=g)[:, :, ::2], kv_pad, torch.randn(4, 2 * H)[:, :H], i32([[39, 40], [0, 7]]),
              bt), dict(out=big[:4, :48], clean=False)),
        ],
        "top_k_per_row": [
            ((torch.randn(5, 40, generator=g), i32([0, 3, 0, 10, 5]), i32([40, 3, 2, 35, 40])),
             dict(out=torch.zeros(5, 8, dtype=torch.int32))),
            ((torch.randn(0, 40), i32([]), i32([])), dict(out=torch.zeros(0, 8, dtype=torch.int32))),
            ((big[:5, :40].normal_(generator=g), i32([0, 3, 0, 10, 5]), i32([40, 3, 2, 35, 40])),
             dict(out=torch.zeros(5, 16, dtype=torch.int32)[:, :8])),
        ],
    }
    return [(name, i, a, k) for name, cases in out.items() for i, (a, k) in enumerate(cases)]


def _op_args(name, args, kwargs):
    """Arguments of the registered op (the 3-D cache view, as the public function passes it)."""
    args = tuple(si.kcache.as_3d(a) if name != "top_k_per_row" and a is not None and a.dtype == torch.uint8
                 and a.dim() in (3, 4) and a.shape[-1] == D + 4 else a for a in args)
    return args, dict(kwargs, backend="reference")


def test_every_op_registered_once_under_one_namespace():
    for name in _dispatch.OPS:
        op = library.op(name)
        assert op.namespace == "sparse_indexer"
        schema = op._schema
        assert len(schema.returns) == 0, f"{name} must return None"
        mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        want = {"write_k_cache": {"kv_cache"}, "gather_k_cache": {"out_k", "out_scale"}}.get(name, {"out"})
        assert mutated == want, f"{name} mutates {mutated}, expected {want}"
        assert [a.name for a in schema.arguments][-1] == "backend"
    qk_op = library.op("fp8_paged_mqa_logits_with_qk")  # the variant with aiter stage1's per-head scratch
    args = qk_op._schema.arguments
    assert {a.name for a in args if a.alias_info is not None and a.alias_info.is_write} == {"out", "qk"}
    assert [a.name for a in args][-2:] == ["backend", "qk"]
    ws_op = library.op("top_k_per_row_with_workspace")  # the variant with the split-row top-k's scratch
    args = ws_op._schema.arguments
    assert {a.name for a in args if a.alias_info is not None and a.alias_info.is_write} == {"out", "workspace"}
    assert [a.name for a in args][-2:] == ["backend", "workspace"]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"{c[0]}-{['plain', 'empty', 'strided'][c[1]]}")
def test_opcheck(case):
    name, _, args, kwargs = case
    a, k = _op_args(name, args, kwargs)
    _opcheck(name, a, k)


NO_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8).clone() if t.numel() else t.view(torch.uint8).clone()


def _opcheck(name, a, k):
    """``opcheck`` with every test util. Its ``test_schema`` compares tensors with ops that PyTorch does not
    implement for float8 on the CPU, so for cases with FP8 tensors on the CPU it is replaced by the same check
    done bytewise: every argument not in ``mutates_args`` is unchanged after the call."""
    op = library.op(name)
    tensors = {**{f"arg{i}": t for i, t in enumerate(a)}, **k}
    has_fp8 = any(isinstance(t, torch.Tensor) and t.dtype in (FN, torch.float8_e4m3fnuz) for t in tensors.values())
    if not has_fp8 or a[0].device.type != "cpu":
        torch.library.opcheck(op, a, k)
        return
    torch.library.opcheck(op, a, k, test_utils=NO_SCHEMA)
    schema = op._schema
    mutated = {i for i, arg in enumerate(schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write}
    names = [arg.name for arg in schema.arguments]
    flat = list(a) + [k.get(n) for n in names[len(a):]]
    keep = {i: _bytes(t) for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and i not in mutated}
    op(*a, **k)
    for i, before in keep.items():
        assert torch.equal(_bytes(flat[i]), before), f"{name} wrote its input {names[i]}, not in mutates_args"


# ------------------------------------------------------------------ routes: op, reference, or implementation
def _topk_args(g=None, **kw):
    logits = torch.randn(2, 10, generator=g, **kw)
    rs = torch.zeros(2, dtype=torch.int32)
    re_ = torch.tensor([10, 6], dtype=torch.int32)
    return logits, rs, re_, torch.full((2, 4), 7, dtype=torch.int32)


@pytest.fixture
def spies(monkeypatch):
    """Records each call of the custom op ``top_k_per_row`` (through ``torch.ops``) and of an implementation
    (through ``_dispatch.implementation``, which every route uses)."""
    seen = []
    real_op = torch.ops.sparse_indexer.top_k_per_row
    real_impl = _dispatch.implementation

    class OpSpy:
        def __call__(self, *a, **k):
            seen.append(("op", k["backend"]))
            return real_op(*a, **k)

    def impl(op, backend):
        fn = real_impl(op, backend)

        def spy(*a, **k):
            seen.append(("impl", backend))
            return fn(*a, **k)

        return spy

    monkeypatch.setattr(torch.ops.sparse_indexer, "top_k_per_row", OpSpy())
    monkeypatch.setattr(_dispatch, "implementation", impl)
    return seen


def _want_topk(logits, rs, re_, out):
    want = out.clone()
    topk_reference.top_k_per_row(logits, rs, re_, out=want)
    return want


def test_plain_eager_runs_the_implementation_directly(spies):
    args = _topk_args(torch.Generator().manual_seed(0))
    want = _want_topk(*args)
    v = args[3]._version
    si.top_k_per_row(*args[:3], out=args[3])
    assert spies == [("impl", "reference")]
    assert torch.equal(args[3], want)
    assert args[3]._version > v  # autograd sees the write, as through the op
    spies.clear()
    with torch.inference_mode():
        si.top_k_per_row(*args[:3], out=args[3], backend="reference")
    assert spies == [("impl", "reference")]
    spies.clear()
    with torch.device("cpu"):  # a DeviceContext is the one torch-function mode that keeps the direct route
        si.top_k_per_row(*args[:3], out=args[3])
    assert spies == [("impl", "reference")]


def test_dispatch_mode_sees_the_op(spies):
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    args = _topk_args(torch.Generator().manual_seed(1))
    want = _want_topk(*args)
    with Log():
        si.top_k_per_row(*args[:3], out=args[3])
    assert ("op", "auto") in spies
    assert "sparse_indexer.top_k_per_row.default" in ops
    assert torch.equal(args[3], want)


def test_torch_function_mode_sees_the_op(spies):
    from torch.overrides import TorchFunctionMode

    funcs = []

    class Log(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            funcs.append(str(func))
            return func(*args, **(kwargs or {}))

    args = _topk_args(torch.Generator().manual_seed(2))
    with Log():
        si.top_k_per_row(*args[:3], out=args[3])
    assert spies[0] == ("op", "auto")


def test_fake_and_meta_tensors_take_the_op(spies):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = _topk_args()
        si.top_k_per_row(*args[:3], out=args[3])
    assert spies == [("op", "auto")]  # the fake ran, no implementation
    spies.clear()
    meta = [t.to("meta") for t in _topk_args()]
    si.top_k_per_row(*meta[:3], out=meta[3])
    assert spies == [("op", "auto")]


def test_subclass_and_autograd_inputs_take_the_op(spies):
    logits, rs, re_, out = _topk_args(torch.Generator().manual_seed(3))
    si.top_k_per_row(torch.nn.Parameter(logits, requires_grad=False), rs, re_, out=out)
    assert spies[0] == ("op", "auto")
    spies.clear()
    si.top_k_per_row(logits.requires_grad_(), rs, re_, out=out)
    assert spies[0] == ("op", "auto")
    spies.clear()
    with torch.no_grad():  # autograd records nothing: the direct route again
        si.top_k_per_row(logits, rs, re_, out=out)
    assert spies == [("impl", "reference")]


def test_torch_func_runs_the_reference(spies):
    args = _topk_args(torch.Generator().manual_seed(4))
    want = _want_topk(*args)

    def f(logits, rs, re_, out):
        si.top_k_per_row(logits, rs, re_, out=out)
        return out

    got = torch.func.functionalize(f)(*args)
    assert spies == [("impl", "reference")]  # not through the op: functorch refuses mutating custom ops
    assert torch.equal(got, want)


def test_tracers_record_the_op():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(logits, rs, re_, out):
        si.top_k_per_row(logits, rs, re_, out=out)
        return out

    args = _topk_args(torch.Generator().manual_seed(5))
    gm = make_fx(f, tracing_mode="fake")(*args)
    assert any(n.target is library.op("top_k_per_row") for n in gm.graph.nodes)
    with pytest.warns(Warning):  # the checks read shapes: the tracer warns that they become constants
        traced = torch.jit.trace(f, args, check_trace=False)
    assert "sparse_indexer::top_k_per_row" in str(traced.graph)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(*args)
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert len(graphs) == 1 and targets == [torch.ops.sparse_indexer.top_k_per_row], targets  # one opaque node


def test_profiler_names_the_direct_call():
    args = _topk_args(torch.Generator().manual_seed(6))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        si.top_k_per_row(*args[:3], out=args[3])
    assert "sparse_indexer::top_k_per_row" in {e.key for e in prof.key_averages()}


def test_runs_directly_predicate():
    t = torch.zeros(2)
    cpu = torch.device("cpu")
    assert library.runs_directly(cpu, (t, None, t))
    assert not library.runs_directly(torch.device("meta"), (t,))
    assert not library.runs_directly(cpu, (torch.nn.Parameter(t, requires_grad=False),))
    assert not library.runs_directly(cpu, (t.clone().requires_grad_(),))
    with torch.no_grad():
        assert library.runs_directly(cpu, (t.clone().requires_grad_(),))


def test_dispatch_resolution_follows_replaced_functions(monkeypatch):
    """The resolved routes are cached, keyed by the functions that resolve them: replacing one (as a test
    does) is seen at once, and restoring it brings the original routes back."""
    args = _topk_args(torch.Generator().manual_seed(7))
    si.top_k_per_row(*args[:3], out=args[3], backend="reference")
    calls = []
    real = _dispatch.implementation

    def impl(op, backend):
        fn = real(op, backend)
        return lambda *a, **k: (calls.append(backend), fn(*a, **k))

    with monkeypatch.context() as m:
        m.setattr(_dispatch, "implementation", impl)
        si.top_k_per_row(*args[:3], out=args[3], backend="reference")
    assert calls == ["reference"]
    si.top_k_per_row(*args[:3], out=args[3], backend="reference")
    assert calls == ["reference"]
    with pytest.raises(ValueError, match="backend must be one of"):
        si.top_k_per_row(*args[:3], out=args[3], backend=["triton"])


def test_eager_overhead(capsys):
    """Per-call cost of each layer on an op small enough that the work is negligible: the implementation, the
    backend resolution, the custom op (the route of traced calls), the public function. Printed (``-s``); the
    bound is checked by tests/sparse_indexer/test_host_overhead.py."""
    logits = torch.randn(1, 8)
    rs, re_ = torch.zeros(1, dtype=torch.int32), torch.full((1,), 4, dtype=torch.int32)
    out = torch.zeros(1, 8, dtype=torch.int32)
    impl = _dispatch.implementation("top_k_per_row", "reference")
    op = library.op("top_k_per_row")

    def bench(fn, n=500):
        for _ in range(20):
            fn()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            best = min(best, (time.perf_counter() - t0) / n)
        return best * 1e6

    t_impl = bench(lambda: impl(logits, rs, re_, out=out))
    t_dispatch = bench(lambda: _dispatch.call("top_k_per_row", None, logits.device, logits, rs, re_, out=out))
    t_op = bench(lambda: op(logits, rs, re_, out, "auto"))
    t_public = bench(lambda: si.top_k_per_row(logits, rs, re_, out=out, check_values=False))
    with capsys.disabled():
        print(f"\n[eager overhead, CPU, us/call] implementation {t_impl:.1f}, _dispatch.call {t_dispatch:.1f}, "
              f"torch.ops custom op {t_op:.1f} (+{t_op - t_dispatch:.1f}), public function {t_public:.1f}")
    assert t_op - t_dispatch < 500  # sanity bound only


def test_every_public_function_takes_the_direct_route_in_plain_eager(monkeypatch):
    """No public function reaches ``torch.ops`` in plain eager (string and dtype arguments included), and the
    step neither."""
    from tests.sparse_indexer.test_host_overhead import _cases

    class Refuse:
        def __init__(self, name):
            self.name = name

        def __call__(self, *a, **k):
            raise AssertionError(f"{self.name} went through torch.ops in plain eager")

    for name in (*_dispatch.OPS, "fp8_paged_mqa_logits_with_qk", "top_k_per_row_with_workspace"):
        monkeypatch.setattr(torch.ops.sparse_indexer, name, Refuse(name))
    for _name, public, _ in _cases():
        public()
    from sparse_indexer.commands import bench_host

    x = bench_host._Inputs(torch.device("cpu"), bench_host.SHAPES["cpu"])
    steps = [c for c in bench_host._cases(x, None) if "step" in c[0]]
    assert len(steps) == 2
    for _, step, _, _ in steps:
        step()
