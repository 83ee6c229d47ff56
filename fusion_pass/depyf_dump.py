"""depyf dumps of compiled graphs that never make a compile fail.

``depyf.prepare_debug`` replaces Inductor's ``PyCodeCache.load_by_key_path`` with a hook
that dumps each loaded module.  depyf 0.20.0 (the release vLLM 0.26-0.34 pin, and its last)
wrote that hook for ``(key, path, linemap, attrs)``; torch's Inductor also passes
``set_sys_modules`` (always from ``PyCodeCache.load``, and on more paths in torch 2.14, such
as the autotuning code block), and the hook's ``TypeError`` then fails the compile
("Failed to run autotuning code block").

:func:`dump` starts depyf in one of two ways:

* given vLLM's own entry point (``vllm.compilation.depyf_compat.prepare_debug``, vLLM 0.34+,
  which patches the hook for the installed torch), it uses that;
* otherwise plain ``depyf.prepare_debug``, and where depyf's hook does not take every
  argument the installed torch's ``load_by_key_path`` has, calls carrying those arguments go
  to Inductor's own function: those modules are not dumped, everything else is, and the log
  says so once.  Where depyf is missing or fails to start, the log says so and there is no
  dump.  Either way compiling goes on as without depyf.

This module imports neither depyf nor vLLM when imported.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any, Callable, Iterator, Optional

from .log import once


def _parameters(fn: Callable[..., Any]) -> Optional[set[str]]:
    """Names ``fn`` accepts; None when it takes any keyword (``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def _tolerate_new_arguments() -> Optional[list[str]]:
    """Inside ``depyf.prepare_debug``: route the calls depyf's hook cannot take to Inductor's
    own ``load_by_key_path``.  Returns the arguments it routes by (None: nothing to do)."""
    from depyf.explain.global_variables import data
    from torch._inductor.codecache import PyCodeCache

    hook = PyCodeCache.__dict__.get("load_by_key_path")
    unhooked = data.get("unpatched_load_by_key_path")
    if not inspect.isfunction(hook) or unhooked is None:  # depyf did not hook it
        return None
    accepted = _parameters(hook)
    if accepted is None:
        return None
    new = sorted(set(inspect.signature(unhooked).parameters) - accepted)
    if not new:
        return None

    def load_by_key_path(*args: Any, **kwargs: Any) -> Any:
        if any(k in kwargs for k in new):
            return unhooked(*args, **kwargs)
        return hook(*args, **kwargs)

    PyCodeCache.load_by_key_path = load_by_key_path  # depyf's exit puts the original back
    return new


@contextlib.contextmanager
def dump(dump_dir: str, prepare: Optional[Callable[[str], Any]] = None) -> Iterator[bool]:
    """Dump what torch.compile does inside the block into ``dump_dir`` with depyf.

    ``prepare``: a ``depyf.prepare_debug`` stand-in that already copes with this torch
    (vLLM's); None for depyf's own plus :func:`_tolerate_new_arguments`.  Yields whether
    depyf is dumping.
    """
    try:
        import depyf
        cm = (prepare or depyf.prepare_debug)(dump_dir)
        cm.__enter__()
    except Exception as e:  # depyf missing, or not working with this torch
        once(f"depyf:{dump_dir}", f"fusion_pass: no depyf dump in {dump_dir}: depyf does not "
             f"start ({type(e).__name__}: {e}); compiling goes on without it")
        yield False
        return
    try:
        if prepare is None:
            new = _tolerate_new_arguments()
            if new:
                once("depyf:new-arguments", "fusion_pass: depyf "
                     f"{getattr(depyf, '__version__', '')} does not take the "
                     f"{', '.join(new)} argument(s) this torch's Inductor passes when it loads "
                     "generated code; code loaded with them is left out of the dump in "
                     f"{dump_dir} (graphs and the rest are dumped; vLLM 0.34 and later patch "
                     "depyf for this)", logging.WARNING)
        yield True
    finally:
        cm.__exit__(None, None, None)
