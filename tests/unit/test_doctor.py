"""``fusion-pass doctor``: its answers follow the environment, and it never raises.

- The command itself, as a user runs it here (CPU, no GPU): text that fits one screen and
  JSON of the documented schema saying no GPU and the reference backend; the same without
  vLLM importable.
- In-process, the environment changed under it: a vLLM outside the supported range, vLLM's
  in-tree fusion on, sequence parallelism, an architecture vLLM runs uncompiled, the plugin
  left out by VLLM_PLUGINS, TP=1, a dtype the backend declines, AITER's known-bad paths, no
  GPU and GPUs (from a stand-in of ``fusion_pass.topology``) with and without P2P, ranks
  sharing a GPU, NVLink through a stand-in of NVML, PDL, the launcher generation of a
  compiled kernel (the launcher stand-ins of Triton 3.6 and 3.8).
- Every probe made to raise: its line says so with the error, the rest still run, exit 0.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from typing import Any, Optional

import pytest

import triton_launcher_standins as si
from fusion_pass import backends
from fusion_pass.backends.aiter import releases
from fusion_pass.tools import doctor
from fusion_pass.tools.doctor import context, report, versions
from fusion_pass.tools.gate_table import limits_for

pytestmark = pytest.mark.vllm

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="reads the installed vLLM")

GIB = 1 << 30


# ------------------------------------------------------------- fusion_pass.topology

from fusion_pass.topology import GpuFacts, RankFacts, group_decline  # noqa: E402


def topology_standin(gpus: list[GpuFacts], p2p: Optional[list[list[bool]]] = None,
                     host: str = "node0") -> types.ModuleType:
    """``fusion_pass.topology`` over the given GPUs: its classes and its rule
    (``group_decline``) the real ones, what it reads of the machine (``gpus``,
    ``p2p_matrix``, ``local_facts``) made up; P2P everywhere unless ``p2p`` says
    otherwise (``[i][j]``: GPU i can map GPU j's memory; the diagonal True)."""
    n = len(gpus)
    matrix = p2p if p2p is not None else [[True] * n for _ in range(n)]
    mod = types.ModuleType("fusion_pass.topology")
    mod.GpuFacts, mod.RankFacts, mod.group_decline = GpuFacts, RankFacts, group_decline
    mod.gpus = lambda: list(gpus)
    mod.p2p_matrix = lambda: [row[:] for row in matrix]

    def local_facts(device: int) -> RankFacts:
        peers = tuple(g.uuid for g in gpus if g.index == device or matrix[device][g.index])
        return RankFacts(host, gpus[device].uuid, device, peers)

    mod.local_facts = local_facts
    return mod


def h100s(n: int, capability: tuple[int, int] = (9, 0)) -> list[GpuFacts]:
    return [GpuFacts(i, "NVIDIA H100 80GB HBM3", f"uuid-{i}", capability, 132, 80 * GIB)
            for i in range(n)]


@pytest.fixture
def install_gpus(monkeypatch):
    """Put a topology stand-in in place (and torch's capability answer for PDL)."""
    def install(gpus: list[GpuFacts], p2p: Optional[list[list[bool]]] = None) -> None:
        import torch

        monkeypatch.setitem(sys.modules, context.TOPOLOGY, topology_standin(gpus, p2p))
        monkeypatch.setattr(torch.cuda, "get_device_capability",
                            lambda device=None: gpus[device].capability)
    return install


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No backend, plugin, PDL or breakable-graph setting from outside; the backend chosen
    afresh; vLLM's supported check re-read."""
    for var in ("FUSION_PASS_BACKEND", "VLLM_PLUGINS", "FUSION_PASS_PDL",
                "VLLM_USE_BREAKABLE_CUDAGRAPH", "TRITON_INTERPRET", "FUSION_PASS_ANY_VLLM"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(backends, "_selected", {})
    from fusion_pass.vllm_integration import compat

    compat.unsupported_reason.cache_clear()
    yield
    compat.unsupported_reason.cache_clear()


def build(**query: Any) -> dict[str, dict[str, Any]]:
    return doctor.build(doctor.Query(**query)).found


# ------------------------------------------------------------------ the command

def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240)


def test_the_command_here_says_no_gpu_and_the_reference_backend():
    """``fusion-pass doctor`` and ``--json`` through the CLI, in one fresh process."""
    sep = "=" * 20
    out = _run("import sys\nfrom fusion_pass.tools.cli import main\n"
               f"a = main(['doctor'])\nprint({sep!r})\nb = main(['doctor', '--json'])\n"
               "sys.exit(a or b)")
    assert out.returncode == 0, out.stderr[-3000:]
    text, raw = out.stdout.split(sep + "\n")
    lines = text.splitlines()
    assert len(lines) <= 40, text
    assert lines[0].startswith("fusion-pass doctor: hidden 4096, bfloat16, TP 2")
    assert [ln for ln in lines if not ln.startswith("  ")][1:] == [
        "versions:", "plugin:", "gpus:", "fusion:"]
    got = json.loads(raw)
    assert got["version"] == report.SCHEMA_VERSION
    assert got["query"] == {"hidden": 4096, "dtype": "bfloat16", "tp": 2, "arch": None}
    assert list(got) == ["version", "query", "versions", "plugin", "gpus", "fusion"]
    for section in ("versions", "plugin", "gpus", "fusion"):
        for name, probe in got[section].items():
            assert isinstance(probe["ok"], bool) and probe["status"] in ("ok", "no", "skip",
                                                                         "error"), name
            assert probe["ok"] == (probe["status"] == "ok")
            assert probe["ok"] or probe["why"], name
    devices = got["gpus"]["devices"]
    assert devices["status"] == "no" and devices["count"] == 0 and "none" in devices["why"]
    assert got["gpus"]["symmetric_memory"]["why"] == "no GPU"
    assert got["fusion"]["backend"] == {"ok": True, "status": "ok", "name": "reference",
                                        "device": "cpu", "fused_kernel": False}
    assert got["fusion"]["verdict"]["blockers"] == [
        "no fused kernel on the CPU: the reference backend runs c10d all-reduce + RMSNorm in torch"]
    assert "  ok  backend reference (chosen for the CPU): c10d all-reduce + RMSNorm in torch, " \
           "no fused kernel" in lines


def test_without_vllm_the_plugin_checks_say_so_and_the_rest_runs():
    out = _run("import sys\nsys.modules['vllm'] = None\n"
               "from fusion_pass.tools.cli import main\nsys.exit(main(['doctor', '--json']))")
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["versions"]["vllm"]["status"] == "skip"
    assert "not installed" in got["versions"]["vllm"]["why"]
    for name in ("compilation_config", "cli_json", "in_tree_fusion", "sequence_parallelism"):
        assert got["plugin"][name] == {"ok": False, "status": "skip",
                                       "why": "vLLM is not installed"}, name
    assert got["fusion"]["backend"]["name"] == "reference"
    assert got["fusion"]["gate"]["ok"]


def test_bad_arguments_exit_2_and_good_ones_0(capsys):
    for bad in (["--tp", "0"], ["--hidden", "x"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit) as e:
            doctor.main(bad)
        assert e.value.code == 2, bad
    assert doctor.main(["--tp", "1", "--hidden", "2880"]) == 0
    assert "hidden 2880, bfloat16, TP 1" in capsys.readouterr().out


# ------------------------------------------------------------------------- vLLM

@needs_vllm
def test_a_vllm_outside_the_supported_range(monkeypatch):
    from fusion_pass.vllm_integration import compat

    monkeypatch.setattr(compat, "vllm_version", lambda: "0.25.0")
    found = build()
    vllm = found["versions"]["vllm"]
    assert vllm.status == "no" and vllm.data["version"] == "0.25.0"
    assert "0.25.0 is outside the versions fusion_pass supports (0.26 through 0.34" in vllm.why
    for name in ("compilation_config", "cli_json", "in_tree_fusion"):
        assert found["plugin"][name].status == "no", name
        assert "outside the versions" in found["plugin"][name].why
    assert found["fusion"]["verdict"].why.startswith("no speed-up expected: vLLM: vLLM 0.25.0 is "
                                                     "outside")


@needs_vllm
def test_vllms_in_tree_fusion_on_here(monkeypatch):
    """vLLM's own rule asked with the TP size; the plugin's config turning it off is what
    keeps the sites for the pass."""
    import vllm.config.vllm as rules

    from fusion_pass.vllm_integration import compat

    asked = []
    monkeypatch.setattr(rules, "enable_allreduce_rms_fusion",
                        lambda cfg: asked.append(cfg.parallel_config.tensor_parallel_size) or True,
                        raising=False)
    found = build(tp=4)
    f = found["plugin"]["in_tree_fusion"]
    assert asked == [4]
    assert f.status == "ok" and f.data["default_on"] is True and f.data["plugin_config"] is False
    assert "on at -O2 here (TP 4); compilation_config() turns it off" in f.text
    # A config that does not turn it off leaves every site to vLLM.
    monkeypatch.setattr(compat, "in_tree_settings", lambda enabled: {})
    found = build(tp=4)
    f = found["plugin"]["in_tree_fusion"]
    assert f.status == "no" and f.data["plugin_config"] is None
    assert "it fuses every site it matches before the pass runs" in f.why
    assert any("in-tree" in b for b in found["fusion"]["verdict"].data["blockers"])


@needs_vllm
def test_sequence_parallelism_by_hidden_size_and_gpu(monkeypatch, install_gpus):
    from fusion_pass.vllm_integration import compat

    monkeypatch.setattr(compat, "pass_config_fields",
                        lambda: frozenset({"enable_sp", "sp_min_token_num", "fuse_allreduce_rms"}))
    install_gpus(h100s(2))
    f = build(hidden=8192)["plugin"]["sequence_parallelism"]
    assert f.status == "no" and f.data["default_on"] is True
    assert "hidden 8192 on NVIDIA H100" in f.why and "sequence_parallel=False" in f.why
    f = build(hidden=4096)["plugin"]["sequence_parallelism"]
    assert f.status == "ok" and "off at -O2 here (hidden 4096 < 8192)" in f.text
    install_gpus(h100s(2, capability=(8, 0)))
    f = build(hidden=8192)["plugin"]["sequence_parallelism"]
    assert f.status == "ok" and "no Hopper or Blackwell GPU" in f.text
    monkeypatch.setattr(compat, "pass_config_fields", lambda: frozenset({"fuse_allreduce_rms"}))
    f = build(hidden=8192)["plugin"]["sequence_parallelism"]
    assert f.status == "ok" and f.text.endswith("has none") and not f.data["has_pass"]


@needs_vllm
def test_an_architecture_vllm_runs_without_compiling(monkeypatch):
    import vllm.config.vllm as rules

    assert build()["plugin"]["architecture"].status == "skip"
    monkeypatch.setattr(rules, "default_breakable_cudagraph_architectures",
                        lambda: frozenset({"Qwen3_5ForCausalLM"}), raising=False)
    f = build(arch="Qwen3_5ForCausalLM")["plugin"]["architecture"]
    assert f.status == "no" and "without torch.compile" in f.why
    assert "VLLM_USE_BREAKABLE_CUDAGRAPH=0 makes vLLM compile it" in f.why
    assert build(arch="LlamaForCausalLM")["plugin"]["architecture"].status == "ok"
    # The environment decides before vLLM's list, either way.
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")
    assert build(arch="Qwen3_5ForCausalLM")["plugin"]["architecture"].status == "ok"
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    f = build(arch="LlamaForCausalLM")["plugin"]["architecture"]
    assert f.status == "no" and "VLLM_USE_BREAKABLE_CUDAGRAPH=1" in f.why


@needs_vllm
def test_the_entry_point_and_vllm_plugins(monkeypatch):
    f = build()["plugin"]["entry_point"]
    assert f.status == "ok"
    assert f.data["value"] == "fusion_pass.vllm_integration.plugin:register"
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    f = build()["plugin"]["entry_point"]
    assert f.status == "no" and "VLLM_PLUGINS=lora_filesystem_resolver leaves it out" in f.why
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver,fusion_pass")
    assert build()["plugin"]["entry_point"].status == "ok"


@needs_vllm
def test_the_config_helpers_output_is_reported():
    found = build()["plugin"]
    assert found["compilation_config"].data["config"] == {
        "inductor_compile_config": {"post_grad_custom_post_pass": "<VllmAllReduceRMSNormPass>"},
        "pass_config": {"fuse_allreduce_rms": False}}
    from fusion_pass.vllm_integration import cli_json

    assert found["cli_json"].data["json"] == cli_json()
    assert json.loads(found["cli_json"].data["json"])["inductor_passes"] == {
        "post_grad_custom_post_pass": "fusion_pass.vllm_fusion_pass"}


def test_a_vllm_that_does_not_import(monkeypatch):
    def broken() -> Any:
        raise ImportError("libcudart.so.13: cannot open shared object file")

    monkeypatch.setattr(context, "_import_vllm", broken)
    found = build()
    f = found["versions"]["vllm"]
    assert f.status == "no" and "does not import (ImportError: libcudart.so.13" in f.why
    assert found["plugin"]["compilation_config"].status == "skip"
    assert found["fusion"]["backend"].ok


# ----------------------------------------------------------- the pass's decision

def test_tp1_declines_with_the_gates_reason():
    found = build(tp=1)
    gate = found["fusion"]["gate"]
    assert gate.status == "no" and gate.data["segments"] == []
    assert gate.why == "declines with backend reference: world size 1: nothing to reduce"
    assert found["gpus"]["symmetric_memory"].status == "skip"
    assert gate.line() in found["fusion"]["verdict"].data["blockers"]


def test_a_dtype_the_backend_declines(monkeypatch):
    """AITER's limits (bf16 and fp16 only) as a registered backend chosen by name."""
    aiter = limits_for("aiter-0.1.20")
    monkeypatch.setitem(backends._factories, "aiter-limits",
                        lambda: types.SimpleNamespace(limits=aiter))
    monkeypatch.setenv("FUSION_PASS_BACKEND", "aiter-limits")
    found = build(dtype="float32")
    assert found["fusion"]["backend"].text.startswith(
        "backend aiter-limits (FUSION_PASS_BACKEND=aiter-limits)")
    gate = found["fusion"]["gate"]
    assert gate.status == "no" and gate.why.endswith("backend aiter-0.1.20 does not take float32")
    monkeypatch.setattr(backends, "_selected", {})
    gate = build(dtype="bfloat16")["fusion"]["gate"]
    most = releases.MAX_BYTES // (4096 * 2)  # AITER's byte cap over a bf16 row of 4096
    assert gate.ok and gate.text.endswith(f"tokens 1-80 one_stage, 81-{most} two_stage, "
                                          f"{most + 1}+ unfused")
    assert [r["tokens"] for r in gate.data["tokens"]][:3] == [1, 8, 32]


def test_an_unknown_backend_name(monkeypatch):
    monkeypatch.setenv("FUSION_PASS_BACKEND", "nccl")
    found = build()
    assert found["fusion"]["backend"].status == "no"
    assert "unknown fusion_pass backend 'nccl'" in found["fusion"]["backend"].why
    assert found["fusion"]["gate"].status == "skip"


def test_aiters_known_bad_paths(monkeypatch):
    from fusion_pass.backends.aiter import installed

    monkeypatch.setattr(installed, "version", lambda: "0.1.18")
    f = build()["versions"]["aiter"]
    assert f.status == "no" and list(f.data["declined"]) == ["one_stage"]
    assert "ROCm/aiter#4346" in f.why and "unused: torch is no ROCm build" in f.text
    monkeypatch.setattr(installed, "version", lambda: "0.1.20")
    assert build()["versions"]["aiter"].status == "ok"


# -------------------------------------------------------------------------- GPUs

def test_no_gpu(install_gpus):
    install_gpus([])
    found = build()
    assert found["gpus"]["devices"].status == "no"
    assert [found["gpus"][k].status for k in ("p2p", "nvlink", "pdl")] == ["skip"] * 3
    assert found["gpus"]["symmetric_memory"].why == "no GPU"
    assert found["fusion"]["backend"].data["name"] == "reference"


def test_gpus_with_p2p(install_gpus):
    install_gpus(h100s(2))
    found = build()
    g = found["gpus"]
    assert g["devices"].text == ("GPUs: 2 x NVIDIA H100 80GB HBM3 (sm 9.0, 132 SMs, 80.0 GiB): "
                                 "GPU 0-1")
    assert g["devices"].data["gpus"][1] == dict(index=1, name="NVIDIA H100 80GB HBM3",
                                                uuid="uuid-1", capability="9.0", sms=132,
                                                total_bytes=80 * GIB)
    assert g["p2p"].ok and g["symmetric_memory"].ok and g["pdl"].ok
    assert g["symmetric_memory"].data["devices"] == [0, 1]
    assert found["fusion"]["backend"].data == {"name": "triton", "device": "cuda",
                                               "fused_kernel": True}
    assert found["fusion"]["backend"].text.startswith("backend triton (chosen for the GPUs)")
    assert found["fusion"]["gate"].ok and found["fusion"]["gate"].data["limits"] == "triton"


def test_gpus_without_p2p(install_gpus):
    install_gpus(h100s(2), p2p=[[True, False], [False, True]])
    found = build()
    assert found["gpus"]["p2p"].why == "GPU pairs 0-1 cannot access each other's memory"
    symm = found["gpus"]["symmetric_memory"]
    assert symm.status == "no"
    assert symm.why.startswith("rank 0's GPU uuid-0 cannot map rank 1's GPU uuid-1 (no peer")
    verdict = found["fusion"]["verdict"]
    assert verdict.status == "no" and "each call falls back to the reference" in verdict.why


def test_more_ranks_than_gpus_share_them(install_gpus):
    install_gpus(h100s(2))
    symm = build(tp=4)["gpus"]["symmetric_memory"]
    assert symm.data["devices"] == [0, 1, 0, 1] and symm.why.startswith("ranks 0 and 2 share one GPU")
    install_gpus(h100s(4))
    assert build()["gpus"]["symmetric_memory"].data == {"tp": 4, "devices": [0, 1, 2, 3]}


def test_pdl_follows_the_gpu_and_the_switch(install_gpus, monkeypatch):
    install_gpus(h100s(1) + [GpuFacts(1, "NVIDIA A100-SXM4-80GB", "uuid-1", (8, 0), 108,
                                      80 * GIB)])
    found = build()
    assert found["gpus"]["pdl"].why == "off: GPU 1 older than Hopper (sm 9.0): no griddepcontrol"
    assert found["gpus"]["devices"].text.count(" x ") == 2
    install_gpus(h100s(2))
    monkeypatch.setenv("FUSION_PASS_PDL", "0")
    assert build()["gpus"]["pdl"].why == "off: FUSION_PASS_PDL=0"


def test_nvlink_through_nvml(install_gpus, monkeypatch):
    """A stand-in of nvidia-ml-py's ``pynvml`` (its names and NVML's constants)."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    links = {"GPU-uuid-0": 18, "GPU-uuid-1": 4}
    nvml.NVMLError, nvml.NVML_FEATURE_ENABLED, nvml.NVML_NVLINK_MAX_LINKS = NVMLError, 1, 18
    nvml.nvmlInit = nvml.nvmlShutdown = lambda: None

    def by_uuid(uuid: str) -> str:
        if uuid not in links:
            raise NVMLError("Not Found")
        return uuid

    def state(handle: str, link: int) -> int:
        return 1 if link < links[handle] else 0

    nvml.nvmlDeviceGetHandleByUUID, nvml.nvmlDeviceGetNvLinkState = by_uuid, state
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    install_gpus(h100s(2))
    f = build()["gpus"]["nvlink"]
    assert f.ok and f.data["links"] == [18, 4]
    assert f.text == "NVLink: GPU 0: 18, GPU 1: 4 active links"
    links.update({"GPU-uuid-0": 0, "GPU-uuid-1": 0})
    assert build()["gpus"]["nvlink"].status == "no"
    install_gpus(h100s(1))  # one GPU: nothing to link
    assert build()["gpus"]["nvlink"].why == "no pair of GPUs"


@pytest.mark.parametrize("generation,launcher", [
    ("flat", lambda sig: si.Run36(sig)),
    ("generic", lambda sig: si.Run38(sig)),
    (None, lambda sig: _Appended(si.Run38(sig))),
])
def test_the_launcher_generation_of_a_compiled_kernel(install_gpus, monkeypatch, generation,
                                                      launcher):
    import torch

    from fusion_pass.backends.triton_symm.probe import read_ends_kernel

    install_gpus(h100s(2))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(versions, "_compiled_launcher",
                        lambda: launcher(si.signature(read_ends_kernel)))
    f = build()["versions"]["triton_launcher"]
    assert f.data["generation"] == generation
    if generation is None:
        assert f.status == "no" and "layout the fast path does not know" in f.why
    else:
        assert f.ok
        assert f.text == f"Triton launcher: generation {generation}, the fast launch takes it"


class _Appended:
    """A launcher of no known generation: 3.8's, with one more argument at the end."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.launch = run.launch
        self.global_scratch_size = self.profile_scratch_size = 0

    def __call__(self, *args: Any) -> None:
        launch = self.launch
        self.run.launch = lambda *a: launch(*a, 0)
        self.run(*args)


def test_with_gpus_and_no_topology_module_the_gpu_lines_say_why(monkeypatch):
    monkeypatch.setitem(sys.modules, context.TOPOLOGY, None)
    monkeypatch.setattr(context, "torch_gpu_count", lambda: 2)
    rc = doctor.main(["--json"])
    assert rc == 0
    found = build()
    for name in ("devices", "p2p", "symmetric_memory"):
        f = found["gpus"][name]
        assert f.status == "error" and "fusion_pass.topology" in f.why, name


# ------------------------------------------------------------- never raising

PROBES = [(s, n) for s, probes in report.SECTIONS.items() for n in probes]


@pytest.mark.parametrize("section,name", PROBES + [("fusion", "verdict")],
                         ids=[f"{s}.{n}" for s, n in PROBES] + ["fusion.verdict"])
def test_a_probe_that_raises_is_one_line_with_its_reason(monkeypatch, capsys, section, name):
    def boom(*args: Any) -> None:
        raise RuntimeError(f"injected into {name}")

    if name == "verdict":
        monkeypatch.setattr(report, "VERDICT", boom)
    else:
        monkeypatch.setitem(report.SECTIONS[section], name, boom)
    assert doctor.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"  ERR {section}.{name}: the check failed: RuntimeError: injected into {name}" in lines
    assert sum(ln.startswith("  ERR ") for ln in lines) == 1, lines
    assert len(lines) == 1 + len(report.SECTIONS) + len(PROBES) + 1
    assert doctor.main(["--json"]) == 0
    got = json.loads(capsys.readouterr().out)[section][name]
    assert got == {"ok": False, "status": "error", "error": "RuntimeError",
                   "why": f"the check failed: RuntimeError: injected into {name}"}


def test_a_probe_that_returns_no_finding_is_an_error_too(monkeypatch):
    monkeypatch.setitem(report.SECTIONS["versions"], "python", lambda ctx: "3.11")
    f = build()["versions"]["python"]
    assert f.status == "error" and "returned str, not a Finding" in f.why


def test_a_shared_fact_that_fails_fails_each_reader_once(install_gpus, monkeypatch):
    """The GPU list raising: every probe that reads it says so, nothing else is lost."""
    install_gpus(h100s(2))

    def gpus() -> list:
        raise OSError("NVML: driver/library version mismatch")

    monkeypatch.setattr(sys.modules[context.TOPOLOGY], "gpus", gpus)
    found = build()
    for name in ("devices", "p2p", "symmetric_memory"):
        assert "driver/library version mismatch" in found["gpus"][name].why, name
    assert found["versions"]["python"].ok and found["fusion"]["backend"].ok



def test_the_plugins_findings_block_only_where_vllm_is_installed(monkeypatch, install_gpus):
    real = context._import_vllm
    install_gpus(h100s(2))
    monkeypatch.setenv("VLLM_PLUGINS", "another_plugin")
    monkeypatch.setattr(context, "_import_vllm", lambda: None)
    found = build()
    assert found["plugin"]["entry_point"].status == "no"
    assert found["fusion"]["verdict"].ok, found["fusion"]["verdict"].why
    assert found["fusion"]["verdict"].text.startswith("verdict: nothing in the way")
    if importlib.util.find_spec("vllm") is not None:
        monkeypatch.setattr(context, "_import_vllm", real)
        verdict = build()["fusion"]["verdict"]
        assert verdict.status == "no" and "VLLM_PLUGINS=another_plugin" in verdict.why
