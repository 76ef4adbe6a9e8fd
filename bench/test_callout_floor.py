"""bench/callout_floor.py's report: its verdict on issue 20's replay bound follows the run's own
numbers, and its section goes under its heading with the command that made it.
Run by `make bench-unit` (part of `make bench-smoke`, so of `make test`)."""

from __future__ import annotations

import argparse

from bench import callout_floor
from bench.report import CALLOUT_FLOOR_HEADING

SCENARIOS = {sid: (f"scenario {sid}", [], None) for sid in ("5", "8", "L", "F")}


def section(floor_us: list[float], rate: float = 200, rounds: int = 2) -> str:
    per_req = {"5": [600.0, 620.0], "8": [1200.0, 1190.0], "L": [450.0, 460.0], "F": floor_us}
    a = argparse.Namespace(rate=rate, rounds=rounds, duration=6.0)
    return callout_floor.markdown(a, SCENARIOS, per_req, 1343)


def test_a_floor_over_the_bound_says_no_one_round_trip_replay_meets_it():
    text = section([1000.0, 990.0])
    assert text.startswith(CALLOUT_FLOOR_HEADING + "\n")
    assert "is at 1.63x: so no one-round-trip replay meets the bound" in text
    assert "`make bench-callout-floor FLOOR_ARGS='--rounds 2'`" in text
    assert "| F | scenario F | 995 | **1.63x** | 1.60..1.67 |" in text


def test_a_floor_under_the_bound_says_what_a_replay_would_need_instead():
    text = section([800.0, 790.0], rate=300, rounds=6)
    assert "is at 1.30x: a replay meets the bound only if its callout (340 µs)" in text
    assert "no one-round-trip replay" not in text
    assert "`make bench-callout-floor FLOOR_ARGS='--rate 300'`" in text
