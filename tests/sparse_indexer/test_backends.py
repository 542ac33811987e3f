"""The backend registry (``sparse_indexer.backends``): a toy backend registered here is picked up by dispatch,
``auto``, the benchmark's backend list, the tests' ``backend`` parametrization and (declaring a top-k workspace)
the buffer plan, with no other file touched; the README's backend table matches the registry."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import sparse_indexer as si
from buffers import IndexerLimits, allocate, plan
from sparse_indexer import backends
from sparse_indexer._runtime import dispatch as _dispatch
from sparse_indexer.commands import bench

ROOT = pathlib.Path(__file__).resolve().parents[2]
CALLS: list[str] = []
WORKSPACES: list[tuple[int, ...] | None] = []


def top_k_per_row(logits, row_starts, row_ends, *, out, workspace=None) -> None:
    """The toy backend's top-k: the reference's, counted (and spoiled when ``TOY_BACKEND_BROKEN`` is set); the
    shape of the workspace it was given is recorded (it takes one, as a backend that declares one does)."""
    CALLS.append("top_k_per_row")
    WORKSPACES.append(None if workspace is None else tuple(workspace.shape))
    if log := os.environ.get("TOY_BACKEND_LOG"):
        with open(log, "a") as f:
            f.write("call\n")
    _dispatch.implementation("top_k_per_row", "reference")(logits, row_starts, row_ends, out=out)
    if os.environ.get("TOY_BACKEND_BROKEN") and out.numel():
        out.view(-1)[0] = out.view(-1)[0] + 1 if int(out.view(-1)[0]) >= 0 else 0


def toy_entry() -> backends.Backend:
    """One registry entry: a CPU top-k, tried by ``auto`` on the CPU before the reference."""
    return backends.Backend("toy", lambda device: None if device.type == "cpu" else "the toy runs on the CPU",
                            auto=("cpu",), rank=0, ops=("top_k_per_row",), module=__name__,
                            where="the CPU (a test's toy)")


@pytest.fixture
def toy():
    backends.register(toy_entry())
    CALLS.clear()
    WORKSPACES.clear()
    try:
        yield
    finally:
        backends.unregister("toy")


def _topk_case():
    logits = torch.randn(3, 300)
    starts, ends = torch.tensor([0, 5, 0], dtype=torch.int32), torch.tensor([300, 200, 7], dtype=torch.int32)
    return logits, starts, ends, torch.empty(3, 64, dtype=torch.int32)


def test_toy_backend_in_dispatch_and_auto(toy):
    cpu = torch.device("cpu")
    assert "toy" in backends.names() and _dispatch.available(cpu) == ("toy", "reference")
    assert _dispatch.PARTIAL_BACKENDS["toy"] == ("top_k_per_row",)
    assert _dispatch.candidates("top_k_per_row", None, cpu) == ("toy", "reference")
    assert _dispatch.candidates("fp8_mqa_logits", None, cpu) == ("reference",)
    logits, s, e, out = _topk_case()
    want = out.clone()
    si.top_k_per_row(logits, s, e, out=want, backend="reference")
    si.top_k_per_row(logits, s, e, out=out, backend="toy")
    assert CALLS == ["top_k_per_row"] and torch.equal(out, want)
    si.top_k_per_row(logits, s, e, out=out)  # auto on the CPU: the toy first
    assert CALLS == ["top_k_per_row"] * 2
    with pytest.raises(si.BackendUnavailable, match="toy runs on the CPU"):
        _dispatch.candidates("top_k_per_row", "toy", torch.device("meta"))


def test_unregistered_backend_is_gone(toy):
    backends.unregister("toy")
    try:
        with pytest.raises(ValueError, match="backend"):
            si.top_k_per_row(*_topk_case()[:3], out=_topk_case()[3], backend="toy")
        assert _dispatch.available("cpu") == ("reference",)
    finally:
        backends.register(toy_entry())


def test_toy_backend_in_bench(toy, tmp_path):
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    assert "toy" in parser.format_help()
    argv = ["--smoke", "--device", "cpu", "--iters", "1", "--warmup", "0", "--out", str(tmp_path),
            "--cases", "topk", "--skip-reference"]
    assert bench.run(parser.parse_args(argv)) == 0  # default --backends: every registered backend
    rows = [r for r in json.loads((tmp_path / "results.json").read_text())["rows"] if r["backend"] == "toy"]
    assert rows and all(r["status"] == "ok" and r["check"] == "ok" for r in rows), rows
    assert CALLS


def test_toy_backend_workspace_in_plan():
    """A toy top-k declaring a workspace wider than Triton's widens the plan's ``topk_scratch`` (and the arena)
    and the step hands it that workspace; a narrower one changes nothing; unregistered, the plan is as before."""
    lim = IndexerLimits(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, next_n=2, n_heads=16,
                        head_dim=64, topk=8)
    base = plan(lim)
    rows, cols = base["topk_scratch"].shape
    backends.register(replace(toy_entry(), topk_workspace=lambda limits: 4 * limits.max_model_len + 1000))
    CALLS.clear()
    WORKSPACES.clear()
    try:
        grown = plan(lim)
        assert grown["topk_scratch"].shape == (rows, 4 * 128 + 1000) and 4 * 128 + 1000 > cols
        assert grown.total_bytes > base.total_bytes
        assert backends.topk_workspace_cols(lim) == 4 * 128 + 1000

        from tests.sparse_indexer.test_indexer import Scenario

        sc = Scenario([40, 7, 100, 64], [2, 2, 2, 1], lim=lim, seed=31)
        md = sc.metadata()
        bufs = allocate(lim)
        assert tuple(bufs.topk_scratch.shape) == (rows, 4 * 128 + 1000)
        got = torch.full((md.num_tokens, lim.topk), 7, dtype=torch.int32)
        si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, bufs, got)  # auto on the CPU: the toy's top-k
        assert CALLS and (md.decode.num_rows, 4 * 128 + 1000) in WORKSPACES, WORKSPACES
        want = torch.full_like(got, 7)
        si.sparse_attn_indexer(sc.q, sc.k, sc.w, sc.kv, md, bufs, want, backend="reference")
        assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)

        backends.register(replace(toy_entry(), topk_workspace=lambda limits: 40), replace=True)
        assert plan(lim) == base  # the widest declared width wins (Triton's)
        backends.register(replace(toy_entry(), topk_workspace=lambda limits: 0), replace=True)
        with pytest.raises(ValueError, match="'toy': topk_workspace"):
            plan(lim)
    finally:
        backends.unregister("toy")
    assert plan(lim) == base
    with pytest.raises(ValueError, match="topk_workspace"):
        backends.Backend("x", lambda d: None, ops=("gather_k_cache",), topk_workspace=lambda limits: 64)


def _pytest_with_toy(tmp_path, broken: bool) -> tuple[subprocess.CompletedProcess, int]:
    """The op tests in a fresh process with the toy registered before collection and named as the backend
    under test; returns the run and the number of calls the toy received."""
    log = tmp_path / f"calls-{broken}.log"
    code = ("import sys, pytest; from sparse_indexer import backends; "
            "from tests.sparse_indexer.test_backends import toy_entry; backends.register(toy_entry()); "
            "sys.exit(pytest.main(sys.argv[1:]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(SPARSE_INDEXER_TEST_BACKENDS="toy", TOY_BACKEND_LOG=str(log), PYTHONPATH=str(ROOT))
    if broken:
        env["TOY_BACKEND_BROKEN"] = "1"
    run = subprocess.run([sys.executable, "-c", code, "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/sparse_indexer/ops/test_top_k_per_row.py::test_hand_computed",
                          "tests/sparse_indexer/ops/test_top_k_per_row.py::test_topk_2048",
                          "tests/sparse_indexer/ops/test_top_k_per_row.py::test_step_uses_topk_scratch_and_checks_it",
                          "tests/sparse_indexer/ops/test_gather_k_cache.py::test_hand_computed"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return run, (len(log.read_text().splitlines()) if log.exists() else 0)


def test_toy_backend_in_parametrized_op_tests(tmp_path):
    """Named in SPARSE_INDEXER_TEST_BACKENDS, the toy runs its op's tests (and they catch a spoiled result); the
    tests of other ops and of the whole step skip it."""
    run, calls = _pytest_with_toy(tmp_path, broken=False)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert calls >= 2 and re.search(r"\b2 passed, 2 skipped\b", out), out
    assert "does not implement gather_k_cache" in out and "does not implement write_k_cache" in out, out
    run, calls = _pytest_with_toy(tmp_path, broken=True)
    assert run.returncode == 1 and calls >= 2 and re.search(r"\b2 failed\b", run.stdout), run.stdout


def test_unknown_test_backend_is_a_usage_error(tmp_path):
    env = {**os.environ, "SPARSE_INDEXER_TEST_BACKENDS": "nonesuch"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/sparse_indexer/ops/test_gather_k_cache.py::test_hand_computed"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 4 and "nonesuch" in run.stdout + run.stderr


def test_readme_table_matches_registry():
    """The README's backend table lists the built-in backends in table order with their ops and where they
    run, as the registry has them."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Backends\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]
    assert [r[0].strip("`") for r in rows] == list(backends.BUILTIN)
    for row in rows:
        entry = backends.get(row[0].strip("`"))
        assert row[1] == ("every op" if entry.ops is None else ", ".join(f"`{op}`" for op in entry.ops)), row
        assert row[2] == entry.where, row


def test_readme_lists_every_script():
    text = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"^\| `scripts/(\w+\.py)` \|", text, flags=re.M))
    assert listed == {p.name for p in (ROOT / "scripts").glob("*.py")}


def test_registry_rejects_bad_entries():
    with pytest.raises(ValueError, match="unknown ops"):
        backends.Backend("x", lambda d: None, ops=("nope",))
    with pytest.raises(ValueError, match="identifier"):
        backends.Backend("auto", lambda d: None)
    with pytest.raises(ValueError, match="already registered"):
        backends.register(backends.get("reference"))
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        backends.get("nope")
    assert backends.auto_order("cuda") == ("aiter", "cuda", "gluon", "triton", "reference")
    assert backends.auto_order("cpu") == ("reference",)


def test_auto_when_passes_small_calls_on(toy, monkeypatch):
    """An implementation's ``auto_when`` predicate (sparse_indexer/_runtime/dispatch.py): ``auto`` leaves the calls it
    rejects to the next candidate without running it (no exception involved), the first route for a call says so
    (``chosen``, what ``bench --host`` times), and an explicitly requested backend always runs."""
    seen = []

    def when(logits, row_starts, row_ends, *, out, workspace=None):
        seen.append(logits.shape[1])
        return logits.shape[1] >= 256

    monkeypatch.setattr(top_k_per_row, "auto_when", when, raising=False)
    _dispatch._resolved.clear()
    _dispatch._routes.cache_clear()  # routes are resolved once: read the predicate now
    logits, s, e, out = _topk_case()
    want = out.clone()
    si.top_k_per_row(logits, s, e, out=want, backend="reference")
    cpu = torch.device("cpu")
    try:
        found = _dispatch.routes("top_k_per_row", None, cpu)
        assert [r.name for r in found] == ["toy", "reference"] and found[0].when is when
        si.top_k_per_row(logits, s, e, out=out)  # 300 columns: the toy takes it
        assert CALLS == ["top_k_per_row"] and torch.equal(out, want)
        narrow = logits[:, :200].contiguous()
        e2 = e.clamp(max=200)
        want2 = out.clone()
        si.top_k_per_row(narrow, s, e2, out=want2, backend="reference")
        si.top_k_per_row(narrow, s, e2, out=out)  # 200 columns: auto passes it to the reference
        assert CALLS == ["top_k_per_row"] and torch.equal(out, want2)
        assert _dispatch.chosen(found, None, (narrow, s, e2), {"out": out}).name == "reference"
        assert _dispatch.chosen(found, None, (logits, s, e), {"out": out}).name == "toy"
        si.top_k_per_row(narrow, s, e2, out=out, backend="toy")  # explicit: runs whatever the predicate says
        assert CALLS == ["top_k_per_row"] * 2 and torch.equal(out, want2)
        assert _dispatch.chosen(found, "toy", (narrow, s, e2), {"out": out}).name == "toy"
        assert seen == [300, 200, 200, 300]
        # a layout the public function has proven (the second 200 above: the auto call after the reference's)
        # has its route asked for once per backend argument, then run directly
        for _ in range(3):
            si.top_k_per_row(narrow, s, e2, out=out)
        assert seen == [300, 200, 200, 300] and CALLS == ["top_k_per_row"] * 2 and torch.equal(out, want2)
        si.top_k_per_row(narrow, s, e2, out=out, backend="toy")  # another backend argument: its own entry
        si.top_k_per_row(narrow, s, e2, out=out)
        assert seen == [300, 200, 200, 300] and CALLS == ["top_k_per_row"] * 3
        seen2 = []
        monkeypatch.setattr(top_k_per_row, "auto_when", lambda *a, **k: seen2.append(1) or True)
        _dispatch._resolved.clear()
        _dispatch._routes.cache_clear()  # new routes: the remembered choice is not used with them
        si.top_k_per_row(narrow, s, e2, out=out)
        si.top_k_per_row(narrow, s, e2, out=out)
        assert seen2 == [1] and CALLS == ["top_k_per_row"] * 5
    finally:
        _dispatch._resolved.clear()
        _dispatch._routes.cache_clear()


def test_invoke_at_keeps_the_auto_fallback():
    """``_dispatch.invoke_at`` (the route a proven layout remembered): under ``auto`` a route that raises
    :class:`NotImplementedError` still passes the call on; an explicitly named backend raises it."""
    def refuses(x, *, out):
        raise NotImplementedError("not this case")

    def runs(x, *, out):
        out.append(x)

    found = (_dispatch._Route("a", refuses, None, frozenset(), lambda *a, **k: False),
             _dispatch._Route("b", runs, None, frozenset()))
    out: list = []
    assert _dispatch.first(found, None, (1,), {"out": out}) == 1  # a's auto_when says no
    assert _dispatch.first(found, "a", (1,), {"out": out}) == 0
    _dispatch.invoke_at(found, 0, "top_k_per_row", None, (7,), {"out": out})
    assert out == [7]
    with pytest.raises(NotImplementedError, match="not this case"):
        _dispatch.invoke_at(found, 0, "top_k_per_row", "a", (8,), {"out": out})
    with pytest.raises(si.BackendUnavailable, match="no backend among"):
        _dispatch.invoke_at(found[:1], 0, "top_k_per_row", "auto", (9,), {"out": out})
    assert out == [7]


def test_graph_aware_predicates_are_asked_on_every_call(toy, monkeypatch):
    """A ``graph_aware`` ``auto_when`` (one that reads the CUDA-graph capture state) is asked on every call of a
    proven layout, so a choice made eagerly never serves a call captured later (and the other way round)."""
    capturing = [False]

    def when(logits, row_starts, row_ends, *, out, workspace=None):
        return capturing[0]

    when.graph_aware = True
    monkeypatch.setattr(top_k_per_row, "auto_when", when, raising=False)
    _dispatch._resolved.clear()
    _dispatch._routes.cache_clear()
    logits, s, e, out = _topk_case()
    want = out.clone()
    si.top_k_per_row(logits, s, e, out=want, backend="reference")
    try:
        assert _dispatch.graph_aware(_dispatch.routes("top_k_per_row", None, torch.device("cpu")))
        for _ in range(2):
            si.top_k_per_row(logits, s, e, out=out)  # eager: the predicate says no, the reference runs
        assert CALLS == [] and torch.equal(out, want)
        capturing[0] = True  # the same proven layout, now "captured": the toy
        si.top_k_per_row(logits, s, e, out=out)
        assert CALLS == ["top_k_per_row"] and torch.equal(out, want)
        capturing[0] = False
        si.top_k_per_row(logits, s, e, out=out)
        assert CALLS == ["top_k_per_row"]
    finally:
        _dispatch._resolved.clear()
        _dispatch._routes.cache_clear()


def test_cuda_paged_logits_auto_takes_h32_next_n2_large_calls_only():
    """``auto`` takes the CUDA paged logits only where it was measured ahead: H = 32 at next_n = 2 from
    ``AUTO_MIN_KEY_BLOCKS`` key blocks eagerly (from ``AUTO_MIN_KEY_BLOCKS_GRAPHED`` in a capture, which a CPU
    tensor never is); never H = 64 (the Gluon kernel's), next_n 1, smaller calls or MXFP4 caches."""
    from sparse_indexer.ops.fp8_paged_mqa_logits import cuda as c

    def call(b, next_n, h, blocks, **kw):
        q = torch.empty(b, next_n, h, 128, dtype=torch.float8_e4m3fn)
        bt = torch.empty(b, blocks, dtype=torch.int32)
        return c._auto_when(q, None, None, None, bt, out=None, clean=False, **kw)

    assert c._auto_when.graph_aware and c.AUTO_MIN_KEY_BLOCKS_GRAPHED < c.AUTO_MIN_KEY_BLOCKS == 65536
    assert call(64, 2, 32, 512)  # 64 x 32K keys
    assert call(64, 2, 32, 1024)  # 64 x 64K keys
    assert not call(64, 2, 32, 511)
    assert not call(64, 2, 64, 1024)  # H = 64: the Gluon kernel's
    assert not call(64, 1, 32, 2048)  # next_n 1: level with Triton
    assert not call(64, 3, 32, 1024)  # next_n 3: not measured
    assert not call(64, 2, 32, 1024, cache_values="mxfp4", q_scale=torch.empty(1))


def test_gluon_paged_logits_takes_smaller_calls_in_a_graph(monkeypatch):
    """``auto`` takes the Gluon paged logits from ``AUTO_MIN_KEY_BLOCKS`` key blocks, and from
    ``AUTO_MIN_KEY_BLOCKS_GRAPHED`` while a CUDA graph is being captured (its host time is then paid once)."""
    import importlib

    try:
        g = importlib.import_module("sparse_indexer.ops.fp8_paged_mqa_logits.gluon")
    except Exception as e:  # noqa: BLE001 - no Gluon in this Triton
        pytest.skip(f"the Gluon module does not import here: {e}")
    assert g._auto_when.graph_aware and g.AUTO_MIN_KEY_BLOCKS_GRAPHED < g.AUTO_MIN_KEY_BLOCKS
    assert not g._capturing(torch.empty(1))  # a CPU tensor is never captured

    def call(b, next_n, blocks):
        q = torch.empty(b, next_n, 64, 128, dtype=torch.float8_e4m3fn)
        bt = torch.empty(b, blocks, dtype=torch.int32)
        return g._auto_when(q, None, None, None, bt, out=None, clean=False)

    for capturing in (False, True):
        monkeypatch.setattr(g, "_capturing", lambda q, c=capturing: c)
        assert call(64, 1, 512)  # 32768 key blocks: always
        assert call(32, 2, 128) is capturing  # 8192 (64 x 16K keys at next_n 2 / 2): only in a graph
        assert call(64, 1, 256) is capturing  # 16384: the V4 decode shape
        assert not call(16, 1, 256)  # 4096: never
        assert not g._auto_when(torch.empty(64, 1, 64, 128, dtype=torch.uint8), None, None, None,
                                torch.empty(64, 1024, dtype=torch.int32), out=None, clean=False,
                                cache_values="mxfp4", q_scale=torch.empty(1))
