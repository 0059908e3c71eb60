"""Spreadsheet format codes (the second argument of ``TEXT``), read into a small description.

Pure Python: :mod:`.formula_catalog` refuses a code this module cannot read when a formula is
checked, and :mod:`.sqlexpr` turns the description into Spark SQL. The subset (the how-to's
TEXT table lists it): ``General``; ``@``; number codes made of ``0`` (a digit, shown even if
zero), ``#`` (a digit, left out if an unneeded zero), ``,`` (thousands separators, or, after
the last digit, a thousandth), ``.``, ``%`` (a hundredth, shown), ``E+00`` (scientific); date
and time codes ``yy yyyy m mm mmm mmmm d dd ddd dddd h hh m mm s ss AM/PM`` (``m`` after
``h`` or before ``s`` is minutes); any other text in double quotes, after a backslash, or one
of ``$ - + / ( ) : ! ^ & ' ~ { } < > =`` and space, shown as written. Not read: sections
(``;``), colours and conditions (``[...]``), fractions (``?``), fill and padding (``*``, ``_``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LITERAL_CHARS = set("$-+/():!^&'~{}<>= ")
_UNSUPPORTED = ((";", "sections (;)"), ("[", "colours and conditions ([...])"),
                ("?", "fractions (?)"), ("*", "fill (*)"), ("_", "padding (_)"))  # fmt: skip


@dataclass(frozen=True)
class General:
    """``General``: a number as :func:`.sqlexpr.number_text` shows it."""


@dataclass(frozen=True)
class Text:
    """``@``: the value as text."""


@dataclass(frozen=True)
class NumberFormat:
    prefix: str
    suffix: str
    integer_zeros: int  # digits always shown before the point (0 for "#.00": ".50")
    decimals: int  # digits always shown after the point
    optional_decimals: int  # "#" after the point: shown unless trailing zeros
    point: bool  # a "." in the code (shown even with no digit after it, as "0." does)
    grouping: bool  # "#,##0"
    scale: int  # powers of 1000 divided out by trailing commas ("0,": thousands)
    percent: bool  # a "%" anywhere: times 100
    scientific: bool  # "0.00E+00"


@dataclass(frozen=True)
class DateFormat:
    """A Java date-time pattern (Spark's ``date_format``), literals quoted."""

    pattern: str


Format = General | Text | NumberFormat | DateFormat

_DATE_TOKEN = re.compile(r"am/pm|yyyy|yyy|yy|y|mmmm|mmm|mm|m|dddd|ddd|dd|d|hh|h|ss|s", re.I)


def parse(code: str) -> Format:
    """The format ``code`` describes; ``ValueError`` (the reason) for a code outside the subset."""
    if code.strip().lower() == "general":
        return General()
    if code == "@":
        return Text()
    for char, what in _UNSUPPORTED:
        if char in _outside_quotes(code):
            raise ValueError(f"TEXT's format: {what} are not supported")
    plain = _outside_quotes(code)
    if re.search(r"[0#]", plain):
        return _number(code)
    if re.search(r"[ymdhs]", plain, re.I):
        return _date(code)
    raise ValueError("TEXT's format has no digit (0, #) and no date code (y, m, d, h, s)")


def _outside_quotes(code: str) -> str:
    """The code without its quoted and backslash-escaped text."""
    return re.sub(r'"[^"]*"|\\.', "", code)


def _tokens(code: str) -> list[tuple[str, str]]:
    """(kind, text): kind "lit" for literal text, "code" for one character of the code."""
    tokens: list[tuple[str, str]] = []
    i = 0
    while i < len(code):
        char = code[i]
        if char == '"':
            end = code.find('"', i + 1)
            if end < 0:
                raise ValueError("TEXT's format has an unclosed quote")
            tokens.append(("lit", code[i + 1 : end]))
            i = end + 1
        elif char == "\\" and i + 1 < len(code):
            tokens.append(("lit", code[i + 1]))
            i += 2
        else:
            tokens.append(("code", char))
            i += 1
    return tokens


def _number(code: str) -> NumberFormat:
    prefix, digits, suffix = "", "", ""
    percent = False
    for kind, text in _tokens(code):
        if kind == "code" and (text in "0#.," or (digits and text in "E+-" and "E" in
                                                   digits + text)):  # fmt: skip
            if suffix:
                raise ValueError("TEXT's format has digits on both sides of other text")
            digits += text
        elif kind == "lit" or text in _LITERAL_CHARS or text == "%":
            percent = percent or (kind == "code" and text == "%")  # shown where written
            if digits:
                suffix += text
            else:
                prefix += text
        else:
            raise ValueError(f"TEXT's format: {text!r} is not a number format code")
    match = re.fullmatch(r"([0#,]*?)(,*)(?:(\.)([0#]*))?(E\+0+)?", digits)
    if match is None:
        raise ValueError(f"TEXT's format: cannot read the number code {digits!r}")
    integer, commas, point, fraction, exponent = match.groups()
    fraction = fraction or ""
    if re.search(r"#.*0", fraction.replace(",", "")) or "," in fraction:
        raise ValueError("TEXT's format: after the point, 0s come before #s")
    return NumberFormat(
        prefix=prefix,
        suffix=suffix,
        integer_zeros=integer.count("0"),
        decimals=fraction.count("0"),
        optional_decimals=fraction.count("#"),
        point=point is not None,
        grouping="," in integer.strip(","),
        scale=len(commas) if not exponent else 0,
        percent=percent,
        scientific=exponent is not None,
    )


def _date(code: str) -> DateFormat:
    pieces: list[tuple[str, str]] = []  # (kind, text): "lit" or a lower-case date token
    for kind, text in _tokens(code):
        if kind == "lit":
            pieces.append(("lit", text))
            continue
        pieces.append(("code", text))
    # Join the code characters back and cut them into date tokens.
    joined: list[tuple[str, str]] = []
    buffer = ""
    for kind, text in [*pieces, ("lit", "")]:
        if kind == "code":
            buffer += text
            continue
        joined += _date_tokens(buffer)
        buffer = ""
        if text:
            joined.append(("lit", text))
    twelve_hour = any(text == "am/pm" for kind, text in joined if kind == "tok")
    pattern = ""
    tokens = joined
    literal = ""
    for index, (kind, text) in enumerate(tokens):
        if kind == "lit":
            literal += text
            continue
        if literal:  # a run of literal text, quoted once (adjacent quotes would be a ' char)
            pattern += "'" + literal.replace("'", "''") + "'"
            literal = ""
        if text in ("m", "mm") and _is_minute(tokens, index):
            pattern += "m" * len(text)
            continue
        pattern += _DATE_PATTERN[text] if text[0] != "h" else (
            text.replace("h", "h" if twelve_hour else "H")
        )  # fmt: skip
    if literal:
        pattern += "'" + literal.replace("'", "''") + "'"
    return DateFormat(pattern=pattern)


_DATE_PATTERN = {
    "yyyy": "yyyy", "yyy": "yyyy", "yy": "yy", "y": "yy",
    "mmmm": "MMMM", "mmm": "MMM", "mm": "MM", "m": "M",
    "dddd": "EEEE", "ddd": "EEE", "dd": "dd", "d": "d",
    "ss": "ss", "s": "s", "am/pm": "a",
}  # fmt: skip


def _date_tokens(text: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    at = 0
    while at < len(text):
        match = _DATE_TOKEN.match(text, at)
        if match is not None:
            found.append(("tok", match.group(0).lower()))
            at = match.end()
        elif text[at] in _LITERAL_CHARS or text[at] in ".,":
            found.append(("lit", text[at]))
            at += 1
        else:
            raise ValueError(f"TEXT's format: {text[at]!r} is not a date format code")
    return found


def _is_minute(tokens: list[tuple[str, str]], index: int) -> bool:
    """``m``/``mm`` right after an hour or right before seconds (literals between) is minutes."""
    for step in (-1, 1):
        at = index + step
        while 0 <= at < len(tokens) and tokens[at][0] == "lit":
            at += step
        if 0 <= at < len(tokens):
            near = tokens[at][1]
            if (step < 0 and near[0] == "h") or (step > 0 and near[0] == "s"):
                return True
    return False
