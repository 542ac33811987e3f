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
    specs = bench.case_specs(smoke=True, graphs=False)  # the CPU has no CUDA graphs
    assert {s.group for s in specs} == set(bench.GROUPS)
    keys = {r["key"] for r in data["rows"]}
    for spec in specs:
        assert spec.title in md
        assert spec.key in keys
    graph_specs = [s for s in bench.case_specs(smoke=True) if s not in specs]
    assert graph_specs and all(s.params["graph"] for s in graph_specs)
    assert not keys & {s.key for s in graph_specs}, "CUDA-graph rows on a device without CUDA graphs"
    assert "CUDA graph" not in md.replace(bench.GRAPHS_NEED_CUDA, "") and bench.GRAPHS_NEED_CUDA in md
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
    assert out.count(bench.GRAPHS_NEED_CUDA) == 1  # said once


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
        elif op == "select_candidate_blocks":
            kwargs["out"].fill_(-1)  # no candidate at all
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
    n = len(bench.case_specs(smoke=True, graphs=False))
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


def test_device_and_timing_defaults():
    """``--device`` is auto (the GPU when one is visible, else the CPU); ``--smoke`` means the fewest iterations
    unless they are given; ``--host-iters`` likewise."""
    from sparse_indexer.__main__ import build_parser
    from sparse_indexer.commands import bench_host

    args = build_parser().parse_args(["bench", "--host", "--host-cpu", "0"])
    assert args.device == "auto" and args.host_cpu == 0 and args.host_iters is None
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert bench._resolve_device(args.device).type == want
    assert bench.timing_options(_args()) == bench.TIMING == dict(iters=30, warmup=5, ref_iters=3)
    assert bench.timing_options(_args("--smoke")) == bench.SMOKE_TIMING == dict(iters=1, warmup=0, ref_iters=1)
    assert bench.timing_options(_args("--smoke", "--iters", "4", "--warmup", "2")) == dict(iters=4, warmup=2,
                                                                                            ref_iters=1)
    assert bench.timing_options(_args("--iters", "2")) == dict(iters=2, warmup=5, ref_iters=2)
    assert (bench_host.HOST_ITERS, bench_host.SMOKE_HOST_ITERS) == (300, 20)


def test_auto_device_is_named_in_the_output(tmp_path, capsys):
    assert bench.run(_args("--smoke", "--cases", "cache", "--backends", "reference", "--out", str(tmp_path))) == 0
    first = capsys.readouterr().out.splitlines()[0]
    want = "cuda" if torch.cuda.is_available() else "cpu (--device auto: no GPU visible)"
    assert first.startswith(f"sparse-indexer bench on {want}"), first


def test_host_cpu_that_is_not_there_is_one_line_exit_2(capsys):
    import os

    import pytest

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("needs os.sched_getaffinity (Linux)")
    allowed = os.sched_getaffinity(0)
    assert bench.run(_args("--host", "--host-cpu", str(max(allowed) + 1), "--device", "cpu")) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    from sparse_indexer.commands.bench_host import cpu_list

    assert len(lines) == 1 and f"cannot pin to CPU {max(allowed) + 1} (--host-cpu)" in lines[0], err
    assert f"may run on CPU {cpu_list(allowed)} only" in lines[0], err
    assert cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8" and cpu_list({3}) == "3"


def test_readme_host_line_runs_as_written(tmp_path):
    """``taskset -c 0 python -m sparse_indexer bench --host --host-cpu 0`` (the README's pinned run), with few
    calls per row: it runs on this machine, on the GPU when one is visible, else the CPU."""
    import os
    import shutil
    import subprocess
    import sys

    import pytest

    if shutil.which("taskset") is None or 0 not in os.sched_getaffinity(0):
        pytest.skip("needs taskset and CPU 0")
    r = subprocess.run(["taskset", "-c", "0", sys.executable, "-m", "sparse_indexer", "bench", "--host", "--host-cpu",
                        "0", "--host-iters", "10", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.startswith("sparse-indexer bench --host on ") and "pinned to CPU 0" in r.stdout
    assert "after start-up" not in r.stderr  # started there: no warning
    assert (tmp_path / "host.json").exists()


def test_host_rows_name_the_backend_auto_resolved_to():
    from sparse_indexer.commands import bench_host

    assert bench_host.backend_label("triton", {"top_k_per_row": "triton"}) == "triton"
    assert bench_host.backend_label(None, {"a": "reference", "b": "reference"}) == "reference (auto)"
    assert bench_host.backend_label(None, {"a": "cuda", "b": "triton"}) == "auto (a: cuda, b: triton)"
    if not torch.cuda.is_available():
        r = bench_host.measure(torch.device("cpu"), None, iters=5, warmup=1)
        assert r["backend"] == "reference (auto)" and "backend reference (auto)" in bench_host.format_markdown(r)


def test_deep_gemm_anchor_rows_on_the_cases_it_takes(tmp_path, monkeypatch):
    """``--anchors``: DeepGEMM's logits (when ``deep_gemm`` imports) are timed beside ours on the decode and prefill
    cases it takes, on the same inputs. A stand-in with DeepGEMM's call forms computes with the reference backend
    and records its calls, so the rows exist and the arguments are the case's own."""
    import sys
    import types

    import sparse_indexer as si

    calls = []
    dg = types.ModuleType("deep_gemm")
    dg.get_num_sms = lambda: 132
    dg.get_paged_mqa_logits_metadata = lambda lens, bs, sms: ("schedule", lens.shape, bs, sms)

    def paged(q, kv4, w, lens2d, bt, sched, cols, clean):
        assert kv4.dim() == 4 and kv4.shape[2] == 1 and lens2d.shape == q.shape[:2] and sched[0] == "schedule"
        calls.append("paged")
        return si.fp8_paged_mqa_logits(q, kv4, w, lens2d, bt, out=torch.empty(q.shape[0] * q.shape[1], cols),
                                       clean=clean, backend="reference")

    def ragged(q, kv, w, ks, ke, clean_logits):
        calls.append("ragged")
        return si.fp8_mqa_logits(q, kv[0], kv[1], w, ks, ke, clean=clean_logits, backend="reference")

    dg.fp8_paged_mqa_logits, dg.fp8_mqa_logits = paged, ragged
    monkeypatch.setitem(sys.modules, "deep_gemm", dg)
    rc, md, data = _run(tmp_path, "--backends", "reference", "--cases", "decode,prefill,topk", "--anchors",
                        str(tmp_path / "no-vllm-here"))
    assert rc == 0
    rows = [r for r in data["rows"] if r["check"] == "anchor"]
    by = {}
    for r in rows:
        by.setdefault(r["backend"], set()).add(r["group"])
    assert by == {"DeepGEMM paged logits": {"decode"}, "DeepGEMM logits": {"prefill"}}, by
    assert "paged" in calls and "ragged" in calls
    decode_keys = {r["key"] for r in rows if r["group"] == "decode"}
    assert not any(k.endswith("-bf16") for k in decode_keys), "bf16 logits are not DeepGEMM's"
    assert "DeepGEMM paged logits" in md and "vLLM anchors" in md  # the missing vLLM folder is said
