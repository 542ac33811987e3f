"""``python -m sparse_indexer check``: passes on the CPU (Triton under its interpreter), fails (exit 1) when a
kernel is broken on purpose, refuses an unavailable device or backend in one line (exit 2).

Each run is its own process: the check switches on ``TRITON_INTERPRET`` before triton is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("triton")


def _run(code_or_args, *, script: bool = False, timeout: int = 600):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPARSE_INDEXER_TEST_BACKENDS")}
    cmd = [sys.executable, "-c", textwrap.dedent(code_or_args)] if script else [
        sys.executable, "-m", "sparse_indexer", "check", *code_or_args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _rows(out: str, status: str) -> list[str]:
    return [line for line in out.splitlines() if line.rstrip().endswith(status)]


def test_check_passes_on_cpu():
    r = _run(["--device", "cpu", "--op", "fp8_paged_mqa_logits", "--seed", "5"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TRITON_INTERPRET=1" in r.stdout
    assert len(_rows(r.stdout, " ok")) == 10, r.stdout  # 4 next_n x 1-D, 3 x 2-D, one H=32/D=64, two MXFP4 cases
    assert "check passed" in r.stdout


# Each program breaks one Triton op after the fact (the kernel runs, then its output is damaged), then runs the
# check on that op: the check must report the damage.
BROKEN = {
    "fp8_paged_mqa_logits": """
        def broken(q, kv_cache, weights, context_lens, block_table, *, out, clean):
            original(q, kv_cache, weights, context_lens, block_table, out=out, clean=clean)
            out[0, 0] += 1.0  # one in-window cell of the first row (contexts are >= 1)
    """,
    "top_k_per_row": """
        def broken(logits, row_starts, row_ends, *, out, workspace=None):
            original(logits, row_starts, row_ends, out=out, workspace=workspace)
            out[0, 0] = out[0, 1]  # a repeated position in a full row
    """,
    "write_k_cache": """
        def broken(k, kv_cache, slot_mapping, *, scale_fmt, fp8_dtype):
            original(k, kv_cache, slot_mapping, scale_fmt=scale_fmt, fp8_dtype=fp8_dtype)
            kv_cache.view(-1)[-1] ^= 1  # one byte of the last block
    """,
    "fp8_mqa_logits": """
        def broken(q, k_fp8, k_scale, weights, ks, ke, *, out, clean):
            raise RuntimeError("kernel crashed on purpose")
    """,
}


@pytest.mark.parametrize("op", sorted(BROKEN))
def test_check_fails_on_a_broken_kernel(op):
    program = "\n".join([
        "import os, sys",
        'os.environ["TRITON_INTERPRET"] = "1"',
        f"import sparse_indexer.ops.{op}.triton as mod",
        f"original = mod.{op}",
        textwrap.dedent(BROKEN[op]),
        f"mod.{op} = broken",
        "from sparse_indexer.__main__ import main",
        f'sys.exit(main(["check", "--device", "cpu", "--op", "{op}", "--seed", "7"]))',
    ])
    r = _run(program, script=True)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "check FAILED" in r.stdout
    want = "ERROR" if op == "fp8_mqa_logits" else "MISMATCH"
    assert _rows(r.stdout, want), r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_unavailable_device_is_one_line_exit_2():
    r = _run(["--device", "cuda"])
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "--device cuda" in r.stderr, r.stderr


def test_unavailable_backend_is_one_line_exit_2():
    r = _run(["--device", "cpu", "--backend", "aiter"])
    assert r.returncode == 2
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "aiter" in r.stderr, r.stderr


def test_backends_on_a_gpu_include_partial_ones_for_their_ops_and_the_auto_step(monkeypatch):
    from sparse_indexer._runtime import dispatch as _dispatch
    from sparse_indexer.commands import check

    monkeypatch.setattr(_dispatch, "available", lambda device: ("cuda", "triton", "reference"))
    got = check._backends("all", torch.device("cuda"))
    assert got == ["cuda", "triton", "reference", "auto"]
    assert check._ops_of("cuda") == ("top_k_per_row", "fp8_paged_mqa_topk", "select_candidate_blocks",
                                     "fp8_paged_mqa_logits")
    assert check._ops_of("auto") == ("step",)
    assert set(check._ops_of("triton")) == set(check.CHECKS)
    assert {op for op, _, _ in check.cases(check.SMALL)} == set(check.CHECKS)
