"""``fusion-pass gate`` and the table behind the gate explorer notebook."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fusion_pass.tools import cli
from fusion_pass.gate import TokenRange, decide
from fusion_pass.tools.gate_table import (MODEL_HIDDEN_SIZES, format_table, gate_table, limits_for,
                                    model_table, parse_tokens, path_ranges)


def test_rows_are_the_gates_decisions():
    rows = gate_table([2880, 4100, 16384], ["bfloat16", "float32"], [2, 8], [1, 80, 81, TokenRange(64, 4096)])
    assert len(rows) == 3 * 2 * 2 * 4
    for r in rows:
        n = r["tokens"] if isinstance(r["tokens"], int) else TokenRange(64, 4096)
        d = decide(r["hidden"], r["dtype"], r["world_size"], n)
        assert (r["path"], r["reason"]) == (d.path.value, d.reason)
    get = {(r["hidden"], r["dtype"], r["world_size"], r["tokens"]): r["path"] for r in rows}
    assert get[(2880, "bfloat16", 2, 80)] == "one_stage"
    assert get[(2880, "bfloat16", 2, 81)] == "two_stage"
    assert get[(2880, "bfloat16", 2, "[64, 4096]")] == "runtime"
    assert get[(16384, "bfloat16", 8, 1)] == "two_stage"
    assert get[(2880, "float32", 2, 1)] == "one_stage"
    assert get[(4100, "bfloat16", 2, 1)] == "unfused"


def test_model_hidden_sizes():
    names = " ".join(MODEL_HIDDEN_SIZES)
    for family in ("Llama 3 8B", "Llama 3 70B", "405B", "Mistral", "Mixtral", "Qwen2.5", "Qwen3",
                   "DeepSeek-V3", "GPT-OSS 20B", "GPT-OSS 120B", "Gemma 2", "Gemma 3", "Phi"):
        assert family in names
    assert MODEL_HIDDEN_SIZES["GPT-OSS 120B"] == 2880
    assert MODEL_HIDDEN_SIZES["DeepSeek-V3"] == 7168
    assert MODEL_HIDDEN_SIZES["Llama 3.1 405B"] == 16384
    rows = model_table(dtypes=["bfloat16"], world_sizes=[2], tokens=[1])
    assert [r["model"] for r in rows] == list(MODEL_HIDDEN_SIZES)


def test_path_ranges_collapse_runs():
    rows = gate_table([4096], ["bfloat16"], [2], [1, 8, 80, 81, 512])
    runs = path_ranges(rows)
    assert [(r["tokens"], r["path"]) for r in runs] == [("1-80", "one_stage"), ("81-512", "two_stage")]
    assert "[81, 512]" in runs[1]["reason"]


def test_aiter_limits_depend_on_world_size():
    aiter = limits_for("aiter-0.1.20")
    rows = gate_table([8192], ["bfloat16"], [2, 8], [4, 8, 80], limits=aiter)
    get = {(r["world_size"], r["tokens"]): r["path"] for r in rows}
    # vLLM's caller gate: one-stage below 128 KiB at TP=8 (8 x 8192 x 2 bytes = 128 KiB).
    assert (get[(2, 80)], get[(8, 4)], get[(8, 8)]) == ("one_stage", "one_stage", "two_stage")
    with pytest.raises(ValueError, match="not available"):
        limits_for("no-such-backend")


def test_parse_tokens():
    assert parse_tokens("64") == 64
    assert parse_tokens("1-80") == TokenRange(1, 80)
    assert parse_tokens("96-") == TokenRange(96, None)
    for bad in ("x", "5-2", "1-y"):
        with pytest.raises(ValueError):
            parse_tokens(bad)


def test_cli(capsys):
    assert cli.main(["gate", "--model", "gpt-oss 120b", "--world-size", "2", "--tokens", "80", "81"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["model", "hidden", "dtype", "world_size", "tokens", "path", "reason"]
    assert "one_stage" in out[2] and "two_stage" in out[3] and "2880" in out[2]
    assert cli.main(["gate", "--hidden", "4096", "--dtype", "float32", "bfloat16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"} and {r["world_size"] for r in rows} == {2, 4, 8}
    assert cli.main(["gate", "--hidden", "2880", "--ranges", "--world-size", "2"]) == 0
    assert "81-8192" in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["--model", "nope"], "unknown model"),
    (["--tokens", "8"], "--hidden"),
    (["--hidden", "4096", "--tokens", "x"], "not N, A-B or A-"),
    (["--hidden", "4096", "--backend", "nope"], "not available"),
    (["--hidden", "4096", "--tokens", "1-8", "--ranges"], "--ranges"),
])
def test_cli_errors(capsys, argv, msg):
    assert cli.main(["gate", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


def test_format_table_drops_empty_columns():
    text = format_table([{"model": "", "hidden": 1, "path": "x"}])
    assert text.splitlines()[0].split() == ["hidden", "path"]


def test_gate_does_not_import_vllm():
    code = ("import sys; from fusion_pass.tools import gate_table; gate_table.main(['--hidden', '4096']);"
            "print([m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
