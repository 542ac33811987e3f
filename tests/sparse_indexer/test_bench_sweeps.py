"""``python -m sparse_indexer bench --sweep topk|logits`` on the CPU with ``--smoke`` shapes: the sweeps run on the
bench's timer and floors, write their reports, and fail when a check fails; usage errors exit 2."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from sparse_indexer.commands import bench
from sparse_indexer.ops.top_k_per_row import sweep as topk_sweep

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def _smoke(tmp_path, *extra: str) -> list[str]:
    return ["--smoke", "--device", "cpu", "--iters", "1", "--warmup", "0", "--out", str(tmp_path), *extra]


def test_topk_sweep_smoke(tmp_path, capsys):
    assert bench.run(_args(*_smoke(tmp_path, "--sweep", "topk"))) == 0
    data = json.loads((tmp_path / "sweep-topk.json").read_text())
    assert data["meta"]["sweep"] == "topk" and data["floors"]["bandwidth"]["value"] > 0
    assert data["results"]["check_bad_rows"] == 0
    cases = {r[0].split()[0] for r in data["rows"]}
    assert {"check", "4x8K", "prefill", "dist", "dist-prefill", "step"} <= cases, cases
    assert not [r for r in data["rows"] if r[1] == "FAILED"]
    assert any("read floor" in r[1] and "measured" in r[1] for r in data["rows"])  # the bench's floor
    assert any("top-k right" in r[1] and r[3] == "True" for r in data["rows"])
    md = (tmp_path / "sweep-topk.md").read_text()
    assert "bandwidth floor" in md and "| case | what | us | note |" in md
    out = capsys.readouterr().out
    # rows named by the backend auto resolves to on the device; no CUDA-graph rows without a CUDA device
    assert "ours reference (auto)" in out and "ours cuda" not in out
    assert "reference (auto): logits + top-k, eager" in out
    assert out.split("\ncase ")[0].count("CUDA-graph rows left out: they need a CUDA device") == 1  # said once
    assert not [r for r in data["rows"] if "graph" in r[1] and "left out" not in r[1]], data["rows"]


def test_topk_sweep_sections_and_a_wrong_result_fails(tmp_path, monkeypatch):
    assert bench.run(_args(*_smoke(tmp_path, "--sweep", "topk", "--sections", "check"))) == 0
    rows = json.loads((tmp_path / "sweep-topk.json").read_text())["rows"]
    assert {r[0] for r in rows} == {"check"}
    monkeypatch.setattr(topk_sweep, "topk_errors", lambda out, *a, **k: list(range(out.shape[0])))
    assert bench.run(_args(*_smoke(tmp_path, "--sweep", "topk", "--sections", "check"))) == 1
    data = json.loads((tmp_path / "sweep-topk.json").read_text())
    assert data["results"]["check_bad_rows"] > 0 and any(r[1].startswith("BAD") for r in data["rows"])


@pytest.mark.parametrize("extra", [["--sections", "check"], ["--configs", "1024x2"],
                                   ["--sweep", "topk", "--sections", "nope"],
                                   ["--sweep", "topk", "--configs", "1024"],
                                   ["--sweep", "logits", "--configs", "1024x2"]])
def test_sweep_usage_errors(tmp_path, capsys, extra):
    assert bench.run(_args(*_smoke(tmp_path, *extra))) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench: ") and ("--sections" in err or "--configs" in err), err


SMOKE_SWEEP_SECONDS = 120
"""The wall-time bound of ``bench --sweep NAME --smoke`` as a user runs it (no other option) on a 2-core CPU
(measured: topk about 10 s, logits about 40 s; the logits sweep's defaults used to take 5-13 minutes)."""


def _smoke_sweep(name: str, tmp_path) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m sparse_indexer bench --sweep NAME --smoke`` in a process of its own, with no other option but
    ``--out`` and no TRITON_INTERPRET in the environment (the bench sets it for the logits sweep on the CPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "sparse_indexer", "bench", "--sweep", name, "--smoke", "--out",
                          str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    return run, time.perf_counter() - t0


@pytest.mark.skipif(torch.cuda.is_available(), reason="times the CPU run")
def test_topk_sweep_smoke_as_a_user_runs_it_is_quick(tmp_path):
    run, seconds = _smoke_sweep("topk", tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert seconds < SMOKE_SWEEP_SECONDS, f"bench --sweep topk --smoke took {seconds:.0f} s"
    data = json.loads((tmp_path / "sweep-topk.json").read_text())
    assert data["meta"]["iters"] == 1 and data["meta"]["warmup"] == 0 and data["results"]["check_bad_rows"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="times the CPU run")
def test_logits_sweep_smoke_as_a_user_runs_it_is_quick(tmp_path):
    """The logits sweep runs the Triton kernels: on the CPU in Triton's interpreter, which the bench switches on."""
    pytest.importorskip("triton")
    run, seconds = _smoke_sweep("logits", tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert seconds < SMOKE_SWEEP_SECONDS, f"bench --sweep logits --smoke took {seconds:.0f} s"
    assert "TRITON_INTERPRET=1 set for this process" in run.stdout
    data = json.loads((tmp_path / "sweep-logits.json").read_text())
    assert data["meta"]["iters"] == 1 and data["meta"]["warmup"] == 0
    assert data["results"] == {**data["results"], "check_ok/check": True}
    checks = [r for r in data["rows"] if r[1].startswith("CHECK")]
    assert len(checks) == 8 and all(r[1].endswith("OK") for r in checks)
    assert any(r[0] == "configs" and "ragged" in r[1] and "TFLOP/s" in r[1] for r in data["rows"])


def test_logits_sweep_needs_the_interpreter_on_the_cpu(tmp_path, monkeypatch, capsys):
    """In a process that imported triton without TRITON_INTERPRET it is too late to switch the interpreter on:
    the logits sweep then says what to set (exit 2)."""
    pytest.importorskip("triton")  # imported here: the bench cannot switch the interpreter on any more
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert bench.run(_args(*_smoke(tmp_path, "--sweep", "logits"))) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
    assert "TRITON_INTERPRET" not in os.environ


def test_readme_lists_the_sweeps():
    """The README's scripts section names every sweep as a bench option, and the deleted scripts are gone."""
    text = (ROOT / "README.md").read_text()
    for name, mod in bench.SWEEPS.items():
        assert f"python -m sparse_indexer bench --sweep {name}" in text, name
        assert f"sparse_indexer/ops/{pathlib.Path(mod.__file__).parent.name}/sweep.py" in text, name
    assert not (ROOT / "scripts" / "topk_sweep.py").exists() and not (ROOT / "scripts" / "logits_sweep.py").exists()
