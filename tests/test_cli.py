"""The command line: help text and defaults for every option, one-line errors (exit 2) before any work for a
device or backend that is not available, progress bars only on a terminal."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparse_indexer.__main__ import build_parser
from sparse_indexer.commands import cli as _cli

ROOT = Path(__file__).resolve().parents[1]


def _cli_run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "sparse_indexer", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("cmd", ["demo", "check", "bench"])
def test_every_option_has_help_and_its_default(cmd):
    parser = _subparsers()[cmd]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{cmd} {action.option_strings} has no help text"
        text = action.help % {"default": action.default} if "%(default)" in action.help else action.help
        if isinstance(action, argparse._StoreTrueAction):
            continue  # a flag: off unless given
        assert "default" in text, f"{cmd} {action.option_strings}: the help does not state the default: {text!r}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("cmd", ["demo", "check"])
def test_missing_gpu_is_one_line_exit_2(cmd):
    r = _cli_run(cmd, "--device", "cuda")
    assert r.returncode == 2
    assert r.stdout == "", "nothing may be printed (or run) before the error"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda"), r.stderr


def test_demo_unavailable_backend_is_one_line_exit_2():
    r = _cli_run("demo", "--backend", "aiter")  # aiter runs on ROCm GPUs only
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --backend aiter"), r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_demo_triton_on_the_cpu_switches_the_interpreter_on_as_check_does():
    """``demo --backend triton`` on the CPU, with no TRITON_INTERPRET in the environment, runs the Triton kernels in
    Triton's interpreter (set for its own process, as ``check`` does) and passes its float64 check."""
    pytest.importorskip("triton")
    r = _cli_run("demo", "--backend", "triton", "--requests", "1", "--context", "200", "--decode-steps", "1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    first = r.stdout.splitlines()[0]
    assert "backend=triton" in first and "TRITON_INTERPRET=1 set for this process" in first, first
    assert "float64 check: 2/2 steps ok" in r.stdout


def test_use_triton_interpreter(monkeypatch):
    """The helper ``check`` and ``demo`` share: only on the CPU; set only while triton is not imported yet."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _cli.use_triton_interpreter(torch.device("cuda")) is None
    monkeypatch.setitem(sys.modules, "triton", sys.modules.get("triton", object()))  # imported: too late
    assert _cli.use_triton_interpreter(torch.device("cpu")) is None and "TRITON_INTERPRET" not in os.environ
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET=1" in _cli.use_triton_interpreter(torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.delitem(sys.modules, "triton")  # not imported yet: set for this process
    assert "set for this process" in _cli.use_triton_interpreter(torch.device("cpu"))
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_bad_device_name_is_one_line_exit_2():
    r = _cli_run("demo", "--device", "tpu")
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_progress_draws_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    plain, tty = io.StringIO(), Tty()
    for stream in (plain, tty):
        p = _cli.Progress(3, stream=stream)
        p.update(1, "step")
        p.clear()
    assert plain.getvalue() == ""
    assert "\r" in tty.getvalue() and "1/3" in tty.getvalue()


def test_resolve_device():
    assert _cli.resolve_device("cpu") == torch.device("cpu")
    assert _cli.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(_cli.UsageError, match="--device 'mps'|--device mps"):
        _cli.resolve_device("mps")
