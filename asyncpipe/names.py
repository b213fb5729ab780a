"""Layer names: a stage's state dict keyed as the plain model's (``"3.weight"`` for position 3
of an ``nn.Sequential``), so stages save, load and merge by the model's own names::

    AsyncPipe.layers[0] = model[2]     state dict key  layers.0.weight  <->  2.weight
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__: list[str] = []


def layer_names(module: object, count: int) -> list[str]:
    """The name of every position: an ``nn.Sequential``'s keys, else ``"0"``, ``"1"``..."""
    if isinstance(module, nn.Sequential):
        return list(module._modules)
    return [str(n) for n in range(count)]


def rename_saved(pipe: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    """State dict hook: ``layers.<k>.<rest>`` becomes ``<name>.<rest>`` for every position
    name of local layer ``k``, the keys the plain model's state dict has."""
    names_of: list[str] = pipe.layer_names  # type: ignore[assignment]
    local: list[list[str]] = pipe.local_names  # type: ignore[assignment]
    own = prefix + "layers."
    taken: dict[int, list[tuple[str, Any]]] = {}
    for key in [k for k in state if k.startswith(own)]:
        number, rest = key[len(own) :].split(".", 1)
        taken.setdefault(int(number), []).append((rest, state.pop(key)))
    order = sorted((names_of.index(n), n, k) for k, ns in enumerate(local) for n in ns)
    for _, name, index in order:  # in model order, as the plain model's state dict
        for rest, value in taken.get(index, []):
            state[f"{prefix}{name}.{rest}"] = value
    metadata_keys = [k for k in getattr(state, "_metadata", {}) if k.startswith(own)]
    for key in metadata_keys:
        state._metadata.pop(key)  # type: ignore[attr-defined]


def rename_loaded(
    pipe: nn.Module,
    state: dict[str, Any],
    prefix: str,
    metadata: Any,
    strict: bool,
    missing: list[str],
    unexpected: list[str],
    errors: list[str],
) -> None:
    """Load hook, the inverse of :func:`rename_saved`: keys of local layers (by any of their
    position names) go to ``layers.<k>``; keys of layers on other stages are ignored, so the
    plain model's whole state dict loads onto every stage."""
    names_of: list[str] = pipe.layer_names  # type: ignore[assignment]
    local: list[list[str]] = pipe.local_names  # type: ignore[assignment]
    where = {name: k for k, names in enumerate(local) for name in names}
    first = {names[0] for names in local if names}
    others = set(names_of) - set(where)
    for key in [k for k in state if k.startswith(prefix)]:
        name, _, rest = key[len(prefix) :].partition(".")
        if name in others or (name in where and name not in first):
            del state[key]
        elif name in where and rest:
            state[f"{prefix}layers.{where[name]}.{rest}"] = state.pop(key)


def rename_missing(pipe: nn.Module, keys: Any) -> None:
    """Load post hook: report missing local keys by the plain model's names, not as
    ``layers.<k>.<rest>``."""
    local: list[list[str]] = pipe.local_names  # type: ignore[assignment]
    for n, key in enumerate(keys.missing_keys):
        head, _, rest = key.partition("layers.")
        number, _, tail = rest.partition(".")
        if number.isdigit() and int(number) < len(local) and local[int(number)]:
            keys.missing_keys[n] = f"{head}{local[int(number)][0]}.{tail}"
