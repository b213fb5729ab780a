"""Constructor validation: every bad argument fails before any message, naming rule and fix."""

from __future__ import annotations

import pytest
import torch
from models import mlp
from threads import run_threads
from torch import nn

import asyncpipe
from asyncpipe import AsyncPipe, LazyModule
from asyncpipe.transport import InProcessHub


def transport(world: int = 2) -> asyncpipe.transport.Transport:
    return InProcessHub(world).transport(0)


def test_balance_sum_must_match_layers() -> None:
    with pytest.raises(ValueError) as info:
        AsyncPipe(mlp(14), [4, 3, 3, 3], transport=transport(4))
    assert str(info.value) == (
        "sum of balance must equal the number of layers (layers: 14, sum of balance: 13); "
        "pass balance=[4, 4, 3, 3]"
    )


@pytest.mark.parametrize(
    "balance,match",
    [
        ([2, 0], r"positive int.*1: 0"),
        ([2, -1], r"positive int.*1: -1"),
        ([2.0, 2], r"positive int.*0: 2.0"),
        ([True, 3], r"positive int.*0: True"),
        ([], "non-empty list"),
        (4, "non-empty list"),
    ],
)
def test_balance_entries(balance: object, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        AsyncPipe(mlp(4), balance, transport=transport())  # type: ignore[arg-type]


@pytest.mark.parametrize("chunks", [0, -2, 1.5, "4", None])
def test_chunks(chunks: object) -> None:
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        AsyncPipe(mlp(4), [2, 2], chunks=chunks, transport=transport())  # type: ignore[arg-type]


def test_checkpoint_policy() -> None:
    with pytest.raises(ValueError, match="checkpoint must be one of always, except_last, never"):
        AsyncPipe(mlp(4), [2, 2], checkpoint="sometimes", transport=transport())


def test_module_type() -> None:
    with pytest.raises(TypeError, match="module must be an nn.Sequential"):
        AsyncPipe(nn.Linear(2, 2), [1], transport=transport(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"every item of a layer list.*1: str"):
        AsyncPipe([nn.Linear(2, 2), "relu"], [1, 1], transport=transport())  # type: ignore[list-item]


@pytest.mark.parametrize("how", ["wrapper", "in_place"])
def test_a_model_compiled_whole_is_refused_with_the_per_layer_fix(how: str) -> None:
    # before: "got OptimizedModule; wrap your layers with nn.Sequential(...)" (they were), and
    # model.compile() trained uncompiled without a word (each layer is called on its own)
    model = mlp(2)
    if how == "wrapper":
        module: object = torch.compile(model)
    else:
        model.compile()
        module = model
    with pytest.raises(TypeError, match=r"compiled whole .*for layer in model: layer.compile"):
        AsyncPipe(module, [2], transport=transport(1))  # type: ignore[arg-type]
    layers = list(mlp(2))
    for layer in layers:
        layer.compile()
    AsyncPipe(layers, [2], transport=transport(1))  # compiled layers are what it takes


def test_every_problem_is_listed_at_once() -> None:
    with pytest.raises(ValueError) as info:
        AsyncPipe(
            mlp(4), [2, 1], chunks=0, checkpoint="nope", schedule="magic", transport=transport()
        )
    text = str(info.value)
    for part in ["sum of balance", "chunks must be", "checkpoint must be", "schedule must be"]:
        assert part in text
    with pytest.raises(ValueError) as info:  # the options in the same error (a second before)
        AsyncPipe(mlp(4), [2, 2], chunks=0, timeout=-1, trace_every=0, transport=transport())
    assert "chunks must be" in str(info.value) and "timeout must be" in str(info.value)
    assert "trace_every must be" in str(info.value)


def test_world_size_must_match_balance() -> None:
    with pytest.raises(ValueError) as info:
        AsyncPipe(mlp(4), [2, 2], transport=transport(4))
    assert str(info.value).endswith(
        "one entry per pipeline rank (ranks: 4, entries in balance: 2); give balance 4 "
        "entries, or launch 2 processes (torchrun --nproc-per-node=2), or run 2 replicas "
        "with data_parallel_size=2"
    )
    with pytest.raises(ValueError, match=r"give balance 1 entries, or launch 2 processes \("):
        AsyncPipe(mlp(4), [2, 2], transport=transport(1))
    with pytest.raises(ValueError) as info:  # 3 ranks cannot hold replicas of 2 stages
        AsyncPipe(mlp(4), [2, 2], transport=transport(3))
    assert "data_parallel_size" not in str(info.value)
    with pytest.raises(ValueError, match=r"times virtual_stages \(2\).*give balance 4 entries"):
        AsyncPipe(mlp(4), [2, 2], schedule="interleaved", virtual_stages=2, transport=transport(2))


def test_p2p_without_process_group_says_how_to_launch() -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="call asyncpipe.init"):
        AsyncPipe(mlp(4), [2, 2])
    with pytest.raises(ValueError, match="--nproc-per-node=2 train.py"):  # 2 model chunks each
        AsyncPipe(mlp(4), [1, 1, 1, 1], schedule="interleaved", virtual_stages=2)


def test_stage_that_owns_no_layer() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"stages \[1\] only reuse layers"):
        AsyncPipe([a, b, a], [2, 1], transport=transport())


def test_init_outside_torchrun_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun --standalone"):
        asyncpipe.init()


def test_a_group_after_the_callers_own_takes_store_keys_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """init() over the caller's own init_process_group, then shutdown() and init() again: the
    second group read torchrun's store under the first one's names, and a rank could take a
    peer's old address (gloo's connectFullMesh refused, 2 runs of 7)."""
    from asyncpipe import group

    monkeypatch.setattr(group, "_GROUPS", 0)
    monkeypatch.setattr(group, "pause_at_exit", lambda: None)
    monkeypatch.setattr(group.dist, "is_initialized", lambda: True)
    asyncpipe.init()  # the caller's group is running: nothing to set up
    monkeypatch.setattr(group.dist, "is_initialized", lambda: False)  # after shutdown()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", "29999")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store = torch.distributed.HashStore()
    monkeypatch.setattr(group, "rendezvous", lambda *a, **k: iter([(store, 0, 1)]))
    given: dict[str, object] = {}
    monkeypatch.setattr(group.dist, "init_process_group", lambda **kw: given.update(kw))
    asyncpipe.init(backend="gloo")
    assert isinstance(given.get("store"), group.PrefixStore), given


def test_lazy_module_checks_its_function() -> None:
    with pytest.raises(TypeError, match="takes a function"):
        LazyModule(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must return an nn.Module"):
        LazyModule(lambda: 3).build()  # type: ignore[arg-type,return-value]


def test_step_refuses_no_grad() -> None:
    pipe = AsyncPipe(mlp(2), [2], transport=transport(1))
    with torch.no_grad(), pytest.raises(RuntimeError, match="outside torch.no_grad"):
        pipe.step(torch.zeros(2, 8), torch.zeros(2, 8), nn.functional.mse_loss)


@pytest.mark.parametrize(
    "value,match",
    [
        ("text", "input must be a tensor or a tuple of tensors \\(got str\\)"),
        ((torch.zeros(2, 8), 3), "got 1: int\\); pass other values through layer attributes"),
        # before: all 1000 entries named (10,000 characters), and the attributes hint
        (list(range(1000)), r"4: int, \.\.\. \(1000 of 1000 entries are no tensor\)\); convert"),
        ((torch.zeros(2, 8), torch.zeros(3, 8)), "same size in dim 0"),
    ],
)
def test_bad_inputs_on_a_single_rank(value: object, match: str) -> None:
    pipe = AsyncPipe(mlp(2), [2], transport=transport(1))
    with pytest.raises((TypeError, ValueError), match=match):
        pipe.step(value, torch.zeros(2, 8), nn.functional.mse_loss)


@pytest.mark.parametrize(
    "schedule,checkpoint",
    [("gpipe", "never"), ("gpipe", "always"), ("1f1b", "except_last"), ("zero_bubble", "never")],
)
def test_a_loss_without_grad_fails_the_step_as_the_plain_backward_would(
    schedule: str, checkpoint: str
) -> None:
    def detached(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out, target).detach()

    def job(rank: int, transport: asyncpipe.transport.Transport) -> float:
        pipe = AsyncPipe(
            mlp(4), [2, 2], chunks=2, checkpoint=checkpoint, schedule=schedule, transport=transport
        )
        return pipe.step(torch.randn(4, 8), torch.randn(4, 8), detached)

    results = run_threads(job, 2)
    assert all(kind == "error" for kind, _ in results), results
    text = str(results[1][1])
    assert "stage 1 failed in 1B" in text and "does not require grad" in text, text
    assert "the plain model's backward" in text


@pytest.mark.parametrize(
    "options,match",
    [
        ({"timeout": float("inf")}, "timeout must be a positive, finite number of seconds"),
        ({"timeout": True}, r"timeout must be .*\(got True\)"),
        ({"timeout": 0}, "pass e.g. timeout=600"),
        ({"loss_scale": float("inf")}, "loss_scale must be a positive, finite number"),
        ({"trace": ""}, "trace must name a directory"),
        ({"trace": __file__}, "is a file; pass another path"),
        ({"trace": __file__ + "/runs"}, "cannot be created: .* is a file"),
        (
            {"device": "cuda:99"},
            "'cuda:99' (is a CUDA device, but this process sees no GPU|does not)",
        ),
        ({"device": "bogus"}, "device must be a torch.device or its name"),
        ({"device": "meta"}, "device 'meta' is not supported: a stage computes on 'cpu' or"),
        ({"device": torch.device("mps")}, "device 'mps' is not supported"),
    ],
)
def test_options_that_could_only_fail_later_fail_in_the_constructor(
    options: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        AsyncPipe(mlp(4), [2, 2], transport=transport(), **options)  # type: ignore[arg-type]


def test_single_rank_pipeline_matches_plain_model() -> None:
    model = mlp(3)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    plain = __import__("copy").deepcopy(model)
    nn.functional.mse_loss(plain(x), y).backward()
    pipe = AsyncPipe(model, [3], chunks=3, transport=transport(1))
    loss = pipe.step(x, y, nn.functional.mse_loss)
    assert loss == pytest.approx(float(nn.functional.mse_loss(plain(x), y).detach()), rel=1e-6)
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


def test_a_transport_name_that_does_not_exist_lists_the_ones_that_do() -> None:
    with pytest.raises(ValueError, match="transport must be 'p2p', 'shm', 'rpc' or a Transport"):
        AsyncPipe(mlp(4), [2, 2], transport="tcp")


def test_the_shm_transport_lists_its_problems_before_touching_shared_memory() -> None:
    from asyncpipe.transport import ShmTransport

    with pytest.raises(ValueError) as info:
        ShmTransport(ring_bytes=5, spin=2)
    text = str(info.value)
    assert "call asyncpipe.init() first" in text
    assert "ring_bytes must be an integer of at least 65536 (got 5)" in text
    assert "spin must be a number of seconds in [0, 1) (got 2)" in text


@pytest.mark.parametrize(
    "differ,named",
    [
        ({"balance": [1, 3]}, "balance (here: [1, 3]; other on rank 0)"),
        ({"chunks": 2}, "chunks (here: 2; other on rank 0)"),
        ({"schedule": "1f1b"}, "schedule (here: '1f1b'; other on rank 0)"),
        ({"checkpoint": "never"}, "checkpoint (here: 'never'; other on rank 0)"),
    ],
)
def test_ranks_that_build_the_pipeline_differently_are_told_before_any_step(
    differ: dict[str, object], named: str
) -> None:
    from threads import run_threads

    model = mlp(4)

    def build(rank: int, transport: asyncpipe.transport.Transport) -> None:
        options: dict[str, object] = {"balance": [2, 2], "chunks": 4, "schedule": "gpipe"}
        if rank == 1:
            options.update(differ)
        AsyncPipe(model, transport=transport, timeout=10, **options)  # type: ignore[arg-type]

    results = run_threads(build, 2)
    for rank, (status, error) in enumerate(results):
        assert status == "error" and isinstance(error, ValueError), (rank, error)
        assert "must build AsyncPipe with the same arguments" in str(error)
        if rank == 1:
            assert named in str(error), str(error)
        else:
            assert f"{next(iter(differ))} (here: " in str(error) and "other on rank 1" in str(error)


def test_a_rank_whose_stage_fails_to_build_tells_the_others_before_any_step() -> None:
    from gloo_workers import no_memory

    def build(rank: int, transport: asyncpipe.transport.Transport) -> None:
        layers: list[nn.Module | LazyModule] = [nn.Linear(4, 4), LazyModule(no_memory)]
        AsyncPipe(layers, [1, 1], chunks=2, transport=transport, timeout=30)

    (status0, error0), (status1, error1) = run_threads(build, 2)
    assert status1 == "error" and type(error1) is RuntimeError, error1
    assert status0 == "error" and isinstance(error0, asyncpipe.StageFailure), error0
    assert error0.rank == 1 and error0.stage == 1, error0
    assert (
        "its constructor failed on rank 1 (stage 1) with RuntimeError: no memory left for this "
        "layer" in str(error0)
    ), error0
    assert "rank 0 stops too, before any step" in str(error0), error0
