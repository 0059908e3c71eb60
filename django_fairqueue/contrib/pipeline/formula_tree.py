"""The formula language's types and its checked tree.

The kinds of source and sink columns, the types of formula values, and :class:`Node`: the
typed tree a formula becomes once checked. Every stage of the language reads them: the
function catalog (:mod:`.formula_catalog`), the checks (:mod:`.formula_check`), the rule sets
(:mod:`.formulas`) and the compiler (:mod:`.compile`), so they sit here, below all of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

#: Kinds of source and sink columns (from their PostgreSQL types; see execute.py).
INT, FLOAT, DECIMAL, STR, BOOL, DATE, NULL = (
    "int",
    "float",
    "decimal",
    "str",
    "bool",
    "date",
    "null",
)
NUMERIC_KINDS = (INT, FLOAT, DECIMAL)

#: Types of formula values.
NUMBER, TEXT, BOOLEAN, DATE_T, BLANK = "number", "text", "boolean", "date", "blank"
#: A date and time of day (what NOW() gives), in the pipeline's time zone, without the zone.
DATETIME = "datetime"
KIND_TYPE = {INT: NUMBER, FLOAT: NUMBER, DECIMAL: NUMBER, STR: TEXT, BOOL: BOOLEAN, DATE: DATE_T}


class Invalid(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Typed tree


@dataclass(frozen=True)
class Node:
    """A checked expression: ``op`` with typed ``args``.

    ``op``: ``const`` (``value``), ``col`` (a source column), ``ref`` (another rule),
    ``agg`` (a tenant aggregate: ``value`` is the function, ``args`` its argument then the
    ``BY`` expressions), ``case`` (condition, value, ..., [default]), ``cast`` (``value``: the
    target type), or an operator or function name (``+``, ``=``, ``and``, ``concat``, ``IF``, ...).
    ``fallible``: whether evaluating it (or a part of it) can give an error value.
    """

    op: str
    type: str
    args: tuple[Node, ...] = ()
    value: Any = None
    fallible: bool = False

    def key(self) -> str:
        """A canonical text of the tree (equal trees, equal keys)."""
        return json.dumps(_plain(self), separators=(",", ":"), default=str)

    def walk(self) -> Iterator[Node]:
        """This node and every node below it (depth first, without recursion: chains of rules
        nest deep)."""
        stack = [self]
        while stack:
            item = stack.pop()
            stack.extend(item.args)
            yield item


def _plain(node: Node) -> Any:
    return [node.op, node.type, node.value, [_plain(a) for a in node.args]]


def make_node(op: str, type_: str, args: Sequence[Node] = (), value: Any = None,
          fallible: bool = False) -> Node:  # fmt: skip
    return Node(op, type_, tuple(args), value, fallible or any(a.fallible for a in args))


def constant_number(node: Node) -> float | None:
    """The value of a number constant (``2``, ``-2``), else None."""
    if node.op == "neg":
        inner = constant_number(node.args[0])
        return None if inner is None else -inner
    if node.op == "const" and node.type == NUMBER:
        return float(node.value)
    return None
