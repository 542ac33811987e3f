"""``python -m sparse_indexer bench --sweep topk``: the top-k sweep on the GPU (the CUDA and Triton backends beside
vLLM's kernels and ``torch.topk``, and the decode step).

Sections (``--sections``, default all): ``check``: the CUDA kernel in every launch configuration (``--configs``,
``NTxCS`` pairs: threads per CTA x CTAs per row) against docs/spec.md §6 (:func:`sparse_indexer.testing.topk_errors`:
short rows exact, long rows distinct in-window positions whose value multiset is the reference's) on every value
distribution and window shape, its exact fallback, the Triton backend with and without the workspace; ``topk``:
timings of the CUDA kernel (auto configuration, phases, the configuration sweep, CUDA-graph replays over distinct
inputs), the Triton paths, vLLM's kernels (``--anchors``, measuring only) and ``torch.topk`` at decode and
prefill shapes, against the read floor at the bandwidth the bench measured; ``dist``: the value distributions;
``step``: the decode step (paged logits + top-k as ``indexer_decode`` runs them), eager and in a CUDA graph.
Times are the bench's timer (CUDA events, L2 flushed). ``--smoke``: tiny shapes, also on the CPU (checks the sweep
itself): the correctness section runs the reference backend, the timed rows ``auto`` (labelled with the backend it
resolves to on the device, e.g. ``reference (auto)`` on the CPU); CUDA-graph rows are left out (said once: they
need a CUDA device, and are not taken under ``--smoke``).
"""

from __future__ import annotations

import math
import time
import traceback

import torch

from ..._runtime import dispatch as _dispatch
from ...indexer import indexer_decode
from ...kcache import new_kv_cache
from ...metadata import build_metadata
from ...testing import TOPK_DISTRIBUTIONS, topk_errors, topk_values
from ..fp8_paged_mqa_logits import fp8_paged_mqa_logits
from ..write_k_cache import write_k_cache
from . import top_k_per_row

__all__ = ["DEFAULT_CONFIGS", "DISTS", "SECTIONS", "run"]

SECTIONS = ("check", "topk", "dist", "step")
DEFAULT_CONFIGS = "256x1,512x1,1024x1,512x2,1024x2,512x4,1024x4,1024x8,1024x16"
"""The CUDA kernel's launch configurations swept by default (threads per CTA x CTAs per row)."""
K = 2048
DISTS = TOPK_DISTRIBUTIONS


def run(env) -> tuple[list[tuple[str, str, str, str]], dict]:
    """Run the sections of ``env`` (a :class:`sparse_indexer.commands.bench_cases.SweepEnv`); returns the rows
    ``(case, what, us, note)`` and the results by key (``check_bad_rows``: rows wrong against the spec; a row
    whose ``what`` is ``FAILED``: a section that raised)."""
    SMOKE = env.smoke  # noqa: N806 - the sweep's mode, read by every helper below
    dev = env.device
    BW = env.floors.get("bandwidth", {}).get("value")  # noqa: N806 - TB/s measured by the bench
    rows: list[tuple[str, str, str, str]] = []
    res: dict = {}
    SWEEP = [tuple(int(v) for v in c.split("x")) for c in (env.configs or DEFAULT_CONFIGS).split(",") if c]  # noqa: N806
    V = env.anchors  # noqa: N806 - vLLM's kernels (measuring only) or None
    if not SMOKE:
        from . import cuda as tkc
        from . import triton as tkt

    def bench(fn):
        return env.median_us(fn)

    GRAPHS = dev.type == "cuda" and not SMOKE  # noqa: N806 - CUDA-graph rows are taken (and printed) only then
    if not GRAPHS and (env.want("topk") or env.want("step")):  # the sections that have graph rows
        why = "they need a CUDA device" if dev.type != "cuda" else "they are not taken under --smoke"
        rows.append(("graphs", f"CUDA-graph rows left out: {why}", "", ""))
        print(rows[-1][1], flush=True)

    def resolved(logits, starts, ends, out, backend):
        """The backend ``backend`` (``None``: auto) runs this top-k call on the device, as a row label."""
        if backend is not None:
            return backend
        route = _dispatch.chosen(_dispatch.routes("top_k_per_row", None, dev), None, (logits, starts, ends),
                                 {"out": out})
        return f"{route.name if route is not None else 'none'} (auto)"

    def graph_us(fns, reps=20):
        """Median per-call time of fns (one call each, distinct buffers: L2 holds no set) replayed in one graph."""
        assert GRAPHS, "graph rows are taken on a CUDA device only"
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / len(fns))
        return sorted(ts)[len(ts) // 2]

    def section(name):
        def deco(f):
            key = name.split()[0]
            if not env.want(key):
                return f
            t0 = time.time()
            try:
                f()
            except Exception:  # noqa: BLE001 - a failed section is a row, the others still run
                traceback.print_exc()
                rows.append((name, "FAILED", "", ""))
            print(f"[{name}] {time.time() - t0:.1f}s", flush=True)
            return f
        return deco

    def add(case, what, us="", note=""):
        rows.append((case, what, f"{us:.1f}" if isinstance(us, float) else us, note))
        print(f"  {case:24s} {what:58s} {rows[-1][2]:>9s} {note}", flush=True)

    # ------------------------------------------------------------------ inputs
    _REAL = {}


    def real_logits(r, w, g):
        """Logits of the paged logits op on random FP8 queries/keys (B = r, next_n = 1, L = w), cached per shape."""
        if (r, w) not in _REAL:
            bs, d, h = 64, 128, 64
            nb = r * ((w + bs - 1) // bs)
            kv = new_kv_cache(nb, bs, d, device=dev)
            write_k_cache(torch.randn(nb * bs, d, device=dev, generator=g), kv, torch.arange(nb * bs, device=dev))
            bt = torch.randperm(nb, device=dev, generator=g).int().view(r, -1)
            q = (torch.randn(r, 1, h, d, device=dev, generator=g) * 2).to(torch.float8_e4m3fn)
            wt = torch.randn(r, h, device=dev, generator=g) / math.sqrt(h * d)
            cl = torch.full((r,), w, dtype=torch.int32, device=dev)
            _REAL[(r, w)] = fp8_paged_mqa_logits(q, kv, wt, cl, bt)
            del kv
        return _REAL[(r, w)].clone()


    def make(dist, r, w, g):
        return topk_values(dist, r, w, device=dev, generator=g, real_logits=lambda rr, ww: real_logits(rr, ww, g))


    def windows(kind, r, w, g, topk=K):
        z = torch.zeros(r, dtype=torch.int32, device=dev)
        if kind == "full":
            return z, torch.full((r,), w, dtype=torch.int32, device=dev)
        if kind == "ragged":  # decode: [0, L_r)
            return z, torch.randint(w // 2, w + 1, (r,), device=dev, dtype=torch.int32, generator=g)
        if kind == "causal":  # prefill, one request of r queries over w keys: [0, (j + 1) w / r)
            return z, ((torch.arange(r, device=dev) + 1) * w // r).int()
        if kind == "short":  # every window <= topk, some empty
            return z, torch.randint(0, topk + 1, (r,), device=dev, dtype=torch.int32, generator=g)
        if kind == "starts":  # ragged prefill windows [ks, ke)
            s = torch.randint(0, w // 3, (r,), device=dev, dtype=torch.int32, generator=g)
            e = torch.randint(w // 3, w + 1, (r,), device=dev, dtype=torch.int32, generator=g)
            e[::7] = s[::7]  # empty
            e[1::7] = torch.clamp(s[1::7] + topk, max=w)  # exactly topk
            return s, e
        raise ValueError(kind)


    def ref_check(logits, starts, ends, out, check_rows=None):
        """docs/spec.md §6 (:func:`sparse_indexer.testing.topk_errors`). Returns the number of bad rows."""
        if check_rows is not None:
            logits, starts, ends, out = logits[check_rows], starts[check_rows], ends[check_rows], out[check_rows]
        return len(topk_errors(out, logits, starts, ends))


    def backends_under_test():
        return ["reference"] if SMOKE else ["cuda", "triton"]


    # ------------------------------------------------------------------ 1. correctness
    @section("check correctness")
    def _():
        g = torch.Generator(device=dev).manual_seed(1)
        shapes = [(16, 3000, 256), (12, 70000, K), (40, 9000, 512), (5, 20000, 1), (6, 30000, 4096), (9, 12000, 3000)]
        if SMOKE:
            shapes = [(6, 3000, 256)]
        configs = [None] if SMOKE else [None, *SWEEP, (256, 1), (1024, 16), (512, 1, False), (1024, 4, False)]
        total_bad = 0
        for r, w, topk in shapes:
            for kind in ("full", "ragged", "starts", "short", "causal"):
                for dist in DISTS if (r, w) != (5, 20000) else ("gaussian", "ints0-3"):
                    x = make(dist, r, w + 5, g)[:, 1:w + 1]  # unaligned base, odd row stride
                    if dist == "logits":
                        x = x.contiguous()  # aligned base
                    s, e = windows(kind, r, w, g, topk)
                    for cfg in configs:
                        out = torch.full((r, topk), -7, dtype=torch.int32, device=dev)
                        if SMOKE:
                            top_k_per_row(x, s, e, out=out, backend="reference")
                        elif cfg is None:
                            top_k_per_row(x, s, e, out=out, backend="cuda")
                        elif len(cfg) == 3 and w > tkc.cap_for(topk):
                            continue
                        else:
                            tkc.launch(x, s, e, out, nt=cfg[0], cs=cfg[1], small=cfg[2] if len(cfg) == 3 else None)
                        b = ref_check(x, s, e, out)
                        total_bad += b
                        if b:
                            add("check", f"BAD {r}x{w} k={topk} {kind} {dist} cfg={cfg}", "", f"{b} rows")
        # the exact fallback inside the CUDA kernel (sample miss, candidate overflow), every config
        if not SMOKE:
            for dist in ("adv-overflow", "adv-miss"):
                x = make(dist, 4, 65536, g)
                s, e = windows("full", 4, 65536, g)
                for cfg in configs:
                    out = torch.full((4, K), -7, dtype=torch.int32, device=dev)
                    if cfg is None:
                        top_k_per_row(x, s, e, out=out, backend="cuda")
                    else:
                        tkc.launch(x, s, e, out, nt=cfg[0], cs=cfg[1])
                    b = ref_check(x, s, e, out)
                    total_bad += b
                    if b:
                        add("check", f"BAD fallback {dist} cfg={cfg}", "", f"{b} rows")
                res[f"fallback/{dist}"] = bench(lambda x=x, s=s, e=e: top_k_per_row(
                    x, s, e, out=torch.empty(4, K, dtype=torch.int32, device=dev), backend="cuda"))
                add("check", f"fallback path {dist} 4x64K (time)", res[f"fallback/{dist}"])
        # the Triton backend on every distribution (portable path), with and without the workspace
        if not SMOKE:
            for dist in DISTS:
                x = make(dist, 64, 65536, g)
                s, e = windows("ragged", 64, 65536, g)
                ws = torch.empty(64, 32 + 2 * 4096, dtype=torch.int32, device=dev)
                for wsv in (None, ws):
                    out = torch.full((64, K), -7, dtype=torch.int32, device=dev)
                    top_k_per_row(x, s, e, out=out, backend="triton", workspace=wsv)
                    b = ref_check(x, s, e, out)
                    total_bad += b
                    if b:
                        add("check", f"BAD triton {dist} ws={wsv is not None}", "", f"{b} rows")
        add("check", f"all configs, shapes, windows, distributions: bad rows = {total_bad}", "", "OK" if total_bad == 0
            else "MISMATCH")
        res["check_bad_rows"] = total_bad


    # ------------------------------------------------------------------ 2. top-k timings
    def time_topk(case, x, s, e, *, sweep=False, anchors=("persistent", "cooperative"), triton_ws=True, graph=True,
                  torch_topk=True, check=True):
        r, w = x.shape
        out = torch.empty(r, K, dtype=torch.int32, device=dev)
        if check and not SMOKE:
            out.fill_(-7)
            top_k_per_row(x, s, e, out=out, backend="cuda")
            b = ref_check(x, s, e, out, None if r <= 512 else torch.randperm(r, device=dev)[:512])
            if b:
                add(case, "cuda: MISMATCH", "", f"{b} rows")
        d = {}
        be = None if SMOKE else "cuda"  # --smoke: auto (the reference on the CPU)
        d["cuda"] = bench(lambda: top_k_per_row(x, s, e, out=out, backend=be, check_values=False))
        if SMOKE:
            add(case, f"ours {resolved(x, s, e, out, be)}", d["cuda"])
        else:
            cfg = tkc.config(r, w, x.device)
            add(case, f"ours cuda (auto {cfg})", d["cuda"])
        if not SMOKE:
            d["cuda_launch"] = bench(lambda: tkc.launch(x, s, e, out, nt=cfg[0], cs=cfg[1], small=cfg[2]))
            add(case, "  same, kernel launch only (no checks/dispatch)", d["cuda_launch"])
            ph = [bench(lambda st=st: tkc.launch(x, s, e, out, nt=cfg[0], cs=cfg[1], small=cfg[2], stop=st))
                  for st in (3, 4, 1, 2)]
            d["cuda_phases"] = ph
            add(case, f"  phases: bounds {ph[0]:.1f}, +sample load {ph[1]:.1f}, +threshold {ph[2]:.1f}, +filter "
                f"{ph[3]:.1f}, +select", d["cuda_launch"])
        if graph and GRAPHS:
            sets = [x] + [x[torch.randperm(r, device=dev)] for _ in range(5)]
            outs = [torch.empty_like(out) for _ in sets]
            d["cuda_graph"] = graph_us([lambda x_=x_, o=o: top_k_per_row(x_, s, e, out=o, backend=be,
                                                                             check_values=False)
                                        for x_, o in zip(sets, outs)])
            add(case, "  graph x6 sets", d["cuda_graph"])
        if sweep and not SMOKE and w <= tkc.cap_for(K):  # every row sampled instead of selected in shared memory
            for nt in (256, 512, 1024):
                t = bench(lambda nt=nt: tkc.launch(x, s, e, out, nt=nt, cs=1, small=False))
                d[f"cuda_{nt}x1_sampled"] = t
                add(case, f"  cuda nt={nt} cs=1 sampled (not small)", t)
        if sweep and not SMOKE:
            for nt, cs in SWEEP:
                try:
                    t = bench(lambda nt=nt, cs=cs: tkc.launch(x, s, e, out, nt=nt, cs=cs))
                    d[f"cuda_{nt}x{cs}"] = t
                    add(case, f"  cuda nt={nt} cs={cs}", t)
                except Exception as ex:  # noqa: BLE001
                    add(case, f"  cuda nt={nt} cs={cs} failed: {str(ex)[:60]}")
        if not SMOKE:
            d["triton"] = bench(lambda: top_k_per_row(x, s, e, out=out, backend="triton", check_values=False))
            add(case, "triton (no workspace)", d["triton"])
            if triton_ws and tkt.use_split(r, x.device, w):
                ws = torch.empty(r, 32 + 2 * 4096, dtype=torch.int32, device=dev)
                d["triton_ws"] = bench(lambda: top_k_per_row(x, s, e, out=out, backend="triton", workspace=ws,
                                                                check_values=False))
                add(case, "triton (workspace)", d["triton_ws"])
        if V is not None:
            z = torch.zeros_like(s)
            full_start = bool((s == 0).all())
            for a in anchors:
                try:
                    if a == "prefill":
                        fn = lambda: V.prefill(x, s, e, out)  # noqa: E731
                    elif not full_start:
                        continue
                    else:
                        fn = lambda a=a: getattr(V, a)(x, e, out)  # noqa: E731
                    t = bench(fn)
                    d[f"vllm_{a}"] = t
                    add(case, f"vLLM {a}", t)
                except Exception as ex:  # noqa: BLE001
                    add(case, f"vLLM {a} failed: {str(ex)[:60]}")
            del z
        if torch_topk:
            d["torch_topk"] = bench(lambda: torch.topk(x, K, dim=1))
            add(case, "torch.topk (full rows)", d["torch_topk"])
        nbytes = int((e - s).clamp(min=0).sum()) * 4
        if BW:
            d["floor_us"] = nbytes / (BW * 1e12) * 1e6
            add(case, f"read floor ({nbytes / 2**20:.1f} MiB at the measured {BW:.3g} TB/s)", d["floor_us"])
        res[f"topk/{case}"] = d
        return d


    @section("topk shapes")
    def _():
        g = torch.Generator(device=dev).manual_seed(2)
        sh = [("64x64K full", 64, 65536, "full"), ("64x64K ragged", 64, 65536, "ragged"),
              ("16x64K full", 16, 65536, "full"), ("4x64K full", 4, 65536, "full"), ("1x64K full", 1, 65536, "full"),
              ("128x32K full", 128, 32768, "full"), ("256x16K full", 256, 16384, "full")]
        if SMOKE:
            sh = [("4x8K full", 4, 8192, "full")]
        for case, r, w, kind in sh:
            x = make("gaussian", r, w, g)
            s, e = windows(kind, r, w, g)
            time_topk(case, x, s, e, sweep=True)
        pre = [("prefill 8Kx64K causal", 8192, 65536), ("prefill 8Kx8K causal", 8192, 8192)]
        if SMOKE:
            pre = [("prefill 64x4K causal", 64, 4096)]
        for case, r, w in pre:
            x = make("gaussian", r, w, g)
            s, e = windows("causal", r, w, g)
            time_topk(case, x, s, e, sweep=True, anchors=("prefill",), graph=False, torch_topk=True)


    @section("dist distributions")
    def _():
        g = torch.Generator(device=dev).manual_seed(3)
        r, w = (64, 65536) if not SMOKE else (4, 8192)
        s, e = windows("full", r, w, g)
        base = None
        for dist in DISTS:
            x = make(dist, r, w, g)
            d = time_topk(f"dist {dist}", x, s, e, anchors=("persistent",), graph=not SMOKE, torch_topk=False,
                          triton_ws=False)
            base = base or d["cuda"]
            add(f"dist {dist}", f"  ratio to gaussian ({'ours' if SMOKE else 'cuda'})", "", f"{d['cuda'] / base:.2f}x")
        x = make("gaussian", 8192, 8192, g) if not SMOKE else make("gaussian", 64, 4096, g)
        s, e = windows("causal", x.shape[0], x.shape[1], g)
        be = None if SMOKE else "cuda"
        for dist in DISTS:
            x = make(dist, x.shape[0], x.shape[1], g)
            o = torch.empty(x.shape[0], K, dtype=torch.int32, device=dev)
            t = bench(lambda x=x, o=o: top_k_per_row(x, s, e, out=o, backend=be, check_values=False))
            add(f"dist-prefill {dist}", f"{resolved(x, s, e, o, be)} {x.shape[0]}x{x.shape[1]} causal", t)
            res[f"dist-prefill/{dist}"] = t


    # ------------------------------------------------------------------ 3. the decode step
    def step_case(b, nn, L, g):
        from buffers import IndexerLimits, allocate

        bs, d, h = 64, 128, 64
        lim = IndexerLimits(max_model_len=L, max_num_batched_tokens=b * nn, max_num_seqs=b, next_n=nn,
                            topk=K if not SMOKE else 256, prefill_k_tokens=L, max_logits_bytes=b * nn * L * 4)
        mb = (L + bs - 1) // bs
        nb = b * mb
        kv = new_kv_cache(nb, bs, d, device=dev)
        kv.view(torch.uint8)[..., :d].copy_(torch.randint(0, 120, kv[..., :d].shape, dtype=torch.uint8))
        kv.view(torch.uint8)[..., d:].view(torch.float32).fill_(0.01)
        bt = torch.randperm(nb, generator=g).int().view(b, mb).to(dev)
        bufs = allocate(lim, dev)
        seq = [L] * b
        t = b * nn
        q = (torch.randn(t, h, d, generator=g) * 2).to(torch.float8_e4m3fn).to(dev)
        w = (torch.randn(t, h, generator=g) / math.sqrt(h * d)).to(dev)
        pos = torch.cat([torch.arange(L - nn, L) for _ in range(b)])
        req = torch.arange(b).repeat_interleave(nn)
        slots = (bt.cpu().long()[req, pos // bs] * bs + pos % bs).to(dev)
        md = build_metadata(seq, [nn] * b, bt, slots, lim)
        out = torch.empty(t, lim.topk, dtype=torch.int32, device=dev)
        case = f"step B={b} next_n={nn} L={L // 1024}K"
        d_ = {}
        for be in ([None, "reference"] if SMOKE else [None, "triton"]):
            if be is None:  # what auto runs here: the reference alone (the CPU), or its top-k's backend named
                lg_ = bufs.logits_view(t, md.decode.width)
                tk = resolved(lg_, md.decode.row_starts, md.decode.row_ends, out, None).split()[0]
                name = f"{tk} (auto)" if _dispatch.available(dev) == (tk,) else f"auto ({tk} top-k)"
            else:
                name = be

            def step(be=be):
                indexer_decode(q, w, kv, md, bufs, out, backend=be)

            step()
            sel = out.clone()
            if be is None:
                first = sel
            else:  # both selections right on the same logits (the logits op is deterministic)
                lg = bufs.logits_view(t, md.decode.width)
                rs, re_ = md.decode.row_starts, md.decode.row_ends
                ok = not topk_errors(first, lg, rs, re_) and not topk_errors(sel, lg, rs, re_)
                add(case, f"{name} and auto: top-k right (value multisets)", "", str(ok))
            d_[f"{name} eager"] = bench(step)
            add(case, f"{name}: logits + top-k, eager", d_[f"{name} eager"])
            if GRAPHS:  # graph replay with the L2 flushed before each replay (as do_bench does)
                gr = torch.cuda.CUDAGraph()
                s_ = torch.cuda.Stream()
                s_.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s_):
                    step()
                torch.cuda.current_stream().wait_stream(s_)
                with torch.cuda.graph(gr):
                    step()
                d_[f"{name} graph"] = bench(gr.replay)
                add(case, f"{name}: logits + top-k, CUDA graph", d_[f"{name} graph"])
        logits = bufs.logits_view(t, md.decode.width)
        d_["logits"] = bench(lambda: fp8_paged_mqa_logits(q.view(b, nn, h, d), kv, w, md.decode.context_lens,
                                                             md.decode.block_table, out=logits, clean=False,
                                                             check_values=False))
        add(case, "logits alone (eager)", d_["logits"])
        res[f"step/{case}"] = d_


    @section("step decode")
    def _():
        shapes = [(64, 1, 65536), (64, 2, 65536), (256, 1, 16384), (1, 1, 65536), (4, 1, 65536), (16, 1, 65536)]
        if SMOKE:
            shapes = [(2, 1, 4096)]
        g = torch.Generator(device="cpu").manual_seed(4)
        for b, nn, L in shapes:
            step_case(b, nn, L, g)
            if not SMOKE:
                torch.cuda.empty_cache()



    return rows, res
