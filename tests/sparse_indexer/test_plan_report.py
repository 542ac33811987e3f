"""``python -m sparse_indexer plan``: every option has help text and its default, the budget's saving is shown,
and the comparison with vLLM never prints a negative saving (it says "vLLM reserves less" and why)."""

from __future__ import annotations

import argparse
import re

import pytest

from buffers import IndexerLimits, plan
from sparse_indexer.__main__ import build_parser, main
from sparse_indexer.commands.plan import report, vllm_reservations

MiB = 1 << 20


def _plan_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["plan"]


def test_every_plan_option_has_help_and_its_default():
    for action in _plan_parser()._actions:
        if isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)):
            continue
        assert action.help and "default" in action.help, action.option_strings
        if action.default is None and "or --model's" in action.help:  # a model's value, else the one stated
            assert re.search(r"default: \d+, or --model's", action.help), action.option_strings
            continue
        assert "%(default)s" in action.help, action.option_strings


def test_plan_help_says_what_it_prints(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert _plan_parser().description and "buffer plan for engine limits" in text
    for what in ("shape, dtype, byte offset and size", "the total", "vLLM 0.33", "saves"):
        assert what in text, what


def test_next_n_default_is_explained():
    action = next(a for a in _plan_parser()._actions if "--next-n" in a.option_strings)
    assert action.default == 2 and "IndexerLimits itself defaults to 1" in action.help


def test_vllm_figures():
    lim = IndexerLimits(max_model_len=163840, max_num_batched_tokens=8192, max_num_seqs=256, next_n=2)
    rows = dict(vllm_reservations(lim))
    assert rows["prefill K gather (max_model_len*40 keys x (D+4) B)"] == 163840 * 40 * 132  # 825 MiB
    assert rows["decode logits (max_num_seqs*next_n*max_model_len x 4 B)"] == 320 * MiB
    assert rows["total (none shared)"] == sum(b for n, b in vllm_reservations(lim)[:-1])
    # DeepSeek-V4-Flash at 1M context (factor 2 above 256K tokens, 4 tokens per key): 4,194,304 keys, 528 MiB;
    # decode logits [256 * 2, 262144] float32
    v4 = IndexerLimits(max_model_len=1 << 20, max_num_batched_tokens=8192, max_num_seqs=256, next_n=2, topk=512,
                       compress_ratio=4)
    rows = dict(vllm_reservations(v4))
    assert rows["prefill K gather (max_model_len*16/4 keys x (D+4) B)"] == 4_194_304 * 132
    assert rows["decode logits (max_num_seqs*next_n*max_model_len/4 x 4 B)"] == 512 * 262144 * 4


def test_model_option_gives_v4_limits(capsys):
    assert main(["plan", "--model", "deepseek-v4-flash", "--max-logits-mib", "512"]) == 0
    out = capsys.readouterr().out
    assert "compress_ratio=4" in out and "topk=512" in out and "max_model_len=1048576" in out
    assert "saves" in out  # one arena of 566 MiB against vLLM's 1553 MiB
    assert main(["plan", "--model", "deepseek-v4-pro", "--topk", "2048"]) == 0
    assert "topk=2048" in capsys.readouterr().out  # an explicit option wins over the model's


@pytest.mark.parametrize("kw", [
    dict(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=1024),
    dict(max_model_len=163840, max_num_seqs=256, max_num_batched_tokens=8192, next_n=2),
    dict(max_model_len=1 << 20, max_num_seqs=256, max_num_batched_tokens=8192, next_n=2),
    dict(max_model_len=1 << 20, max_num_seqs=256, max_num_batched_tokens=8192, next_n=2,
         max_decode_logits_bytes=256 * MiB),
    dict(max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=8192, with_qk=True),
    dict(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=4096, max_logits_bytes=4096 * MiB),
])
def test_no_negative_saving(kw):
    lim = IndexerLimits(**kw)
    text = report(lim)
    assert not re.search(r"-\d+(\.\d+)? MiB", text), text
    ours, theirs = plan(lim).total_bytes, vllm_reservations(lim)[-1][1]
    if ours <= theirs:
        assert "saves" in text and "vLLM reserves less" not in text
    else:
        assert "vLLM reserves less" in text and "because:" in text
        assert "(alignment of the fields)" not in text  # a real reason is named


def test_with_qk_names_the_reason():
    text = report(IndexerLimits(max_model_len=8192, max_num_seqs=64, max_num_batched_tokens=8192, with_qk=True))
    assert "vLLM reserves less" in text and "qk (" in text and "aiter" in text


def test_budget_saving_is_shown(capsys):
    assert main(["plan", "--max-model-len", "1048576", "--max-decode-logits-mib", "256"]) == 0
    out = capsys.readouterr().out
    assert "sub-batches of 32 requests" in out and "decode logits 256.0 MiB instead of 2048.0 MiB" in out
    assert "saves" in out


def test_small_engine_fits_in_66_mib(capsys):
    assert main(["plan", "--max-model-len", "4096", "--max-num-seqs", "4", "--max-num-batched-tokens", "1024"]) == 0
    out = capsys.readouterr().out
    total = int(re.search(r"^total\s+uint8\s+0\s+(\d+)", out, re.M).group(1))
    assert total <= 1.05 * 66 * MiB


def test_invalid_limits_are_one_line_exit_2(capsys):
    assert main(["plan", "--max-model-len", "4096", "--max-num-seqs", "64", "--max-num-batched-tokens", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: IndexerLimits.max_num_batched_tokens")
