"""``python -m benchmarks``: every generated section of the docs belongs to a registered part and
every part's sections are on its page; the sections' markers, the command line, and a quick
run of every part into a copy of the docs."""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
sys.path.insert(0, str(REPO))

from benchmarks.__main__ import commands, parse_args  # noqa: E402
from benchmarks.parts import PARTS, by_name  # noqa: E402
from benchmarks.sections import find_sections, markers, write_section  # noqa: E402

PAGES = sorted([*DOCS.glob("*.md"), *DOCS.glob("*.rst"), REPO / "README.md"])


def _name(page: Path) -> str:
    return page.relative_to(DOCS).as_posix() if page.parent == DOCS else page.name


def _sections() -> dict[tuple[str, str], str]:
    """(page relative to docs/, key) -> body, for every generated section anywhere."""
    return {
        (_name(page), key): body
        for page in PAGES
        for key, body in find_sections(page.read_text()).items()
    }


def test_every_generated_section_belongs_to_a_registered_part() -> None:
    owners = {(part.page, key): part for part in PARTS for key in part.keys}
    strays = [f"{page}: {key}" for page, key in _sections() if (page, key) not in owners]
    assert not strays, f"sections no part of python -m benchmarks writes: {strays}"


def test_every_part_has_its_sections_on_its_page() -> None:
    found = _sections()
    missing = [f"{p.page}: {key}" for p in PARTS for key in p.keys if (p.page, key) not in found]
    assert not missing, f"parts whose sections are missing from their pages: {missing}"
    assert len({p.name for p in PARTS}) == len(PARTS)
    for part in PARTS:
        assert all(key.split()[0] == part.name for key in part.keys), part


def test_every_section_records_date_machine_commit_and_command() -> None:
    for (page, key), body in _sections().items():
        if "Carried over from" in body:
            continue  # figures of a run before its part existed, until the next run
        for word in ("Date:", "Machine:", "asyncpipe: commit", "Command:"):
            assert word in body, (page, key, word)


def test_no_marker_of_the_old_forms_is_left() -> None:
    for page in PAGES:
        text = page.read_text()
        assert not re.search(r"<!-- \w+:(begin|end) -->", text), page
        assert "(generated; rerun to update)" not in text, page


def test_the_benchmarks_page_lists_every_part() -> None:
    text = (DOCS / "benchmarks.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \|", text, re.MULTILINE)
    assert [name for name, _ in rows] == [p.name for p in PARTS]
    for (_, where), part in zip(rows, PARTS, strict=True):
        assert f"({part.page})" in where or (part.page == "benchmarks.md" and "this page" in where)


def test_sections_pair_up_or_say_what_is_wrong() -> None:
    begin, end = markers("gpipe shape=small", "page.md")
    assert find_sections(f"a\n{begin}\nbody\n{end}\nb") == {"gpipe shape=small": "\nbody\n"}
    with pytest.raises(ValueError, match="never ends"):
        find_sections(f"{begin}\nbody")
    with pytest.raises(ValueError, match="without its begin"):
        find_sections(f"body\n{end}")
    with pytest.raises(ValueError, match="twice"):
        find_sections(f"{begin}\n{end}\n{begin}\n{end}")
    rst_begin, rst_end = markers("failures", "page.rst")
    assert rst_begin.startswith(".. begin: failures") and rst_end == ".. end: failures"
    assert find_sections(f"{rst_begin}\n\nx\n\n{rst_end}\n") == {"failures": "\n\nx\n\n"}


def test_write_section_replaces_only_its_own_section(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    write_section(page, "twobw", "first", "Title")
    write_section(page, "convergence", "other", "Title")
    write_section(page, "twobw", "second", "Title")
    text = page.read_text()
    assert text.startswith("# Title\n")
    assert find_sections(text) == {"twobw": "\n\nsecond\n\n", "convergence": "\n\nother\n\n"}
    rst = tmp_path / "page.rst"
    write_section(rst, "failures", "- a line", "Title")
    assert rst.read_text().startswith("Title\n=====\n") and ".. end: failures" in rst.read_text()


def test_list_shows_only_the_selected_parts(capsys: pytest.CaptureFixture[str]) -> None:
    """``--list --only gpipe`` listed every part."""
    from benchmarks.__main__ import main

    assert (
        main(["--list", "--only", "gpipe,failures", "--skip", "failures", "--device", "cpu"]) == 0
    )
    out = capsys.readouterr().out
    listed = [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")]
    assert listed == ["gpipe"], out
    assert "python -m benchmarks.gpipe " in out and "benchmarks.failures" not in out


def test_selection_quick_mode_and_where_it_writes(tmp_path: Path) -> None:
    full = parse_args(["--device", "cpu"])
    assert [p.name for p in full.parts] == [p.name for p in PARTS] and full.write
    some = parse_args(["--only", "failures,gpipe", "--skip", "gpipe", "--device", "cpu"])
    assert [p.name for p in some.parts] == ["failures"]
    assert not parse_args(["--quick", "--device", "cpu"]).write  # never over real figures
    quick = parse_args(["--quick", "--docs", str(tmp_path), "--device", "cpu"])
    assert quick.write
    for bad in (["--only", "nothing"], ["--skip", ",".join(p.name for p in PARTS)]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    with pytest.raises(ValueError, match="unknown parts"):
        by_name(["gpipe", "nothing"])
    (suite,) = by_name(["suite"])
    (command,) = commands(suite, full)
    assert command[1:4] == ["-m", "benchmarks.suite", "--device"]
    assert command[-2:] == ["--markdown", "docs/benchmark_suite.md"]
    assert suite.key_for("cpu") == ["suite device=cpu"]


def test_a_run_that_does_not_write_the_docs_writes_no_picture_into_them(tmp_path: Path) -> None:
    """--quick without --docs, and --no-write, leave out the pictures' options (the schedule
    timelines, the traced run's picture) instead of drawing tiny runs over the real ones."""
    for argv in (["--quick"], ["--no-write"], ["--quick", "--no-write", "--docs", str(tmp_path)]):
        run = parse_args([*argv, "--device", "cpu"])
        assert not run.write
        for part in run.parts:
            for command in commands(part, run):
                assert not [a for a in command[3:] if "docs" in a or "_static" in a], command
    quick = parse_args(["--quick", "--docs", str(tmp_path), "--device", "cpu"])
    (schedules,) = commands(by_name(["schedules"])[0], quick)
    assert schedules[schedules.index("--timelines") + 1] == f"{tmp_path}/_static"
    (full,) = commands(by_name(["trace_example"])[0], parse_args(["--device", "cpu"]))
    assert full[3:] == ["--picture", "docs/_static/trace_train_lm.png", "--markdown",
                        "docs/tracing.md"]  # fmt: skip


class _Parsed(Exception):
    pass


@pytest.mark.parametrize("part", PARTS, ids=lambda p: p.name)
def test_every_command_of_every_part_parses(part, monkeypatch: pytest.MonkeyPatch) -> None:
    """The arguments the runner passes (full and quick) are options the part's command has."""
    runs = [
        command
        for quick in (False, True)
        for command in commands(part, parse_args(["--device", "cpu", "--quick"][: 2 + quick]))
    ]
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[call-overload]
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    module = importlib.import_module(part.module)
    for command in runs:
        assert command[1:3] == ["-m", part.module]
        with pytest.raises(_Parsed):
            module.main(command[3:])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_quick_run_of_every_part_rewrites_every_section(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for page in {p.page for p in PARTS}:
        shutil.copy(DOCS / page, docs / page)
    before = {page: find_sections((docs / page).read_text()) for page in {p.page for p in PARTS}}
    command = [sys.executable, "-m", "benchmarks", "--quick", "--docs", str(docs)]
    done = subprocess.run(
        [*command, "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for n, part in enumerate(PARTS, 1):
        assert f"[{n}/{len(PARTS)}] {part.name}: ok" in done.stderr, done.stderr[-3000:]
        after = find_sections((docs / part.page).read_text())
        for key in part.key_for("cpu"):
            assert after[key] != before[part.page][key], (part.name, key)
            assert f"python -m {part.module} " in after[key] and "Date:" in after[key]
    assert "not rewritten by a run on this device (cpu): suite device=cuda" in done.stderr
    for picture in ("trace_train_lm.png", "benchmark_suite_cpu.png"):
        assert (docs / "_static" / picture).stat().st_size > 0
    assert list((docs / "_static").glob("schedule_benchmarks_*.svg"))


def test_plan_check_runs_the_warmup_it_was_given_and_reports_a_failed_job_in_its_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import plan_check
    from benchmarks.launch import LaunchResult

    calls: list[list[str]] = []

    def launch(module: str, argv: list[str], world: int, *rest: object) -> LaunchResult:
        calls.append(argv)
        if len(calls) > 1:  # the second configuration's job fails
            return LaunchResult([1] * world, False, 0.1, [Path("no-such-log")] * world)
        Path(argv[argv.index("--out") + 1]).write_text("[0.05, 0.07, 0.06]")
        return LaunchResult([0] * world, False, 0.1, [])

    monkeypatch.setattr(plan_check, "launch", launch)
    argv = ["--world", "2", "--batch", "4", "--chunk-options", "2", "--schedules", "gpipe"]
    argv += ["--steps", "3", "--warmup", "0", "--repeat", "1", "--f-ms", "0.1"]
    assert plan_check.main(argv) == 0
    assert len(calls) == 2
    assert all(call[call.index("--warmup") + 1] == "0" for call in calls)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| gpipe")]
    assert "| 60.0 |" in rows[0]
    assert "FAILED: rank 0 exited with 1" in rows[1]


def test_plan_check_runs_interleaved_on_its_virtual_stages_and_2bw_with_an_optimizer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The worker ran interleaved without its virtual stages (balance has two entries per
    rank) and 2BW without the optimizer it needs: every row of either said FAILED."""
    from benchmarks import plan_check
    from benchmarks.launch import LaunchResult

    workers: list[tuple[argparse.Namespace, int]] = []

    def launch(module: str, argv: list[str], world: int, *rest: object) -> LaunchResult:
        assert plan_check.main(argv) == 0  # the worker's command line, as the worker reads it
        args = workers[-1][0]
        workers[-1] = (args, world)
        Path(args.out).write_text("[0.05]")
        return LaunchResult([0] * world, False, 0.1, [])

    monkeypatch.setattr(plan_check, "launch", launch)
    monkeypatch.setattr(plan_check, "_worker", lambda args: workers.append((args, 0)) or 0)
    argv = ["--world", "2", "--batch", "4", "--chunk-options", "2"]
    argv += ["--schedules", "interleaved,2bw", "--steps", "2", "--warmup", "0", "--repeat", "1"]
    assert plan_check.main([*argv, "--f-ms", "0.1"]) == 0
    assert "FAILED" not in capsys.readouterr().out
    runs = {(a.schedule, a.virtual_stages, len(a.balance.split(",")), w) for a, w in workers}
    assert ("interleaved", 2, 4, 2) in runs and ("2bw", 1, 2, 2) in runs, runs


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved", "2bw"])
def test_plan_check_worker_runs_interleaved_and_2bw(schedule: str, tmp_path: Path) -> None:
    """A real two-rank job of the worker, a few milliseconds of compute per step."""
    from benchmarks.launch import launch

    out = tmp_path / "seconds.json"
    balance = "2,2,2,2" if schedule == "interleaved" else "4,4"
    argv = ["--worker", "--f-ms", "0", "--batch", "4", "--chunks", "2", "--schedule", schedule]
    argv += ["--virtual-stages", "2" if schedule == "interleaved" else "1", "--warmup", "1"]
    argv += ["--steps", "2", "--balance", balance, "--out", str(out)]
    result = launch("benchmarks.plan_check", argv, 2, 120.0, tmp_path / "logs")
    assert result.ok, result.failure()
    seconds = json.loads(out.read_text())
    assert seconds and all(s > 0 for s in seconds)


REFUSED = [
    ("benchmarks.gpipe", ["--chunks", "0"]),
    ("benchmarks.gpipe", ["--chunks", ","]),
    ("benchmarks.gpipe", ["--balance", "0,0"]),
    ("benchmarks.gpipe", ["--micro-batch", "0"]),
    ("benchmarks.gpipe", ["--timeout", "0"]),
    ("benchmarks.gpipe", ["--f-ms", "-1"]),
    ("benchmarks.schedules", ["--virtual-stages", "0"]),
    ("benchmarks.schedules", ["--ranks", "0"]),
    ("benchmarks.schedules", ["--chunks", "-4"]),
    ("benchmarks.schedules", ["--memory-chunks", "0"]),
    ("benchmarks.schedules", ["--timeline-chunks", "0"]),
    ("benchmarks.schedules", ["--layers", "6"]),
    ("benchmarks.transports", ["--processes", "1"]),
    ("benchmarks.transports", ["--processes", "3"]),
    ("benchmarks.transports", ["--steps", "0"]),
    ("benchmarks.transports", ["--messages", "0", "--bandwidth-only"]),
    ("benchmarks.transports", ["--trials", "0"]),
    ("benchmarks.twobw", ["--schedules", "1f1b,nope"]),
    ("benchmarks.twobw", ["--chunks", "4"]),  # 2bw-lookahead2 on 4 ranks needs 6
    ("benchmarks.twobw", ["--ranks", "9"]),
    ("benchmarks.parallel", ["--steps", "0"]),
    ("benchmarks.trace_overhead", ["--every", "0"]),
    ("benchmarks.trace_overhead", ["--steps", "0"]),
    ("benchmarks.failures", ["--modes", ","]),
    ("benchmarks.failures", ["--timeout", "-1"]),
    ("benchmarks.convergence", ["--lrs", "fast"]),
    ("benchmarks.trace_example", ["--processes", "0"]),
    ("benchmarks.plan_check", ["--chunk-options", "2,x"]),
    ("benchmarks.plan_check", ["--batch", "0"]),
    ("benchmarks.plan_check", ["--schedules", "1F1B"]),  # plan's names are lower case
    ("benchmarks.plan_check", ["--schedules", "gpipe,nope"]),
    ("benchmarks.plan_check", ["--schedules", ","]),
    ("benchmarks.plan_check", ["--chunk-options", "2", "--batch", "5"]),  # 2 does not divide 5
    ("benchmarks.plan_check", ["--schedules", "interleaved", "--world", "1"]),
    ("benchmarks.suite", ["--stages", "0"]),
    ("benchmarks.suite", ["--steps", "0"]),
    ("benchmarks.gpt", ["--chunks", "0"]),
]


@pytest.mark.parametrize(
    ("module", "argv"), REFUSED, ids=lambda v: v if isinstance(v, str) else " ".join(v)
)
def test_nonsense_numbers_are_refused_when_the_command_line_is_read(
    module: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each of these ran for a while and failed with a traceback (a segfault for one process),
    or quietly ran something else (``--timeout 0`` meant the default)."""
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(module).main(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"python -m {module}: error: ") and argv[0] in error, error
