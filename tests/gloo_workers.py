"""Worker functions for the multi-process gloo tests (run in spawned processes)."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from models import Boxed, Unboxed, UsesAux, WithAux, mlp, reference
from torch import Tensor, nn

from asyncpipe import AsyncPipe, LazyModule, StageFailure
from asyncpipe.transport import P2PTransport

mse = nn.functional.mse_loss


def _diff(pipe: AsyncPipe, want: dict[int, Tensor], model: nn.Module) -> float:
    """Largest gradient difference of this rank's parameters against the reference."""
    ids = {id(p): n for n, p in enumerate(model.parameters())}
    worst = 0.0
    for p in pipe.parameters():
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        worst = max(worst, float((got - want[ids[id(p)]]).abs().max()))
    return worst


def _transport(name: str, device: str) -> str | P2PTransport:
    """``"p2p-ordered"``: the p2p transport as it runs over NCCL (every message sent as header
    then tensors, every receive posted only when due, a group per direction), over gloo."""
    if name != "p2p-ordered":
        return name
    return P2PTransport(device=torch.device(device), ordered=True)


def errors(
    model: nn.Module,
    balance: list[int],
    chunks: int,
    policy: str,
    schedule: str,
    virtual: int,
    rows: int,
    seed: int,
    transport: str,
    device: str = "cpu",
) -> tuple[float, float]:
    """One step of ``model`` in a pipeline on a seeded batch: how far its loss and this rank's
    gradients are from the plain model's (model, batch and stages on ``device``)."""
    torch.manual_seed(seed)
    x, y = torch.randn(rows, 8, device=device), torch.randn(rows, 8, device=device)
    model.to(device)
    want_loss, grads = reference(model, x, y, chunks, mse)
    pipe = AsyncPipe(
        model,
        balance,
        chunks=chunks,
        checkpoint=policy,
        timeout=30,
        schedule=schedule,
        virtual_stages=virtual,
        transport=_transport(transport, device),
        device=device,
    )
    first, last = pipe.is_first_stage, pipe.is_last_stage
    loss = pipe.step(x if first else None, y if last else None, mse)
    return abs(loss - want_loss), _diff(pipe, dict(enumerate(grads)), model)


def check_errors(results: list[dict[str, tuple[float, float]]]) -> None:
    """Every rank ran some checks, each within 1e-5 of the plain model (``transparency``)."""
    for rank, checks in enumerate(results):
        assert checks, rank
        for key, (loss_error, grad_error) in checks.items():
            assert loss_error < 1e-5, f"rank {rank} {key}: loss off by {loss_error}"
            assert grad_error < 1e-5, f"rank {rank} {key}: gradients off by {grad_error}"


def check_failed_constructor(results: list[tuple[str, str, int, float]], where: str) -> None:
    """The results of :func:`one_rank_cannot_build` (or its rpc twin): rank 1's constructor
    failed as ``where`` says (every rank's with ``"build-all"``) with its own error, the others
    raised a StageFailure naming it at once (not after their timeout), and a good pipeline
    built after it in the same processes matched the plain model on every rank."""
    for rank, (kind, text, culprit, loss) in enumerate(results):
        assert loss < 1e-6, (rank, loss)
        own = {
            "arguments": "chunks must be",
            "world": "balance must have one entry per pipeline rank",
            "plan": "schedule '1f1b' needs each rank to run one consecutive block",
        }
        if rank == 1 or where == "build-all":
            if where in own:
                assert kind == "ValueError" and own[where] in text, text
            else:
                assert kind == "RuntimeError" and text == "no memory left for this layer", text
            continue
        assert kind == "StageFailure" and culprit == 1, (rank, kind, text)
        assert f"rank {rank} stops too" in text and "timed out" not in text, text
        if where == "arguments":
            assert "rank 1 rejected its arguments" in text, text
        elif where in own:
            assert f"failed on rank 1 (stage 1) with ValueError: {own[where]}" in text, text
        else:
            assert "failed on rank 1 (stage 1) with RuntimeError: no memory left" in text, text


def transparency(
    rank: int,
    world: int,
    balances: list[list[int]],
    chunks_list: list[int],
    schedules: tuple[str, ...] = ("gpipe",),
    policies: tuple[str, ...] = ("always", "except_last", "never"),
    rows: int = 10,
    transport: str = "p2p",
    device: str = "cpu",
) -> Any:
    """Loss and gradient errors against the plain model for every combination given."""
    out = {}
    for schedule in schedules:
        for balance in balances:
            virtual = len(balance) // world
            for chunks in chunks_list:
                for policy in policies:
                    model = mlp(sum(balance), seed=sum(balance) + chunks)
                    key = f"{schedule}-{balance}-{chunks}-{policy}"
                    out[key] = errors(
                        model,
                        balance,
                        chunks,
                        policy,
                        schedule,
                        virtual,
                        rows,
                        7,
                        transport,
                        device,
                    )
    return out


def every_schedule(
    world: int,
    chunks: list[int],
    schedules: tuple[str, ...],
    policies: tuple[str, ...],
    interleaved: tuple[list[int], tuple[str, ...]],
    transport: str = "p2p",
) -> list[Any]:
    """``transparency`` on ``world`` ranks, one layer per stage: ``schedules`` at ``chunks``
    with ``policies``, then the interleaved schedule (two stages per rank) at the chunks and
    with the policies of ``interleaved``. Every rank's results of both runs."""
    from spawn import run_ranks

    balance = [[1] * world]
    results: list[Any] = run_ranks(
        transparency, world, balance, chunks, schedules, policies, 16, transport, timeout=240
    )
    interleaved_chunks, interleaved_policies = interleaved
    results += run_ranks(
        transparency,
        world,
        [[1] * (2 * world)],
        interleaved_chunks,
        ("interleaved",),
        interleaved_policies,
        16,
        transport,
        timeout=240,
    )
    return results


class Pair(nn.Module):
    """x -> (linear(x), integer row ids) and back: a tuple with a non-float tensor."""

    def __init__(self, join: bool) -> None:
        super().__init__()
        self.lin, self.join = nn.Linear(8, 8), join

    def forward(self, value: Any) -> Any:
        if self.join:
            a, ids = value
            return self.lin(a) * ids.float().unsqueeze(1)
        return torch.tanh(self.lin(value)), torch.arange(value.shape[0]) % 3 + 1


def features(rank: int, world: int) -> Any:
    """Tuples, LazyModule lists, reused layers, fairscale-style forward, inference."""
    out: dict[str, Any] = {}
    last = rank == world - 1
    import asyncpipe

    asyncpipe.init()  # already set up by the spawn helper: harmless
    out["init_again"] = torch.distributed.get_world_size() == world
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randn(6, 8)

    # tuples with an integer tensor across the boundary
    model = nn.Sequential(Pair(join=False), Pair(join=True))
    _, grads = reference(model, x, y, 3, mse)
    pipe = AsyncPipe(model, [1, 1], chunks=3, timeout=30)
    pipe.step(x, y, mse)
    out["tuple"] = _diff(pipe, dict(enumerate(grads)), model)

    # LazyModule list: each rank builds only its own layers
    torch.manual_seed(1)
    plain = mlp(4, seed=3)
    lazy = [LazyModule(lambda layer=layer: copy.deepcopy(layer)) for layer in plain]
    pipe = AsyncPipe(lazy, [3, 1], chunks=2, timeout=30)
    out["lazy_built"] = [m.built for m in lazy]
    want_loss, grads = reference(plain, x, y, 2, mse)
    loss = pipe.step(x, y, mse)
    mine = range(0, 3) if rank == 0 else range(3, 4)
    want = [g for n, g in enumerate(grads) if n // 2 in mine]
    got = [p.grad for p in pipe.parameters()]
    out["lazy"] = (
        abs(loss - want_loss),
        max(float((a - b).abs().max()) for a, b in zip(got, want)),
    )

    # a layer reused across stages runs on its owner
    torch.manual_seed(2)
    a, b, c = nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)
    layers = [a, b, c, a, b]
    want_loss, grads = reference(nn.Sequential(*layers), x, y, 3, mse)
    pipe = AsyncPipe(layers, [2, 3], chunks=3, timeout=30)
    loss = pipe.step(x, y, mse)
    out["reuse"] = (
        abs(loss - want_loss),
        _diff(pipe, dict(enumerate(grads)), nn.Sequential(*layers)),
    )

    # fairscale-style forward and back_helper
    model = mlp(4, seed=5)
    plain = copy.deepcopy(model)
    mse(plain(x), y).backward()
    pipe = AsyncPipe(model, [2, 2], chunks=3, timeout=30)
    output = pipe(x if rank == 0 else None)
    if last:
        mse(output, y).backward()
    else:
        pipe.back_helper(output)
    plain_grads = dict(enumerate(p.grad for p in plain.parameters()))
    out["forward"] = _diff(pipe, plain_grads, model)

    # inference under no_grad
    with torch.no_grad():
        result = pipe(x if rank == 0 else None)
        out["inference"] = float((result - plain(x)).abs().max()) if last else 0.0
    return out


def dropout(rank: int, world: int) -> Any:
    """Gradients with recompute equal those without when dropout is in the model."""
    grads = {}
    for policy in ["always", "never"]:
        torch.manual_seed(0)
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5), nn.Tanh()) for _ in range(world)]
        )
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        pipe = AsyncPipe(model, [1] * world, chunks=4, checkpoint=policy, timeout=30)
        torch.manual_seed(100 + rank)
        pipe.step(x, y, mse)
        grads[policy] = [p.grad.clone() for p in pipe.parameters()]
    return max(float((a - b).abs().max()) for a, b in zip(grads["always"], grads["never"]))


class Fail(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.lin, self.where, self.calls = nn.Linear(8, 8), where, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.where == "forward" and self.calls == 2:
            raise ValueError("injected forward failure")
        if self.where == "sleep":
            time.sleep(8)
        out = self.lin(x)
        if self.where == "backward" and self.calls == 1:
            out.register_hook(
                lambda g: (_ for _ in ()).throw(ValueError("injected backward failure"))
            )
        return out


def failure(rank: int, world: int, where: str, transport: str = "p2p") -> Any:
    """Run a step where stage 1 fails; return what each rank saw and how long it took."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), Fail(where), *[nn.Linear(8, 8) for _ in range(world - 2)]
    )
    timeout = 2.0 if where == "sleep" else 30.0
    pipe = AsyncPipe(
        model, [1] * world, chunks=4, checkpoint="never", timeout=timeout, transport=transport
    )
    began = time.monotonic()
    try:
        pipe.step(torch.randn(8, 8), torch.randn(8, 8), mse)
    except StageFailure as e:
        return ("StageFailure", str(e), e.stage, e.microbatch, e.action, time.monotonic() - began)
    except Exception as e:
        return (type(e).__name__, str(e), -1, -1, "", time.monotonic() - began)
    return ("no error", "", -1, -1, "", time.monotonic() - began)


def settle(rank: int, world: int) -> Any:
    """A settled send releases its buffers; the others wait for the flush."""
    from asyncpipe.transport import Message, P2PTransport

    transport = P2PTransport()
    big = torch.randn(64, 64)
    if rank == 0:
        for slot in range(3):
            transport.send(1, 5, Message(slot, 3, (big * slot,)))
        transport.recv(1, 6).wait(30)  # rank 1 has taken everything
        transport.settle(1, 5, 1, 30)
        left = sorted(key[2] for key in transport._pending)
        transport.flush(30)
        return left, len(transport._pending)
    got = [transport.recv(0, 5, slot).wait(30) for slot in range(3)]
    transport.send(0, 6, Message(0, 1, (torch.zeros(1),)))
    transport.flush(30)
    return [float(m.tensors[0].sum()) for m in got if m.tensors[0] is not None]


def message_sizes(rank: int, world: int) -> Any:
    """Messages of one slot, small then large then small, arrive intact; the transport packs
    (one buffer) only the small ones once it knows their size, and never grows a receive past
    its packing limit."""
    from asyncpipe.transport import Message, P2PTransport
    from asyncpipe.transport.p2p import PACK_LIMIT

    transport = P2PTransport()
    sizes = [16, 16, PACK_LIMIT, PACK_LIMIT, 16, 16]  # float32 elements: 64 B ... 1 MiB
    if rank == 0:
        for n, size in enumerate(sizes):
            transport.send(1, 7, Message(0, 1, (torch.full((size,), float(n)),)))
            transport.recv(1, 8).wait(30)  # one message in flight per slot, as in a pipeline
            transport.flush(30)
        return None
    got = []
    for _ in sizes:
        message = transport.recv(0, 7, 0).wait(30)
        tensor = message.tensors[0]
        assert tensor is not None
        got.append((tensor.numel(), float(tensor.mean())))
        transport.send(0, 8, Message(0, 1, (torch.zeros(1),)))
    transport.flush(30)
    return got, max(transport.capacity.values(), default=0)


def directions(rank: int, world: int) -> Any:
    """Two pipelines of two ranks (data parallelism) in ordered mode: each rank sends to its
    neighbour, up in the pipeline group and down in the second group, and gets the other's;
    a pipeline group smaller than the world without its second group is refused."""
    import torch.distributed as dist

    from asyncpipe.parallel import Layout, groups
    from asyncpipe.transport import Message

    layout = Layout(2, 2)
    pipeline, _, down = groups(layout, rank, True)
    try:
        P2PTransport(group=pipeline, ordered=True)
        refused = ""
    except ValueError as e:
        refused = str(e)
    transport = P2PTransport(group=pipeline, ordered=True, down_group=down)
    me, peer = transport.rank, 1 - transport.rank
    pending = transport.recv(peer, 3)
    transport.send(peer, 3, Message(0, 1, (torch.full((2, 3), float(rank)),)))
    got = pending.wait(30).tensors[0]
    transport.flush(30)
    assert got is not None
    return {
        "got": got.tolist(),
        "groups": [dist.get_process_group_ranks(g) for g in (pipeline, down) if g is not None],
        "distinct": transport.group_to(peer) is not transport.group_from(peer),
        "me": me,
        "refused": refused,
    }


def packed_reuse(rank: int, world: int) -> Any:
    """Three rounds of 8 packed messages from rank 0 to rank 1 (one per slot), with a flush
    after each: from the second round on, rank 0 packs into the buffers of the sends the
    previous flush completed, and rank 1 must still get every round's own values."""
    from asyncpipe.transport import Message

    transport = P2PTransport()
    shape, spares, got = (4, 256), [], []
    for round_ in range(3):
        if rank == 0:
            for slot in range(8):
                value = torch.full(shape, float(100 * round_ + slot))
                transport.send(1, 5, Message(slot, 8, (value,)))
            spares.append(sum(len(s) for s in transport._spare.values()))
            transport.flush(30)
            spares.append(sum(len(s) for s in transport._spare.values()))
        else:
            for slot in range(8):
                message = transport.recv(0, 5, slot).wait(30)
                tensor = message.tensors[0]
                assert tensor is not None
                got.append(sorted(set(tensor.flatten().tolist())))
        torch.distributed.barrier()
    return {"spares": spares, "got": got}


def varying_shapes(rank: int, world: int) -> Any:
    """1,100 packed messages of as many shapes (a model whose shapes vary from step to step)
    from rank 0 to rank 1, with the spare buffers capped at 4 MiB: rank 1 gets each as sent,
    rank 0's spare buffers stay under the cap and its layouts under ``KINDS``."""
    from asyncpipe.transport import Message, p2p
    from asyncpipe.transport.frame import PACK_LIMIT

    p2p._SPARE_BYTES = 2**22
    transport = P2PTransport()
    spare, layouts, got = [], [], []
    large = torch.zeros(PACK_LIMIT // 4 - 64)  # the slot's first message: later ones fit packed
    shapes = [(1, 32768 + 16 * k) for k in range(1100)]  # 128 to 197 KiB
    if rank == 0:
        transport.send(1, 5, Message(0, 1, (large,)))
        for k, shape in enumerate(shapes):
            transport.send(1, 5, Message(0, 1, (torch.full(shape, float(k)),)))
            if k % 10 == 9:
                transport.flush(30)
                sizes = sum(b.numel() for v in transport._spare.values() for b in v)
                spare.append((sizes, transport._spare_bytes))
                layouts.append(len(transport._layouts))
        transport.flush(30)
    else:
        transport.recv(0, 5, 0).wait(30)
        for k, shape in enumerate(shapes):
            tensor = transport.recv(0, 5, 0).wait(30).tensors[0]
            assert tensor is not None
            if tuple(tensor.shape) != shape or bool((tensor != k).any()):
                got.append(k)
    return {"spare": spare, "layouts": layouts, "wrong": got}


def expected_headers(rank: int, world: int) -> Any:
    """Messages of one channel, one per slot, over three rounds: the first teaches each slot
    its size, the second comes packed (the receiver learns the channel's header), and in the
    third the receiver takes the messages that match it without decoding: the others (another
    shape, requires_grad or dtype, a missing tensor, an error notice) must still arrive as
    sent."""
    from asyncpipe.transport import Message

    transport = P2PTransport()
    third: list[Message] = [
        Message(0, 8, (torch.full((4, 16), 0.0, requires_grad=True), torch.ones(3))),
        Message(1, 8, (torch.full((4, 16), 1.0, requires_grad=True), torch.ones(3))),
        Message(2, 8, (torch.full((2, 16), 2.0, requires_grad=True), torch.ones(3))),
        Message(3, 8, (torch.full((4, 16), 3.0), torch.ones(3))),
        Message(4, 8, (torch.full((4, 16), 4.0, dtype=torch.float64), torch.ones(3))),
        Message(5, 8, (None, torch.ones(3))),
        Message(6, 8, (), error="stage 0 failed in 0F6"),
        Message(7, 9, (None, torch.full((3,), 7.0))),
    ]
    got: list[Any] = []
    for round_ in range(3):
        for slot in range(8):
            if rank == 0:
                value = torch.full((4, 16), float(slot), requires_grad=True)
                message = Message(slot, 8, (value, torch.ones(3)))
                transport.send(1, 5, third[slot] if round_ == 2 else message)
                continue
            pending = transport.recv(0, 5, slot)
            predicted = pending.expected is not None
            message = pending.wait(30)
            fast = bool(pending.views) and message.tensors is pending.views
            if round_ < 2:
                continue
            tensors = [
                None if t is None else (t.dtype, tuple(t.shape), t.requires_grad, t.sum().item())
                for t in message.tensors
            ]
            got.append((message.microbatch, message.microbatches, message.error, tensors))
            got.append((predicted, fast))
        transport.flush(30)
        torch.distributed.barrier()
    return got


def early_tensors(rank: int, world: int) -> Any:
    """Large messages of four slots over five rounds, each round's receives posted at once:
    the first teaches each slot its sizes; later ones have their tensors' receives posted
    before their header comes (two at a time), and take the tensors there when they fit the
    slot's last sizes, or stand-ins and the tensors the long way when they do not (larger, more
    tensors, packed). One receive is waited on out of turn. Every message must arrive as
    sent."""
    from asyncpipe.transport import Message
    from asyncpipe.transport.p2p import PACK_LIMIT

    big, small = PACK_LIMIT // 2, 16  # float32 elements: 512 KiB (goes separate) and 64 B
    f64 = torch.float64

    def message(round_: int, slot: int) -> Message:
        value = float(10 * round_ + slot)
        shapes: dict[tuple[int, int], list[tuple[int, torch.dtype]]] = {
            (2, 0): [(big // 2, torch.float32)],  # smaller (still separate): fits
            (2, 1): [(2 * big, torch.float32)],  # larger: does not fit
            (2, 2): [(small, torch.float32)],  # small: goes packed
            (2, 3): [(big, torch.float32), (small, torch.float32)],  # one tensor more
            (3, 1): [(big // 2, f64)],  # another dtype, fits slot 1's last sizes
            (4, 0): [],  # an error notice
        }
        if (round_, slot) == (4, 0):
            return Message(slot, 4, (), error="stage 0 failed in 0F0")
        return Message(
            slot,
            4,
            tuple(
                torch.full((n,), value + k, dtype=dtype, requires_grad=k == 0)
                for k, (n, dtype) in enumerate(shapes.get((round_, slot), [(big, torch.float32)]))
            ),
        )

    transport = P2PTransport()
    got: list[Any] = []
    for round_ in range(5):
        slots = [0] if round_ == 4 else list(range(4))
        if rank == 0:
            for slot in slots:
                transport.send(1, 5, message(round_, slot))
            transport.flush(30)
            torch.distributed.barrier()
            continue
        pending = {slot: transport.recv(0, 5, slot) for slot in slots}
        posted = [pending[s].early is not None for s in slots]  # before any wait
        order = [2, 0, 1, 3] if round_ == 1 else slots  # slot 2 out of turn
        for slot in order:
            receive = pending[slot]
            had_record = receive.record is not None
            received = receive.wait(30)
            early = receive.early
            sent = message(round_, slot)
            same = received.error == sent.error and len(received.tensors) == len(sent.tensors)
            for a, b in zip(received.tensors, sent.tensors):
                assert a is not None and b is not None
                same = same and a.dtype == b.dtype and a.requires_grad == b.requires_grad
                same = same and torch.equal(a.detach(), b.detach())
            into_early = bool(received.tensors) and early is not None
            into_early = into_early and received.tensors[0].untyped_storage().data_ptr() == (
                early[0].untyped_storage().data_ptr()
            )
            got.append((round_, slot, same, had_record, into_early))
        got.append((round_, "posted before any wait", posted))
        torch.distributed.barrier()
    return got


def large_steps(rank: int, world: int, schedules: tuple[str, ...]) -> Any:
    """Several steps of every schedule with activations and gradients of 320 to 400 KiB per
    micro-batch (each travels as a header and then its tensor; from the second step on into
    buffers posted before the header, or, where a step's micro-batches are larger than the
    last one's, the long way): loss and gradient errors against the plain model per step."""
    out: dict[str, list[tuple[float, float]]] = {}
    for schedule in schedules:
        virtual = 2 if schedule == "interleaved" else 1
        model = mlp(2 * world, width=512, seed=3)
        pipe = AsyncPipe(
            model,
            [2 // virtual] * (world * virtual),
            chunks=4,
            timeout=30,
            schedule=schedule,
            virtual_stages=virtual,
        )
        first, last = pipe.is_first_stage, pipe.is_last_stage
        out[schedule] = []
        for step, rows in enumerate([160, 160, 200, 160]):  # rows per micro-batch
            torch.manual_seed(100 + step)
            x, y = torch.randn(4 * rows, 512), torch.randn(4 * rows, 512)
            want_loss, grads = reference(model, x, y, 4, mse)
            for p in pipe.parameters():
                p.grad = None
            loss = pipe.step(x if first else None, y if last else None, mse)
            worst = _diff(pipe, dict(enumerate(grads)), model)
            out[schedule].append((abs(loss - want_loss), worst))
        transport = pipe.transport
        assert isinstance(transport, P2PTransport)
        out[schedule].append((float(len(transport.records)), 0.0))  # slots that post early
    return out


def one_tuples(rank: int, world: int, transport: str = "p2p") -> Any:
    """Layers that pass tuples of one tensor (and one that takes the input as such a tuple, and
    a last one that gives ``loss_fn`` such a tuple) across stage boundaries, under several
    schedules and checkpoint policies: how far loss, gradients and inference are from the plain
    model, which hands each layer what the one before returned."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randn(6, 8)

    def loss_fn(out: tuple[Tensor], target: Tensor) -> Tensor:
        return mse(out[0], target)

    out: dict[str, tuple[float, float, float]] = {}
    cases = [
        ("gpipe", "never", [2, 2]),
        ("1f1b", "always", [2, 2]),
        ("zero_bubble", "except_last", [2, 2]),
        ("interleaved", "always", [1] * 2 * world),
    ]
    for schedule, policy, balance in cases:
        torch.manual_seed(1)
        model = nn.Sequential(*[Unboxed() if n % 2 == 0 else Boxed() for n in range(sum(balance))])
        plain = copy.deepcopy(model)
        want_loss = 0.0
        for px, py in zip(x.chunk(2), y.chunk(2)):
            loss = loss_fn(plain((px,)), py) / 2
            loss.backward()
            want_loss += float(loss.detach())
        grads = dict(enumerate(p.grad for p in plain.parameters()))
        virtual = len(balance) // world
        pipe = AsyncPipe(
            model,
            balance,
            chunks=2,
            checkpoint=policy,
            schedule=schedule,
            virtual_stages=virtual,
            transport=transport,
            timeout=30,
        )
        loss = pipe.step((x,), y, loss_fn)
        pipe.eval()
        with torch.no_grad():
            result = pipe((x,))
            want = plain((x,))
        inference = 0.0
        if pipe.is_last_stage:
            assert isinstance(result, tuple) and len(result) == 1, type(result)
            inference = float((result[0] - want[0]).abs().max())
        out[f"{schedule}-{policy}"] = (abs(loss - want_loss), _diff(pipe, grads, model), inference)
    return out


def scalar_boundary(rank: int, world: int) -> Any:
    """``pipe(input)`` (training, then inference) where a stage's output holds a tensor without
    dimensions: the stage before the last gets its outputs with that tensor stacked, one entry
    per micro-batch; gradients and inference match the plain model run per micro-batch."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    model = nn.Sequential(WithAux(), UsesAux())
    plain = copy.deepcopy(model)
    mse(torch.cat([plain(piece) for piece in x.chunk(2)]), y).backward()
    pipe = AsyncPipe(model, [1, 1], chunks=2, timeout=30)
    out: dict[str, Any] = {}
    output = pipe(x)
    if pipe.is_last_stage:
        mse(output, y).backward()
    else:
        pipe.back_helper(output)
        out["local"] = [tuple(t.shape) for t in output]
    out["grads"] = _diff(pipe, dict(enumerate(p.grad for p in plain.parameters())), model)
    pipe.eval()
    with torch.no_grad():
        result = pipe(x)
        want = torch.cat([plain(piece) for piece in x.chunk(2)])
    out["inference"] = float((result - want).abs().max()) if pipe.is_last_stage else 0.0
    return out


def no_memory() -> nn.Module:
    """A layer whose real build fails (as out of memory would); its description on the meta
    device, which every rank builds to read skip declarations, does not."""
    if torch.empty(0).device.type != "meta":
        raise RuntimeError("no memory left for this layer")
    return nn.Linear(4, 4)


def one_rank_cannot_build(rank: int, world: int, where: str, transport: str = "p2p") -> Any:
    """Build a pipeline whose constructor fails on rank 1 only: ``"arguments"``, a bad chunks
    there (rejected before connecting); ``"build"``, its LazyModule's factory raises (after
    connecting); ``"build-all"``, every rank's does; ``"world"``, a balance with an entry
    more than the world has ranks; ``"plan"``, schedule '1f1b' with a layer reused on two
    stages (both found after connecting). Then build a good pipeline in the same processes and
    run a step. ``transport`` as :func:`_transport` takes it. Returns (error type, text, the
    error's rank or -1, the good step's loss minus the plain model's)."""
    layers: list[nn.Module | LazyModule] = [nn.Linear(4, 4) for _ in range(world)]
    balance, schedule = [1] * world, "gpipe"
    if where == "build":
        layers[1] = LazyModule(no_memory)
    if where == "build-all":
        layers = [LazyModule(no_memory) for _ in range(world)]
    if where == "world" and rank == 1:
        layers, balance = layers + [nn.Linear(4, 4)], balance + [1]
    if where == "plan" and rank == 1:  # the last stage runs a layer of the first again
        layers, balance, schedule = layers + [layers[0]], [1] * (world - 1) + [2], "1f1b"
    chunks = 0 if where == "arguments" and rank == 1 else 2
    try:
        pipe = _transport(transport, "cpu")
        AsyncPipe(layers, balance, chunks=chunks, timeout=60, transport=pipe, schedule=schedule)
        seen: tuple[str, str, int] = ("no error", "", -1)
    except StageFailure as e:
        seen = ("StageFailure", str(e), e.rank)
    except Exception as e:
        seen = (type(e).__name__, str(e), -1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(world)])
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    plain = float(mse(copy.deepcopy(model)(x), y))
    good = AsyncPipe(
        model, [1] * world, chunks=2, timeout=60, transport=_transport(transport, "cpu")
    )
    return (*seen, abs(good.step(x, y, mse) - plain))


class _Split(nn.Module):
    """Two tensors from one: they cross the stage boundary in one message."""

    def __init__(self) -> None:
        super().__init__()
        self.h, self.m = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.h(x), self.m(x)


class _SinOfSecond(nn.Module):
    """Keeps ``m`` for its backward (sin saves its input) and passes ``h`` on."""

    def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        h, m = pair
        return h, m.sin()


class _ReluFirstInPlace(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        h, s = pair
        return h.relu_() + s


def in_place_sibling(rank: int, world: int, transport: str) -> Any:
    """A stage that changes one tensor of a received message in place after a layer kept the
    other for its backward (each received into the same buffer): loss and gradient errors
    against the plain model. A message's tensors shared one version counter, so autograd
    refused that backward."""
    torch.manual_seed(0)
    model = nn.Sequential(_Split(), _SinOfSecond(), _ReluFirstInPlace(), nn.Linear(8, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    want_loss, want = reference(model, x, y, 4, mse)
    grads = dict(enumerate(want))
    pipe = AsyncPipe(model, [1, 3], chunks=4, checkpoint="never", transport=transport, timeout=30)
    loss = pipe.step(x, y, mse)
    return abs(loss - want_loss), _diff(pipe, grads, model)


class _LazyViews(nn.Module):
    """A lazily conjugated complex tensor and a lazily negated real one: neither's memory
    holds the values it reads as."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return torch.complex(x, 2 * x).conj(), torch._neg_view(3 * x)


class _FromLazyViews(nn.Module):
    """Reads the complex input through ``conj()``: its gradient by ``autograd.grad`` (zero
    bubble's B) is a lazily conjugated tensor too."""

    def forward(self, value: tuple[Tensor, Tensor]) -> Tensor:
        z, n = value
        w = z.conj()
        return w.real + 0.5 * w.imag + n


def lazy_views(rank: int, world: int, schedules: tuple[str, ...], transport: str = "p2p") -> Any:
    """Stage outputs (and gradients) that are lazily conjugated or negated views, over
    ``transport``:
    small messages (separate at first, then packed) and large ones (over ``PACK_LIMIT``),
    training steps and inference. The error against the plain model of each, by case."""
    width, out = 1024, {}
    for schedule in schedules:
        for rows in (4, 64):  # 2 micro-batches of 2 rows: 24 KiB; of 32 rows: 384 KiB
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(width, width), _LazyViews(), _FromLazyViews())
            x, y = torch.randn(rows, width), torch.randn(rows, width)
            plain = copy.deepcopy(model)  # for the inference below
            want_loss, want = reference(model, x, y, 2, mse)
            grads = dict(enumerate(want))
            pipe = AsyncPipe(
                model, [2, 1], chunks=2, schedule=schedule, timeout=30, transport=transport
            )
            for step in range(2):  # a slot's first message goes separate, the next packed
                pipe.zero_grad()
                loss = pipe.step(x if rank == 0 else None, y, mse)
                error = abs(loss - want_loss) if pipe.is_last_stage else 0.0
                out[f"{schedule}-{rows}-{step}"] = max(error, _diff(pipe, grads, model))
            pipe.eval()
            for step in range(2):
                with torch.no_grad():
                    got = pipe(x if rank == 0 else None)
                    error = float((got - plain(x)).abs().max()) if pipe.is_last_stage else 0.0
                out[f"{schedule}-{rows}-inference{step}"] = error
    return out


def as_saved_before(directory: str, into: str, drop: str) -> None:
    """Copy the checkpoint in ``directory`` into ``into`` as the versions that stored a tied
    weight's optimizer state under its first position's name only wrote it: without the
    state (and group entry) named ``drop``."""
    import os
    import shutil

    shutil.copytree(directory, into)
    for name in os.listdir(into):
        if name.endswith(".pt"):
            content = torch.load(os.path.join(into, name), weights_only=False)
            if content["optimizer"] is not None and drop in content["optimizer"]["state"]:
                del content["optimizer"]["state"][drop]
                for group in content["optimizer"]["param_groups"]:
                    group["params"] = [p for p in group["params"] if p != drop]
                torch.save(content, os.path.join(into, name))


def _tied_net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    net[3].weight = net[1].weight
    return net


def _tied_batch(step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator)


def tied_reshard(rank: int, world: int, path: str) -> Any:
    """A weight tied (shared_weights) between positions 1 and 3, trained with Adam on balance
    [1, 3] (both copies on rank 1) and saved, then loaded onto [2, 2] (one copy per rank): as
    saved, and as older versions saved it (under "1.weight" only). Returns the losses of the
    steps after the save in each run, and for each load whether every parameter got optimizer
    state and the loaded weights."""
    import torch.distributed as dist

    from asyncpipe import checkpoint

    shared = [("1.weight", "3.weight")]
    pipe = AsyncPipe(_tied_net(0), [1, 3], chunks=2, timeout=30, shared_weights=shared)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.05)
    for step in range(2):
        pipe.step(*_tied_batch(step), mse, optimizer=opt)
    checkpoint.save(pipe, opt, f"{path}/new", step=2)
    out: dict[str, Any] = {"saved": {k: v.clone() for k, v in pipe.state_dict().items()}}
    out["ref"] = [pipe.step(*_tied_batch(step), mse, optimizer=opt) for step in range(2, 5)]
    if rank == 0:
        as_saved_before(f"{path}/new", f"{path}/old", drop="3.weight")
    dist.barrier()
    for name in ("new", "old"):
        pipe = AsyncPipe(_tied_net(1), [2, 2], chunks=2, timeout=30, shared_weights=shared)
        opt = torch.optim.Adam(pipe.parameters(), lr=0.05)
        checkpoint.load(pipe, opt, f"{path}/{name}")
        loaded = {k: v.clone() for k, v in pipe.state_dict().items()}
        stated = all(p in opt.state for p in pipe.parameters())
        losses = [pipe.step(*_tied_batch(step), mse, optimizer=opt) for step in range(2, 5)]
        out[name] = (losses, stated, loaded)
    return out


def tied_lm(seed: int) -> nn.Module:
    """A cut language model whose head is tied to its embedding, sequentialized (5 positions:
    tok.weight at 0, head.weight at 4), the same in every process."""
    from cut_models import TiedLM

    from asyncpipe import sequentialize

    torch.manual_seed(seed)
    return sequentialize(TiedLM(), torch.randint(0, 11, (2, 6)))


def tied_lm_batch(step: int) -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, 11, (8, 6), generator=torch.Generator().manual_seed(step))
    return ids, ids.roll(1, 1)


def tied_lm_resume(rank: int, world: int, path: str) -> Any:
    """Load the checkpoints ``new`` and ``old`` in ``path`` (of :func:`tied_lm`, saved on one
    stage) onto balance [2, 3] with the tie named by its original names, and train 3 steps:
    for each, the losses and whether every parameter got optimizer state."""
    from cut_models import lm_loss

    from asyncpipe import checkpoint

    out = {}
    for name in ("new", "old"):
        pipe = AsyncPipe(
            tied_lm(1), [2, 3], chunks=2, timeout=30, shared_weights=[("tok.weight", "head.weight")]
        )
        opt = torch.optim.Adam(pipe.parameters(), lr=0.05)
        checkpoint.load(pipe, opt, f"{path}/{name}")
        stated = all(p in opt.state for p in pipe.parameters())
        losses = [pipe.step(*tied_lm_batch(step), lm_loss, optimizer=opt) for step in range(2, 5)]
        out[name] = (losses, stated)
    return out


def two_pipelines(rank: int, world: int, transport: str = "p2p") -> Any:
    """Two pipelines on one process group (``transport`` by name). A pipeline that rank 0
    numbers otherwise than rank 1 (as if rank 0 had built one more before) is refused on every
    rank; stepped in the same order everywhere, both pipelines train like their plain models;
    rank 0 stepping A while rank 1 steps B, then each the other, fails on every rank (before,
    each pipeline took the other's messages: all four steps ran, mixing the two models)."""
    import weakref

    import torch.distributed as dist

    import asyncpipe
    from asyncpipe import parallel

    if transport == "rpc":
        asyncpipe.init(rpc=True)
    out: dict[str, Any] = {}
    try:
        models = {"A": mlp(4, 8, seed=1), "B": mlp(4, 8, seed=2)}
        saved = list(parallel._BUILT)
        if rank == 0:
            parallel._BUILT[:] = [weakref.ref(dist.group.WORLD), parallel.built_before() + 1]
        try:
            AsyncPipe(models["A"], [2, 2], chunks=2, timeout=10, transport=transport)
            out["numbered apart"] = "built"
        except ValueError as e:
            out["numbered apart"] = str(e)
        parallel._BUILT[:] = saved
        pipes = {
            name: AsyncPipe(model, [2, 2], chunks=2, timeout=3, transport=transport)
            for name, model in models.items()
        }
        torch.manual_seed(5)
        x, y = torch.randn(4, 8), torch.randn(4, 8)
        for name in "AB":  # the same order on every rank
            want_loss, want = reference(models[name], x, y, 2, mse)
            loss = pipes[name].step(x, y, mse)
            out[name] = (
                abs(loss - want_loss),
                _diff(pipes[name], dict(enumerate(want)), models[name]),
            )
        crossed = []
        for name in "AB" if rank == 0 else "BA":
            try:
                crossed.append(("no error", pipes[name].step(x, y, mse)))
            except Exception as e:
                crossed.append((type(e).__name__, str(e)))
        out["crossed"] = crossed
        return out
    finally:
        if transport == "rpc":
            asyncpipe.shutdown()


def check_two_pipelines(results: list[dict[str, Any]]) -> None:
    """See :func:`two_pipelines`."""
    for rank, out in enumerate(results):
        assert "built different numbers of pipelines before this one" in out["numbered apart"]
        assert "rank 0: 1, rank 1: 0" in out["numbered apart"], out["numbered apart"]
        for name in "AB":
            loss_error, grad_error = out[name]
            assert loss_error < 1e-6 and grad_error < 1e-6, (rank, name, out[name])
        first, second = out["crossed"]
        assert first[0] == "StageFailure", (rank, first)  # on every rank, naming the peer
        assert f"rank {1 - rank} (stage {1 - rank})" in first[1], (rank, first)
        assert second[0] != "no error", (rank, second)
    # at least the rank that waited first says so (over gloo its timeout closes the pair, which
    # the other sees as a lost connection)
    assert any("sent nothing" in out["crossed"][0][1] for out in results), results


def closed_down_group(rank: int, world: int) -> dict[str, Any]:
    """An ordered transport over the world creates its own down group and close() destroys
    it; a down group passed in stays the caller's. Returns whether each group still works."""
    import gc

    import torch.distributed as dist

    from asyncpipe.transport import Message

    def used(transport: P2PTransport) -> list[float]:
        peer = 1 - transport.rank
        pending = transport.recv(peer, 3)
        transport.send(peer, 3, Message(0, 1, (torch.full((2,), float(rank)),)))
        got = pending.wait(30).tensors[0]
        transport.flush(30)
        assert got is not None
        return got.tolist()

    made = P2PTransport(ordered=True)
    got = used(made)
    own = made.down_group
    made.close()
    del own
    gc.collect()
    try:
        destroyed = f"still there: {made.down_group}"
    except RuntimeError as e:
        destroyed = str(e)
    given = dist.new_group([0, 1])
    kept = P2PTransport(ordered=True, down_group=given)
    got_kept = used(kept)
    kept.close()
    return {
        "got": got,
        "destroyed": destroyed,
        "kept": got_kept,
        "given_alive": dist.get_process_group_ranks(given) == [0, 1],
        "after": used(P2PTransport(ordered=True, down_group=given)),
    }
