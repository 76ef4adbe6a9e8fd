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

    python3 bench/fuel_profile.py --wat prof.wat --sites sites.tsv [--top 25]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import re

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wat", required=True, help="the instrumented module as text (wasm-dis)")
    ap.add_argument("--sites", required=True, help="what examples/fuel.rs wrote with FUEL_SITES")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    with open(a.wat) as f:
        wat = f.read()
    with open(a.sites) as f:
        fuel = profile(wat, f.read())
    for path in PATHS:
        c = fuel.get(path, collections.Counter())
        total = sum(c.values())
        print("%s: %.0f instructions per request (instrumented build)" % (path, total / REQUESTS))
        for name, spent in c.most_common(a.top):
            print("  %8.0f %5.1f%%  %s" % (spent / REQUESTS, 100 * spent / max(total, 1), demangle(name)[:110]))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
