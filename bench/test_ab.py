"""bench/ab.py's arithmetic (make bench-unit)."""

from bench.ab import ratio_summary


def test_ratios_pair_rounds_in_order():
    q = ratio_summary([110.0, 90.0, 100.0], [100.0, 100.0, 100.0])
    assert q["median"] == 1.0
    assert abs(q["mean"] - 1.0) < 1e-9
    assert q["n"] == 3 and q["sd"] > 0.09


def test_no_rounds_is_not_a_ratio():
    q = ratio_summary([], [])
    assert q["n"] == 0 and q["median"] != q["median"]
