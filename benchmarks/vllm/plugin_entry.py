"""The plugin's vLLM entry point for a checkout that is not pip-installed.

vLLM loads plugins through the ``vllm.general_plugins`` entry points in every process it
starts (its OpenAI server, engine core and workers); the plugin publishes the pass under
the name JSON configs use (``fusion_pass.vllm_fusion_pass``) when it loads.  A checkout on
``PYTHONPATH`` has no entry point: this writes a minimal distribution record with the one
in ``pyproject.toml`` into a folder, to put on ``PYTHONPATH`` beside the checkout.

    python benchmarks/vllm/plugin_entry.py DIR   # prints DIR if it wrote the record there,
                                            # nothing if vLLM already finds the plugin
"""

from __future__ import annotations

import importlib.metadata
import sys
import tomllib
from pathlib import Path

GROUP = "vllm.general_plugins"
ROOT = Path(__file__).resolve().parents[2]


def installed() -> bool:
    """Whether an installed distribution gives vLLM the plugin's entry point."""
    return any(ep.value.startswith("fusion_pass.")
               for ep in importlib.metadata.entry_points(group=GROUP))


def write(dest: Path) -> Path:
    """``dest/fusion_pass-<version>.dist-info`` with the project's name, version and
    vLLM entry points, as ``pyproject.toml`` states them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = dest / f"{project['name']}-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\n"
                                   f"Version: {project['version']}\n")
    entries = project["entry-points"][GROUP]
    (info / "entry_points.txt").write_text(
        f"[{GROUP}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
    return dest


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    if not installed():
        print(write(Path(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
