"""``python -m sparse_indexer plan``: the buffer plan for engine limits, beside what vLLM reserves for the same
limits (docs/memory.md has the tables this prints). Nothing is allocated; no device is needed.

It prints the limits (``IndexerLimits``, from the options below), then the plan of the one scratch arena an engine
allocates once (``buffers.plan``): every field with its shape, dtype, byte offset and size, and the total; with
``--max-decode-logits-mib``, the decode sub-batches and what the budget saves; with ``--logits-dtype bfloat16`` or
``--compressed-prefill-logits``, what that saves against float32 ``[M, N]`` logits; then what vLLM 0.33's indexer
reserves for the same limits (prefill key gather, prefill and decode logits, top-k workspace) and the difference
of the totals (when vLLM reserves less, which of our fields are larger and why).
"""

from __future__ import annotations

import argparse

import attrs
import torch

from buffers import BufferPlan, IndexerLimits, plan

__all__ = ["add_arguments", "report", "run", "vllm_reservations"]

MiB = 1 << 20
_DEFAULTS = {a.name: a.default for a in attrs.fields(IndexerLimits)}

# vLLM 0.33 (vllm/model_executor/layers/sparse_attn_indexer.py and v1/attention/backends/mla/indexer.py):
# get_max_prefill_buffer_size = max_model_len * (576 * 2 // 132 = 8) * sparse_mla_prefill_workspace_factor, the
# factor 5 up to 256K tokens of context and 2 above (config/vllm.py); compressed caches hold that // C keys
VLLM_GATHER_PER_TOKEN = 576 * 2 // 132
VLLM_TOPK_WORKSPACE = 1 << 20  # RADIX_TOPK_WORKSPACE_SIZE, uint8
VLLM_MAX_LOGITS = 512 * MiB  # VLLM_SPARSE_INDEXER_MAX_LOGITS_MB default


def vllm_gather_factor(max_model_len: int) -> int:
    """Keys per token of context vLLM 0.33 reserves for the prefill gather: ``8 * 5`` up to 256K tokens, ``8 * 2``
    above (``get_max_prefill_buffer_size``)."""
    return VLLM_GATHER_PER_TOKEN * (5 if max_model_len <= 256 * 1024 else 2)


def vllm_reservations(lim: IndexerLimits) -> list[tuple[str, int]]:
    """What vLLM 0.33's indexer (its CUDA/DeepGEMM path) holds for the same limits, in bytes.

    At profiling it reserves the prefill key gather (``max_model_len * 8 * factor // C`` keys of ``D + 4`` bytes,
    factor 5 up to 256K tokens of context, else 2; ``C = compress_ratio``, DeepSeek-V4's compressed indexer 4) and
    a 1 MiB top-k workspace in its workspace manager, and allocates a dummy of
    ``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB`` (512 MiB) standing for the largest prefill chunk's logits; at run time
    each decode step allocates its logits ``[max_num_seqs * next_n, max_model_len // C]`` float32 (outside the
    profile, and never under a budget). None of these share memory. The last row is their sum.
    """
    f = vllm_gather_factor(lim.max_model_len)
    c = lim.compress_ratio
    gather = lim.max_model_len * f // c * (lim.head_dim + 4)
    decode = lim.max_num_seqs * lim.next_n * lim.max_keys * 4
    per = f"max_model_len*{f}" + (f"/{c}" if c > 1 else "")
    width = "max_model_len" + (f"/{c}" if c > 1 else "")
    rows = [
        (f"prefill K gather ({per} keys x (D+4) B)", gather),
        ("prefill logits (VLLM_SPARSE_INDEXER_MAX_LOGITS_MB)", VLLM_MAX_LOGITS),
        (f"decode logits (max_num_seqs*next_n*{width} x 4 B)", decode),
        ("top-k workspace (RADIX_TOPK_WORKSPACE_SIZE)", VLLM_TOPK_WORKSPACE),
    ]
    return rows + [("total (none shared)", sum(b for _, b in rows))]


def _why_vllm_less(p: BufferPlan) -> list[str]:
    """Our fields that are larger than what vLLM holds for the same purpose, as reasons."""
    lim = p.limits
    theirs = dict(vllm_reservations(lim)[:-1])
    gather, plog, dlog, topk = theirs.values()
    size = {f.name: f.nbytes for f in p.fields}
    why = []
    keys = size.get("k_fp8", 0) + size.get("k_scale", 0)
    if keys > gather:
        why.append(f"the key gather ({keys / MiB:.1f} MiB) exceeds vLLM's prefill workspace: "
                   f"prefill_k_tokens={lim.prefill_k_tokens} lets chunks gather more")
    if size["logits"] > plog + dlog:
        why.append(f"logits ({size['logits'] / MiB:.1f} MiB) exceed vLLM's prefill + decode logits: "
                   f"max_logits_bytes={lim.max_logits_bytes} is above vLLM's 512 MiB")
    if "qk" in size:
        why.append(f"qk ({size['qk'] / MiB:.1f} MiB) holds per-head scores for aiter's paged stage1 (with_qk); "
                   "vLLM's CUDA path (DeepGEMM) needs none")
    if size.get("topk_scratch", 0) > topk:
        why.append(f"topk_scratch ({size['topk_scratch'] / MiB:.1f} MiB) is the split-row top-k's candidate store "
                   "for max_keys windows; vLLM's radix top-k keeps 1 MiB")
    packs = sum(size.get(n, 0) for n in ("q_pack", "w_pack", "topk_pack"))
    if packs:
        why.append(f"the decode packs ({packs / MiB:.1f} MiB) are planned; vLLM allocates its padded decode "
                   "tensors at each step instead")
    return why


def report(lim: IndexerLimits) -> str:
    """The plan of ``lim``, what a decode budget saves (when ``lim`` has one), and vLLM's reservations."""
    p = plan(lim)
    out = [f"limits: {lim}", "",
           "sparse-indexer plan (one arena; prefill chunks and decode sub-batches reuse `logits`):", str(p)]
    if lim.max_decode_logits_bytes is not None:
        free = plan(attrs.evolve(lim, max_decode_logits_bytes=None))
        out += ["", f"decode budget max_decode_logits_bytes={lim.max_decode_logits_bytes} "
                f"({lim.max_decode_logits_bytes / MiB:.1f} MiB): sub-batches of {lim.decode_batch} requests "
                f"(decode logits {lim.decode_batch_rows * lim.max_keys * 4 / MiB:.1f} MiB instead of "
                f"{lim.max_decode_rows * lim.max_keys * 4 / MiB:.1f} MiB); plan "
                f"{free.total_bytes / MiB:.1f} MiB without the budget -> {p.total_bytes / MiB:.1f} MiB "
                f"(saves {(free.total_bytes - p.total_bytes) / MiB:.1f} MiB)"]
    plain = attrs.evolve(lim, logits_dtype=torch.float32, compressed_prefill_logits=False)
    if plain != lim:
        base = plan(plain)
        out += ["", f"logits {str(lim.logits_dtype).replace('torch.', '')}"
                f"{', compressed prefill logits' if lim.compressed_prefill_logits else ''}: logits "
                f"{p['logits'].nbytes / MiB:.1f} MiB instead of {base['logits'].nbytes / MiB:.1f} MiB (float32, "
                f"[M, N] prefill chunks); plan {base.total_bytes / MiB:.1f} MiB -> {p.total_bytes / MiB:.1f} MiB "
                f"(saves {(base.total_bytes - p.total_bytes) / MiB:.1f} MiB)"]
    rows = vllm_reservations(lim)
    out += ["", "vLLM 0.33 for the same limits (CUDA/DeepGEMM path; it has no decode budget):"]
    w = max(len(n) for n, _ in rows)
    out += [f"  {name:<{w}}  {b:>16,d} B  {b / MiB:>10.1f} MiB" for name, b in rows]
    ours, theirs = p.total_bytes, rows[-1][1]
    if ours <= theirs:
        out.append(f"\nplan total {ours / MiB:.1f} MiB vs vLLM {theirs / MiB:.1f} MiB: saves "
                   f"{(theirs - ours) / MiB:.1f} MiB ({ours / theirs:.2f}x)")
    else:
        out.append(f"\nplan total {ours / MiB:.1f} MiB vs vLLM {theirs / MiB:.1f} MiB: vLLM reserves less, by "
                   f"{(ours - theirs) / MiB:.1f} MiB, because:")
        out += [f"  - {r}" for r in _why_vllm_less(p)] or ["  - (alignment of the fields)"]
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``plan``; each default is stated in its help (DeepSeek-V3.2 serving shapes)."""
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest context of one request, tokens (default: 163840, or --model's)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="most query tokens in one step (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step (default: %(default)s)")
    p.add_argument("--next-n", type=int, default=2,
                   help="decode tokens per request, 1 + speculative tokens (default: %(default)s, DeepSeek-V3.2 "
                        f"with one MTP token; IndexerLimits itself defaults to {_DEFAULTS['next_n']})")
    p.add_argument("--heads", type=int, default=_DEFAULTS["n_heads"],
                   help="indexer heads H (default: %(default)s)")
    p.add_argument("--head-dim", type=int, default=_DEFAULTS["head_dim"],
                   help="indexer head dim D (default: %(default)s)")
    p.add_argument("--topk", type=int, default=None,
                   help=f"tokens selected per query (default: {_DEFAULTS['topk']}, or --model's)")
    p.add_argument("--block-size", type=int, default=None,
                   help=f"keys per K-cache page: tokens per page // compress ratio (default: {_DEFAULTS['block_size']}"
                        ", or --model's)")
    p.add_argument("--compress-ratio", type=int, default=None,
                   help="tokens per key of the cache: 1 (DeepSeek-V3.2, GLM-5) or 4 (DeepSeek-V4's compressed "
                        f"indexer) (default: {_DEFAULTS['compress_ratio']}, or --model's)")
    p.add_argument("--model", choices=tuple(MODELS), default=None,
                   help="start from a model's serving shapes (options given explicitly still win; default: "
                        "%(default)s, the defaults of each option): "
                        + "; ".join(f"{k}: {v[1]}" for k, v in MODELS.items()))
    p.add_argument("--prefill-k-tokens", type=int, default=None,
                   help="cap on the keys one prefill chunk gathers (default: %(default)s = IndexerLimits' default, "
                        "see docs/memory.md)")
    p.add_argument("--max-logits-mib", type=int, default=None,
                   help="cap on one prefill chunk's logits, MiB (default: %(default)s = IndexerLimits' default, "
                        "see docs/memory.md)")
    p.add_argument("--max-decode-logits-mib", type=int, default=None,
                   help="decode logits budget, MiB: decode runs in sub-batches that fit it (default: %(default)s = "
                        "no budget)")
    p.add_argument("--with-qk", action="store_true", help="also plan the per-head qk buffer (aiter stage1)")
    p.add_argument("--logits-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the logits buffer (default: %(default)s; bfloat16 halves it, docs/spec.md §5)")
    p.add_argument("--compressed-prefill-logits", action="store_true",
                   help="prefill chunks write compressed logits [M, longest window] (DeepGEMM's max_seqlen_k)")


# --model: serving shapes of the family (vLLM 0.33's configs: deepseek_v4 indexer on the C=4 layers, 256-token
# pages of 64 keys, topk 512 for V4-Flash, 1024 for V4-Pro, 1M context)
MODELS = {
    "deepseek-v3.2": (dict(), "H=64 D=128 topk 2048, 163840 tokens, pages of 64"),
    "deepseek-v4-flash": (dict(max_model_len=1 << 20, compress_ratio=4, block_size=64, topk=512),
                          "the C=4 indexer layers, H=64 D=128 topk 512, 1M tokens, pages of 256 tokens = 64 keys"),
    "deepseek-v4-pro": (dict(max_model_len=1 << 20, compress_ratio=4, block_size=64, topk=1024),
                        "as V4-Flash with topk 1024"),
}


def limits_from_args(args) -> IndexerLimits:
    model = MODELS[args.model][0] if getattr(args, "model", None) else {}
    fallback = {"max_model_len": 163840, "topk": _DEFAULTS["topk"], "block_size": _DEFAULTS["block_size"],
                "compress_ratio": _DEFAULTS["compress_ratio"]}

    def pick(name: str, attr: str):
        value = getattr(args, attr, None)
        return value if value is not None else model.get(name, fallback[name])

    kw = dict(
        max_model_len=pick("max_model_len", "max_model_len"), max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, next_n=args.next_n, n_heads=args.heads, head_dim=args.head_dim,
        topk=pick("topk", "topk"), block_size=pick("block_size", "block_size"),
        compress_ratio=pick("compress_ratio", "compress_ratio"), with_qk=args.with_qk,
        logits_dtype=getattr(torch, getattr(args, "logits_dtype", "float32")),
        compressed_prefill_logits=bool(getattr(args, "compressed_prefill_logits", False)),
    )
    if args.prefill_k_tokens is not None:
        kw["prefill_k_tokens"] = args.prefill_k_tokens
    if args.max_logits_mib is not None:
        kw["max_logits_bytes"] = args.max_logits_mib * MiB
    if args.max_decode_logits_mib is not None:
        kw["max_decode_logits_bytes"] = args.max_decode_logits_mib * MiB
    return IndexerLimits(**kw)


def run(args) -> int:
    """Print :func:`report` for the limits of ``args``; invalid limits are one line on stderr, exit status 2."""
    import sys

    try:
        lim = limits_from_args(args)
    except (TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(lim))
    return 0
