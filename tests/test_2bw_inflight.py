"""What the caller may change while a mini-batch is in flight: between two 2BW steps (or before
``flush()``), and between ``pipe(input)`` and its backward."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from asyncpipe import AsyncPipe, CutPoint, StageFailure, sequentialize
from asyncpipe.transport import Transport
from tests.test_2bw import adam, assert_same, batches, delayed_reference, model, mse
from tests.threads import run_threads, values

Hook = Callable[[int, nn.Module], object]


def batch_norm_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for n in range(4):
        layers += [nn.Linear(8, 8), nn.Tanh() if n % 2 else nn.BatchNorm1d(8)]
    return nn.Sequential(*layers)


def run_hooked(
    plain: nn.Module,
    balance: list[int],
    policy: str,
    steps: int,
    hook: Hook,
    max_norm: float | None = None,
) -> tuple[list[list[float]], list[AsyncPipe]]:
    """``steps`` 2BW steps and a flush, chunks 4, calling ``hook(t, pipe)`` before step ``t``
    and ``hook(steps, pipe)`` before the flush; every rank's returns and pipes."""
    data = batches(steps)

    def fn(rank: int, transport: Transport) -> tuple[list[float], AsyncPipe]:
        pipe = AsyncPipe(
            copy.deepcopy(plain),
            balance,
            chunks=4,
            checkpoint=policy,
            schedule="2bw",
            transport=transport,
            timeout=20,
        )
        params = list(pipe.parameters())
        opt = adam(params) if params else None
        out = []
        for t, (x, y) in enumerate(data):
            hook(t, pipe)
            out.append(pipe.step(x, y, mse, optimizer=opt, max_norm=max_norm))
        hook(steps, pipe)
        out.append(pipe.flush())
        return out, pipe

    results = values(run_threads(fn, len(balance)))
    return [r[0] for r in results], [r[1] for r in results]


def check_hooked(
    plain: nn.Module,
    balance: list[int],
    policy: str,
    hook: Hook,
    steps: int = 4,
    max_norm: float | None = None,
) -> None:
    got, pipes = run_hooked(plain, balance, policy, steps, hook, max_norm)
    want, trained = delayed_reference(plain, batches(steps), 4, {steps - 1}, max_norm, hook=hook)
    assert_same(pipes, trained, got, want)


def first_layer(module: nn.Module) -> nn.Module | None:
    """The plain model's layer 0, in the plain model or on the pipe that holds it."""
    if isinstance(module, AsyncPipe):
        return module.layers[0] if module.stage == 0 else None
    assert isinstance(module, nn.Sequential)
    return module[0]


@pytest.mark.parametrize(
    ("change", "policy"), [("freeze", "never"), ("freeze", "always"), ("unfreeze", "always")]
)
def test_requires_grad_changed_between_steps_leaves_the_mini_batch_in_flight_as_it_ran(
    change: str, policy: str
) -> None:
    """Frozen at step 2 (and unfrozen before the flush), or the other way round: the stale
    backwards of the mini-batch in flight ran with the new flags (a frozen parameter missed
    their gradients; an unfrozen one got some from a checkpointed micro-batch's recompute)."""

    def hook(t: int, module: nn.Module) -> None:
        layer = first_layer(module)
        if layer is not None and t in (0, 2, 4):  # 4: before the flush
            layer.requires_grad_((change == "freeze") != (t == 2))

    check_hooked(model(), [4, 4], policy, hook)


@pytest.mark.parametrize(
    ("balance", "policy", "at"), [([4, 4], "always", 2), ([2, 2, 2, 2], "except_last", 4)]
)
def test_train_and_eval_switched_while_a_mini_batch_is_in_flight(
    balance: list[int], policy: str, at: int
) -> None:
    """eval() before step ``at`` (train() again before the flush), or eval() just before the
    flush: a checkpointed micro-batch in flight was recomputed in the new mode (BatchNorm
    with running statistics), not the mode of its forward."""

    def hook(t: int, module: nn.Module) -> None:
        if t == at:
            module.eval()
        elif t == 4 and at < 4:
            module.train()

    check_hooked(batch_norm_model(), balance, policy, hook)


class TrainingBranches(nn.Module):
    """Reads ``self.training`` on both sides of a cut point: each segment of
    ``sequentialize`` runs the graph of its mode."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.extra = (nn.Linear(8, 8) for _ in range(4))
        self.cut = CutPoint()

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        if self.training:
            h = h + self.extra(h)
        h = torch.tanh(self.b(self.cut(h)))
        return self.c(h * 2 if self.training else h)


def test_a_cut_segment_in_flight_is_recomputed_with_the_graph_of_its_mode() -> None:
    torch.manual_seed(0)
    seq = sequentialize(TrainingBranches(), batches(1)[0][0][:2])

    def hook(t: int, module: nn.Module) -> None:
        module.train(t != 2)

    check_hooked(seq, [1, 1], "always", hook)


def test_eval_before_the_backward_of_pipe_input_recomputes_in_train_mode() -> None:
    """``out = pipe(x)`` in train mode, then ``pipe.eval()``, then the backward: the
    checkpointed micro-batches were recomputed in eval mode."""
    plain = batch_norm_model()
    x, y = batches(1)[0]
    reference = copy.deepcopy(plain)
    out = torch.cat([reference(part) for part in x.chunk(4)])
    mse(out, y).backward()

    def fn(rank: int, transport: Transport) -> tuple[AsyncPipe, bool]:
        pipe = AsyncPipe(
            copy.deepcopy(plain), [4, 4], chunks=4, checkpoint="always", transport=transport
        )
        out = pipe(x if rank == 0 else None)
        pipe.eval()
        if pipe.is_last_stage:
            mse(out, y).backward()
        else:
            pipe.back_helper(out)
        return pipe, all(not m.training for m in pipe.modules())

    grads: dict[str, Tensor | None] = {}
    for pipe, in_eval in values(run_threads(fn, 2)):
        assert in_eval  # the caller's mode is back after the recompute
        for layer, names in zip(pipe.layers, pipe.local_names):
            grads.update({f"{names[0]}.{n}": p.grad for n, p in layer.named_parameters()})
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)


@pytest.mark.parametrize(
    ("when", "to_none", "culprits"), [(1, False, [1]), (2, True, [0, 1]), (2, False, [0])]
)
def test_zero_grad_between_two_steps_is_refused(
    when: int, to_none: bool, culprits: list[int]
) -> None:
    """``optimizer.zero_grad()`` between two steps (``when`` 2: before the flush) on the
    ``culprits`` silently dropped the running gradient of the mini-batch in flight. Every rank
    raises: before a step, and before a flush too, where the last rank's drain waits for
    nobody but its end waits for every rank's word (before, the last rank's flush completed)."""
    data = batches(2)

    def fn(rank: int, transport: Transport) -> str:
        pipe = AsyncPipe(model(), [4, 4], chunks=4, schedule="2bw", transport=transport)
        opt = adam(pipe.parameters())
        for t in range(3):
            if t == when and rank in culprits:
                opt.zero_grad(set_to_none=to_none)
            try:
                if t < 2:
                    pipe.step(*data[t], mse, optimizer=opt)
                else:
                    pipe.flush()
            except StageFailure as e:
                return str(e)
        return "no error"

    what = "set to None" if to_none else "zeroed or changed in place"
    for rank, text in enumerate(values(run_threads(fn, 2))):
        culprit = rank if rank in culprits else culprits[0]
        assert f"stage {culprit} failed on rank {culprit} before its" in text, text
        assert f"parameters: {what}), e.g. by optimizer.zero_grad()" in text, text
        assert "mini-batch in flight, which is lost now" in text, text


def test_zero_grad_after_a_flush_and_clipping_are_accepted() -> None:
    """What the library does between two steps (clipping, the drain), and zero_grad() when
    nothing is in flight, do not trip that check."""
    plain, data = model(), batches(4)

    def fn(rank: int, transport: Transport) -> tuple[list[float], AsyncPipe]:
        pipe = AsyncPipe(
            copy.deepcopy(plain), [4, 4], chunks=4, schedule="2bw", transport=transport
        )
        opt = adam(pipe.parameters())
        out = []
        for t, (x, y) in enumerate(data):
            out.append(pipe.step(x, y, mse, optimizer=opt, max_norm=0.5))
            if t in (1, 3):
                out.append(pipe.flush())
                opt.zero_grad()
        return out, pipe

    results = values(run_threads(fn, 2))
    want, trained = delayed_reference(plain, data, 4, {1, 3}, max_norm=0.5)
    assert_same([r[1] for r in results], trained, [r[0] for r in results], want)


def test_a_stage_without_parameters_passes_no_optimizer() -> None:
    """torch refuses an optimizer over no parameters, and 2BW refused optimizer=None."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Tanh(), nn.Linear(8, 8))
    check_hooked(plain, [1, 2, 1], "except_last", lambda t, m: None, max_norm=0.5)
