"""Every code example in the docs and the README runs, as its tag says (see tests/docblocks.py).

``python -m pytest tests/test_docs.py -rs`` lists the blocks that are not run and why;
``python tests/docblocks.py`` lists every block and how it runs.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from docblocks import ROOT, Block, DocError, blocks, pages

PYTHON_TIMEOUT = 180
TORCHRUN_TIMEOUT = 240


def _collect() -> list[object]:
    """One test per block that has a mode; blocks that run the same code (the front page's
    example is also the README's) run once, under the names of all of them."""
    same: dict[tuple[str, ...], list[Block]] = {}
    for page in pages():
        try:
            found = blocks(page)
        except DocError:
            continue  # reported by test_every_code_block_is_tagged
        for block in found:
            if not block.mode:
                continue  # text: a diagram, a plan or printed output
            files = repr(sorted(block.files.items()))
            key = (block.mode, block.argument, block.script(), files, *block.needs)
            same.setdefault(key if block.runs else (block.name,), []).append(block)
    params: list[object] = []
    for group in same.values():
        block = group[0]
        marks = [pytest.mark.slow] if block.mode == "torchrun" else []
        name = " + ".join(b.name for b in group)
        params.append(pytest.param(block, id=name, marks=marks))
    return params


def test_every_code_block_is_tagged() -> None:
    problems = []
    for page in pages():
        try:
            blocks(page)
        except DocError as e:
            problems.append(str(e))
    assert not problems, "\n".join(problems)


def _workdir(block: Block, tmp_path: Path) -> Path:
    for name, text in block.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for name in ("examples", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", MPLBACKEND="Agg")


def _run(command: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _check(block: Block, result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, (
        f"{block.name} ({block.mode} {block.argument}) exited with {result.returncode}\n"
        f"--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{_clip(result.stderr)}"
    )


class _RankRunner:
    """One ``tests/forkrun.py --serve`` process per test session: it imports torch once and
    forks the ranks of every ``torchrun N`` example from there."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None

    def run(self, block: Block, cwd: Path) -> list[int | None]:
        if self.process is None or self.process.poll() is not None:
            command = [sys.executable, str(ROOT / "tests" / "forkrun.py"), "--serve"]
            self.process = subprocess.Popen(
                command, env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        assert self.process.stdin is not None and self.process.stdout is not None
        job = {"cwd": str(cwd), "world": block.processes(), "timeout": TORCHRUN_TIMEOUT}
        self.process.stdin.write(json.dumps({**job, "script": "example.py"}) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer, f"the rank runner ended (exit status {self.process.wait()})"
        codes: list[int | None] = json.loads(answer)
        return codes

    def close(self) -> None:
        if self.process is not None and self.process.stdin is not None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


@pytest.fixture(scope="session")
def rank_runner() -> Iterator[_RankRunner]:
    runner = _RankRunner()
    yield runner
    runner.close()


def _run_ranks(block: Block, cwd: Path, runner: _RankRunner) -> None:
    """Run the script as every rank of a gloo job on loopback, with the environment torchrun
    gives its workers, the ranks forked by ``runner``. Every rank must exit with status 0
    within the timeout."""
    codes = runner.run(block, cwd)
    if any(code != 0 for code in codes) and _port_taken(cwd, len(codes)):
        # the free port picked for the rendezvous was taken by another test meanwhile
        codes = runner.run(block, cwd)
    failed = [(rank, code) for rank, code in enumerate(codes) if code != 0]
    assert not failed, "\n".join(
        f"{block.name} ({block.mode} {block.argument}): rank {rank} "
        + ("did not finish" if code is None else f"exited with {code}")
        + f"\n--- stdout\n{(cwd / f'rank{rank}.out').read_text()[-2000:]}"
        + f"\n--- stderr\n{_clip((cwd / f'rank{rank}.err').read_text())}"
        for rank, code in failed
    )


def _port_taken(cwd: Path, world: int) -> bool:
    errors = [cwd / f"rank{rank}.err" for rank in range(world)]
    return any(path.exists() and "EADDRINUSE" in path.read_text() for path in errors)


def _clip(text: str, keep: int = 4000) -> str:
    """The start and the end of a long output (a failing rank's traceback comes first, the
    launcher's summary last)."""
    return text if len(text) <= 2 * keep else f"{text[:keep]}\n[...]\n{text[-keep:]}"


def _run_console(block: Block, cwd: Path) -> None:
    """Run each ``$ command`` and compare its output (stdout and stderr) with the lines that
    follow it, ignoring trailing spaces."""
    commands: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line.rstrip())
    assert commands, f"{block.name}: a console block needs '$ ' command lines"
    for command, expected in commands:
        result = subprocess.run(
            ["bash", "-c", command],
            cwd=cwd,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=PYTHON_TIMEOUT,
        )
        got = [ln.rstrip() for ln in result.stdout.rstrip("\n").splitlines()]
        want = "\n".join(expected).rstrip("\n")
        assert "\n".join(got) == want, (
            f"{block.name}: `{command}` printed (exit status {result.returncode}):\n"
            + "\n".join(got)
            + f"\n--- the docs say:\n{want}"
        )


@pytest.mark.parametrize("block", _collect())
def test_doc_block(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if block.mode == "skip":
        pytest.skip(f"{block.name} not run: {block.argument}")
    if block.mode == "file":
        pytest.skip(f"{block.name} written as {block.argument} for the blocks after it")
    for module in block.needs:
        pytest.importorskip(module, reason=f"an example of {module}, which is not installed")
    cwd = _workdir(block, tmp_path)
    if block.mode == "python":
        (cwd / "example.py").write_text(block.script())
        _check(block, _run([sys.executable, "example.py"], cwd, PYTHON_TIMEOUT))
    elif block.mode == "torchrun":
        (cwd / "example.py").write_text(block.script())
        _run_ranks(block, cwd, request.getfixturevalue("rank_runner"))
    elif block.mode == "shell":
        _check(block, _run(["bash", "-euo", "pipefail", "-c", block.text], cwd, PYTHON_TIMEOUT))
    elif block.mode == "console":
        _run_console(block, cwd)
    elif block.mode == "doctest":
        _run_doctest(block, cwd)
    else:  # pragma: no cover - _parse_tag accepts only the modes above
        raise AssertionError(block.mode)


def _run_doctest(block: Block, cwd: Path) -> None:
    parser = doctest.DocTestParser()
    test = parser.get_doctest(block.setup + block.text, {}, block.name, block.page, block.line)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    here = Path.cwd()
    os.chdir(cwd)
    try:
        out: list[str] = []
        runner.run(test, out=out.append)
    finally:
        os.chdir(here)
    assert runner.failures == 0, "".join(out)


def _modules() -> list[str]:
    import asyncpipe

    names = ["asyncpipe"]
    for info in pkgutil.walk_packages(asyncpipe.__path__, "asyncpipe."):
        if not re.search(r"\.__main__$", info.name):
            names.append(info.name)
    return names


def test_docstring_examples() -> None:
    """The ``>>>`` examples in the library's docstrings (those not marked ``+SKIP``)."""
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    out: list[str] = []
    for name in _modules():
        module = importlib.import_module(name)
        for test in finder.find(module, name):
            runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)
    assert runner.tries > 20, runner.tries


def test_schedule_pictures_are_current(tmp_path: Path) -> None:
    """The timelines in docs/_static are what the command on the schedules page draws today.

    The block is run by bash with ``python`` standing for a function that records its
    arguments; the recorded ``python -m asyncpipe.schedule`` calls then run in this process.
    """
    from asyncpipe.schedule.__main__ import main

    (block,) = [b for b in blocks(ROOT / "docs" / "schedules.md") if "docs/_static/" in b.text]
    record = 'python() { printf "%s\\0" "$@" >> calls; printf "\\n" >> calls; }\n'
    command = record + block.text.replace("docs/_static/", f"{tmp_path}/")
    _check(block, _run(["bash", "-euo", "pipefail", "-c", command], tmp_path, PYTHON_TIMEOUT))
    calls = [c.strip("\0").split("\0") for c in (tmp_path / "calls").read_text().split("\0\n")]
    calls = [c for c in calls if c != [""]]
    assert len(calls) == 4 and all(c[:2] == ["-m", "asyncpipe.schedule"] for c in calls), calls
    with contextlib.redirect_stdout(io.StringIO()):
        assert all(main(c[2:]) == 0 for c in calls)
    stale = [
        path.name
        for path in sorted(tmp_path.glob("*.svg"))
        if path.read_bytes() != (ROOT / "docs" / "_static" / path.name).read_bytes()
    ]
    assert len(list(tmp_path.glob("*.svg"))) == 4
    assert not stale, f"redraw {stale} with the command at {block.name}"


def _page(tmp_path: Path, name: str, text: str) -> list[Block]:
    page = tmp_path / name
    page.write_text(text)
    return blocks(page, root=tmp_path)


def test_tags_setup_and_continue_are_read(tmp_path: Path) -> None:
    md = _page(
        tmp_path,
        "page.md",
        "<!-- test: file plan.txt -->\n```text\nrank 0: 0F0 0B0\n```\n\n"
        "<!-- test: torchrun 2\nimport torch\n-->\n```python\nx = 1\n```\n\n"
        "<!-- test: torchrun 2 continue needs=fairscale -->\n```python\ny = x\n```\n"
        "```text\na diagram\n```\n",
    )
    assert [(b.mode, b.argument) for b in md] == [
        ("file", "plan.txt"),
        ("torchrun", "2"),
        ("torchrun", "2"),
        ("", ""),
    ]
    assert md[1].setup == "import torch\n" and md[1].files == {"plan.txt": "rank 0: 0F0 0B0\n"}
    assert md[2].script().split() == ["import", "torch", "x", "=", "1", "y", "=", "x"]
    assert md[2].needs == ["fairscale"] and md[2].processes() == 2
    rst = _page(
        tmp_path,
        "page.rst",
        "Title\n=====\n\n.. test: python\n   import os\n\n.. code-block:: python\n\n"
        "   print(os.sep)\n\n.. code-block:: text\n\n   a diagram\n",
    )
    assert [(b.mode, b.setup, b.text) for b in rst] == [
        ("python", "import os\n", "print(os.sep)\n"),
        ("", "", "a diagram\n"),
    ]


@pytest.mark.parametrize(
    ("name", "text", "problem"),
    [
        ("a.md", "```python\nx = 1\n```\n", "without a test tag"),
        ("a.md", "<!-- test: run -->\n```python\nx = 1\n```\n", "starts with one of"),
        ("a.md", "<!-- test: torchrun -->\n```python\nx = 1\n```\n", "number of processes"),
        ("a.md", "<!-- test: skip -->\n```bash\nls\n```\n", "needs an argument"),
        ("a.md", "<!-- test: python -->\ntext\n```python\nx = 1\n```\n", "right before"),
        ("a.rst", "Some code::\n\n   x = 1\n", "literal block"),
        ("a.rst", ".. code-block:: console\n\n   $ ls\n", "without a test tag"),
    ],
)
def test_untagged_or_badly_tagged_blocks_are_refused(
    tmp_path: Path, name: str, text: str, problem: str
) -> None:
    with pytest.raises(DocError, match=problem):
        _page(tmp_path, name, text)


@pytest.mark.slow
def test_rank_runner_reports_failed_and_hung_ranks(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['RANK'])\n"
        "if rank == 2:\n    time.sleep(300)\n"
        "sys.exit(3 if rank == 1 else 0)\n"
    )
    # rank 2 is killed 10 s after rank 1 failed, well before the 60 s timeout
    command = [sys.executable, str(ROOT / "tests" / "forkrun.py"), "3", "60", "job.py"]
    result = _run(command, tmp_path, 120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == [0, 3, None]


def test_every_member_the_api_page_lists_is_documented() -> None:
    """Sphinx's autodoc leaves out, without a warning, a listed member that has no docstring or
    that the class inherits (AsyncPipe's methods from its parts): each listed name must exist
    and carry a docstring, and a class with inherited listed members must say so."""
    text = (ROOT / "docs" / "api.rst").read_text()
    missing = []
    pattern = r"\.\. auto(?:class|module):: (\S+)\n((?:   :.*\n(?:      .*\n)*)*)"
    for found in re.finditer(pattern, text):
        target, options = found.groups()
        listed = re.search(r":members:(.*(?:\n      .*)*)", options)
        if not listed:
            continue
        module, _, name = target.rpartition(".")
        owner = getattr(importlib.import_module(module), name, None)
        if owner is None or not isinstance(owner, type):
            owner = importlib.import_module(target)
        for member in (m.strip() for m in listed.group(1).replace("\n", " ").split(",")):
            if not member:
                continue
            value = inspect.getattr_static(owner, member, None)
            if value is None:  # an instance attribute: documented by the string after it
                source = inspect.getsource(owner)
                if not re.search(rf"self\.{member}\b[^\n]*=[^\n]*\n\s*\"\"\"", source):
                    missing.append(f"{target}.{member} (no attribute with a docstring)")
                continue
            doc = value.__doc__ if isinstance(value, property) else getattr(value, "__doc__", None)
            if not doc or doc == getattr(type(value), "__doc__", None):
                if member not in (getattr(owner, "__annotations__", {}) or {}):
                    missing.append(f"{target}.{member}")
            elif (
                isinstance(owner, type)
                and member not in owner.__dict__
                and ":inherited-members:" not in options
            ):
                missing.append(f"{target}.{member} (inherited: add :inherited-members:)")
    assert not missing, missing
