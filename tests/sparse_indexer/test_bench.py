"""``sparse_indexer.commands.bench`` end to end on the CPU with ``--smoke`` shapes (reference backend)."""

from __future__ import annotations

import argparse
import json

import torch

from sparse_indexer._runtime import dispatch as _dispatch
from sparse_indexer.commands import bench


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def _run(tmp_path, *extra: str) -> tuple[int, str, dict]:
    argv = ["--smoke", "--device", "cpu", "--iters", "2", "--warmup", "0", "--out", str(tmp_path), *extra]
    rc = bench.run(_args(*argv))
    md = (tmp_path / "results.md").read_text()
    data = json.loads((tmp_path / "results.json").read_text())
    return rc, md, data


def test_smoke_cpu_reference_writes_every_case(tmp_path, capsys):
    rc, md, data = _run(tmp_path, "--backends", "reference")
    assert rc == 0
    specs = bench.case_specs(smoke=True)
    assert {s.group for s in specs} == set(bench.GROUPS)
    keys = {r["key"] for r in data["rows"]}
    for spec in specs:
        assert spec.title in md
        assert spec.key in keys
    copies = [r for r in data["rows"] if r["backend"] == "copy (same bytes)"]
    assert {r["group"] for r in copies} == {"cache"} and len(copies) == 2
    for r in data["rows"]:
        assert r["status"] == "ok"
        assert (r["backend"], r["check"]) in (("reference", "ref"), ("copy (same bytes)", "floor"))
        assert r["median_us"] > 0 and r["achieved"] > 0 and r["unit"] in ("TB/s", "TFLOP/s")
    assert set(data["floors"]) == {"bandwidth", "compute"}
    assert data["floors"]["bandwidth"]["value"] > 0
    for col in bench.HEADERS:
        assert col in md
    assert "command:" in md and "bandwidth floor" in md
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "results.png").exists()
    else:
        assert (tmp_path / "results.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert f"[1/{len(specs)}] " in out and "reference ..." in out


def test_unavailable_backend_is_na_and_cases_filter(tmp_path):
    rc, md, data = _run(tmp_path, "--backends", "reference,aiter", "--cases", "cache", "--skip-reference")
    assert rc == 0
    assert {r["group"] for r in data["rows"]} == {"cache"}
    aiter = [r for r in data["rows"] if r["backend"] == "aiter"]
    assert aiter and all(r["status"] == "n/a" and r["check_detail"] for r in aiter)
    assert all(r["status"] == "skipped" for r in data["rows"] if r["backend"] == "reference")
    assert "aiter: n/a" in md


def test_bad_arguments_return_2(tmp_path):
    assert bench.run(_args("--smoke", "--device", "cpu", "--cases", "nope", "--out", str(tmp_path))) == 2
    assert bench.run(_args("--smoke", "--device", "cpu", "--backends", "tpu", "--out", str(tmp_path))) == 2


def _corrupt(op, fn):
    """A backend that runs the reference and then spoils its output."""

    def wrong(*args, **kwargs):
        fn(*args, **kwargs)
        if op in ("fp8_mqa_logits", "fp8_paged_mqa_logits"):
            kwargs["out"].add_(1.0)
        elif op == "top_k_per_row":
            out = kwargs["out"]
            out.copy_(torch.arange(out.shape[1], dtype=out.dtype).expand_as(out))  # the first topk positions
        elif op == "write_k_cache":
            args[1].view(-1)[0] = 0x7F  # a NaN byte: quantization never writes it
        else:
            kwargs["out_k"].view(torch.uint8).view(-1)[0] = 0x7F

    return wrong


def test_checks_against_reference(tmp_path, monkeypatch):
    """Pretend "aiter" (the reference) and "triton" (the reference, spoiled) run on the CPU: every check
    must pass on the first and fail on the second."""
    real = _dispatch.implementation

    def impl(op, backend):
        fn = real(op, "reference")
        return _corrupt(op, fn) if backend == "triton" else fn

    monkeypatch.setattr(_dispatch, "implementation", impl)
    monkeypatch.setattr(_dispatch, "unavailable_reason", lambda b, d: None)
    monkeypatch.setattr(bench, "unavailable_reason", lambda b, d: None)
    rc, md, data = _run(tmp_path, "--backends", "triton,reference,aiter", "--skip-reference", "--iters", "1")
    assert rc == 1
    n = len(bench.case_specs(smoke=True))
    for backend, want in (("aiter", "ok"), ("triton", "FAIL")):
        rows = [r for r in data["rows"] if r["backend"] == backend]
        assert len(rows) == n
        assert all(r["check"] == want for r in rows), [(r["key"], r["check"], r["check_detail"]) for r in rows]


def test_l2_flush_methods():
    """``--l2-flush``: zero (the default) or read; the timer refuses any other; the CPU has nothing to flush."""
    import pytest

    assert _args().l2_flush == "zero" and _args("--l2-flush", "read").l2_flush == "read"
    with pytest.raises(SystemExit):
        _args("--l2-flush", "none")
    with pytest.raises(ValueError, match="flush must be one of"):
        bench.Timer(torch.device("cpu"), "none")
    t = bench.Timer(torch.device("cpu"), "read")
    assert t.flush is None and t.method == "read" and len(t.times_us(lambda: None, 3, 0)) == 3
