"""The plugin as vLLM loads it: vLLM's own plugin loader finds the entry point, and the
``vllm serve`` JSON (``cli_json()``) becomes a config whose pass is the plugin's, prepared for
the model's TP size.  In a fresh process: loading a plugin changes process-wide state."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

PROBE = r"""
import json
from vllm.plugins import load_general_plugins

load_general_plugins()

import fusion_pass
from vllm.config import CompilationConfig, ParallelConfig, VllmConfig
from fusion_pass.vllm_integration import VllmAllReduceRMSNormPass, cli_json

given = json.loads(cli_json())
vc = VllmConfig(compilation_config=CompilationConfig(**given),
                parallel_config=ParallelConfig(tensor_parallel_size=2))
pass_ = vc.compilation_config.inductor_compile_config.get("post_grad_custom_post_pass")
print("RESULT " + json.dumps(dict(
    published=isinstance(getattr(fusion_pass, "vllm_fusion_pass", None), VllmAllReduceRMSNormPass),
    hooked=getattr(VllmConfig._set_compile_ranges, "_fusion_pass_hook", False),
    given=given,
    pass_type=type(pass_).__name__,
    private=pass_ is not getattr(fusion_pass, "vllm_fusion_pass", None),
    inactive=pass_.inactive_reason,
    in_tree=vc.compilation_config.pass_config.fuse_allreduce_rms,
    endpoints=list(vc.compilation_config.compile_ranges_endpoints or []))))
"""


def _run(code: str, **env: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, env={**os.environ, **env})
    return r.stdout + "\n" + r.stderr[-4000:]


def test_vllms_loader_loads_the_plugin_and_the_json_config_carries_the_pass():
    out = _run(PROBE)
    line = next((l for l in out.splitlines() if l.startswith("RESULT ")), None)
    assert line is not None, out[-6000:]
    res = json.loads(line[len("RESULT "):])
    assert res["published"] and res["hooked"]
    assert res["given"]["inductor_passes"] == {
        "post_grad_custom_post_pass": "fusion_pass.vllm_fusion_pass"}
    assert res["pass_type"] == "VllmAllReduceRMSNormPass" and res["private"]
    assert res["inactive"] is None and res["in_tree"] is False
    assert 80 in res["endpoints"]  # the reference backend's threshold, added by the hook


def test_vllm_plugins_allowlist_without_it_loads_nothing():
    """Control: with ``VLLM_PLUGINS`` naming another plugin, vLLM does not load this one."""
    out = _run("from vllm.plugins import load_general_plugins; load_general_plugins(); "
               "import fusion_pass; print('PUBLISHED', hasattr(fusion_pass, 'vllm_fusion_pass'))",
               VLLM_PLUGINS="some_other_plugin")
    assert "PUBLISHED False" in out, out[-6000:]
