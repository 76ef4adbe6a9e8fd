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


def test_the_section_names_each_pair_and_the_commit():
    import argparse

    from bench.ab import markdown
    from bench.report import AB_HEADING

    a = argparse.Namespace(before_label="cf05570", pairs=2, rounds=4, seconds=2.0, connections=8)
    r = {"before": 100.0, "after": 102.0, "ratio": ratio_summary([102.0, 101.0], [100.0, 100.0]),
         "pairs": [1.02, 1.01]}
    text = markdown({"replay": r}, a)
    assert text.startswith(AB_HEADING + "\n\n")
    assert "BENCH_BEFORE=cf05570" in text
    assert "| replay | 100.0 | 102.0 | **1.015** |" in text and "1.020, 1.010" in text
