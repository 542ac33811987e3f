"""The package's import graph has no cycle: every ``import`` statement of ``buffers/`` and ``sparse_indexer/``,
at module level or inside a function, is an edge to the module it names (``from pkg import name`` names
``pkg.name`` when that is a module, else ``pkg``)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("buffers", "sparse_indexer")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods and "." in t:
                    t = t.rpartition(".")[0]
                if t in mods and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (c := visit(t)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    g = import_graph()
    assert "sparse_indexer.backends" in g["sparse_indexer._runtime.dispatch"]  # relative imports resolved


# The layers of the package, lowest first. A module may import modules of its own layer or of a lower one, never
# of a higher one. The folders show them: ``_runtime/`` holds the launch support (layer 0) and the dispatch,
# checks and custom ops (layer 2); ``ops/<op>/<backend>.py`` the kernels (1); ``ops/<op>/__init__.py`` the checked
# public functions (3); ``commands/`` and the ops' ``bench``/``sweep`` modules the commands (5).
LAYERS = (
    ("foundation", ("buffers.limits", "sparse_indexer.fp8", "sparse_indexer.mxfp4", "sparse_indexer.kcache",
                    "sparse_indexer._runtime", "sparse_indexer._runtime.launch", "sparse_indexer._runtime.tma",
                    "sparse_indexer._runtime.triton_compat")),
    ("kernels", ("sparse_indexer.ops", "sparse_indexer.ops._aiter", "sparse_indexer.ops._mxfp4_triton",
                 "sparse_indexer.ops.*.*", "sparse_indexer.parallel.triton")),
    ("runtime", ("sparse_indexer.backends", "sparse_indexer._runtime.*", "buffers", "buffers.*")),
    ("ops", ("sparse_indexer.ops.*", "sparse_indexer.metadata")),
    ("api", ("sparse_indexer", "sparse_indexer.indexer", "sparse_indexer.parallel", "sparse_indexer.testing",
             "sparse_indexer.compat", "sparse_indexer.compat.*")),
    ("commands", ("sparse_indexer.commands", "sparse_indexer.commands.*", "sparse_indexer.__main__",
                  "sparse_indexer.ops.*.bench", "sparse_indexer.ops.*.sweep")),
)


def layer_of(module: str) -> int:
    """The layer of ``module``: the most specific pattern that matches it (an exact name beats a ``*`` one,
    a longer pattern a shorter one)."""
    import fnmatch

    best = None
    for rank, (_, patterns) in enumerate(LAYERS):
        for p in patterns:
            if fnmatch.fnmatchcase(module, p) and (module.count(".") == p.count(".")):
                key = ("*" not in p, len(p))
                if best is None or key > best[0]:
                    best = (key, rank)
    if best is None:
        raise AssertionError(f"{module} is in no layer of LAYERS")
    return best[1]


def test_every_module_has_a_layer_and_imports_none_above_it():
    graph = import_graph()
    up = [f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
          for m, targets in sorted(graph.items()) for t in sorted(targets) if layer_of(t) > layer_of(m)]
    assert not up, "imports from a lower layer up to a higher one:\n" + "\n".join(up)


def test_layer_patterns():
    assert LAYERS[layer_of("sparse_indexer.ops.top_k_per_row.triton")][0] == "kernels"
    assert LAYERS[layer_of("sparse_indexer.ops.top_k_per_row")][0] == "ops"
    assert LAYERS[layer_of("sparse_indexer.ops.top_k_per_row.bench")][0] == "commands"
    assert LAYERS[layer_of("sparse_indexer._runtime.dispatch")][0] == "runtime"
    assert LAYERS[layer_of("sparse_indexer._runtime.launch")][0] == "foundation"
    assert LAYERS[layer_of("buffers.limits")][0] == "foundation"


PUBLIC_PATHS = ("sparse_indexer", "sparse_indexer.compat.vllm", "sparse_indexer.testing", "sparse_indexer.parallel",
                "sparse_indexer.backends", "buffers", "sparse_indexer.__main__")


def test_public_import_paths():
    """The public import paths, and the names each exports, import in a fresh interpreter."""
    import subprocess
    import sys

    code = "; ".join(f"import {p} as m; [getattr(m, n) for n in getattr(m, '__all__', ())]" for p in PUBLIC_PATHS)
    code += "; import sparse_indexer as si; assert callable(si.sparse_attn_indexer) and callable(si.build_metadata)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
