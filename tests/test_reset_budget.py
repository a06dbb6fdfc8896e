"""The node's reset budget (gpud/health/reset_budget.py, issue 40): a sliding hour, drawn by health.auto_reset
and remediations, each draw saved."""

from __future__ import annotations

from gpud.health.reset_budget import ResetBudget


class Clock:
    def __init__(self, now: float = 10_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_draws_within_the_hour_then_none_until_the_oldest_leaves_it():
    clock, saved = Clock(), []
    budget = ResetBudget(2, lambda: saved.append(list(budget.times)), clock)
    assert budget.view() == {"max_per_hour": 2, "used": 0, "next_free_in_s": None}
    assert budget.draw()
    clock.now += 600
    assert budget.draw()
    assert saved == [[10_000.0], [10_000.0, 10_600.0]]  # each draw saved at once
    assert not budget.draw() and len(saved) == 2  # a refused draw changes nothing
    assert budget.view() == {"max_per_hour": 2, "used": 2, "next_free_in_s": 3000.0}
    clock.now = 10_000.0 + 3600
    assert budget.used() == 1 and budget.next_free_in_s() is None and budget.draw()


def test_a_lower_limit_than_the_times_kept_waits_for_enough_of_them_to_leave_the_hour():
    clock = Clock()
    budget = ResetBudget(1, lambda: None, clock)
    budget.times = [clock.now - 100, clock.now - 50, clock.now - 10]  # read back from a gpud allowed more
    assert budget.next_free_in_s() == 3590.0  # the newest must leave the hour: one would then be one too many
    clock.now += 3595
    assert budget.next_free_in_s() is None and budget.used() == 0
