"""The reference workload's pacing, on a simulated clock (no wall-clock time is asserted)."""

from __future__ import annotations

import pytest

from benchmarks.workload import Pacer


class FakeTime:
    """A clock whose sleeps overshoot by ``overshoot`` seconds and whose every reading costs
    ``tick`` seconds, and the graph task autograd would report."""

    def __init__(self, overshoot: float = 3e-4, tick: float = 0.0) -> None:
        self.now = 0.0
        self.overshoot = overshoot
        self.tick = tick
        self.task = -1
        self.slept: list[float] = []

    def clock(self) -> float:
        self.now += self.tick
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds + self.overshoot

    def pacer(self) -> Pacer:
        return Pacer(clock=self.clock, sleep=self.sleep, graph_task=lambda: self.task)


def test_the_pacer_learns_the_overshoot_of_sleep() -> None:
    fake = FakeTime(overshoot=3e-4)
    pacer = fake.pacer()
    pacer.until(0.005)
    assert fake.now == pytest.approx(0.0053)  # the first sleep overshoots in full
    for _ in range(60):
        deadline = fake.now + 0.005
        pacer.until(deadline)
    assert fake.now - deadline == pytest.approx(0.0, abs=1e-6)
    assert pacer.early == pytest.approx(3e-4, rel=1e-3)


def test_a_deadline_already_past_does_not_sleep() -> None:
    fake = FakeTime()
    pacer = fake.pacer()
    fake.now = 1.0
    pacer.until(0.5)
    assert fake.slept == []
    assert pacer.woke == 1.0


def test_a_forward_ends_f_after_its_start_once_its_tail_is_learnt() -> None:
    fake = FakeTime(overshoot=0.0)
    pacer = fake.pacer()
    tail = 2e-4  # what the forward does after its sleep
    for _ in range(80):
        start = fake.now
        pacer.forward(0.005, start)
        fake.now += tail
        pacer.learn_tail(fake.now - pacer.woke)
    assert fake.now - start == pytest.approx(0.005, abs=1e-6)


def test_backward_parts_of_one_pass_count_from_the_previous_deadline() -> None:
    fake = FakeTime(overshoot=0.0)
    pacer = fake.pacer()
    fake.task = 7
    pacer.backward(0.005, fake.now)
    first_end = fake.now
    fake.now += 1e-4  # autograd hands the gradient over
    pacer.backward(0.005, fake.now)
    assert fake.now == pytest.approx(first_end + 0.005)  # the hand-over overlapped
    # a hand-over longer than cap counts only beyond cap
    fake.now += 0.002
    begin = fake.now
    pacer.backward(0.005, begin)
    assert fake.now == pytest.approx(begin - pacer.cap + 0.005)


def test_a_new_pass_or_a_forward_between_parts_starts_afresh() -> None:
    fake = FakeTime(overshoot=0.0)
    pacer = fake.pacer()
    fake.task = 1
    pacer.backward(0.005, fake.now)
    fake.now += 1e-4
    fake.task = 2  # the next backward pass
    begin = fake.now
    pacer.backward(0.005, begin)
    assert fake.now == pytest.approx(begin + 0.005)
    pacer.learn_tail(0.0)  # a recomputed forward inside the same pass
    fake.now += 1e-4
    begin = fake.now
    pacer.backward(0.005, begin)
    assert fake.now == pytest.approx(begin + 0.005)
