"""Checkpoint files: one file per stage plus a manifest, written so that a crash never leaves a
checkpoint that looks complete, and read back onto any balance or number of stages.

A checkpoint is a directory on a filesystem every rank sees::

    ckpt/manifest.json          step, layer names, balance, schedule, which file has which layers
    ckpt/stage0.step120.pt      rank 0's layers (keys as in the plain model) and optimizer state
    ckpt/stage1.step120.pt      ...

Every rank writes its file under a temporary name and renames it into place; then it tells
rank 0, which writes the manifest (again through a rename) only once every rank succeeded, and
removes the files of older checkpoints. The manifest names the files of its step, so until the
new manifest is in place the old one still describes a complete, consistent set of files.

Model state is stored under the plain model's names (``"3.weight"`` for position 3 of an
``nn.Sequential``), optimizer state per parameter name, so :func:`load` can pick the layers a
rank owns from any set of files: a checkpoint of 4 stages loads onto 2, or onto the plain model
through :func:`consolidate`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..blame import NEWS_SECONDS, PEER_ERRORS
from ..pipe import AsyncPipe
from ..runtime import CHECKPOINT_CHANNEL
from ..shared import layer_parameter_names
from ..transport import Message, PeerLost, TransportTimeout

__all__: list[str] = []

MANIFEST = "manifest.json"
FORMAT = 1
_FILE = re.compile(r"stage(\d+)\.step(\d+)(\.b)?\.pt$")


def _suffix(step: int, directory: str) -> str:
    """How the files of a save of ``step`` into ``directory`` end: a save of the step the
    complete checkpoint there already has goes to the other of two names, so the files the
    manifest names stay untouched until the new ones are all written (every rank reads the
    same manifest, so all agree)."""
    try:
        manifest = read_manifest(directory)
    except (FileNotFoundError, ValueError):
        return ".pt"
    if manifest.step == step and any(name.endswith(f".step{step}.pt") for name in manifest.files):
        return ".b.pt"
    return ".pt"


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds.

    Attributes:
        step: the step given to :func:`save` (steps finished when it was taken).
        layers: the name of every position of the model, in order.
        balance: the balance of the pipeline that saved it.
        schedule: its schedule name (``"custom"`` for a plan given as data).
        chunks: its micro-batches per mini-batch.
        files: for each stage file, the names of the positions whose state it holds.
        optimizer: the optimizer's class name, or ``""`` if none was saved.
        extra: the JSON value rank 0 passed to :func:`save` as ``extra``.
    """

    step: int
    layers: tuple[str, ...]
    balance: tuple[int, ...]
    schedule: str
    chunks: int
    files: Mapping[str, tuple[str, ...]]
    optimizer: str
    extra: Any = None


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of the checkpoint in directory ``path``.

    Raises:
        FileNotFoundError: if ``path`` holds no complete checkpoint.

    Example:
        >>> asyncpipe.checkpoint.read_manifest("ckpt").step  # doctest: +SKIP
        120
    """
    where = os.path.join(os.fspath(path), MANIFEST)
    if not os.path.exists(where):
        raise FileNotFoundError(
            f"no complete checkpoint in {os.fspath(path)!r} (it has no {MANIFEST}: nothing was "
            f"saved there, or the first save did not finish); save one with "
            f"asyncpipe.checkpoint.save(pipe, optimizer, path, step=...)"
        )
    try:
        with open(where) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{where} cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{where} has format {found!r}, this version reads format {FORMAT}")
    try:
        return Manifest(
            step=int(data["step"]),
            layers=tuple(data["layers"]),
            balance=tuple(data["balance"]),
            schedule=str(data["schedule"]),
            chunks=int(data["chunks"]),
            files={name: tuple(layers) for name, layers in data["files"].items()},
            optimizer=str(data["optimizer"]),
            extra=data.get("extra"),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(
            f"{where} is not a complete manifest ({type(e).__name__}: {e}): it was changed by "
            f"hand or written by another program"
        ) from e


def _write_atomically(where: str, write: Any) -> None:
    """``write(file)`` into a temporary file next to ``where``, synced, then renamed over it."""
    temporary = f"{where}.tmp{os.getpid()}"
    try:
        with open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, where)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _parameter_names(pipe: AsyncPipe) -> dict[int, list[str]]:
    """id of each local parameter -> its names in the plain model's state dict, one for each
    position holding it (first: its first local position). A weight tied within this stage
    (a reused layer, or ``model[2].weight = model[1].weight``) has several."""
    names: dict[int, list[str]] = {}
    for index, layer in enumerate(pipe.layers):
        for position in pipe.local_names[index]:
            for rest, param in layer.named_parameters(remove_duplicate=False):
                held = names.setdefault(id(param), [])
                if f"{position}.{rest}" not in held:
                    held.append(f"{position}.{rest}")
    return names


def _owned_names(pipe: AsyncPipe, optimizer: torch.optim.Optimizer) -> dict[int, list[str]]:
    """:func:`_parameter_names`, once it is checked that ``optimizer`` holds only this
    stage's parameters (ValueError if not)."""
    names = _parameter_names(pipe)
    foreign = [
        tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if id(p) not in names
    ]
    if foreign:
        raise ValueError(
            f"the optimizer must hold only this stage's parameters, but {len(foreign)} are not "
            f"this stage's (shapes {foreign[:4]}); build it over pipe.parameters()"
        )
    return names


def _optimizer_state(pipe: AsyncPipe, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with parameters named as in the plain model: a parameter at
    several positions under each of their names, so that a stage holding any of them after a
    reshard finds its state."""
    names = _owned_names(pipe, optimizer)
    saved = optimizer.state_dict()
    state: dict[str, Any] = {}
    groups = []
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        params = [names[id(p)] for p in group["params"]]
        for aliases, index in zip(params, saved_group["params"]):
            if index in saved["state"]:
                state.update((name, saved["state"][index]) for name in aliases)
        hyper = {k: v for k, v in saved_group.items() if k != "params"}
        groups.append({**hyper, "params": [name for aliases in params for name in aliases]})
    return {"state": state, "param_groups": groups}


def _exchange(pipe: AsyncPipe, error: str | None, step: int, done: str = "saved") -> str | None:
    """Every rank tells rank 0 how its part of saving (or loading, ``done="loaded"``) ``step``
    went; rank 0 answers with the verdict (:func:`_answer`). Returns the problems reported
    (rank 0 adds its own, and ranks that ``done`` another step), or None when all went well."""
    transport, timeout, world = pipe.transport, pipe.timeout, pipe.transport.world_size
    ok = (torch.tensor([float(step)], dtype=torch.float64),)
    if transport.rank != 0:
        transport.send(0, CHECKPOINT_CHANNEL, Message(0, 1, ok, error=error))
        waits = timeout + min(timeout, NEWS_SECONDS)  # rank 0 may wait `timeout` for a rank
        try:
            answer = transport.recv(0, CHECKPOINT_CHANNEL).wait(waits)
        except PEER_ERRORS as e:  # rank 0 waits for every rank first: the fault may be theirs
            lost = isinstance(e, ConnectionError)
            how = "lost rank 0" if lost else f"timed out after {waits:.1f} s"
            text = (
                f"rank {transport.rank} {how} waiting for rank 0's verdict on the checkpoint, "
                f"which rank 0 gives once every rank told it how its part went (waiting up to "
                f"{timeout:.1f} s for them): a rank slow, stuck or gone may be at fault, not "
                f"rank 0; rank 0's error names any that did not answer (raise the pipeline's "
                f"timeout if their work really takes longer)"
            )
            raise (PeerLost(text, 0) if lost else TransportTimeout(text)) from e
        # rank 0 answers after it took every rank's part; it may exit at once (GracefulStop)
        transport.flush_received(timeout)
        return answer.error
    problems = [f"rank 0: {error}"] if error else []
    # all posted at once, waited for against one deadline: the verdict comes within ``waits``
    pending = {peer: transport.recv(peer, CHECKPOINT_CHANNEL) for peer in range(1, world)}
    deadline = time.monotonic() + timeout
    for peer, receive in pending.items():
        try:
            message = receive.wait(max(deadline - time.monotonic(), 0.1))
        except Exception as e:
            problems.append(f"rank {peer}: no answer ({e})")
            continue
        if message.error is not None:
            problems.append(f"rank {peer}: {message.error}")
            continue
        theirs = int(message.values(peer, "checkpoint step")[0])
        if error is None and theirs != step:
            problems.append(
                f"rank {peer} {done} step {theirs} where rank 0 {done} step {step}: pass the "
                f"same {'step' if done == 'saved' else 'path'} on every rank"
            )
    return "; ".join(problems) or None


def _answer(pipe: AsyncPipe, verdict: str | None) -> None:
    """Rank 0 tells every other rank the verdict of :func:`_exchange`."""
    transport = pipe.transport
    news = Message(0, 1, (torch.zeros(1),), error=verdict)
    for peer in range(1, transport.world_size):
        with contextlib.suppress(Exception):  # a rank that is gone learns nothing, needs nothing
            transport.send(peer, CHECKPOINT_CHANNEL, news)
    # A peer that took the verdict may end its process at once (GracefulStop exits): over
    # rpc the receipt of the send then never comes back, which is no failure of the save.
    with contextlib.suppress(Exception):
        transport.flush(pipe.timeout)


def save(
    pipe: AsyncPipe,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
    *,
    step: int,
    extra: Any = None,
) -> None:
    """Save the pipeline (and optimizer) of every rank into directory ``path``.

    Call it on every rank at the same point, between steps (with data parallelism too: the
    ranks of replica 0 write, the other replicas learn the outcome). It returns once the
    checkpoint is complete on every rank; a checkpoint of an earlier step (or of the same
    step) in ``path`` stays valid until then and is removed after. Under
    ``schedule="2bw"``, call ``pipe.flush()`` first: a mini-batch still in flight has not had
    its update. With float16 autocast, the loss scale is saved too.

    Args:
        pipe: this rank's pipeline.
        optimizer: an optimizer over ``pipe.parameters()``, or None.
        path: a directory every rank can write (created if missing): the same path on every
            rank, in a file system every rank sees (rank 0 checks that it sees every stage's
            file before it writes the manifest).
        step: the number of steps finished, returned by :func:`load`.
        extra: a JSON value stored from rank 0 (e.g. the position of the data loader).

    Raises:
        RuntimeError: on every rank, if any rank could not write its file (the old
            checkpoint, if any, is left in place), or a 2BW pipeline is not flushed.

    Example:
        >>> asyncpipe.checkpoint.save(pipe, optimizer, "ckpt", step=step)  # doctest: +SKIP
    """
    pipe._guard()  # a failed pipeline cannot exchange: say so, not the transport's error
    if pipe.in_flight:  # the same on every rank: all raise
        raise RuntimeError(
            "schedule '2bw' keeps a mini-batch in flight between steps, whose backwards and "
            "update a checkpoint would lose; call pipe.flush() on every rank before saving"
        )
    directory = os.fspath(path)
    verdict = None
    if pipe.data_parallel_rank == 0:  # replicas hold the same weights: the first one writes
        verdict = _save_pipeline(pipe, optimizer, directory, step, extra)
    if pipe.data_parallel_size > 1:  # every replica learns whether it was saved
        failed = pipe._replicas_max(1.0 if verdict is not None else 0.0)
        if failed and verdict is None:
            verdict = "replica 0 could not write it; see the errors of its ranks"
    if verdict is not None:
        raise RuntimeError(
            f"the checkpoint of step {step} in {directory!r} was not saved ({verdict}); the "
            f"previous checkpoint there, if any, is still complete"
        )


def _step_number(step: object) -> int:
    """``step`` as an int, or a TypeError saying what it must be."""
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise TypeError(
            f"step must be an int, the number of steps finished (load returns it), got "
            f"{step!r}; pass the same step on every rank"
        )
    number: int = step.__index__()
    return number


def _save_pipeline(
    pipe: AsyncPipe,
    optimizer: torch.optim.Optimizer | None,
    directory: str,
    given: object,
    extra: Any,
) -> str | None:
    """Write this rank's stage file, and on rank 0 the manifest once every rank succeeded;
    the verdict, the same on every rank of the pipeline (None: saved). Each rank checks its
    own ``given`` step, and rank 0 that every rank's is its own, before the manifest."""
    rank = pipe.transport.rank
    error = None
    step = -1
    try:
        step = _step_number(given)
        name = f"stage{rank}.step{step}{_suffix(step, directory)}"
        os.makedirs(directory, exist_ok=True)
        content = {
            "format": FORMAT,
            "step": step,
            "model": pipe.state_dict(),
            "optimizer": None if optimizer is None else _optimizer_state(pipe, optimizer),
            "loss_scale": None if pipe.scaler is None else pipe.scaler.state_dict(),
        }
        _write_atomically(os.path.join(directory, name), lambda f: torch.save(content, f))
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    verdict = _exchange(pipe, error, step)
    if rank == 0:
        if verdict is None:
            try:
                _write_manifest(pipe, optimizer, directory, step, extra)
            except Exception as e:
                verdict = f"rank 0 could not write the manifest: {type(e).__name__}: {e}"
        _answer(pipe, verdict)
    return verdict


def _write_manifest(
    pipe: AsyncPipe,
    optimizer: torch.optim.Optimizer | None,
    directory: str,
    step: int,
    extra: Any,
) -> None:
    files = {}
    suffix = _suffix(step, directory)  # read before the new manifest replaces the old
    for part in pipe.partitions:
        names = [pipe.layer_names[inv.order] for inv in part.invocations]
        files[f"stage{part.stage}.step{step}{suffix}"] = names
    missing = [name for name in files if not os.path.exists(os.path.join(directory, name))]
    if missing:
        raise FileNotFoundError(
            f"the stage files {', '.join(missing)} are not in {directory!r} as rank 0 sees it: "
            f"every rank must pass the same path, in a file system every rank sees"
        )
    manifest = {
        "format": FORMAT,
        "step": step,
        "layers": pipe.layer_names,
        "balance": pipe.balance,
        "schedule": pipe.schedule if isinstance(pipe.schedule, str) else "custom",
        "chunks": pipe.chunks,
        "files": files,
        "optimizer": "" if optimizer is None else type(optimizer).__name__,
        "extra": extra,
    }
    text = json.dumps(manifest, indent=1).encode()
    _write_atomically(os.path.join(directory, MANIFEST), lambda f: f.write(text))
    for entry in os.listdir(directory):  # files of older checkpoints, or of failed saves
        if _FILE.match(entry) and entry not in files:
            os.remove(os.path.join(directory, entry))


def _read(directory: str, names: set[str], manifest: Manifest) -> list[dict[str, Any]]:
    """The contents of the stage files that hold any of the layers ``names``."""
    out = []
    for file, layers in manifest.files.items():
        if names & set(layers):
            try:
                content = torch.load(os.path.join(directory, file), map_location="cpu")
            except FileNotFoundError as e:
                raise ValueError(
                    f"{file} in {directory!r} is missing (the manifest names it): restore it, "
                    f"or load another checkpoint"
                ) from e
            except Exception as e:
                raise ValueError(
                    f"{file} in {directory!r} cannot be read ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); the file is damaged: restore "
                    f"it, or load another checkpoint"
                ) from e
            step = content.get("step") if isinstance(content, dict) else None
            if step != manifest.step:
                raise ValueError(
                    f"{file} in {directory!r} holds step {step} but the manifest "
                    f"says step {manifest.step}; the checkpoint was changed by hand"
                )
            out.append(content)
    return out


def load(
    pipe: AsyncPipe,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
) -> Manifest:
    """Load the checkpoint in ``path`` into this rank's pipeline (and optimizer).

    The checkpoint may come from a pipeline with another balance or number of stages: each rank
    reads the files that hold its layers. Call it on every rank after building ``pipe`` and the
    optimizer (over ``pipe.parameters()``), before the first step (under ``schedule="2bw"``,
    after ``pipe.flush()``). The ranks check everything before any of them changes anything:
    if one rank refuses the checkpoint, no rank loads it.

    Returns:
        the checkpoint's manifest: ``manifest.step`` is the step to go on from.

    Raises:
        FileNotFoundError: if ``path`` holds no complete checkpoint.
        ValueError: if it is of another model (other layers, or other shapes or parameters
            in the same layers), or of another optimizer, or a file of it cannot be read
            (the error names the file), or ``optimizer`` holds parameters of other stages.
        RuntimeError: on the other ranks, when one of them raised one of these (rank 0
            names it and its error), or the ranks read checkpoints of different steps;
            nothing was loaded on any rank.

    Example:
        >>> start = asyncpipe.checkpoint.load(pipe, optimizer, "ckpt").step  # doctest: +SKIP
    """
    pipe._guard()
    if pipe.in_flight:  # the same on every rank: all raise
        raise RuntimeError(
            "schedule '2bw' keeps a mini-batch in flight between steps, which would go on with "
            "the loaded weights; call pipe.flush() on every rank before loading"
        )
    directory = os.fspath(path)
    failure: Exception | None = None
    found = None
    try:
        found = _check(pipe, optimizer, directory)
    except Exception as e:
        failure = e
    error = None if failure is None else f"{type(failure).__name__}: {failure}"
    verdict = _exchange(pipe, error, -1 if found is None else found[0].step, done="loaded")
    if pipe.transport.rank == 0:
        _answer(pipe, verdict)
    if pipe.data_parallel_size > 1:  # one replica loading alone would leave the others apart
        failed = pipe._replicas_max(1.0 if verdict is not None else 0.0)
        if failed and verdict is None:
            verdict = "another replica's ranks refused it; see the errors there"
    if failure is not None:
        raise failure
    if verdict is not None or found is None:
        raise RuntimeError(
            f"the checkpoint in {directory!r} was loaded on no rank ({verdict}); this rank "
            f"could have loaded it: fix the problem named and load again on every rank"
        )
    manifest, model, contents, owned = found
    pipe.load_state_dict(model)
    scales = [c["loss_scale"] for c in contents if c.get("loss_scale")]
    if pipe.scaler is not None and scales:  # float16: go on with the scale it had reached
        pipe.scaler.load_state_dict(scales[0])
    if optimizer is not None and owned is not None:
        saved = [c["optimizer"] for c in contents if c["optimizer"]]
        _load_optimizer(pipe, optimizer, saved, owned)
    return manifest


def _check(
    pipe: AsyncPipe, optimizer: torch.optim.Optimizer | None, directory: str
) -> tuple[Manifest, dict[str, Tensor], list[dict[str, Any]], dict[int, list[str]] | None]:
    """This rank's part of :func:`load` before it changes anything: the manifest, the model
    state of the local layers, the stage files read, and the optimizer's parameter names; or
    the error that refuses the checkpoint."""
    manifest = read_manifest(directory)
    problems = []
    if list(manifest.layers) != pipe.layer_names:
        problems.append(
            f"the checkpoint is of a model with {len(manifest.layers)} layers named "
            f"{list(manifest.layers)[:8]}..., this pipeline has {len(pipe.layer_names)} named "
            f"{pipe.layer_names[:8]}...; load it into the model it was saved from"
        )
    if optimizer is not None and manifest.optimizer != type(optimizer).__name__:
        problems.append(
            f"the checkpoint holds the state of optimizer {manifest.optimizer or 'none'!r}, "
            f"not of {type(optimizer).__name__!r}; build the same optimizer, or pass None"
        )
    if problems:
        raise ValueError("; ".join(problems))
    owned = None if optimizer is None else _owned_names(pipe, optimizer)  # before any change
    mine = {name for names in pipe.local_names for name in names}
    contents = _read(directory, mine, manifest)
    model: dict[str, Tensor] = {}
    for content in contents:
        model.update(content["model"])
    missing = sorted(set(pipe.state_dict()) - set(model))
    if missing:  # same positions, other layers inside them
        layers = {key.split(".")[0] for key in missing}
        held = sorted(k for k in model if k.split(".")[0] in layers)
        raise ValueError(
            f"the checkpoint in {directory!r} is of a model with other layers at the same "
            f"positions: it has no {missing[:4]} (it holds {held[:4]} there); load it into "
            f"the model it was saved from"
        )
    own = pipe.state_dict()
    other = [
        f"{key} {tuple(value.shape)} (here {tuple(own[key].shape)})"
        for key, value in model.items()
        if key in own and isinstance(value, Tensor) and value.shape != own[key].shape
    ]
    other += [
        f"{key} (none here)"
        for key in model
        if key not in own and any(key.startswith(f"{name}.") for name in mine)
    ]
    if other:
        raise ValueError(
            f"the checkpoint in {directory!r} is of a model with other layers at the same "
            f"positions: it holds {', '.join(other[:4])}; load it into the model it was saved "
            f"from"
        )
    return manifest, model, contents, owned


def _shared_names(pipe: AsyncPipe) -> dict[int, list[str]]:
    """id of each local parameter in a ``shared_weights`` group -> the names in the plain
    model's state dict of every parameter of its group, at every position of the model (a
    layer built on another stage only, a ``LazyModule``, is left out). A checkpoint saved
    before optimizer state was stored under each position of a tied weight holds it under one
    name only, which may be of a position now on another stage."""
    called: dict[str, list[int]] = {}  # a name shared_weights may use -> ids it names
    keys: dict[int, list[str]] = {}  # id -> state dict names, over every position
    for part in pipe.partitions:
        mine = part.stage == pipe.stage
        for inv in part.invocations:
            layer = pipe.layers[inv.this.index] if mine else part.layers[inv.this.index]
            if not isinstance(layer, nn.Module):  # a LazyModule built elsewhere
                continue
            for name, param in layer_parameter_names(inv.order, layer):
                called.setdefault(name, []).append(id(param))
            for rest, param in layer.named_parameters(remove_duplicate=False):
                keys.setdefault(id(param), []).append(f"{pipe.layer_names[inv.order]}.{rest}")
    out: dict[int, list[str]] = {}
    for group in pipe._shared.groups:
        ids = {key: None for name in group.names for key in called.get(name, [])}
        names = [name for key in ids for name in keys.get(key, [])]
        for param in group.local:
            out.setdefault(id(param), []).extend(names)
    return out


def _load_optimizer(
    pipe: AsyncPipe,
    optimizer: torch.optim.Optimizer,
    saved: list[dict[str, Any]],
    names: dict[int, list[str]],
) -> None:
    """Give each parameter its saved state, and each group the hyperparameters of the saved
    group its first parameter was in (e.g. a learning rate a scheduler changed). A parameter's
    state is looked up under each of its names (``names``, from :func:`_owned_names`), then
    under those of the other copies of its ``shared_weights`` group."""
    shared = _shared_names(pipe)
    state = {name: value for part in saved for name, value in part["state"].items()}
    group_of = {name: g for part in saved for g in part["param_groups"] for name in g["params"]}
    current = optimizer.state_dict()
    new_state: dict[int, Any] = {}
    given: set[int] = set()
    groups = []
    for group, index_group in zip(optimizer.param_groups, current["param_groups"]):
        params = [names[id(p)] + shared.get(id(p), []) for p in group["params"]]
        for aliases, index in zip(params, index_group["params"]):
            found = next((name for name in aliases if name in state), None)
            if found is not None:  # two copies of a tie here may find one saved state: the
                value = state[found]  # optimizer updates its tensors in place, so copy it
                new_state[index] = copy.deepcopy(value) if id(value) in given else value
                given.add(id(value))
        first = params[0] if params else []
        source = next((group_of[name] for name in first if name in group_of), None)
        hyper = {k: v for k, v in (source or index_group).items() if k != "params"}
        groups.append({**hyper, "params": index_group["params"]})
    optimizer.load_state_dict({"state": new_state, "param_groups": groups})


def consolidate(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The state dict of the plain model, put together from every stage file of a checkpoint.

    Example:
        >>> model.load_state_dict(asyncpipe.checkpoint.consolidate("ckpt"))  # doctest: +SKIP
    """
    directory = os.fspath(path)
    manifest = read_manifest(directory)
    merged: dict[str, Tensor] = {}
    for content in _read(directory, set(manifest.layers), manifest):
        merged.update(content["model"])
    position = {name: n for n, name in enumerate(manifest.layers)}
    keys = sorted(merged, key=lambda k: position[k.split(".", 1)[0]])  # stable: keeps order
    return {key: merged[key] for key in keys}
