"""The formula language's type checks: lark's tree of one expression to a typed
:class:`~.formula_tree.Node`, each name, function, argument count and type checked.

The builder knows the source columns, the rules checked before, the functions allowed and the
lookup tables. It writes what a spreadsheet writes several ways in one form (``BETWEEN``,
``IN``, ``IS NULL``, SUMIF and the other criteria aggregates), so that the compiler has fewer
kinds of node to know. :mod:`.formulas` parses the text, and checks a tenant's rules as a set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from django_fairqueue.contrib.pipeline.formula_catalog import (
    AGGREGATES,
    CAST_TYPES,
    CRITERIA_AGGREGATES,
    FUNCTIONS,
    RANK_ASC,
    Function,
    check_agg_minmax,
    check_aggregate,
    common_type,
    constant_in,
    require,
)
from django_fairqueue.contrib.pipeline.formula_criteria import criterion
from django_fairqueue.contrib.pipeline.formula_tree import (
    BLANK,
    BOOLEAN,
    DATE_T,
    DATETIME,
    NUMBER,
    TEXT,
    Invalid,
    Node,
    constant_number,
    make_node,
)

if TYPE_CHECKING:
    from django_fairqueue.contrib.pipeline.formulas import LookupTable


class Builder:
    def __init__(
        self,
        columns: Mapping[str, str],
        rules: Mapping[str, Node],
        functions: frozenset[str],
        lookups: Mapping[str, LookupTable] | None = None,
    ) -> None:
        self.columns = columns  # source column -> value type
        self.rules = rules  # a rule built before (one it may use) -> its checked tree
        self.functions = functions
        self.lookups = lookups or {}
        self.in_aggregate = False

    def build(self, tree: Any) -> Node:
        from lark import Token

        if isinstance(tree, Token):  # a bare "(expr)" never reaches here; names do
            raise Invalid(f"unexpected {tree!s}")
        method = getattr(self, f"_{tree.data}", None)
        if method is None:
            raise Invalid(f"unsupported construct {tree.data}")
        node: Node = method(*tree.children)
        return node

    # constants
    def _number(self, token: Any) -> Node:
        value = float(token)
        if value != value or value in (float("inf"), float("-inf")):
            raise Invalid(f"number out of range: {token}")
        return make_node("const", NUMBER, value=value)

    def _percent(self, token: Any) -> Node:
        """``10%`` is 0.1, as in a spreadsheet (``a % b``, between operands, is a remainder)."""
        return make_node("const", NUMBER, value=self._number(str(token)[:-1]).value / 100)

    def _string(self, token: Any) -> Node:
        quote = token[0]
        return make_node("const", TEXT, value=token[1:-1].replace(quote * 2, quote))

    def _true(self, _: Any) -> Node:
        return make_node("const", BOOLEAN, value=True)

    def _false(self, _: Any) -> Node:
        return make_node("const", BOOLEAN, value=False)

    def _null(self, _: Any) -> Node:
        return make_node("const", BLANK)

    def _name(self, token: Any) -> Node:
        name = str(token)
        if name.startswith("`"):
            name = name[1:-1].replace("``", "`")
        if name in self.rules:
            rule = self.rules[name]
            if self.in_aggregate and _has_aggregate(rule):
                raise Invalid(f"an aggregate's argument uses {name!r}, itself an aggregate")
            return make_node("ref", rule.type, value=name, fallible=rule.fallible)
        if name in self.columns:
            return make_node("col", self.columns[name], value=name)
        known = ", ".join(sorted({*self.columns, *self.rules})) or "none"
        raise Invalid(f"unknown name {name!r} (known: {known})")

    # operators
    def _unary(self, op: Any, operand: Any) -> Node:
        node = self.build(operand)
        require(node, (NUMBER,), f"unary {op}")
        return node if str(op) == "+" else make_node("neg", NUMBER, [node])

    def _arith(self, left: Any, op: Any, right: Any) -> Node:
        a, b = self.build(left), self.build(right)
        symbol = str(op)
        if symbol in ("+", "-") and DATE_T in (a.type, b.type):
            if symbol == "-" and a.type == DATE_T and b.type == DATE_T:
                return make_node("days", NUMBER, [a, b])
            date, number = (a, b) if a.type == DATE_T else (b, a)
            if symbol == "-" and date is b:
                raise Invalid("a number minus a date means nothing; subtract dates or days")
            require(number, (NUMBER,), f"date {symbol}")
            return make_node("date+" if symbol == "+" else "date-", DATE_T, [date, number])
        require(a, (NUMBER,), symbol)
        require(b, (NUMBER,), symbol)
        fallible = symbol in ("/", "%", "^", "*")  # division by zero; overflow; no real power
        return make_node(symbol, NUMBER, [a, b], fallible=fallible)

    def _concat(self, left: Any, right: Any) -> Node:
        return make_node("CONCAT", TEXT, [self.build(left), self.build(right)])

    def _compare(self, left: Any, op: Any, right: Any) -> Node:
        a, b = self.build(left), self.build(right)
        if {a.type, b.type} != {DATE_T, DATETIME}:  # a date is its midnight beside a datetime
            common_type([a, b], f"comparison {op}")
        symbol = {"==": "=", "!=": "<>"}.get(str(op), str(op))
        return make_node(symbol, BOOLEAN, [a, b])

    def _logical(self, op: str, left: Any, right: Any) -> Node:
        a, b = self.build(left), self.build(right)
        require(a, (BOOLEAN,), op.upper())
        require(b, (BOOLEAN,), op.upper())
        return make_node(op.upper(), BOOLEAN, [a, b])

    def _or_op(self, left: Any, _: Any, right: Any) -> Node:
        return self._logical("or", left, right)

    def _and_op(self, left: Any, _: Any, right: Any) -> Node:
        return self._logical("and", left, right)

    def _not_op(self, _: Any, operand: Any) -> Node:
        node = self.build(operand)
        require(node, (BOOLEAN,), "NOT")
        return make_node("NOT", BOOLEAN, [node])

    def _is_null(self, operand: Any, *_: Any) -> Node:
        return make_node("ISBLANK", BOOLEAN, [self.build(operand)])

    def _is_not_null(self, operand: Any, *_: Any) -> Node:
        return make_node("NOT", BOOLEAN, [make_node("ISBLANK", BOOLEAN, [self.build(operand)])])

    def _between(self, operand: Any, _b: Any, low: Any, _a: Any, high: Any) -> Node:
        x = self.build(operand)
        lo, hi = self.build(low), self.build(high)
        common_type([x, lo, hi], "BETWEEN")
        return make_node(
            "AND", BOOLEAN, [make_node(">=", BOOLEAN, [x, lo]), make_node("<=", BOOLEAN, [x, hi])]
        )

    def _not_between(self, operand: Any, _n: Any, *rest: Any) -> Node:
        return make_node("NOT", BOOLEAN, [self._between(operand, *rest)])

    def _in_list(self, operand: Any, _in: Any, *items: Any) -> Node:
        x = self.build(operand)
        values = [self.build(item) for item in items]
        common_type([x, *values], "IN")
        tests = [make_node("=", BOOLEAN, [x, value]) for value in values]
        node = tests[0]
        for test in tests[1:]:
            node = make_node("OR", BOOLEAN, [node, test])
        return node

    def _not_in_list(self, operand: Any, _n: Any, *rest: Any) -> Node:
        return make_node("NOT", BOOLEAN, [self._in_list(operand, *rest)])

    def _case(self, *children: Any) -> Node:
        from lark import Token

        parts = [c for c in children if not isinstance(c, Token) and c is not None]
        has_else = any(isinstance(c, Token) and c.type == "ELSE" for c in children)
        built = [self.build(p) for p in parts]
        pairs = built[: len(built) - 1] if has_else else built
        for condition in pairs[0::2]:
            require(condition, (BOOLEAN,), "WHEN")
        values = [*pairs[1::2], *(built[-1:] if has_else else [])]
        return make_node("case", common_type(values, "CASE"), built, value=has_else)

    def _cast(self, _c: Any, operand: Any, _as: Any, type_name: Any, *digits: Any) -> Node:
        node = self.build(operand)
        name = str(type_name).lower()
        if name not in CAST_TYPES:
            raise Invalid(
                f"CAST to an unsupported type {type_name!s}; use one of "
                f"{', '.join(sorted(CAST_TYPES))}"
            )
        scale = None
        if name in ("decimal", "numeric") and len(digits) > 1 and digits[1] is not None:
            scale = int(float(digits[1]))
        target = CAST_TYPES[name]
        integer = name in ("int", "integer", "bigint", "long")
        fallible = node.type != target and node.type != BLANK
        return make_node("cast", target, [node], value=(target, integer, scale), fallible=fallible)

    def _call(self, name_token: Any, args: Any, by: Any) -> Node:
        name = str(name_token).upper()
        function = FUNCTIONS.get(name)
        if function is None or name not in self.functions:
            allowed = ", ".join(sorted(self.functions))
            raise Invalid(f"function {name_token!s} is not allowed (allowed: {allowed})")
        raw_args = [] if args is None else [c for c in args.children if c is not None]
        raw_by = [] if by is None else [c for c in by.children[1:] if c is not None]
        if name in AGGREGATES and len(raw_args) == 1:
            return self._aggregate(name, raw_args[0], raw_by)
        if name == "RANK":
            _count_args(function, len(raw_args))
            try:
                return self._rank(raw_args, raw_by)
            except Invalid as exc:
                raise Invalid(f"RANK(): {exc}") from None
        if name in ("VLOOKUP", "XLOOKUP") and not raw_by:
            _count_args(function, len(raw_args))
            try:
                return self._lookup(name, [self.build(arg) for arg in raw_args])
            except Invalid as exc:
                raise Invalid(f"{name}(): {exc}") from None
        if name in CRITERIA_AGGREGATES:
            _count_args(function, len(raw_args))
            try:
                return self._criteria_aggregate(name, raw_args, raw_by)
            except Invalid as exc:
                raise Invalid(f"{name}(): {exc}") from None
        if raw_by:
            raise Invalid(f"BY goes with an aggregate: {'/'.join(AGGREGATES)} of one argument")
        if name == "COUNT":
            raise Invalid("COUNT takes one argument (the tenant's count of non-blank values)")
        _count_args(function, len(raw_args))
        built = [self.build(arg) for arg in raw_args]
        try:
            result, fallible = function.check(built)
        except Invalid as exc:
            raise Invalid(f"{name}(): {exc}") from None
        return make_node(name, result, built, fallible=fallible)

    def _rank(self, raw_args: list[Any], by: list[Any]) -> Node:
        """RANK(x[, order] [BY ...]): an aggregate grouped by x itself (and the BY groups),
        whose per-group counts phase one turns into ranks."""
        args, groups = self._in_aggregate("RANK", raw_args, by)
        value = args[0]
        require(value, (NUMBER,), "the value ranked")
        ascending = False
        if len(args) > 1:
            constant_in(args[1], (0, 1), "the order (0: largest first, 1: smallest first)")
            ascending = constant_number(args[1]) == 1
        return Node("agg", NUMBER, (value, value, *groups), RANK_ASC if ascending else "RANK",
                    True)  # fmt: skip

    def _lookup(self, name: str, args: list[Node]) -> Node:
        """``lookup`` nodes: args (the value looked up[, the value if not found]), value
        (table, column returned)."""
        value, *rest = args
        if name == "VLOOKUP":
            table = self._lookup_table(rest[0], "the table")
            index = constant_number(rest[1])
            columns = list(self.lookups[table].columns)
            if index is None or index != int(index) or not 1 <= index <= len(columns):
                raise Invalid(f"the column must be a constant from 1 to {len(columns)} (the "
                               f"key, then {', '.join(columns[1:])})")  # fmt: skip
            exact = rest[2] if len(rest) > 2 else None
            if exact is None or exact.op != "const" or exact.value not in (False, 0.0):
                raise Invalid("only an exact match is supported: give FALSE as the 4th argument")
            column, default = columns[int(index) - 1], None
        else:
            table, key = self._lookup_column(rest[0], "the lookup array")
            if key != self.lookups[table].key:
                raise Invalid(f"{table} is looked up by its key {self.lookups[table].key!r}")
            table_returned, column = self._lookup_column(rest[1], "the return array")
            if table_returned != table:
                raise Invalid("the lookup and return arrays are columns of one table")
            default = rest[2] if len(rest) > 2 else None
        if _reads_joined(value, self.rules):
            raise Invalid("the value looked up may not use an aggregate or another lookup")
        kind = self.lookups[table].columns[column]
        key_kind = self.lookups[table].columns[self.lookups[table].key]
        if value.type not in (key_kind, BLANK):
            raise Invalid(f"the value looked up is {value.type}; {table}'s key is {key_kind}")
        if default is None:
            return make_node("lookup", kind, [value], value=(table, column), fallible=True)
        result = common_type([make_node("const", kind), default], "the value if not found")
        return make_node("lookup", result, [value, default], value=(table, column))

    def _lookup_table(self, node: Node, what: str) -> str:
        if node.op != "const" or node.value not in self.lookups:
            known = ", ".join(f'"{n}"' for n in sorted(self.lookups)) or "none declared"
            raise Invalid(f"{what} is the name of a lookup table, in quotes ({known})")
        return str(node.value)

    def _lookup_column(self, node: Node, what: str) -> tuple[str, str]:
        text = str(node.value) if node.op == "const" else ""
        table, _, column = text.partition(".")
        if table not in self.lookups or column not in self.lookups[table].columns:
            raise Invalid(f'{what} is "table.column" of a lookup table ({text!r} is not one)')
        return table, column

    def _aggregate(self, name: str, arg: Any, by: list[Any]) -> Node:
        (built,), groups = self._in_aggregate(name, [arg], by)
        return self._aggregate_node(name, built, groups)

    def _in_aggregate(self, name: str, args: list[Any], by: list[Any]) -> tuple[list[Node], ...]:
        """An aggregate's arguments and ``BY`` groups, built (no aggregate inside)."""
        if self.in_aggregate:
            raise Invalid(f"{name}(): an aggregate inside an aggregate")
        self.in_aggregate = True
        try:
            built = [self.build(arg) for arg in args]
            groups = [self.build(b) for b in by]
        finally:
            self.in_aggregate = False
        for group in groups:
            if group.type == BLANK:
                raise Invalid(f"{name}(... BY ...): a group must not be blank")
        return built, groups

    def _criteria_aggregate(self, name: str, raw_args: list[Any], by: list[Any]) -> Node:
        args, groups = self._in_aggregate(name, raw_args, by)
        if name == "COUNTA":
            return self._aggregate_node("COUNT", args[0], groups)
        if name == "SUMPRODUCT":
            product = args[0]
            for i, arg in enumerate(args):
                require(arg, (NUMBER,), f"argument {i + 1}")
            for arg in args[1:]:
                product = make_node("*", NUMBER, [product, arg], fallible=True)
            return self._aggregate_node("SUM", product, groups)
        if name in ("SUMIF", "AVERAGEIF", "COUNTIF"):
            condition = criterion(args[0], args[1])
            values = args[2] if len(args) > 2 else args[0]
        else:
            pairs = args if name == "COUNTIFS" else args[1:]
            if len(pairs) % 2:
                raise Invalid("the criteria come in pairs: range, criterion, range, ...")
            tests = [criterion(r, c) for r, c in zip(pairs[0::2], pairs[1::2], strict=True)]
            condition = tests[0] if len(tests) == 1 else make_node("AND", BOOLEAN, tests)
            values = args[0]
        if name in ("COUNTIF", "COUNTIFS"):
            values = make_node("const", NUMBER, value=1.0)
        require(values, (NUMBER,), "the values summed, averaged or compared")
        kind = {"SUM": "SUM", "AVE": "AVERAGE", "COU": "COUNT", "MAX": "MAX", "MIN": "MIN"}
        aggregate = self._aggregate_node(
            kind[name[:3]], make_node("IF", NUMBER, [condition, values]), groups
        )
        if name in ("MAXIFS", "MINIFS"):  # no row meets the criteria: 0, as a spreadsheet gives
            return make_node("COALESCE", NUMBER, [aggregate, make_node("const", NUMBER, value=0.0)])
        return aggregate

    def _aggregate_node(self, name: str, built: Node, groups: list[Node]) -> Node:
        check = {
            "SUM": check_aggregate(True),
            "AVERAGE": check_aggregate(True),
            "MEDIAN": check_aggregate(True),
            "COUNT": check_aggregate(False),
            "MIN": check_agg_minmax,
            "MAX": check_agg_minmax,
        }[name]
        try:
            result, _ = check([built])
        except Invalid as exc:
            raise Invalid(f"{name}(): {exc}") from None
        return Node("agg", result, (built, *groups), name, True)


def _reads_joined(node: Node, rules: Mapping[str, Node]) -> bool:
    """Whether ``node`` (or a rule it uses) reads a tenant aggregate or a lookup: values
    joined to the rows, which a lookup's key cannot wait for."""
    stack, seen = [node], set()
    while stack:
        item = stack.pop()
        if item.op in ("agg", "lookup"):
            return True
        if item.op == "ref" and item.value not in seen and item.value in rules:
            seen.add(item.value)
            stack.append(rules[item.value])
        stack.extend(item.args)
    return False


def _count_args(function: Function, given: int) -> None:
    if given < function.min_args or (function.max_args is not None and given > function.max_args):
        if function.max_args is None:
            expected = f"at least {function.min_args}"
        elif function.min_args == function.max_args:
            expected = str(function.min_args)
        else:
            expected = f"{function.min_args} to {function.max_args}"
        raise Invalid(f"{function.name}() takes {expected} arguments, got {given}")


def _has_aggregate(node: Node) -> bool:
    return any(item.op == "agg" for item in node.walk())
