"""What a vLLM engine of the benchmarks is: the variants' compilation configs, the engine
arguments and the environment, stated once for the offline benchmark (``bench_vllm.py``,
``vllm.LLM``) and the serving one (``bench_serve.py``, vLLM's OpenAI server), so that a
server of a variant compiles to the same cache key as the offline engine of that variant
and loads what it compiled (the models themselves: ``vllm_models.py``).  vLLM is imported
only where it is asked.

Every engine has the same KV cache size (``kv_cache_memory_bytes``, from ``--kv-tokens``)
whatever else runs on its GPU, and on GPUs the same pinned Inductor kernel choices
(:data:`PINNED`): no choice made by timing kernels at compile or first run, so two
compiles of one graph give the same kernels.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import plugin_entry
import vllm_models
from vllm_models import CPU_MODELS, GPU_MODELS, MODELS, kv_bytes_per_token

from fusion_pass import records
from fusion_pass.tools import demo
from fusion_pass.tools.demo import ModelSpec, cpu_env, on_cpu

VARIANTS = ("off", "in_tree", "plugin")
DESCRIBE = {
    "off": "no all-reduce fusion (vLLM's in-tree fusion off, no plugin pass)",
    "in_tree": "vLLM's in-tree all-reduce + RMSNorm fusion (FlashInfer / AITER); the plugin's "
               "pass runs after it only to record what it fused and fuses any site it left",
    "plugin": "this plugin's pass (vLLM's in-tree fusion off)",
}
AA_SUFFIX = "_aa"
"""The label of a variant's second engine, the A/A twin: ``off_aa`` for ``off``."""
FLASHINFER_ENV = {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"}
"""Set for every engine unless the environment sets it: FlashInfer's mnnvl all-reduce
(vLLM 0.26's default for its fusion) uses NVLink multicast; the trtllm one does not."""

# Inductor settings for every engine on GPUs.  vLLM's defaults turn on combo kernels with
# `benchmark_combo_kernel` (each candidate combination timed at compile time), and
# Inductor times every candidate config of a pointwise kernel, and of combo kernels, at
# its first run (vLLM's profile run): picks among near-equal candidates that differ from
# compile to compile, between two engines of one variant as much as between variants.
# Here combo kernels stay on, formed and configured by Inductor's heuristics alone.
# Reductions with several candidate configs were still timed at their first run, and two
# engines of one variant picked differently (3 timed kernels per compile, 1 or 2 picks
# differing, on one H200): Inductor's reduction-config filter (the one its deterministic
# mode uses, without that mode's other changes) keeps one candidate by a fixed rule.  The
# kernel digests (compiled_digest.py) show whether any pick still differs.
PINNED = {"combo_kernels": True, "benchmark_combo_kernel": False,
          "combo_kernels_autotune": 0, "triton.autotune_pointwise": False,
          "test_configs.force_filter_reduction_configs": True}
KERNEL_CHOICES = ("pinned", "vllm")


def label_variant(label: str) -> str:
    """The variant an engine label runs (``off_aa`` runs ``off``)."""
    return label[:-len(AA_SUFFIX)] if label.endswith(AA_SUFFIX) else label


# -- the model ----------------------------------------------------------------------

def write_model(spec: ModelSpec, path: Path, dtype: str, weights: str) -> Path:
    """``weights="dummy"``: a Llama ``config.json`` (vLLM's dummy weights, as ``vllm bench
    latency`` runs them) and a word-level tokenizer (``vllm bench serve``'s random prompts
    are decoded and re-encoded with it); ``"random"``: the demo's random-weight checkpoint
    with its tokenizer (small models)."""
    if weights == "random":
        return demo.make_checkpoint(spec, path, dtype=dtype)
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                      num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                      num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
                      vocab_size=spec.vocab, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=500000.0,
                      bos_token_id=1, eos_token_id=2, torch_dtype=dtype)
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    if not (path / "tokenizer.json").exists():
        demo.make_tokenizer(spec.vocab).save_pretrained(path)
    return path


# -- what the engines run -------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EngineShape:
    """The engine arguments shared by every engine of a run, offline or serving."""
    tp: int
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: Optional[int]
    """Every model's token budget a step; None: each model's own (:meth:`step_tokens`)."""
    kv_tokens: int
    weights: str = "dummy"
    kernel_choice: str = "pinned"
    attention_backend: Optional[str] = None
    dump: bool = False
    model_info_dir: Optional[str] = None

    def step_tokens(self, model: str) -> int:
        """The token budget a step (``max_num_batched_tokens``) of ``model``'s engines."""
        return vllm_models.step_tokens(model, self.max_num_batched_tokens)


def kernel_settings(choice: str) -> dict[str, Any]:
    """The Inductor settings of ``--kernel-choice`` that this torch has (none on the CPU,
    where Inductor times nothing and vLLM turns no combo kernels on)."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernel choice {choice!r}: one of {KERNEL_CHOICES}")
    if choice != "pinned" or on_cpu():
        return {}
    from torch._inductor import config

    def known(name: str) -> bool:
        obj: Any = config
        for part in name.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True

    return {k: v for k, v in PINNED.items() if known(k)}


def compilation(variant: str, shape: EngineShape,
                dump_dir: Optional[Path] = None) -> dict[str, Any]:
    """A variant's ``compilation_config`` as plain JSON, the form ``vllm serve`` takes
    and ``vllm.LLM`` takes too (the plugin's pass by its qualified name): the same
    config, so the same compile cache key, in both benchmarks.  vLLM's defaults
    otherwise (mode, CUDA graph mode, capture sizes, sequence parallelism)."""
    from fusion_pass.vllm_integration import cli_json, compat

    base: dict[str, Any] = {}
    pinned = kernel_settings(shape.kernel_choice)
    if pinned:
        base["inductor_compile_config"] = pinned
    if variant == "plugin":
        cfg = json.loads(cli_json(base=base))
    elif variant == "in_tree":
        cfg = json.loads(cli_json(base=base, in_tree=True))
    elif variant == "off":
        cfg = {**base, "pass_config": compat.in_tree_settings(False)}
    else:
        raise ValueError(f"unknown variant {variant!r}")
    if dump_dir is not None and variant != "off" and not on_cpu():
        cfg["debug_dump_path"] = str(dump_dir)
    return cfg


def engine_kwargs(shape: EngineShape, spec: ModelSpec, model: Path, variant: str,
                  dump_dir: Optional[Path] = None) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments (plain JSON) of a variant's engine."""
    kw: dict[str, Any] = dict(
        model=str(model), tensor_parallel_size=shape.tp, dtype=shape.dtype,
        load_format="dummy" if shape.weights == "dummy" else "auto",
        max_model_len=shape.max_model_len, max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.step_tokens(spec.name), enable_prefix_caching=False,
        seed=0, compilation_config=compilation(variant, shape, dump_dir))
    if not on_cpu():
        # The KV cache is sized by the bytes given, not by what the GPU has free when the
        # engine starts: the same for every engine, whatever the others hold.  The
        # utilization is only checked against the memory free at start.
        kw["kv_cache_memory_bytes"] = shape.kv_tokens * kv_bytes_per_token(
            spec, shape.tp, shape.dtype)
        kw["gpu_memory_utilization"] = 0.05
    if shape.attention_backend is not None:
        from vllm.engine.arg_utils import EngineArgs

        if "attention_config" in {f.name for f in dataclasses.fields(EngineArgs)}:
            kw["attention_config"] = {"backend": shape.attention_backend}
    return kw


def server_args(kw: dict[str, Any]) -> list[str]:
    """The same engine as command-line flags of vLLM's OpenAI server."""
    out = ["--model", kw["model"]]
    for k, v in kw.items():
        if k == "model":
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + k.replace("_", "-"))
        elif isinstance(v, dict):
            out += [flag, json.dumps(v)]
        else:
            out += [flag, str(v)]
    return out


def engine_env(work: Path, shape: EngineShape) -> dict[str, str]:
    """The environment of one engine: its own compile caches and record folder under
    ``work`` (a server of the same variant later reuses the caches), and the model-class
    answers of every engine's vLLM in one folder (:func:`share_model_info`)."""
    if shape.model_info_dir is not None:
        share_model_info(work / "cache" / "vllm", Path(shape.model_info_dir))
    env = {"VLLM_CACHE_ROOT": str(work / "cache" / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(work / "cache" / "inductor"),
           records.RECORD_DIR_ENV: str(work / "records")}
    if shape.attention_backend is not None and not _has_attention_config():
        env["VLLM_ATTENTION_BACKEND"] = shape.attention_backend
    env.update({k: v for k, v in FLASHINFER_ENV.items() if k not in os.environ})
    if on_cpu():
        env.update({k: v for k, v in cpu_env().items() if k not in os.environ})
    return env


def share_model_info(cache_root: Path, shared: Path) -> None:
    """``cache_root/modelinfos`` made a link to ``shared``.  Before an engine starts, vLLM
    asks what its model class supports in a child process that imports vLLM again (about
    20 s), unless ``VLLM_CACHE_ROOT/modelinfos`` holds the answer (checked against the
    hash of the model's source file).  Each engine has a cache root of its own, for its
    compile caches; without the link every engine of every step pays those seconds."""
    shared.mkdir(parents=True, exist_ok=True)
    link = cache_root / "modelinfos"
    cache_root.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        if link.is_symlink() and link.resolve() == shared.resolve():
            return
        if link.is_symlink() or not link.is_dir():
            link.unlink()
        else:  # a folder of its own, kept from a run before the link
            shutil.rmtree(link)
    link.symlink_to(shared.resolve(), target_is_directory=True)


def warm_model_info(shared: Path, architectures: tuple[str, ...] = ("LlamaForCausalLM",)) \
        -> dict[str, float]:
    """vLLM's answers for ``architectures`` written to ``shared`` (what
    :func:`share_model_info` links), seconds per architecture; run once before the
    engines start, in a process of its own (``python benchmarks/vllm/vllm_setup.py
    warm-model-info DIR``: it sets ``VLLM_CACHE_ROOT`` for the process).  vLLM asks in a
    child process that imports vLLM again, so that the process asking never initialises
    CUDA; this process exists only to ask, so where vLLM has that child-process hook
    (``registry._run_in_subprocess``, 0.26 to 0.34) it asks in this process instead: the
    same answer through vLLM's own cache code, without a second import of vLLM (vLLM's
    child process took 26 s of the 46 this step took on one H100; on 2 CPU cores the step
    takes 7 s instead of 15)."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        os.environ["VLLM_CACHE_ROOT"] = root
        share_model_info(Path(root), shared)
        from vllm.model_executor.models import registry

        hook = getattr(registry, "_run_in_subprocess", None)
        if callable(hook):
            registry._run_in_subprocess = lambda fn: fn()
        out = {}
        try:
            for arch in architectures:
                t = time.monotonic()
                registry.ModelRegistry.models[arch].inspect_model_cls()
                out[arch] = round(time.monotonic() - t, 2)
        finally:
            if callable(hook):
                registry._run_in_subprocess = hook
    if not any(shared.iterdir()):
        raise RuntimeError(f"vLLM wrote no model-class answer into {shared}")
    return out


@functools.cache
def _has_attention_config() -> bool:
    from vllm.engine.arg_utils import EngineArgs

    return "attention_config" in {f.name for f in dataclasses.fields(EngineArgs)}


# -- what can run here --------------------------------------------------------------

def attention_backend(requested: str) -> tuple[Optional[str], str]:
    """The attention backend to ask vLLM for, and why.  vLLM's CUDA default is
    FlashAttention, whose extensions a vLLM install may lack; Triton's then."""
    if requested != "auto":
        return requested, "given on the command line"
    if on_cpu():
        return None, "vLLM's choice (the CPU build)"
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None, "vLLM's choice"
    have = [m for m in ("vllm.vllm_flash_attn._vllm_fa3_C", "vllm.vllm_flash_attn._vllm_fa2_C",
                        "vllm._vllm_fa3_C", "vllm._vllm_fa2_C") if _spec(m)]
    if have:
        return None, f"vLLM's choice (FlashAttention's extension present: {have[0]})"
    return "TRITON_ATTN", "FlashAttention's extensions are not installed"


def _spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# vLLM's own verdict, in a child process (importing FlashInfer's comm module may
# touch the GPU): the module of its in-tree pass keeps ``flashinfer_comm`` None
# unless FlashInfer imports and has what this vLLM calls.
_PROBE = """
import importlib, sys
m = importlib.import_module("vllm.compilation.passes.fusion.allreduce_rms_fusion")
if getattr(m, "flashinfer_comm", None) is not None:
    sys.exit(0)
try:
    import flashinfer.comm
except Exception as e:
    print(f"importing flashinfer.comm failed: {type(e).__name__}: {e}")
else:
    print("this FlashInfer lacks the all-reduce fusion API this vLLM calls")
sys.exit(3)
"""


@functools.cache
def in_tree_unavailable(tp: int) -> Optional[str]:
    """Why vLLM's in-tree all-reduce fusion cannot run here (None: it can)."""
    from fusion_pass.vllm_integration import compat

    fields = compat.pass_config_fields()
    missing = sorted(set(compat.in_tree_settings(True)) - fields)
    if missing:
        return f"this vLLM's PassConfig has no {', '.join(missing)}"
    if tp < 2:
        return f"tensor_parallel_size={tp}: there is no all-reduce to fuse"
    if on_cpu():
        return "vLLM's CPU build has no in-tree all-reduce fusion (it needs FlashInfer or AITER)"
    from vllm.platforms import current_platform

    if current_platform.is_rocm():
        return None if _spec("aiter") else "AITER is not installed"
    if not _spec("flashinfer"):
        return "FlashInfer is not installed"
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                       timeout=300)
    if r.returncode == 0:
        return None
    last = (r.stdout.strip() or r.stderr.strip() or "?").splitlines()[-1]
    return last if r.returncode == 3 else f"probing vLLM's in-tree pass failed: {last}"


def runnable(args: Any) -> tuple[list[str], dict[str, str]]:
    """The variants of ``--variants`` that can run here, and why each other one cannot;
    ``args.aa`` becomes ``none`` where its variant cannot run."""
    from fusion_pass.vllm_integration import compat

    skipped: dict[str, str] = {}
    if "in_tree" in args.variants and (why := in_tree_unavailable(args.tp)) is not None:
        skipped["in_tree"] = why
    if "plugin" in args.variants and (why := compat.unsupported_reason()) is not None:
        skipped["plugin"] = why
    if not plugin_entry.installed():
        # The variants' configs name the pass by its JSON name, which the plugin publishes.
        why = ("vLLM finds no fusion_pass plugin entry point (pip install the package, or "
               "put the folder `python benchmarks/vllm/plugin_entry.py DIR` writes on PYTHONPATH)")
        skipped.update({v: why for v in ("plugin", "in_tree") if v in args.variants
                        and v not in skipped})
    want = [v for v in args.variants if v not in skipped]
    if args.aa not in want:
        args.aa = "none"
    for v, reason in skipped.items():
        print(f"variant {v} not run: {reason}", file=sys.stderr, flush=True)
    return want, skipped


# -- the command line both benchmarks share -------------------------------------------

def engine_parser(doc: Optional[str]) -> argparse.ArgumentParser:
    """A benchmark's command line, its engine flags added (:func:`add_engine_args`)."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    return p


def add_engine_args(p: Any) -> None:
    """The engine's flags, with the same defaults in both benchmarks: a serving run that
    follows an offline one with the same flags reuses the offline engines' compiles."""
    cpu = on_cpu()
    p.add_argument("--tp", type=int, default=2 if cpu else 1, help="tensor_parallel_size")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS),
                   default=list(CPU_MODELS if cpu else GPU_MODELS))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--aa", default="off", help="the variant measured twice (the A/A pair: "
                   f"<variant> and <variant>{AA_SUFFIX}); 'none': no A/A pair")
    p.add_argument("--dtype", default="float32" if cpu else "bfloat16")
    p.add_argument("--max-model-len", type=int, default=256 if cpu else 2112)
    p.add_argument("--max-num-seqs", type=int, default=8 if cpu else 64)
    p.add_argument("--max-num-batched-tokens", type=int, default=256 if cpu else None,
                   help="every model's token budget a step (default on GPUs: each model's "
                        "own, vllm_models.step_tokens; 256 on the CPU)")
    p.add_argument("--kv-tokens", type=int, default=40960,
                   help="KV cache size of every engine, in tokens (GPUs; the CPU build takes "
                        "VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--kernel-choice", choices=KERNEL_CHOICES, default="pinned",
                   help="pinned: Inductor picks kernels and configs without timing them, "
                        "the same in every compile of a graph (GPUs); vllm: vLLM's defaults")
    p.add_argument("--cpu-placement", choices=("pinned", "scheduler"),
                   default="scheduler" if cpu else "pinned",
                   help="pinned: once up, every engine's frontend, engine core and workers on "
                        "the same CPUs, one physical core each, the benchmark's process on the "
                        "others (cpu_placement.py: every engine measured in the same place); "
                        "scheduler: left to the kernel (the CPU build binds its own compute "
                        "threads)")
    p.add_argument("--cpu-no-halt", choices=("auto", "on", "off"),
                   default="off" if cpu else "auto",
                   help="on: while measuring, a busy loop at the lowest priority on every CPU "
                        "(cpu_placement.Spinners), so that no CPU halts and waits on the "
                        "hypervisor to wake it; auto (GPUs): on in a virtual machine; off: none")
    p.add_argument("--attention-backend", default="auto",
                   help="auto: vLLM's choice, or TRITON_ATTN where FlashAttention is not installed")
    p.add_argument("--weights", choices=("dummy", "random"), default="dummy",
                   help="dummy: vLLM's dummy weights from a config (as vllm bench latency); "
                        "random: a random-weight checkpoint written first (small models)")
    p.add_argument("--start-parallel", type=int, default=1 if cpu else 0,
                   help="engines of a wave starting at once (0: all); on GPUs their "
                        "compiles overlap")
    p.add_argument("--launch-order", choices=("shuffled", "given"), default="shuffled",
                   help="the order a wave's engines are launched in: shuffled (by "
                        "--launch-seed, or a seed of the run's own, recorded) or as the "
                        "variants are given")
    p.add_argument("--launch-seed", type=int, default=None)
    p.add_argument("--gpu-free-gib", type=float, nargs="+", default=None,
                   help="each GPU's free memory, GiB, that the waves are sized against "
                        "(default: read by NVML when the run starts; none on the CPU)")
    p.add_argument("--beside-gib", type=float, default=0.0,
                   help="GiB held on each GPU by a job beside the first wave (the "
                        "end-to-end check's engines, BESIDE_GIB of wave_plan.py --shell)")
    p.add_argument("--budget-s", type=float, default=0,
                   help="wall-clock seconds for the whole run (0: none): measuring stops in "
                        "time to write the results")
    p.add_argument("--latest-s", type=float, default=0,
                   help="wall-clock seconds the run may take where its engines come up late "
                        "(0: --budget-s): a wave's start and first round may reach into the "
                        "time after --budget-s, the later waves left what they need for one "
                        "round each; its other rounds end within --budget-s")
    p.add_argument("--reserve-s", type=float, default=30,
                   help="of --budget-s, the seconds kept to stop the engines and write results")
    p.add_argument("--gpu-shared", action="store_true",
                   help="another job holds memory on these GPUs while this run's engines are "
                        "up (the end-to-end check, beside the offline benchmark's first "
                        "wave): what a wave holds is then not told from the GPUs' free "
                        "memory, and not recorded")
    p.add_argument("--after-pid", type=int, default=None,
                   help="measure only once process PID has ended, waiting for it within the "
                        "first wave's start-up time: a job sharing the GPUs that must not "
                        "overlap the measurements (the end-to-end check beside the offline "
                        "benchmark)")
    p.add_argument("--model-info-dir", type=Path, default=None,
                   help="vLLM's model-class answers, shared by every engine (default: "
                        "WORK_DIR/modelinfos); a folder given here may be warmed first "
                        "(python benchmarks/vllm/vllm_setup.py warm-model-info DIR)")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="configs, caches, records, dumps (default: a temporary folder, removed)")


def least_step_tokens(a: Any) -> int:
    """The smallest token budget a step of :func:`add_engine_args`'s ``--models``."""
    return min(vllm_models.step_tokens(m, a.max_num_batched_tokens) for m in a.models)


def check_engine_args(p: Any, a: Any) -> None:
    """What ``argparse`` cannot check of :func:`add_engine_args`'s flags."""
    if a.aa != "none" and a.aa not in a.variants:
        p.error(f"--aa {a.aa}: not one of --variants")


def engine_shape(args: Any, attention: Optional[str], root: Optional[Path] = None) \
        -> EngineShape:
    """The run's engine arguments; the model-class answers shared in ``--model-info-dir``,
    else in ``root/modelinfos``."""
    info = getattr(args, "model_info_dir", None) or (root / "modelinfos" if root else None)
    return EngineShape(tp=args.tp, dtype=args.dtype, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       kv_tokens=args.kv_tokens, weights=args.weights,
                       kernel_choice=args.kernel_choice, attention_backend=attention,
                       dump=getattr(args, "dump", False),
                       model_info_dir=None if info is None else str(info))


def labels(variants: list[str], aa: str) -> list[str]:
    """The engines of a model: each variant, and the A/A twin right after its variant."""
    out = []
    for v in variants:
        out.append(v)
        if v == aa:
            out.append(v + AA_SUFFIX)
    return out


def baseline(labels: Any) -> str:
    """The engine every other is compared with: ``off`` where it ran, else the first."""
    labels = list(labels)
    return "off" if "off" in labels or not labels else labels[0]


def aa_pair(aa: str, labels: Any) -> Optional[tuple[str, str]]:
    """(the A/A twin, its variant) where both ran."""
    twin = aa + AA_SUFFIX
    return (twin, aa) if twin in labels and aa in labels else None


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "warm-model-info":
        sys.exit("usage: python benchmarks/vllm/vllm_setup.py warm-model-info DIR")
    print(json.dumps({"model_info_warmed": warm_model_info(Path(sys.argv[2]))}), flush=True)
    # Done: the interpreter's shutdown after importing vLLM can take tens of seconds (as
    # the benchmarks' own, vllm_run.exit_now), here inside the setup step's limit.
    os._exit(0)
