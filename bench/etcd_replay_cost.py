"""What a replay costs on the etcd store at 1 and at 20,000 live records of its caller (issue 18,
item 8): starts one etcd member on loopback, then runs examples/etcd_replay_cost.rs (the
filter's own exchanges over a blocking client) for each build given, interleaved, and prints a
table of median microseconds per replay. Not part of `make bench`.

    make bench-etcd-replay [BENCH_BEFORE=<commit>]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess

from idemkit.etcd import Etcd


def run(binary: str, port: int, live: int, iterations: int) -> int:
    out = subprocess.run([binary, "127.0.0.1:%d" % port, str(live), str(iterations)],
                         check=True, capture_output=True, text=True).stdout
    match = re.search(r"median_us=(\d+)", out)
    if not match:
        raise RuntimeError("no median in %r" % out)
    return int(match.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", required=True, metavar="LABEL=BINARY",
                    help="a build of examples/etcd_replay_cost to measure (repeatable)")
    ap.add_argument("--live", type=int, nargs="+", default=[1, 20_000])
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    builds = [b.split("=", 1) for b in a.build]
    etcd = Etcd("bench-replay", durable=True).start()
    try:
        medians: dict[tuple[str, int], list[int]] = {}
        for _ in range(a.rounds):
            for live in a.live:
                for label, binary in builds:
                    medians.setdefault((label, live), []).append(run(binary, etcd.client_port, live, a.iterations))
    finally:
        etcd.stop()
    print("| build | " + " | ".join("%d live records" % n for n in a.live) + " |")
    print("|---|" + "---:|" * len(a.live))
    for label, _ in builds:
        cells = ["%d µs" % statistics.median(medians[(label, n)]) for n in a.live]
        print("| %s | %s |" % (label, " | ".join(cells)))
    print("(median of %d rounds of %d replays each; one etcd member on loopback)" % (a.rounds, a.iterations))


if __name__ == "__main__":
    main()
