"""Small FX predicates shared by the pattern matchers."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import fx

aten = torch.ops.aten
prims = torch.ops.prims


def is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def val(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor FX recorded for ``node``, or None."""
    if not isinstance(node, fx.Node):
        return None
    v = node.meta.get("val")
    return v if isinstance(v, torch.Tensor) else None


def dtype_of(node: Any) -> Optional[torch.dtype]:
    v = val(node)
    return None if v is None else v.dtype


def cast_target(node: fx.Node) -> Optional[torch.dtype]:
    """The dtype ``node`` converts to, if it is a pure dtype cast."""
    if is_call(node, prims.convert_element_type.default):
        return node.args[1]
    if is_call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"}:
        return node.kwargs.get("dtype")
    return None


def other_operand(mul: fx.Node, known: fx.Node) -> Optional[Any]:
    """For a binary op with ``known`` as one operand, the other one."""
    if len(mul.args) != 2 or mul.kwargs:
        return None
    a, b = mul.args
    if a is known:
        return b
    if b is known:
        return a
    return None


FUNCTIONALIZED = (torch.ops.higher_order.auto_functionalized,
                  torch.ops.higher_order.auto_functionalized_v2)
"""How a mutating op (vLLM's quant and fused ops, FlashInfer's) appears in a
post-grad graph: vLLM compiles with v1, torch's default is v2."""


def op_name(node: fx.Node) -> str:
    """The schema name (``ns::op``) a call node runs, seen through functionalization."""
    if node.op != "call_function":
        return ""
    target: Any = node.target
    if target in FUNCTIONALIZED and node.args:
        target = node.args[0]
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else ""


def mutated_index(schema: torch.FunctionSchema, name: str) -> Optional[int]:
    """Index of the mutated argument ``name`` in auto_functionalized's (v1) outputs:
    the op's own outputs (one ``None`` slot when it returns nothing), then the
    mutated arguments in schema order."""
    first = len(schema.returns) if len(schema.returns) > 1 else 1
    mutated = [a.name for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    return first + mutated.index(name) if name in mutated else None
