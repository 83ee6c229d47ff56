"""vLLM general plugin: makes the fusion pass available in every vLLM process.

vLLM calls :func:`register` once in each of its processes (the CLI / API
server, the engine core, every worker), before configs are parsed there.  It

* publishes the pass under the top-level name ``fusion_pass.vllm_fusion_pass``
  (and the pass that merges summed all-reduces under
  ``fusion_pass.vllm_fusion_pass_merge_summed``), so that plain JSON can enable it:
  vLLM resolves ``compilation_config.inductor_passes`` values with a top-level
  ``__import__``, which only finds attributes of the top-level package;
* hooks vLLM's compile-range computation so that a config carrying the pass
  gets the pass's endpoints (the token threshold, the backend's size limit),
  and the pass decides there, once, whether it applies (TP size, dtype);
* registers the CPU build's shared-memory all-reduce form with the matcher;
* when ``FUSION_PASS_DEPYF_DIR`` is set, starts depyf in this process: vLLM
  honours ``debug_dump_path`` only in VLLM_COMPILE mode, never on the CPU
  (through vLLM's depyf compatibility layer where it has one: a dump never fails a
  compile, :mod:`fusion_pass.depyf_dump`).

Nothing changes unless a config names the pass: the fusion is off by default.
With a vLLM outside the supported versions (:mod:`.compat`) it says so in one
line and publishes a pass that changes nothing, so that configs naming it load.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

from ..log import logger

JSON_NAME = "vllm_fusion_pass"
"""Attribute of the top-level ``fusion_pass`` package that holds the pass for JSON configs."""
JSON_MERGE_NAME = "vllm_fusion_pass_merge_summed"
"""The same for the pass with ``merge_summed_all_reduces=True``: a JSON config names a
pass but cannot give it arguments, so each setting it may choose is a pass of its own."""
JSON_NAMES = {False: JSON_NAME, True: JSON_MERGE_NAME}
"""The published name by the value of ``merge_summed_all_reduces``."""
DEPYF_DIR_ENV = "FUSION_PASS_DEPYF_DIR"

_registered = False
_depyf: Any = None


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True

    import fusion_pass
    from .vllm_pass import VllmAllReduceRMSNormPass, supported

    _route_logs()
    for merge, name in JSON_NAMES.items():
        setattr(fusion_pass, name, VllmAllReduceRMSNormPass(merge_summed_all_reduces=merge))
    if not supported():
        return
    _install_config_hook()
    _start_depyf()


def _route_logs() -> None:
    """Send the package's log through vLLM's logger, so that decisions show in
    vLLM's output (with its process prefixes), at vLLM's logging level.

    Forwarded at emit time: vLLM may configure its handlers after plugins load."""
    import logging

    try:
        from vllm import envs
        level = envs.VLLM_LOGGING_LEVEL
    except Exception:  # an unsupported vLLM: keep our own logging
        return

    class ToVllm(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            logging.getLogger("vllm").handle(record)

    ours = logging.getLogger("fusion_pass")
    ours.addHandler(ToVllm())
    ours.setLevel(level)
    ours.propagate = False


def _install_config_hook() -> None:
    """Wrap ``VllmConfig._set_compile_ranges``: it runs on the final config
    (after the platform's own adjustments) and computes the endpoints vLLM
    compiles separate graphs for."""
    from vllm.config import VllmConfig

    original = getattr(VllmConfig, "_set_compile_ranges", None)
    if original is None or getattr(original, "_fusion_pass_hook", False):
        if original is None:
            logger.warning("fusion_pass: this vLLM has no VllmConfig._set_compile_ranges; "
                           "add the token threshold to compile_ranges_endpoints yourself")
        return

    @functools.wraps(original)
    def set_compile_ranges(self: Any) -> None:
        prepare_config(self)
        original(self)

    set_compile_ranges._fusion_pass_hook = True  # type: ignore[attr-defined]
    VllmConfig._set_compile_ranges = set_compile_ranges


def prepare_config(vllm_config: Any) -> None:
    """If ``vllm_config`` carries the pass, give it a private copy prepared for
    this config, and add the pass's compile-range endpoints."""
    from .vllm_pass import VllmAllReduceRMSNormPass

    cc = vllm_config.compilation_config
    pass_ = cc.inductor_compile_config.get("post_grad_custom_post_pass")
    if not isinstance(pass_, VllmAllReduceRMSNormPass):
        return
    # The JSON form resolves to a shared object: never prepare that one in place.
    pass_ = copy.copy(pass_)
    cc.inductor_compile_config["post_grad_custom_post_pass"] = pass_
    endpoints = pass_.prepare(vllm_config)
    if endpoints:
        cc.compile_ranges_endpoints = sorted(set(cc.compile_ranges_endpoints or []) | set(endpoints))


def _start_depyf() -> None:
    """Dump compiled code and graphs with depyf in this process, when asked.

    Each process dumps into its own subdirectory; vLLM's worker processes are
    killed at shutdown, so only what depyf writes while compiling is kept
    (transformed code, graphs, kernels), not its exit-time summaries.  depyf goes
    through vLLM's own compatibility layer where this vLLM has one, otherwise through
    :func:`fusion_pass.depyf_dump.dump`: never a failed compile.
    """
    global _depyf
    root = os.environ.get(DEPYF_DIR_ENV)
    if not root or _depyf is not None:
        return
    import multiprocessing

    from ..depyf_dump import dump
    from . import compat

    name = multiprocessing.current_process().name.replace("/", "_")
    _depyf = dump(os.path.join(root, f"{name}-pid{os.getpid()}"), compat.depyf_prepare_debug())
    _depyf.__enter__()
