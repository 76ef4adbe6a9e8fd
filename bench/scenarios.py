"""The benchmark's numbered scenarios, as facts both sides of the bench need: the phases that run
them (bench/phases.py) and the report that reads them (bench/report.py, report_more.py). It
imports no other bench module, so both can import it without importing each other."""

from __future__ import annotations

# The pairs of the equal-load phase: (etcd scenario, local scenario), each pair run at one
# open-loop rate (bench/report_more.py holds issue 20's bounds on their CPU ratios).
EQUAL_LOAD_PAIRS = ((7, 4), (8, 5), (13, 5))
