"""Tenant formulas: a spreadsheet-like language, parsed and type-checked before any job starts.

A formula is ``name = expression`` (an expression may start with ``=``, as in a spreadsheet
cell): ``total = IF(qty > 0, price * qty, 0)``, ``label = UPPER(LEFT(city, 3)) & "-" & id``,
``share = total / SUM(total BY region)``. The grammar is an LALR grammar run by `lark
<https://github.com/lark-parser/lark>`_ (no recursion while parsing, so no input can exhaust
Python's stack); this module checks the depth and size of lark's tree, :mod:`.formula_check`
turns it into a small typed tree (:class:`~.formula_tree.Node`), checking every name, function
(:mod:`.formula_catalog`), argument count and type, and this module puts a tenant's rules in
the order they use each other. No Spark session is needed for any of it: :mod:`.compile`
turns a checked tree into Spark SQL expression text in which the tenant's names and constants
are data, never SQL.

Types: number, text, boolean, date, and the blank (``NULL``/a missing value). Errors (a
division by zero, ``SQRT(-1)``, ``VALUE("abc")``, ...) are values, as in a spreadsheet: the
cell is empty and the rule's error count goes up; they never fail a batch.

This module needs neither Django's app registry nor PySpark.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from django_fairqueue.contrib.pipeline.formula_catalog import DEFAULT_FUNCTIONS, FUNCTIONS
from django_fairqueue.contrib.pipeline.formula_check import Builder
from django_fairqueue.contrib.pipeline.formula_tree import KIND_TYPE, Invalid, Node

#: Limits, checked before anything recursive runs.
MAX_FORMULA_LENGTH = 8192  # characters of one expression (a spreadsheet cell's limit)
MAX_DEPTH = 64  # nesting of one expression (a spreadsheet's function nesting limit)
MAX_NODES = 2000  # operators, calls, names and constants in one expression
MAX_RULES = 2000  # formulas of one tenant
MAX_TOTAL_NODES = 200_000  # over all of a tenant's formulas
MAX_CHAIN_DEPTH = 400  # nesting once each rule's references to other rules are counted
RESERVED_PREFIX = "__fq_"  # the columns the compiled formulas add (errors, aggregates)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_TARGET = re.compile(r"^\s*`?([A-Za-z_][A-Za-z0-9_]*)`?\s*=(?!=)\s*(.*)$", re.DOTALL)


class FormulaError(ValueError):
    """A tenant's formula is invalid; the message names the tenant and the formula."""

    def __init__(self, tenant: str, formula: str, reason: str) -> None:
        self.tenant = tenant
        self.formula = formula
        self.reason = reason
        if formula:
            super().__init__(f"tenant {tenant!r}: invalid formula {formula!r}: {reason}")
        else:  # about the tenant's formulas as a whole (none, too many, unreadable)
            super().__init__(f"tenant {tenant!r}: {reason}")


# --------------------------------------------------------------------------------------------
# Grammar

GRAMMAR = r"""
?start: expr
?expr: or_expr
?or_expr: and_expr | or_expr OR and_expr -> or_op
?and_expr: not_expr | and_expr AND not_expr -> and_op
?not_expr: comparison | NOT not_expr -> not_op
?comparison: concat
    | concat CMP concat -> compare
    | concat IS NULL -> is_null
    | concat IS NOT NULL -> is_not_null
    | concat BETWEEN concat AND concat -> between
    | concat NOT BETWEEN concat AND concat -> not_between
    | concat IN "(" expr ("," expr)* ")" -> in_list
    | concat NOT IN "(" expr ("," expr)* ")" -> not_in_list
?concat: sum | concat "&" sum -> concat
?sum: product | sum ADDOP product -> arith
?product: power | product MULOP power -> arith
?power: unary | power POWOP unary -> arith
?unary: atom | ADDOP unary -> unary
?atom: NUMBER -> number
    | PERCENT -> percent
    | STRING -> string
    | TRUE -> true
    | FALSE -> false
    | NULL -> null
    | NAME -> name
    | QUOTED -> name
    | NAME "(" [args] [by] ")" -> call
    | CASE (WHEN expr THEN expr)+ [ELSE expr] END -> case
    | CAST "(" expr AS NAME ["(" NUMBER ["," NUMBER] ")"] ")" -> cast
    | "(" expr ")"
args: expr ("," expr)*
by: BY expr ("," expr)*
CMP: "<=" | ">=" | "<>" | "!=" | "==" | "=" | "<" | ">"
ADDOP: "+" | "-"
MULOP: "*" | "/" | "%"
POWOP: "^"
OR: "OR"i
AND: "AND"i
NOT: "NOT"i
IS: "IS"i
NULL: "NULL"i
BETWEEN: "BETWEEN"i
IN: "IN"i
TRUE: "TRUE"i
FALSE: "FALSE"i
CASE: "CASE"i
WHEN: "WHEN"i
THEN: "THEN"i
ELSE: "ELSE"i
END: "END"i
CAST: "CAST"i
AS: "AS"i
BY: "BY"i
NAME: /[A-Za-z_][A-Za-z0-9_]*/i
QUOTED: /`(?:[^`]|``)+`/
NUMBER: /(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?/
PERCENT.2: /(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?%(?!\s*[A-Za-z0-9_.(`"'])/
STRING: /"(?:[^"]|"")*"/ | /'(?:[^']|'')*'/
%ignore /[ \t\r\n]+/
"""


@cache
def _parser() -> Any:
    try:
        from lark import Lark
    except ImportError:
        raise ImportError(
            "the pipeline's formulas need lark: pip install 'django-fairqueue[pipeline]'"
        ) from None

    return Lark(GRAMMAR, parser="lalr", lexer="contextual", maybe_placeholders=True)


# --------------------------------------------------------------------------------------------
# From lark's tree to a checked Node


def _depth_and_size(tree: Any) -> tuple[int, int]:
    """Nesting depth and node count of a lark tree, without recursion."""
    from lark import Tree

    deepest, count = 0, 0
    stack: list[tuple[Any, int]] = [(tree, 1)]
    while stack:
        item, depth = stack.pop()
        count += 1
        deepest = max(deepest, depth)
        if isinstance(item, Tree):
            stack.extend((child, depth + 1) for child in item.children if child is not None)
    return deepest, count


def _expression_depth(tree: Any) -> int:
    """Nesting counted as a reader counts it: operators and calls, not lark's helper rules."""
    from lark import Tree

    deepest = 0
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, Tree):
            continue
        here = depth if item.data in ("args", "by") else depth + 1
        deepest = max(deepest, here)
        stack.extend((child, here) for child in item.children if child is not None)
    return deepest


def parse_expression(
    text: str,
    *,
    columns: Mapping[str, str],
    rules: Mapping[str, Node] | None = None,
    functions: Iterable[str] | None = None,
) -> Node:
    """Parse and check one expression; raises ``ValueError`` (the reason) if invalid.

    ``columns``: source column -> kind (``int``, ``float``, ``str``, ...) or value type.
    """
    try:
        return _parse(text, _value_types(columns), dict(rules or {}), _allowed(functions))
    except Invalid as exc:
        raise ValueError(str(exc)) from None


def _value_types(columns: Mapping[str, str]) -> dict[str, str]:
    return {name: KIND_TYPE.get(kind, kind) for name, kind in columns.items()}


def _allowed(functions: Iterable[str] | None) -> frozenset[str]:
    if functions is None:
        return DEFAULT_FUNCTIONS
    names = frozenset(str(f).upper() for f in functions)
    unknown = sorted(names - set(FUNCTIONS))
    if unknown:
        raise ValueError(f"unknown functions {unknown}; the language has {sorted(FUNCTIONS)}")
    return names


def _parse(
    text: str, columns: Mapping[str, str], rules: Mapping[str, Node], functions: frozenset[str]
) -> Node:
    return Builder(columns, rules, functions).build(_syntax_tree(text))


def _syntax_tree(text: str) -> Any:
    """lark's tree of an expression, its depth and size checked."""
    from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedEOF, UnexpectedToken

    body = text.strip()
    if body.startswith("=") and not body.startswith("=="):
        body = body[1:].lstrip()
    if not body:
        raise Invalid("the expression is empty")
    if len(body) > MAX_FORMULA_LENGTH:
        raise Invalid(f"longer than {MAX_FORMULA_LENGTH} characters")
    try:
        tree = _parser().parse(body)
    except UnexpectedCharacters as exc:
        pos: int = getattr(exc, "pos_in_stream", 0) or 0
        raise Invalid(f"unexpected character {body[pos]!r} at position {pos + 1}") from None
    except UnexpectedEOF:
        raise Invalid("the expression ends too early") from None
    except UnexpectedToken as exc:
        if exc.token.type == "$END":
            raise Invalid("the expression ends too early") from None
        raise Invalid(f"unexpected {exc.token!s} at position {exc.column}") from None
    except LarkError as exc:  # anything else lark reports: still a clear error
        raise Invalid(str(exc).strip().splitlines()[0]) from None
    depth = _expression_depth(tree)
    if depth > MAX_DEPTH:
        raise Invalid(
            f"nested {depth} levels deep; at most {MAX_DEPTH} are allowed (each operator of a "
            "chain such as a + b + c is a level: write SUM(a, b, c), CONCAT(a, b, c), "
            "AND(a, b, c) or OR(a, b, c), which are one)"
        )
    _, size = _depth_and_size(tree)
    if size > MAX_NODES * 3:
        raise Invalid(f"too large: at most {MAX_NODES} operators, names and constants")
    return tree


def _names_used(tree: Any) -> set[str]:
    """The names an expression's tree reads (columns and rules; not function names)."""
    from lark import Token, Tree

    found: set[str] = set()
    stack = [tree]
    while stack:
        item = stack.pop()
        if not isinstance(item, Tree):
            continue
        if item.data == "name":
            name = str(item.children[0])
            found.add(name[1:-1].replace("``", "`") if name.startswith("`") else name)
            continue
        stack.extend(c for c in item.children if isinstance(c, Tree | Token) or c is not None)
    return found


class Cycle(ValueError):
    """Rules that use each other in a circle (``members``: the circle, first one last too)."""

    def __init__(self, members: list[str]) -> None:
        self.members = members
        if len(members) == 2:
            super().__init__(f"{members[0]!r} uses itself")
        else:
            super().__init__("a cycle: " + " -> ".join(members) + " (each uses the next)")


def dependency_order(uses: Mapping[str, set[str]]) -> list[str]:
    """The rules in an order in which each comes after the rules it uses, as written where
    that allows; :class:`Cycle` naming the members of a cycle."""
    import heapq

    position = {name: i for i, name in enumerate(uses)}
    waiting = {name: {u for u in used if u in uses} for name, used in uses.items()}
    users: dict[str, list[str]] = {name: [] for name in uses}
    for name, used in waiting.items():
        for u in used:
            users[u].append(name)
    ready = [position[name] for name, used in waiting.items() if not used]
    heapq.heapify(ready)
    names = list(uses)
    order: list[str] = []
    while ready:
        name = names[heapq.heappop(ready)]
        order.append(name)
        for user in users[name]:
            waiting[user].discard(name)
            if not waiting[user]:
                heapq.heappush(ready, position[user])
    if len(order) < len(names):
        raise Cycle(_cycle({n: u for n, u in waiting.items() if u}))
    return order


def _cycle(waiting: Mapping[str, set[str]]) -> list[str]:
    """A cycle among rules that still wait on each other: ``[a, b, a]``."""
    start = min(waiting, key=list(waiting).index)
    path = [start]
    seen = {start: 0}
    while True:
        following = sorted(waiting[path[-1]], key=list(waiting).index)[0]
        if following in seen:
            return [*path[seen[following] :], following]
        seen[following] = len(path)
        path.append(following)


# --------------------------------------------------------------------------------------------
# Formula sets


@dataclass(frozen=True)
class Formula:
    """One checked formula: ``target = expression``."""

    target: str
    source: str  # the expression as written
    tree: Node
    kind: str  # the value type

    @property
    def text(self) -> str:
        return f"{self.target} = {self.source}"

    @property
    def intermediate(self) -> bool:
        """A name starting with ``_``: usable by later formulas, not written to the sink."""
        return self.target.startswith("_")

    @property
    def uses_aggregate(self) -> bool:
        return _uses_aggregate(self.tree, {})


def _uses_aggregate(node: Node, memo: dict[str, bool]) -> bool:
    return any(
        item.op == "agg" or (item.op == "ref" and memo.get(item.value, False))
        for item in node.walk()
    )


def split_formulas(raw: Any) -> list[tuple[str, str]]:
    """``(target, expression)`` pairs from what a formula lookup returned.

    Accepted: a mapping ``{target: expression}``, or an iterable of ``"target = expression"``
    strings or ``(target, expression)`` pairs.
    """
    if isinstance(raw, Mapping):
        return [(str(target), str(expression)) for target, expression in raw.items()]
    if isinstance(raw, str):
        raw = [raw]
    pairs: list[tuple[str, str]] = []
    for item in raw:
        if isinstance(item, str):
            match = _TARGET.match(item)
            if match is None:
                pairs.append(("", item))  # reported by parse_formulas with the tenant
            else:
                pairs.append((match.group(1), match.group(2)))
        else:
            target, expression = item
            pairs.append((str(target), str(expression)))
    return pairs


def version_of(pairs: Sequence[tuple[str, str]]) -> str:
    """The content hash of a formula set (16 hex digits): equal formulas, equal version."""
    text = json.dumps([[t, e.strip()] for t, e in pairs], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FormulaSet:
    """A tenant's checked formulas, in dependency order (each after the ones it uses)."""

    tenant: str
    formulas: tuple[Formula, ...]
    version: str = ""
    aggregates: tuple[Node, ...] = field(default=())  # distinct tenant aggregates, in order
    #: The formulas as written (``formulas`` is in dependency order): what a job pins.
    written: tuple[tuple[str, str], ...] = ()

    def targets(self) -> list[str]:
        return [f.target for f in self.formulas]

    def outputs(self) -> list[Formula]:
        """The formulas whose results are written (not the ``_``-named intermediates)."""
        return [f for f in self.formulas if not f.intermediate]

    def pairs(self) -> list[tuple[str, str]]:
        """The formulas as written, in the order written (their version's order)."""
        return list(self.written) or [(f.target, f.source) for f in self.formulas]


@dataclass(frozen=True)
class LookupTable:
    """What formulas may read of a lookup table: its key and columns (key first), typed."""

    key: str
    columns: Mapping[str, str]  # column -> value type or kind


def parse_formulas(
    tenant: str,
    raw: Any,
    *,
    columns: Mapping[str, str],
    targets: Iterable[str] | None,
    functions: Iterable[str] | None = None,
    lookups: Mapping[str, LookupTable] | None = None,
) -> FormulaSet:
    """Parse and check a tenant's formulas against the source ``columns`` (name -> kind).

    ``targets``: the names a formula may define (a typed sink's columns), or None for any
    name (a JSON results sink). Names starting with ``_`` are intermediate results, always
    allowed. Raises :class:`FormulaError` for the first invalid formula.
    """
    allowed_targets = None if targets is None else set(targets)
    try:
        allowed = _allowed(functions)
    except ValueError as exc:
        raise FormulaError(tenant, "", str(exc)) from None
    known = _value_types(columns)
    rules: dict[str, Node] = {}
    aggregated: dict[str, bool] = {}
    parsed: list[Formula] = []
    try:
        pairs = split_formulas(raw)
    except (TypeError, ValueError) as exc:
        raise FormulaError(tenant, repr(raw)[:200], f"cannot read the formulas: {exc}") from None
    if not pairs:
        raise FormulaError(tenant, "", "the tenant has no formulas")
    if len(pairs) > MAX_RULES:
        raise FormulaError(tenant, "", f"{len(pairs)} formulas; at most {MAX_RULES} per tenant")
    total = 0
    chain: dict[str, int] = {}
    aggregates: dict[str, Node] = {}
    written: dict[str, tuple[str, str, Any]] = {}  # target -> (expression, shown, syntax tree)
    tables = {
        name: LookupTable(table.key, _value_types(table.columns))
        for name, table in (lookups or {}).items()
    }
    for target, expression in pairs:
        text = f"{target} = {expression}" if target else expression
        shown = text if len(text) <= 200 else text[:200] + "..."
        if not target:
            raise FormulaError(tenant, shown, "a formula reads `name = expression`")
        if not _NAME.match(target):
            raise FormulaError(tenant, shown, "a name starts with a letter or _, then letters, "
                               "digits and _ (at most 63 in all)")  # fmt: skip
        if (
            allowed_targets is not None
            and not target.startswith("_")
            and target not in allowed_targets
        ):
            raise FormulaError(
                tenant,
                shown,
                f"{target!r} is not a column of the sink (sink columns: "
                f"{', '.join(sorted(allowed_targets))})",
            )
        if target.startswith(RESERVED_PREFIX):
            raise FormulaError(tenant, shown, f"names starting with {RESERVED_PREFIX} are the "
                               "pipeline's own columns")  # fmt: skip
        if target in written:
            raise FormulaError(tenant, shown, f"{target!r} is defined twice")
        if target in known:
            raise FormulaError(tenant, shown, f"{target!r} is a source column's name")
        try:
            written[target] = (expression, shown, _syntax_tree(expression))
        except Invalid as exc:
            raise FormulaError(tenant, shown, str(exc)) from None
    # As in a spreadsheet, a rule may use rules written after it: compute in dependency order.
    try:
        order = dependency_order({t: _names_used(w[2]) for t, w in written.items()})
    except Cycle as exc:
        raise FormulaError(tenant, written[exc.members[0]][1], str(exc)) from None
    for target in order:
        expression, shown, syntax = written[target]
        try:
            builder_rules = {
                name: (node if not aggregated[name] else _mark_aggregate(node))
                for name, node in rules.items()
            }
            tree = Builder(known, builder_rules, allowed, tables).build(syntax)
        except Invalid as exc:
            raise FormulaError(tenant, shown, str(exc)) from None
        size, depth = _tree_size_and_chain(tree, chain)
        total += size
        if total > MAX_TOTAL_NODES:
            raise FormulaError(tenant, shown, f"the formulas are too large together: at most "
                               f"{MAX_TOTAL_NODES} operators, names and constants")  # fmt: skip
        if depth > MAX_CHAIN_DEPTH:
            raise FormulaError(
                tenant,
                shown,
                f"nested {depth} levels deep counting the formulas it uses; at most "
                f"{MAX_CHAIN_DEPTH} are allowed",
            )
        chain[target] = depth
        rules[target] = tree
        aggregated[target] = _uses_aggregate(tree, aggregated)
        for node in _aggregate_nodes(tree):
            aggregates.setdefault(node.key(), node)
        parsed.append(Formula(target=target, source=expression.strip(), tree=tree, kind=tree.type))
    return FormulaSet(
        tenant=tenant,
        formulas=tuple(parsed),
        version=version_of(pairs),
        aggregates=tuple(aggregates.values()),
        written=tuple((t, e.strip()) for t, e in pairs),
    )


def _mark_aggregate(node: Node) -> Node:
    """A stand-in for a rule that uses an aggregate: the builder refuses it in an aggregate."""
    return Node("agg", node.type, (), "ref", node.fallible)


def _aggregate_nodes(tree: Node) -> list[Node]:
    found: list[Node] = []
    stack = [tree]
    while stack:
        item = stack.pop()
        if item.op == "agg":
            found.append(item)
            continue  # no aggregate inside an aggregate
        stack.extend(item.args)
    return found


def _tree_size_and_chain(tree: Node, chain: Mapping[str, int]) -> tuple[int, int]:
    """Node count, and depth counting each referenced rule's own depth."""
    size, deepest = 0, 0
    stack: list[tuple[Node, int]] = [(tree, 1)]
    while stack:
        item, depth = stack.pop()
        size += 1
        if item.op == "ref":
            depth += chain.get(item.value, 0)
        deepest = max(deepest, depth)
        stack.extend((arg, depth + 1) for arg in item.args)
    return size, deepest
