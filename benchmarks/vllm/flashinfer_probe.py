"""Whether FlashInfer's all-reduce fusion, which vLLM's in-tree fusion calls on CUDA, can
run here, each step recorded with its time or its error:

1. ``import flashinfer.comm`` and the unified API vLLM 0.26 calls (``allreduce_fusion``,
   ``create_allreduce_fusion_workspace``);
2. its TRT-LLM communication module (``trtllm_comm``) loaded: a prebuilt one where the
   bundle of ``scripts/flashinfer_bundle.sh`` put it, else a JIT build (unless
   ``FLASHINFER_DISABLE_JIT`` is set);
3. one of that module's kernels run on the GPU: ``trtllm_lamport_initialize`` fills a
   buffer with -0.0, and every element is checked;
4. vLLM's own verdict: its in-tree pass's module keeps ``flashinfer_comm`` None unless
   FlashInfer imports and has what it calls.

    python benchmarks/vllm/flashinfer_probe.py OUT.json
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional


OUT: Optional[str] = None
"""Where the findings go; written after every step, so that a probe stopped by its time
limit still says how far it got."""


def write(result: dict[str, Any]) -> None:
    if OUT is not None:
        with open(OUT, "w") as f:
            json.dump(result, f, indent=1)


def step(result: dict[str, Any], name: str, fn: Callable[[], Any]) -> bool:
    start = time.perf_counter()
    result[name] = {"ok": False, "error": "did not finish (stopped by the time limit?)"}
    write(result)
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - the failure is the finding
        traceback.print_exc()
        result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        write(result)
        return False
    result[name] = {"ok": True, "seconds": round(time.perf_counter() - start, 2),
                    **({"value": value} if value is not None else {})}
    write(result)
    return True


def version(name: str) -> Any:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def probe() -> dict[str, Any]:
    try:
        pins = [r for r in importlib.metadata.requires("vllm") or [] if r.startswith("flashinfer")]
    except importlib.metadata.PackageNotFoundError:
        pins = []
    result: dict[str, Any] = {
        "versions": {n: version(n) for n in ("torch", "vllm", "flashinfer-python",
                                             "apache-tvm-ffi", "triton")},
        "vllm_requires": pins,
        "environment": {k: v for k, v in os.environ.items() if k.startswith("FLASHINFER_")}}

    def comm() -> dict[str, Any]:
        import flashinfer
        import flashinfer.comm as fc

        return {"from": os.path.dirname(flashinfer.__file__),
                "api": {n: hasattr(fc, n) for n in ("allreduce_fusion",
                                                    "create_allreduce_fusion_workspace")}}

    def module() -> dict[str, Any]:
        from flashinfer.comm.trtllm_ar import gen_trtllm_comm_module, get_trtllm_comm_module

        spec = gen_trtllm_comm_module()
        prebuilt = getattr(spec, "aot_path", None)
        get_trtllm_comm_module()
        return {"prebuilt": str(prebuilt) if prebuilt is not None else None,
                "prebuilt_exists": bool(prebuilt is not None and os.path.exists(prebuilt))}

    def kernel() -> dict[str, Any]:
        import torch
        from flashinfer.comm import trtllm_lamport_initialize

        buf = torch.ones(1 << 16, dtype=torch.bfloat16, device="cuda")
        trtllm_lamport_initialize(buf.data_ptr(), buf.numel(), buf.dtype)
        torch.cuda.synchronize()
        negative_zero = bool(((buf == 0) & torch.signbit(buf)).all())
        if not negative_zero:
            raise AssertionError("trtllm_lamport_initialize left elements other than -0.0")
        return {"device": torch.cuda.get_device_name(), "elements": buf.numel()}

    def vllm_sees() -> bool:
        m = importlib.import_module("vllm.compilation.passes.fusion.allreduce_rms_fusion")
        return getattr(m, "flashinfer_comm", None) is not None

    if step(result, "import_comm", comm) and step(result, "trtllm_comm_module", module):
        step(result, "kernel_runs", kernel)
    step(result, "vllm_in_tree_pass_has_flashinfer", vllm_sees)
    result["usable"] = all(result.get(k, {}).get("ok") for k in (
        "import_comm", "trtllm_comm_module", "kernel_runs")) and bool(
        result["vllm_in_tree_pass_has_flashinfer"].get("value"))
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    global OUT
    OUT = argv[0]
    result = probe()
    write(result)
    print("flashinfer: " + ", ".join(
        f"{k} {'ok' if v.get('ok') else 'FAILED: ' + v.get('error', '?')}"
        for k, v in result.items() if isinstance(v, dict) and "ok" in v))
    print(f"flashinfer: versions {result['versions']}; usable by vLLM's in-tree fusion: "
          f"{result['usable']}")
    return 0 if result["usable"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
