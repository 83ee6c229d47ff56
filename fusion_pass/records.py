"""What the pass decided, per compiled graph and per site.

Kept in memory (:data:`HISTORY`), logged once per graph, and, when the
environment variable ``FUSION_PASS_RECORD_DIR`` names a directory, appended as
JSON lines to ``<dir>/fusion_pass_records.rank<r>.jsonl`` so that the demo, the
CLI and notebooks can read decisions made in other processes.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from .log import logger

RECORD_DIR_ENV = "FUSION_PASS_RECORD_DIR"


@dataclass
class SiteRecord:
    collective: str
    norm: Optional[str]
    hidden: Optional[int]
    dtype: Optional[str]
    world_size: int
    tokens: str
    path: str
    reason: str
    backend: str
    group: str

    @property
    def fused(self) -> bool:
        return self.path != "unfused"


@dataclass
class GraphRecord:
    graph: int
    rank: int
    token_range: str
    sites: list[SiteRecord] = field(default_factory=list)

    @property
    def fused(self) -> int:
        return sum(s.fused for s in self.sites)

    def summary(self) -> str:
        paths: dict[str, int] = {}
        for s in self.sites:
            paths[s.path] = paths.get(s.path, 0) + 1
        detail = ", ".join(f"{k} x{v}" for k, v in sorted(paths.items()))
        return (f"fusion_pass: graph {self.graph} (rank {self.rank}, tokens {self.token_range}): "
                f"{len(self.sites)} all-reduce -> RMSNorm site(s), {self.fused} fused"
                + (f" ({detail})" if detail else ""))

    def to_json(self) -> dict:
        return asdict(self)


HISTORY: list[GraphRecord] = []


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:
        return 0


def new_graph_record(token_range: str) -> GraphRecord:
    return GraphRecord(graph=len(HISTORY), rank=_rank(), token_range=token_range)


def emit(record: GraphRecord) -> None:
    HISTORY.append(record)
    level = logging.INFO if record.sites else logging.DEBUG
    logger.log(level, record.summary())
    for s in record.sites:
        if not s.fused:
            logger.info("fusion_pass:   left unfused (%s -> %s, hidden %s %s): %s",
                        s.collective, s.norm, s.hidden, s.dtype, s.reason)
    out_dir = os.environ.get(RECORD_DIR_ENV)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"fusion_pass_records.rank{record.rank}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(record.to_json()) + "\n")


def read_dir(path: str) -> list[GraphRecord]:
    """Every record written under ``path`` (recursively), in file order."""
    out = []
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            if name.startswith("fusion_pass_records.") and name.endswith(".jsonl"):
                with open(os.path.join(root, name)) as f:
                    for line in f:
                        d = json.loads(line)
                        sites = [SiteRecord(**s) for s in d.pop("sites")]
                        out.append(GraphRecord(sites=sites, **d))
    return out
