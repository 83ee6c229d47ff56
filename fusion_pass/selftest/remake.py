"""The simulated-rank suite's cases of a group made again under its name (kind ``remake``).

A process that hosts engines in turn destroys its group and makes the next one
under the same c10d name, of another size or of the same size with new
communicators, and keeps its backend objects.  A case here runs a call on the
simulated group (:mod:`.sim_group`), remakes the group (``remake``: the ranks
that stay keep their backends and buffer providers; new buffers, so new peer
tables), runs a call again, and so on through its ``sizes``, ending at the
size it started with.  After every call each rank's objects must keep nothing
of a group that ended (:func:`.sim_group.kept`): no plan, decline or wait
bound of it, plans of the live group's size only, buffers of the live group
only, with peer tables none of which the ranks had before the remake; and the
outputs are judged as :func:`.suite.run_call` judges them.

:func:`cases` and :func:`run_remake` follow :mod:`.suite`'s contract for a
kind of case (its ``cases`` groups and ``RUNNERS``).
"""

from __future__ import annotations

from typing import Any

from ..gate import Path

ONE, TWO = Path.ONE_STAGE.value, Path.TWO_STAGE.value


def other_size(world: int) -> int:
    """A group size to remake a group of ``world`` ranks with: another one the
    backend's limits take (2 and 4 trade places, 8 goes to 4)."""
    from ..backends.triton_symm import LIMITS

    others = sorted(w for w in LIMITS.world_sizes if w != world)
    return 4 if world != 4 and 4 in others else others[0]


def cases(form: str, world: int) -> list[dict]:
    """The remake cases of a group of ``world`` ranks (``form``: ``gpu`` or
    ``interpret``), each with its ``id`` and ``world``: the group remade with
    another size and back (one-stage calls), and with the same size (two-stage)."""
    from .suite import _call

    gpu = form == "gpu"
    dtype, hidden, tokens = ("bfloat16", 4096, 8) if gpu else ("float16", 256, 3)
    out = [dict(_call(ONE, dtype, hidden, tokens, 9500), kind="remake",
                sizes=[world, other_size(world), world]),
           dict(_call(TWO, dtype, hidden, tokens + 2, 9510), kind="remake",
                sizes=[world, world])]
    for i, c in enumerate(out):
        c.update(id=f"n{world}-remake-{i}", world=world, calls=1)
    return out


def state_problems(size: int, states: list[dict[str, Any]],
                   tables_before: list[tuple[Any, list[int]]]) -> list[str]:
    """What a group of ``size`` ranks keeps that it must not, rank by rank
    (``states``: :func:`.sim_group.kept` of each; ``tables_before``: every
    ``(provider, peer table)`` the ranks had before the group was made)."""
    problems = []
    if len(states) != size:
        problems.append(f"{len(states)} ranks answered, not {size}")
    for rank, st in enumerate(states):
        where = f"rank {rank} of {size}"
        if st["plans_of_ended"] or st["timeouts_of_ended"]:
            problems.append(f"{where} keeps {st['plans_of_ended']} plans and "
                            f"{st['timeouts_of_ended']} wait bounds of an ended group")
        if any(ended or n != size for _, n, ended in st["groups"]):
            problems.append(f"{where} keeps state of other groups: {st['groups']}")
        if st["plans"] == 0 or st["plan_worlds"] != [size]:
            problems.append(f"{where}: {st['plans']} plans, of world sizes {st['plan_worlds']}")
        if not st["provider_serves_group"] or st["buffer_worlds"] != [size]:
            problems.append(f"{where}: buffers of world sizes {st['buffer_worlds']}, for "
                            f"{'the' if st['provider_serves_group'] else 'another'} group")
        for table in st["tables"]:
            if len(table) != size:
                problems.append(f"{where}: a peer table of {len(table)} addresses")
            if (st["provider"], table) in tables_before:
                problems.append(f"{where}: a peer table of the group before the remake")
    return problems


def run_remake(group: Any, case: dict, interpreted: bool) -> dict:
    """The group at each of ``case["sizes"]`` in turn, remade between them: a call
    of the case's shape at each, judged; each rank's state checked after each
    (:func:`state_problems`).  The group ends at the size it had."""
    from .suite import Inputs, _layouts, _merge, announce, judge

    sizes = case["sizes"]
    judged: list[dict] = []
    problems: list[str] = []
    layouts: list[dict] = []
    seen_tables: list[tuple[Any, list[int]]] = []
    states: list[list[dict]] = []
    if group.world != sizes[0]:
        group.remake(sizes[0])
    for i, size in enumerate(sizes):
        before = group.inspect()
        seen_tables += [(st["provider"], t) for st in before for t in st["tables"]]
        if i:
            group.remake(size)
        inputs = Inputs(group, case, case["seed"] * 16 + i)
        prepared = group.prepare(inputs.calls)
        lay = _layouts(group, prepared[0])
        layouts.append(lay[0])
        if i == 0:
            announce(case["id"], dict(layout=lay[0], sizes=sizes))
        outs = group.launch(inputs.calls)
        error = group.finish()
        judged.append(judge(inputs, outs, interpreted))
        if error:
            problems.append(f"at {size} ranks: {error}")
        now = group.inspect()
        states.append(now)
        problems += [f"after remake {i} to {size} ranks: {p}" if i else p
                     for p in state_problems(size, now, seen_tables if i else [])]
    result = _merge(judged)
    result["problems"] += problems
    result.update(layout=layouts[0], layouts=layouts, sizes=sizes,
                  cap=getattr(group, "cap", None),
                  kept=[{k: st[k] for k in ("groups", "plans", "plan_worlds", "buffer_worlds",
                                            "ended_buffers", "generation")}
                        for st in states[-1]])
    return result
