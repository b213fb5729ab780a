"""DeferredBatchNorm against plain BatchNorm: per micro-batch outputs, per mini-batch statistics."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from threads import run_threads, values
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from asyncpipe import AsyncPipe
from asyncpipe.batchnorm import DeferredBatchNorm, commit_all, paused
from asyncpipe.transport import Transport

C = 3
N = 11  # torch.chunk(…, 4) gives 3, 3, 3, 2: the last micro-batch is smaller
CHUNKS = 4

# (id, class, shape of one sample after the channel dimension)
KINDS = [
    ("1d-2D", nn.BatchNorm1d, ()),
    ("1d-3D", nn.BatchNorm1d, (5,)),
    ("2d", nn.BatchNorm2d, (4, 3)),
    ("3d", nn.BatchNorm3d, (2, 3, 2)),
]


def make_bn(cls: type[_BatchNorm], momentum: float | None, affine: bool) -> _BatchNorm:
    """A BatchNorm with non-trivial weights and running statistics."""
    bn = cls(C, momentum=momentum, affine=affine)
    with torch.no_grad():
        if affine:
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
        assert bn.running_mean is not None and bn.running_var is not None
        bn.running_mean.uniform_(-1.0, 1.0)
        bn.running_var.uniform_(0.5, 2.0)
    return bn


def batch(rest: tuple[int, ...], n: int = N) -> Tensor:
    """A batch whose channels have distinct, non-zero means and scales."""
    shape = (n, C, *rest)
    view = (1, C) + (1,) * len(rest)
    scale = torch.tensor([0.5, 2.0, 4.0]).view(view)
    offset = torch.tensor([3.0, -1.0, 10.0]).view(view)
    return torch.randn(shape) * scale + offset


def stats(bn: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in bn.state_dict().items()}


def assert_same_stats(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["num_batches_tracked"] == sb["num_batches_tracked"]
    torch.testing.assert_close(sa["running_mean"], sb["running_mean"])
    torch.testing.assert_close(sa["running_var"], sb["running_var"])


def params(bn: nn.Module) -> list[nn.Parameter]:
    return [p for p in (bn.weight, bn.bias) if p is not None]


@pytest.fixture(autouse=True)
def seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["ema", "cma"])
@pytest.mark.parametrize(("cls", "rest"), [k[1:] for k in KINDS], ids=[k[0] for k in KINDS])
def test_matches_batchnorm_per_microbatch_and_per_minibatch(
    cls: type[_BatchNorm], rest: tuple[int, ...], momentum: float | None, affine: bool
) -> None:
    original = make_bn(cls, momentum, affine)
    micro = copy.deepcopy(original)  # run per micro-batch: outputs and gradients
    whole = copy.deepcopy(original)  # run on the whole mini-batch: running statistics
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(original), CHUNKS)
    assert isinstance(deferred, DeferredBatchNorm)
    for _ in range(3):
        x = batch(rest)
        pieces = torch.chunk(x, CHUNKS)
        assert [p.shape[0] for p in pieces] == [3, 3, 3, 2]
        for module in (micro, deferred):
            for p in params(module):
                p.grad = None
        before = stats(deferred)
        for piece in pieces:
            a = piece.clone().requires_grad_(True)
            b = piece.clone().requires_grad_(True)
            w = torch.randn_like(piece)
            ya, yb = micro(a), deferred(b)
            torch.testing.assert_close(yb, ya)
            (ya * w).sum().backward()
            (yb * w).sum().backward()
            assert a.grad is not None and b.grad is not None
            torch.testing.assert_close(b.grad, a.grad)
        for pa, pb in zip(params(micro), params(deferred)):
            assert pa.grad is not None and pb.grad is not None
            torch.testing.assert_close(pb.grad, pa.grad)
        # Nothing moves before the commit.
        for key, value in stats(deferred).items():
            assert torch.equal(value, before[key]), key
        whole(x)
        deferred.commit()
        assert_same_stats(deferred, whole)
    assert int(deferred.num_batches_tracked) == 3


@pytest.mark.parametrize("momentum", [0.1, None], ids=["ema", "cma"])
def test_statistics_differ_from_per_microbatch_updates(momentum: float | None) -> None:
    # The comparison above is meaningful: per-micro-batch updates give other statistics.
    micro = make_bn(nn.BatchNorm2d, momentum, True)
    whole = copy.deepcopy(micro)
    x = batch((4, 3))
    for piece in torch.chunk(x, CHUNKS):
        micro(piece)
    whole(x)
    assert not torch.allclose(micro.running_var, whole.running_var)


def test_accumulator_is_numerically_careful() -> None:
    # Large offset, unit spread: a float32 sum of squares would lose the variance entirely.
    deferred = DeferredBatchNorm(2, momentum=1.0, chunks=8)
    x = torch.randn(64, 2, 16) + torch.tensor([1e4, -3e4]).view(1, 2, 1)
    for piece in torch.chunk(x, 8):
        deferred(piece)
    deferred.commit()
    x64 = x.double().transpose(0, 1).reshape(2, -1)
    torch.testing.assert_close(deferred.running_mean, x64.mean(1).float())
    torch.testing.assert_close(deferred.running_var, x64.var(1).float(), rtol=1e-3, atol=0)
    assert deferred.running_mean.dtype == torch.float32


@pytest.mark.parametrize(("cls", "rest"), [k[1:] for k in KINDS], ids=[k[0] for k in KINDS])
def test_recompute_under_paused_accumulates_nothing(
    cls: type[_BatchNorm], rest: tuple[int, ...]
) -> None:
    original = make_bn(cls, 0.1, True)
    whole = copy.deepcopy(original)
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(original), CHUNKS)
    model = nn.Sequential(nn.Identity(), deferred)
    x = batch(rest)
    pieces = torch.chunk(x, CHUNKS)
    with torch.no_grad():  # checkpointed forwards: no graph, statistics tracked
        first = [model(p) for p in pieces]
    for p, y in zip(pieces, first):  # recompute with a graph, then backward
        with paused(model):
            again = model(p.clone().requires_grad_(True))
        torch.testing.assert_close(again, y)
        again.sum().backward()
    assert deferred.tracking
    deferred.commit()
    whole(x)
    assert_same_stats(deferred, whole)
    # A recompute after the commit leaves the statistics as they are.
    before = stats(deferred)
    with paused([deferred]):
        for p in pieces:
            deferred(p)
    deferred.commit()
    for key, value in stats(deferred).items():
        assert torch.equal(value, before[key]), key


def test_paused_restores_and_nests_and_skips_non_modules() -> None:
    a = DeferredBatchNorm(C, chunks=1)
    b = DeferredBatchNorm(C, chunks=1)
    b.tracking = False
    layers: list[object] = [a, len, nn.Sequential(b, a)]
    with paused(layers):
        assert not a.tracking and not b.tracking
        with paused(a):
            assert not a.tracking
        assert not a.tracking
    assert a.tracking and not b.tracking
    with pytest.raises(KeyError), paused(a):
        raise KeyError("boom")
    assert a.tracking


def test_unpaused_recompute_is_caught() -> None:
    deferred = DeferredBatchNorm(C, chunks=2)
    x = batch(())
    for piece in torch.chunk(x, 2):
        deferred(piece)
    with pytest.raises(RuntimeError, match="without a commit"):
        deferred(x[:4])  # a third micro-batch: a recompute outside paused, or a missed commit
    deferred.commit()
    deferred(x[:4])  # fine again after the commit


@pytest.mark.parametrize(("cls", "rest"), [k[1:] for k in KINDS], ids=[k[0] for k in KINDS])
def test_eval_uses_running_statistics_and_accumulates_nothing(
    cls: type[_BatchNorm], rest: tuple[int, ...]
) -> None:
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(make_bn(cls, 0.1, True), CHUNKS)
    for piece in torch.chunk(batch(rest), CHUNKS):
        deferred(piece)
    deferred.commit()
    plain = cls(C)
    plain.load_state_dict(deferred.state_dict())
    deferred.eval()
    plain.eval()
    before = stats(deferred)
    x = batch(rest)
    torch.testing.assert_close(deferred(x), plain(x))
    # Normalised with the running statistics, not the batch's: the channel means are not zero.
    assert deferred(x).transpose(0, 1).reshape(C, -1).mean(1).abs().max() > 0.1
    deferred.train()
    deferred.commit()
    for key, value in stats(deferred).items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize(("cls", "rest"), [k[1:] for k in KINDS], ids=[k[0] for k in KINDS])
def test_state_dict_keys_and_loading_both_ways(
    cls: type[_BatchNorm], rest: tuple[int, ...], affine: bool
) -> None:
    original = make_bn(cls, 0.1, affine)
    keys = list(original.state_dict())
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(original), CHUNKS)
    assert list(deferred.state_dict()) == keys
    for piece in torch.chunk(batch(rest), CHUNKS):
        deferred(piece)
    assert list(deferred.state_dict()) == keys  # the accumulator is never saved
    deferred.commit()
    # Deferred -> plain.
    plain = cls(C, affine=affine)
    plain.load_state_dict(deferred.state_dict())
    for key, value in deferred.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key
    # Plain -> deferred.
    fresh = DeferredBatchNorm(C, affine=affine, chunks=CHUNKS)
    fresh.load_state_dict(original.state_dict())
    for key, value in original.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
    # Both ways inside a model, prefixes included.
    model = nn.Sequential(nn.Conv1d(C, C, 1), make_bn(cls, 0.1, affine))
    converted = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(model), CHUNKS)
    assert list(converted.state_dict()) == list(model.state_dict())
    model.load_state_dict(converted.state_dict())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C, C, 1)
        self.norms = nn.ModuleList([nn.BatchNorm2d(C), nn.Sequential(nn.BatchNorm2d(C))])


def test_convert_keeps_parameters_and_buffers_and_converts_nested_modules() -> None:
    block = Block()
    model = nn.Sequential(block, nn.BatchNorm1d(C, momentum=None, affine=False, eps=1e-3))
    model.eval()
    model[1].train()
    old = [block.norms[0], block.norms[1][0], model[1]]
    old_params = [list(bn.parameters()) for bn in old]
    old_buffers = [list(bn.buffers()) for bn in old]
    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, CHUNKS)
    assert converted is model
    new = [block.norms[0], block.norms[1][0], model[1]]
    for bn, was, ps, bs in zip(new, old, old_params, old_buffers):
        assert isinstance(bn, DeferredBatchNorm)
        assert bn is not was and bn.chunks == CHUNKS and bn.training == was.training
        assert bn.eps == was.eps and bn.momentum == was.momentum and bn.affine == was.affine
        assert all(p is q for p, q in zip(bn.parameters(), ps)) and len(ps) == (
            2 if was.affine else 0
        )
        assert all(b is c for b, c in zip(bn.buffers(), bs)) and len(bs) == 3
    assert isinstance(block.conv, nn.Conv2d)
    # Callers holding the old parameters see the gradients.
    weight = old_params[0][0]
    model.train()
    block.norms[0](batch((2, 2))).pow(2).sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_convert_a_batchnorm_itself_and_what_is_left_alone() -> None:
    bn = nn.BatchNorm2d(C)
    converted = DeferredBatchNorm.convert_deferred_batch_norm(bn, 2)
    assert isinstance(converted, DeferredBatchNorm) and converted.weight is bn.weight
    assert DeferredBatchNorm.convert_deferred_batch_norm(converted, 2) is converted
    sync = nn.SyncBatchNorm(C)
    untracked = nn.BatchNorm2d(C, track_running_stats=False)
    model = nn.Sequential(sync, untracked)
    DeferredBatchNorm.convert_deferred_batch_norm(model, 2)
    assert model[0] is sync and model[1] is untracked
    with pytest.raises(ValueError, match="uninitialised"):
        DeferredBatchNorm.convert_deferred_batch_norm(nn.Sequential(nn.LazyBatchNorm1d()), 2)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="chunks"):
            DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm1d(C), bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("momentum", [0.1, None], ids=["ema", "cma"])
def test_commit_with_nothing_accumulated_changes_nothing(momentum: float | None) -> None:
    deferred = DeferredBatchNorm.convert_deferred_batch_norm(
        make_bn(nn.BatchNorm1d, momentum, True), CHUNKS
    )
    before = stats(deferred)
    deferred.commit()
    for key, value in stats(deferred).items():
        assert torch.equal(value, before[key]), key
    for piece in torch.chunk(batch(()), CHUNKS):
        deferred(piece)
    deferred.commit()
    after = stats(deferred)
    assert int(after["num_batches_tracked"]) == 1
    deferred.commit()  # a second commit for the same mini-batch: nothing left to apply
    for key, value in stats(deferred).items():
        assert torch.equal(value, after[key]), key


def test_discard_drops_the_accumulator() -> None:
    deferred = DeferredBatchNorm(C, chunks=CHUNKS)
    before = stats(deferred)
    deferred(batch(()))
    deferred.discard()
    deferred.commit()
    for key, value in stats(deferred).items():
        assert torch.equal(value, before[key]), key


def test_commit_all_commits_every_layer_once() -> None:
    shared = nn.BatchNorm1d(C)
    model = nn.Sequential(nn.BatchNorm1d(C), nn.Sequential(shared, nn.ReLU()))
    whole = copy.deepcopy(model[0])
    model = DeferredBatchNorm.convert_deferred_batch_norm(model, CHUNKS)
    first, second = model[0], model[1][0]
    assert isinstance(first, DeferredBatchNorm) and isinstance(second, DeferredBatchNorm)
    x = batch(())
    for piece in torch.chunk(x, CHUNKS):
        model(piece)
    commit_all([model, second, print])  # the shared layer is listed twice, once committed
    whole(x)
    assert_same_stats(first, whole)
    assert int(second.num_batches_tracked) == 1
    assert int(first.num_batches_tracked) == 1


def test_input_checks() -> None:
    deferred = DeferredBatchNorm(C, chunks=1)
    with pytest.raises(ValueError, match="at least 2"):
        deferred(torch.randn(C))
    with pytest.raises(ValueError, match="channels"):
        deferred(torch.randn(4, C + 1))
    with pytest.raises(ValueError, match="chunks"):
        DeferredBatchNorm(C, chunks=0)
    # A micro-batch with one value per channel fails as in BatchNorm, and folds nothing in.
    with pytest.raises(ValueError, match="more than 1 value"):
        deferred(torch.randn(1, C))
    before = stats(deferred)
    deferred.commit()
    for key, value in stats(deferred).items():
        assert torch.equal(value, before[key]), key


# ----- a BatchNorm used several times per forward -------------------------------------------


class TwoCalls(nn.Module):
    """One BatchNorm called twice per forward, on two branches."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.bn(self.a(x))) + self.bn(self.b(x))


def shared_norms(seed: int = 0) -> nn.Sequential:
    """A BatchNorm shared by positions 0 and 2, one called twice in position 1, and a layer
    (with a cumulative BatchNorm) reused at positions 3 and 4."""
    torch.manual_seed(seed)
    shared = nn.BatchNorm1d(8)
    reused = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.Tanh())
    return nn.Sequential(
        nn.Sequential(nn.Linear(8, 8), shared, nn.Tanh()),
        TwoCalls(),
        nn.Sequential(nn.Linear(8, 8), shared, nn.Tanh()),
        reused,
        reused,
        nn.Linear(8, 8),
    )


def per_use_reference(
    model: nn.Module, x: Tensor, y: Tensor, chunks: int, steps: int
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Gradients of per-micro-batch normalisation, and the running statistics of the plain
    model run on the whole mini-batch: each BatchNorm updated once per use (its n-th call in
    a forward), in the model's order, with the statistics of all the micro-batches of that
    use."""
    per_chunk, whole = copy.deepcopy(model), copy.deepcopy(model)
    norms = {id(m): n for n, m in per_chunk.named_modules() if isinstance(m, nn.BatchNorm1d)}
    seen: dict[tuple[str, int], list[Tensor]] = {}  # by use, in the order of first calls
    calls: dict[str, int] = {}  # within one forward
    for name in norms.values():
        norm = per_chunk.get_submodule(name)

        def record(m: nn.Module, args: tuple[Tensor, ...], name: str = name) -> None:
            use = (name, calls.get(name, 0))
            calls[name] = use[1] + 1
            seen.setdefault(use, []).append(args[0].detach())

        norm.register_forward_pre_hook(record)
    pieces = list(zip(x.chunk(chunks), y.chunk(chunks)))
    for _ in range(steps):
        per_chunk.zero_grad()
        for px, py in pieces:
            calls.clear()
            (nn.functional.mse_loss(per_chunk(px), py) / len(pieces)).backward()
        with torch.no_grad():
            for (name, _), inputs in seen.items():
                whole.get_submodule(name)(torch.cat(inputs))
        seen.clear()
    grads = [p.grad.clone() for p in per_chunk.parameters() if p.grad is not None]
    stats = {k: v.clone() for k, v in whole.state_dict().items() if "running" in k or "num" in k}
    return grads, stats


def test_convert_keeps_one_object_per_batchnorm_and_updates_once_per_use() -> None:
    model = shared_norms()
    inner = copy.deepcopy(model[3])
    model.append(nn.Sequential(inner, inner))
    x = torch.randn(N, 8)
    y = torch.randn(N, 8)
    want_grads, want_stats = per_use_reference(model, x, y, CHUNKS, steps=2)
    # a block converted on its own first, then inside the whole model
    model[6] = DeferredBatchNorm.convert_deferred_batch_norm(model[6], CHUNKS)
    model = DeferredBatchNorm.convert_deferred_batch_norm(model, CHUNKS)
    assert isinstance(model[0][1], DeferredBatchNorm)
    assert model[0][1] is model[2][1]  # one object, found at both places
    for _ in range(2):
        model.zero_grad()
        for px, py in zip(x.chunk(CHUNKS), y.chunk(CHUNKS)):
            (nn.functional.mse_loss(model(px), py) / CHUNKS).backward()
        commit_all(model)
    for got, want in zip([p.grad for p in model.parameters()], want_grads):
        torch.testing.assert_close(got, want)
    got_stats = model.state_dict()
    for key, value in want_stats.items():
        torch.testing.assert_close(got_stats[key], value, msg=key)
    assert int(got_stats["0.1.num_batches_tracked"]) == 4  # two uses, two steps
    assert int(got_stats["1.bn.num_batches_tracked"]) == 4
    assert int(got_stats["3.1.num_batches_tracked"]) == 4  # the reused layer's two positions
    assert int(got_stats["6.0.1.num_batches_tracked"]) == 4  # twice in the converted block


def check_pipes(
    model: nn.Sequential, balance: list[int], world: int, **options: Any
) -> list[AsyncPipe]:
    """Two steps of ``AsyncPipe(model, ...)`` against :func:`per_use_reference`."""
    torch.manual_seed(1)
    x, y = torch.randn(N, 8), torch.randn(N, 8)
    want_grads, want_stats = per_use_reference(model, x, y, CHUNKS, steps=2)

    def fn(rank: int, transport: Transport) -> AsyncPipe:
        pipe = AsyncPipe(
            model, balance, chunks=CHUNKS, deferred_batch_norm=True, transport=transport,
            timeout=10, **options,
        )  # fmt: skip
        for _ in range(2):
            pipe.zero_grad()
            pipe.step(x, y, nn.functional.mse_loss)
        return pipe

    pipes = values(run_threads(fn, world))
    grads = [p.grad for p in model.parameters()]  # the pipes hold the caller's parameters
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want)
    stats: dict[str, Tensor] = {}
    for pipe in pipes:
        stats.update(pipe.state_dict())
    for key, value in want_stats.items():
        torch.testing.assert_close(stats[key], value, msg=key)
    return pipes


@pytest.mark.parametrize(
    ("schedule", "policy"), [("gpipe", "always"), ("1f1b", "never"), ("zero_bubble", "except_last")]
)
def test_pipeline_updates_a_batchnorm_once_per_use(schedule: str, policy: str) -> None:
    pipes = check_pipes(shared_norms(), [3, 3], 2, schedule=schedule, checkpoint=policy)
    first, second = pipes
    assert first[0][1] is first[2][1]  # the shared BatchNorm is one DeferredBatchNorm
    assert int(first[0][1].num_batches_tracked) == 4  # two uses, two steps
    assert int(first[1].bn.num_batches_tracked) == 4
    assert int(second[0][1].num_batches_tracked) == 4  # the reused layer's two positions


def test_interleaved_pipeline_updates_a_batchnorm_shared_across_segments_once_per_use() -> None:
    model = shared_norms()
    model = nn.Sequential(model[0], model[1], model[2], model[5])  # 0 and 2 on rank 0
    pipes = check_pipes(model, [1, 1, 1, 1], 2, schedule="interleaved", virtual_stages=2)
    assert pipes[0][0][1] is pipes[0][1][1]
    assert int(pipes[0][0][1].num_batches_tracked) == 4


def test_pipeline_refuses_a_batchnorm_layer_reused_in_two_segments_of_a_stage() -> None:
    reused = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    model = nn.Sequential(reused, nn.Linear(8, 8), nn.Linear(8, 8), reused)

    def fn(rank: int, transport: Transport) -> AsyncPipe:
        return AsyncPipe(
            model, [2, 2], chunks=2, deferred_batch_norm=True, transport=transport, timeout=10
        )

    (status, error), (other, _) = run_threads(fn, 2)
    assert status == "error" and other == "error"
    assert isinstance(error, ValueError)
    message = str(error)
    assert "positions '0', '3'" in message and "BatchNorm '0.1'" in message
    assert "its own layer object" in message


@pytest.mark.filterwarnings("ignore:Using a target size")  # mse broadcasts the short target
def test_a_mismatched_batch_leaves_deferred_statistics_as_they_were() -> None:
    """MismatchedBatch ended the step without committing: the accumulators kept its
    micro-batches and the next good step failed ("tracked 4 micro-batches ... without a
    commit()"), breaking the pipeline."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8), nn.Tanh())
    fresh = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def fn(net: nn.Module, wrong: bool) -> Any:
        def run(rank: int, transport: Transport) -> Any:
            pipe = AsyncPipe(net, [2, 2], chunks=4, transport=transport, deferred_batch_norm=True)
            if wrong:
                with pytest.raises(ValueError, match="same batch size"):
                    pipe.step(x, y[:4], nn.functional.mse_loss)
            return pipe.step(x, y, nn.functional.mse_loss)

        return values(run_threads(run, 2))

    assert fn(model, True) == fn(fresh, False)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
