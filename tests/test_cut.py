"""CutPoint and sequentialize: segments equal the model, values cross cuts, clear errors."""

from __future__ import annotations

import copy

import pytest
import torch
from cut_models import MaskResidual, TiedLM
from cut_workers import cut_transparency
from spawn import run_ranks
from torch import Tensor, nn

from asyncpipe import CutPoint, sequentialize
from asyncpipe.cut import CutSegment


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
    # the mask crosses every cut, the residual cuts 0 to 2, the tuple cut 1
    assert all("mask" in s.inputs for s in seq[1:4])
    assert [("inp" in s.inputs) for s in seq] == [False, True, True, True, False]
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
