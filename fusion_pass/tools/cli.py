"""``fusion-pass``: the demo, dump inspection, the gate's table, the environment check
and the kernels' self-test from a shell."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

# Each subcommand lives in its own module with ``main(argv) -> int``; it is
# imported only when used, so ``fusion-pass gate`` never imports vLLM.
COMMANDS = {
    "demo": ("fusion_pass.tools.demo", "run real vLLM (TP=2) with the fusion off and on"),
    "inspect": ("fusion_pass.tools.inspect_dumps", "summarise a depyf / vLLM graph dump directory"),
    "gate": ("fusion_pass.tools.gate_table", "print the gate's decision for shapes you name"),
    "doctor": ("fusion_pass.tools.doctor", "say whether the plugin will load and fuse on this machine"),
    "selftest": ("fusion_pass.tools.selftest", "prove the kernels on this GPU (simulated ranks)"),
}


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="fusion-pass", description=__doc__)
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's own arguments")
    ns = parser.parse_args(argv[:1])
    module = importlib.import_module(COMMANDS[ns.command][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
