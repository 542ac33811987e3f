"""The examples run as a user would run them (each in its own process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, env=None, stderr=False):
    e = dict(os.environ)
    e.update(env or {})
    e.pop("TRITON_INTERPRET", None) if not env or "TRITON_INTERPRET" not in env else None
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{args} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return (r.stdout, r.stderr) if stderr else r.stdout


@pytest.mark.parametrize("script", ["custom_engine.py", "cpu_unit_test.py", "quickstart.py",
                                    "context_parallel.py"])
def test_example_runs(script):
    assert "ok" in _run(f"examples/{script}")


def test_custom_engine_checks_its_selection_against_the_reference():
    out = _run("examples/custom_engine.py", "--layers", "2")
    assert "reference vs reference: every token's top-256 selects the same multiset of scores" in out


def test_custom_engine_on_triton_interpreter():
    pytest.importorskip("triton")
    out = _run("examples/custom_engine.py", "--backend", "triton", "--layers", "1", env={"TRITON_INTERPRET": "1"})
    assert "triton vs reference: every token's top-256 selects the same multiset of scores (rtol 1e-05)" in out


def test_custom_engine_check_catches_a_wrong_selection(monkeypatch):
    """The example's check fails when the engine's backend selects a wrong key (here: the reference backend,
    then one selected position of a long decode row replaced by a position outside its top-k)."""
    import importlib.util

    import sparse_indexer as si

    spec = importlib.util.spec_from_file_location("custom_engine_example", ROOT / "examples" / "custom_engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    real = si.sparse_attn_indexer

    def wrong(q, k, w, kv, md, bufs, topk_out, backend=None):
        real(q, k, w, kv, md, bufs, topk_out, backend="reference")
        if backend != "reference":  # the engine's backend under test
            row = topk_out[1]  # decode request 1: 1500 keys, top-256
            row[0] = int(next(p for p in range(1500) if p not in set(row.tolist())))

    monkeypatch.setattr(si, "sparse_attn_indexer", wrong)
    with pytest.raises(AssertionError, match="row 1"):
        mod.main(["--backend", "triton", "--layers", "1"])


def test_cpu_unit_test_example_on_triton_interpreter():
    pytest.importorskip("triton")
    out = _run("examples/cpu_unit_test.py", "triton", env={"TRITON_INTERPRET": "1"})
    assert "ok" in out


def test_demo_command_verifies_every_step():
    out, err = _run("-m", "sparse_indexer", "demo", "--requests", "2", "--context", "2100", "--decode-steps", "2",
                    stderr=True)
    assert "float64 check: 6/6 steps ok" in out and "MISMATCH" not in out
    # it says what each check compared, and with what tolerance and result
    assert "checked against a float64 model of its scores" in out and "quantize_k" in out
    assert "must select exactly its positions 0..n-1" in out and "1e-05 x max|score| below the 2048th best" in out
    steps = [line for line in out.splitlines() if line.lstrip().startswith("step ")]
    assert len(steps) == 6 and all(" ok: " in line and " exact, " in line and " by gap" in line for line in steps)
    totals = re.search(r"top-2048 of (\d+) tokens against float64 scores: (\d+) windows of <= 2048 keys selected "
                       r"exactly;\n(\d+) longer windows, largest gap below the 2048th best score (\S+) x max\|score\| "
                       r"\(tolerance 1e-05\)", out)
    assert totals, out[-1000:]
    assert int(totals[1]) == int(totals[2]) + int(totals[3]) and int(totals[3]) > 0 and float(totals[4]) <= 1e-5
    # redirected output: no progress bar (no carriage returns), "1 chunk" in the singular
    assert "\r" not in out + err and "1 chunks" not in out and "1 chunk)" in out


def test_plan_command():
    out = _run("-m", "sparse_indexer", "plan", "--max-model-len", "163840", "--max-num-seqs", "256",
               "--next-n", "2")
    assert "vLLM" in out and "total" in out


def _untracked() -> set[str]:
    r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return {line[3:] for line in r.stdout.splitlines() if line.startswith("??")}


@pytest.mark.parametrize("script", [["scripts/memory_bench.py", "--smoke"],
                                    ["scripts/cp_bench.py", "--device", "cpu", "--smoke"],
                                    ["scripts/cp_bench.py", "--device", "cpu", "--smoke", "--compress-ratio", "4"]],
                         ids=lambda a: " ".join(a))
def test_script_smoke_runs_leave_no_untracked_file(script):
    """The scripts' smoke runs, from the repository root as a user runs them, write only where git ignores
    (memory_bench: ``--out`` defaults to ``bench-out/``)."""
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    before = _untracked()
    _run(*script)
    assert _untracked() - before == set(), "the smoke run left untracked files in the repository"
    if script[0].endswith("memory_bench.py"):
        assert (ROOT / "bench-out" / "memory_bench.json").exists()
