"""What the probes are asked about (:class:`Query`) and the facts several of them read
(:class:`Context`): each fact is found once, and a fact that could not be found raises the
same error for every probe that reads it, so each says so on its own line."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

TOPOLOGY = "fusion_pass.topology"
"""The module that states the GPUs' facts (names, P2P, whether a group can map each other's
memory); imported when a probe first needs it."""


@dataclass(frozen=True)
class Query:
    """The model shape and parallelism asked about: ``tp`` None takes the visible GPUs
    (at least 2); ``arch`` a vLLM architecture name, or None."""

    hidden: int = 4096
    dtype: str = "bfloat16"
    tp: Optional[int] = None
    arch: Optional[str] = None


class Context:
    """The query, and the facts the probes share, each found on first use."""

    def __init__(self, query: Query) -> None:
        self.query = query
        self._facts: dict[str, tuple[bool, Any]] = {}

    def once(self, key: str, find: Callable[[], Any]) -> Any:
        """``find()``, found once: its value, or the error it raised, raised again."""
        if key not in self._facts:
            try:
                self._facts[key] = (True, find())
            except Exception as e:  # kept, and raised to every reader
                self._facts[key] = (False, e)
        found, value = self._facts[key]
        if not found:
            raise value
        return value

    def topology(self) -> Any:
        return self.once("topology", lambda: importlib.import_module(TOPOLOGY))

    def gpus(self) -> list[Any]:
        """The visible GPUs (``topology.gpus()``).  Without GPUs torch can see, the list is
        empty whether or not the topology module imports; with some, its import error is
        raised."""
        return self.once("gpus", self._find_gpus)

    def _find_gpus(self) -> list[Any]:
        try:
            topology = self.topology()
        except ImportError:
            if torch_gpu_count() == 0:
                return []
            raise
        return list(topology.gpus())

    def has_gpu(self) -> bool:
        """Whether there are GPUs: the topology's answer, else torch's."""
        try:
            return bool(self.gpus())
        except Exception:  # the GPU facts failed (their probes say why): torch's count
            return torch_gpu_count() > 0

    def gpu_indices(self) -> list[int]:
        try:
            return [int(g.index) for g in self.gpus()]
        except Exception:  # as in has_gpu
            return list(range(torch_gpu_count()))

    @property
    def tp(self) -> int:
        if self.query.tp is not None:
            return self.query.tp
        return max(2, len(self.gpu_indices()))

    def vllm(self) -> Any:
        """The vLLM package (its import error where it is installed but broken); None where
        it is not installed."""
        return self.once("vllm", _import_vllm)

    def compat(self) -> Any:
        """``fusion_pass.vllm_integration.compat`` (imports vLLM where it can)."""
        return self.once("compat", lambda: importlib.import_module(
            "fusion_pass.vllm_integration.compat"))

    def backend(self) -> tuple[str, str, Any]:
        """``(name, device type, backend)`` the fused op would use on this machine's device."""
        return self.once("backend", self._find_backend)

    def _find_backend(self) -> tuple[str, str, Any]:
        from ... import backends

        device = "cuda" if self.has_gpu() else "cpu"
        name = backends.selected_name(device)
        return name, device, backends.get(name)


def torch_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _import_vllm() -> Any:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    return importlib.import_module("vllm")
