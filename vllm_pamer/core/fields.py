"""The docstrings of a typed config's fields (the string literal under each
annotated field), read from the source: the one description of each setting,
for ``--help``, the README check and the tests that every field has one."""

from __future__ import annotations

import ast
import inspect
import itertools
import textwrap
from functools import cache


@cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of ``cls`` and its bases (a subclass's own
    docstring of a field wins); fields without one are absent."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or klass.__module__ == "builtins" or klass.__module__.startswith("msgspec"):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        if not isinstance(body, ast.ClassDef):
            continue
        statements = body.body
        for node, following in itertools.pairwise(statements):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs
