"""Where the module's instructions go, function by function, for a new key, a replay and a
request no rule matches: `make bench-fuel-profile` (issue 49).

The module is built with its function names and instrumented by wasm-opt's `--log-execution`,
which calls an import at every function's start and loop header with a number of its own; the
emulated Envoy (tests/module-abi, `examples/fuel.rs` with FUEL_SITES) adds up the instructions
executed after each such call until the next one, and counts each step from one to the next.
This script names the numbers by the functions that hold them (`wasm-dis` output) and prints,
for each path, the functions that cost the most per request.

What it cannot do: a function's instructions after a call it makes count for the callee's last
mark until the next mark (a function start or a loop), so a caller's straight-line code after a
call is charged to the callee. Read it to find where to look; `make bench-fuel` (the module as
shipped) and `make bench-ab` (Envoy's CPU) say what a change is worth. The instrumented build
runs more instructions than the shipped one, and the order of its code differs.

    python3 -m bench.fuel_profile --wat prof.wat --sites sites.tsv [--top 25] [--write]

`--write` also puts the tables into BENCHMARKS.md's section `fuel-profile`.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import datetime
import re

from bench import REPO, sections

PATHS = ("new key", "replay", "pass")
REQUESTS = 2000  # examples/fuel.rs: N requests per path


def demangle(name: str) -> str:
    """Rust's legacy mangling (`_ZN` length-prefixed parts, a hash last) made readable; other
    names (v0 `_R...`, the allocator's) as they are."""
    m = re.fullmatch(r"_ZN(.*)E", name)
    if not m:
        return name
    rest, parts = m.group(1), []
    while rest and rest[0].isdigit():
        n = re.match(r"\d+", rest).group(0)
        rest = rest[len(n):]
        parts.append(rest[: int(n)])
        rest = rest[int(n):]
    if parts and re.fullmatch(r"h[0-9a-f]{16}", parts[-1]):
        parts.pop()
    text = "::".join(parts)
    for code, char in (("$LT$", "<"), ("$GT$", ">"), ("$RF$", "&"), ("$C$", ","), ("$u20$", " "),
                       ("$u27$", "'"), ("$u7b$", "{"), ("$u7d$", "}"), ("$BP$", "*"), ("..", "::")):
        text = text.replace(code, char)
    return text


def site_functions(wat: str) -> dict[int, str]:
    """Each `log_execution` number, by the function whose code calls it."""
    funcs = [(m.start(), m.group(1)) for m in re.finditer(r"\n\s*\(func \$(\S+)", wat)]
    starts = [f[0] for f in funcs]
    out = {}
    for m in re.finditer(r"call \$log_execution\s*\(i32\.const (\d+)\)", wat):
        i = bisect.bisect_right(starts, m.start()) - 1
        if i >= 0:
            out[int(m.group(1))] = funcs[i][1]
    return out


def profile(wat: str, sites: str) -> dict[str, collections.Counter]:
    """Instructions per request by function, for each path."""
    by_site = site_functions(wat)
    fuel: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in sites.splitlines():
        parts = line.split("\t")
        if len(parts) != 4:  # the steps from one mark to the next
            continue
        path, site, spent, _hits = parts
        fuel[path][by_site.get(int(site), "?")] += int(spent)
    return fuel


HEADING = "## The module's instructions by function"


def markdown(fuel: dict[str, collections.Counter], top: int,
             before: tuple[str, dict[str, collections.Counter]] | None = None) -> list[str]:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [HEADING, "",
           f"Measured {when} by `make bench-fuel-profile` (`bench/fuel_profile.py`): the filter built with its "
           "function names, instrumented by wasm-opt's `--log-execution`, run in the emulated Envoy of "
           "`make bench-fuel` (2,000 requests per path). Instructions per request by the function that ran "
           "them; a caller's code after a call counts for the callee until the next function start or loop, "
           "and the instrumented build runs more instructions than the shipped one (`make bench-fuel` has "
           "those). Exact and free of the machine's noise; what it is worth to Envoy is `make bench-ab`'s.", ""]
    for path in PATHS:
        c = fuel.get(path, collections.Counter())
        total = sum(c.values())
        if before is None:
            out += [f"{path}: **{total / REQUESTS:,.0f}** instructions per request", "",
                    "| instructions | share | function |", "|---:|---:|---|"]
            out += [f"| {spent / REQUESTS:,.0f} | {100 * spent / max(total, 1):.1f}% | `{demangle(name)[:100]}` |"
                    for name, spent in c.most_common(top)]
        else:
            label, then = before
            b = then.get(path, collections.Counter())
            out += [f"{path}: **{total / REQUESTS:,.0f}** instructions per request, "
                    f"{sum(b.values()) / REQUESTS:,.0f} at {label}", "",
                    f"| this build | share | at {label} | function |", "|---:|---:|---:|---|"]
            names = [n for n, _ in c.most_common(top)]
            names += [n for n, _ in b.most_common(top) if n not in names]
            out += [f"| {c[n] / REQUESTS:,.0f} | {100 * c[n] / max(total, 1):.1f}% | {b[n] / REQUESTS:,.0f} "
                    f"| `{demangle(n)[:100]}` |" for n in names]
        out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wat", required=True, help="the instrumented module as text (wasm-dis)")
    ap.add_argument("--sites", required=True, help="what examples/fuel.rs wrote with FUEL_SITES")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--write", action="store_true", help="also into BENCHMARKS.md's section fuel-profile")
    ap.add_argument("--before", nargs=3, metavar=("LABEL", "WAT", "SITES"),
                    help="an earlier build's profile beside this one's (its label, .wat and sites)")
    a = ap.parse_args(argv)
    with open(a.wat) as f:
        wat = f.read()
    with open(a.sites) as f:
        fuel = profile(wat, f.read())
    before = None
    if a.before:
        label, before_wat, before_sites = a.before
        with open(before_wat) as w, open(before_sites) as t:
            before = (label, profile(w.read(), t.read()))
    for path in PATHS:
        c = fuel.get(path, collections.Counter())
        total = sum(c.values())
        print("%s: %.0f instructions per request (instrumented build)" % (path, total / REQUESTS))
        for name, spent in c.most_common(a.top):
            print("  %8.0f %5.1f%%  %s" % (spent / REQUESTS, 100 * spent / max(total, 1), demangle(name)[:110]))
        print()
    if a.write:
        sections.update_file(REPO / "BENCHMARKS.md", "fuel-profile", "\n".join(markdown(fuel, a.top, before)) + "\n")
        print("updated BENCHMARKS.md (section fuel-profile)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
