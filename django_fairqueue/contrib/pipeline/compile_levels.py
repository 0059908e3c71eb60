"""Phase two: a tenant's rules as Spark projections over its rows, in levels (each rule
after the rules it uses), with an error column for each rule that can have errors; and the
check, when a job is planned, that every phase of its formulas compiles
(:func:`check_compiles`).

:mod:`.compile` turns each rule into text; this module decides which projection each text goes
in and hands them to Spark, one ``selectExpr`` a level (:func:`apply_formulas`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django_fairqueue.contrib.pipeline.compile import (
    AGG_PREFIX,
    MAX_EXPRESSION_CHARS,
    Compiler,
    Pair,
    TooLong,
    lookup_name,
)
from django_fairqueue.contrib.pipeline.compile_joins import aggregate_plan, lookup_shapes
from django_fairqueue.contrib.pipeline.formula_tree import NUMBER, Node
from django_fairqueue.contrib.pipeline.formulas import FormulaError, FormulaSet
from django_fairqueue.contrib.pipeline.sqlexpr import (
    SQL_FALSE,
    Expr,
    bad_number,
    coalesce,
    either,
    not_,
    quoted,
    when,
)

ERROR_PREFIX = "__fq_err_"
#: A last-level rule's value and error before blanking (:class:`Level`).
RAW_PREFIX = "__fq_raw_"


@dataclass(frozen=True)
class Output:
    """A rule written to the sink: its column, and its error column if it can have errors."""

    name: str
    type: str
    error_column: str | None


@dataclass
class Level:
    """Rules computed side by side, in one projection: ``computed`` holds each rule's value
    (blank where an error) and, for a rule that can have errors, its error column. Such a
    rule's value text holds its error text, and its error text a number's value (an overflow
    is an error): Spark evaluates a repeated subexpression once per row (its subexpression
    elimination), while a second projection per level, reading the first's columns by name,
    doubled the plan's depth, and Spark's planning cost grows with the square of it (its
    planner walks the stack of projections below each one): 250 rules with chains 20 deep
    took minutes of the driver's CPU that way.

    The last level (the rules no rule uses, most of a tenant's) is the exception: one more
    projection on top of a stack costs little, while writing each value there three times
    (as the value, inside its error, inside the blanked value) made that level three times
    the text Spark parses, analyses, optimises and generates code for. There ``computed``
    holds each such rule's raw value and raw error (:data:`RAW_PREFIX` names), and
    ``finish``, a projection over them, the rule's error column and blanked value, reading
    the raw ones by name."""

    computed: dict[str, Expr]
    finish: dict[str, Expr] = field(default_factory=dict)


def packed_flags(flags: Sequence[Expr], bits: int) -> list[Expr]:
    """Boolean expressions (NULL counts as false) packed ``bits`` to a bigint, bit k of
    word j being flag ``bits * j + k``."""
    words = []
    for first in range(0, len(flags), bits):
        terms = [f"CASE WHEN {flag} THEN {1 << k}L ELSE 0L END"
                 for k, flag in enumerate(flags[first : first + bits])]  # fmt: skip
        words.append("(" + " | ".join(terms) + ")")
    return words


def formula_levels(
    formulas: FormulaSet, *, today: dt.date, names: Mapping[str, Pair]
) -> tuple[list[Level], list[Output]]:
    """Phase two as text: each rule as a column (blank where it is an error) and an error
    column for each rule that can have errors, in :class:`Level` s (a projection each, over
    every column of the levels before). A rule other rules use goes in the level after the
    deepest rule it uses (the first if it uses none), so there are as many levels as the
    longest chain of rules using rules (two chains of 20 side by side make 20, not 40); every
    other rule goes in the last level. So the levels before the last carry only the source and
    the rules used later: Spark copies every column of a projection into each row it passes
    on, and its planning walks the stack of projections below each one, so 20 levels each
    carrying a tenant's 250 rules cost minutes of CPU where narrow ones cost seconds.

    :class:`FormulaError` for a rule whose text is longer than
    :data:`.compile.MAX_EXPRESSION_CHARS`.
    """
    known: dict[str, Pair] = dict(names)
    compiler = Compiler(today=today, names=known)
    depth: dict[str, int] = {}
    used: set[str] = set()  # the rules other rules use
    for formula in formulas.formulas:
        references = _references(formula.tree)
        used |= references
        depth[formula.target] = 1 + max((depth[n] for n in references if n in depth), default=-1)
    levels = [Level({}) for _ in range(1 + max(depth.values(), default=0))]
    outputs: list[Output] = []
    for formula in formulas.formulas:
        target = formula.target
        last = target not in used
        level = levels[-1 if last else depth[target]]
        try:
            value, error = compiler(formula.tree)
        except TooLong as exc:
            raise _too_long(formulas.tenant, f"{target} = {formula.source}", exc) from None
        error_name = None
        if error is None:
            level.computed[target] = value
        else:
            error_name = ERROR_PREFIX + target
            if last:  # the raw pair once each, then blanked by name (see Level)
                raw_value, raw_error = RAW_PREFIX + target, RAW_PREFIX + error_name
                level.computed[raw_value] = value
                if formula.tree.type == NUMBER:
                    error = _without_check(error, value)  # made below, by name
                if error is not None:
                    level.computed[raw_error] = error
                value, error = quoted(raw_value), quoted(raw_error) if error else None
            if formula.tree.type == NUMBER:
                error = either(error, bad_number(value))
            assert error is not None  # only a number's own check was dropped, made again here
            settled = coalesce(error, SQL_FALSE)
            (level.finish if last else level.computed)[error_name] = settled
            (level.finish if last else level.computed)[target] = when((not_(settled), value))
        known[target] = (quoted(target), quoted(error_name) if error_name else None)
        if not formula.intermediate:
            outputs.append(Output(target, formula.tree.type, error_name))
    return levels, outputs


def _without_check(error: Expr, value: Expr) -> Expr | None:
    """``error`` without its last term if that is ``value``'s own overflow check (a product
    or power at the top of a rule ends its error so, :func:`.sqlexpr.or_errors` joining the
    terms): a last-level rule's number is checked again by name (:class:`Level`), so the check
    and the copy of the value in it are text Spark would parse, analyse and compile for
    nothing. In a tenant of 250 realistic rules that copy was 14% of the plan's text."""
    check = bad_number(value)
    if error == check:
        return None
    tail = f" OR {check})"
    if error.startswith("(") and error.endswith(tail):
        return f"({error[1 : -len(tail)]})"
    return error


def _too_long(tenant: str, shown: str, exc: TooLong) -> FormulaError:
    return FormulaError(
        tenant,
        shown[:200],
        f"it compiles to more than {MAX_EXPRESSION_CHARS:,} characters of Spark SQL: "
        "functions that use their argument more than once (INT, CEILING, IF's condition, a "
        "number as text) repeat it when nested; name the inner part as an intermediate rule "
        "(_inner = ...) and use the name",
    )


def apply_formulas(
    df: Any, formulas: FormulaSet, *, today: dt.date, names: Mapping[str, Pair]
) -> tuple[Any, list[Output]]:
    """Phase two on ``df``: a ``selectExpr`` per level of :func:`formula_levels` (and the last
    level's ``finish``).

    Each is analysed as it is added, the levels below already analysed. One query of nested
    ``SELECT`` s instead, analysed once, cost a tenant of 250 rules in 20 levels more, not
    less: Spark's analyser resolved the unresolved stack a level per pass of its rules, each
    pass over the whole tree."""
    levels, outputs = formula_levels(formulas, today=today, names=names)
    for level in levels:
        for step in (level.computed, level.finish):
            if step:
                df = df.selectExpr("*", *(f"{text} AS {quoted(n)}" for n, text in step.items()))
    return df, outputs


def check_compiles(formulas: FormulaSet, *, today: dt.date) -> None:
    """Compile every phase of ``formulas`` as a job's batches would (no Spark session):
    :class:`FormulaError` if a rule cannot be handed to Spark."""
    try:
        shapes = aggregate_plan(formulas, today)
    except TooLong as exc:
        raise _too_long(formulas.tenant, "a tenant aggregate (SUM, AVERAGE, ...)", exc) from None
    placeholders = {
        AGG_PREFIX + node.key(): (quoted("aggregate"), quoted("error"))
        for _groups, nodes, _keys, _columns in shapes
        for node in nodes
    }
    for table, key, wanted in lookup_shapes(formulas):
        for column, _kind in wanted:
            placeholders[lookup_name(table, column, key)] = (quoted("found"), quoted("missing"))
    formula_levels(formulas, today=today, names=placeholders)


def uses_moment(formulas: FormulaSet) -> bool:
    """Whether any rule reads the job's moment (``TODAY()``, ``NOW()``): the only rules whose
    Spark text differs between two jobs of one formula version (aggregates aside)."""
    return any(item.op in ("TODAY", "NOW") for f in formulas.formulas for item in f.tree.walk())


def _references(tree: Node) -> set[str]:
    return {item.value for item in tree.walk() if item.op == "ref"}
