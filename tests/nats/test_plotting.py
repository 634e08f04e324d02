"""Tick labels stay readable: distinct on a narrow range, short on an ordinary one."""

from __future__ import annotations

from nats.plotting import format_si, format_tick, tick_labels


def test_ticks_of_a_narrow_range_get_the_digits_that_tell_them_apart() -> None:
    ticks = [3.4992, 3.4994, 3.4996, 3.4998, 3.5, 3.5002]
    assert [format_tick(t) for t in ticks] == ["3.499", "3.499", "3.5", "3.5", "3.5", "3.5"]
    assert tick_labels(ticks, format_tick) == ["3.4992", "3.4994", "3.4996", "3.4998", "3.5",
                                               "3.5002"]


def test_ordinary_ticks_and_other_formats_are_left_alone() -> None:
    assert tick_labels([0, 0.5, 1.0, 1.5], format_tick) == ["0", "0.5", "1", "1.5"]
    assert tick_labels([1e3, 1e6, 1e6], format_si) == ["1K", "1M", "1M"]
