"""Environment variables set for a block and restored after it."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def patched(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` inside the block; restore what was there after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
