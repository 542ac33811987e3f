"""examples/vllm_integration.py runs as a user would run it (its own process), where vLLM is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_integration_example_runs():
    pytest.importorskip("vllm.v1.worker.workspace")
    r = subprocess.run([sys.executable, "examples/vllm_integration.py"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "ok" in r.stdout
