"""The trace writer's pace against the pipeline's, and the Chrome trace of appended runs."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from trace_workers import literal_step

import asyncpipe.trace.recorder as recorder
from asyncpipe import AsyncPipe
from asyncpipe.trace import StepTrace, TraceWriter, chrome_trace, load_steps
from asyncpipe.trace.chrome import RUN_GAP
from asyncpipe.transport import InProcessHub


class SlowWriter(TraceWriter):
    """Takes 0.1 s over each of the first 20 steps (as if it drew an image each), then none;
    records whether it was let draw each step's image and how many steps waited meanwhile."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, every=1, images=False, tensorboard=False)
        self.pictures: list[bool] = []
        self.waiting: list[int] = []
        self.pipe: AsyncPipe | None = None

    def write(self, step: StepTrace, *, picture: bool = True) -> None:
        if len(self.pictures) < 20:
            time.sleep(0.1)
        self.pictures.append(picture)
        assert self.pipe is not None and self.pipe._recorder is not None
        self.waiting.append(self.pipe._recorder._queue.qsize())
        super().write(step, picture=picture)


def test_a_writer_behind_the_pipeline_leaves_images_out_and_holds_few_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A writer slower than the steps (every=1 draws an image a step, ~0.1 s) fell ever further
    behind: the steps waiting for it grew without bound (2,700 after 3,000 steps of a small
    model, 40 MB) and close() then drew them all. Now a step that waited too long (here 1 s)
    goes without its image, beyond a bound (here 16 steps) the training loop waits for the
    writer, and once the writer has caught up the steps get their images again."""
    monkeypatch.setattr(recorder, "_BACKLOG", 16)
    monkeypatch.setattr(recorder, "_LATE", 1.0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    writer = SlowWriter(tmp_path)
    pipe = AsyncPipe(model, [2], chunks=2, transport=InProcessHub(1).transport(0), trace=writer)
    copy = pipe._recorder.writer if pipe._recorder else None  # the pipe traces into a copy
    assert isinstance(copy, SlowWriter)
    copy.pipe = pipe

    def step() -> None:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)

    began = time.monotonic()
    for _ in range(30):
        step()
    assert time.monotonic() - began > 0.9  # held back to the writer's pace (16 steps ahead)
    time.sleep(0.5)  # the writer catches up
    for _ in range(3):
        step()
        time.sleep(0.3)
    pipe.close()
    assert [s.step for s in load_steps(tmp_path)] == list(range(33))  # every step is written
    assert max(copy.waiting) <= 16
    assert not all(copy.pictures[:30]) and all(copy.pictures[-3:]), copy.pictures
    err = capsys.readouterr().err
    assert err.count("behind the pipeline") == 1, err
    assert "written without their images" in err


def test_chrome_trace_lays_a_run_on_an_earlier_clock_after_the_one_before() -> None:
    first = literal_step()  # origin 100 s, ends 4 s later
    later = [replace(first, step=8, origin=5.0), replace(first, step=9, origin=10.0)]
    spans = [e for e in chrome_trace([first, *later])["traceEvents"] if e["ph"] == "X"]
    starts = {s: min(e["ts"] for e in spans if e["args"]["step"] == s) for s in (7, 8, 9)}
    ends = {s: max(e["ts"] + e["dur"] for e in spans if e["args"]["step"] == s) for s in (7, 8)}
    assert starts[8] == pytest.approx((104.0 + RUN_GAP) * 1e6)  # 1 s after step 7's end
    assert starts[9] - starts[8] == pytest.approx(5.0e6)  # the later run keeps its own spacing
    assert ends[7] <= starts[8] and ends[8] <= starts[9]
    # steps on one clock stay where they were recorded, even where they touch
    same = [first, replace(first, step=8, origin=103.5)]
    spans = [e for e in chrome_trace(same)["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in spans if e["args"]["step"] == 8) == pytest.approx(103.5e6)
