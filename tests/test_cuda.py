"""CUDA tests: run where a GPU is at hand, skipped elsewhere."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from gloo_workers import check_errors, transparency
from models import mlp, reference
from spawn import run_ranks
from threads import run_threads, values
from torch import nn

import asyncpipe
from asyncpipe import AsyncPipe
from asyncpipe.group import choose_backend
from asyncpipe.transport import Transport
from asyncpipe.transport.rpc import device_maps

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
mse = nn.functional.mse_loss


@cuda
@pytest.mark.parametrize("policy", ["always", "except_last", "never"])
def test_in_process_ranks_on_cuda_match_the_plain_model(policy: str) -> None:
    device = torch.device("cuda", 0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.0), nn.Tanh()) for _ in range(4)]
    ).to(device)
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 32, device=device), torch.randn(8, 32, device=device)
    for xc, yc in zip(x.chunk(4), y.chunk(4)):
        (mse(plain(xc), yc) / 4).backward()

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(
            model,
            [2, 2],
            chunks=4,
            checkpoint=policy,
            transport=transport,
            timeout=30,
            device=device,
        )
        return pipe.step(x, y, mse)

    values(run_threads(fn, 2))
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


def _nccl_worker(rank: int, world: int) -> Any:
    device = torch.device("cuda", rank)
    model = mlp(4, width=16, seed=0).to(device)
    plain = copy.deepcopy(model)
    torch.manual_seed(1)
    x, y = torch.randn(8, 16, device=device), torch.randn(8, 16, device=device)
    for xc, yc in zip(x.chunk(4), y.chunk(4)):
        (mse(plain(xc), yc) / 4).backward()
    pipe = AsyncPipe(model, [2, 2], chunks=4, timeout=60, device=device)
    pipe.step(x, y, mse)
    ids = {id(p): n for n, p in enumerate(model.parameters())}
    want = list(plain.parameters())
    return max(float((p.grad - want[ids[id(p)]].grad).abs().max()) for p in pipe.parameters())


@two_gpus
@pytest.mark.slow
def test_nccl_two_processes_match_the_plain_model() -> None:
    for error in run_ranks(_nccl_worker, 2, timeout=300, backend="nccl"):
        assert error < 1e-5


def test_processes_are_placed_on_gpus_one_each_or_shared() -> None:
    # NCCL needs a GPU per process; with fewer GPUs the processes share them over gloo.
    assert choose_backend(0, 4) == "gloo"
    assert choose_backend(4, 4) == "nccl"
    assert choose_backend(8, 4) == "nccl"
    assert choose_backend(1, 2) == "gloo"
    names = {r: f"w{r}" for r in range(4)}
    assert device_maps(1, 4, 4, names) == {"w0": {1: 0}, "w2": {1: 2}, "w3": {1: 3}}
    assert device_maps(3, 4, 4, names, gpus=2) == {"w0": {1: 0}, "w1": {1: 1}, "w2": {1: 0}}
    assert device_maps(2, 4, 4, names, gpus=1) == {"w0": {0: 0}, "w1": {0: 0}, "w3": {0: 0}}
    # two nodes of two processes, one GPU each process
    assert device_maps(3, 4, 2, names) == {"w0": {1: 0}, "w1": {1: 1}, "w2": {1: 0}}


def _on_shared_gpu(
    rank: int,
    world: int,
    transport: str,
    schedules: tuple[str, ...],
    balances: list[list[int]],
    chunks: list[int],
) -> Any:
    """Every process computes on GPU 0; messages go over gloo (p2p) or TensorPipe (rpc)."""
    if transport == "rpc":
        asyncpipe.init(rpc=True)  # device maps GPU 0 -> GPU 0
    try:
        policies = ("always", "except_last", "never")
        return transparency(
            rank, world, balances, chunks, schedules, policies, 16, transport, "cuda"
        )
    finally:
        if transport == "rpc":
            asyncpipe.shutdown()


@cuda
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["p2p", "rpc"])
def test_two_processes_sharing_a_gpu_match_the_plain_model(transport: str) -> None:
    schedules = ("gpipe", "1f1b", "zero_bubble")
    balances, chunks = [[2, 2], [1, 3]], [1, 2, 4]
    results = run_ranks(_on_shared_gpu, 2, transport, schedules, balances, chunks, timeout=300)
    check_errors(results)
    assert len(results[0]) == len(schedules) * 2 * 3 * 3


@cuda
@pytest.mark.slow
def test_four_processes_sharing_a_gpu_interleaved_match_the_plain_model() -> None:
    one = run_ranks(_on_shared_gpu, 4, "p2p", ("gpipe",), [[1, 2, 2, 1]], [4, 8], timeout=300)
    two = run_ranks(_on_shared_gpu, 4, "p2p", ("interleaved",), [[1] * 8], [4, 8], timeout=300)
    check_errors(one)
    check_errors(two)
    assert len(one[0]) == len(two[0]) == 2 * 3


def _cuda_trace(rank: int, world: int, directory: str) -> Any:
    device = torch.device("cuda", 0)
    model = mlp(4, width=16, seed=0).to(device)
    pipe = AsyncPipe(model, [2, 2], chunks=4, timeout=60, device=device, trace=directory)
    x, y = torch.randn(8, 16, device=device), torch.randn(8, 16, device=device)
    for _ in range(2):
        pipe.step(x, y, mse)
    pipe.close()
    return pipe.last_step.peak_activations, torch.cuda.max_memory_allocated(device)


@cuda
@pytest.mark.slow
def test_trace_of_a_pipeline_on_a_gpu(tmp_path: Any) -> None:
    from asyncpipe.trace import load_steps, summarize

    results = run_ranks(_cuda_trace, 2, str(tmp_path), timeout=300)
    assert [peak for peak, _ in results] == [4, 4]  # GPipe holds every micro-batch
    stages = summarize(load_steps(tmp_path))
    assert [s.rank for s in stages] == [0, 1]
    for stage, (_, allocated) in zip(stages, results):
        # the CUDA allocator's peak, not the process's resident set
        assert 0 < stage.peak_memory <= allocated, (stage, allocated)
        assert 0 < stage.busy < 1, stage


@cuda
def test_bf16_autocast_on_cuda_is_near_float32() -> None:
    device = torch.device("cuda", 0)
    model = mlp(4, width=32, seed=3).to(device)
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 32, device=device), torch.randn(8, 32, device=device)
    for xc, yc in zip(x.chunk(4), y.chunk(4)):
        (mse(plain(xc), yc) / 4).backward()

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(
            model, [2, 2], chunks=4, transport=transport, device=device, autocast=torch.bfloat16
        )
        return pipe.step(x, y, mse)

    values(run_threads(fn, 2))
    for got, want in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=3e-2, rtol=5e-2)


def _rpc_cuda_messages(rank: int, world: int) -> Any:
    """Large CUDA tensors over the RPC transport, read as soon as they arrive."""
    from asyncpipe.transport import Message
    from asyncpipe.transport.rpc import RPCTransport

    asyncpipe.init(rpc=True)
    try:
        transport = RPCTransport(name="cuda-messages")
        wrong = []
        for n in range(16):
            if rank == 0:
                value = torch.full((4096, 4096), float(n + 1), device="cuda")
                transport.send(1, 0, Message(n, 16, (value,)))
            else:
                tensor = transport.recv(0, 0).wait(60).tensors[0]
                assert tensor is not None and tensor.is_cuda
                low, high = float(tensor.min()), float(tensor.max())
                if low != high or low != n + 1:
                    wrong.append((n, low, high))
        transport.flush(60)
        return wrong
    finally:
        asyncpipe.shutdown()


@cuda
@pytest.mark.slow
def test_rpc_cuda_tensors_are_ready_when_received() -> None:
    # TensorPipe fills a received CUDA tensor on a stream of its own: the transport must wait
    # for it before the pipeline (on its stream) reads the tensor.
    assert run_ranks(_rpc_cuda_messages, 2, timeout=300) == [[], []]


@cuda
def test_layers_and_batch_move_to_the_pipeline_device() -> None:
    device = torch.device("cuda", 0)
    model = mlp(4, width=16, seed=4)  # on the CPU
    layers = list(model)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    want_loss, want_grads = reference(model.to(device), x.to(device), y.to(device), 4, mse)
    model.cpu()

    def fn(rank: int, transport: Transport) -> float:
        pipe = AsyncPipe(model, [2, 2], chunks=4, transport=transport, device=device)
        return pipe.step(x, y, mse)  # a CPU batch

    losses = values(run_threads(fn, 2))
    assert list(model) == layers  # the same layer objects, now on the GPU
    assert all(p.is_cuda for p in model.parameters())
    assert losses == pytest.approx([want_loss] * 2, rel=1e-5)
    for got, want in zip(model.parameters(), want_grads):
        torch.testing.assert_close(got.grad, want)
