"""depyf dumps never fail a compile (``fusion_pass/depyf_dump.py``, and the plugin's
``FUSION_PASS_DEPYF_DIR`` path): through vLLM's own depyf layer where vLLM has one (0.34+),
otherwise a dump without what depyf's hook cannot take, said once.

depyf 0.20.0 replaces Inductor's ``PyCodeCache.load_by_key_path`` with a hook written for
``(key, path, linemap, attrs)``; Inductor also passes ``set_sys_modules`` (torch 2.14 on the
autotuning path as well), and the hook's TypeError fails the compile.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import pytest
import torch

depyf = pytest.importorskip("depyf")

from fusion_pass import depyf_dump, log  # noqa: E402

NEW_ARGS = "does not take the"


def _hook_lacks_arguments() -> bool:
    """Whether depyf's hook takes fewer arguments than this torch's function (read here
    from both signatures, independently of the module under test)."""
    from depyf.explain.patched_load_by_key_path import patched_load_by_key_path
    from torch._inductor.codecache import PyCodeCache

    hook = inspect.signature(patched_load_by_key_path).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in hook.values()):
        return False
    return not set(inspect.signature(PyCodeCache.load_by_key_path).parameters) <= set(hook)


@pytest.fixture
def said(monkeypatch, fusion_log):
    """The package's log, with its "said once" memory empty for this test."""
    monkeypatch.setattr(log, "_said", set())
    return fusion_log


def _load_with_new_argument() -> int:
    """Load generated code the way Inductor's ``PyCodeCache.load`` does (it passes
    ``set_sys_modules``)."""
    from torch._inductor.codecache import PyCodeCache

    return PyCodeCache.load("answer = 42\n").answer


def _compile_something() -> torch.Tensor:
    torch._dynamo.reset()
    x = torch.randn(8, 16)
    out = torch.compile(lambda t: torch.relu(t) * 2 + 1)(x)
    torch.testing.assert_close(out, torch.relu(x) * 2 + 1)
    return out


def test_plain_depyf_fails_the_load_where_its_hook_lacks_arguments(tmp_path):
    """Control: the failure the module guards against is real with this torch and depyf."""
    if not _hook_lacks_arguments():
        pytest.skip("this depyf's hook takes every argument this torch passes")
    with depyf.prepare_debug(str(tmp_path)):
        with pytest.raises(TypeError, match="set_sys_modules"):
            _load_with_new_argument()


def test_dump_never_fails_a_compile_and_still_dumps(tmp_path, said):
    with depyf_dump.dump(str(tmp_path)) as on:
        assert on
        assert _load_with_new_argument() == 42
        _compile_something()
    files = [p.name for p in tmp_path.iterdir()]
    assert any(f.startswith("__compiled_fn") for f in files), files  # the graphs
    assert any(".kernel_" in f for f in files), files  # Inductor's code, through depyf's hook
    notes = [r.getMessage() for r in said if NEW_ARGS in r.getMessage()]
    if _hook_lacks_arguments():
        (note,) = notes
        assert "set_sys_modules" in note and str(tmp_path) in note and "\n" not in note
    else:
        assert notes == []
    # depyf's hooks are gone again.
    from torch._inductor.codecache import PyCodeCache

    assert inspect.ismethod(PyCodeCache.load_by_key_path)


def test_depyf_that_does_not_start_leaves_compiling_alone(tmp_path, said, monkeypatch):
    def broken(dump_src_dir):
        raise RuntimeError("depyf cannot hook this torch")

    monkeypatch.setattr(depyf, "prepare_debug", broken)
    with depyf_dump.dump(str(tmp_path)) as on:
        assert not on
        _compile_something()
    (note,) = [r.getMessage() for r in said if r.levelno == logging.WARNING]
    assert f"no depyf dump in {tmp_path}" in note and "cannot hook this torch" in note


@pytest.mark.vllm
def test_the_plugins_dump_uses_vllms_depyf_layer_where_it_exists(tmp_path, said, monkeypatch):
    """``FUSION_PASS_DEPYF_DIR``: vLLM 0.34+'s ``depyf_compat.prepare_debug`` patches the hook,
    so even code loaded with ``set_sys_modules`` is dumped and nothing is said; an older vLLM
    gets the degraded dump with its note."""
    pytest.importorskip("vllm")
    from fusion_pass.vllm_integration import compat, plugin

    monkeypatch.setenv(plugin.DEPYF_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(plugin, "_depyf", None)
    plugin._start_depyf()
    try:
        before = set(Path(tmp_path).rglob("*.kernel_*.py"))
        assert _load_with_new_argument() == 42
        _compile_something()
        loaded = set(Path(tmp_path).rglob("*.kernel_*.py")) - before
    finally:
        plugin._depyf.__exit__(None, None, None)
    notes = [r.getMessage() for r in said if NEW_ARGS in r.getMessage()]
    (proc_dir,) = list(tmp_path.iterdir())  # one subdirectory per process
    assert any(p.name.startswith("__compiled_fn") for p in proc_dir.iterdir())
    if compat.depyf_prepare_debug() is not None:
        assert notes == []
        # The set_sys_modules load is dumped too (vLLM's hook), then the compile's kernels.
        assert any("answer = 42" in p.read_text() for p in loaded), loaded
    elif _hook_lacks_arguments():
        assert len(notes) == 1
        assert not any("answer = 42" in p.read_text() for p in loaded)
