"""Text helpers of the native script (:mod:`explorer.runtime.native_script`): values a plan
file holds, written so that none of it is ever read as code."""

from __future__ import annotations

import json
import re
import textwrap

__all__ = ["listed", "literal", "words"]


def listed(name: str, items: tuple[str, ...]) -> list[str]:
    """``NAME = [...]`` of ``items`` as string literals: one line where it fits in 100
    characters, else wrapped."""
    one = f"{name} = [{', '.join(literal(x) for x in items)}]"
    return [one] if len(one) <= 100 else [f"{name} = [", *textwrap.wrap(
        " ".join(f"{literal(x)}," for x in items), 96, initial_indent="    ",
        subsequent_indent="    ", break_long_words=False, break_on_hyphens=False), "]"]


def words(text: str) -> str:
    """``text`` for a docstring: letters, digits and ``_.:=+-`` and spaces kept, anything else
    (quotes, backslashes, line breaks) left out."""
    return re.sub(r"[^A-Za-z0-9_.:=+ -]", "", str(text))[:80] or "-"


def literal(text: str) -> str:
    """``text`` as a Python string literal in double quotes."""
    return json.dumps(str(text))
