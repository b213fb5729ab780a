"""Loading checkpoints: every rank reads and checks the files that hold its layers, the ranks
agree (:mod:`.verdict`), and only then does any rank change its pipeline and optimizer.

::

    load    _check: manifest, stage files (structure, ids, optimizer class), shapes
            exchange: rank 0 compares every rank's step and manifest id ──> verdict
            verdict None: assign the prepared state (model, loss scale, optimizer)

Everything that can refuse the checkpoint runs before the verdict, so a rank either loads all
of its part or nothing, and so does every other.
"""

from __future__ import annotations

import copy
import os
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..pipe import AsyncPipe
from ..shared import layer_parameter_names
from .files import Manifest, owned_names, read_manifest
from .verdict import Report, answer, exchange

__all__: list[str] = []

_REFUSED = re.compile(r"GLOBAL ([\w.]+)")


@dataclass(frozen=True)
class _Found:
    """What :func:`_check` found, ready to assign: the manifest, the model state of the local
    layers, the loss scale (or None), the optimizer state dict to load (or None)."""

    manifest: Manifest
    model: dict[str, Tensor]
    loss_scale: dict[str, Any] | None
    optimizer: dict[str, Any] | None


def load(
    pipe: AsyncPipe,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike[str],
) -> Manifest:
    """Load the checkpoint in ``path`` into this rank's pipeline (and optimizer).

    The checkpoint may come from a pipeline with another balance or number of stages: each rank
    reads the files that hold its layers. Call it on every rank after building ``pipe`` and the
    optimizer (over ``pipe.parameters()``), before the first step (under ``schedule="2bw"``,
    after ``pipe.flush()``; after ``pipe(input)``, once its backward ran). The ranks check
    everything before any of them changes anything: if one rank refuses the checkpoint, no rank
    loads it. A stage saved without an optimizer loads into a fresh one (no state).

    Returns:
        the checkpoint's manifest: ``manifest.step`` is the step to go on from.

    Raises:
        FileNotFoundError: if ``path`` holds no complete checkpoint.
        ValueError: if it is of another model (other layers, or other shapes or parameters
            in the same layers), or a stage file holds the state of another optimizer class,
            or a file of it cannot be read, is incomplete or of another save (the error names
            the file), or ``optimizer`` holds parameters of other stages.
        RuntimeError: on the other ranks, when one of them raised one of these (rank 0
            names it and its error), or the ranks read different checkpoints (other steps, or
            other saves of one step); nothing was loaded on any rank. Also, on every rank, if
            a 2BW pipeline is not flushed or a ``pipe(input)`` still waits for its backward.

    Example:
        >>> start = asyncpipe.checkpoint.load(pipe, optimizer, "ckpt").step  # doctest: +SKIP
    """
    pipe._guard()
    if pipe.in_flight:  # the same on every rank: all raise
        raise RuntimeError(
            "schedule '2bw' keeps a mini-batch in flight between steps, which would go on with "
            "the loaded weights; call pipe.flush() on every rank before loading"
        )
    if pipe._pending is not None:  # pipe(input) runs on every rank: all raise
        raise RuntimeError(
            "a forward of pipe(input) still waits for its backward, whose gradients would mix "
            "the weights it ran with and the loaded ones; finish it (backward() on the last "
            "stage's output, back_helper(output) on the others) on every rank before loading"
        )
    directory = os.fspath(path)
    failure: Exception | None = None
    found = None
    try:
        found = _check(pipe, optimizer, directory)
    except Exception as e:
        failure = e
    error = None if failure is None else f"{type(failure).__name__}: {failure}"
    mine = Report(-1) if found is None else Report(found.manifest.step, found.manifest.id)

    def same_checkpoint(peer: int, theirs: Report) -> str | None:
        if theirs.step != mine.step:
            return (
                f"rank {peer} loaded step {theirs.step} where rank 0 loaded step {mine.step}: "
                f"pass the same path on every rank"
            )
        if theirs.id != mine.id:
            return (
                f"rank {peer} read another checkpoint of step {mine.step} than rank 0 (manifest "
                f"id {theirs.id:x}, rank 0's {mine.id:x}: another directory, or a save in "
                f"between): pass the same path on every rank"
            )
        return None

    verdict, _ = exchange(pipe, error, mine, same_checkpoint)
    if pipe.transport.rank == 0:
        answer(pipe, verdict)
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
    pipe.load_state_dict(found.model)
    if pipe.scaler is not None and found.loss_scale:  # float16: go on with the scale reached
        pipe.scaler.load_state_dict(found.loss_scale)
    if optimizer is not None and found.optimizer is not None:
        optimizer.load_state_dict(found.optimizer)
    return found.manifest


def _check(pipe: AsyncPipe, optimizer: torch.optim.Optimizer | None, directory: str) -> _Found:
    """This rank's part of :func:`load` before it changes anything: every file it needs read
    and checked, the state to assign prepared; or the error that refuses the checkpoint."""
    manifest = read_manifest(directory)
    if list(manifest.layers) != pipe.layer_names:
        raise ValueError(
            f"the checkpoint is of a model with {len(manifest.layers)} layers named "
            f"{list(manifest.layers)[:8]}..., this pipeline has {len(pipe.layer_names)} named "
            f"{pipe.layer_names[:8]}...; load it into the model it was saved from"
        )
    owned = None if optimizer is None else owned_names(pipe, optimizer)  # before any change
    mine = {name for names in pipe.local_names for name in names}
    contents = _read(directory, mine, manifest)
    if optimizer is not None:
        kind = type(optimizer).__name__
        other = [
            f"{file} (stage {file.split('.')[0][5:]}'s) holds the state of optimizer "
            f"{theirs!r}, not of {kind!r}"
            for file, content in contents.items()
            if (theirs := _optimizer_class(content, manifest)) and theirs != kind
        ]
        if other:
            raise ValueError(
                f"a stage's optimizer state loads only into an optimizer of its class: "
                f"{'; '.join(other)}; build the same optimizer on this stage, or pass None"
            )
    model: dict[str, Tensor] = {}
    for content in contents.values():
        model.update(content["model"])
    _check_model(pipe, directory, model, mine)
    scales = [c["loss_scale"] for c in contents.values() if c.get("loss_scale")]
    state = None
    if optimizer is not None and owned is not None:
        saved = [c["optimizer"] for c in contents.values() if c["optimizer"]]
        state = _optimizer_update(pipe, optimizer, saved, owned)
    return _Found(manifest, model, scales[0] if scales else None, state)


def _optimizer_class(content: Mapping[str, Any], manifest: Manifest) -> str:
    """The class name of the optimizer whose state a stage file holds; ``""`` for none, or
    for a file saved before it was recorded whose class is unknown (rank 0's was recorded)."""
    if "optimizer_class" in content:
        return str(content["optimizer_class"])
    return "" if content["optimizer"] is None else manifest.optimizer


def _check_model(pipe: AsyncPipe, directory: str, model: dict[str, Tensor], mine: set[str]) -> None:
    """A ValueError unless ``model`` holds the state of the local layers, in their shapes."""
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


def _read(
    directory: str, names: set[str], manifest: Manifest, model_only: bool = False
) -> dict[str, dict[str, Any]]:
    """The contents of the stage files that hold any of the layers ``names``, by file name,
    each checked to be complete (only its model state with ``model_only``) and of the save
    the manifest describes."""
    out = {}
    for file, layers in manifest.files.items():
        if names & set(layers):
            content = _load_file(directory, file)
            _validate(directory, file, content, manifest, model_only)
            out[file] = content
    return out


def _load_file(directory: str, file: str) -> Any:
    """``torch.load`` of one stage file, its errors as a ValueError naming the file."""
    try:
        return torch.load(os.path.join(directory, file), map_location="cpu")
    except FileNotFoundError as e:
        raise ValueError(
            f"{file} in {directory!r} is missing (the manifest names it): restore it, "
            f"or load another checkpoint"
        ) from e
    except pickle.UnpicklingError as e:
        refused = _REFUSED.search(str(e))
        if refused is None:
            raise _damaged(directory, file, e) from e
        kind = refused.group(1)
        raise ValueError(
            f"{file} in {directory!r} holds an object of type {kind} (a layer's "
            f"get_extra_state() or an optimizer's state, say), and torch.load with "
            f"weights_only=True loads only tensors and allowed types; if you trust the "
            f"checkpoint, allow the type in every process before loading: "
            f"torch.serialization.add_safe_globals([{kind}])"
        ) from e
    except Exception as e:
        raise _damaged(directory, file, e) from e


def _damaged(directory: str, file: str, e: Exception) -> ValueError:
    first = str(e).splitlines()[0] if str(e) else ""
    return ValueError(
        f"{file} in {directory!r} cannot be read ({type(e).__name__}: {first}); the file is "
        f"damaged: restore it, or load another checkpoint"
    )


def _validate(
    directory: str, file: str, content: Any, manifest: Manifest, model_only: bool
) -> None:
    """A ValueError naming every problem unless ``content`` (of ``file``) has what loading
    reads, with the step and id the manifest gives it."""
    where = f"{file} in {directory!r}"
    if not isinstance(content, dict):
        raise ValueError(
            f"{where} holds a {type(content).__name__}, not a stage file's dict; it was "
            f"replaced by hand or by another program: restore it, or load another checkpoint"
        )
    if content.get("step") != manifest.step:
        raise ValueError(
            f"{where} holds step {content.get('step')} but the manifest says step "
            f"{manifest.step}; the checkpoint was changed by hand"
        )
    expected = manifest.ids.get(file)
    if expected is not None and content.get("id") != expected:
        found = content.get("id")
        raise ValueError(
            f"{where} is of another save than its manifest (file id "
            f"{'none' if found is None else format(found, 'x')}, the manifest's {expected:x}): "
            f"a file of another checkpoint was copied in; restore this checkpoint's file, or "
            f"load another checkpoint"
        )
    problems = []
    needs = ("model",) if model_only else ("model", "optimizer")
    problems += [f"no {key!r} entry" for key in needs if key not in content]
    if not isinstance(content.get("model", {}), dict):
        problems.append(f"a 'model' entry of type {type(content['model']).__name__}")
    if not model_only:
        saved = content.get("optimizer")
        groups = saved.get("param_groups") if isinstance(saved, dict) else None
        if saved is not None and not (
            isinstance(saved.get("state") if isinstance(saved, dict) else None, dict)
            and isinstance(groups, list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        ):
            problems.append("an 'optimizer' entry without 'state' and 'param_groups' as saved")
        scale = content.get("loss_scale")
        if scale is not None and not isinstance(scale, dict):
            problems.append(f"a 'loss_scale' entry of type {type(scale).__name__}")
    if problems:
        raise ValueError(
            f"a stage file must hold what save wrote, but {where} has {', '.join(problems)}; "
            f"it was changed by hand or written by another program: restore it, or load "
            f"another checkpoint"
        )


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


def _optimizer_update(
    pipe: AsyncPipe,
    optimizer: torch.optim.Optimizer,
    saved: list[dict[str, Any]],
    names: dict[int, list[str]],
) -> dict[str, Any]:
    """The state dict that gives each parameter its saved state, and each group the
    hyperparameters of the saved group its first parameter was in (e.g. a learning rate a
    scheduler changed). A parameter's state is looked up under each of its names (``names``,
    from :func:`owned_names`), then under those of the other copies of its
    ``shared_weights`` group. Nothing is saved (a stage without optimizer): no state."""
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
    return {"state": new_state, "param_groups": groups}


def consolidate(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The state dict of the plain model, put together from every stage file of a checkpoint.

    Example:
        >>> model.load_state_dict(asyncpipe.checkpoint.consolidate("ckpt"))  # doctest: +SKIP
    """
    directory = os.fspath(path)
    manifest = read_manifest(directory)
    merged: dict[str, Tensor] = {}
    for content in _read(directory, set(manifest.layers), manifest, model_only=True).values():
        merged.update(content["model"])
    position = {name: n for n, name in enumerate(manifest.layers)}
    keys = sorted(merged, key=lambda k: position[k.split(".", 1)[0]])  # stable: keeps order
    return {key: merged[key] for key in keys}
