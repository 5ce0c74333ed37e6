"""Recognise transformers code by what it says, not by its class name.

transformers generates most model files from others ("modular" files): the MoE blocks of
Glm4Moe, Dots1, Kimi-Linear and fifteen more are DeepSeek-V3's, renamed. A class's
*code key* is a short hash of the source of its methods other than ``__init__``
(tokens only: no comments, docstrings or layout), so a renamed copy gets the key of its
original, and a class whose forward changed in a new transformers gets a new key and is
no longer taken for the old one. ``__init__`` is left out because copies differ there in
names only (config class annotations); the attributes it sets are read by name.

Keys come from ``tokenize``, whose token strings are the source text itself, so they do
not change with the Python version (``ast.unparse`` and ``ast.dump`` do).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import io
import textwrap
import tokenize

__all__ = ["code_key"]

_DROP = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
_MARK = {tokenize.NEWLINE: "\n", tokenize.INDENT: ">", tokenize.DEDENT: "<"}


def _tokens(text: str) -> str:
    """The source's tokens joined by spaces, without comments and docstrings."""
    out: list[str] = []
    prev = tokenize.INDENT
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in _DROP:
            continue
        if tok.type == tokenize.STRING and prev == tokenize.INDENT:
            prev = tok.type  # a docstring: the first statement of a block
            continue
        out.append(_MARK.get(tok.type, tok.string))
        prev = tok.type
    return " ".join(out)


@functools.cache
def code_key(obj: type | object) -> str | None:
    """12 hex digits naming the code of a class's methods but ``__init__`` (or of a function);
    None when its source cannot be read (a class defined in a REPL, a C type)."""
    try:
        src = textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return None
    lines = src.splitlines(keepends=True)
    node = ast.parse(src).body[0]
    if isinstance(node, ast.ClassDef):
        defs = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"]
    else:
        defs = [node]
    parts = []
    for d in defs:
        start = min([x.lineno for x in d.decorator_list] + [d.lineno]) - 1
        parts.append(_tokens(textwrap.dedent("".join(lines[start : d.end_lineno]))))
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]
