"""Tracing: TensorBoard output read back with TensorBoard's reader, Chrome trace, CLI, HTML."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from models import mlp, reference
from threads import run_threads, values
from torch import nn
from trace_workers import (
    literal_step,
    threaded_run,
    traced_failure,
    traced_remote,
    traced_replicas,
    traced_run,
    traced_two_bw,
    written_run,
)

from asyncpipe import AsyncPipe
from asyncpipe.schedule import build, lower, two_bw
from asyncpipe.schedule.two_bw import windows
from asyncpipe.trace import (
    StepTrace,
    TraceWriter,
    chrome_trace,
    load_plans,
    load_steps,
    render,
    summarize,
)
from asyncpipe.trace.clock import clock_offset
from asyncpipe.transport import Transport

mse = nn.functional.mse_loss
REPO = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")


def _actions(plan_row: list[object]) -> list[str]:
    return [str(a) for a in plan_row if a is not None]


# ----- a real multi-process run ---------------------------------------------------------


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three processes over gloo, 4 steps of a sleep workload, timelines every 2 steps."""
    from spawn import run_ranks

    directory = tmp_path_factory.mktemp("trace") / "run"
    losses = run_ranks(traced_run, 3, str(directory), 4, 2, 4, timeout=240)
    assert all(len(v) == 4 for v in losses) and losses[0] == losses[1] == losses[2]
    return directory


@pytest.mark.slow
def test_tensorboard_reads_the_scalars_images_and_config(gloo_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(gloo_run), size_guidance={"images": 0, "scalars": 0})
    board.Reload()
    tags = board.Tags()
    per_step = ["train/loss", "train/step_seconds", "train/samples_per_second"]
    per_step += ["pipeline/bubble_fraction"]
    per_step += [
        f"{name}/rank{r}" for name in ("idle_fraction", "peak_memory_mib") for r in range(3)
    ]
    for tag in per_step:
        assert tag in tags["scalars"], tag
        assert [e.step for e in board.Scalars(tag)] == [0, 1, 2, 3], tag
    assert [e.step for e in board.Scalars("pipeline/ideal_bubble_fraction")] == [0, 2]
    assert [e.step for e in board.Images("timeline")] == [0, 2]
    image = board.Images("timeline")[0]
    assert image.width > 400 and image.height > 200
    assert image.encoded_image_string.startswith(b"\x89PNG")
    assert "config/text_summary" in tags["tensors"]
    config = board.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    for setting in ("balance", "chunks", "schedule", "transport", "checkpoint", "gpipe"):
        assert setting in config
    # samples per second: 8 rows per step over the step time
    seconds = {e.step: e.value for e in board.Scalars("train/step_seconds")}
    for e in board.Scalars("train/samples_per_second"):
        assert e.value == pytest.approx(8 / seconds[e.step], rel=1e-4)
    for e in board.Scalars("peak_memory_mib/rank1"):
        assert e.value > 10  # a Python process with torch has a resident set of some size


@pytest.mark.slow
def test_bubble_is_a_fraction_near_the_simulated_one(gloo_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(gloo_run))
    board.Reload()
    measured = {e.step: e.value for e in board.Scalars("pipeline/bubble_fraction")}
    ideal = {e.step: e.value for e in board.Scalars("pipeline/ideal_bubble_fraction")}
    assert all(0 < v < 1 for v in measured.values())
    # GPipe over 3 stages and 4 micro-batches with B = 2F: (S - 1) / (M + S - 1) = 1/3 idle,
    # give or take how evenly the stages' measured compute times came out. A step's ideal is
    # simulated from its own measured actions, so a busy machine that stretches one action
    # stretches that step's ideal bubble too (0.53 seen once under a full test run): every
    # step's ideal is a fraction, and at least one comes out near a third.
    assert all(0 < v < 1 for v in ideal.values()), ideal
    assert any(0.25 < v < 0.45 for v in ideal.values()), ideal
    steps = load_steps(gloo_run)
    plans = load_plans(gloo_run)
    for s in steps:  # the TensorBoard values are those of the recorded steps
        assert measured[s.step] == pytest.approx(s.bubble, abs=1e-6)
    assert ideal[2] == pytest.approx(steps[2].ideal(plans[steps[2].plan]).total_bubble, abs=1e-6)
    # the closest of the warm steps to its own ideal: a busy machine may delay any single step
    # (two cores shared by several test workers have added up to 0.15 of idle time)
    gaps = [abs(s.bubble - s.ideal(plans[s.plan]).total_bubble) for s in steps[1:]]
    assert min(gaps) < 0.25, (measured, ideal, gaps)
    for rank in range(3):
        idle = board.Scalars(f"idle_fraction/rank{rank}")
        assert all(0 < e.value < 1 for e in idle)


@pytest.mark.slow
def test_chrome_trace_has_one_track_per_rank_and_every_action_once(gloo_run: Path) -> None:
    trace = json.loads((gloo_run / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"
    }
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    plan = lower(build("gpipe", 3, 4))
    for step in range(4):
        for rank in range(3):
            seen = Counter(
                e["name"]
                for e in spans
                if e["pid"] == rank
                and e["args"]["step"] == step
                and e["cat"] in ("compute", "comm")
            )
            assert seen == Counter(_actions(plan[rank])), (step, rank)
    users = [e for e in spans if e["name"] == "optimizer"]
    assert {e["pid"] for e in users} == {0, 1, 2}
    # clocks aligned: each receive of an activation ends after its send began on the other rank
    by = {(e["pid"], e["name"], e["args"]["step"]): e for e in spans}
    for step in range(4):
        for mb in range(4):
            send = by[(0, f"0SEND_F{mb}->1", step)]
            recv = by[(1, f"1RECV_F{mb}->0", step)]
            # clock error: half the best of 8 round trips; a few ms on a busy machine
            assert recv["ts"] + recv["dur"] >= send["ts"] - 2000


@pytest.mark.slow
def test_cli_renders_png_and_html(gloo_run: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "asyncpipe.trace", str(gloo_run), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("3 steps, mean step")
    assert [line.split()[0] for line in lines[2:5]] == ["0", "1", "2"]
    png = (tmp_path / "timeline.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    html = (tmp_path / "timeline.html").read_text()
    assert html.count("<svg") == 2 and html.count('class="idle"') == 6
    assert "<script src" not in html and "http" not in html.replace("http://www.w3.org", "")
    json.loads((tmp_path / "trace.json").read_text())


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Chromium (apt-get install chromium)")
def test_html_loads_in_headless_chromium(gloo_run: Path, tmp_path: Path) -> None:
    from benchmarks.check_trace_html import check

    render(gloo_run, out=tmp_path, images=False, quiet=True)
    assert check(tmp_path / "timeline.html", 3, str(CHROMIUM)) == []


def test_check_script_is_documented() -> None:
    script = REPO / "benchmarks" / "check_trace_html.py"
    assert script.exists() and "chromium" in script.read_text()


# ----- PipeDream-2BW: one window per step -----------------------------------------------


@pytest.fixture(scope="module")
def two_bw_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """Three processes over gloo, 4 steps of 2BW and the drain, timelines every 2 steps."""
    from spawn import run_ranks

    directory = tmp_path_factory.mktemp("trace2bw") / "run"
    losses = run_ranks(traced_two_bw, 3, str(directory), 4, 2, timeout=240)
    assert all(math.isnan(v[0]) and v[1:] == losses[0][1:] and len(v) == 5 for v in losses)
    return directory, losses[0]


@pytest.mark.slow
def test_2bw_steps_are_traced_as_the_windows_of_the_stream(
    two_bw_run: tuple[Path, list[float]],
) -> None:
    directory, losses = two_bw_run
    steps = load_steps(directory)
    assert [s.step for s in steps] == [0, 1, 2, 3, 4]  # four windows, then the drain
    assert [s.plan for s in steps] == ["4/2bw-first", "4/2bw", "4/2bw", "4/2bw", "4/2bw-drain"]
    # every rank ran exactly its window of the stream of 4 mini-batches, named in the stream
    cut = windows(lower(two_bw(3, 4, batches=4)), 3, 4, 4)
    for s in steps:
        for rank in range(3):
            ran = [n for n, _, _ in s.ranks[rank].events if n[0].isdigit()]
            assert ran == [str(a) for a in cut[rank][s.step]], (s.step, rank)
    # the loss of step n is that of mini-batch n - 1 (what step() and the drain returned)
    assert steps[0].loss is None
    assert [s.loss for s in steps[1:]] == pytest.approx(losses[1:], rel=1e-6)
    assert [s.samples for s in steps] == [8, 8, 8, 8, 0]
    # the plan of a window is the stream; its ideal is the same window, named as measured
    plans = load_plans(directory)
    assert plans["4/2bw"] == lower(two_bw(3, 4, batches=3))
    for s in steps:
        ideal = s.ideal(plans[s.plan])
        for rank in range(3):
            measured = [n for n, _, _ in s.ranks[rank].events if n[0].isdigit()]
            assert [n for n, _, _ in ideal.timeline[rank]] == measured, (s.step, rank)
        assert ideal.makespan > 0 and 0 <= ideal.total_bubble < 1


@pytest.mark.slow
def test_2bw_with_lookahead_is_traced_as_its_own_windows(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from spawn import run_ranks

    directory = tmp_path_factory.mktemp("trace2bw2") / "run"
    results = run_ranks(traced_two_bw, 3, str(directory), 3, 1, 2, timeout=240)
    assert all(math.isnan(v[0]) and v[1:] == results[0][1:] and len(v) == 4 for v in results)
    losses = results[0]
    steps = load_steps(directory)
    keys = ["4/2bw-lookahead2-first", "4/2bw-lookahead2", "4/2bw-lookahead2"]
    assert [s.plan for s in steps] == [*keys, "4/2bw-lookahead2-drain"]
    # each rank ran its window of the lookahead-2 stream (rank 0 runs 4 forwards before its
    # first backward, not 1F1B's 2), and each window's ideal lists the same actions
    cut = windows(lower(two_bw(3, 4, batches=3, lookahead=2)), 3, 4, 3, lookahead=2)
    plans = load_plans(directory)
    for s in steps:
        ideal = s.ideal(plans[s.plan])
        for rank in range(3):
            ran = [n for n, _, _ in s.ranks[rank].events if n[0].isdigit()]
            assert ran == [str(a) for a in cut[rank][s.step]], (s.step, rank)
            assert [n for n, _, _ in ideal.timeline[rank]] == ran, (s.step, rank)
    first = [n for n, _, _ in steps[0].ranks[0].events if n[0].isdigit() and "F" in n[1:3]]
    assert first[:4] == ["0F0", "0F1", "0F2", "0F3"]
    assert [s.loss for s in steps[1:]] == pytest.approx(losses[1:], rel=1e-6)


@pytest.mark.slow
def test_2bw_trace_files_tensorboard_and_chrome(two_bw_run: tuple[Path, list[float]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    directory, losses = two_bw_run
    board = EventAccumulator(str(directory), size_guidance={"images": 0, "scalars": 0})
    board.Reload()
    assert [e.step for e in board.Scalars("train/step_seconds")] == [0, 1, 2, 3, 4]
    assert [e.step for e in board.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.value for e in board.Scalars("train/loss")] == pytest.approx(losses[1:], rel=1e-6)
    assert [e.step for e in board.Images("timeline")] == [0, 2, 4]
    assert [e.step for e in board.Scalars("pipeline/ideal_step_seconds")] == [0, 2, 4]
    config = board.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "2bw" in config
    trace = json.loads((directory / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    forwards = sorted({e["name"] for e in spans if e["pid"] == 0 and "F" in e["name"]})
    assert forwards == sorted(f"0F{n}" for n in range(16))  # 4 mini-batches of 4, one stream
    rendered = render(directory, out=directory / "again", quiet=True)
    assert rendered.step.plan == "4/2bw" and set(rendered.files) == {"trace", "html", "png"}
    html = rendered.files["html"].read_text()
    assert html.count("<svg") == 2 and "0F12" in html  # measured and ideal of the last window


# ----- in one process -------------------------------------------------------------------


def test_tracing_keeps_the_results_and_records_every_action(tmp_path: Path) -> None:
    model = mlp(4)
    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    want, grads = reference(model, x, y, 4, mse)

    def fn(rank: int, transport: Transport) -> tuple[float, list[torch.Tensor]]:
        pipe = AsyncPipe(
            model, [2, 2], chunks=4, transport=transport, timeout=20, trace=tmp_path,
            schedule="1f1b",
        )  # fmt: skip
        loss = pipe.step(x, y, mse)
        got = [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
        out = pipe(x)  # the fairscale-style forward and backward make one more step
        if pipe.is_last_stage:
            mse(out, y).backward()
        else:
            pipe.back_helper(out)
        pipe.close()
        return loss, got

    results = values(run_threads(fn, 2))
    for loss, _ in results:
        assert loss == pytest.approx(want, rel=1e-6)
    got = results[0][1] + results[1][1]
    for a, b in zip(got, grads):
        torch.testing.assert_close(a, b)
    steps = load_steps(tmp_path)
    assert [s.step for s in steps] == [0, 1]
    assert steps[0].loss == pytest.approx(want, rel=1e-6) and steps[1].loss is None
    plan = load_plans(tmp_path)[steps[0].plan]
    assert plan == lower(build("1f1b", 2, 4))
    for s in steps:
        for rank, part in s.ranks.items():
            actions = [n for n, _, _ in part.events if n[0].isdigit()]
            assert sorted(actions) == sorted(_actions(plan[rank]))
            assert all(0 <= a <= b <= s.makespan + 1e-9 for _, a, b in part.events)


def test_profiler_ranges_are_named_by_the_action(tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    model = mlp(2)

    def fn(rank: int, transport: Transport) -> set[str]:
        pipe = AsyncPipe(model, [2], chunks=2, transport=transport, trace=tmp_path)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pipe.step(torch.randn(4, 8), torch.randn(4, 8), mse)
            with pipe.trace_span("optimizer"):
                pass
        pipe.close()
        return {e.key for e in prof.key_averages()}

    names = values(run_threads(fn, 1))[0]
    assert {"0F0", "0F1", "0B0", "0B1", "optimizer"} <= names
    recorded = {n for n, _, _ in load_steps(tmp_path)[0].ranks[0].events}
    assert {"0F0", "0F1", "0B0", "0B1"} <= recorded


def test_clock_offset_of_threads_is_zero() -> None:
    def fn(rank: int, transport: Transport) -> float:
        return clock_offset(transport, 10.0, torch.device("cpu"))

    offsets = values(run_threads(fn, 3))
    assert offsets[0] == 0.0 and all(abs(v) < 0.01 for v in offsets)


def test_bad_trace_arguments_are_refused() -> None:
    model = mlp(2)

    def fn(rank: int, transport: Transport) -> str:
        with pytest.raises(ValueError) as info:
            AsyncPipe(model, [1, 1], transport=transport, trace=5, trace_every=0)  # type: ignore[arg-type]
        return str(info.value)

    text = values(run_threads(fn, 2))[0]
    assert "trace must be a directory or a TraceWriter (got int)" in text
    assert "trace_every must be a positive number of steps (got 0)" in text
    with pytest.raises(ValueError, match="every must be a positive"):
        TraceWriter("x", every=-1)


def test_summary_and_bubble_of_a_literal_step() -> None:
    step = literal_step()
    assert step.makespan == 4.0
    assert step.bubble == pytest.approx(1 - 3.9 / 8)
    assert step.idle(0) == pytest.approx(0.5) and step.idle(1) == pytest.approx(1 - 1.9 / 4)
    summary = summarize([step])
    assert [s.rank for s in summary] == [0, 1]
    assert summary[0].communication == pytest.approx(0.1 / 4)
    assert summary[1].communication == pytest.approx(0.6 / 4)
    assert StepTrace.from_json(step.to_json()) == step


def test_chrome_trace_of_a_literal_step() -> None:
    trace = chrome_trace([literal_step()])
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    first = next(e for e in spans if e["name"] == "1F0")
    assert first["pid"] == 1 and first["ts"] == pytest.approx(101.1e6)
    assert first["dur"] == pytest.approx(0.9e6) and first["cat"] == "compute"
    assert {e["cat"] for e in spans} == {"compute", "comm", "wait"}


def test_cli_reports_a_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from asyncpipe.trace.__main__ import main

    assert main([str(tmp_path / "nothing")]) == 2
    assert not (tmp_path / "nothing").exists()  # nothing created on the way
    (tmp_path / "file").write_text("not a run")
    assert main([str(tmp_path / "file")]) == 2
    out = capsys.readouterr().err
    assert "nothing does not exist" in out and "file is not a directory" in out, out
    for d in (0, 1):  # a data-parallel run: the command names the replicas' traces
        written_run(tmp_path / "dp" / f"replica{d}", 2)
    assert main([str(tmp_path / "dp")]) == 2
    out = capsys.readouterr().err
    assert f"{tmp_path / 'dp'} holds one trace per data-parallel replica" in out, out
    assert f"({tmp_path / 'dp' / 'replica0'}, {tmp_path / 'dp' / 'replica1'})" in out, out


def test_render_picks_a_step(tmp_path: Path) -> None:
    written_run(tmp_path, 2)
    rendered = render(tmp_path, step=0, quiet=True, images=False)
    assert rendered.step.step == 0 and set(rendered.files) == {"trace", "html"}
    with pytest.raises(ValueError, match="step 5 is not in"):
        render(tmp_path, step=5, quiet=True)


def test_without_pillow_the_trace_goes_on_without_images(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "PIL" else real(name, *a)
    )
    writer = TraceWriter(tmp_path)
    with pytest.warns(UserWarning, match="timeline images need Pillow"):
        writer.open({"chunks": 1})
    assert writer.images is False
    writer.add_plan("1/train", lower(build("gpipe", 2, 1)))
    writer.write(StepTrace(0, 100.0, 0.5, 8, literal_step().ranks, "1/train"))
    writer.close()
    assert load_steps(tmp_path)[0].loss == 0.5
    assert not (tmp_path / "timeline.png").exists() and (tmp_path / "timeline.html").exists()


def test_optimizer_steps_are_traced_through_its_hooks(tmp_path: Path) -> None:
    model = mlp(2)

    def fn(rank: int, transport: Transport) -> None:
        pipe = AsyncPipe(model, [1, 1], chunks=2, transport=transport, trace=tmp_path)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        pipe.trace_optimizer(optimizer, "sgd")
        for _ in range(3):
            pipe.step(torch.randn(4, 8), torch.randn(4, 8), mse)
            optimizer.step()
        pipe.close()

    values(run_threads(fn, 2))
    steps = load_steps(tmp_path)
    spans = [(s.step, rank, name) for s in steps for rank, name, _, _ in s.extra]
    # each optimizer step lands in the payload of the step after it (the last one in none)
    assert sorted(spans) == [(1, 0, "sgd"), (1, 1, "sgd"), (2, 0, "sgd"), (2, 1, "sgd")]
    for s in steps:
        for _, _, start, end in s.extra:
            assert start < end < s.makespan  # after the last step, around the next one's start


def test_a_run_without_close_is_written_at_exit(tmp_path: Path) -> None:
    script = f"""
import torch
from asyncpipe import AsyncPipe
from asyncpipe.transport import InProcessHub
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
transport = InProcessHub(1).transport(0)
pipe = AsyncPipe(model, [2], chunks=2, transport=transport, trace={str(tmp_path)!r})
for _ in range(3):
    pipe.step(torch.randn(4, 4), torch.randn(4, 4), torch.nn.functional.mse_loss)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert [s.step for s in load_steps(tmp_path)] == [0, 1]  # the last one was on its way
    assert (tmp_path / "trace.json").exists() and (tmp_path / "timeline.html").exists()


def test_tracing_and_clipping_share_no_messages(tmp_path: Path) -> None:
    """Clipping exchanges the norm between ranks after every step while tracing sends each
    step's events to rank 0: each keeps its own messages (they once shared a channel, and the
    norm exchange took the trace's messages)."""
    model = mlp(4)
    torch.manual_seed(6)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    _, grads = reference(model, x, y, 4, nn.functional.mse_loss)
    want = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))

    def fn(rank: int, transport: Transport) -> list[float]:
        pipe = AsyncPipe(model, [2, 2], chunks=4, transport=transport, timeout=10, trace=tmp_path)
        norms = []
        for _ in range(4):
            pipe.step(x, y, nn.functional.mse_loss)
            norms.append(float(pipe.clip_grad_norm_(1e9)))
            pipe.zero_grad()
        pipe.close()
        return norms

    for norms in values(run_threads(fn, 2)):
        assert norms == pytest.approx([want] * 4, rel=1e-5)
    assert [s.step for s in load_steps(tmp_path)] == [0, 1, 2, 3]


def test_a_damaged_events_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cut-off last line (rank 0 killed while it wrote it) is left out with a note; a bad
    line before the last is an error naming the file and the line (both refused the run)."""
    from asyncpipe.trace.__main__ import main

    events = written_run(tmp_path, 3)
    lines = events.read_text().splitlines()
    events.write_text("\n".join(lines)[:-40])
    with pytest.warns(UserWarning, match=r"events.jsonl, line 3 \(the last\) is not a whole"):
        assert [s.step for s in load_steps(tmp_path)] == [0, 1]
    assert main([str(tmp_path), "--no-png"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("1 steps, mean step") and "note: " in err, err
    events.write_text("\n".join([lines[0], lines[1][:50], lines[2]]) + "\n")
    with pytest.raises(ValueError, match=r"events.jsonl, line 2 of 3 is not \(.*delete that"):
        load_steps(tmp_path)
    assert main([str(tmp_path)]) == 2
    assert f"{events}, line 2 of 3" in capsys.readouterr().err


def test_a_second_run_into_the_directory_goes_on_after_the_first(tmp_path: Path) -> None:
    """Steps numbered on from the recorded ones in events.jsonl and TensorBoard (a second run
    truncated events.jsonl); plans.json keeps both runs' plans, under keys of their own."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    threaded_run(tmp_path, "gpipe", 3)
    with (tmp_path / "events.jsonl").open("a") as f:
        f.write('{"step":3,"origin":1.0,"lo')  # a step cut off when the first job was killed
    threaded_run(tmp_path, "gpipe", 2)
    threaded_run(tmp_path, "1f1b", 2)
    steps = load_steps(tmp_path)
    assert [s.step for s in steps] == [0, 1, 2, 3, 4, 5, 6]
    assert [s.plan for s in steps] == ["4/train"] * 5 + ["4/train#2"] * 2
    plans = {"4/train": lower(build("gpipe", 2, 4)), "4/train#2": lower(build("1f1b", 2, 4))}
    assert load_plans(tmp_path) == plans
    board = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "scalars": 0})
    board.Reload()
    losses = board.Scalars("train/loss")
    assert [e.step for e in losses] == [s.step for s in steps]
    assert [e.value for e in losses] == pytest.approx([s.loss for s in steps], rel=1e-6)
    # every 2 training steps of a run, from its first (3 steps, then 2 and 2)
    assert [e.step for e in board.Images("timeline")] == [0, 2, 3, 5]
    assert [e.step for e in board.Tensors("config/text_summary")] == [0, 3, 5]
    assert render(tmp_path, quiet=True, images=False).step.step == 4  # the most common plan


def _recorded(directory: Path, losses: list[float]) -> None:
    """The trace in ``directory`` has one step per loss, numbered from 0, of both ranks."""
    steps = load_steps(directory)
    assert [s.step for s in steps] == list(range(len(losses)))
    assert [s.loss for s in steps] == pytest.approx(losses, rel=1e-6)
    assert all(set(s.ranks) == {0, 1} for s in steps)


@pytest.mark.slow
def test_a_failed_step_leaves_every_completed_step_in_the_trace(tmp_path: Path) -> None:
    """3 steps complete, the 4th fails: close() writes all 3 (it dropped the last, whose
    payloads rank 0 takes a step late), without waiting out the pipeline's timeout."""
    from spawn import run_ranks

    results = run_ranks(traced_failure, 2, str(tmp_path), 3, timeout=120)
    for losses, failure, seconds in results:
        assert len(losses) == 3 and "boom" in failure, failure
        assert seconds < 10
    _recorded(tmp_path, results[0][0])


@pytest.mark.slow
def test_replicas_traced_through_one_writer_write_a_trace_each(tmp_path: Path) -> None:
    """trace=TraceWriter(DIR) with 2 replicas: each writes DIR/replica<d>, as with trace=DIR
    (both wrote DIR/events.jsonl, mixing their lines)."""
    from spawn import run_ranks

    results = run_ranks(traced_replicas, 4, str(tmp_path), 3, timeout=240)
    for replica, where, writer, _ in results:
        assert where == str(tmp_path / f"replica{replica}") and writer == str(tmp_path)
    assert sorted(r[0] for r in results) == [0, 0, 1, 1]
    assert not (tmp_path / "events.jsonl").exists()
    for replica, _, _, losses in results:
        _recorded(tmp_path / f"replica{replica}", losses)
    assert results[0][3] != results[-1][3]  # the replicas' own steps, from their own data


@pytest.mark.slow
@pytest.mark.parametrize("close", [False, True])
def test_single_controller_mode_traces_every_step(tmp_path: Path, close: bool) -> None:
    """RemotePipe(trace=DIR): shutdown() (or close() before it) closes every stage, so the
    last step is recorded too (shutdown only closed the stages' transports)."""
    from spawn import run_ranks

    losses = run_ranks(traced_remote, 2, str(tmp_path), 2, close, timeout=240)[0]
    _recorded(tmp_path, losses)
    assert (tmp_path / "trace.json").exists() and (tmp_path / "timeline.html").exists()


# ----- what the trace showed wrongly ----------------------------------------------------


def test_a_nan_loss_is_recorded_as_nan(tmp_path: Path) -> None:
    """A diverged step (step() returned NaN) was recorded with loss null and left out of
    TensorBoard's train/loss: only the first 2BW window (no loss yet) is recorded without
    one; any other NaN loss is recorded as NaN, in events.jsonl and TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = mlp(2)
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def fn(rank: int, transport: Transport) -> list[float]:
        pipe = AsyncPipe(model, [1, 1], chunks=2, transport=transport, timeout=20, trace=tmp_path)
        got = [pipe.step(x * (1 if n < 2 else math.nan), y, mse) for n in range(3)]
        pipe.close()
        return got

    losses = values(run_threads(fn, 2))[0]
    assert math.isnan(losses[2]) and not math.isnan(losses[1])
    steps = load_steps(tmp_path)
    assert steps[2].loss is not None and math.isnan(steps[2].loss)
    assert steps[1].loss == pytest.approx(losses[1], rel=1e-6)
    board = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    board.Reload()
    recorded = board.Scalars("train/loss")
    assert [e.step for e in recorded] == [0, 1, 2] and math.isnan(recorded[2].value)
    assert render(tmp_path, quiet=True, images=False).step.step == 2  # the readers take NaN


def test_the_first_2bw_window_has_no_loss(tmp_path: Path) -> None:
    model = mlp(2)

    def fn(rank: int, transport: Transport) -> None:
        pipe = AsyncPipe(
            model, [1, 1], chunks=2, transport=transport, timeout=20, trace=tmp_path,
            schedule="2bw",
        )  # fmt: skip
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for _ in range(2):
            pipe.step(torch.randn(4, 8), torch.randn(4, 8), mse, optimizer=optimizer)
        pipe.close()

    values(run_threads(fn, 2))
    steps = load_steps(tmp_path)
    assert [s.plan for s in steps] == ["2/2bw-first", "2/2bw", "2/2bw-drain"]
    assert steps[0].loss is None and all(s.loss is not None for s in steps[1:])


def test_a_span_before_the_first_step_is_on_rank_0s_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trace_span before the first step was recorded on the rank's own clock (the offset to
    rank 0's, measured at the first step, was still 0): here a clock 1000 s behind rank 0's
    put it 1000 s before the step. Now every span is moved by the offset as its step ends."""
    import asyncpipe.trace.recorder as recorder
    from asyncpipe.transport import InProcessHub

    monkeypatch.setattr(recorder, "clock_offset", lambda *_: 1000.0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = AsyncPipe(model, [2], chunks=2, transport=InProcessHub(1).transport(0), trace=tmp_path)
    with pipe.trace_span("setup"):
        pass
    for _ in range(2):
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), mse)
        with pipe.trace_span("optimizer"):
            pass
    pipe.close()
    steps = load_steps(tmp_path)
    spans = {name: (s.step, start, end) for s in steps for _, name, start, end in s.extra}
    step, start, end = spans["setup"]
    assert step == 0 and -30 < start <= end <= 0, spans  # just before the step
    step, start, end = spans["optimizer"]
    assert step == 1 and -30 < start <= end <= 0, spans


def test_timelines_count_training_steps_only(tmp_path: Path) -> None:
    """An evaluation before each training step took every even step number, and the timeline
    and the ideal scalars (due every ``every`` step numbers) were never written. Now they are
    due at the first training step, then every ``every`` training steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = TraceWriter(tmp_path, every=2)
    writer.open({"chunks": 1})
    plan = lower(build("gpipe", 2, 1))
    writer.add_plan("1/train", plan)
    writer.add_plan("1/eval", plan)
    for n in range(8):
        kind = "1/eval" if n % 2 == 0 else "1/train"
        writer.write(StepTrace(n, 100.0 + n, 0.5, 8, literal_step().ranks, kind))
    writer.close()
    board = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "scalars": 0})
    board.Reload()
    assert [e.step for e in board.Scalars("train/step_seconds")] == [1, 3, 5, 7]
    assert [e.step for e in board.Scalars("pipeline/ideal_step_seconds")] == [1, 5]
    assert [e.step for e in board.Images("timeline")] == [1, 5]


def test_steps_after_close_are_refused_and_not_traced(tmp_path: Path) -> None:
    """Steps after close() went on queueing for a writer that had ended: after 1024 of them
    rank 0 raised that the writer was behind (and the other ranks timed out). close() now
    ends the pipeline: a step after it raises on every rank, and the trace keeps the steps
    before it."""
    model = mlp(2)

    def fn(rank: int, transport: Transport) -> int:
        pipe = AsyncPipe(model, [1, 1], chunks=2, transport=transport, timeout=3, trace=tmp_path)
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        pipe.step(x, y, mse)
        pipe.close()
        refused = 0
        for _ in range(3):
            with pytest.raises(RuntimeError, match="this pipeline was closed"):
                pipe.step(x, y, mse)
            refused += 1
        pipe.close()
        assert pipe._recorder is not None and pipe._recorder._queue.empty()
        return refused

    assert values(run_threads(fn, 2)) == [3, 3]
    assert [s.step for s in load_steps(tmp_path)] == [0]


def _stepped(directory: Path, plans: list[str]) -> None:
    """Literal steps of the given plan keys (not stored: no ideal) written into ``directory``."""
    writer = TraceWriter(directory, tensorboard=False, images=False)
    writer.open({"chunks": 1})
    for n, key in enumerate(plans):
        writer.write(StepTrace(n, 100.0 + n, 0.5, 8, literal_step().ranks, key))
    writer.close()


def test_the_summary_keeps_the_first_steady_2bw_window(tmp_path: Path) -> None:
    """The summary left out the first steady 2BW window as warm-up (a run of 3 steps said
    "1 steps"): the first window, a kind of its own, was the warm-up."""
    _stepped(tmp_path, ["4/2bw-first", "4/2bw", "4/2bw", "4/2bw-drain"])
    rendered = render(tmp_path, quiet=True, images=False)
    assert rendered.step.step == 2 and rendered.text.startswith("2 steps"), rendered.text
    _stepped(tmp_path / "gpipe", ["4/train"] * 3)  # other kinds still leave out their first
    assert render(tmp_path / "gpipe", quiet=True, images=False).text.startswith("2 steps")


def test_the_summary_of_a_step_includes_it(tmp_path: Path) -> None:
    """--step N summarized the steps of N's kind without the first: --step 0 left out step 0."""
    written_run(tmp_path, 3)
    assert render(tmp_path, step=0, quiet=True, images=False).text.startswith("3 steps")
    assert render(tmp_path, step=2, quiet=True, images=False).text.startswith("2 steps")
