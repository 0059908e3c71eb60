"""Tenant formulas: ``total = price * qty``, parsed and checked before any job starts.

A formula is ``target = expression``; the expression is a small, safe subset of Spark SQL:
numbers, strings, ``TRUE``/``FALSE``/``NULL``, columns, arithmetic (``+ - * / %``), comparisons,
``AND``/``OR``/``NOT``, ``IS [NOT] NULL``, ``[NOT] BETWEEN``, ``[NOT] IN (...)``,
``CASE WHEN ... THEN ... [ELSE ...] END``, ``CAST(x AS type)`` and calls of allow-listed
functions. Anything else (sub-queries, ``;``, comments, unknown columns or functions) is refused
with a :class:`FormulaError` naming the tenant and the formula.

The parsed tree renders both as Spark SQL (what the pipeline runs) and as PostgreSQL (the same
formulas as one ``INSERT ... SELECT``: the benchmark's baseline and the tests' oracle).
This module needs neither Django's app registry nor PySpark.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from psycopg import sql

#: Functions a formula may call, by default: Spark SQL name -> PostgreSQL name.
DEFAULT_FUNCTIONS: Mapping[str, str] = {
    "abs": "abs",
    "round": "round",
    "floor": "floor",
    "ceil": "ceil",
    "ceiling": "ceil",
    "sqrt": "sqrt",
    "exp": "exp",
    "ln": "ln",
    "log10": "log10",
    "power": "power",
    "pow": "power",
    "sign": "sign",
    "greatest": "greatest",
    "least": "least",
    "coalesce": "coalesce",
    "nullif": "nullif",
    "lower": "lower",
    "upper": "upper",
    "length": "length",
    "trim": "trim",
}

#: Column kinds of the small type system used to render the same meaning in both dialects.
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

#: CAST(x AS type): accepted Spark type names -> (kind, PostgreSQL type).
CAST_TYPES: Mapping[str, tuple[str, str]] = {
    "int": (INT, "integer"),
    "integer": (INT, "integer"),
    "bigint": (INT, "bigint"),
    "long": (INT, "bigint"),
    "double": (FLOAT, "double precision"),
    "float": (FLOAT, "double precision"),
    "string": (STR, "text"),
    "boolean": (BOOL, "boolean"),
    "date": (DATE, "date"),
}

_KEYWORDS = {
    "and", "or", "not", "is", "null", "true", "false", "between", "in", "case", "when", "then",
    "else", "end", "cast", "as", "decimal",
}  # fmt: skip
_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<number>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)
  | (?P<string>'(?:[^'\\]|''|\\.)*')
  | (?P<quoted>`(?:[^`]|``)+`)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op><=|>=|<>|!=|==|[-+*/%(),<>=])
    """,
    re.VERBOSE,
)
_TARGET = re.compile(r"^\s*`?([A-Za-z_][A-Za-z0-9_]*)`?\s*=(?!=)\s*(.*)$", re.DOTALL)
MAX_FORMULA_LENGTH = 4000
MAX_DEPTH = 60


class FormulaError(ValueError):
    """A tenant's formula is invalid; the message names the tenant and the formula."""

    def __init__(self, tenant: str, formula: str, reason: str) -> None:
        self.tenant = tenant
        self.formula = formula
        self.reason = reason
        super().__init__(f"tenant {tenant!r}: invalid formula {formula!r}: {reason}")


class _Invalid(Exception):
    pass


# --------------------------------------------------------------------------------------------
# Tree


@dataclass(frozen=True)
class Node:
    kind: str = field(default="", compare=False)


@dataclass(frozen=True)
class Literal(Node):
    text: str = ""  # a number as written, or TRUE/FALSE/NULL
    value: str | None = None  # a string literal's value


@dataclass(frozen=True)
class Column(Node):
    name: str = ""


@dataclass(frozen=True)
class Call(Node):
    name: str = ""
    args: tuple[Node, ...] = ()


@dataclass(frozen=True)
class Unary(Node):
    op: str = ""
    operand: Node = field(default_factory=Node)


@dataclass(frozen=True)
class Binary(Node):
    op: str = ""
    left: Node = field(default_factory=Node)
    right: Node = field(default_factory=Node)


@dataclass(frozen=True)
class IsNull(Node):
    operand: Node = field(default_factory=Node)
    negated: bool = False


@dataclass(frozen=True)
class Between(Node):
    operand: Node = field(default_factory=Node)
    low: Node = field(default_factory=Node)
    high: Node = field(default_factory=Node)
    negated: bool = False


@dataclass(frozen=True)
class InList(Node):
    operand: Node = field(default_factory=Node)
    items: tuple[Node, ...] = ()
    negated: bool = False


@dataclass(frozen=True)
class Case(Node):
    whens: tuple[tuple[Node, Node], ...] = ()
    default: Node | None = None


@dataclass(frozen=True)
class Cast(Node):
    operand: Node = field(default_factory=Node)
    spark_type: str = ""
    pg_type: str = ""


@dataclass(frozen=True)
class Formula:
    """One parsed formula: ``target = expression``."""

    target: str
    source: str  # the expression as written
    tree: Node
    kind: str

    @property
    def text(self) -> str:
        return f"{self.target} = {self.source}"

    def spark_sql(self) -> str:
        """The expression as Spark SQL (identifiers back-quoted)."""
        return _spark(self.tree)


# --------------------------------------------------------------------------------------------
# Parsing


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        if text.startswith(("--", "/*"), pos):
            raise _Invalid(f"comments are not allowed (position {pos + 1})")
        match = _TOKEN.match(text, pos)
        if match is None:
            raise _Invalid(f"unexpected character {text[pos]!r} at position {pos + 1}")
        kind = match.lastgroup or ""
        value = match.group()
        pos = match.end()
        if kind == "space":
            continue
        if kind == "quoted":
            kind, value = "name", value[1:-1].replace("``", "`")
            tokens.append(("ident", value))
            continue
        if kind == "name" and value.lower() in _KEYWORDS:
            tokens.append(("kw", value.lower()))
            continue
        tokens.append(("ident" if kind == "name" else kind, value))
    return tokens


class _Parser:
    def __init__(self, text: str, columns: Mapping[str, str], functions: Mapping[str, str]) -> None:
        self.tokens = _tokenize(text)
        self.pos = 0
        self.columns = columns
        self.functions = functions
        self.depth = 0

    # token helpers
    def peek(self, offset: int = 0) -> tuple[str, str] | None:
        index = self.pos + offset
        return self.tokens[index] if index < len(self.tokens) else None

    def accept(self, kind: str, value: str | None = None) -> bool:
        token = self.peek()
        if token is not None and token[0] == kind and (value is None or token[1] == value):
            self.pos += 1
            return True
        return False

    def expect(self, kind: str, value: str) -> None:
        if not self.accept(kind, value):
            raise _Invalid(f"expected {value.upper()!r} {self.where()}")

    def where(self) -> str:
        token = self.peek()
        return "at the end" if token is None else f"before {token[1]!r}"

    def parse(self) -> Node:
        if not self.tokens:
            raise _Invalid("the expression is empty")
        node = self.expr()
        if self.peek() is not None:
            raise _Invalid(f"unexpected {self.peek()[1]!r}")  # type: ignore[index]
        return node

    def expr(self) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Invalid(f"nested more than {MAX_DEPTH} levels deep")
        try:
            return self.or_()
        finally:
            self.depth -= 1

    def or_(self) -> Node:
        node = self.and_()
        while self.accept("kw", "or"):
            node = _logical("OR", node, self.and_())
        return node

    def and_(self) -> Node:
        node = self.not_()
        while self.accept("kw", "and"):
            node = _logical("AND", node, self.not_())
        return node

    def not_(self) -> Node:
        if self.accept("kw", "not"):
            operand = self.not_()
            _require(operand, (BOOL,), "NOT")
            return Unary(kind=BOOL, op="NOT", operand=operand)
        return self.comparison()

    def comparison(self) -> Node:
        node = self.additive()
        token = self.peek()
        if token is None:
            return node
        if token[0] == "op" and token[1] in ("=", "==", "!=", "<>", "<", "<=", ">", ">="):
            self.pos += 1
            op = {"==": "=", "!=": "<>"}.get(token[1], token[1])
            right = self.additive()
            _comparable(node, right, op)
            return Binary(kind=BOOL, op=op, left=node, right=right)
        if self.accept("kw", "is"):
            negated = self.accept("kw", "not")
            self.expect("kw", "null")
            return IsNull(kind=BOOL, operand=node, negated=negated)
        negated = False
        if token == ("kw", "not") and self.peek(1) in (("kw", "between"), ("kw", "in")):
            self.pos += 1
            negated = True
        if self.accept("kw", "between"):
            low = self.additive()
            self.expect("kw", "and")
            high = self.additive()
            _comparable(node, low, "BETWEEN")
            _comparable(node, high, "BETWEEN")
            return Between(kind=BOOL, operand=node, low=low, high=high, negated=negated)
        if self.accept("kw", "in"):
            self.expect("op", "(")
            items = [self.expr()]
            while self.accept("op", ","):
                items.append(self.expr())
            self.expect("op", ")")
            for item in items:
                _comparable(node, item, "IN")
            return InList(kind=BOOL, operand=node, items=tuple(items), negated=negated)
        if negated:
            raise _Invalid(f"expected BETWEEN or IN after NOT {self.where()}")
        return node

    def additive(self) -> Node:
        node = self.multiplicative()
        while (token := self.peek()) is not None and token in (("op", "+"), ("op", "-")):
            self.pos += 1
            node = _arithmetic(token[1], node, self.multiplicative())
        return node

    def multiplicative(self) -> Node:
        node = self.unary()
        while (token := self.peek()) is not None and token[0] == "op" and token[1] in "*/%":
            self.pos += 1
            node = _arithmetic(token[1], node, self.unary())
        return node

    def unary(self) -> Node:
        token = self.peek()
        if token in (("op", "-"), ("op", "+")):
            self.pos += 1
            operand = self.unary()
            _require(operand, NUMERIC_KINDS, f"unary {token[1]}")
            return Unary(kind=operand.kind, op=token[1], operand=operand)
        return self.primary()

    def primary(self) -> Node:
        token = self.peek()
        if token is None:
            raise _Invalid("the expression ends too early")
        kind, value = token
        self.pos += 1
        if kind == "number":
            is_float = any(c in value for c in ".eE")
            # Spark reads 1.5 as a decimal and 1e3 as a double; both are exact enough here.
            return Literal(kind=FLOAT if is_float else INT, text=value)
        if kind == "string":
            body = value[1:-1]
            if "\\" in body:
                raise _Invalid("backslash escapes in strings are not supported")
            return Literal(kind=STR, value=body.replace("''", "'"))
        if kind == "kw" and value in ("true", "false"):
            return Literal(kind=BOOL, text=value.upper())
        if kind == "kw" and value == "null":
            return Literal(kind=NULL, text="NULL")
        if kind == "op" and value == "(":
            node = self.expr()
            self.expect("op", ")")
            return node
        if kind == "kw" and value == "case":
            return self.case()
        if kind == "kw" and value == "cast":
            return self.cast()
        if kind == "ident":
            if self.accept("op", "("):
                return self.call(value)
            name = value
            if name not in self.columns:
                known = ", ".join(sorted(self.columns)) or "none"
                raise _Invalid(f"unknown column {name!r} (known: {known})")
            return Column(kind=self.columns[name], name=name)
        raise _Invalid(f"unexpected {value!r}")

    def call(self, name: str) -> Node:
        function = name.lower()
        if function not in self.functions:
            allowed = ", ".join(sorted(self.functions))
            raise _Invalid(f"function {name!r} is not allowed (allowed: {allowed})")
        args: list[Node] = []
        if not self.accept("op", ")"):
            args.append(self.expr())
            while self.accept("op", ","):
                args.append(self.expr())
            self.expect("op", ")")
        return Call(kind=_call_kind(function, args), name=function, args=tuple(args))

    def case(self) -> Node:
        whens: list[tuple[Node, Node]] = []
        while self.accept("kw", "when"):
            condition = self.expr()
            _require(condition, (BOOL,), "WHEN")
            self.expect("kw", "then")
            whens.append((condition, self.expr()))
        if not whens:
            raise _Invalid(f"CASE needs WHEN ... THEN ... {self.where()}")
        default = self.expr() if self.accept("kw", "else") else None
        self.expect("kw", "end")
        branches = [then for _, then in whens] + ([default] if default is not None else [])
        return Case(kind=_common_kind(branches, "CASE"), whens=tuple(whens), default=default)

    def cast(self) -> Node:
        self.expect("op", "(")
        operand = self.expr()
        self.expect("kw", "as")
        token = self.peek()
        if token == ("kw", "decimal"):
            self.pos += 1
            self.expect("op", "(")
            precision = self._integer()
            scale = self._integer() if self.accept("op", ",") else 0
            self.expect("op", ")")
            if not 1 <= precision <= 38 or not 0 <= scale <= precision:
                raise _Invalid(f"DECIMAL({precision},{scale}) is out of range")
            self.expect("op", ")")
            return Cast(
                kind=DECIMAL,
                operand=operand,
                spark_type=f"DECIMAL({precision},{scale})",
                pg_type=f"numeric({precision},{scale})",
            )
        if token is None or token[0] != "ident" or token[1].lower() not in CAST_TYPES:
            raise _Invalid(f"CAST to an unsupported type {self.where()}; use one of "
                           f"{', '.join(sorted(CAST_TYPES))} or DECIMAL(p,s)")  # fmt: skip
        self.pos += 1
        self.expect("op", ")")
        kind, pg_type = CAST_TYPES[token[1].lower()]
        return Cast(kind=kind, operand=operand, spark_type=token[1].upper(), pg_type=pg_type)

    def _integer(self) -> int:
        token = self.peek()
        if token is None or token[0] != "number" or not token[1].isdigit():
            raise _Invalid(f"expected an integer {self.where()}")
        self.pos += 1
        return int(token[1])


def _require(node: Node, kinds: Sequence[str], what: str) -> None:
    if node.kind not in (*kinds, NULL):
        raise _Invalid(f"{what} needs {' or '.join(kinds)}, got {node.kind}")


def _logical(op: str, left: Node, right: Node) -> Node:
    _require(left, (BOOL,), op)
    _require(right, (BOOL,), op)
    return Binary(kind=BOOL, op=op, left=left, right=right)


def _comparable(left: Node, right: Node, what: str) -> None:
    _common_kind([left, right], what)


def _common_kind(nodes: Sequence[Node], what: str) -> str:
    kinds = {node.kind for node in nodes} - {NULL}
    if not kinds:
        return NULL
    if len(kinds) == 1:
        return kinds.pop()
    if kinds <= set(NUMERIC_KINDS):
        return FLOAT if FLOAT in kinds else DECIMAL
    raise _Invalid(f"{what} mixes {' and '.join(sorted(kinds))}")


def _arithmetic(op: str, left: Node, right: Node) -> Node:
    _require(left, NUMERIC_KINDS, op)
    _require(right, NUMERIC_KINDS, op)
    kind = _common_kind([left, right], op)
    if op == "/" and kind in (INT, NULL):
        kind = FLOAT  # Spark's / on integers gives a double
    return Binary(kind=kind, op=op, left=left, right=right)


def _call_kind(name: str, args: Sequence[Node]) -> str:
    arity = {
        "round": (1, 2), "abs": (1, 1), "floor": (1, 1), "ceil": (1, 1), "ceiling": (1, 1),
        "sqrt": (1, 1), "exp": (1, 1), "ln": (1, 1), "log10": (1, 1), "power": (2, 2),
        "pow": (2, 2), "sign": (1, 1), "nullif": (2, 2), "lower": (1, 1), "upper": (1, 1),
        "length": (1, 1), "trim": (1, 1),
    }.get(name, (1, 255))  # fmt: skip
    if not arity[0] <= len(args) <= arity[1]:
        expected = str(arity[0]) if arity[0] == arity[1] else f"{arity[0]} to {arity[1]}"
        raise _Invalid(f"{name}() takes {expected} arguments, got {len(args)}")
    if name in ("lower", "upper", "trim"):
        _require(args[0], (STR,), f"{name}()")
        return STR
    if name == "length":
        _require(args[0], (STR,), "length()")
        return INT
    if name in ("coalesce", "greatest", "least", "nullif"):
        return _common_kind(args, f"{name}()")
    for arg in args:
        _require(arg, NUMERIC_KINDS, f"{name}()")
    if name == "round" and len(args) == 2 and args[1].kind != INT:
        raise _Invalid("round()'s second argument must be an integer")
    if name in ("sqrt", "exp", "ln", "log10", "power", "pow"):
        return FLOAT
    if name in ("floor", "ceil", "ceiling"):
        return INT if args[0].kind in (INT, FLOAT) else DECIMAL
    return args[0].kind if args[0].kind != NULL else FLOAT


# --------------------------------------------------------------------------------------------
# Rendering


def _quote_spark(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _spark(node: Node) -> str:
    match node:
        case Literal(value=str() as value):
            return "'" + value.replace("'", "''") + "'"
        case Literal(text=text) if node.kind == FLOAT and "e" not in text.lower():
            return f"{text}D"  # a double, as in PostgreSQL (Spark reads 1.5 as a decimal)
        case Literal(text=text):
            return text
        case Column(name=name):
            return _quote_spark(name)
        case Call(name=name, args=args):
            return f"{name}({', '.join(_spark(arg) for arg in args)})"
        case Unary(op=op, operand=operand):
            return f"({op} {_spark(operand)})"
        case Binary(op=op, left=left, right=right):
            return f"({_spark(left)} {op} {_spark(right)})"
        case IsNull(operand=operand, negated=negated):
            return f"({_spark(operand)} IS {'NOT ' if negated else ''}NULL)"
        case Between(operand=operand, low=low, high=high, negated=negated):
            not_ = "NOT " if negated else ""
            return f"({_spark(operand)} {not_}BETWEEN {_spark(low)} AND {_spark(high)})"
        case InList(operand=operand, items=items, negated=negated):
            listed = ", ".join(_spark(item) for item in items)
            return f"({_spark(operand)} {'NOT ' if negated else ''}IN ({listed}))"
        case Case(whens=whens, default=default):
            parts = [f"WHEN {_spark(c)} THEN {_spark(t)}" for c, t in whens]
            if default is not None:
                parts.append(f"ELSE {_spark(default)}")
            return f"(CASE {' '.join(parts)} END)"
        case Cast(operand=operand, spark_type=spark_type):
            return f"CAST({_spark(operand)} AS {spark_type})"
    raise TypeError(f"cannot render {node!r}")


def _pg(node: Node, names: Mapping[str, sql.Composable], functions: Mapping[str, str]) -> Any:
    def r(child: Node) -> Any:
        return _pg(child, names, functions)

    match node:
        case Literal(value=str() as value):
            return sql.Literal(value)
        case Literal(text=text) if node.kind == FLOAT:
            return sql.SQL("{}::double precision").format(sql.Literal(text))
        case Literal(text=text) if node.kind == INT:
            return sql.Literal(int(text))
        case Literal(text=text):
            return sql.SQL({"TRUE": "TRUE", "FALSE": "FALSE", "NULL": "NULL"}[text])
        case Column(name=name):
            return names[name]
        case Call(name="round", args=args) if args[0].kind == FLOAT:
            # PostgreSQL's round(double) rounds half to even; Spark rounds the double's
            # shortest decimal form half up. float8::numeric keeps only 15 digits, while
            # float8::text is the shortest exact form (extra_float_digits >= 1, the default).
            rest = [r(arg) for arg in args[1:]]
            joined = sql.SQL(", ").join([sql.SQL("({})::text::numeric").format(r(args[0])), *rest])
            return sql.SQL("round({})::double precision").format(joined)
        case Call(name=name, args=args):
            joined = sql.SQL(", ").join([r(arg) for arg in args])
            return sql.SQL("{}({})").format(sql.SQL(functions[name]), joined)
        case Unary(op=op, operand=operand):
            return sql.SQL("({} {})").format(sql.SQL(op), r(operand))
        case Binary(op="/", left=left, right=right) if node.kind == FLOAT:
            return sql.SQL("(({})::double precision / {})").format(r(left), r(right))
        case Binary(op="%", left=left, right=right):
            if node.kind == FLOAT:
                return sql.SQL("mod(({})::text::numeric, ({})::text::numeric)::float8").format(
                    r(left), r(right)
                )
            return sql.SQL("mod({}, {})").format(r(left), r(right))
        case Binary(op=op, left=left, right=right):
            return sql.SQL("({} {} {})").format(r(left), sql.SQL(op), r(right))
        case IsNull(operand=operand, negated=negated):
            return sql.SQL("({} IS {}NULL)").format(r(operand), sql.SQL("NOT " if negated else ""))
        case Between(operand=operand, low=low, high=high, negated=negated):
            return sql.SQL("({} {}BETWEEN {} AND {})").format(
                r(operand), sql.SQL("NOT " if negated else ""), r(low), r(high)
            )
        case InList(operand=operand, items=items, negated=negated):
            return sql.SQL("({} {}IN ({}))").format(
                r(operand),
                sql.SQL("NOT " if negated else ""),
                sql.SQL(", ").join([r(item) for item in items]),
            )
        case Case(whens=whens, default=default):
            parts = [sql.SQL("WHEN {} THEN {}").format(r(c), r(t)) for c, t in whens]
            if default is not None:
                parts.append(sql.SQL("ELSE {}").format(r(default)))
            return sql.SQL("(CASE {} END)").format(sql.SQL(" ").join(parts))
        case Cast(operand=operand, pg_type=pg_type):
            return sql.SQL("CAST({} AS {})").format(r(operand), sql.SQL(pg_type))
    raise TypeError(f"cannot render {node!r}")


# --------------------------------------------------------------------------------------------
# Formula sets


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


@dataclass(frozen=True)
class FormulaSet:
    """A tenant's parsed formulas, in order (a formula may use the targets before it)."""

    tenant: str
    formulas: tuple[Formula, ...]

    def targets(self) -> list[str]:
        return [f.target for f in self.formulas]

    def postgres(
        self, columns: Mapping[str, sql.Composable], functions: Mapping[str, str] | None = None
    ) -> dict[str, sql.Composable]:
        """target -> PostgreSQL expression over ``columns`` (earlier targets inlined)."""
        names: dict[str, sql.Composable] = dict(columns)
        rendered: dict[str, sql.Composable] = {}
        for formula in self.formulas:
            expression = sql.SQL("({})").format(
                _pg(formula.tree, names, functions or DEFAULT_FUNCTIONS)
            )
            rendered[formula.target] = expression
            names[formula.target] = expression
        return rendered


def parse_formulas(
    tenant: str,
    raw: Any,
    *,
    columns: Mapping[str, str],
    targets: Iterable[str],
    functions: Mapping[str, str] | None = None,
) -> FormulaSet:
    """Parse and check a tenant's formulas against the source ``columns`` (name -> kind).

    ``targets``: the columns a formula may define (the sink's). Raises :class:`FormulaError`
    for the first invalid formula.
    """
    allowed_targets = set(targets)
    functions = DEFAULT_FUNCTIONS if functions is None else functions
    known: dict[str, str] = dict(columns)
    parsed: list[Formula] = []
    seen: set[str] = set()
    try:
        pairs = split_formulas(raw)
    except (TypeError, ValueError) as exc:
        raise FormulaError(tenant, repr(raw), f"cannot read the formulas: {exc}") from None
    if not pairs:
        raise FormulaError(tenant, "", "the tenant has no formulas")
    for target, expression in pairs:
        text = f"{target} = {expression}" if target else expression
        if not target:
            raise FormulaError(tenant, text, "a formula reads `target = expression`")
        if len(expression) > MAX_FORMULA_LENGTH:
            raise FormulaError(tenant, text[:80] + "...", f"longer than {MAX_FORMULA_LENGTH}")
        if target not in allowed_targets:
            raise FormulaError(
                tenant,
                text,
                f"{target!r} is not a column of the sink (sink columns: "
                f"{', '.join(sorted(allowed_targets))})",
            )
        if target in seen:
            raise FormulaError(tenant, text, f"{target!r} is defined twice")
        try:
            tree = _Parser(expression, known, functions).parse()
        except _Invalid as exc:
            raise FormulaError(tenant, text, str(exc)) from None
        seen.add(target)
        known[target] = tree.kind
        parsed.append(Formula(target=target, source=expression.strip(), tree=tree, kind=tree.kind))
    return FormulaSet(tenant=tenant, formulas=tuple(parsed))
