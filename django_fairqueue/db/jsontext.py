"""JSON text as the queue stores it: floats that come back as floats.

jsonb keeps a number as ``numeric``. Python writes the float ``1e20`` as ``1e+20``, which
jsonb prints back as ``100000000000000000000``, an int to ``json.loads``; written as
``100000000000000000000.0`` it keeps its scale and reads back as the same float. Payloads
(arguments) and results (return values) are both written so.
"""

from __future__ import annotations

import json
import re
from typing import Any

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
