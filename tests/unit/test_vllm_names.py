"""Every vLLM name fusion_pass relies on (``fusion_pass/vllm_names.py``), checked against the
installed vLLM: a name that moved fails here, by name, not deep inside a compile."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fusion_pass import vllm_names as vn

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def _installed() -> vn.Version:
    import vllm

    version = vn.parse_version(vllm.__version__)
    assert version is not None, vllm.__version__
    return version


@pytest.mark.parametrize("name", vn.NAMES, ids=lambda n: n.name)
def test_each_name_is_where_this_vllm_keeps_it(name: vn.Name) -> None:
    if not name.in_release(_installed()):
        pytest.skip(f"not in vLLM {_installed()} (releases {name.since} to {name.until})")
    assert vn.problem(name) is None, vn.problem(name)


def test_names_outside_their_releases_are_absent() -> None:
    """A name whose range ends before the installed release is gone from it (the range is
    not stale); one whose range starts later is checked when that release is installed."""
    gone = [n for n in vn.NAMES if n.until is not None and _installed() >= n.until]
    for n in gone:
        assert vn.problem(n) is not None, f"{n.name} is still in vLLM {_installed()}"


def test_the_installed_vllm_is_in_the_supported_range() -> None:
    assert vn.SUPPORTED[0] <= _installed() < vn.SUPPORTED[1]
    assert vn.missing_required() == []


def test_a_moved_name_is_reported_by_name(monkeypatch) -> None:
    """The checks can fail: names moved in each way vLLM could move them."""
    moved = [
        vn.Name("InductorPassRenamed", "attr", "vllm.compilation.passes.inductor_pass", "x"),
        vn.Name("PassConfig.fuse_allreduce_rms_renamed", "field", "vllm.config", "x"),
        vn.Name("vllm::all_reduce_renamed", "op", "vllm.distributed.parallel_state", "x"),
        vn.Name("vllm::all_reduce", "op", "vllm.distributed.parallel_state", "x",
                args=("tensor", "group")),
        vn.Name("get_pass_context", "attr", "vllm.compilation.moved_away", "x"),
    ]
    for n in moved:
        problem = vn.problem(n)
        assert problem is not None and n.name in problem and "\n" not in problem
    assert "arguments are now ['tensor', 'group_name']" in vn.problem(moved[3])
    required = vn.Name("InductorPassRenamed", "attr", "vllm.compilation.passes.inductor_pass",
                       "x", required=True)
    monkeypatch.setattr(vn, "NAMES", vn.NAMES + (required,))
    assert vn.missing_required() == ["InductorPassRenamed"]


def test_version_strings_are_read_as_major_minor() -> None:
    assert vn.parse_version("0.34.0") == (0, 34)
    assert vn.parse_version("0.32.1.dev7+g1234abc") == (0, 32)
    assert vn.parse_version("0.32.0+cpu") == (0, 32)
    assert vn.parse_version("main") is None
    assert vn.supported_text() == f"0.26 through 0.{vn.SUPPORTED[1][1] - 1}"


def test_op_names_are_written_only_in_vllm_names() -> None:
    """The matchers and the integration take vLLM's op names from vllm_names: a literal
    ``ns::op`` of vLLM's namespaces anywhere else would escape the check above."""
    literal = re.compile(r"""["'](?:vllm|vllm_ir|_C|aiter)::\w+["']""")
    offenders = []
    for path in (ROOT / "fusion_pass").rglob("*.py"):
        if path.name == "vllm_names.py":
            continue
        offenders += [f"{path.relative_to(ROOT)}: {m}" for m in literal.findall(path.read_text())]
    assert offenders == []
