"""What one probe found: a :class:`Finding`, and :func:`run`, which never lets a probe raise.

A finding has a status: ``ok`` (nothing in the way of the fusion), ``no`` (something is, and
``why`` says what), ``skip`` (does not apply here: no GPU, no vLLM, nothing named; ``why``
says why) or ``error`` (the probe itself raised: ``why`` is the exception).  Its ``text`` is
the one line a person reads; its ``data`` the fields the JSON form adds (docs/doctor.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

STATUSES = ("ok", "no", "skip", "error")


@dataclass
class Finding:
    status: str
    text: str
    why: Optional[str] = None
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def line(self) -> str:
        """The text a person reads: the answer, then why where it is not ok."""
        return self.text if self.ok or not self.why else f"{self.text}: {self.why}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "status": self.status}
        out.update(self.data)
        if not self.ok:
            out["why"] = self.why or self.text
        return out


def ok(text: str, **data: Any) -> Finding:
    return Finding("ok", text, None, data)


def no(text: str, why: str, **data: Any) -> Finding:
    return Finding("no", text, why, data)


def skip(text: str, why: str, **data: Any) -> Finding:
    return Finding("skip", text, why, data)


def run(label: str, probe: Callable[..., Finding], *args: Any) -> Finding:
    """``probe(*args)``, or an ``error`` finding naming what it raised: a doctor that
    fails must still say what it could."""
    try:
        found = probe(*args)
        if not isinstance(found, Finding):
            raise TypeError(f"the probe returned {type(found).__name__}, not a Finding")
        return found
    except Exception as e:  # any failure of a probe is one line of the report
        return Finding("error", label, f"the check failed: {type(e).__name__}: {e}",
                       {"error": type(e).__name__})
