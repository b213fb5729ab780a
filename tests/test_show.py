"""Looking at plans: the text grid, the SVG and PNG timelines and the command line (no torch)."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from asyncpipe.schedule import NAMES, Costs, build, format_plan, lower, simulate
from asyncpipe.schedule.__main__ import main
from asyncpipe.schedule.show import grid, parse_plan, timeline_png, timeline_svg

SVG = "{http://www.w3.org/2000/svg}"

VALID_PLAN = """\
# 1F1B on two ranks, written by hand
rank 0: 0F0 0F1 0B0 0B1

rank 1: 1F0 1B0 1F1 1B1
"""

# Rank 1 runs 1F1 first, which waits for 0F1; rank 0 reaches 0F1 only after 0B0, which waits for
# 1B0, which rank 1 runs last: neither rank can move. Each row on its own is in a valid order.
DEADLOCKED_PLAN = """\
rank 0: 0F0 0B0 0F1 0B1
rank 1: 1F1 1B1 1F0 1B0
"""


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncpipe.schedule", "show", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def action_rects(svg: str) -> list[ET.Element]:
    root = ET.fromstring(svg)
    return [r for r in root.iter(f"{SVG}rect") if "action" in r.get("class", "").split()]


def test_grid_gpipe_literal() -> None:
    assert grid(build("gpipe", 2, 2)) == (
        "step    0   1   2   3\nrank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1F1 1B0 1B1"
    )


def test_grid_aligns_columns_and_shows_idle_slots() -> None:
    plan = parse_plan("rank 0: 0F0 0SEND_F0->1 . 0B0\nrank 1: 1RECV_F0->0 1F0 1B0")
    assert grid(plan).splitlines() == [
        "step    0           1           2   3",
        "rank 0: 0F0         0SEND_F0->1 .   0B0",
        "rank 1: 1RECV_F0->0 1F0         1B0",
    ]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_parse_plan_reads_format_plan(name: str) -> None:
    for plan in (build(name, 3, 4), lower(build(name, 3, 4))):
        assert parse_plan(format_plan(plan)) == plan


@pytest.mark.parametrize(
    "text,match",
    [
        ("0F0 0B0", r"line 1 .*'rank <r>: <action> \.\.\.'"),
        ("rank 0: 0F0\nrank 0: 0B0", "line 2 .*rank 0 a second time"),
        ("rank 0: 0F0 0X0", r"line 1 .*rank 0.*cannot parse action '0X0'"),
        ("# nothing\n\n", "no 'rank <r>: <action> ...' lines"),
    ],
)
def test_parse_plan_rejects_bad_text(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_plan(text)


def test_svg_has_one_box_per_action_and_the_title() -> None:
    simulation = simulate(build("1f1b", 4, 8), Costs(forward=1, backward=2))
    svg = timeline_svg(simulation, title="1F1B <4 stages> & 8 chunks")
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    rects = action_rects(svg)
    entries = [e for rows in simulation.timeline.values() for e in rows]
    assert len(entries) == 4 * 8 * 2
    assert len(rects) == len(entries)
    kinds = [r.get("class", "").split()[1] for r in rects]
    assert kinds.count("kind-F") == 32 and kinds.count("kind-B") == 32
    assert [r.findtext(f"{SVG}title", "").split(":")[0] for r in rects] == [
        text for text, _, _ in entries
    ]
    assert root.findtext(f"{SVG}title") == "1F1B <4 stages> & 8 chunks"
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "1F1B <4 stages> & 8 chunks" in texts
    assert "3F7" in texts and "forward (F)" in texts


def test_svg_boxes_follow_the_simulated_times() -> None:
    simulation = simulate(build("gpipe", 2, 2), Costs(forward=1, backward=2))
    boxes = {
        r.findtext(f"{SVG}title", "").split(":")[0]: (
            float(r.get("x", "")),
            float(r.get("width", "")),
        )
        for r in action_rects(timeline_svg(simulation))
    }
    x0, forward = boxes["0F0"]
    scale = (boxes["0F1"][0] - x0) / 1.0
    assert forward == pytest.approx(scale, abs=1)
    assert boxes["0B0"][1] == pytest.approx(2 * scale, abs=1)
    # rank 1 is idle for one forward before 1F0, rank 0 from 2 until 1B0 ends at 5: bubbles
    assert boxes["1F0"][0] == pytest.approx(x0 + scale, abs=0.1)
    assert boxes["0B0"][0] == pytest.approx(x0 + 5 * scale, abs=0.1)


def test_svg_draws_weight_and_messages_thin_and_distinct() -> None:
    plan = lower(parse_plan("rank 0: 0F0 0B0 0W0\nrank 1: 1F0 1B0 1W0"))
    svg = timeline_svg(simulate(plan, Costs(forward=1, backward=1, weight=1, post=0.5)))
    rects = action_rects(svg)
    by_kind: dict[str, list[ET.Element]] = {}
    for r in rects:
        by_kind.setdefault(r.get("class", "").split()[1], []).append(r)
    assert {k: len(v) for k, v in by_kind.items()} == {
        "kind-F": 2,
        "kind-B": 2,
        "kind-W": 2,
        "kind-comm": 4,
    }
    fills = {k: {r.get("fill") for r in v} for k, v in by_kind.items()}
    assert all(len(f) == 1 for f in fills.values()) and len(set.union(*fills.values())) == 4
    assert float(by_kind["kind-comm"][0].get("height", "")) < float(
        by_kind["kind-F"][0].get("height", "")
    )


def test_png_is_written(tmp_path: Path) -> None:
    pytest.importorskip("PIL", reason="Pillow is not installed; timeline_png needs it")
    from PIL import Image

    simulation = simulate(build("1f1b", 4, 8), Costs())
    path = tmp_path / "timeline.png"
    timeline_png(simulation, path, title="1f1b")
    with Image.open(path) as image:
        assert image.format == "PNG"
        width, height = image.size
        colours = {colour for _, colour in image.convert("RGB").getcolors(1 << 16) or []}
    assert width > 900 and 300 < height < width
    assert {(0x4C, 0x78, 0xA8), (0xE4, 0x57, 0x56), (0xEE, 0xEE, 0xEE)} <= colours


def test_png_without_pillow_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)
    simulation = simulate(build("gpipe", 2, 2), Costs())
    with pytest.raises(RuntimeError, match=r"pip install pillow.*timeline_svg"):
        timeline_png(simulation, tmp_path / "out.png")
    assert not (tmp_path / "out.png").exists()


def test_cli_named_schedule(tmp_path: Path) -> None:
    result = cli(
        "--schedule", "1f1b", "--stages", "4", "--chunks", "8", "--svg", "out.svg", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert grid(build("1f1b", 4, 8)) in result.stdout
    lines = result.stdout.splitlines()
    assert "makespan: 33" in lines
    assert "total bubble: 27.3%" in lines
    table = lines.index("rank      busy   bubble  peak activations")
    rows = [line.split() for line in lines[table + 1 : table + 5]]
    assert rows == [[str(r), "24", "27.3%", str(4 - r)] for r in range(4)]
    svg = (tmp_path / "out.svg").read_text()
    assert len(action_rects(svg)) == 64


def test_cli_plan_file(tmp_path: Path) -> None:
    (tmp_path / "plan.txt").write_text(VALID_PLAN)
    result = cli("--plan", "plan.txt", "--backward", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert grid(build("1f1b", 2, 2)) in result.stdout
    assert "makespan: 6" in result.stdout.splitlines()


def test_cli_deadlocked_plan_file(tmp_path: Path) -> None:
    (tmp_path / "plan.txt").write_text(DEADLOCKED_PLAN)
    result = cli("--plan", "plan.txt", cwd=tmp_path)
    assert result.returncode == 2
    assert "deadlock" in result.stderr
    assert ">>0B0<<" in result.stderr and ">>1F1<<" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_cli_unknown_schedule(tmp_path: Path) -> None:
    result = cli("--schedule", "2f2b", "--stages", "4", "--chunks", "8", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "schedule must be one of gpipe, 1f1b" in result.stderr and "'2f2b'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--schedule", "1f1b", "--stages", "0", "--chunks", "8"], "--stages: must be a positive"),
        (["--schedule", "1f1b", "--stages", "four", "--chunks", "8"], "positive int (got 'four')"),
        (["--schedule", "1f1b", "--stages", "4"], "--schedule needs --chunks"),
        (
            ["--schedule", "gpipe", "--stages", "2", "--chunks", "2", "--virtual-stages", "2"],
            "needs schedule='interleaved'",
        ),
        (
            ["--schedule", "1f1b", "--stages", "2", "--chunks", "2", "--lookahead", "2"],
            "lookahead=2 needs schedule '2bw'",
        ),
        (
            ["--schedule", "2bw", "--stages", "4", "--chunks", "4", "--lookahead", "2"],
            "pass chunks >= 6 or a smaller lookahead",
        ),
        (["--schedule", "gpipe", "--stages", "2", "--chunks", "2", "--send", "-1"], ">= 0"),
        (["--plan", "missing.txt"], "cannot read plan file 'missing.txt'"),
        (  # it was ignored before: a plan has sends and receives only once lowered
            ["--schedule", "1f1b", "--stages", "2", "--chunks", "2", "--post", "0.5"],
            "add --lower, or drop --post",
        ),
        (  # it ran out of memory (gigabytes) before: no plan that size can be shown
            ["--schedule", "1f1b", "--stages", "1000", "--chunks", "10000"],
            "about 20,000,000 actions, more than this command shows (200,000",
        ),
    ],
)
def test_cli_errors_are_one_line(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    status: int | str | None
    try:
        status = main(["show", *args])
    except SystemExit as e:  # argparse rejects bad values by exiting
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_shows_2bw_with_a_lookahead(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["show", "--schedule", "2bw", "--stages", "4", "--chunks", "6", "--lookahead", "2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("2bw: 4 ranks, 6 micro-batches, lookahead 2")
    assert "rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 0B0 " in out  # 2 * 3 forwards ahead, then 1F1B


@pytest.mark.parametrize("name", NAMES)
def test_every_named_schedule_can_be_shown(name: str) -> None:
    virtual = 2 if name == "interleaved" else 1
    try:
        plan = build(name, 4, 8, virtual)
    except ImportError as e:  # a generator module not written yet
        pytest.skip(f"schedule {name!r} is not available: {e}")
    simulation = simulate(plan, Costs(forward=1, backward=1, weight=1))
    assert len(grid(plan).splitlines()) == 1 + 4
    entries = sum(len(rows) for rows in simulation.timeline.values())
    assert entries == sum(a is not None for row in plan.values() for a in row)
    assert len(action_rects(timeline_svg(simulation, title=name))) == entries
