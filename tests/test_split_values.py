"""The split backward (zero_bubble) matches the plain model whatever the layers hand on and
whatever leaves their graphs (and the loss's) reach; in-process transport."""

from __future__ import annotations

import warnings
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from threads import run_threads, values
from torch import Tensor, nn

from asyncpipe import AsyncPipe
from asyncpipe.skip import pop, skippable, stash
from asyncpipe.transport import Transport

mse = nn.functional.mse_loss
Make = Callable[[], tuple[nn.Module, Any]]
"""Builds the model and the loss function (seeded: two calls give equal ones)."""


def _step(
    model: nn.Module, balance: list[int], policy: str, loss_fn: Any, x: Tensor, y: Tensor
) -> list[float]:
    """One zero_bubble step of 4 micro-batches on in-process ranks; each rank's loss."""

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(
            model,
            balance,
            chunks=4,
            checkpoint=policy,
            schedule="zero_bubble",
            transport=transport,
            timeout=10,
        )
        return pipe.step(x, y, loss_fn)

    return values(run_threads(fn, len(balance)))


def _leaves(model: nn.Module, loss_fn: Any) -> list[Tensor]:
    """What must get the plain model's gradient: the parameters of the model and of the loss,
    and every plain tensor attribute of a layer that requires grad."""
    found = [*model.parameters()]
    if isinstance(loss_fn, nn.Module):
        found += loss_fn.parameters()
    for module in model.modules():
        found += [
            t
            for t in vars(module).values()
            if isinstance(t, Tensor)
            and not isinstance(t, nn.Parameter)
            and t.is_leaf
            and t.requires_grad
        ]
    return found


def _matches_plain(make: Make, balance: list[int], policy: str = "never") -> None:
    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    plain, plain_loss = make()
    want = 0.0
    for px, py in zip(x.chunk(4), y.chunk(4)):
        loss = plain_loss(plain(px), py) / 4
        loss.backward()
        want += float(loss.detach())
    model, loss_fn = make()
    losses = _step(model, balance, policy, loss_fn, x, y)
    assert losses == pytest.approx([want] * len(balance), rel=1e-6)
    got, wanted = _leaves(model, loss_fn), _leaves(plain, plain_loss)
    assert len(got) == len(wanted)
    for n, (a, b) in enumerate(zip(got, wanted)):
        assert b.grad is not None, f"the plain model gave leaf {n} no gradient"
        assert a.grad is not None, f"leaf {n} {tuple(a.shape)} got no gradient"
        torch.testing.assert_close(a.grad, b.grad, msg=lambda m, n=n: f"leaf {n}: {m}")


Pair = namedtuple("Pair", "h g")


@dataclass
class Box:
    """An object pytree does not know: it could hide a tensor, so the layers stay one run."""

    h: Tensor
    g: Tensor


class Bag(dict):  # type: ignore[type-arg]
    """A dict subclass pytree does not know (as a ``transformers`` ``ModelOutput`` without
    its pytree registration)."""


def _pack(kind: str, h: Tensor) -> Any:
    g = torch.tanh(h)
    if kind == "dict":
        return {"h": h, "g": g, "note": "a constant"}
    if kind == "namedtuple":
        return Pair(h, g)
    if kind == "nested":
        return ((h, 2 * h), [g, None, 3], h)  # h twice: both parts of its gradient count
    if kind == "object":
        return Box(h, g)
    return Bag(h=h, g=g)


def _unpack(kind: str, value: Any) -> Tensor:
    if kind in ("dict", "bag"):
        return value["h"] * value["g"]
    if kind in ("namedtuple", "object"):
        return value.h * value.g
    (a, b), (g, _, three), c = value
    return (a + b) * g + c * three


class Pack(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.linear = kind, nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Any:
        return _pack(self.kind, self.linear(x))


class Unpack(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.linear = kind, nn.Linear(8, 8)

    def forward(self, value: Any) -> Tensor:
        return self.linear(_unpack(self.kind, value))


@pytest.mark.parametrize("policy", ["never", "always"])
@pytest.mark.parametrize("kind", ["dict", "namedtuple", "nested", "object", "bag"])
def test_any_value_between_the_layers_of_a_stage_matches(kind: str, policy: str) -> None:
    # only a tensor or a flat tuple was cut: a dict (or an object) lost the first stage's
    # gradients, a nested tuple failed W ("Trying to backward through the graph a second
    # time"), a namedtuple failed the forward (Pair.__new__() missing an argument)
    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), Pack(kind), Unpack(kind), nn.Linear(8, 8)), mse

    _matches_plain(make, [1, 3], policy)


@skippable(stash=["s"])
class StashBox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Any:
        h = self.linear(x)
        yield stash("s", torch.tanh(h))
        return Box(h, 2 * h)


@skippable(pop=["s"])
class PopBox(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, box: Box) -> Any:
        s = yield pop("s")
        return self.linear(box.h * box.g + s)


def test_a_skip_inside_layers_that_stay_one_run_matches() -> None:
    # the stash and the pop of one run stay in its graph (they were cut apart, and the
    # object between the layers lost its gradients)
    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), StashBox(), PopBox(), nn.Linear(8, 8)), mse

    _matches_plain(make, [1, 3])


class TemperedLoss(nn.Module):
    """MSE of the output scaled by a learnable temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Parameter(torch.tensor(1.5))

    def forward(self, out: Tensor, target: Tensor) -> Tensor:
        return mse(out * self.t, target)


@pytest.mark.parametrize("policy", ["never", "always"])
def test_a_loss_with_a_parameter_gets_its_gradient(policy: str) -> None:
    # B took only the loss's gradient with respect to the outputs: loss_fn.t got none
    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]), TemperedLoss()

    _matches_plain(make, [2, 2], policy)


class KeepsAux(nn.Module):
    """A linear layer that keeps an auxiliary loss of its input for the loss to read."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.aux: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x)
        self.aux = (h * x).pow(2).mean()
        return h


def test_a_loss_that_reads_a_tensor_a_layer_kept_matches() -> None:
    # B took only the loss's gradient with respect to the outputs: the auxiliary term's
    # gradient reached neither the last layers' weights nor the earlier stage
    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), KeepsAux(), nn.Linear(8, 8))

        def loss_fn(out: Tensor, target: Tensor) -> Tensor:
            aux = model[2].aux
            assert aux is not None
            return mse(out, target) + 0.1 * aux

        return model, loss_fn

    _matches_plain(make, [2, 2])


class Scaled(nn.Module):
    """Linear, then a scale kept as a plain tensor that requires grad (no ``nn.Parameter``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.scale = torch.linspace(0.5, 1.5, 8).requires_grad_(True)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * self.scale


def test_a_plain_tensor_a_layer_reads_gets_its_gradient() -> None:
    # W asked autograd only for the nn.Parameters its graph reached: scale got none
    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), Scaled(), nn.Linear(8, 8), nn.Linear(8, 8)), mse

    _matches_plain(make, [2, 2])


class Reentrant(nn.Module):
    """A linear layer (or a linear layer after another) checkpointed with
    ``use_reentrant=True``."""

    def __init__(self, before: bool = False) -> None:
        super().__init__()
        self.before = nn.Linear(8, 8) if before else None
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        if self.before is not None:
            x = self.before(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = torch.utils.checkpoint.checkpoint(
                lambda t: torch.tanh(self.linear(t)), x, use_reentrant=True
            )
        assert isinstance(out, Tensor)
        return out


@pytest.mark.parametrize("policy", ["never", "always"])
def test_a_reentrant_checkpoint_in_a_layer_matches(policy: str) -> None:
    # B asked autograd for the input gradients only, which a reentrant checkpoint refuses
    # ("incompatible with .grad() or passing an `inputs` parameter"); the first layer, whose
    # input wants no gradient, has no B to fail in and failed in W
    def make() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        layers = [Reentrant(before=True), nn.Linear(8, 8), Reentrant(), nn.Linear(8, 8)]
        return nn.Sequential(*layers), mse

    _matches_plain(make, [2, 2], policy)


class Keeps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.kept: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        self.kept = self.linear(x)
        return torch.tanh(self.kept)


class ReadsKept(nn.Module):
    def __init__(self, other: Keeps) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.read = lambda: other.kept

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) + self.read()


def test_a_layer_that_reads_an_earlier_layers_tensor_past_the_cut_is_refused() -> None:
    # B lost the gradient through the kept tensor to the earlier layer's input, and W then
    # failed with torch's "Trying to backward through the graph a second time"
    torch.manual_seed(0)
    keeps = Keeps()
    model = nn.Sequential(nn.Linear(8, 8), keeps, ReadsKept(keeps), nn.Linear(8, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(model, [1, 3], 4, schedule="zero_bubble", transport=transport, timeout=10)
        return pipe.step(x, y, mse)

    (_, first), (status, error) = run_threads(fn, 2)
    assert status == "error", error
    message = str(error)
    assert "zero_bubble" in message and "ReadsKept" in message, message
    assert "another schedule" in message, message


class _Probe(torch.autograd.Function):
    """Identity whose backward records what the loss's graph still holds at that moment."""

    seen: list[int] = []  # noqa: RUF012
    alive: dict[int, int] = {}  # noqa: RUF012

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        _Probe.seen.append(sum(_Probe.alive.values()))
        return g


def test_the_losss_saved_tensors_are_freed_before_the_last_stages_b_goes_on() -> None:
    # before: the plain backward of the loss kept its graph (retain_graph=True) while the loss
    # stayed in scope, so a 50000-class head's log-softmax lived through the whole stage's B
    import weakref

    class Held:
        def __init__(self, t: Tensor) -> None:
            self.t = t

    def pack(t: Tensor) -> Held:
        held = Held(t.detach().clone())
        _Probe.alive[id(held)] = t.nbytes
        weakref.finalize(held, _Probe.alive.pop, id(held), None)
        return held

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.t):
            return nn.functional.cross_entropy(out, y)

    class Check(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return _Probe.apply(x)  # type: ignore[no-any-return]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Check(), nn.Linear(16, 16), nn.Linear(16, 20000))
    x, y = torch.randn(8, 16), torch.randint(0, 20000, (8,))
    _Probe.seen.clear()

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(
            model,
            [1, 3],
            chunks=2,
            checkpoint="never",
            schedule="zero_bubble",
            transport=transport,
            timeout=30,
        )
        return pipe.step(x, y, loss_fn)

    values(run_threads(fn, 2))
    assert len(_Probe.seen) == 2 and _Probe.seen == [0, 0], _Probe.seen
