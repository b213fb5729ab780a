"""Find the code blocks of the docs and README and how each one runs (see docs/contributing.md).

A code block is tagged by a comment right before it (blank lines between are allowed)::

    <!-- test: torchrun 4 -->              Markdown (MyST)
    .. test: torchrun 4                    reStructuredText

The first word is the mode, the rest its argument:

``python``        run the block as a script in a fresh process
``torchrun N``    run it as a script on N processes with torchrun's environment (gloo on
                  loopback), forked from one interpreter that has imported torch
``doctest``       run its ``>>>`` lines with :mod:`doctest` and compare their output
``console``       run each ``$ command`` line and compare its output with the lines below it
``shell``         run the block with bash; it must exit with status 0
``file NAME``     write the block to ``NAME`` for the later blocks of the same page
``skip REASON``   not run; the reason is listed by the test

``needs=MODULE`` anywhere in the tag skips the block (saying why) where ``MODULE`` does not
import: for examples of other libraries. ``continue`` after ``python`` or ``torchrun N`` runs
the page's previous runnable block first, in the same process (a page can build an example up
over several blocks). Lines after the tag in
the same comment (indented in reStructuredText) are setup code run before the block and not
shown in the docs. Every block runs in a fresh directory of its own, where the page's earlier
``file`` blocks have been written and ``examples`` and ``benchmarks`` of the repository are
linked, with the repository on ``PYTHONPATH``.

Blocks in ``text`` (or with no language) are diagrams, plans and printed output: they need no
tag. A block in a language that runs (Python, shell, console) without a tag is an error, and so
is an reStructuredText literal block (``::``): write ``.. code-block:: text`` for those.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Block", "DocError", "blocks", "pages", "ROOT"]

ROOT = Path(__file__).resolve().parent.parent

MODES = ("python", "torchrun", "doctest", "console", "shell", "file", "skip")
CODE_LANGUAGES = {"python", "py", "pycon", "bash", "sh", "shell", "console", "sh-session"}
TEXT_LANGUAGES = {"", "text", "none", "output"}
DIRECTIVES = {"include"}  # MyST directives written as fences (``{include}``): not code

_MD_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*\{?([\w+-]*)\}?\s*(.*)$")
_MD_TAG = re.compile(r"^\s*<!--\s*test:\s*(.*?)\s*(-->)?\s*$")
_RST_TAG = re.compile(r"^\.\. test:\s*(.*?)\s*$")
_RST_CODE = re.compile(r"^(\s*)\.\. (?:code-block|code|sourcecode)::\s*([\w+-]*)\s*$")


class DocError(ValueError):
    """A block whose tag is missing or malformed."""


@dataclass
class Block:
    """One code block: where it is, its language and text, and how it runs."""

    page: str
    line: int
    language: str
    text: str
    mode: str = ""
    argument: str = ""
    setup: str = ""
    previous: Block | None = None
    files: dict[str, str] = field(default_factory=dict)
    needs: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.mode in ("python", "torchrun", "doctest", "console", "shell")

    def script(self) -> str:
        """The code a ``python`` or ``torchrun`` block runs: earlier blocks it continues, its
        setup, and its own text."""
        parts = [] if self.previous is None else [self.previous.script()]
        return "\n".join([*parts, self.setup, self.text])

    def processes(self) -> int:
        return int(self.argument.split()[0]) if self.mode == "torchrun" else 1


def _parse_tag(tag: str, where: str) -> tuple[str, str, bool, list[str]]:
    words = tag.split()
    needs = [w.removeprefix("needs=") for w in words if w.startswith("needs=")]
    words = [w for w in words if not w.startswith("needs=")]
    if not words or words[0] not in MODES:
        raise DocError(f"{where}: a test tag starts with one of {', '.join(MODES)} (got {tag!r})")
    mode, rest = words[0], words[1:]
    follow = bool(rest) and rest[-1] == "continue" and mode in ("python", "torchrun")
    if follow:
        rest = rest[:-1]
    argument = " ".join(rest)
    if mode == "torchrun" and not (rest and rest[0].isdigit()):
        raise DocError(f"{where}: 'torchrun' needs a number of processes, e.g. 'torchrun 2'")
    if mode in ("file", "skip") and not argument:
        raise DocError(f"{where}: '{mode}' needs an argument (a file name or a reason)")
    return mode, argument, follow, needs


def _dedent(lines: list[str]) -> str:
    body = [ln for ln in lines if ln.strip()]
    indent = min((len(ln) - len(ln.lstrip()) for ln in body), default=0)
    return "\n".join(ln[indent:] for ln in lines).strip("\n") + "\n"


def _markdown(page: str, lines: list[str]) -> list[tuple[Block, str | None, str]]:
    found: list[tuple[Block, str | None, str]] = []
    tag: str | None = None
    setup: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _MD_TAG.match(line)
        if m:
            tag, setup = m.group(1), []
            if not m.group(2):  # setup lines up to the closing -->
                i += 1
                while i < len(lines) and lines[i].strip() != "-->":
                    setup.append(lines[i])
                    i += 1
            i += 1
            continue
        fence = _MD_FENCE.match(line)
        if fence:
            indent, marker, language = fence.group(1), fence.group(2), fence.group(3).lower()
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(marker):
                body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
                i += 1
            block = Block(page, start, language, "\n".join(body) + "\n")
            found.append((block, tag, _dedent(setup) if setup else ""))
            tag, setup = None, []
            i += 1
            continue
        if line.strip() and tag is not None:
            raise DocError(f"{page}:{i + 1}: a test tag must come right before a code block")
        i += 1
    return found


def _indented(lines: list[str], i: int) -> tuple[list[str], int]:
    """The indented lines from ``i`` on (blank lines inside kept); the index after them."""
    body: list[str] = []
    while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
        body.append(lines[i])
        i += 1
    while body and not body[-1].strip():
        body.pop()
    return body, i


def _rst(page: str, lines: list[str]) -> list[tuple[Block, str | None, str]]:
    found: list[tuple[Block, str | None, str]] = []
    tag: str | None = None
    setup: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _RST_TAG.match(line)
        if m:
            tag = m.group(1)
            setup, i = _indented(lines, i + 1)
            continue
        code = _RST_CODE.match(line)
        if code:
            j = i + 1
            while j < len(lines) and lines[j].strip().startswith(":"):
                j += 1  # directive options
            body, after = _indented(lines, j)
            block = Block(page, j + 2, code.group(2).lower(), _dedent(body))
            found.append((block, tag, _dedent(setup) if setup else ""))
            tag, setup, i = None, [], after
            continue
        stripped = line.rstrip()
        if stripped.endswith("::") and not stripped.lstrip().startswith(".."):
            body, after = _indented(lines, i + 1)
            if body:
                raise DocError(
                    f"{page}:{i + 1}: a literal block ('::') cannot be tagged; write "
                    f"'.. code-block:: text' for a diagram or output, or a tagged "
                    f"'.. code-block:: python' / 'bash' for code"
                )
        if line.strip() and tag is not None:
            raise DocError(f"{page}:{i + 1}: a test tag must come right before a code-block")
        i += 1
    return found


def pages() -> list[Path]:
    """Every page of the docs, and the README."""
    docs = ROOT / "docs"
    return [*sorted(docs.glob("*.md")), *sorted(docs.glob("*.rst")), ROOT / "README.md"]


def blocks(page: Path, root: Path = ROOT) -> list[Block]:
    """The code blocks of one page with their tags; raise :class:`DocError` listing every
    block that is not tagged or tagged wrongly. Blocks are named by their path from ``root``."""
    name = str(page.relative_to(root))
    lines = page.read_text().splitlines()
    raw = _markdown(name, lines) if page.suffix == ".md" else _rst(name, lines)
    problems: list[str] = []
    result: list[Block] = []
    files: dict[str, str] = {}
    last: Block | None = None
    for block, tag, setup in raw:
        block.setup = setup
        block.files = dict(files)
        if tag is None:
            if block.language in CODE_LANGUAGES:
                problems.append(
                    f"{block.name}: a {block.language} block without a test tag; put "
                    f"'<!-- test: MODE -->' (Markdown) or '.. test: MODE' (reST) before it"
                )
            elif block.language not in TEXT_LANGUAGES | DIRECTIVES:
                problems.append(f"{block.name}: unknown language {block.language!r}")
            result.append(block)
            continue
        try:
            block.mode, block.argument, follow, block.needs = _parse_tag(tag, block.name)
        except DocError as e:
            problems.append(str(e))
            continue
        if follow:
            if last is None:
                problems.append(f"{block.name}: 'continue' with no runnable block before it")
            block.previous = last
        if block.mode in ("python", "torchrun"):
            last = block
        if block.mode == "file":
            files[block.argument] = block.text
        result.append(block)
    if problems:
        raise DocError("\n".join(problems))
    return result


def main() -> int:
    """Print every block and how it runs: ``python tests/docblocks.py``."""
    status = 0
    for page in pages():
        try:
            found = blocks(page)
        except DocError as e:
            print(e)
            status = 1
            continue
        for block in found:
            how = f"{block.mode} {block.argument}".strip() or f"not run ({block.language})"
            print(f"{block.name:32} {how}")
    return status


if __name__ == "__main__":
    sys.exit(main())
