"""Small models and references shared by the single- and multi-process tests."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn


def mlp(layers: int = 4, width: int = 8, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]
    )


def reference(
    model: nn.Module, x: object, y: object, chunks: int, loss_fn: Callable[..., Tensor]
) -> tuple[float, list[Tensor]]:
    """Mean micro-batch loss and gradients of a copy of ``model`` run in one process."""
    plain = copy.deepcopy(model)
    xs = x if isinstance(x, tuple) else (x,)
    ys = y if isinstance(y, tuple) else (y,)
    pieces_x = list(zip(*[t.chunk(chunks) for t in xs]))
    pieces_y = list(zip(*[t.chunk(chunks) for t in ys]))
    total = 0.0
    for px, py in zip(pieces_x, pieces_y):
        out = plain(px[0] if len(px) == 1 else px)
        loss = loss_fn(out, py[0] if len(py) == 1 else py) / len(pieces_x)
        loss.backward()
        total += float(loss.detach())
    return total, [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in plain.parameters()
    ]


def grads_of(params: Sequence[nn.Parameter]) -> list[Tensor]:
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


def bn_reference(
    model: nn.Module, x: Tensor, y: Tensor, chunks: int, steps: int
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Gradients of per-micro-batch normalisation, and the running statistics a plain BatchNorm
    gets when run once per step on all the inputs its layer saw in that step."""
    per_chunk, whole = copy.deepcopy(model), copy.deepcopy(model)
    norms = {n: m for n, m in per_chunk.named_modules() if isinstance(m, nn.BatchNorm1d)}
    seen: dict[str, list[Tensor]] = {n: [] for n in norms}
    for name, norm in norms.items():
        norm.register_forward_pre_hook(lambda m, a, name=name: seen[name].append(a[0].detach()))
    pieces = list(zip(x.chunk(chunks), y.chunk(chunks)))
    for _ in range(steps):
        per_chunk.zero_grad()
        for px, py in pieces:
            (nn.functional.mse_loss(per_chunk(px), py) / len(pieces)).backward()
        with torch.no_grad():
            for name in norms:
                whole.get_submodule(name)(torch.cat(seen[name]))
                seen[name].clear()
    grads = [p.grad.clone() for p in per_chunk.parameters()]
    stats = {k: v.clone() for k, v in whole.state_dict().items() if "running" in k or "num" in k}
    return grads, stats


class Boxed(nn.Module):
    """A linear layer that returns its output as a tuple of one tensor, as many library blocks
    do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor]:
        return (self.lin(x),)


class Unboxed(nn.Module):
    """A linear layer that takes a tuple of one tensor, as ``nn.Sequential`` hands it the output
    of a :class:`Boxed` (a bare tensor is an error: indexing it would take its first row)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, value: tuple[Tensor]) -> Tensor:
        if not isinstance(value, tuple) or len(value) != 1:
            raise TypeError(f"Unboxed takes a tuple of one tensor (got {type(value).__name__})")
        return torch.tanh(self.lin(value[0]))


class WithAux(nn.Module):
    """A linear layer that also returns a tensor without dimensions (an auxiliary loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.lin(x)
        return h, (h**2).mean()


class UsesAux(nn.Module):
    """A linear layer that adds the auxiliary value of a :class:`WithAux` to its output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, value: tuple[Tensor, Tensor]) -> Tensor:
        h, aux = value
        return self.lin(h) + aux
