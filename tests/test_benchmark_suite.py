"""The benchmark suite's pieces: tables and chart on made-up results, placement, options."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.gpu import SHARED_GPU_PEERS, placement  # noqa: E402
from benchmarks.suite import Results, _section, parse_args  # noqa: E402
from benchmarks.suite_report import (  # noqa: E402
    REFERENCE_HEADER,
    SUMMARY_HEADER,
    markdown_table,
    plot,
    reference_cells,
    summary_cells,
    text_table,
)
from benchmarks.suite_runs import SuiteRow, twobw_table  # noqa: E402
from benchmarks.transports import round_trip_table  # noqa: E402
from benchmarks.twobw import measured_limit, table  # noqa: E402


def _rows() -> list[SuiteRow]:
    return [
        SuiteRow(4, 8, "asyncpipe-gpipe", "p2p", 0.40, 0.36, [2**20] * 4, [8, 8, 8, 8]),
        SuiteRow(4, 8, "asyncpipe-gpipe", "rpc", 0.50, 0.36),
        SuiteRow(4, 8, "torch-gpipe", "gloo", 0.44, 0.36),
        SuiteRow(4, 8, "fairscale-asyncpipe", "rpc", 0.625, 0.36),
        SuiteRow(4, 8, "fairscale-pipe", "-", 1.0, 0.36),
        SuiteRow(2, 8, "fairscale-pipe", "-", error="ModuleNotFoundError: No module named 'x'"),
        SuiteRow(4, 8, "torch-1f1b", "gloo", error=SHARED_GPU_PEERS),
    ]


def test_reference_table_gives_the_ratio_to_the_ideal_and_to_each_peer() -> None:
    cells = reference_cells(_rows())
    assert len(cells[0]) == len(REFERENCE_HEADER)
    column = {name: i for i, name in enumerate(REFERENCE_HEADER)}
    p2p, rpc = cells[0], cells[1]
    assert p2p[column["/simulated"]] == "1.11x"
    assert p2p[column["asyncpipe / torch same schedule"]] == "0.91x"
    assert rpc[column["asyncpipe / fairscale AsyncPipe"]] == "0.80x"
    assert p2p[column["asyncpipe / fairscale Pipe"]] == "0.40x"
    assert p2p[column["memory per rank MiB"]] == "1.0 / 1.0 / 1.0 / 1.0"
    assert cells[2][column["asyncpipe / torch same schedule"]] == "-"  # a peer row
    assert cells[5][column["step ms"]] == "FAILED: ModuleNotFoundError: No module named 'x'"
    assert cells[6][column["step ms"]] == SHARED_GPU_PEERS  # not run: no "FAILED"


def test_summary_pairs_each_peer_with_asyncpipes_same_schedule() -> None:
    cells = {line[0]: line for line in summary_cells(_rows())}
    assert cells["ScheduleGPipe"][4:] == ["gpipe over p2p", "400.0", "0.91x"]
    assert cells["fairscale AsyncPipe (RPC, fill-drain)"][4:] == [
        "gpipe over rpc",
        "500.0",
        "0.80x",
    ]
    assert cells["Schedule1F1B"][3] == SHARED_GPU_PEERS
    text = text_table(SUMMARY_HEADER, summary_cells(_rows()))
    assert "FAILED [1]" in text and "[1] peer fairscale Pipe (one process), stages 2" in text
    table = markdown_table(SUMMARY_HEADER, summary_cells(_rows()))
    assert table.count("\n") == 1 + 5  # header, rule, one line per peer row


def test_plot_draws_a_png_per_stage_count(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    from PIL import Image

    rows = _rows() + [SuiteRow(2, 8, "asyncpipe-gpipe", "p2p", 0.6, 0.5)]
    path = plot(rows, tmp_path / "chart.png", "test")
    assert path is not None
    with Image.open(path) as image:
        assert image.size[0] > 2 * 640 and image.size[1] > 360
    assert plot([SuiteRow(4, 8, "torch-1f1b", "gloo", error="x")], tmp_path / "n.png", "") is None


def test_placement_of_the_cpu_and_of_a_missing_gpu() -> None:
    cpu = placement("cpu", 4)
    assert cpu.backend == "gloo" and not cpu.staged and not cpu.cuda
    assert "gloo" in cpu.describe(4)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda"):
            placement("cuda", 4)
        assert placement("auto", 4).device.type == "cpu"


def test_quick_options() -> None:
    args = parse_args(["--quick", "--device", "cpu", "--only", "reference,gpt"])
    assert args.stage_list == [4] and args.chunk_list == [8] and args.parts == ["reference", "gpt"]
    full = parse_args(["--device", "cpu"])
    assert full.stage_list == [2, 4] and full.chunk_list == [4, 8, 16]
    with pytest.raises(SystemExit):
        parse_args(["--only", "nothing"])
    assert args.markdown is None and args.plot is None  # without --markdown it only prints
    page = parse_args(["--quick", "--device", "cpu", "--markdown", "x/page.md"])
    assert page.plot == Path("x/_static/benchmark_suite_cpu.png")


def test_twobw_table() -> None:
    rows = [
        {"stages": 4, "chunks": 8, "limit_s": 0.24, "1f1b_s": 0.36, "2bw_s": 0.264},
        {"stages": 2, "chunks": 8, "limit_s": 0.48, "error": "the benchmark failed: x"},
    ]
    lines = twobw_table(rows).splitlines()
    assert lines[2] == "| 4 | 8 | 360.0 | 264.0 | 240.0 | 1.10x | 0.73x |"
    assert lines[3].startswith("| 2 | 8 | did not run: the benchmark failed: x")


def test_twobw_benchmark_limit_is_the_calibrated_stage_and_both_ratios_are_shown() -> None:
    from benchmarks.calibration import StageCosts

    costs = [StageCosts(0.006, 0.012, 30), StageCosts(0.0062, 0.0124, 30)]
    assert measured_limit(costs, chunks=8) == pytest.approx(8 * 0.0183)  # mean of the two
    rows = [{"step_s": 0.2, "busy_s": 0.14}, {"step_s": 0.15, "busy_s": 0.14}]
    lines = table(rows, ["1f1b", "2bw"], limit=0.144, measured=0.15).splitlines()
    assert "/ measured limit" in lines[0]
    assert lines[3] == "| 2bw | 150.0 | 140.0 | 1.042 | 1.000 | 1.071 | 0.750 |"


def test_round_trip_table_gives_microseconds_and_ratios_to_raw() -> None:
    trips = {
        "raw": {"best_s": 200e-6, "median_s": 250e-6},
        "p2p": {"best_s": 300e-6, "median_s": 400e-6},
        "rpc": {"best_s": 1e-3, "median_s": 2e-3},
        "shm": {"best_s": 50e-6, "median_s": 100e-6},
    }
    head, _, row = round_trip_table(trips, micro_batch=8).splitlines()
    assert head.startswith("| round trip of | raw send/recv | p2p | shm | rpc | p2p / raw |")
    assert row == (
        "| (8, 1024) | 200 us | 300 us | 50 us | 1000 us | 1.50 | 0.25 | 5.00 | "
        "1.60 / 0.40 / 8.00 |"
    )
    del trips["shm"]  # a record without shm (a CUDA run over NCCL): no column for it
    row = round_trip_table(trips, micro_batch=8).splitlines()[2]
    assert row == "| (8, 1024) | 200 us | 300 us | 1000 us | 1.50 | 5.00 | 1.60 / 8.00 |"
    # the same table for the hop to a receiver that waited, named by its first column
    head = round_trip_table(trips, micro_batch=8, lead="hop after 20 ms of waiting, of")
    assert head.startswith("| hop after 20 ms of waiting, of | raw send/recv | p2p | rpc |")


def test_section_names_the_device_and_carries_every_part(tmp_path: Path) -> None:
    args = parse_args(["--device", "cpu", "--markdown", str(tmp_path / "page.md")])
    chart = tmp_path / "_static" / "chart.png"
    out = Results(meta=["Device: CPU"], rows=_rows(), notes=["fairscale: 0.4.13"])
    text = _section(args, out, chart)
    assert text.startswith("## Results on the CPU") and "(_static/chart.png)" in text
    assert "### Each peer against asyncpipe" in text and "- fairscale: 0.4.13" in text
    assert "GPT model" not in text and "(_static" not in _section(args, out, None)


@pytest.mark.slow
def test_suite_runs_end_to_end_and_writes_its_section(tmp_path: Path) -> None:
    page = tmp_path / "suite.md"
    command = [sys.executable, "-m", "benchmarks.suite", "--quick", "--device", "cpu"]
    command += ["--only", "bandwidth,gpt", "--messages", "20", "--markdown", str(page)]
    command += ["--plot", str(tmp_path / "chart.png")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    text = page.read_text()
    assert "<!-- begin: suite device=cpu" in text and "Activation bandwidth" in text
    assert "tokens/s" in text and "one process" in text


def test_bandwidth_table_has_a_column_and_a_ratio_per_transport() -> None:
    from benchmarks.transports import bandwidth_table

    entry = {"bytes": 32768, "bytes_per_s": 2**20 * 100.0, "median_bytes_per_s": 2**20 * 80.0}
    record = {}
    for label in ("small", "large"):
        record[f"{label}-raw"] = entry
        record[f"{label}-p2p"] = {**entry, "bytes_per_s": 2**20 * 50.0}
        record[f"{label}-shm"] = {**entry, "bytes_per_s": 2**20 * 400.0}
        record[f"{label}-rpc"] = {**entry, "bytes_per_s": 2**20 * 25.0}
    head, _, small, _ = bandwidth_table(record, micro_batch=8).splitlines()
    assert "| raw send/recv | p2p | shm | rpc | p2p / raw | shm / raw | rpc / raw |" in head
    assert small == (
        "| (8, 1024) | 32768 | 100 MiB/s | 50 MiB/s | 400 MiB/s | 25 MiB/s | 0.50 | 4.00 | "
        "0.25 | 1.00 / 1.00 / 1.00 |"
    )
    record["small-raw+work"] = {**entry, "bytes_per_s": 2**20 * 40.0}
    note = bandwidth_table(record, micro_batch=8).splitlines()[-1]
    assert note.startswith("The same raw stream of (8, 1024) tensors with 50 us of work")
    assert "40 MiB/s (0.40 of raw; medians 1.00)" in note


def test_schedule_targets_are_judged_per_transport() -> None:
    from benchmarks.schedule_report import table_cells, target_lines
    from benchmarks.schedule_results import Row

    def row(system: str, step: float, simulated: float = 1.0) -> Row:
        return Row(system, 8, simulated_s=simulated, step_s=step)

    rows = [
        row("asyncpipe-gpipe", 1.05),
        row("asyncpipe-1f1b", 1.08),
        row("asyncpipe-interleaved", 1.00, simulated=0.85),  # 1.18x its ideal
        row("asyncpipe-zero_bubble", 0.95),
        row("asyncpipe-gpipe@shm", 1.02),
        row("asyncpipe-1f1b@shm", 1.03),
        row("asyncpipe-interleaved@shm", 0.90, simulated=0.85),
        row("asyncpipe-zero_bubble@shm", 0.92),
        row("torch-1f1b", 1.05),
    ]
    lines = target_lines(rows)
    assert len(lines) == 6
    assert lines[0].startswith("Target (every asyncpipe schedule <= 1.10x")
    assert "NOT met" in lines[0] and "interleaved (V=2) chunks 8: 1.18x" in lines[0]
    assert "met (interleaved (V=2) 0.93x of 1f1b" in lines[1]
    assert lines[2].endswith("NOT met (slower: 1f1b chunks 8: 1.03x)")
    assert lines[3].startswith("Target (every asyncpipe schedule over shm <= 1.10x")
    assert ": met (worst 1.06x)" in lines[3]
    assert "over shm): met (interleaved (V=2) over shm 0.87x of 1f1b over shm" in lines[4]
    assert lines[5].endswith(
        "over shm no slower than torch.distributed.pipelining's same schedule): met"
    )
    cells = table_cells(rows)
    assert cells[5][2] == "1f1b over shm" and cells[5][1] == "asyncpipe"
    assert cells[5][6] == "1.01x"  # against gpipe over shm, not over p2p


def test_step_rows_compare_with_fairscale_overall_and_round_by_round() -> None:
    from benchmarks.transport_steps import FAIRSCALE, step_rows

    steps = {
        "asyncpipe gpipe over p2p": {
            "median_s": 0.36,
            "min_s": 0.35,
            "round_medians_s": [0.36, 0.37, 0.35],
        },
        "asyncpipe gpipe over rpc": {"median_s": 0.5, "min_s": 0.39},  # no rounds recorded
        FAIRSCALE: {"median_s": 0.45, "min_s": 0.42, "round_medians_s": [0.72, 0.37, 0.45]},
    }
    ours, old, peer = step_rows(steps, ideal=0.33)
    cells = [c.strip() for c in ours.strip("|").split("|")]
    assert cells == [
        "asyncpipe gpipe over p2p",
        "360.0 ms",
        "350.0 ms",
        "1.09x",
        "1.25",  # 0.45 / 0.36
        "1.00-2.00",  # rounds: 0.37 / 0.37, 0.45 / 0.35 = 1.29, 0.72 / 0.36
        "0.50-1.00",
    ]
    assert old.split("|")[5:8] == [" 0.90 ", " n/a ", " n/a "]
    assert [c.strip() for c in peer.strip("|").split("|")][-3:] == [
        "1.00",
        "1.00-1.00",
        "1.00-1.00",
    ]
    failed = step_rows({FAIRSCALE: {"error": "ImportError: no fairscale"}}, ideal=0.33)
    assert "did not run: ImportError: no fairscale" in failed[0]


def test_merge_rounds_pools_the_steps_and_keeps_each_rounds_median() -> None:
    from benchmarks.transport_steps import FAIRSCALE, merge_rounds

    rounds = [
        {"a": {"times_s": [0.3, 0.5, 0.4]}, FAIRSCALE: {"error": "ImportError: none"}},
        {"a": {"times_s": [0.2, 0.9]}, FAIRSCALE: {"error": "ImportError: none"}},
    ]
    merged = merge_rounds(rounds)
    assert merged["a"] == {
        "median_s": 0.4,
        "min_s": 0.2,
        "round_medians_s": [0.4, pytest.approx(0.55)],
    }
    assert merged[FAIRSCALE] == {"error": "ImportError: none"}
