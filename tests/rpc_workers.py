"""Worker functions for the RPC transport tests (run in spawned processes)."""

from __future__ import annotations

import copy
import functools
import os
import time
import warnings
from typing import Any

import torch
from gloo_workers import no_memory, one_rank_cannot_build, one_tuples, transparency
from models import mlp, reference
from skip_workers import skips
from torch import Tensor, nn

import asyncpipe
import asyncpipe.rpc
from asyncpipe import AsyncPipe, LazyModule, StageFailure

mse = nn.functional.mse_loss


def rpc_transparency(rank: int, world: int, *args: Any) -> Any:
    """``transparency`` over the RPC transport."""
    asyncpipe.init(rpc=True)
    try:
        return transparency(rank, world, *args, transport="rpc")
    finally:
        asyncpipe.shutdown()


def rpc_cannot_build(rank: int, world: int, where: str) -> Any:
    """``one_rank_cannot_build`` over the RPC transport."""
    asyncpipe.init(rpc=True)
    try:
        return one_rank_cannot_build(rank, world, where, transport="rpc")
    finally:
        asyncpipe.shutdown()


def rpc_one_tuples(rank: int, world: int) -> Any:
    """``one_tuples`` over the RPC transport."""
    asyncpipe.init(rpc=True)
    try:
        return one_tuples(rank, world, "rpc")
    finally:
        asyncpipe.shutdown()


def rpc_skips(rank: int, world: int, cases: list[Any]) -> Any:
    """``skips`` over the RPC transport."""
    asyncpipe.init(rpc=True)
    try:
        return skips(rank, world, cases, "rpc")
    finally:
        asyncpipe.shutdown()


def _plain_training(model: nn.Module, batches: list[tuple[Tensor, Tensor]], chunks: int) -> Any:
    """Losses and final state of a copy of ``model`` trained with SGD on micro-batches."""
    plain = copy.deepcopy(model)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        total = 0.0
        for px, py in zip(x.chunk(chunks), y.chunk(chunks)):
            loss = mse(plain(px), py) / chunks
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        losses.append(total)
    return losses, plain


def gradients(pipe: AsyncPipe) -> list[Tensor]:
    """Run on every stage by foreach_worker: the local gradients."""
    return [p.grad.clone() for p in pipe.parameters() if p.grad is not None]


def failing_loss(output: Tensor, target: Tensor) -> Tensor:
    raise ValueError("this loss always fails")


def failing_on_last(pipe: AsyncPipe) -> int:
    """Run on every stage by foreach_worker: fails on the last one."""
    if pipe.is_last_stage:
        raise KeyError("nothing here")
    return pipe.stage


def driver(rank: int, world: int, schedule: str) -> Any:
    """Single-controller mode: rank 0 drives; compare with the plain model trained alike."""
    asyncpipe.init(rpc=True)
    if rank != 0:
        asyncpipe.rpc.serve()
        return None
    model = mlp(2 * world, seed=21)
    torch.manual_seed(22)
    batches = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(3)]
    want_losses, plain = _plain_training(model, batches, 4)
    _, want_first = reference(model, *batches[0], 4, mse)
    pipe = asyncpipe.rpc.RemotePipe(
        model,
        [2] * world,
        chunks=4,
        schedule=schedule,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        timeout=30,
    )
    losses, first_grads = [], None
    for n, (x, y) in enumerate(batches):
        pipe.zero_grad()
        losses.append(pipe.step(x, y, mse))
        if n == 0:
            first_grads = [g for stage in pipe.foreach_worker(gradients) for g in stage]
        pipe.optimizer_step()
    state = pipe.state_dict()
    pipe.eval()
    probe = torch.randn(5, 8)
    output = pipe(probe)
    with torch.no_grad():
        want_output = plain(probe)
    result = {
        "loss_error": max(abs(a - b) for a, b in zip(losses, want_losses)),
        "grad_error": max(
            float((a - b).abs().max()) for a, b in zip(first_grads or [], want_first)
        ),
        "grads": len(first_grads or []),
        "state_error": max(
            float((state[k] - v).abs().max()) for k, v in plain.state_dict().items()
        ),
        "state_keys": sorted(state) == sorted(plain.state_dict()),
        "output_error": float((output - want_output).abs().max()),
    }
    try:
        pipe.foreach_worker(failing_on_last)
    except StageFailure as e:
        result["foreach_failure"] = (str(e), e.stage, e.rank)
    try:  # refused before any message: the pipeline goes on below
        pipe.step(batches[0][0], batches[0][1], lambda out, target: mse(out, target))
    except TypeError as e:
        result["lambda"] = str(e)
    try:
        pipe.train()
        pipe.step(batches[0][0], batches[0][1], failing_loss)
    except StageFailure as e:
        result["failure"] = str(e)
    pipe.shutdown()
    return result


def driver_elsewhere(rank: int, world: int) -> Any:
    """Building the driver on a worker rank is an error; the real driver then shuts down."""
    asyncpipe.init(rpc=True)
    if rank == 1:
        try:
            asyncpipe.rpc.RemotePipe(mlp(2), [1, 1], chunks=1)
        except RuntimeError as e:
            message = str(e)
        asyncpipe.rpc.serve()
        return message
    pipe = asyncpipe.rpc.RemotePipe(mlp(2), [1, 1], chunks=1)
    pipe.shutdown()
    return "driver"


def driver_everywhere(rank: int, world: int) -> Any:
    """Every rank builds the driver: the worker ranks are refused and (as a script would) end;
    the real driver names them as gone, instead of TensorPipe's bare "eof"."""
    asyncpipe.init(rpc=True)
    try:
        asyncpipe.rpc.RemotePipe(mlp(2), [1, 1], chunks=1, timeout=20)
    except (RuntimeError, ValueError) as e:
        if rank != 0:
            os._exit(1)
        return type(e).__name__, str(e)
    return "built", ""


def driver_stage_cannot_build(rank: int, world: int) -> Any:
    """A lambda optimizer factory is refused before anything is sent; the stage of rank 1
    fails to build (its LazyModule's factory raises): the driver names it, and a pipeline
    built after it on the same workers trains."""
    asyncpipe.init(rpc=True)
    if rank != 0:
        asyncpipe.rpc.serve()
        return "served"
    layers: list[nn.Module | LazyModule] = [nn.Linear(4, 4) for _ in range(world)]
    try:  # refused before anything is sent: the workers go on serving
        asyncpipe.rpc.RemotePipe(layers, [1] * world, optimizer=lambda p: torch.optim.SGD(p))
        raise AssertionError("a lambda optimizer factory was sent")
    except TypeError as e:
        assert "the optimizer factory is sent to other processes" in str(e), e
    layers[1] = LazyModule(no_memory)
    try:
        asyncpipe.rpc.RemotePipe(layers, [1] * world, chunks=2, timeout=60)
        seen = ("built", "")
    except Exception as e:
        seen = (type(e).__name__, str(e))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(world)])
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    plain = float(mse(copy.deepcopy(model)(x), y))
    pipe = asyncpipe.rpc.RemotePipe(model, [1] * world, chunks=2, timeout=60)
    loss = pipe.step(x, y, mse)
    pipe.shutdown()
    return (*seen, abs(loss - plain))


def driver_dies(rank: int, world: int) -> Any:
    """The driver process dies after building the pipeline; the workers must not hang."""
    asyncpipe.init(rpc=True)
    if rank == 0:
        asyncpipe.rpc.RemotePipe(mlp(2), [1, 1], chunks=1)
        os._exit(3)
    started = time.monotonic()
    try:
        asyncpipe.rpc.serve(check_every=0.5, timeout=5)
    except RuntimeError as e:
        return str(e), time.monotonic() - started
    return "served", time.monotonic() - started


def outbox(rank: int, world: int, messages: int) -> Any:
    """Rank 0 sends ``messages`` small messages to rank 1 back to back over the RPC transport;
    rank 1 takes them in order. Rank 0 returns how many remote calls carried them."""
    import torch.distributed.rpc as rpc

    from asyncpipe.transport import Message, RPCTransport

    asyncpipe.init(rpc=True)
    try:
        transport = RPCTransport(name="outbox")
        if rank == 0:
            calls = []
            real = rpc.rpc_async

            def counting(*args: Any, **kwargs: Any) -> Any:
                calls.append(len(kwargs["args"][2]))  # messages in this call
                return real(*args, **kwargs)

            rpc.rpc_async = counting
            try:
                for n in range(messages):
                    tensor = torch.full((4,), float(n), requires_grad=n % 2 == 1)
                    error = "stage 0 failed" if n == messages - 1 else None
                    transport.send(1, n % 3, Message(n, messages, (tensor, None), error))
                transport.flush(60)
            finally:
                rpc.rpc_async = real
            return calls
        got = []
        pending = [transport.recv(0, n % 3) for n in range(messages)]
        for n, receive in enumerate(pending):
            message = receive.wait(60)
            tensor = message.tensors[0]
            assert tensor is not None and message.tensors[1] is None
            assert float(tensor.detach()[0]) == n and tensor.requires_grad == (n % 2 == 1), n
            assert message.microbatch == n and message.microbatches == messages
            got.append(message.error)
        return got
    finally:
        asyncpipe.shutdown()


def outbox_peer_dies(rank: int, world: int) -> Any:
    """Rank 1 dies with messages on their way to it: rank 0's flush must say so, not hang."""
    from asyncpipe.transport import Message, RPCTransport, TransportTimeout

    asyncpipe.init(rpc=True)
    transport = RPCTransport(name="outbox")
    if rank == 1:
        transport.recv(0, 0).wait(60)
        os._exit(3)
    started = time.monotonic()
    try:
        for n in range(2000):
            transport.send(1, 0, Message(n, 1, (torch.zeros(256),)))
            time.sleep(0.001)
        transport.flush(30)
    except (TransportTimeout, RuntimeError) as e:
        return type(e).__name__, str(e), time.monotonic() - started
    return "delivered", "", time.monotonic() - started


def named_workers(rank: int, world: int) -> Any:
    """RPC workers named by asyncpipe.init(worker_map=...): transport='rpc', RemotePipe and
    serve() find the names without being told them again."""
    asyncpipe.init(rpc=True, worker_map={0: "trainer", 1: "stage1"})
    model = mlp(2, seed=5)
    torch.manual_seed(6)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    want, _ = reference(model, x, y, 2, mse)
    pipe = AsyncPipe(model, [1, 1], chunks=2, transport="rpc", timeout=30)
    pipeline_error = abs(pipe.step(x, y, mse) - want)
    if rank != 0:
        asyncpipe.rpc.serve()
        return pipeline_error, None, None
    try:
        asyncpipe.rpc.RemotePipe(model, [1, 1], chunks=2, schedule="2bw")
        refusal = "built"
    except ValueError as e:
        refusal = str(e)
    driver = asyncpipe.rpc.RemotePipe(model, [1, 1], chunks=2, timeout=30)
    driver_error = abs(driver.step(x, y, mse) - want)
    driver.shutdown()
    return pipeline_error, driver_error, refusal


class _SlowOnRankOne(nn.Module):
    """A layer that sleeps ``seconds`` in its second forward on rank ``rank`` (a stuck stage)."""

    def __init__(self, seconds: float, rank: int = 1) -> None:
        super().__init__()
        self.lin, self.seconds, self.calls, self.rank = nn.Linear(4, 4), seconds, 0, rank

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if torch.distributed.get_rank() == self.rank and self.calls == 2:
            time.sleep(self.seconds)
        return self.lin(x)


def driver_worker_stuck(rank: int, world: int) -> Any:
    """The last rank's stage is stuck in a layer for 25 s with a pipeline timeout of 3 s: the
    driver raises without waiting for it (RPC's timeout is 120 s here). Returns the error's
    text, the rank it names and how long the step took."""
    asyncpipe.init(rpc=True, timeout=120)
    if rank != 0:
        asyncpipe.rpc.serve()
        return "served"
    layers = [nn.Linear(4, 4) for _ in range(world - 1)]
    model = nn.Sequential(*layers, _SlowOnRankOne(25.0, world - 1))
    pipe = asyncpipe.rpc.RemotePipe(model, [1] * world, chunks=2, timeout=3)
    began = time.monotonic()
    named = None
    try:
        pipe.step(torch.randn(4, 4), torch.randn(4, 4), mse)
        seen = "no error"
    except StageFailure as e:
        seen, named = str(e), e.rank
    took = time.monotonic() - began
    pipe.shutdown()
    return seen, named, took


def _exits(pipe: AsyncPipe) -> int:
    if pipe.stage == 1:
        raise SystemExit(2)
    return pipe.stage


def _ends(pipe: AsyncPipe) -> int:
    if pipe.stage == 1:
        os._exit(5)
    return pipe.stage


def driver_worker_exits(rank: int, world: int) -> Any:
    """A function of foreach_worker raises SystemExit on rank 1, then one ends rank 1's
    process: the driver's errors name the stage and function, then the worker as gone (RPC
    passed on "SystemExit: 2" without either, and a bare "eof" for calls to a lost
    worker)."""
    asyncpipe.init(rpc=True)
    if rank != 0:
        asyncpipe.rpc.serve(timeout=20)
        return "served"
    pipe = asyncpipe.rpc.RemotePipe(mlp(2), [1, 1], chunks=1, timeout=20)
    seen = []
    for call in (lambda: pipe.foreach_worker(_exits), lambda: pipe.foreach_worker(_ends),
                 pipe.state_dict):  # fmt: skip
        try:
            call()
            seen.append(("returned", ""))
        except StageFailure as e:
            seen.append((e.rank, str(e)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # closing the stages fails: a worker is gone
        pipe.shutdown()
    return seen


def _driver_with_reused_first_layer(rank: int) -> tuple[nn.Module, Tensor, Tensor] | None:
    """Start RPC; the workers serve (None), the driver gets [A, Tanh, Linear, A] (its last
    stage, with balance [2, 2], on rank 0) and a batch."""
    asyncpipe.init(rpc=True)
    if rank != 0:
        asyncpipe.rpc.serve()
        return None
    torch.manual_seed(0)
    a = nn.Linear(8, 8)
    model = nn.Sequential(a, nn.Tanh(), nn.Linear(8, 8), a)
    return model, torch.randn(8, 8), torch.randn(8, 8)


def driver_reused_last(rank: int, world: int) -> Any:
    """A model whose last position reuses its first layer ([A, B, C, A], balance [2, 2]): its
    last stage runs on rank 0. The driver sent the target to rank 1 (the loss failed: "the
    target is None") and returned rank 1's output (None) from pipe(x). Also: data_parallel_size
    is refused up front (the error blamed a transport the user never passed)."""
    made = _driver_with_reused_first_layer(rank)
    if made is None:
        return None
    model, x, y = made
    want_loss, _ = reference(model, x, y, 2, mse)
    try:
        asyncpipe.rpc.RemotePipe(model, [2, 2], chunks=2, data_parallel_size=2)
        refused = ""
    except ValueError as e:
        refused = str(e)
    pipe = asyncpipe.rpc.RemotePipe(model, [2, 2], chunks=2, timeout=30)
    loss = pipe.step(x, y, mse)
    pipe.eval()
    output = pipe(x)
    with torch.no_grad():
        want_output = model(x)
    pipe.shutdown()
    return abs(loss - want_loss), float((output - want_output).abs().max()), refused


def _tanh_mse(output: Tensor, target: Tensor) -> Tensor:
    return mse(torch.tanh(output), target)


def driver_refusals(rank: int, world: int) -> Any:
    """What the driver refuses before it sends anything, and what it no longer sends.

    On a model whose last stage is on rank 0 ([A, B, C, A]), a lambda loss_fn went to every
    rank and failed to pickle; balance "auto", an int or None, shared weights across stages
    and lambda LazyModule factories failed on the stages (or in a raw pickling or iteration
    error) with messages that did not fit RemotePipe; a batch the stages could not split
    broke the pipeline for every later call. Returns, by case, what each call gave (kind,
    text) and how many remote calls it made, and the losses to compare with the plain
    model's."""
    import torch.distributed.rpc as rpc

    made = _driver_with_reused_first_layer(rank)
    if made is None:
        return None
    model, x, y = made
    seen: dict[str, Any] = {"want": reference(model, x, y, 2, _tanh_mse)[0]}
    calls: list[str] = []
    real = rpc.rpc_async

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(str(args[0]))
        return real(*args, **kwargs)

    def attempt(case: str, call: Any) -> None:
        calls.clear()
        rpc.rpc_async = counting
        try:
            seen[case] = ("returned", call(), len(calls))
        except Exception as e:
            seen[case] = (type(e).__name__, str(e), len(calls))
        finally:
            rpc.rpc_async = real

    def build(module: Any, balance: Any, **kwargs: Any) -> str:
        asyncpipe.rpc.RemotePipe(module, balance, chunks=2, timeout=30, **kwargs)
        return "built"

    attempt("auto", lambda: build(model, "auto", sample=x[:4]))
    attempt("int", lambda: build(model, 2))
    attempt("none", lambda: build(model, None))
    attempt("shared", lambda: build(mlp(4), [2, 2], shared_weights=[("0.0.weight", "3.0.weight")]))
    lazy = [LazyModule(lambda: nn.Linear(8, 8)) for _ in range(4)]
    attempt("lazy", lambda: build([nn.Linear(8, 8), *lazy[1:]], [2, 2]))
    tied = asyncpipe.rpc.RemotePipe(  # shared weights on one stage are kept equal there
        mlp(4),
        [2, 2],
        chunks=2,
        timeout=30,
        shared_weights=[("0.0.weight", "1.0.weight")],
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
    )
    tied.step(x, y, mse)
    tied.optimizer_step()
    state = tied.state_dict()
    seen["tied"] = torch.equal(state["0.0.weight"], state["1.0.weight"])
    tied.close()
    pipe = asyncpipe.rpc.RemotePipe(model, [2, 2], chunks=2, timeout=30)
    seen["last_rank"] = pipe.pipe.last_rank
    attempt("lambda", lambda: pipe.step(x, y, lambda out, target: _tanh_mse(out, target)))
    attempt("list", lambda: pipe.step([1.0, 2.0], y, _tanh_mse))
    attempt("rows", lambda: pipe.step(x, y[:1], _tanh_mse))
    attempt("forward", lambda: pipe([1.0]))
    attempt("after", lambda: pipe.step(x, y, _tanh_mse))
    pipe.shutdown()
    return seen
