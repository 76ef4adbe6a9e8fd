"""What the report's renderers read of a computed report: `ReportData`, which bench/report.py's
`Report` meets and bench/report_more.py and bench/report_svg.py take. bench/report.py imports
both renderers, so they name this protocol rather than `Report`, and no two report modules import
each other, not even for type hints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from bench.harness import Bench


class ReportData(Protocol):
    # The run the report was computed from.
    b: Bench
    # Per scenario id: its scenario ("s") and the figures computed from its rounds.
    rows: dict[int, dict]
    # "A/B": the spread of scenario A's throughput over B's, per round.
    ratios: dict[str, dict]
    # "A/B": the spread of B's Envoy CPU per request over A's, per round (report_more.cpu_ratios).
    cpu_ratios: dict[str, dict]
