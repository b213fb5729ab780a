"""torch.compile'd layers in a pipeline: the split backward of zero_bubble too."""

from __future__ import annotations

import pytest
import torch
from compile_workers import compiled_layers
from spawn import run_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch._dynamo.is_dynamo_supported(), reason="torch.compile is not supported here"
    ),
]


@pytest.mark.parametrize("policy", ["never", "except_last"])
def test_compiled_layers_match_the_plain_model(policy: str) -> None:
    """zero_bubble keeps each layer's graph after B for its W, and AOTAutograd's compiled
    backward (with donated buffers) may refuse that: after a 1f1b pipeline of the same layers
    in the same process, zero_bubble's step failed with torch's "requires create_graph=False
    and retain_graph=False". A layer whose backward refuses now runs its whole backward in B
    (its weight gradients then, none in W)."""
    results = run_ranks(compiled_layers, 2, ["1f1b", "zero_bubble", "gpipe"], policy, timeout=240)
    for rank, errors in enumerate(results):
        for schedule, (loss, grads) in errors.items():
            assert loss < 1e-6 and grads < 1e-6, (rank, schedule, loss, grads)
