"""Random text edits shared by the parser fuzz tests (hypothesis strategies build on `edit`)."""

from __future__ import annotations

import random

from hypothesis import strategies as st

EDIT_OPS = ("delete_line", "duplicate_line", "swap", "replace", "insert", "truncate")


def edit(text: str, op: str, draw, rnd: random.Random, special: str) -> str:
    """`text` after one edit `op` at a uniformly random position (`rnd`); `special` feeds insertions."""
    lines = text.split("\n")
    i = rnd.randrange(max(len(text), 1))
    if op in ("delete_line", "duplicate_line"):
        k = rnd.randrange(len(lines))
        lines[k : k + 1] = [] if op == "delete_line" else [lines[k], lines[k]]
        return "\n".join(lines)
    if op == "swap" and len(text) > 1:
        i = min(i, len(text) - 2)
        return text[:i] + text[i + 1] + text[i] + text[i + 2 :]
    if op in ("replace", "insert"):
        c = draw(st.sampled_from(special) | st.characters())
        return text[:i] + c + text[i + (op == "replace") :]
    if op == "truncate":
        return text[:i]
    return text
