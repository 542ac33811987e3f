"""The examples run as a user would run them (each in its own process)."""

from __future__ import annotations

import os
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


def test_cpu_unit_test_example_on_triton_interpreter():
    pytest.importorskip("triton")
    out = _run("examples/cpu_unit_test.py", "triton", env={"TRITON_INTERPRET": "1"})
    assert "ok" in out


def test_demo_command_verifies_every_step():
    out, err = _run("-m", "sparse_indexer", "demo", "--requests", "2", "--context", "2100", "--decode-steps", "2",
                    stderr=True)
    assert "float64 check:" in out and "MISMATCH" not in out
    # redirected output: no progress bar (no carriage returns), "1 chunk" in the singular
    assert "\r" not in out + err and "1 chunks" not in out and "1 chunk)" in out


def test_plan_command():
    out = _run("-m", "sparse_indexer", "plan", "--max-model-len", "163840", "--max-num-seqs", "256",
               "--next-n", "2")
    assert "vLLM" in out and "total" in out
