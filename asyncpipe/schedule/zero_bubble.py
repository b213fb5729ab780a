"""Zero-bubble pipeline (ZB-H1): the backward split into input and weight gradients."""

from __future__ import annotations

from .action import Action, Kind, Plan
from .generate import _check_counts

__all__: list[str] = []


def zero_bubble(stages: int, microbatches: int) -> Plan:
    """ZB-H1 plan: each backward is split into ``B`` (the gradient of the stage's input, which
    the stage upstream waits for) and ``W`` (the gradient of its weights, which nothing waits
    for), so ``W`` can be moved into the gaps where 1F1B idles. Stage ``s`` runs on rank ``s``;
    each (stage, micro-batch) has ``F``, ``B`` and ``W``, in that order.

    Construction: a step-by-step simulation with unit costs. At every step each rank runs the
    first ready action of: its next ``F``, if its input has arrived, fewer than ``stages - s``
    micro-batches await their ``B`` on it (1F1B's warm-up and steady state) and fewer than
    ``stages`` await their ``W`` (the activation bound, as :func:`simulate` counts them); else
    its oldest ``B`` whose gradient has arrived; else its oldest pending ``W``; else it idles.
    Actions finished in a step are seen in the next one. The order each rank ran its actions is
    the plan; fixed priorities make it deterministic. ``zero_bubble(3, 3)`` at unit costs (one
    column per step, ``.`` is idle)::

        rank 0: F0 F1 F2 .  .  B0 W0 B1 W1 B2 W2
        rank 1: .  F0 F1 .  B0 F2 B1 W0 B2 W1 W2
        rank 2: .  .  F0 B0 F1 B1 F2 B2 W0 W1 W2

    The later stages put their ``W`` off until the ``B`` have gone upstream, and run them in
    the cool-down, where 1F1B idles. With F = B = W = 1 the makespan is ``3 * M + S - 1`` for
    ``M >= S``, against ``3 * (M + S - 1)`` for 1F1B with the same work (F = 1, B = 2): a third
    of 1F1B's bubble, the paper's ZB-H1. Memory: every rank holds at most ``stages``
    micro-batches' activations (counted until their ``W``), 1F1B's peak, which 1F1B reaches on
    its first rank; the later ranks hold more than under 1F1B, up to that peak.

    Example:
        >>> from asyncpipe.schedule import zero_bubble, format_plan
        >>> print(format_plan(zero_bubble(2, 2)))
        rank 0: 0F0 0F1 0B0 0W0 0B1 0W1
        rank 1: 1F0 1B0 1F1 1B1 1W0 1W1

    Raises:
        ValueError: if ``stages`` or ``microbatches`` is not a positive int.
    """
    _check_counts(stages, microbatches)
    # per stage: how many forwards, backwards and weight gradients it has run
    forward = [0] * stages
    backward = [0] * stages
    weight = [0] * stages
    plan: Plan = {s: [] for s in range(stages)}
    while any(w < microbatches for w in weight):
        done_forward, done_backward = list(forward), list(backward)  # as of the step's start
        for s in range(stages):
            i = backward[s]
            if (
                forward[s] < microbatches
                and forward[s] - backward[s] < stages - s
                and forward[s] - weight[s] < stages
                and (s == 0 or done_forward[s - 1] > forward[s])
            ):
                kind, i, forward[s] = Kind.FORWARD, forward[s], forward[s] + 1
            elif i < forward[s] and (s == stages - 1 or done_backward[s + 1] > i):
                kind, backward[s] = Kind.BACKWARD, i + 1
            elif weight[s] < backward[s]:
                kind, i, weight[s] = Kind.WEIGHT, weight[s], weight[s] + 1
            else:
                continue
            plan[s].append(Action(s, kind, i))
    return plan
