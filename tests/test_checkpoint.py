"""Checkpoints over the in-process transport: names as in the plain model, save / load equality
of parameters and optimizer state, resharding, and saves that fail half-way."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from gloo_workers import as_saved_before, tied_lm, tied_lm_batch, tied_lm_resume, tied_reshard
from spawn import run_ranks
from threads import run_threads, values
from torch import nn
from training import batch, model, mse, optimizer, train_step

from asyncpipe import AsyncPipe, checkpoint
from asyncpipe.checkpoint import files
from asyncpipe.transport import Transport


def run(
    balance: list[int],
    job: Any,
    seed: int = 0,
) -> list[Any]:
    """``job(pipe, optimizer, rank)`` on one thread per stage of a fresh model."""
    net = model(seed)

    def fn(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(net, balance, chunks=2, transport=transport, timeout=20)
        return job(pipe, optimizer(pipe.parameters()), rank)

    return values(run_threads(fn, len(balance)))


def optimizer_state(opt: torch.optim.Optimizer, pipe: AsyncPipe) -> dict[str, Any]:
    return files._optimizer_state(pipe, opt)["state"]


def test_state_dict_keys_are_the_plain_models() -> None:
    plain = model().state_dict()

    def job(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        pipe.load_state_dict(plain)  # the whole model's state loads on every stage
        return list(pipe.state_dict())

    def missing(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        with pytest.raises(RuntimeError, match='Missing key.*"4.bias"') as info:
            pipe.load_state_dict({k: v for k, v in plain.items() if k != "4.bias"})
        assert rank != 1 or "layers." not in str(info.value)

    run([3, 2, 3], lambda pipe, opt, rank: missing(pipe, opt, rank) if rank == 1 else None)
    keys = run([3, 2, 3], job)
    assert keys[0] == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    assert keys[1] == ["4.weight", "4.bias"]  # positions 3 (Tanh) and 4
    assert [k for stage in keys for k in stage] == list(plain)


def test_reused_layer_is_saved_under_each_of_its_names() -> None:
    a, b, c = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    plain = torch.nn.Sequential(a, b, c, a)

    def fn(rank: int, transport: Transport) -> list[str]:
        pipe = AsyncPipe([a, b, c, a], [2, 2], transport=transport)
        pipe.load_state_dict(plain.state_dict())
        return list(pipe.state_dict())

    keys = values(run_threads(fn, 2))
    names = ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]
    assert keys == [names, ["2.weight", "2.bias"]]


def test_save_then_load_into_a_fresh_job_goes_on_exactly(tmp_path: Path) -> None:
    def first(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        for step in range(2):
            train_step(pipe, opt, step)
        checkpoint.save(pipe, opt, tmp_path, step=2, extra={"epoch": 0})
        params = {k: v.clone() for k, v in pipe.state_dict().items()}
        state = optimizer_state(opt, pipe)
        return params, state, train_step(pipe, opt, 2)

    def second(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        manifest = checkpoint.load(pipe, opt, tmp_path)
        params = {k: v.clone() for k, v in pipe.state_dict().items()}
        state = optimizer_state(opt, pipe)
        return manifest, params, state, train_step(pipe, opt, manifest.step)

    before = run([4, 4], first)
    after = run([4, 4], second, seed=1)  # other initial weights: all must come from the files
    for (params, state, loss), (manifest, loaded, loaded_state, loss_again) in zip(before, after):
        assert manifest.step == 2 and manifest.extra == {"epoch": 0}
        assert manifest.balance == (4, 4) and manifest.optimizer == "Adam"
        assert params.keys() == loaded.keys()
        for key in params:
            assert torch.equal(params[key], loaded[key]), key
        assert state.keys() == loaded_state.keys() and state
        for name in state:
            for field in state[name]:
                assert torch.equal(state[name][field], loaded_state[name][field]), name
        assert loss_again == loss  # the same next step, bit for bit
    assert sorted(os.listdir(tmp_path)) == [
        "manifest.json",
        "stage0.step2.pt",
        "stage1.step2.pt",
    ]


def test_a_float16_job_resumes_with_the_loss_scale_it_had_reached(tmp_path: Path) -> None:
    def job(resume: bool) -> list[Any]:
        net = model(1 if resume else 0)

        def fn(rank: int, transport: Transport) -> Any:
            pipe = AsyncPipe(
                net, [4, 4], chunks=2, transport=transport, timeout=20,
                autocast=torch.float16, loss_scale=2.0**40,
            )  # fmt: skip
            opt = optimizer(pipe.parameters())
            assert pipe.scaler is not None
            if resume:
                checkpoint.load(pipe, opt, tmp_path)
            else:  # a scale far too large: every step overflows and halves it
                for step in range(3):
                    train_step(pipe, opt, step)
                checkpoint.save(pipe, opt, tmp_path, step=3)
            scale = pipe.scaler.state_dict()
            return scale, [train_step(pipe, opt, step) for step in range(3, 5)]

        return values(run_threads(fn, 2))

    before, after = job(resume=False), job(resume=True)
    assert before[0][0]["scale"] == 2.0**37  # three overflows
    assert after == before  # the same scale, then the same losses (it began at 2**40 again)


def test_reshard_four_stages_to_two_to_the_plain_model(tmp_path: Path) -> None:
    four, two = tmp_path / "four", tmp_path / "two"

    def on_four(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        train_step(pipe, opt, 0)
        checkpoint.save(pipe, opt, four, step=1)
        return train_step(pipe, opt, 1), {k: v.clone() for k, v in pipe.state_dict().items()}

    def on_two(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        step = checkpoint.load(pipe, opt, four).step
        checkpoint.save(pipe, opt, two, step=step)
        return train_step(pipe, opt, step), {k: v.clone() for k, v in pipe.state_dict().items()}

    results4 = run([2, 2, 2, 2], on_four)
    results2 = run([5, 3], on_two, seed=1)
    assert results2[0][0] == pytest.approx(results4[0][0], rel=1e-6)  # the same next step
    after4 = {k: v for _, params in results4 for k, v in params.items()}
    after2 = {k: v for _, params in results2 for k, v in params.items()}
    assert after4.keys() == after2.keys()
    for key in after4:
        torch.testing.assert_close(after2[key], after4[key])

    plain = model(seed=2)
    state = checkpoint.consolidate(two)
    assert list(state) == list(plain.state_dict())
    plain.load_state_dict(state)
    for key, value in checkpoint.consolidate(four).items():
        assert torch.equal(plain.state_dict()[key], value), key


def saved_then_trained(pipe: AsyncPipe, opt: Any, path: Path) -> dict[str, Any]:
    """Train a step, save it as step 1 into ``path``, train another: the state saved."""
    train_step(pipe, opt, 0)
    checkpoint.save(pipe, opt, path, step=1)
    saved = {k: v.clone() for k, v in pipe.state_dict().items()}
    train_step(pipe, opt, 1)
    return saved


def reloaded(path: Path) -> list[Any]:
    """(step, state) on each rank of a fresh [4, 4] pipeline that loaded ``path``."""

    def reload(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        return checkpoint.load(pipe, opt, path).step, pipe.state_dict()

    return run([4, 4], reload, seed=3)


def test_a_save_that_fails_on_one_rank_leaves_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = files._write_atomically

    def failing(where: str, content: Any) -> None:
        if os.path.basename(where) == "stage1.step2.pt":
            with open(where + ".tmp-partial", "wb") as f:
                f.write(b"half a file")  # what a crash mid-write leaves
            raise OSError("disk full")
        write(where, content)

    def job(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        saved = saved_then_trained(pipe, opt, tmp_path)
        with pytest.raises(RuntimeError, match=r"step 2 .* not saved \(rank 1: OSError: disk"):
            checkpoint.save(pipe, opt, tmp_path, step=2)
        return saved

    monkeypatch.setattr(files, "_write_atomically", failing)
    saved = run([4, 4], job)
    monkeypatch.setattr(files, "_write_atomically", write)

    for (step, params), want in zip(reloaded(tmp_path), saved):
        assert step == 1
        for key in want:
            assert torch.equal(params[key], want[key]), key


def test_a_failed_save_of_the_same_step_leaves_that_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving step 1 again (after more training) goes to other files until every rank has
    written; rank 1 failing leaves the first step-1 checkpoint whole on every rank."""
    write = files._write_atomically
    fail = {"on": False}

    def failing(where: str, content: Any) -> None:
        if fail["on"] and os.path.basename(where).startswith("stage1."):
            raise OSError("disk full")
        write(where, content)

    def job(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        saved = saved_then_trained(pipe, opt, tmp_path)
        checkpoint.save(pipe, opt, tmp_path, step=1)  # the same step, other contents: fine
        again = {k: v.clone() for k, v in pipe.state_dict().items()}
        train_step(pipe, opt, 2)
        fail["on"] = True
        with pytest.raises(RuntimeError, match=r"step 1 .* not saved \(rank 1: OSError: disk"):
            checkpoint.save(pipe, opt, tmp_path, step=1)
        return saved, again

    monkeypatch.setattr(files, "_write_atomically", failing)
    saved = run([4, 4], job)
    monkeypatch.setattr(files, "_write_atomically", write)

    for (step, params), (first, again) in zip(reloaded(tmp_path), saved):
        assert step == 1
        for key in again:  # the second save of step 1, whole on both ranks
            assert torch.equal(params[key], again[key]), key
        assert any(not torch.equal(first[k], again[k]) for k in first)
    # the manifest names the files of the second save; the failed one's leftovers (rank 0's
    # file) go at the next good save
    assert sorted(files.read_manifest(tmp_path).files) == ["stage0.step1.b.pt", "stage1.step1.b.pt"]


def test_ranks_that_save_into_different_directories_are_told(tmp_path: Path) -> None:
    def job(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        with pytest.raises(RuntimeError, match=r"stage1.step0.pt are not in .* as rank 0 sees"):
            checkpoint.save(pipe, opt, tmp_path / f"rank{rank}", step=0)
        return sorted(os.listdir(tmp_path / f"rank{rank}"))

    assert run([4, 4], job) == [["stage0.step0.pt"], ["stage1.step0.pt"]]  # no manifest


def test_ranks_that_save_different_steps_are_told_so(tmp_path: Path) -> None:
    """Different steps were blamed on the path (rank 0 missed the other's file); a step that
    is no int on one rank failed there alone, and the other waited until its timeout."""

    def job(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        with pytest.raises(RuntimeError, match="rank 1 saved step 4 where rank 0 saved step 3"):
            checkpoint.save(pipe, opt, tmp_path, step=3 + rank)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 1: TypeError: step must be an int.*None"):
            checkpoint.save(pipe, opt, tmp_path, step=None if rank else 5)  # type: ignore[arg-type]
        return time.monotonic() - started

    assert all(seconds < 10 for seconds in run([4, 4], job))  # the timeout is 20 s
    assert not (tmp_path / files.MANIFEST).exists()


def test_loading_refuses_what_does_not_fit(tmp_path: Path) -> None:
    def nothing_there(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
            checkpoint.load(pipe, opt, tmp_path)

    run([4, 4], nothing_there)
    run([4, 4], lambda pipe, opt, rank: checkpoint.save(pipe, opt, tmp_path, step=0))

    def other_optimizer(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        with pytest.raises(ValueError, match="optimizer 'Adam', not of 'SGD'"):
            checkpoint.load(pipe, torch.optim.SGD(pipe.parameters(), lr=1), tmp_path)

    run([4, 4], other_optimizer)


def test_an_optimizer_over_other_stages_parameters_is_refused_before_anything_loads(
    tmp_path: Path,
) -> None:
    """load failed with a bare KeyError (an id) after it had loaded the weights; save named
    the problem."""
    run([4, 4], lambda pipe, opt, rank: checkpoint.save(pipe, opt, tmp_path, step=0))
    net = model(seed=1)

    def fn(rank: int, transport: Transport) -> None:
        pipe = AsyncPipe(net, [4, 4], transport=transport, timeout=20)
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        whole = optimizer(net.parameters())  # the whole model's, not pipe.parameters()
        with pytest.raises(ValueError, match=r"only this stage's .* build it over pipe.param"):
            checkpoint.load(pipe, whole, tmp_path)
        for key, value in pipe.state_dict().items():
            assert torch.equal(value, before[key]), key
        assert not whole.state

    values(run_threads(fn, 2))


def test_a_tied_weight_keeps_its_optimizer_state_when_a_reshard_splits_the_tie(
    tmp_path: Path,
) -> None:
    """A weight tied on one stage was saved under its first position's name only, so a stage
    holding its other position after a reshard started it with no Adam state (the steps after
    differed); a checkpoint saved so still loads whole (the names of the tie's group)."""
    results = run_ranks(tied_reshard, 2, str(tmp_path), timeout=120)
    saved = {k: v for result in results for k, v in result["saved"].items()}
    for rank, result in enumerate(results):
        for name in ("new", "old"):
            losses, stated, loaded = result[name]
            assert stated, (rank, name)
            assert losses == pytest.approx(result["ref"], rel=1e-5), (rank, name)
            for key, value in loaded.items():  # the tied copy's weights too
                assert torch.equal(value, saved[key]), (rank, name, key)
    assert set(results[1]["new"][2]) == {"3.weight", "3.bias"}  # the tied copy is here


def test_copies_of_a_tie_on_one_stage_get_their_own_optimizer_state(tmp_path: Path) -> None:
    """A checkpoint of a weight tied by one object, loaded onto a model whose copies are two
    parameters kept equal by shared_weights on one stage: each copy gets the tie's state (the
    second got none), in tensors of its own (the optimizer updates them in place)."""

    def net(tied: bool) -> nn.Sequential:
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        if tied:
            layers[3].weight = layers[1].weight
        return layers

    def job(rank: int, transport: Transport, tied: bool) -> Any:
        shared = [] if tied else [("1.weight", "3.weight")]
        pipe = AsyncPipe(net(tied), [4], transport=transport, shared_weights=shared)
        opt = torch.optim.Adam(pipe.parameters(), lr=0.05)
        if tied:
            for step in range(2):
                pipe.step(*batch(step), mse, optimizer=opt)
            checkpoint.save(pipe, opt, tmp_path, step=2)
        else:
            checkpoint.load(pipe, opt, tmp_path)
            first, second = pipe.layers[1].weight, pipe.layers[3].weight
            assert first is not second and first in opt.state and second in opt.state
            for key, value in opt.state[first].items():
                assert value is not opt.state[second][key], key
        return [pipe.step(*batch(step), mse, optimizer=opt) for step in range(2, 5)]

    want = values(run_threads(lambda rank, t: job(rank, t, tied=True), 1))
    assert values(run_threads(lambda rank, t: job(rank, t, tied=False), 1)) == want


def test_a_cut_models_tie_saved_on_one_stage_resumes_on_two(tmp_path: Path) -> None:
    """Tied embedding and head (named by their names in the original model), saved on one
    stage, resumed on two: the head's copy gets the embedding's optimizer state, also from a
    checkpoint saved before state was stored under every position of a tied weight."""
    from cut_models import lm_loss

    net = tied_lm(0)

    def one(rank: int, transport: Transport) -> list[float]:
        pipe = AsyncPipe(net, [5], chunks=2, transport=transport, timeout=20)
        opt = torch.optim.Adam(pipe.parameters(), lr=0.05)
        for step in range(2):
            pipe.step(*tied_lm_batch(step), lm_loss, optimizer=opt)
        checkpoint.save(pipe, opt, tmp_path / "new", step=2)
        return [pipe.step(*tied_lm_batch(step), lm_loss, optimizer=opt) for step in range(2, 5)]

    want = values(run_threads(one, 1))[0]
    as_saved_before(str(tmp_path / "new"), str(tmp_path / "old"), drop="4.module.head.weight")
    for rank, result in enumerate(run_ranks(tied_lm_resume, 2, str(tmp_path), timeout=120)):
        for name, (losses, stated) in result.items():
            assert stated, (rank, name)
            assert losses == pytest.approx(want, rel=1e-5), (rank, name)


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    run([4, 4], lambda pipe, opt, rank: checkpoint.save(pipe, opt, tmp_path, step=0))
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))

    def fn(rank: int, transport: Transport) -> None:
        pipe = AsyncPipe(net, [1, 1], transport=transport)
        with pytest.raises(ValueError, match="a model with 8 layers .* this pipeline has 2"):
            checkpoint.load(pipe, None, tmp_path)

    values(run_threads(fn, 2))
    # the same 8 positions, other layers in them: named, not torch's key lists
    other = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8)) for _ in range(8)])

    def inside(rank: int, transport: Transport) -> None:
        pipe = AsyncPipe(other, [4, 4], transport=transport)
        with pytest.raises(ValueError, match=r"other layers at the same positions: it has no"):
            checkpoint.load(pipe, None, tmp_path)

    values(run_threads(inside, 2))


def test_other_shapes_or_a_missing_bias_at_the_same_positions_are_named(tmp_path: Path) -> None:
    run([4, 4], lambda pipe, opt, rank: checkpoint.save(pipe, opt, tmp_path, step=0))
    first_layers = {
        "wider": [nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8), nn.Tanh()],
        "no bias": [nn.Linear(8, 8, bias=False), nn.LayerNorm(8), nn.Linear(8, 8), nn.Tanh()],
    }
    words = {"wider": r"0.weight \(8, 8\) \(here \(16, 8\)\)", "no bias": r"0.bias \(none here\)"}
    for case, first in first_layers.items():
        net = nn.Sequential(*first, *list(model())[4:])

        def fn(rank: int, transport: Transport, net: nn.Module = net, case: str = case) -> None:
            pipe = AsyncPipe(net, [4, 4], transport=transport)
            if rank == 0:
                with pytest.raises(ValueError, match=f"other layers at the same .*{words[case]}"):
                    checkpoint.load(pipe, None, tmp_path)
            else:  # its layers are the saved ones, but rank 0 refused: it loads nothing
                with pytest.raises(RuntimeError, match=f"loaded on no rank .*{words[case]}"):
                    checkpoint.load(pipe, None, tmp_path)

        values(run_threads(fn, 2))


def test_a_checkpoint_one_rank_refuses_is_loaded_on_no_rank(tmp_path: Path) -> None:
    """load was not collective: the ranks that could load it did, and went on to their first
    step, where they waited for the refusing rank until their timeout."""

    def trained(pipe: AsyncPipe, opt: Any, rank: int) -> None:
        train_step(pipe, opt, 0)
        checkpoint.save(pipe, opt, tmp_path, step=1)

    run([4, 4], trained)
    (tmp_path / "stage0.step1.pt").unlink()  # rank 0's layers are gone, rank 1's are there

    def job(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        before = {k: v.clone() for k, v in pipe.state_dict().items()}
        started = time.monotonic()
        error = (ValueError, "") if rank == 0 else (RuntimeError, "no rank .*rank 0: ValueError: ")
        with pytest.raises(error[0], match=error[1] + r"stage0.step1.pt in .* is missing"):
            checkpoint.load(pipe, opt, tmp_path)
        seconds = time.monotonic() - started
        for key, value in pipe.state_dict().items():
            assert torch.equal(value, before[key]), (rank, key)
        assert not opt.state
        return seconds

    assert all(seconds < 10 for seconds in run([4, 4], job))  # the timeout is 20 s


def test_a_damaged_checkpoint_is_named(tmp_path: Path) -> None:
    run([4, 4], lambda pipe, opt, rank: checkpoint.save(pipe, opt, tmp_path, step=0))
    stage = tmp_path / "stage1.step0.pt"
    stage.write_bytes(stage.read_bytes()[:100])  # what a crash mid-copy leaves

    def fn(rank: int, transport: Transport) -> None:
        pipe = AsyncPipe(model(), [4, 4], transport=transport)
        error = (ValueError, "") if rank == 1 else (RuntimeError, "rank 1: ValueError: ")
        with pytest.raises(error[0], match=error[1] + r"stage1.step0.pt in .* cannot be read"):
            checkpoint.load(pipe, None, tmp_path)

    values(run_threads(fn, 2))
    manifest = tmp_path / files.MANIFEST
    manifest.write_text(manifest.read_text()[:40])
    with pytest.raises(ValueError, match=r"manifest.json cannot be read \(JSONDecodeError"):
        files.read_manifest(tmp_path)
    manifest.write_text(f'{{"format": {files.FORMAT}, "step": 0}}')
    with pytest.raises(ValueError, match=r"manifest.json is not a complete manifest \(KeyError"):
        files.read_manifest(tmp_path)


def test_a_stop_asked_on_one_rank_is_agreed_on_every_rank_after_the_step() -> None:
    def job(pipe: AsyncPipe, opt: Any, rank: int) -> Any:
        seen = []
        for step in range(3):
            if rank == 2 and step == 1:
                pipe.request_stop()
            train_step(pipe, opt, step)
            seen.append(pipe.stop_agreed)
        return seen

    assert run([3, 2, 3], job) == [[False, True, True]] * 3


def test_a_2bw_pipeline_in_flight_is_flushed_before_it_is_saved(tmp_path: Path) -> None:
    """save() and load() refuse a 2BW pipeline with a mini-batch in flight (its update would be
    lost, or run on other weights); GracefulStop.check drains it first, so the checkpoint
    holds every update."""
    net = model(0)

    def fn(rank: int, transport: Transport) -> Any:
        pipe = AsyncPipe(net, [4, 4], chunks=2, schedule="2bw", transport=transport, timeout=20)
        opt = optimizer(pipe.parameters())
        for step in range(2):
            pipe.step(*batch(step), mse, optimizer=opt)
        with pytest.raises(RuntimeError, match=r"call pipe.flush\(\) on every rank before"):
            checkpoint.save(pipe, opt, tmp_path, step=2)
        with pytest.raises(RuntimeError, match=r"call pipe.flush\(\) on every rank before load"):
            checkpoint.load(pipe, opt, tmp_path)  # a mini-batch in flight would go on with it
        stop = checkpoint.GracefulStop.__new__(checkpoint.GracefulStop)  # no signal handlers
        stop.pipe, stop.optimizer, stop.path, stop._previous = pipe, opt, tmp_path, {}
        pipe._runtime.stop_agreed = True  # as if a rank had asked to stop
        with pytest.raises(SystemExit):
            stop.check(2)
        return {k: v.clone() for k, v in pipe.state_dict().items()}, pipe._stream.in_flight

    flushed = values(run_threads(fn, 2))

    for (step, params), (want, in_flight) in zip(reloaded(tmp_path), flushed):
        assert step == 2 and not in_flight
        for key in want:
            assert torch.equal(params[key], want[key]), key
