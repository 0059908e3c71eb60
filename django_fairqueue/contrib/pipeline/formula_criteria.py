"""Spreadsheet criteria and wildcards: text read as a number or as a pattern, as a
spreadsheet reads it, and a criterion (``10``, ``">10"``, ``"<>x"``, ``"a*"``) as a test.

The checks (:mod:`.formula_check`) turn the criteria of SUMIF, COUNTIFS and the like into
nodes here; the compiler (:mod:`.compile`, :mod:`.sqlexpr`) reads numbers and wildcards by the
same definitions, so that a criterion agrees with ``VALUE`` and ``SEARCH``.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

from django_fairqueue.contrib.pipeline.formula_tree import (
    BLANK,
    BOOLEAN,
    DATE_T,
    NUMBER,
    TEXT,
    Invalid,
    Node,
    make_node,
)

#: Text a spreadsheet reads as a number (VALUE, criteria such as ">1,000"), once the spaces
#: around it are trimmed: a sign, digits with optional thousands separators, a fraction, an
#: exponent, a percent sign (a hundredth), a dollar sign after the sign; and a digit before
#: any exponent.
NUMBER_TEXT = r"^[+-]?[$]?([0-9]{1,3}(,[0-9]{3})+|[0-9]+)?([.][0-9]*)?([eE][+-]?[0-9]+)?%?$"
NUMBER_START = r"^[+-]?[$]?[.]?[0-9]"


def spreadsheet_number(text: str) -> float | None:
    """Text as a spreadsheet reads it as a number (see :data:`NUMBER_TEXT`), else None."""
    trimmed = text.strip(" ")
    if not re.match(NUMBER_TEXT, trimmed) or not re.match(NUMBER_START, trimmed):
        return None
    value = float(trimmed.replace(",", "").replace("%", "").replace("$", ""))
    return value / 100 if trimmed.endswith("%") else value


def wildcard_regex(pattern: str) -> str:
    """A spreadsheet pattern (``*`` any text, ``?`` one character, ``~`` escapes the next) as
    a Java regular expression."""
    parts: list[str] = []
    escaped = False
    for char in pattern:
        if escaped:
            parts.append(_regex_char(char))
            escaped = False
        elif char == "~":
            escaped = True
        elif char in "*?":
            parts.append(".*" if char == "*" else ".")
        else:
            parts.append(_regex_char(char))
    if escaped:
        parts.append(_regex_char("~"))
    return "".join(parts)


def has_wildcard(pattern: str) -> bool:
    return any(char in pattern for char in "*?~")


def _regex_char(char: str) -> str:
    # A backslash before any character that is not a letter or digit is that character.
    return char if char.isalnum() else "\\" + char


_CRITERION_OPS = ("<=", ">=", "<>", "=", "<", ">")


def criterion(subject: Node, given: Node) -> Node:
    """A spreadsheet criterion (``10``, ``">10"``, ``"<>x"``, ``"a*"``, ``""``) applied to
    ``subject``, as a boolean node. A blank meets only ``""``, ``"="`` and ``"<>..."``; text is
    compared without case; a criterion of another type than the subject's is never met (but
    ``"<>..."``, always met)."""
    if given.op != "const" or given.type == BLANK:
        raise Invalid('a criterion must be a constant (10, ">10", "<>x", "a*")')
    value = given.value
    op, operand = "=", value
    if isinstance(value, str):
        op = next((o for o in _CRITERION_OPS if value.startswith(o)), "")
        operand = value[len(op) :]
        op = op or "="
    blank_test = make_node("ISBLANK", BOOLEAN, [subject])
    never = make_node("const", BOOLEAN, value=False)
    always = make_node("const", BOOLEAN, value=True)
    if operand == "" and op in ("=", "<>"):
        return blank_test if op == "=" else make_node("NOT", BOOLEAN, [blank_test])
    constant = _criterion_constant(subject.type, operand)
    if constant is None:
        return always if op == "<>" else never
    if subject.type == TEXT and op in ("=", "<>") and has_wildcard(constant.value):
        regex = "(?isu)^" + wildcard_regex(constant.value) + "$"
        match = make_node("WILDCARD", BOOLEAN, [subject], value=regex)
        if op == "<>":
            return make_node("NOT", BOOLEAN, [match])
        return make_node("AND", BOOLEAN, [make_node("NOT", BOOLEAN, [blank_test]), match])
    test = make_node(op, BOOLEAN, [subject, constant])
    if op == "<>":
        return test
    return make_node("AND", BOOLEAN, [make_node("NOT", BOOLEAN, [blank_test]), test])


def _criterion_constant(kind: str, operand: Any) -> Node | None:
    """The criterion's operand as a constant of the subject's type, or None."""
    if kind == TEXT:
        text = operand if isinstance(operand, str) else _plain_number(operand)
        return make_node("const", TEXT, value=text)
    if kind == NUMBER:
        if isinstance(operand, bool):
            return None
        number = operand if isinstance(operand, float) else spreadsheet_number(str(operand))
        return None if number is None else make_node("const", NUMBER, value=float(number))
    if kind == BOOLEAN:
        if isinstance(operand, bool):
            return make_node("const", BOOLEAN, value=operand)
        word = str(operand).strip().upper()
        return (
            make_node("const", BOOLEAN, value=word == "TRUE") if word in ("TRUE", "FALSE") else None
        )
    if kind == DATE_T and isinstance(operand, str):
        try:
            return make_node("const", DATE_T, value=dt.date.fromisoformat(operand.strip()))
        except ValueError:
            return None
    return None


def _plain_number(value: Any) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    number = float(value)
    return str(int(number)) if number.is_integer() and abs(number) < 1e15 else repr(number)
