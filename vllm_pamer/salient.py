"""Salient values, and what it means for a value to occur in a text.

A *salient value* is defined by ``salient_values`` (identifiers, ids, paths,
dotted names, dates, long numbers, e-mails) plus, for tool-call arguments,
whole argument strings with a capital letter (names, codes); an action "uses"
a value when its text or argument values contain it (``action_values``), and a
value "occurs" in a message when the exact value appears, delimited, in the
message's text (``occurs``, ``message_text``). The reference annotator
(``vllm_pamer.training.annotate``) labels recall and compression by this rule
and the replay (``vllm_pamer.replay``) scores kept evidence by it, so both
import it from here. Its examples and biases are in docs/annotation.md.

Pure: the standard library only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

STOPLIST: frozenset[str] = frozenset(
    {
        # shell plumbing present in almost every command of a coding agent
        "/dev/null",
        "/bin/bash",
        "/bin/sh",
        "/usr/bin/env",
        "/testbed",
        "__init__.py",
        # tau-bench API enumerations: vocabulary of the tool schema (which the
        # recorded trajectories do not keep), not evidence from the history
        "one_way",
        "round_trip",
        "basic_economy",
        "credit_card",
        "gift_card",
    }
)
"""Values that are never salient (ubiquitous plumbing and API vocabulary)."""

PYTHON_BUILTINS: frozenset[str] = frozenset(
    [
        "ArithmeticError",
        "AssertionError",
        "AttributeError",
        "BaseException",
        "BaseExceptionGroup",
        "BlockingIOError",
        "BrokenPipeError",
        "BufferError",
        "BytesWarning",
        "ChildProcessError",
        "ConnectionAbortedError",
        "ConnectionError",
        "ConnectionRefusedError",
        "ConnectionResetError",
        "DeprecationWarning",
        "EOFError",
        "Ellipsis",
        "EncodingWarning",
        "EnvironmentError",
        "Exception",
        "ExceptionGroup",
        "False",
        "FileExistsError",
        "FileNotFoundError",
        "FloatingPointError",
        "FutureWarning",
        "GeneratorExit",
        "IOError",
        "ImportError",
        "ImportWarning",
        "IndentationError",
        "IndexError",
        "InterruptedError",
        "IsADirectoryError",
        "KeyError",
        "KeyboardInterrupt",
        "LookupError",
        "MemoryError",
        "ModuleNotFoundError",
        "NameError",
        "None",
        "NotADirectoryError",
        "NotImplemented",
        "NotImplementedError",
        "OSError",
        "OverflowError",
        "PendingDeprecationWarning",
        "PermissionError",
        "ProcessLookupError",
        "RecursionError",
        "ReferenceError",
        "ResourceWarning",
        "RuntimeError",
        "RuntimeWarning",
        "StopAsyncIteration",
        "StopIteration",
        "SyntaxError",
        "SyntaxWarning",
        "SystemError",
        "SystemExit",
        "TabError",
        "TimeoutError",
        "True",
        "TypeError",
        "UnboundLocalError",
        "UnicodeDecodeError",
        "UnicodeEncodeError",
        "UnicodeError",
        "UnicodeTranslateError",
        "UnicodeWarning",
        "UserWarning",
        "ValueError",
        "Warning",
        "ZeroDivisionError",
    ]
)
"""Python's capitalised built-in names (``ValueError``, ``NotImplemented``; the
builtins module of Python 3.11, frozen here so labels do not depend on the
interpreter): language vocabulary, never evidence. Dropped like ``STOPLIST``."""

_TOKEN_RE = re.compile(
    r"""
      (?P<email>[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)
    | (?P<date>\d{4}-\d{2}-\d{2}(?!\d))
    | (?P<path>(?:~|\.{1,2})?/?[\w.-]+(?:/[\w.-]+)+/?|/[A-Za-z_][\w.-]*)
    | (?P<dotted>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)
    | (?P<number>\d+(?:\.\d+)*(?!\w))
    | (?P<word>\w+)
    """,
    re.VERBOSE,
)
_EXTENSION_RE = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,7}$")
_CAMEL_RE = re.compile(r"[a-z][A-Z]")
_ESCAPE_RE = re.compile(r"\\[nrt]")  # a literal backslash-n in a command separates words


def _is_salient_word(word: str) -> bool:
    """A plain token (letters, digits, underscores) that looks like an identifier."""
    core = word.strip("_")
    has_letter = any(c.isalpha() for c in core)
    has_digit = any(c.isdigit() for c in core)
    if has_letter and has_digit:
        return len(core) >= 4  # HAT136, YAX4DR, mia_li_3668, credit_card_4421486
    if not has_letter:
        return False
    if "_" in core:
        return len(core) >= 6  # snake_case / UPPER_SNAKE identifiers
    return len(core) >= 6 and _CAMEL_RE.search(core) is not None  # camelCase / PascalCase


def _is_salient_number(number: str) -> bool:
    return "." in number or len(number) >= 3


def _is_salient_dotted(name: str) -> bool:
    parts = name.split(".")
    return len(name) >= 4 and max(len(p) for p in parts) >= 2


def _is_salient_path(path: str) -> bool:
    if len(path) < 4 or not any(c.isalpha() for c in path):
        return False
    if path.startswith(("/", "~/", "../")):
        return True
    return _EXTENSION_RE.search(path) is not None or path.count("/") >= 2


def _extract(text: str) -> set[str]:
    found: set[str] = set()
    for match in _TOKEN_RE.finditer(text):
        kind = match.lastgroup
        token = match.group()
        if kind == "email":
            found.add(token.rstrip(".-"))
        elif kind == "date":
            found.add(token)
        elif kind == "path":
            path = token.rstrip(".-/") or token
            if path.startswith("./"):
                path = path[2:]
            if _is_salient_path(path):
                found.add(path)
                parts = [p for p in path.split("/") if p]
                if len(parts) >= 3 and _EXTENSION_RE.search(parts[-1]):
                    found.add("/".join(parts[-2:]))  # dir/file.ext: matches other spellings of the path
        elif kind == "dotted":
            if _is_salient_dotted(token):
                found.add(token)
            found.update(p for p in token.split(".") if _is_salient_word(p))
        elif kind == "number":
            if _is_salient_number(token):
                found.add(token)
        elif _is_salient_word(token):
            found.add(token)
    return found


def salient_values(text: str) -> set[str]:
    """The salient values of a text: exact, case-sensitive strings.

    Scanning left to right, the first rule that matches at a position takes the
    span (so ``2024-05-20`` is one date, not the number ``2024``):

    1. e-mail addresses (``mia.li@example.com``);
    2. ISO dates ``YYYY-MM-DD``;
    3. file paths: a token with ``/`` that is absolute (``/a``, ``~/a``,
       ``../a``), or whose last component has an extension (``a/b.py``), or
       that has 3+ components (``a/b/c``); a leading ``./`` is dropped; a path
       of 3+ components ending in a file also gives its last two components
       (``/testbed/a/b/c.py`` -> ``b/c.py``, which other spellings of the same
       path contain); ``and/or`` is not a path;
    4. dotted names (``module.func``, ``self.serialize_result``, ``b.py``) of
       4+ characters with a component of 2+; each component that is itself an
       identifier (rule 6) is a value too;
    5. numbers with 3+ digits or a decimal point (``122``, ``4421486``,
       ``3.5``); ``19:00`` and ``5`` are not;
    6. identifiers: words mixing letters and digits of 4+ characters
       (``HAT136``, ``YAX4DR``, ``mia_li_3668``, ``Http404``), snake_case
       words of 6+ characters (``serialize_result``, ``INSTALLED_APPS``), and
       camelCase/PascalCase words of 6+ characters (``AutocompleteJsonView``).
       Leading/trailing underscores do not count towards the length
       (``__init__`` is not salient). Plain words (``economy``, ``django``)
       never are.

    Trailing ``.``/``-``/``/`` of paths and e-mails are stripped; a literal
    ``\\n``/``\\t``/``\\r`` (inside a quoted command) separates words; values in
    ``STOPLIST`` and ``PYTHON_BUILTINS`` are dropped.
    """
    return _extract(_ESCAPE_RE.sub(" ", text)) - STOPLIST - PYTHON_BUILTINS


def _content_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    elif value is not None:
        yield value


def argument_leaves(call: Mapping[str, Any]) -> list[Any]:
    """The scalar values of a tool call's arguments (JSON decoded; keys dropped).
    Arguments that are not JSON count as one string."""
    arguments = (call.get("function") or {}).get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return [arguments]
    return list(_leaves(arguments))


def _is_literal(leaf: Any) -> bool:
    """A whole argument string that names something: one token with a capital
    letter (``Noah``, ``Hernandez``, ``BOS``)."""
    return (
        isinstance(leaf, str)
        and 2 <= len(leaf) <= 64
        and not any(c.isspace() for c in leaf)
        and any(c.isupper() for c in leaf)
    )


def action_values(message: Mapping[str, Any]) -> set[str]:
    """V(a): the salient values an assistant action uses - those of its text and
    of its tool-call argument values (not the argument names, not the tool
    name), plus argument strings that are literals (``_is_literal``)."""
    values = salient_values(_content_text(message))
    for call in message.get("tool_calls") or []:
        for leaf in argument_leaves(call):
            if isinstance(leaf, bool):
                continue
            values |= salient_values(str(leaf))
            if _is_literal(leaf) and leaf not in STOPLIST and leaf not in PYTHON_BUILTINS:
                values.add(leaf)
    return values


def message_text(message: Mapping[str, Any]) -> str:
    """The text a value may occur in: the content and the tool-call argument
    values (decoded, so ``\\n`` in a command is a newline). Tool names and call
    ids are not part of it."""
    parts = [_content_text(message)]
    for call in message.get("tool_calls") or []:
        parts.extend(json.dumps(leaf) if isinstance(leaf, bool) else str(leaf) for leaf in argument_leaves(call))
    return "\n".join(p for p in parts if p)


@lru_cache(maxsize=65536)
def _occurrence_re(value: str) -> re.Pattern[str]:
    left = r"(?<!\w)" + (r"(?<!\d[.-])" if value[0].isdigit() else "")
    right = r"(?!\w)" + (r"(?![.-]\d)" if value[-1].isdigit() else "")
    return re.compile(left + re.escape(value) + right)


def occurs(value: str, text: str) -> bool:
    """``value`` appears in ``text`` as a whole: no letter, digit or underscore
    right before or after it, and a number is not part of a longer number or
    date (``122`` does not occur in ``HAT122``, ``122.50`` or ``2024-122``; a
    path occurs inside a longer path that ends with it: ``b/c.py`` in ``/a/b/c.py``)."""
    return value in text and _occurrence_re(value).search(text) is not None
