"""Checkpoint files: one file per stage plus a manifest, written so that a crash never leaves a
checkpoint that looks complete (:mod:`.restore` reads them back onto any balance).

A checkpoint is a directory on a filesystem every rank sees::

    ckpt/manifest.json          step, layer names, balance, schedule, which file has which layers,
                                each file's id and optimizer class
    ckpt/stage0.step120.pt      rank 0's layers (keys as in the plain model) and optimizer state
    ckpt/stage1.step120.pt      ...

Every rank writes its file under a temporary name and renames it into place; then it tells
rank 0, which writes the manifest (again through a rename) only once every rank succeeded, and
removes the files of older checkpoints (and temporary files a killed rank left). The manifest
names the files of its step, and each file's random id (also stored in the file), so until the
new manifest is in place the old one still describes a complete, consistent set of files, and a
file of another save is told apart even where it has the same name.

Model state is stored under the plain model's names (``"3.weight"`` for position 3 of an
``nn.Sequential``), optimizer state per parameter name, so :func:`load` can pick the layers a
rank owns from any set of files: a checkpoint of 4 stages loads onto 2, or onto the plain model
through :func:`consolidate`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..pipe import AsyncPipe
from .verdict import Report, answer, exchange

__all__: list[str] = []

MANIFEST = "manifest.json"
FORMAT = 1
_FILE = re.compile(r"stage(\d+)\.step(\d+)(\.b)?\.pt$")
_TEMPORARY = re.compile(r"(stage\d+\.step\d+(\.b)?\.pt|manifest\.json)\.tmp\d+$")


def new_id() -> int:
    """A random id for a stage file or manifest: 48 bits, never 0 (0 stands for "none":
    checkpoints written before ids), exact as a float64 in :class:`.verdict.Report`."""
    return secrets.randbits(48) or 1


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
        optimizer: the optimizers' class name (the names, comma-separated, where the stages
            used different ones), or ``""`` if no stage saved one.
        extra: the JSON value rank 0 passed to :func:`save` as ``extra``.
        optimizers: for each stage file, its optimizer's class name (``""``: none); empty for
            checkpoints saved before it was recorded.
        ids: for each stage file, the random id of the save that wrote it (also in the file);
            empty for checkpoints saved before ids.
        id: the random id of this save's manifest (0 before ids): ranks that read manifests
            with other ids read different checkpoints.
    """

    step: int
    layers: tuple[str, ...]
    balance: tuple[int, ...]
    schedule: str
    chunks: int
    files: Mapping[str, tuple[str, ...]]
    optimizer: str
    extra: Any = None
    optimizers: Mapping[str, str] = field(default_factory=dict)
    ids: Mapping[str, int] = field(default_factory=dict)
    id: int = 0


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
            optimizers={name: str(kind) for name, kind in data.get("optimizers", {}).items()},
            ids={name: int(ident) for name, ident in data.get("ids", {}).items()},
            id=int(data.get("id", 0)),
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


def owned_names(pipe: AsyncPipe, optimizer: torch.optim.Optimizer) -> dict[int, list[str]]:
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
    names = owned_names(pipe, optimizer)
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
    step, ident, since = -1, new_id(), 0
    kind = "" if optimizer is None else type(optimizer).__name__
    try:
        step = _step_number(given)
        name = f"stage{rank}.step{step}{_suffix(step, directory)}"
        os.makedirs(directory, exist_ok=True)
        content = {
            "format": FORMAT,
            "step": step,
            "id": ident,
            "model": pipe.state_dict(),
            "optimizer": None if optimizer is None else _optimizer_state(pipe, optimizer),
            "optimizer_class": kind,
            "loss_scale": None if pipe.scaler is None else pipe.scaler.state_dict(),
        }
        _write_atomically(os.path.join(directory, name), lambda f: torch.save(content, f))
        since = os.stat(os.path.join(directory, name)).st_mtime_ns  # the file system's clock
    except Exception as e:
        error = f"{type(e).__name__}: {e}"

    def same_step(peer: int, report: Report) -> str | None:
        if report.step == step:
            return None
        return (
            f"rank {peer} saved step {report.step} where rank 0 saved step {step}: pass the "
            f"same step on every rank"
        )

    verdict, reports = exchange(pipe, error, Report(step, ident, kind), same_step)
    if rank == 0:
        if verdict is None:
            try:
                written = _write_manifest(pipe, directory, step, extra, reports)
                _clean(directory, written, since)
            except Exception as e:
                verdict = f"rank 0 could not write the manifest: {type(e).__name__}: {e}"
        answer(pipe, verdict)
    return verdict


def _write_manifest(
    pipe: AsyncPipe, directory: str, step: int, extra: Any, reports: Mapping[int, Report]
) -> set[str]:
    """Rank 0 writes the manifest of the save of ``step`` whose stage files every rank wrote
    and told of in ``reports`` (rank -> its file's id and optimizer class); returns the names
    of the stage files it names."""
    files, ids, optimizers = {}, {}, {}
    suffix = _suffix(step, directory)  # read before the new manifest replaces the old
    for part in pipe.partitions:
        name = f"stage{part.stage}.step{step}{suffix}"
        files[name] = [pipe.layer_names[inv.order] for inv in part.invocations]
        ids[name] = reports[part.stage].id
        optimizers[name] = reports[part.stage].name
    missing = [name for name in files if not os.path.exists(os.path.join(directory, name))]
    if missing:
        raise FileNotFoundError(
            f"the stage files {', '.join(missing)} are not in {directory!r} as rank 0 sees it: "
            f"every rank must pass the same path, in a file system every rank sees"
        )
    kinds = [kind for kind in dict.fromkeys(optimizers.values()) if kind]
    manifest = {
        "format": FORMAT,
        "step": step,
        "id": new_id(),
        "layers": pipe.layer_names,
        "balance": pipe.balance,
        "schedule": pipe.schedule if isinstance(pipe.schedule, str) else "custom",
        "chunks": pipe.chunks,
        "files": files,
        "ids": ids,
        "optimizer": ", ".join(kinds),
        "optimizers": optimizers,
        "extra": extra,
    }
    text = json.dumps(manifest, indent=1).encode()
    _write_atomically(os.path.join(directory, MANIFEST), lambda f: f.write(text))
    return set(files)


def _clean(directory: str, kept: set[str], since: int) -> None:
    """Remove the stage files not in ``kept`` (those the new manifest names: the others are of
    older checkpoints, or of failed saves), and the temporary files of writes that did not
    finish: those not written to since ``since`` (the ``st_mtime_ns`` of rank 0's file of this
    save, on the file system's clock).
    Every rank of this save has renamed its own by now, so an older temporary file is an
    orphan of a rank killed mid-write; a newer one may be another job's write under way, and is
    left alone."""
    for entry in os.listdir(directory):
        where = os.path.join(directory, entry)
        if _FILE.match(entry) and entry not in kept:
            os.remove(where)
        elif _TEMPORARY.match(entry):
            with contextlib.suppress(FileNotFoundError):  # its writer renamed or removed it
                if os.stat(where).st_mtime_ns < since:
                    os.remove(where)
