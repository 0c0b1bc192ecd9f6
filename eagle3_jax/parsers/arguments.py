"""A call's arguments read as the JSON object they are, or the one a reader sees in them.

Arguments are JSON as RFC 8259 writes it (`loads`): NaN and Infinity, which Python's json takes,
are refused, as a client's JSON parser would refuse them. Models write arguments that are almost
JSON: Python's literals (`'city'`, `True`, `None`), a comma before the closing brace, unquoted
keys, a fence around them, or the closing braces left out before the call's end marker. Each of
those has one reading, so it is repaired (`object_text`). What has more than one reading is not
guessed: a string that never ends (the value was cut short), a bare word as a value, NaN or
Infinity, text after the object.
"""

from __future__ import annotations

import json
import re
from typing import Any


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant)


def loads(text: str) -> Any:
    """`text` as strict JSON; ValueError (json.JSONDecodeError included) or RecursionError if it is not."""
    return STRICT_JSON.decode(text)


def arguments_text(value: Any) -> str | None:
    """A call's arguments as JSON object text: an object as JSON, text as `object_text` reads it;
    None when it is neither."""
    if isinstance(value, str):
        return object_text(value)
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return None


_FENCE = re.compile(r"\A\s*```[a-zA-Z]*\s*\n?(?P<body>.*?)\s*(?:```)?\s*\Z", re.S)  # its end may be left out
_PYTHON_WORDS = {"True": "true", "False": "false", "None": "null", "true": "true", "false": "false",
                 "null": "null"}
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?(?![A-Za-z0-9_])")
_CLOSERS = {"{": "}", "[": "]"}


def object_text(text: str) -> str | None:
    """The arguments in `text` as JSON object text: `text` itself (stripped) when it is a JSON
    object, else the repaired text, None when it does not read as one object."""
    try:
        parsed = loads(text)
    except (ValueError, RecursionError):
        parsed = None
    if isinstance(parsed, dict):
        return text.strip()
    fenced = _FENCE.match(text)
    repaired = _repaired(fenced["body"] if fenced else text)
    if repaired is None:
        return None
    try:
        parsed = loads(repaired)
    except (ValueError, RecursionError):
        return None
    return repaired if isinstance(parsed, dict) else None


def _quoted(body: str) -> str:
    """A single-quoted string's body as a JSON string literal."""
    return json.dumps(re.sub(r"\\(.)", lambda m: m[1] if m[1] in "'\"" else m[0], body), ensure_ascii=False)[1:-1]


def _repaired(text: str) -> str | None:
    """`text` rewritten token by token into JSON: single-quoted strings double-quoted, Python's
    literals as JSON's, bare keys quoted, commas before a closer dropped, missing closers added at
    the end. None when a string never ends or a bare word is a value."""
    text = text.strip()
    out: list[str] = []  # the JSON written so far, a token (or a blank) per item
    stack: list[str] = []  # the closers owed
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":  # a string: copied, single quotes turned double
            j, escaped = i + 1, False
            while j < n and (escaped or text[j] != c):
                escaped = not escaped and text[j] == "\\"
                j += 1
            if j >= n:
                return None  # never ends: cut short, no single reading
            out.append(text[i:j + 1] if c == '"' else '"' + _quoted(text[i + 1:j]) + '"')
            i = j + 1
        elif c in "{[":
            stack.append(_CLOSERS[c])
            out.append(c)
            i += 1
        elif c in "}]":
            if not stack or stack.pop() != c:
                return None
            _drop_trailing_comma(out)
            out.append(c)
            i += 1
        elif (token := _NUMBER.match(text, i) or _WORD.match(text, i)) is not None:
            word = token[0]
            if token.re is _NUMBER:
                out.append(word)
            elif stack and stack[-1] == "}" and text[token.end():].lstrip().startswith(":") and _expects_key(out):
                out.append(json.dumps(word))  # a bare key
            elif word in _PYTHON_WORDS:
                out.append(_PYTHON_WORDS[word])
            else:
                return None  # a bare word as a value (NaN, Infinity, an unquoted string)
            i = token.end()
        else:
            out.append(c)
            i += 1
    if _last(out) == ":":
        return None  # a key without its value
    _drop_trailing_comma(out)
    return "".join(out) + "".join(reversed(stack))


def _last(out: list[str]) -> str:
    """The last token written, blanks skipped."""
    return next((item for item in reversed(out) if not item.isspace()), "")


def _expects_key(out: list[str]) -> bool:
    """Whether the JSON written so far stands where an object's key goes (after `{` or `,`)."""
    return _last(out) in ("{", ",")


def _drop_trailing_comma(out: list[str]) -> None:
    """Drop a `,` (and the blanks after it) that the text has just before a closer or its end."""
    while out and out[-1].isspace():
        out.pop()
    if out and out[-1] == ",":
        out.pop()
