"""Griffe extension for the API pages: two habits of the docstrings that Markdown and the
Google-style parser would print badly, fixed at build time. The docstrings themselves stay as
they are (help() and IDEs show them unchanged).

* Sphinx roles (:func:`probe`, :class:`~normfast.encoders.Encoder`) become code spans of the
  name a reader types (``~`` drops the module path, as in Sphinx).
* An entry naming several parameters at once (``lr, weight_decay: η and λ of the law``) becomes
  one entry per name with the shared description, so each gets its own type and default.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|obj|exc|const):`(~?)([^`]+)`")
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Attributes|Parameters|Keyword Args|Other Parameters):\s*$")
_MULTI = re.compile(r"^(\s*)(\w+(?:\s*,\s*\w+)+)(\s*\([^)]*\))?:(.*)$")


def plain_roles(text: str) -> str:
    """``:role:`~a.b.c``` -> ```c```, ``:role:`a.b``` -> ```a.b```."""

    def span(m: re.Match) -> str:
        name = m.group(2)
        return f"`{name.rsplit('.', 1)[-1] if m.group(1) else name}`"

    return _ROLE.sub(span, text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def split_shared_entries(text: str) -> str:
    """In Args/Attributes sections, ``a, b: text`` -> ``a: text`` and ``b: text``."""
    lines = text.splitlines()
    out: list[str] = []
    section_indent = None
    i = 0
    while i < len(lines):
        line = lines[i]
        head = _SECTION.match(line)
        if head:
            section_indent = len(head.group(1))
        elif line.strip() and section_indent is not None and _indent(line) <= section_indent:
            section_indent = None
        multi = _MULTI.match(line) if section_indent is not None else None
        if not multi:
            out.append(line)
            i += 1
            continue
        item_indent = len(multi.group(1))
        body = [multi.group(4)]
        i += 1
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > item_indent):
            if not lines[i].strip() and (i + 1 >= len(lines) or _indent(lines[i + 1]) <= item_indent):
                break
            body.append("\n" + lines[i])
            i += 1
        for name in re.split(r"\s*,\s*", multi.group(2)):
            out.append(f"{multi.group(1)}{name}{multi.group(3) or ''}:{''.join(body)}")
    return "\n".join(out)


class DocstringsForMarkdown(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = split_shared_entries(plain_roles(obj.docstring.value))
