"""A digest of the code that ran, for results written from a copy of the tree.

A copy's git metadata can name another commit than the files it holds (a copy made
with uncommitted changes, or with a stale ``.git``); the digest of the files
themselves settles which code ran.  ``python -m fusion_pass.testing.source_digest``
prints it for the current checkout, to compare with a result's ``source_digest``.
"""

from __future__ import annotations

import hashlib
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PARTS = ("fusion_pass", "benchmarks", "scripts")
"""The folders whose code a result depends on (tests and docs do not run in one)."""


def source_digest(root: str = ROOT) -> str:
    """sha256 over the relative path and bytes of every ``.py`` and ``.sh`` file under
    :data:`PARTS`, in sorted order; caches and byte code are not read."""
    h = hashlib.sha256()
    for part in PARTS:
        for folder, dirs, files in sorted(os.walk(os.path.join(root, part))):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            for name in sorted(files):
                if name.endswith((".py", ".sh")):
                    path = os.path.join(folder, name)
                    h.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as f:
                        h.update(f.read() + b"\0")
    return h.hexdigest()[:16]


if __name__ == "__main__":
    print(source_digest())
