"""Checkpoints that load all or nothing: a stage without optimizer, a forward waiting for its
backward, ranks reading different saves of one step, incomplete stage files, types torch.load
refuses, and temporary files of killed writers (over the in-process transport)."""

from __future__ import annotations

import fractions
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from threads import run_threads, values
from torch import nn
from training import batch, model, mse, optimizer, train_step

from asyncpipe import AsyncPipe, checkpoint
from asyncpipe.checkpoint import files
from asyncpipe.transport import Transport


def run(balance: list[int], job: Any, seed: int = 0) -> list[Any]:
    """``job(pipe, optimizer, rank)`` on one thread per stage of a fresh model."""
    net = model(seed)

    def fn(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(net, balance, chunks=2, transport=transport, timeout=20)
        return job(pipe, optimizer(pipe.parameters()), rank)

    return values(run_threads(fn, len(balance), timeout=120))


def no_params_first(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 8))


def test_a_stage_without_optimizer_does_not_refuse_the_others(tmp_path: Path) -> None:
    """Rank 0 holds no parameters, so no optimizer (None, as the docs say); rank 1 uses Adam.
    Before, the manifest recorded rank 0's optimizer only ("") and every load refused the
    checkpoint ("optimizer 'none', not of 'Adam'")."""

    def job(kind: type[torch.optim.Optimizer], seed: int, save: bool) -> list[Any]:
        net = no_params_first(seed)

        def fn(rank: int, transport: Transport) -> Any:
            pipe = AsyncPipe(net, [2, 2], chunks=2, transport=transport, timeout=20)
            params = list(pipe.parameters())
            opt = kind(params, lr=0.01) if params else None
            if save:
                pipe.step(*batch(0), mse)
                if opt is not None:
                    opt.step()
                checkpoint.save(pipe, opt, tmp_path, step=1)
                return pipe.state_dict(), None if opt is None else opt.state_dict()["state"]
            manifest = checkpoint.load(pipe, opt, tmp_path)
            return pipe.state_dict(), None if opt is None else opt.state_dict()["state"], manifest

        return run_threads(fn, 2, timeout=120)

    saved = values(job(torch.optim.Adam, 0, save=True))
    loaded = values(job(torch.optim.Adam, 1, save=False))
    manifest = loaded[0][2]
    assert manifest.optimizers == {"stage0.step1.pt": "", "stage1.step1.pt": "Adam"}
    assert manifest.optimizer == "Adam"
    for key, value in saved[1][0].items():
        assert torch.equal(loaded[1][0][key], value), key
    assert set(loaded[1][1]) == set(saved[1][1]) != set()  # Adam's state came back
    assert torch.equal(loaded[1][1][0]["exp_avg"], saved[1][1][0]["exp_avg"])
    # the class of each stage's optimizer is checked, and the refusal names the stage
    refused = job(torch.optim.SGD, 1, save=False)
    assert [status for status, _ in refused] == ["error", "error"]
    assert isinstance(refused[1][1], ValueError)
    text = str(refused[1][1])
    assert "stage1.step1.pt (stage 1's) holds the state of optimizer 'Adam', not of 'SGD'" in text
    assert "rank 1: ValueError" in str(refused[0][1])


def test_load_is_refused_while_a_forward_waits_for_its_backward(tmp_path: Path) -> None:
    """Before, load copied the checkpoint into the parameters a pending pipe(input) had used:
    the backward then failed or gave gradients of neither model."""
    net = model(0)

    def fn(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(net, [4, 4], chunks=2, transport=transport, timeout=20)
        opt = optimizer(pipe.parameters())
        checkpoint.save(pipe, opt, tmp_path, step=0)
        with torch.no_grad():
            for param in pipe.parameters():
                param.add_(0.5)
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        x, y = batch(0)
        out = pipe(x)
        with pytest.raises(RuntimeError, match=r"pipe\(input\) still waits for its backward"):
            checkpoint.load(pipe, opt, tmp_path)
        assert all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items())
        if pipe.is_last_stage:
            mse(out, y).backward()
        else:
            pipe.back_helper(out)
        return checkpoint.load(pipe, opt, tmp_path).step  # after the backward: loads

    assert values(run_threads(fn, 2, timeout=120)) == [0, 0]


def trained_and_saved(path: Path, step: int = 1) -> Any:
    """A job that trains a step, saves it as ``step`` into ``path`` and returns its state."""

    def job(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        train_step(pipe, opt, 0)
        checkpoint.save(pipe, opt, path, step=step)
        return pipe.state_dict()

    return job


def save_two_runs(tmp_path: Path) -> None:
    for seed, name in ((0, "run_a"), (1, "run_b")):
        run([4, 4], trained_and_saved(tmp_path / name), seed)


def test_ranks_reading_two_saves_of_one_step_are_refused_on_every_rank(tmp_path: Path) -> None:
    """Before, only the steps were compared: rank 0 loaded run_a, rank 1 run_b."""
    save_two_runs(tmp_path)
    net = model(5)
    before = {k: v.clone() for k, v in net.state_dict().items()}

    def fn(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(net, [4, 4], chunks=2, transport=transport, timeout=20)
        where = tmp_path / ("run_a" if rank == 0 else "run_b")
        return checkpoint.load(pipe, optimizer(pipe.parameters()), where).step

    results = run_threads(fn, 2, timeout=120)
    for status, error in results:
        assert status == "error"
        assert isinstance(error, RuntimeError)
        assert "rank 1 read another checkpoint of step 1 than rank 0" in str(error)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_a_stage_file_of_another_save_is_refused(tmp_path: Path) -> None:
    """A file copied in from another save of the same step (same name) is told apart by its id."""
    save_two_runs(tmp_path)
    (tmp_path / "run_a" / "stage1.step1.pt").write_bytes(
        (tmp_path / "run_b" / "stage1.step1.pt").read_bytes()
    )

    def job(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        with pytest.raises((ValueError, RuntimeError)) as info:
            checkpoint.load(pipe, opt, tmp_path / "run_a")
        return str(info.value)

    texts = run([4, 4], job, seed=5)
    assert all("stage1.step1.pt" in text and "another save" in text for text in texts)
    with pytest.raises(ValueError, match="is of another save than its manifest"):
        checkpoint.consolidate(tmp_path / "run_a")


def test_a_checkpoint_saved_before_ids_still_loads(tmp_path: Path) -> None:
    """Files and manifest without ids or optimizer classes, as earlier versions wrote them."""
    saved = run([4, 4], trained_and_saved(tmp_path, step=3))
    manifest = json.loads((tmp_path / files.MANIFEST).read_text())
    for key in ("id", "ids", "optimizers"):
        del manifest[key]
    (tmp_path / files.MANIFEST).write_text(json.dumps(manifest))
    for name in manifest["files"]:
        content = torch.load(tmp_path / name)
        del content["id"], content["optimizer_class"]
        torch.save(content, tmp_path / name)
    loaded = run([2, 6], lambda p, o, r: (checkpoint.load(p, o, tmp_path).step, p.state_dict()), 4)
    assert [step for step, _ in loaded] == [3, 3]
    want = {k: v for state in saved for k, v in state.items()}
    for _, state in loaded:
        for key, value in state.items():
            assert torch.equal(value, want[key]), key


def test_an_incomplete_stage_file_is_refused_before_any_rank_loads(tmp_path: Path) -> None:
    """A stage file without its "optimizer" entry: before, its rank loaded the weights, then
    raised a KeyError, while the other ranks loaded everything."""
    run([2, 2, 4], trained_and_saved(tmp_path))
    where = tmp_path / "stage1.step1.pt"
    content = torch.load(where)
    del content["optimizer"]
    torch.save(content, where)
    fresh = model(5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}

    def fn(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(fresh, [2, 2, 4], chunks=2, transport=transport, timeout=20)
        opt = optimizer(pipe.parameters())
        return checkpoint.load(pipe, opt, tmp_path).step, len(opt.state)

    results = run_threads(fn, 3, timeout=120)
    assert [status for status, _ in results] == ["error"] * 3
    assert isinstance(results[1][1], ValueError)
    assert "stage1.step1.pt" in str(results[1][1])
    assert "has no 'optimizer' entry" in str(results[1][1])
    assert all("rank 1: ValueError" in str(error) for _, error in results[::2])
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert checkpoint.consolidate(tmp_path).keys() == model().state_dict().keys()


class Ratio(nn.Linear):
    """A layer whose extra state is a Python object torch.load(weights_only=True) refuses."""

    def get_extra_state(self) -> Any:
        return {"ratio": fractions.Fraction(1, 3)}

    def set_extra_state(self, state: Any) -> None:
        self.ratio = state["ratio"]


def test_a_type_torch_load_refuses_is_named_with_the_way_to_allow_it(tmp_path: Path) -> None:
    """Before, load called such a file damaged ("restore it")."""
    torch.manual_seed(0)
    net = nn.Sequential(Ratio(8, 8), nn.Tanh(), Ratio(8, 8), nn.Tanh())

    def fn(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(net, [2, 2], chunks=2, transport=transport, timeout=20)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        checkpoint.save(pipe, opt, tmp_path, step=1)
        with pytest.raises(ValueError) as info:
            checkpoint.load(pipe, opt, tmp_path)
        return str(info.value)

    for text in values(run_threads(fn, 2, timeout=120)):
        assert "holds an object of type fractions.Fraction" in text
        assert "torch.serialization.add_safe_globals([fractions.Fraction])" in text
        assert "damaged" not in text
    with torch.serialization.safe_globals([fractions.Fraction]):
        state = checkpoint.consolidate(tmp_path)
    assert state["0._extra_state"]["ratio"] == fractions.Fraction(1, 3)


def test_temporary_files_of_killed_writers_are_removed(tmp_path: Path) -> None:
    """A rank killed mid-write leaves ``stage<r>.step<n>.pt.tmp<pid>`` (and rank 0
    ``manifest.json.tmp<pid>``); the next complete save removes those older than itself and
    leaves a newer one (a write under way) alone. Before, they stayed for good."""
    tmp_path.mkdir(exist_ok=True)
    orphans = ["stage1.step2.pt.tmp4242", "stage0.step2.b.pt.tmp4243", "manifest.json.tmp4244"]
    old = time.time() - 3600
    for name in orphans:
        (tmp_path / name).write_bytes(b"half a file")
        os.utime(tmp_path / name, (old, old))
    busy = tmp_path / "stage1.step9.pt.tmp4245"
    busy.write_bytes(b"being written")
    future = time.time() + 3600  # written to after this save started
    os.utime(busy, (future, future))
    other = tmp_path / "notes.txt.tmp1"
    other.write_bytes(b"not ours")
    os.utime(other, (old, old))
    run([4, 4], lambda pipe, opt, rank: checkpoint.save(pipe, opt, tmp_path, step=3))
    left = sorted(os.listdir(tmp_path))
    assert left == sorted(
        ["manifest.json", "stage0.step3.pt", "stage1.step3.pt", busy.name, other.name]
    )
