"""The shell and Python examples of the README and ``docs/``, read from their fenced blocks.

Each ``bash`` or ``python`` block follows a one-line HTML comment that says how it runs (a
reader of the rendered page does not see it):

- ``<!-- example: PIPELINE -->``: against a server of that built-in pipeline (started with
  ``--enable-sleep-mode``), the blocks of one pipeline in document order (the README first),
  each request answered 2xx;
- ``<!-- example: PIPELINE; expect 200 503 -->``: the block's HTTP requests answer those
  statuses, in order (an example that shows an error);
- ``<!-- example: not run: REASON -->``: not run here (a real checkpoint, GPUs, a cluster,
  code to add to the package), and why.

A block's lines that start the server (``make serve``, ``omnistage serve ...``) are the server
the harness started: they must name its pipeline and are not run again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LANGUAGES = ("bash", "python")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_MARKER = re.compile(r"<!-- example: (.*?) -->\s*$")
SERVE_LINE = re.compile(
    r"^\s*(make serve|(?:\.venv/bin/)?omnistage serve)\b(.*?)(?:&\s*)?(?:#.*)?$"
)


@dataclass(frozen=True)
class Example:
    doc: str  # relative to the repository
    line: int  # of the opening fence
    language: str
    body: str
    marker: str | None  # the comment's text, None when there is none

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.marker is not None and not self.marker.startswith("not run")

    @property
    def pipeline(self) -> str:
        return (self.marker or "").split(";")[0].strip()

    @property
    def expected(self) -> list[int] | None:
        """The statuses the block's requests answer, in order; None: every one 2xx."""
        for part in (self.marker or "").split(";")[1:]:
            words = part.split()
            if words and words[0] == "expect":
                return [int(w) for w in words[1:]]
        return None


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def examples() -> list[Example]:
    """Every ``bash`` and ``python`` block, README first, then ``docs/`` by name."""
    found = []
    for path in documents():
        text = path.read_text()
        for match in _FENCE.finditer(text):
            if match.group(1) not in LANGUAGES:
                continue
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = _MARKER.search(before)
            found.append(
                Example(
                    doc=str(path.relative_to(ROOT)),
                    line=text[: match.start()].count("\n") + 1,
                    language=match.group(1),
                    body=match.group(2),
                    marker=marker.group(1).strip() if marker else None,
                )
            )
    return found


def served_pipeline(line: str) -> str | None:
    """The pipeline a server-starting line serves (``make serve`` serves tiny-omni unless it
    says ``PIPELINE=``); None for any other line."""
    match = SERVE_LINE.match(line)
    if match is None:
        return None
    args = match.group(2)
    if match.group(1) == "make serve":
        named = re.search(r"PIPELINE=(\S+)", args)
        return named.group(1) if named else "tiny-omni"
    named = re.search(r"--pipeline[ =](\S+)", args)
    return named.group(1) if named else ""
