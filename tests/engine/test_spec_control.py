"""The load-adaptive speculation controller's choice, from hand-fed observations."""

from __future__ import annotations

import pytest

from engine.spec_control import SpeculationControl


def _feed(control: SpeculationControl, steps: int, accepted_of_3: int, times: dict[int, float], batch: int = 1):
    for _ in range(steps):
        control.observe_verification(3, accepted_of_3)
    for d, t in times.items():
        control.observe_step_time(batch, d, t)


def test_optimistic_without_data():
    assert SpeculationControl(3).choose(1) == 3


def test_drafts_that_always_fail_are_not_verified():
    control = SpeculationControl(3, probe_every=1000)
    _feed(control, 50, 0, {3: 0.013})
    assert control.acceptance()[0] < 0.05
    assert control.choose(1) == 0


def test_drafts_that_always_succeed_are_all_verified_when_verification_is_cheap():
    control = SpeculationControl(3)
    _feed(control, 50, 3, {0: 0.010, 3: 0.012})
    assert control.choose(1) == 3
    assert control.expected_accepted(3) > 2.5


def test_costly_verification_at_a_large_batch_turns_speculation_down():
    """Half the first drafts are accepted (E(1) = 0.5) but at batch 256 a 1-draft step costs 1.8×."""
    control = SpeculationControl(3, probe_every=1000)
    for _ in range(100):
        control.observe_verification(3, 1 if _ % 2 else 0)
    control.observe_step_time(256, 0, 0.010)
    control.observe_step_time(256, 1, 0.018)
    control.observe_step_time(256, 3, 0.034)
    assert control.choose(256) == 0
    control.observe_step_time(1, 0, 0.010)  # at batch 1 the same drafts are nearly free
    control.observe_step_time(1, 1, 0.0105)
    assert control.choose(1) >= 1


def test_unmeasured_depths_are_interpolated_and_extrapolated():
    control = SpeculationControl(3)
    control.observe_step_time(4, 0, 0.010)
    control.observe_step_time(4, 2, 0.014)
    assert control.step_cost(4, 1) == pytest.approx(0.012)
    assert control.step_cost(4, 3) == pytest.approx(0.014 * 1.15)
    assert control.step_cost(64, 1) is None  # another batch bucket has no data


def test_probes_keep_the_rates_fresh_and_back_off():
    control = SpeculationControl(3, probe_every=4, max_probe_every=16)
    _feed(control, 50, 0, {0: 0.010, 3: 0.013})
    choices = [control.choose(1) for _ in range(60)]
    probes = [i for i, c in enumerate(choices) if c == 3]
    assert probes == [3, 11, 27, 43, 59]  # after 4, then 8, then 16 (the cap) choices below k
    assert choices.count(0) == 55
    _feed(control, 200, 3, {})  # drafts start succeeding: all k again, probe interval reset
    assert control.choose(1) == 3 and control.probe_every == 4
    with pytest.raises(ValueError):
        SpeculationControl(0)
