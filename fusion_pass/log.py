"""One logger for the package, and a "say it once" helper for fallbacks."""

from __future__ import annotations

import logging

logger = logging.getLogger("fusion_pass")

_said: set[str] = set()


def once(key: str, msg: str, level: int = logging.WARNING) -> bool:
    """Log ``msg`` the first time ``key`` is seen in this process; True if logged."""
    if key in _said:
        return False
    _said.add(key)
    logger.log(level, msg)
    return True
