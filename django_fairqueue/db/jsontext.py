"""JSON text as the queue stores it: floats that come back as floats.

jsonb keeps a number as ``numeric``. Python writes the float ``1e20`` as ``1e+20``, which
jsonb prints back as ``100000000000000000000``, an int to ``json.loads``; written as
``100000000000000000000.0`` it keeps its scale and reads back as the same float. Payloads
(arguments) and results (return values) are both written so.

Read back, jsonb comes in PostgreSQL's binary format (see ``db.pg``) and is decoded by
:class:`JsonbLoader`.
"""

from __future__ import annotations

import json
import re
from json.decoder import JSONDecoder
from json.scanner import make_scanner
from typing import Any

from psycopg import errors, pq
from psycopg.abc import Buffer
from psycopg.adapt import Loader

# A JSON string, or a number written with a positive exponent.
_STRING_OR_BIG_FLOAT = re.compile(r'"(?:[^"\\]|\\.)*"|(-?\d+(?:\.\d+)?e\+\d+)')


def keep_big_floats(text: str) -> str:
    """``text`` (JSON) with every number written with a positive exponent written out whole
    with ``.0``; strings are left as they are."""

    def fix(match: re.Match[str]) -> str:
        number = match.group(1)
        if number is None:
            return match.group(0)  # a string: left as it is
        return f"{int(float(number))}.0"  # exact: such a float is a whole number

    return _STRING_OR_BIG_FLOAT.sub(fix, text)


def dumps(value: Any) -> str:
    """``json.dumps`` for a value to store as jsonb (a result), its big floats kept floats."""
    text = json.dumps(value, ensure_ascii=False)
    return keep_big_floats(text) if "e+" in text else text


# The json module's own scanner (its C implementation), with json.loads's defaults.
# (typeshed types make_scanner's argument as itself; it takes the decoder whose options it reads)
_scan = make_scanner(JSONDecoder())  # type: ignore[arg-type]


class JsonbLoader(Loader):
    """jsonb in binary format (a version byte, then the JSON text) to Python values.

    psycopg's ``JsonbBinaryLoader`` hands the text to ``json.loads`` as bytes, whose encoding
    detection and argument checks cost about 5 us of the 7 a small payload takes (some 6% of
    a worker's CPU per no-op message). The text PostgreSQL writes is one JSON value, UTF-8,
    with no surrounding blanks, so the scanner alone reads it as ``json.loads`` would.
    """

    format = pq.Format.BINARY

    def load(self, data: Buffer) -> Any:
        if data[0] != 1:
            raise errors.DataError(f"unknown jsonb binary format: {data[0]}")
        return _scan(str(data[1:], "utf-8"), 0)[0]


# JSON's escape of U+0000: `\u0000` after an even number of backslashes (an odd number means
# the backslash itself is escaped and the text is a literal backslash followed by "u0000").
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def has_nul(text: str) -> bool:
    """Whether ``text`` (JSON) holds the character U+0000, which jsonb cannot store; a
    backslash followed by "u0000" in a string is text, not that character."""
    return "\\u0000" in text and _ESCAPED_NUL.search(text) is not None
