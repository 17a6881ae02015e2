"""The wording of the results' findings, kept out of the code.

A section's findings (the "Findings" list of its page and the README's lines) are made from
templates in ``benchmarks/results/findings/<section>.md``: each template is a ``## name`` heading
and the paragraph under it, in which ``{value}`` stands for a figure the section computes and
formats (a number with its precision, a count, a list). The code picks which templates apply and
computes the values; rewording a finding edits the template file only. A template's lines are
joined into one line (runs of spaces and newlines become one space). Every ``{value}`` must be
given and every value given must be used: a mismatch is an error naming the template.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

__all__ = ["FOLDER", "finding", "templates"]

FOLDER = Path(__file__).with_name("findings")
_HEADING = re.compile(r"^## (\w+)\s*$", re.MULTILINE)
_VALUE = re.compile(r"\{(\w+)\}")


@functools.cache
def templates(section: str) -> dict[str, str]:
    """The templates of ``findings/<section>.md`` by name, each joined into one line."""
    text = (FOLDER / f"{section}.md").read_text(encoding="utf-8")
    parts = _HEADING.split(text)
    return {
        name: " ".join(body.split()) for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def finding(section: str, name: str, /, **values: object) -> str:
    """The template ``name`` of ``section`` with ``values`` in place of its ``{value}`` fields."""
    template = templates(section)[name]
    fields = set(_VALUE.findall(template))
    if fields != set(values):
        raise KeyError(
            f"findings/{section}.md, ## {name}: fields {sorted(fields)}, values {sorted(values)}"
        )
    return _VALUE.sub(lambda match: str(values[match.group(1)]), template)
