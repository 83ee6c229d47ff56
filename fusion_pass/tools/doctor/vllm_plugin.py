"""The plugin section: the plugin as vLLM will see it.

Whether vLLM finds and loads the entry point, what the config helpers return on this vLLM,
and whether something in vLLM takes the sites before the pass sees them: its own all-reduce
fusion, its sequence parallelism (0.26-0.31), or running the model without compiling it.
"""

from __future__ import annotations

import importlib
import json
import os
from types import SimpleNamespace
from typing import Any, Optional

from ... import vllm_names
from .context import Context
from .findings import Finding, no, ok, skip

PLUGIN_NAME = "fusion_pass"
"""The entry point's name in ``vllm.general_plugins`` (pyproject.toml)."""

SP_MIN_HIDDEN = 8192
SP_CAPABILITY_MAJORS = (9, 10)
"""vLLM 0.26-0.31 turn sequence parallelism on at -O2 for dense models of hidden >= 8192 on
Hopper (sm 9.x) and Blackwell (sm 10.x) (docs/vllm_integration.md)."""


def _vllm_absent(ctx: Context, label: str) -> Optional[Finding]:
    """A finding for a probe that needs a supported vLLM, where there is none; else None."""
    try:
        module = ctx.vllm()
    except Exception as e:
        return skip(label, f"vLLM does not import ({type(e).__name__}: {e})")
    if module is None:
        return skip(label, "vLLM is not installed")
    reason = ctx.compat().unsupported_reason()
    if reason is not None:
        return no(label, f"{reason}: the helpers change nothing and the pass stays off")
    return None


def _version(ctx: Context) -> str:
    return str(ctx.compat().vllm_version())


def _plugin_config(ctx: Context) -> dict[str, Any]:
    from ...vllm_integration import compilation_config

    return ctx.once("compilation_config", compilation_config)


def entry_point(ctx: Context) -> Finding:
    from importlib.metadata import entry_points

    group = vllm_names.PLUGIN_GROUP
    label = "plugin entry point"
    found = [e for e in entry_points(group=group) if e.name == PLUGIN_NAME]
    if not found:
        return no(label, f"no {group} entry point named {PLUGIN_NAME}: fusion_pass is not "
                  "installed where vLLM looks (pip install -e .)", group=group, value=None)
    ep = found[0]
    target = ep.load()
    if not callable(target):
        return no(label, f"{ep.value} is not callable", group=group, value=ep.value)
    allowed = _allowed_plugins(ctx)
    if allowed is not None and PLUGIN_NAME not in allowed:
        return no(label, f"registered, but VLLM_PLUGINS={','.join(allowed)} leaves it out, so "
                  "vLLM does not load it", group=group, value=ep.value, allowed=allowed)
    twice = f" (registered {len(found)} times)" if len(found) > 1 else ""
    return ok(f"plugin entry point {group}: {PLUGIN_NAME} -> {ep.value}, loads{twice}",
              group=group, value=ep.value, allowed=allowed)


def _allowed_plugins(ctx: Context) -> Optional[list[str]]:
    """The plugins vLLM loads (``VLLM_PLUGINS``, as vLLM reads it), None for all of them."""
    try:
        if ctx.vllm() is not None:
            from vllm import envs

            allowed = envs.VLLM_PLUGINS
            return None if allowed is None else list(allowed)
    except Exception:  # vLLM broken: read the variable as vLLM documents it
        pass
    raw = os.environ.get("VLLM_PLUGINS")
    return None if raw is None else raw.split(",")


def compilation_config(ctx: Context) -> Finding:
    label = "compilation_config()"
    absent = _vllm_absent(ctx, label)
    if absent is not None:
        return absent
    cfg = _jsonable(_plugin_config(ctx))
    passes = cfg.get("inductor_compile_config", {})
    if "post_grad_custom_post_pass" not in passes:
        return no(label, "returned no post_grad_custom_post_pass", config=cfg)
    settings = ", ".join(f"{k}={json.dumps(v)}" for k, v in cfg.get("pass_config", {}).items())
    return ok(f"{label}: the pass as post_grad_custom_post_pass"
              + (f"; pass_config {settings}" if settings else ""), config=cfg)


def cli_json(ctx: Context) -> Finding:
    from ...vllm_integration import cli_json as make

    label = "cli_json()"
    absent = _vllm_absent(ctx, label)
    if absent is not None:
        return absent
    text = make()
    return ok(f"vllm serve ... --compilation-config '{text}'", json=text)


def in_tree_fusion(ctx: Context) -> Finding:
    label = "vLLM's in-tree all-reduce fusion"
    absent = _vllm_absent(ctx, label)
    if absent is not None:
        return absent
    tp = ctx.tp
    plugin_sets = _plugin_config(ctx).get("pass_config", {}).get("fuse_allreduce_rms")
    default = _in_tree_default(tp)
    data = dict(default_on=default, plugin_config=plugin_sets, tp=tp)
    here = {True: f"on at -O2 here (TP {tp})", False: f"off at -O2 here (TP {tp})",
            None: f"vLLM {_version(ctx)} has no default rule to ask"}[default]
    if plugin_sets is False:
        tail = ("; with in_tree=None it would take every site first" if default else "")
        return ok(f"{label}: {here}; compilation_config() turns it off{tail}", **data)
    if default is False:
        return ok(f"{label}: {here}; compilation_config() leaves vLLM's setting", **data)
    return no(label, f"{here}, and compilation_config() does not turn it off: it fuses every "
              "site it matches before the pass runs", **data)


def _in_tree_default(tp: int) -> Optional[bool]:
    """vLLM's own answer (-O2 and -O3) for a config of this TP size on this platform, or
    None where this vLLM has no such function."""
    rules = importlib.import_module("vllm.config.vllm")
    decide = getattr(rules, "enable_allreduce_rms_fusion", None)
    if decide is None:
        return None
    return bool(decide(SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp))))


def sequence_parallelism(ctx: Context) -> Finding:
    label = "sequence parallelism"
    absent = _vllm_absent(ctx, label)
    if absent is not None:
        return absent
    version = _version(ctx)
    if "enable_sp" not in ctx.compat().pass_config_fields():
        return ok(f"{label}: vLLM {version} has none", has_pass=False, default_on=False)
    hidden, tp = ctx.query.hidden, ctx.tp
    gpus = ctx.gpus()
    fitting = [g for g in gpus if _major(g.capability) in SP_CAPABILITY_MAJORS]
    if tp < 2:
        return ok(f"{label}: none at TP {tp}", has_pass=True, default_on=False)
    if hidden < SP_MIN_HIDDEN or not fitting:
        why = (f"hidden {hidden} < {SP_MIN_HIDDEN}" if hidden < SP_MIN_HIDDEN
               else "no Hopper or Blackwell GPU")
        return ok(f"{label}: vLLM {version} has it, off at -O2 here ({why})", has_pass=True,
                  default_on=False)
    return no(label, f"vLLM {version} turns it on at -O2 for a dense model of hidden {hidden} "
              f"on {fitting[0].name}: from pass_config.sp_min_token_num tokens up it takes the "
              "all-reduces before the pass; compilation_config(sequence_parallel=False) leaves "
              "them to the fusion", has_pass=True, default_on=True)


def architecture(ctx: Context) -> Finding:
    arch = ctx.query.arch
    if arch is None:
        return skip("architecture", "none named (--arch NAME: does vLLM compile it?)", arch=None)
    label = f"architecture {arch}"
    absent = _vllm_absent(ctx, label)
    if absent is not None:
        return absent
    version = _version(ctx)
    env = vllm_names.BREAKABLE_CUDAGRAPH_ENV
    if env in os.environ:
        breakable, source = os.environ[env] == "1", f"{env}={os.environ[env]}"
    else:
        rules = importlib.import_module("vllm.config.vllm")
        defaults = getattr(rules, "default_breakable_cudagraph_architectures", None)
        if defaults is None:
            breakable, source = False, f"vLLM {version} compiles every architecture by default"
        else:
            breakable = arch in defaults()
            source = (f"vLLM {version} runs it so by default on this platform" if breakable else
                      f"not among vLLM {version}'s uncompiled architectures on this platform")
    if breakable:
        return no(label, f"vLLM runs it without torch.compile, as eager code in breakable CUDA "
                  f"graphs ({source}): no post-grad pass runs; {env}=0 makes vLLM compile it "
                  "where it can", arch=arch, compiled=False)
    return ok(f"{label}: vLLM compiles it ({source})", arch=arch, compiled=True)


def _major(capability: Any) -> Optional[int]:
    try:
        return int(capability[0])
    except (TypeError, ValueError, IndexError):
        try:
            return int(str(capability).split(".")[0])
        except ValueError:
            return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return f"<{type(value).__name__}>"
