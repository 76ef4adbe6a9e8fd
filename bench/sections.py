"""Sections of a Markdown file that a bench tool owns: the text between the lines
`<!-- bench:NAME:begin -->` and `<!-- bench:NAME:end -->`. A writer replaces what lies between
its own two markers and nothing else: no pattern is ever substituted across the document, and a
file without the markers, or with one of them missing, repeated or out of order, is refused
(SectionError) rather than guessed at. Issue 18, item 9: a writer that matched text instead of
markers overwrote the README's links to docs/ETCD.md with a benchmark sentence.
"""

from __future__ import annotations

import re
from pathlib import Path

_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")


class SectionError(ValueError):
    """The markers of a section are missing, repeated or out of order."""


def markers(name: str) -> tuple[str, str]:
    if not _NAME.fullmatch(name):
        raise SectionError(f"section name {name!r}: lowercase letters, digits and '-' only")
    return f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"


def _lines_at(text: str, marker: str) -> list[int]:
    """Offsets of every occurrence of `marker`; each must be a line of its own."""
    found, i = [], text.find(marker)
    while i >= 0:
        j = i + len(marker)
        if (i > 0 and text[i - 1] != "\n") or (j < len(text) and text[j] != "\n"):
            raise SectionError(f"{marker} must be a line of its own (at offset {i})")
        found.append(i)
        i = text.find(marker, j)
    return found


def span(text: str, name: str) -> tuple[int, int] | None:
    """(start, end) of the section's content: from after the begin line to the end marker.
    None when neither marker is there; SectionError when the pair is broken."""
    begin, end = markers(name)
    b, e = _lines_at(text, begin), _lines_at(text, end)
    if not b and not e:
        return None
    if len(b) != 1 or len(e) != 1:
        raise SectionError(f"section {name!r}: {len(b)} begin and {len(e)} end markers, expected one each")
    start = b[0] + len(begin) + 1
    if e[0] < start:
        raise SectionError(f"section {name!r}: the end marker comes before the begin marker")
    return start, e[0]


def get(text: str, name: str) -> str | None:
    """The section's content (without its markers); None when the file has no such section."""
    s = span(text, name)
    return None if s is None else text[s[0]:s[1]]


def block(name: str, content: str) -> str:
    """The section with its markers, as a writer emits it into a file it generates whole."""
    begin, end = markers(name)
    return f"{begin}\n{_padded(content)}{end}\n"


def _padded(content: str) -> str:
    """Content as it sits between the markers: its own lines, then a blank line (so Markdown ends
    a table or list before the end marker); nothing at all for an empty section."""
    content = content.strip("\n")
    return content + "\n\n" if content else ""


def put(text: str, name: str, content: str) -> str:
    """`text` with the content of section `name` replaced by `content`; every byte outside the
    section's markers is kept. Refuses (SectionError) a text without the section."""
    s = span(text, name)
    if s is None:
        raise SectionError(f"section {name!r}: no {markers(name)[0]} marker; add the marker pair where the "
                           "section belongs (the writer never guesses)")
    for other in ("begin", "end"):
        if f"<!-- bench:{name}:{other} -->" in content:
            raise SectionError(f"section {name!r}: the new content carries its own markers")
    new = text[:s[0]] + _padded(content) + text[s[1]:]
    # Nothing outside the markers moved (a guard against this function itself).
    if new[:s[0]] != text[:s[0]] or not new.endswith(text[s[1]:]):
        raise SectionError(f"section {name!r}: the writer would touch text outside its markers")
    return new


def update_file(path: Path, name: str, content: str) -> None:
    """Writes `content` into section `name` of the file at `path`, which must exist and hold the
    section's markers."""
    path.write_text(put(path.read_text(), name, content))
