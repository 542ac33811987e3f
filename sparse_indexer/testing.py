"""The checks of the indexer's outputs: top-k selections (docs/spec.md §6) and FP8 logits (§5), in one place.

The tests, the benchmark (``python -m sparse_indexer bench``), the self-check (``python -m sparse_indexer
check``), the demo and the scripts judge results with these functions; so can anyone writing a backend
(README, "Adding a backend").

Top-k: row ``i`` of ``sel [R, topk] int32`` selects from the window ``logits[i, starts[i]:ends[i]]`` (positions
relative to the window start). A window of ``n <= topk`` cells must give exactly ``0, 1, ..., n - 1, -1, ...``;
a longer one ``topk`` distinct positions in ``[0, n)`` whose values, sorted, equal the window's ``topk`` largest
(ties may be broken either way: only the multiset of values counts; NaN ranks as ``-inf``). ``rtol`` allows
the sorted values to differ by ``rtol * max|finite window value|`` (logits from another computation, e.g. a
tensor-core kernel judged by float64 scores); ``threshold=True`` only asks every selected value to be within that
of the ``topk``-th largest.

Logits: inside the windows, the relative L2 error against the expected values (float64 or the reference
backend's); with ``clean``, the ``-inf`` mask (cells outside the windows) must match exactly. ``scale`` (the
magnitudes ``sum_h |w_h| relu(q_h . k) s_k``: the scores with ``|weights|``, the sum of the terms' sizes) replaces the
expected values in the denominator: a float32 sum's error is bounded by its terms' sizes, not by its result, so a
window of a few keys whose heads cancel (a score near 0 from terms of size 1) is judged on what it summed.

Fused ops (``fp8_paged_mqa_topk``, ``fp8_mqa_topk``; docs/spec.md §6b): the selection must be exact for the logits
the op returned (the top-k check above with ``rtol = 0`` on them), and those logits, inside the windows, within
:data:`FUSED_LOGITS_RTOL_L2` relative L2 of the reference composition's (:data:`FUSED_LOGITS_RTOL_L2_BF16` for
bfloat16 logits; non-finite scores equal), so a kernel
cannot select well on wrong scores nor return right scores beside a wrong selection.
"""

from __future__ import annotations

import torch

__all__ = ["ADVERSARIAL_DISTRIBUTIONS", "FUSED_LOGITS_RTOL_L2", "FUSED_LOGITS_RTOL_L2_BF16", "LOGITS_RTOL_L2",
           "TOPK_DISTRIBUTIONS",
           "assert_candidates", "assert_fused_topk", "assert_logits", "assert_topk", "block_scores",
           "candidate_errors", "capture_cuda_graph", "eligible", "fused_topk_errors", "logits_error",
           "paged_inputs_for_scores", "paged_windows", "ragged_inputs_for_scores", "rank_key", "top_values",
           "topk_errors", "topk_values"]

LOGITS_RTOL_L2 = 1e-5
"""Relative L2 error allowed inside the windows against float64 (FP8 products exact in float32, float32 sums)."""
FUSED_LOGITS_RTOL_L2 = 2e-4
"""Relative L2 error allowed inside the windows between the float32 logits a fused op returned and the reference
composition's (tensor-core sums against float32 sums of another order)."""
FUSED_LOGITS_RTOL_L2_BF16 = 2e-3
"""The same for bfloat16 logits: each is rounded once from a float32 score about ``1e-4`` from the reference's, so
near a rounding boundary the two land one bfloat16 step (``2**-8`` relative) apart (measured on an H200: about
``7e-4``)."""
NEG_INF = float("-inf")

TOPK_DISTRIBUTIONS = ("gaussian", "logits", "ints0-3", "all-equal", "heavy", "sorted", "95%-inf", "nan+inf")
"""Value distributions every top-k backend is tested and timed on (:func:`topk_values`)."""
ADVERSARIAL_DISTRIBUTIONS = ("adv-overflow", "adv-miss")
"""Distributions aimed at a sampling top-k that samples every 32nd cell: big cells the sample never sees (its
candidate buffer overflows), or only sampled cells big (its threshold is too high); both force exact fallbacks."""


def topk_values(name: str, rows: int, width: int, *, device: torch.device | str = "cpu",
                generator: torch.Generator | None = None, real_logits=None) -> torch.Tensor:
    """``[rows, width]`` float32 values of one of :data:`TOPK_DISTRIBUTIONS` or :data:`ADVERSARIAL_DISTRIBUTIONS`.

    ``gaussian``; ``logits``: scores of the paged logits op (``real_logits(rows, width)`` when given, else random
    FP8 queries and keys through ``fp8_paged_mqa_logits``, small heads on the CPU); ``ints0-3`` (massive ties);
    ``all-equal``; ``heavy`` (``exp(4 x Gaussian)``); ``sorted`` ascending rows; ``95%-inf``; ``nan+inf`` (1% NaN,
    0.5% ``+inf``, 1.5% ``-inf``); ``adv-overflow``, ``adv-miss`` (see :data:`ADVERSARIAL_DISTRIBUTIONS`).
    ``generator`` must live on ``device``.
    """
    dev, g, shape = torch.device(device), generator, (rows, width)
    x = torch.randn(shape, device=dev, generator=g)
    if name == "gaussian":
        return x
    if name == "logits":
        if real_logits is not None:
            return real_logits(rows, width)
        return _paged_logits(rows, width, dev, g)
    if name == "ints0-3":
        return torch.randint(0, 4, shape, device=dev, generator=g).float()
    if name == "all-equal":
        return torch.full(shape, 0.5, device=dev)
    if name == "heavy":
        return torch.exp(4 * x)
    if name == "sorted":
        return x.sort(dim=1).values
    if name == "95%-inf":
        return torch.where(torch.rand(shape, device=dev, generator=g) < 0.95, NEG_INF, x)
    if name == "nan+inf":
        u = torch.rand(shape, device=dev, generator=g)
        x = torch.where(u < 0.01, float("nan"), x)
        x = torch.where((u >= 0.01) & (u < 0.015), float("inf"), x)
        return torch.where((u >= 0.015) & (u < 0.03), NEG_INF, x)
    if name == "adv-overflow":
        y = x * 1e-3
        for o in (1, 2, 3):
            y[:, o::32] += 10 + x[:, o::32]
        return y
    if name == "adv-miss":
        y = x * 1e-3
        y[:, ::32] += 10 + x[:, ::32]
        return y
    raise ValueError(f"unknown distribution {name!r}; choose from {TOPK_DISTRIBUTIONS + ADVERSARIAL_DISTRIBUTIONS}")


def _paged_logits(rows: int, width: int, dev: torch.device, g) -> torch.Tensor:
    """Scores of ``fp8_paged_mqa_logits`` on random FP8 queries and keys (``B = rows``, ``next_n = 1``,
    ``L = width``): DeepSeek-V3.2's heads on a GPU, small ones (reference backend) on the CPU."""
    import sparse_indexer as si

    gpu = dev.type != "cpu"
    bs, d, h = (64, 128, 64) if gpu else (16, 64, 4)
    backend = None if gpu else "reference"
    nb = rows * ((width + bs - 1) // bs)
    kv = si.new_kv_cache(nb, bs, d, device=dev)
    si.write_k_cache(torch.randn(nb * bs, d, device=dev, generator=g), kv, torch.arange(nb * bs, device=dev),
                     backend=backend)
    bt = torch.randperm(nb, device=dev, generator=g).int().view(rows, -1)
    q = (torch.randn(rows, 1, h, d, device=dev, generator=g) * 2).to(torch.float8_e4m3fn)
    wt = torch.randn(rows, h, device=dev, generator=g) / (h * d) ** 0.5
    lens = torch.full((rows,), width, dtype=torch.int32, device=dev)
    return si.fp8_paged_mqa_logits(q, kv, wt, lens, bt, backend=backend)[:, :width].contiguous()


def rank_key(x: torch.Tensor) -> torch.Tensor:
    """float64 values where NaN counts as ``-inf`` (both rank below every finite value)."""
    x = x.double()
    return torch.where(torch.isnan(x), torch.full_like(x, NEG_INF), x)


def top_values(window: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` largest values of a 1-D window (NaN as ``-inf``), sorted descending, float64."""
    return torch.sort(rank_key(window), descending=True).values[:topk]


def _as_rows(logits, starts, ends) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits [R, W], starts [R], ends [R])`` from a 2-D tensor and its windows, or from a sequence of 1-D
    windows (padded into one tensor, each window starting at column 0)."""
    if starts is None or ends is None:
        if starts is not None or ends is not None:
            raise ValueError("give both starts and ends, or neither (logits a sequence of 1-D windows)")
        rows = list(logits)
        lens = [int(w.shape[0]) for w in rows]
        dev = rows[0].device if rows else torch.device("cpu")
        x = torch.zeros(len(rows), max(lens, default=0), dtype=torch.float64, device=dev)
        for i, w in enumerate(rows):
            x[i, : lens[i]] = w
        return x, torch.zeros(len(rows), dtype=torch.long, device=dev), torch.tensor(lens, device=dev)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"logits must be a 2-D tensor when starts/ends are given, got {type(logits).__name__}")
    return logits, torch.as_tensor(starts).to(logits.device).long(), torch.as_tensor(ends).to(logits.device).long()


def topk_errors(sel: torch.Tensor, logits, starts=None, ends=None, *, rtol: float = 0.0, threshold: bool = False,
                limit: int | None = None) -> list[str]:
    """What is wrong with each row of ``sel [R, topk]`` (int32) as the top-k of its window (see the module
    docstring): ``logits [R, W]`` (any float dtype, any device) with ``starts/ends [R]``, or ``logits`` a
    sequence of ``R`` 1-D windows. One message per wrong row, at most ``limit``; ``[]`` when every row is
    right. Vectorized over rows (chunks of at most 2**24 cells) on the tensors' device."""
    x, s, e = _as_rows(logits, starts, ends)
    r, w = x.shape
    if sel.dim() != 2 or sel.shape[0] != r:
        raise ValueError(f"sel must be [R = {r}, topk], got {tuple(sel.shape)}")
    sel = sel.to(x.device)
    errors: list[str] = []
    step = max(1, (1 << 24) // max(1, w))
    for r0 in range(0, r, step):
        r1 = min(r, r0 + step)
        for i in _bad_rows(sel[r0:r1].long(), x[r0:r1], s[r0:r1], e[r0:r1], rtol, threshold):
            i += r0
            errors.append(_row_error(i, sel[i], x[i, int(s[i]) : max(int(s[i]), int(e[i]))], rtol, threshold))
            if limit is not None and len(errors) >= limit:
                return errors
    return errors


def _bad_rows(pos: torch.Tensor, x: torch.Tensor, s: torch.Tensor, e: torch.Tensor, rtol: float,
              threshold: bool) -> list[int]:
    """Indices of the rows of ``pos [rows, topk]`` (int64) that break docs/spec.md §6 on ``x [rows, W]``."""
    topk = pos.shape[1]
    n = (e - s).clamp(min=0)
    ar = torch.arange(topk, device=pos.device)
    short = n <= topk
    bad = short & (pos != torch.where(ar[None, :] < n[:, None], ar[None, :], -1)).any(dim=1)
    lng = ~short
    if bool(lng.any()):
        xl, sl, nl, p = x[lng], s[lng], n[lng], pos[lng]
        cols = torch.arange(x.shape[1], device=x.device)
        inside = (cols[None, :] >= sl[:, None]) & (cols[None, :] < (sl + nl)[:, None])
        key = torch.where(inside, rank_key(xl), NEG_INF)  # float64, -inf outside the window
        wrong = ((p < 0) | (p >= nl[:, None])).any(dim=1) | (p.sort(dim=1).values.diff(dim=1) == 0).any(dim=1)
        p = p.clamp(min=0).minimum((nl - 1)[:, None])
        got = key.gather(1, p + sl[:, None]).sort(dim=1, descending=True).values
        want = key.topk(topk, dim=1).values  # sorted, descending
        tol = rtol * torch.where(torch.isfinite(key), key.abs(), 0.0).amax(dim=1)
        if threshold:
            kth = want[:, -1:]
            wrong |= torch.where(torch.isfinite(kth), kth - got, 0.0).amax(dim=1) > tol
        else:
            fin = torch.isfinite(want)
            wrong |= (torch.isfinite(got) != fin).any(dim=1)
            wrong |= torch.where(fin, (got - want).abs(), 0.0).nan_to_num(float("inf")).amax(dim=1) > tol
        bad[lng] = wrong
    return bad.nonzero().flatten().tolist()


def _row_error(i: int, row: torch.Tensor, window: torch.Tensor, rtol: float, threshold: bool) -> str:
    """The message of wrong row ``i``: ``row [topk]`` its selection, ``window`` its cells."""
    row, window = row.cpu().long(), window.cpu()
    n, topk = window.shape[0], row.shape[0]
    if n <= topk:
        want = torch.cat([torch.arange(n), torch.full((topk - n,), -1)])
        return f"row {i} (len {n} <= topk {topk}): got {row[:20].tolist()}..., want {want[:20].tolist()}..."
    if bool(((row < 0) | (row >= n)).any()):
        return f"row {i}: positions outside [0, {n}): {sorted(row.tolist())[:10]}..."
    if row.unique().numel() != topk:
        return f"row {i}: {topk - row.unique().numel()} repeated positions"
    key = rank_key(window)
    fin_key = torch.isfinite(key)
    scale = float(key[fin_key].abs().max()) if bool(fin_key.any()) else 0.0
    got = torch.sort(key[row], descending=True).values
    want = top_values(window, topk)
    if threshold:
        return (f"row {i}: a selected value is {float((want[-1] - got).max()):.3e} below the {topk}-th largest "
                f"(tolerance {rtol:.0e} x max|value| {scale:.3e})")
    fin = torch.isfinite(want)
    if not bool((torch.isfinite(got) == fin).all()):
        return (f"row {i}: selected {int((~torch.isfinite(got)).sum())} -inf/NaN cells, the top-{topk} have "
                f"{int((~fin).sum())}")
    diff = (got[fin] - want[fin]).abs()
    j = int(diff.argmax())
    return (f"row {i}: sorted selected values differ from the top-{topk} values: "
            f"{int((diff > rtol * scale).sum())} mismatches, worst at rank {j}: "
            f"got {float(got[fin][j])!r}, want {float(want[fin][j])!r}")


def assert_topk(sel: torch.Tensor, logits, starts=None, ends=None, *, rtol: float = 0.0,
                threshold: bool = False, candidates: torch.Tensor | None = None,
                candidate_block_size: int | None = None) -> None:
    """Raise ``AssertionError`` naming the first wrong row unless ``sel [R, topk]`` (int32) is the top-k of every
    window: ``logits [R, W]`` with ``starts/ends [R]``, or ``logits`` a sequence of ``R`` 1-D windows. With
    ``candidates`` (and ``candidate_block_size``), the top-k of each window's candidate cells
    (:func:`candidate_topk_errors`; ``rtol`` as there)."""
    assert sel.dtype == torch.int32, f"top-k output must be int32, got {sel.dtype}"
    if candidates is not None:
        errors = candidate_topk_errors(sel, logits, starts, ends, candidates, candidate_block_size, rtol=rtol,
                                       limit=1)
    else:
        errors = topk_errors(sel, logits, starts, ends, rtol=rtol, threshold=threshold, limit=1)
    if errors:
        raise AssertionError(errors[0])


# ---------------------------------------------------------------- fused ops (docs/spec.md §6b)
def paged_windows(context_lens: torch.Tensor, next_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, ends)`` int64 ``[B * next_n]`` of the decode rows' windows ``[0, limit[r])`` (docs/spec.md §5:
    :func:`sparse_indexer.row_limits`), on ``context_lens``'s device."""
    from .ops.fp8_paged_mqa_logits import row_limits

    ends = row_limits(context_lens, next_n)
    return torch.zeros_like(ends), ends


def paged_inputs_for_scores(values: torch.Tensor, lens=None, *, next_n: int = 1, heads: int = 64,
                            head_dim: int = 128, block_size: int = 64, generator: torch.Generator | None = None):
    """Decode inputs ``(q, kv_cache, weights, context_lens, block_table)`` whose §5 scores are exactly ``values``:
    row ``b * next_n + j`` scores request ``b``'s key ``p`` as ``values[b, p]`` (``values [B, L]`` float32, any
    finite or non-finite values, on the device the inputs are made on). ``lens`` (``[B]`` ints, default ``L``):
    each request's context length, so row ``r``'s window is ``[0, limit[r])`` of :func:`paged_windows`.

    So a fused op can be fed any value distribution (:func:`topk_values`) through its scoring: key ``p`` holds
    ``sign(values[b, p])`` in its first dimension (0 elsewhere) and ``|values[b, p]|`` as its scale; query heads 0
    and 1 hold ``+1`` and ``-1`` there with weights ``+1`` and ``-1`` (the other heads 0), so the head sum is the
    key's sign, exactly, and the scale multiplies it after the sum (docs/spec.md §5). The cache's blocks are a
    random permutation (``generator``, on the values' device)."""
    from .kcache import cache_views, new_kv_cache

    dev = values.device
    b, length = values.shape
    fp8 = torch.float8_e4m3fn
    per = -(-length // block_size)
    nb = max(1, b * per)
    kv = new_kv_cache(nb, block_size, head_dim, device=dev)
    vals, scales = cache_views(kv, torch.uint8)  # (the value bytes: index_put of FP8 is not on every device)
    perm = torch.randperm(nb, device=dev, generator=generator)
    bt = perm[: b * per].view(b, per).to(torch.int32)
    pos = torch.arange(length, device=dev)
    blk = bt.long()[:, pos // block_size]  # [B, L]
    off = (pos % block_size).expand(b, length)
    v = values.float()
    vals[blk, off, 0] = torch.where(v < 0, -1.0, 1.0).to(fp8).view(torch.uint8)  # the other dimensions stay 0
    scales[blk, off] = v.abs()
    q = torch.zeros(b, next_n, heads, head_dim, device=dev)
    q[:, :, 0, 0] = 1.0
    q[:, :, 1, 0] = -1.0
    w = torch.zeros(b * next_n, heads, device=dev)
    w[:, 0] = 1.0
    w[:, 1] = -1.0
    cl = torch.full((b,), length, dtype=torch.int32, device=dev) if lens is None else torch.as_tensor(
        lens, dtype=torch.int32).to(dev)
    return q.to(fp8), kv, w, cl, bt


def ragged_inputs_for_scores(values: torch.Tensor, rows: int, *, heads: int = 64, head_dim: int = 128):
    """Prefill inputs ``(q [rows, H, D], k_fp8 [N, D], k_scale [N], weights [rows, H])`` whose §5 ragged scores are
    exactly ``values [N]`` (float32) for every query row, built as :func:`paged_inputs_for_scores` builds its keys
    and queries (so each row's window ``[ks, ke)`` selects from ``values[ks:ke]``)."""
    dev = values.device
    fp8 = torch.float8_e4m3fn
    v = values.float()
    k = torch.zeros(v.shape[0], head_dim, device=dev)
    k[:, 0] = torch.where(v < 0, -1.0, 1.0)
    q = torch.zeros(rows, heads, head_dim, device=dev)
    q[:, 0, 0] = 1.0
    q[:, 1, 0] = -1.0
    w = torch.zeros(rows, heads, device=dev)
    w[:, 0] = 1.0
    w[:, 1] = -1.0
    return q.to(fp8), k.to(fp8), v.abs(), w


def _denominator(ei: torch.Tensor, inside: torch.Tensor, scale: torch.Tensor | None) -> float:
    """The L2 norm a logits error is relative to: the expected cells ``ei`` (zero outside ``inside``), or the
    magnitudes ``scale`` there (never below the expected cells' own norm)."""
    own = float(ei.norm())
    if scale is None:
        return own
    m = torch.where(inside, scale.detach().cpu().double().abs(), 0.0)
    m = torch.where(torch.isfinite(m), m, 0.0)
    return max(own, float(m.norm()))


def _score_errors(actual: torch.Tensor, expected: torch.Tensor, starts, ends, rtol_l2: float,
                  scale: torch.Tensor | None = None) -> str | None:
    """Why ``actual``'s in-window cells (``[R, W]``, any float dtype) are not ``expected``'s (same shape): a
    non-finite expected score not matched exactly (the same infinity, or NaN), or a relative L2 error of the
    finite ones of ``rtol_l2`` or more (relative to ``scale``'s cells when given: the module docstring);
    ``None`` when they match."""
    if actual.shape != expected.shape:
        return f"logits: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    s = torch.as_tensor(starts).cpu().long()[:, None]
    t = torch.as_tensor(ends).cpu().long()[:, None]
    cols = torch.arange(a.shape[1])[None, :]
    inside = (cols >= s) & (cols < t)
    fin = inside & torch.isfinite(e)
    other = inside & ~torch.isfinite(e)
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    bad = other & ~same
    if bool(bad.any()):
        r, c = (int(i) for i in bad.nonzero()[0])
        return (f"logits: {int(bad.sum())} non-finite scores differ inside the windows, first at [{r}, {c}]: "
                f"got {float(a[r, c])!r}, want {float(e[r, c])!r}")
    if not bool(fin.any()):
        return None
    ai, ei = torch.where(fin, a, 0.0), torch.where(fin, e, 0.0)
    if not bool(torch.isfinite(ai).all()):
        r, c = (int(i) for i in (~torch.isfinite(ai)).nonzero()[0])
        return (f"logits: a non-finite score inside the windows at [{r}, {c}]: {float(a[r, c])!r}, want "
                f"{float(e[r, c])!r}")
    diff = (ai - ei).abs()
    err = float(diff.norm()) / max(_denominator(ei, fin, scale), 1e-300)
    if err >= rtol_l2 and float(diff.max()) > 0:
        r, c = (int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        return (f"logits: relative L2 error {err:.3e} >= {rtol_l2:.0e} inside the windows; worst at [{r}, {c}]: "
                f"got {float(a[r, c])!r}, want {float(e[r, c])!r}")
    return None


def fused_topk_errors(sel: torch.Tensor, logits: torch.Tensor, starts, ends, *, expected: torch.Tensor | None = None,
                      rtol_l2: float | None = None, limit: int | None = None,
                      scale: torch.Tensor | None = None) -> list[str]:
    """What is wrong with the result of a fused op (docs/spec.md §6b): ``sel [R, topk]`` (int32) and the
    ``logits [R, W]`` it returned, row ``r``'s window ``[starts[r], ends[r])`` (decode rows:
    :func:`paged_windows`). ``sel`` must be exactly the top-k (docs/spec.md §6) of ``logits`` (:func:`topk_errors`
    with ``rtol = 0``: short windows ``0, ..., len - 1, -1, ...``, long ones the multiset of the window's ``topk``
    largest); with ``expected`` (the reference composition's logits, same shape), the in-window cells of
    ``logits`` within ``rtol_l2`` relative L2 of it (default :data:`FUSED_LOGITS_RTOL_L2`, for bfloat16 logits
    :data:`FUSED_LOGITS_RTOL_L2_BF16`; relative to ``scale``'s cells when given: the module docstring) and its
    non-finite scores matched exactly. ``[]`` when right; at most ``limit`` messages."""
    errors = topk_errors(sel, logits, starts, ends, limit=limit)
    if rtol_l2 is None:
        rtol_l2 = FUSED_LOGITS_RTOL_L2_BF16 if logits.dtype == torch.bfloat16 else FUSED_LOGITS_RTOL_L2
    if expected is not None and (limit is None or len(errors) < limit):
        why = _score_errors(logits, expected, starts, ends, rtol_l2, scale)
        if why is not None:
            errors.append(why)
    return errors


def assert_fused_topk(sel: torch.Tensor, logits: torch.Tensor, starts, ends, *, expected: torch.Tensor | None = None,
                      rtol_l2: float | None = None) -> None:
    """Raise ``AssertionError`` with the first message of :func:`fused_topk_errors`."""
    assert sel.dtype == torch.int32, f"top-k output must be int32, got {sel.dtype}"
    errors = fused_topk_errors(sel, logits, starts, ends, expected=expected, rtol_l2=rtol_l2, limit=1)
    if errors:
        raise AssertionError(errors[0])


# ---------------------------------------------------------------- candidate blocks (docs/spec.md §6a)
PINNED = float("inf")
"""Rank of a row's newest block: above every score."""


def block_scores(window: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rank keys (float64) of the blocks of one 1-D window, as docs/spec.md §6a ranks them: the newest block
    ``+inf``; a block whose maximum is ``+inf`` ``1e300``; one holding a NaN ``-1e300``; one of ``-inf`` cells only
    ``-inf`` (never a candidate); any other its maximum."""
    x = window.double()
    n = x.shape[0]
    nv = -(-n // block_size)
    pad = torch.full((nv * block_size,), NEG_INF, dtype=torch.float64, device=x.device)
    pad[:n] = x
    pad = pad.view(nv, block_size)
    nan = torch.isnan(pad).any(dim=1)
    mx = torch.where(torch.isnan(pad), NEG_INF, pad).amax(dim=1) if nv else pad.new_zeros(0)
    key = torch.where(mx == float("inf"), 1e300, mx)
    key = torch.where(nan, -1e300, key)
    if nv:
        key[nv - 1] = PINNED
    return key


def _window(x, s, e, i) -> torch.Tensor:
    return x[i, int(s[i]) : max(int(s[i]), int(e[i]))]


def candidate_errors(cand: torch.Tensor, logits, starts, ends, block_size: int, *, rtol: float = 0.0,
                     limit: int | None = None) -> list[str]:
    """What is wrong with each row of ``cand [R, K_b]`` (int32) as the candidate blocks of its window
    (docs/spec.md §6a): the first ``m = min(K_b, blocks not all -inf)`` columns must hold distinct block ids of
    the window whose rank keys (:func:`block_scores`), sorted, equal the ``m`` largest; the rest -1. ``rtol > 0``
    (logits judged by float64 scores of another computation): the newest block must be there and every other
    chosen block's score within ``rtol * max|finite score|`` of the ``m``-th largest."""
    x, s, e = _as_rows(logits, starts, ends)
    r, kb = cand.shape
    cand = cand.to(x.device).long()
    errors = []
    for i in range(r):
        key = block_scores(_window(x, s, e, i), block_size)
        m = min(kb, int((key > NEG_INF).sum()))
        row = cand[i]
        msg = None
        if bool((row[m:] != -1).any()) or bool((row[:m] < 0).any()):
            msg = f"row {i}: want {m} ids then -1, got {row[:min(kb, m + 8)].tolist()}..."
        elif bool((row[:m] >= key.shape[0]).any()):
            msg = f"row {i}: block ids outside [0, {key.shape[0]}): {row[:m][row[:m] >= key.shape[0]][:8].tolist()}"
        elif row[:m].unique().numel() != m:
            msg = f"row {i}: a block id appears twice"
        elif rtol > 0 and m:
            fin = key[torch.isfinite(key) & (key.abs() < 1e300)]
            tol = rtol * float(fin.abs().max()) if fin.numel() else 0.0
            kth = float(key.sort(descending=True).values[m - 1])
            worst = float(key[row[:m]].min())
            if int(key.shape[0] - 1) not in row[:m].tolist():
                msg = f"row {i}: the newest block {key.shape[0] - 1} is not a candidate"
            elif worst < kth - tol:
                msg = (f"row {i}: a chosen block scores {worst!r}, below the {m}-th largest {kth!r} by more than "
                       f"{tol:.3e}")
        else:
            got = key[row[:m]].sort(descending=True).values
            want = key.sort(descending=True).values[:m]
            if not torch.equal(got, want):
                j = int((got != want).nonzero()[0])
                msg = (f"row {i}: sorted block scores differ from the {m} largest at rank {j}: got {float(got[j])!r},"
                       f" want {float(want[j])!r}")
        if msg is not None:
            errors.append(msg)
            if limit is not None and len(errors) >= limit:
                break
    return errors


def assert_candidates(cand: torch.Tensor, logits, starts, ends, block_size: int, *, rtol: float = 0.0) -> None:
    """Raise ``AssertionError`` naming the first wrong row of :func:`candidate_errors`."""
    assert cand.dtype == torch.int32, f"candidates must be int32, got {cand.dtype}"
    errors = candidate_errors(cand, logits, starts, ends, block_size, rtol=rtol, limit=1)
    if errors:
        raise AssertionError(errors[0])


def eligible(n: int, ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """The positions ``[0, n)`` of a window of ``n`` cells inside the candidate blocks ``ids`` (1-D; negative
    ids and ids past the window select nothing), sorted."""
    ids = ids.long().unique()
    ids = ids[(ids >= 0) & (ids * block_size < n)]
    pos = (ids[:, None] * block_size + torch.arange(block_size, device=ids.device)[None, :]).flatten()
    return pos[pos < n].sort().values


def candidate_topk_errors(sel: torch.Tensor, logits, starts, ends, candidates: torch.Tensor, block_size: int, *,
                          rtol: float = 0.0, limit: int | None = None) -> list[str]:
    """What is wrong with each row of ``sel [R, topk]`` as the candidate-restricted top-k of its window
    (docs/spec.md §6a): with ``n_e <= topk`` eligible cells (:func:`eligible`), all of them first (any order),
    then -1; otherwise ``topk`` distinct eligible positions whose values, sorted, equal the ``topk`` largest
    eligible values (NaN as ``-inf``). ``rtol > 0``: every selected value within ``rtol * max|finite value|``
    of the ``topk``-th largest eligible one (float64 scores of another computation)."""
    x, s, e = _as_rows(logits, starts, ends)
    r, topk = sel.shape
    sel = sel.to(x.device).long()
    candidates = candidates.to(x.device)
    errors = []
    for i in range(r):
        win = _window(x, s, e, i)
        pos = eligible(win.shape[0], candidates[i], block_size)
        row = sel[i]
        k = min(topk, pos.shape[0])
        msg = None
        if bool((row[k:] != -1).any()) or bool((row[:k] < 0).any()):
            msg = f"row {i}: want {k} positions then -1, got {row[:min(topk, k + 8)].tolist()}..."
        elif row[:k].unique().numel() != k:
            msg = f"row {i}: a position appears twice"
        elif not bool(torch.isin(row[:k], pos).all()):
            msg = f"row {i}: positions outside the candidate blocks: {row[:k][~torch.isin(row[:k], pos)][:8].tolist()}"
        elif k < topk:
            pass  # every eligible cell, each once
        else:
            key = rank_key(win)
            got = key[row].sort(descending=True).values
            want = key[pos].sort(descending=True).values[:topk]
            if rtol > 0:
                fin = key[torch.isfinite(key)]
                tol = rtol * float(fin.abs().max()) if fin.numel() else 0.0
                if torch.isfinite(want[-1]) and float(got[-1]) < float(want[-1]) - tol:
                    msg = (f"row {i}: a selected value {float(got[-1])!r} is below the {topk}-th largest candidate "
                           f"value {float(want[-1])!r} by more than {tol:.3e}")
            elif not torch.equal(got, want):
                j = int((got != want).nonzero()[0])
                msg = (f"row {i}: sorted selected values differ from the {topk} largest candidate values at rank "
                       f"{j}: got {float(got[j])!r}, want {float(want[j])!r}")
        if msg is not None:
            errors.append(msg)
            if limit is not None and len(errors) >= limit:
                break
    return errors


def logits_error(actual: torch.Tensor, expected: torch.Tensor, inside: torch.Tensor | None = None, *,
                 clean: bool = True, scale: torch.Tensor | None = None) -> tuple[float, int]:
    """``(relative L2 error inside the windows, cells whose -inf mask differs)`` of ``actual`` against
    ``expected`` (same shape; ``inside`` defaults to ``expected != -inf``), relative to ``scale``'s cells when
    given (the magnitudes: the module docstring). The error is ``inf`` when a value inside is not finite; the mask
    is compared only with ``clean`` (else 0)."""
    a = actual.detach().cpu().double()
    e = expected.detach().cpu().double()
    inside = (e != NEG_INF) if inside is None else inside.cpu()
    mask_bad = int(((a == NEG_INF) != ~inside).sum()) if clean else 0
    ai = torch.where(inside, a, 0.0)
    ei = torch.where(inside, e, 0.0)
    if not bool(torch.isfinite(ai).all()):
        return float("inf"), mask_bad
    return float((ai - ei).norm()) / max(_denominator(ei, inside, scale), 1e-300), mask_bad


def _worst(diff: torch.Tensor, actual, expected, n: int = 8) -> str:
    flat = diff.reshape(-1)
    k = min(n, flat.numel())
    idx = torch.topk(flat.nan_to_num(float("inf")), k).indices
    lines = []
    for i in idx.tolist():
        pos = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), diff.shape))
        lines.append(f"  at {list(pos)}: actual={float(actual[pos])!r} expected={float(expected[pos])!r}")
    return "\n".join(lines)


def assert_logits(actual: torch.Tensor, expected: torch.Tensor, *, clean: bool = True,
                  rtol_l2: float = LOGITS_RTOL_L2, name: str = "logits") -> None:
    """``expected``: float64 (or the reference backend's) logits, ``-inf`` outside the windows. Inside them the
    relative L2 error must be below ``rtol_l2``; with ``clean`` the ``-inf`` masks must match exactly. The
    ``AssertionError`` shows the worst cells."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().cpu().double()
    expected = expected.detach().cpu().double()
    outside = expected == NEG_INF
    if clean:
        bad = (a == NEG_INF) != outside
        if bool(bad.any()):
            raise AssertionError(f"{name}: -inf mask differs in {int(bad.sum())} cells (worst shown):\n"
                                 + _worst(bad.double(), a, expected))
    inside = ~outside
    if not bool(inside.any()):
        return
    ai = torch.where(inside, a, 0.0)
    finite = torch.isfinite(ai)
    if not bool(finite.all()):
        raise AssertionError(f"{name}: non-finite values inside windows:\n" + _worst((~finite).double(), a, expected))
    ei = torch.where(inside, expected, 0.0)
    diff = (ai - ei).abs()
    err = float(diff.norm()) / max(float(ei.norm()), 1e-300)
    if err >= rtol_l2 and float(diff.max()) > 0:
        raise AssertionError(f"{name}: relative L2 error {err:.3e} >= {rtol_l2:.0e}; worst cells:\n"
                             + _worst(diff, a, expected))


def capture_cuda_graph(fn) -> torch.cuda.CUDAGraph:
    """``fn`` (no arguments) captured in a CUDA graph after one warm-up run on a side stream, so first-use work
    (allocator growth, library handles) stays out of the capture; replay it with ``.replay()``. Run ``fn`` once
    eagerly before when it compiles kernels. Used by the benchmarks and the GPU tests."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
