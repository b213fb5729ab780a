"""CutPoint and sequentialize: segments equal the model, values cross cuts, clear errors."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from cut_models import MaskResidual, TiedLM
from cut_workers import cut_transparency
from models import reference
from spawn import run_ranks
from threads import run_threads, values
from torch import Tensor, nn

from asyncpipe import AsyncPipe, CutPoint, sequentialize
from asyncpipe.cut import CutSegment
from asyncpipe.transport import Transport


def test_cut_point_is_the_identity() -> None:
    x = torch.randn(2, 3)
    assert CutPoint()(x) is x
    pair = (x, x + 1)
    assert CutPoint()(pair) is pair


def test_segments_equal_the_model_with_gradients() -> None:
    torch.manual_seed(0)
    model = MaskResidual()
    x, mask = torch.randn(5, 8), torch.rand(5, 8) > 0.5
    seq = sequentialize(model, (x, mask))
    assert len(seq) == 5 and all(isinstance(s, CutSegment) for s in seq)
    # the mask crosses every cut, the residual (cut0's value) cuts 0 to 2, the tuple cut 1
    assert all("mask" in s.inputs for s in seq[1:4])
    assert [("cut0" in s.inputs) for s in seq] == [False, True, True, True, False]
    assert not any("inp" in s.inputs for s in seq)  # residual is h: it crosses once, as cut0
    assert seq[2].in_spec.count(2) == 1  # the tuple travels flattened
    plain = copy.deepcopy(model)
    seq((x, mask)).square().sum().backward()
    plain(x, mask).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_segments_hold_the_models_own_parameters() -> None:
    model = TiedLM()
    seq = sequentialize(model, torch.randint(0, 11, (2, 4)))
    first = dict(seq[0].named_model_parameters())
    last = dict(seq[-1].named_model_parameters())
    assert first["tok.weight"] is model.tok.weight is last["head.weight"]
    ids = torch.randint(0, 11, (3, 4))
    assert torch.equal(seq(ids), model(ids))


def test_model_and_its_rng_are_unchanged() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), CutPoint(), nn.BatchNorm1d(4))
    state = copy.deepcopy(model.state_dict())
    x = torch.randn(6, 4)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    seq = sequentialize(model, x)
    assert torch.equal(torch.rand(3), expected)
    assert len(seq) == 2 and model.training
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cut, self.lin = CutPoint(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.cut(self.lin(self.cut(x)))


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cut, self.spare, self.lin = CutPoint(), CutPoint(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(self.cut(x))


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cut, self.lin = CutPoint(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:  # data-dependent control flow
            x = -x
        return self.lin(self.cut(x))


class Shape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cut, self.lin = CutPoint(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.shape[0]
        h = self.cut(self.lin(x))
        return h.reshape(rows, -1)


class Flip(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return -x if x.sum() > 0 else x


class LeafBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flip, self.cut, self.lin = Flip(), CutPoint(), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(self.cut(self.flip(x)))


def test_a_cut_point_used_twice_is_named() -> None:
    with pytest.raises(
        ValueError, match=r"cut point 'cut' runs 2 times.*test_cut.py.*one CutPoint"
    ):
        sequentialize(Twice(), torch.randn(2, 4))


def test_a_cut_point_that_never_ran_is_named() -> None:
    with pytest.raises(ValueError, match=r"cut points \['spare'\] never ran"):
        sequentialize(Unused(), torch.randn(2, 4))


def test_untraceable_control_flow_names_the_users_line() -> None:
    with pytest.raises(TypeError, match=r"cannot follow.*test_cut.py:\d+: if x.sum\(\) > 0"):
        sequentialize(Branch(), torch.randn(2, 4))


def test_leaves_keep_a_branching_module_opaque() -> None:
    model = LeafBranch()
    seq = sequentialize(model, torch.randn(2, 4), leaves=(Flip,))
    x = torch.randn(3, 4)
    assert torch.equal(seq(x), model(x)) and torch.equal(seq(-x), model(-x))


def test_a_non_tensor_crossing_a_cut_is_named() -> None:
    with pytest.raises(TypeError, match=r"'getitem' \(int\) crosses cut 0, made at .*rows = x"):
        sequentialize(Shape(), torch.randn(2, 4))


def test_too_few_example_inputs() -> None:
    with pytest.raises(TypeError, match=r"one tensor per positional argument.*\['x', 'mask'\]"):
        sequentialize(MaskResidual(), torch.randn(2, 8))


def test_a_model_without_cut_points_is_one_segment() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    seq = sequentialize(model, torch.randn(2, 4))
    x = torch.randn(3, 4)
    assert len(seq) == 1 and torch.equal(seq(x), model(x))


@pytest.mark.parametrize(
    ("world", "schedule"), [(2, "1f1b"), pytest.param(4, "gpipe", marks=pytest.mark.slow)]
)
def test_cut_models_equal_the_plain_model_over_gloo(world: int, schedule: str) -> None:
    results = run_ranks(cut_transparency, world, schedule, timeout=120)
    for rank, result in enumerate(results):
        for key in ("many", "mask"):
            loss_error, grad_error = result[key]
            assert loss_error < 1e-5 and grad_error < 1e-5, (rank, key, result[key])
    assert results[-1]["output"] < 1e-5


def _two_stages(seq: nn.Sequential, x: Tensor, y: Tensor, loss_fn: Callable[..., Tensor]) -> float:
    """The loss of one step of ``seq`` on two in-process stages, two micro-batches."""

    def run(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(seq, [1, 1], chunks=2, transport=transport, timeout=20)
        return pipe.step(x, y, loss_fn)

    return float(values(run_threads(run, 2))[-1])


class TrainingFlag(nn.Module):
    """Reads ``self.training`` in forward: functional dropout and a training-only branch."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.noise = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.cut = CutPoint()

    def forward(self, x: Tensor) -> Tensor:
        h = F.dropout(self.a(x), 0.5, self.training)
        if self.training:
            h = h + self.noise(h)
        return self.b(self.cut(h))


class CutOrderByMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.c0, self.c1 = nn.Linear(4, 4), CutPoint(), CutPoint()

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            return self.c1(self.lin(self.c0(x)))
        return self.c0(self.lin(self.c1(x)))


@pytest.mark.parametrize("traced_in_training", [True, False])
def test_code_reading_self_training_follows_the_segments_mode(traced_in_training: bool) -> None:
    torch.manual_seed(0)
    model, x = TrainingFlag().train(traced_in_training), torch.randn(3, 4)
    seq = sequentialize(model, x)
    assert seq.training == model.training == traced_in_training
    for training in (not traced_in_training, traced_in_training):
        model.train(training)
        seq.train(training)
        torch.manual_seed(1)
        want = model(x)
        torch.manual_seed(1)
        assert torch.equal(seq(x), want), training
    copied = copy.deepcopy(seq.eval())  # each mode's attributes travel with either graph
    model.train()
    torch.manual_seed(2)
    want = model(x)
    torch.manual_seed(2)
    assert torch.equal(copied.train()(x), want)
    # one module per segment: the state dict holds each value once
    assert all(key.split(".")[1] == "module" for key in seq.state_dict())
    assert "0.module.noise.weight" in seq.state_dict()
    with pytest.raises(ValueError, match=r"different order in training mode.*eval mode"):
        sequentialize(CutOrderByMode(), x)


class AliasInPlace(nn.Module):
    """``residual`` is the cut point's argument, changed in place after the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.cut = nn.Linear(4, 4), nn.Linear(4, 4), CutPoint()

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        residual = h
        h = self.cut(h)
        h.mul_(2)  # residual is h: it changes too
        return self.b(h + residual)


def test_an_alias_of_a_cut_points_argument_is_its_value_on_the_next_stage() -> None:
    torch.manual_seed(0)
    model, x, y = AliasInPlace(), torch.randn(8, 4), torch.randn(8, 4)
    seq = sequentialize(model, x[:2])
    mse = nn.functional.mse_loss
    want_loss, want = reference(model, x, y, 2, mse)
    assert abs(_two_stages(seq, x, y, mse) - want_loss) < 1e-5
    for p, g in zip(model.parameters(), want):
        assert p.grad is not None and torch.allclose(p.grad, g, atol=1e-6)
    assert seq[0].outputs == ("cut",)  # sent once, as the cut's value


class NoGrad(nn.Module):
    """A frozen target computed under ``torch.no_grad()`` in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.cut = nn.Linear(4, 4), nn.Linear(4, 4), CutPoint()

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            target = torch.tanh(self.a(x)).sum(-1, keepdim=True)
        return self.b(self.cut(x * target))


def test_no_grad_in_forward_is_kept() -> None:
    torch.manual_seed(0)
    model, x = NoGrad(), torch.randn(3, 4)
    plain = copy.deepcopy(model)
    seq = sequentialize(model, x)
    seq(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert model.a.weight.grad is None and plain.a.weight.grad is None
    assert model.b.weight.grad is not None and plain.b.weight.grad is not None
    assert torch.allclose(model.b.weight.grad, plain.b.weight.grad)


class TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.cut = nn.Linear(4, 4), nn.Linear(4, 4), CutPoint()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.cut(self.a(x))
        return self.b(h), h


class DictOut(TupleOut):
    def forward(self, x: Tensor) -> dict[str, Tensor]:  # type: ignore[override]
        return {"y": self.b(self.cut(self.a(x)))}


def test_a_tuple_output_leaves_the_pipeline_and_a_dict_is_named() -> None:
    torch.manual_seed(0)
    model, x, y = TupleOut(), torch.randn(8, 4), torch.randn(8, 4)
    seq = sequentialize(model, x[:2])
    assert all(torch.equal(a, b) for a, b in zip(seq(x), model(x)))

    def loss_fn(out: tuple[Tensor, Tensor], target: Tensor) -> Tensor:
        return ((out[0] - target) ** 2).mean() + out[1].square().mean()

    want_loss, want = reference(model, x, y, 2, loss_fn)
    assert abs(_two_stages(seq, x, y, loss_fn) - want_loss) < 1e-5
    for p, g in zip(model.parameters(), want):
        assert p.grad is not None and torch.allclose(p.grad, g, atol=1e-6)
    with pytest.raises(TypeError, match=r"must be a tensor or a tuple of tensors.*got dict"):
        sequentialize(DictOut(), x)


class OptionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.cut = nn.Linear(4, 4), CutPoint()

    def forward(self, x: Tensor, mask: Tensor | None = None, scale: float = 2.0) -> Tensor:
        h = self.cut(self.a(x)) * scale
        return h if mask is None else h * mask


def test_trailing_optional_arguments_may_be_left_out_or_none() -> None:
    model, x, mask = OptionalMask(), torch.randn(2, 4), torch.randn(2, 4)
    for example, inputs in [((x,), ["x"]), ((x, None), ["x"]), ((x, mask), ["x", "mask"])]:
        seq = sequentialize(model, example)
        assert list(seq[0].inputs) == inputs
        got = seq(x) if len(inputs) == 1 else seq((x, mask))
        assert torch.equal(got, model(*example))
    with pytest.raises(TypeError, match=r"None before a tensor; only trailing arguments"):
        sequentialize(model, (x, None, torch.tensor(1.0)))


class Constant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.cut = nn.Linear(4, 4), CutPoint()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        return self.cut(self.a(x)) * torch.tensor([1.0, 2.0, 3.0, 4.0])


class CountsSteps(Constant):
    def forward(self, x: Tensor) -> Tensor:
        self.steps.add_(1)  # fx runs this while tracing and does not record it
        return self.cut(self.a(x))


def test_tracing_leaves_the_model_as_it_was() -> None:
    model, x = Constant(), torch.randn(2, 4)
    before = dict(vars(model))
    seq = sequentialize(model, x)
    assert vars(model).keys() == before.keys()
    assert torch.equal(seq(x), model(x))
    counting = CountsSteps()
    with pytest.raises(TypeError, match=r"changes buffers \['steps'\] in place"):
        sequentialize(counting, x)
    assert int(counting.steps) == 0
