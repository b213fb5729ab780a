"""The main example runs end to end under torchrun and its loss falls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from spawn import free_port

ROOT = Path(__file__).resolve().parent.parent


def torchrun(script: str, *args: str) -> str:
    """Run ``examples/<script>`` on two processes under torchrun; return its output."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        str(ROOT / "examples" / script), *args,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout


@pytest.mark.slow
def test_train_lm_runs_under_torchrun(tmp_path: Path) -> None:
    stdout = torchrun(
        "train_lm.py", "--steps", "8", "--dim", "32", "--depth", "2", "--log-every", "4",
        "--sample-chars", "20", "--trace", str(tmp_path / "trace"), "--trace-every", "4",
    )  # fmt: skip
    losses = [float(v) for v in re.findall(r"step +\d+/\d+ +loss (\d+\.\d+)", stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], stdout
    assert "idle" in stdout
    assert f"trace: {tmp_path / 'trace'}" in stdout
    assert (tmp_path / "trace" / "timeline.html").exists()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="shm runs on Linux")
def test_train_lm_over_shared_memory() -> None:
    stdout = torchrun(
        "train_lm.py", "--steps", "6", "--dim", "32", "--depth", "2", "--log-every", "3",
        "--sample-chars", "10", "--trace", "", "--transport", "shm", "--schedule", "1f1b",
    )  # fmt: skip
    losses = [float(v) for v in re.findall(r"step +\d+/\d+ +loss (\d+\.\d+)", stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], stdout


@pytest.mark.slow
def test_train_resnet_with_skips_and_deferred_batch_norm() -> None:
    stdout = torchrun(
        "train_resnet.py", "--epochs", "2", "--train", "1536", "--test", "256", "--width", "8",
    )  # fmt: skip
    assert "skips crossing stages (from stage, to stage): [(0, 1)]" in stdout
    losses = [float(v) for v in re.findall(r"epoch \d+/\d+ +loss (\d+\.\d+)", stdout)]
    assert len(losses) == 2 and losses[1] < losses[0], stdout
    accuracy = float(re.findall(r"test accuracy (\d\.\d+)", stdout)[0])
    assert accuracy > 0.5, stdout  # four classes: chance is 0.25


@pytest.mark.slow
def test_train_cutpoint_runs_under_torchrun() -> None:
    stdout = torchrun(
        "train_cutpoint.py", "--steps", "10", "--dim", "32", "--depth", "2", "--log-every", "5",
    )  # fmt: skip
    losses = [float(v) for v in re.findall(r"step +\d+/\d+ +loss (\d+\.\d+)", stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], stdout
    assert "balance found by timing them: [2, 2]" in stdout, stdout
    assert "differ by 0.0" in stdout, stdout


def test_progress_bar_redraws_one_line_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from train_lm import Progress

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    bar = Progress(10, enabled=True, width=10)
    bar.update(5, 2.5, 0.1234)
    bar.clear()
    out = capsys.readouterr().out
    assert out.startswith("\r[#####.....] step 5/10  loss 2.5000  step  123.4 ms")
    assert "\n" not in out
    quiet = Progress(10, enabled=False)
    quiet.update(1, 1.0, 0.1)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "argv",
    [
        ["--trace-every", "0"],
        ["--threads", "-1"],
        ["--log-every", "-2"],
        ["--sample-chars", "-1"],
        ["--steps", "0"],
    ],
    ids=" ".join,
)
def test_train_lm_refuses_nonsense_numbers_when_it_reads_its_command_line(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--trace-every 0`` and ``--threads -1`` ran into a traceback instead."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from train_lm import parse_args

    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: " + argv[0] + " must be at least" in error, error
    for fine in (["--threads", "0"], ["--log-every", "0"], ["--sample-chars", "0"]):
        parse_args(fine)  # 0 means: the CPUs per process, a tenth of --steps, no sample
