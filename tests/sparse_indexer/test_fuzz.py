"""``check --fuzz``: random cases that replay from their seed, failures reported with it, and a short run of the
Triton kernels (CPU interpreter) against the reference that must pass."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from sparse_indexer.commands import check, fuzz

ROOT = Path(__file__).resolve().parents[2]


def test_a_case_is_a_function_of_its_seed():
    for s in range(200, 260):
        a, b = random.Random(s), random.Random(s)
        op_a, name_a, _ = fuzz.draw_case(a, False, check)
        op_b, name_b, _ = fuzz.draw_case(b, False, check)
        assert (op_a, name_a, fuzz.draw_sizes(a, False, check)) == (op_b, name_b, fuzz.draw_sizes(b, False, check))
    ops = {fuzz.draw_case(random.Random(s), True, check)[0] for s in range(400)}
    assert ops == set(fuzz.FUZZ_OPS), "every op is drawn"


def test_failures_are_reported_with_their_seed(monkeypatch, capsys):
    verdicts = iter([("fine", "0", True), ("3 rows wrong", "0", False), ("fine", "0", True)])

    def fake_case(rng, gpu, C):
        rng.random()
        return "top_k_per_row", "fake", lambda ctx: next(verdicts)

    monkeypatch.setattr(fuzz, "draw_case", fake_case)
    rc = fuzz.run_fuzz(3, 50, torch.device("cpu"), ["triton"], check)
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED seed 51" in out and "seeds 51" in out and "3 rows wrong" in out


def test_a_case_does_not_depend_on_its_process():
    """A worker's chunk gives what the cases give one by one in this process (the pool only splits the seeds)."""
    seeds = range(900, 904)
    one = [(s, *fuzz._one(s, torch.device("cpu"), ["reference"], check, False)[:4]) for s in seeds]
    assert [r[:5] for r in fuzz._chunk(seeds, "cpu", ["reference"], False, check.__name__)] == one  # (the times differ)
    assert all(status == "ok" for _, status, _, _, _ in one)


def test_fuzz_cases_on_the_cpu():
    """150 random cases of the Triton kernels in the interpreter, in two processes, against the reference."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "sparse_indexer", "check", "--device", "cpu", "--fuzz", "150",
                        "--seed", "20261202", "--jobs", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1500)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "fuzz passed" in r.stdout and "150 cases" in r.stdout and "2 processes" in r.stdout


def test_jobs_needs_fuzz():
    r = subprocess.run([sys.executable, "-m", "sparse_indexer", "check", "--device", "cpu", "--jobs", "2"], cwd=ROOT,
                       env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--jobs goes with --fuzz" in r.stderr + r.stdout
