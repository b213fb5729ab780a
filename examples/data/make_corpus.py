"""Build ``stdlib_docs.txt``, the example corpus, from the Python standard library's docstrings.

The corpus is plain ASCII text: the docstrings of a fixed list of standard-library modules and
of the public classes, functions and methods they define, in a fixed order.  The output depends
only on the Python version that runs this script; the committed file was made with CPython 3.11.
Run it from anywhere::

    python examples/data/make_corpus.py            # rewrites examples/data/stdlib_docs.txt
    python examples/data/make_corpus.py --check    # exit 1 if the committed file differs
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

OUTPUT = Path(__file__).resolve().parent / "stdlib_docs.txt"

# Modules are visited in this order until the corpus reaches the size limit.
MODULES: tuple[str, ...] = (
    "textwrap",
    "string",
    "collections",
    "itertools",
    "functools",
    "operator",
    "heapq",
    "bisect",
    "json",
    "csv",
    "argparse",
    "pathlib",
    "shutil",
    "tempfile",
    "fnmatch",
    "glob",
    "re",
    "difflib",
    "datetime",
    "calendar",
    "random",
    "statistics",
    "fractions",
    "decimal",
    "base64",
    "hashlib",
    "hmac",
    "secrets",
    "uuid",
    "zipfile",
    "tarfile",
    "gzip",
    "urllib.parse",
    "http.client",
    "email.message",
    "subprocess",
    "threading",
    "queue",
    "sched",
    "contextlib",
    "dataclasses",
    "enum",
    "copy",
    "pprint",
    "reprlib",
    "inspect",
    "ast",
    "traceback",
    "warnings",
    "unittest",
    "doctest",
    "logging",
    "configparser",
    "shlex",
    "getopt",
    "gettext",
    "codecs",
    "io",
    "struct",
    "array",
    "weakref",
    "abc",
    "numbers",
    "math",
    "cmath",
    "time",
    "os",
    "socket",
    "selectors",
    "signal",
    "mmap",
    "sqlite3",
    "xml.dom.minidom",
    "html",
    "html.parser",
    "mailbox",
    "smtplib",
    "ftplib",
    "wave",
    "colorsys",
    "zlib",
    "bz2",
    "lzma",
)

DEFAULT_LIMIT = 200_000  # characters


def ascii_text(text: str) -> str:
    """Fold ``text`` to ASCII so the character vocabulary stays small."""
    folded = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    lines = [line.rstrip().replace("\t", "    ") for line in folded.splitlines()]
    return "\n".join(lines).strip()


def public_members(module: ModuleType) -> Iterator[tuple[str, object]]:
    """Yield ``(qualified name, object)`` for public classes and functions ``module`` defines."""
    for name in sorted(vars(module)):
        if name.startswith("_"):
            continue
        obj = vars(module)[name]
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        yield f"{module.__name__}.{name}", obj
        if inspect.isclass(obj):
            for attr in sorted(vars(obj)):
                if attr.startswith("_"):
                    continue
                member = vars(obj)[attr]
                if inspect.isfunction(member) or inspect.ismethoddescriptor(member):
                    yield f"{module.__name__}.{name}.{attr}", member


def sections() -> Iterator[str]:
    """Yield the corpus's sections, each a title line followed by a docstring."""
    seen: set[str] = set()
    for module_name in MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        entries: list[tuple[str, object]] = [(module_name, module)]
        entries.extend(public_members(module))
        for title, obj in entries:
            doc = inspect.getdoc(obj)
            if not doc:
                continue
            text = ascii_text(doc)
            if len(text) < 40 or text in seen:
                continue
            seen.add(text)
            yield f"{title}\n\n{text}\n\n"


def build(limit: int) -> str:
    """Return the corpus text, cut at a section boundary near ``limit`` characters."""
    parts: list[str] = []
    size = 0
    for section in sections():
        if size + len(section) > limit:
            break
        parts.append(section)
        size += len(section)
    return "".join(parts)


def main() -> None:
    """Write (or check) the corpus file."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="size cap in characters")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    text = build(args.limit)
    if args.check:
        same = args.output.exists() and args.output.read_text(encoding="ascii") == text
        print(f"{args.output}: {'up to date' if same else 'DIFFERS'}")
        sys.exit(0 if same else 1)
    args.output.write_text(text, encoding="ascii")
    print(f"wrote {args.output} ({len(text)} characters, {len(set(text))} distinct)")


if __name__ == "__main__":
    main()
