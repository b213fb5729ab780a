"""Worker functions for the tests of torch.compile'd layers (run in spawned processes)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from asyncpipe import AsyncPipe


def compiled_layers(rank: int, world: int, schedules: list[str], policy: str) -> Any:
    """For each schedule in turn, in this one process, one step of 4 fresh
    ``torch.compile``'d layers (AOTAutograd, no code generation) on 2 stages: how far its loss
    and this rank's gradients are from the plain, uncompiled model's."""
    errors = {}
    for schedule in schedules:
        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4)]
        plain = nn.Sequential(*copy.deepcopy(layers))
        model = nn.Sequential(*[torch.compile(layer, backend="aot_eager") for layer in layers])
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        pipe = AsyncPipe(model, [2, 2], chunks=4, checkpoint=policy, schedule=schedule, timeout=60)
        loss = pipe.step(x, y, nn.functional.mse_loss)
        pieces = zip(x.chunk(4), y.chunk(4))
        want = sum(nn.functional.mse_loss(plain(a), b) for a, b in pieces) / 4
        want.backward()
        twin = dict(zip([id(p) for p in model.parameters()], plain.parameters()))
        worst = 0.0
        for p in pipe.parameters():
            reference = twin[id(p)].grad
            assert p.grad is not None and reference is not None
            worst = max(worst, float((p.grad - reference).abs().max()))
        errors[schedule] = (abs(loss - float(want)), worst)
    return errors
