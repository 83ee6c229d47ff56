"""Building vLLM compilation configs that enable the fusion.

Python: ``LLM(model, tensor_parallel_size=2, compilation_config=compilation_config())``.

Command line (plain JSON, resolved by the plugin in every process)::

    vllm serve MODEL -tp 2 --compilation-config \
        '{"inductor_passes": {"post_grad_custom_post_pass": "fusion_pass.vllm_fusion_pass"}}'

:func:`cli_json` prints that JSON, merged with other settings;
``cli_json(merge_summed_all_reduces=True)`` names ``fusion_pass.vllm_fusion_pass_merge_summed``.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Optional

from ..allreduce_rmsnorm_pass import merge_option
from . import compat
from .plugin import JSON_NAME, JSON_NAMES

PASS_KEY = "post_grad_custom_post_pass"
JSON_PASS = f"fusion_pass.{JSON_NAME}"


def compilation_config(threshold: Optional[int] = None,
                       dtypes: Optional[Iterable[str]] = None,
                       base: Optional[dict[str, Any]] = None,
                       debug_dump_path: Optional[str] = None,
                       in_tree: Optional[bool] = False,
                       sequence_parallel: Optional[bool] = None,
                       merge_summed_all_reduces: bool = False) -> dict[str, Any]:
    """A ``compilation_config`` dict for ``vllm.LLM`` with the fusion pass enabled.

    With a vLLM outside the supported versions it says so in one line and
    returns a copy of ``base`` unchanged: the model runs without the fusion.

    ``base``: other compilation settings to keep (copied, not modified).
    ``in_tree``: vLLM's own all-reduce fusion (``pass_config.fuse_allreduce_rms``,
    on by default at -O2 on Hopper/Blackwell with FlashInfer and on ROCm with
    AITER).  It runs before this pass and takes every site it matches, so False
    (default) turns it off and this pass fuses them; None leaves vLLM's setting.
    ``threshold``: force one-stage up to that many tokens (None: the backend's
    schedule).  The plugin adds the compile-range endpoints where the path
    changes for the model; a forced threshold is also added here, so that vLLM
    compiles separate graphs at or below it and above it even where the plugin
    is not loaded (``VLLM_PLUGINS`` excludes it).
    ``sequence_parallel``: vLLM 0.26-0.31's sequence parallelism
    (``pass_config.enable_sp``, with the async TP on it) runs before this pass
    and, above its token threshold, replaces the all-reduces this pass would
    fuse; False turns it off, None (default) leaves vLLM's setting.
    ``merge_summed_all_reduces``: rewrite ``all_reduce(a) + all_reduce(b)`` into
    ``all_reduce(a + b)`` before matching (DeepSeek-V3's routed + shared experts; one
    rounding differs), as :class:`~fusion_pass.AllReduceRMSNormFusionPass` does; off by
    default.
    """
    from .vllm_pass import VllmAllReduceRMSNormPass, supported

    merge_option(merge_summed_all_reduces)  # bad input fails with every vLLM
    if not supported():
        return dict(base or {})
    cfg = _merge(base)
    if PASS_KEY in cfg["inductor_compile_config"]:
        raise ValueError(f"compilation_config already sets {PASS_KEY}; vLLM takes one "
                         "custom post pass")
    cfg["inductor_compile_config"][PASS_KEY] = VllmAllReduceRMSNormPass(
        threshold, dtypes, merge_summed_all_reduces=merge_summed_all_reduces)
    if threshold is not None:
        cfg["compile_ranges_endpoints"] = sorted(set(cfg.get("compile_ranges_endpoints") or [])
                                                 | {threshold})
    if debug_dump_path is not None:
        cfg["debug_dump_path"] = debug_dump_path
    _set_pass_config(cfg, in_tree, sequence_parallel)
    return cfg


def cli_json(base: Optional[dict[str, Any]] = None, in_tree: Optional[bool] = False,
             sequence_parallel: Optional[bool] = None,
             merge_summed_all_reduces: bool = False) -> str:
    """The ``--compilation-config`` JSON that enables the fusion for ``vllm serve``
    (``in_tree``, ``sequence_parallel`` and ``merge_summed_all_reduces`` as for
    :func:`compilation_config`; the last one picks which published pass the JSON names;
    ``base`` unchanged, with a one-line warning, for an unsupported vLLM)."""
    from .vllm_pass import supported

    name = JSON_NAMES[merge_option(merge_summed_all_reduces)]
    if not supported():
        return json.dumps(base or {})
    cfg = _merge(base)
    _set_pass_config(cfg, in_tree, sequence_parallel)
    if not cfg["inductor_compile_config"]:
        cfg.pop("inductor_compile_config")
    passes = dict(cfg.get("inductor_passes") or {})
    passes[PASS_KEY] = f"fusion_pass.{name}"
    cfg["inductor_passes"] = passes
    return json.dumps(cfg)


def _set_pass_config(cfg: dict[str, Any], in_tree: Optional[bool],
                     sequence_parallel: Optional[bool]) -> None:
    settings: dict[str, bool] = {}
    if in_tree is not None:
        settings.update(compat.in_tree_settings(in_tree))
    if sequence_parallel is not None:
        settings.update(compat.sequence_parallel_settings(sequence_parallel))
    if settings:
        cfg["pass_config"] = {**dict(cfg.get("pass_config") or {}), **settings}


def _merge(base: Optional[dict[str, Any]]) -> dict[str, Any]:
    cfg = dict(base or {})
    cfg["inductor_compile_config"] = dict(cfg.get("inductor_compile_config") or {})
    return cfg
