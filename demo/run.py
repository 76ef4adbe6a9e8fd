"""`make run`: the orders upstream on 127.0.0.1:8080 behind Envoy on 127.0.0.1:10000 (admin
127.0.0.1:9901, envoy/envoy.yaml), started and stopped together through the kit (idemkit/).
It says what it starts and where, then prints the README's quick-start curl lines (no comments
among them: they paste whole into an interactive bash or zsh). Envoy logs to
this terminal. Ctrl-C, SIGTERM or SIGHUP (a closed terminal) stops everything it started, also
when only this process got the signal; a second Ctrl-C does not cut that cleanup short. With
`--etcd` (`make run-etcd`) the filter keeps its records in an etcd started here on
127.0.0.1:2379 (envoy/envoy-etcd.yaml; its data directory is temporary and removed at the end).
A port something already listens on (another Envoy, a `make run` still running) stops it before
it starts anything, with one line naming the port.

    python -m demo.run --envoy BIN [--etcd] [--log-level warn] [--component-log-level wasm:info]

Run from the repository root (envoy/envoy.yaml names dist/idempotency_filter.wasm relative to it).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import sys
from pathlib import Path

from idemkit import REPO_ROOT
from idemkit.envoy import Envoy
from idemkit.etcd import Etcd
from idemkit.process import Upstream

UPSTREAM_PORT = 8080  # envoy/envoy.yaml's cluster `orders`
ETCD_PORT = 2379  # envoy/envoy-etcd.yaml's cluster `etcd`
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# The README's quick-start block: this marker, then a fenced sh block. tests/e2e/operations/test_demo.py
# runs its lines against this very demo, so what is printed here is what the README says.
QUICKSTART_MARKER = "<!-- quickstart-curl"


def quickstart_block(readme: str) -> list[str]:
    """The lines of the README's quick-start block (comments and blank lines included)."""
    _, marker, rest = readme.partition(QUICKSTART_MARKER)
    m = re.search(r"^```sh\n(.*?)^```", rest, re.S | re.M) if marker else None
    if m is None:
        raise ValueError("README.md has no %s ...> block followed by a ```sh block" % QUICKSTART_MARKER)
    return m.group(1).splitlines()


def taken(ports: dict[int, str]) -> list[str]:
    """The ports of `ports` ({port: what listens there}) that something already listens on on
    127.0.0.1, as lines to print. Bound the way Envoy binds a listener without reuse-port
    (SO_REUSEADDR, no SO_REUSEPORT): any listening socket there makes the bind fail, whether it
    reuses the port or not, and connections of an earlier run in TIME_WAIT do not."""
    out = []
    for port, what in ports.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                out.append("port %d (%s) is taken: another Envoy, or a `make run` still running? "
                           "`ss -ltnp 'sport = :%d'` shows which process holds it" % (port, what, port))
    return out


def config_ports(config: Path) -> dict[int, str]:
    """The admin port and the listeners' ports of an Envoy config written as the shipped ones are
    (`socket_address: { address: ..., port_value: N }` under `admin:` and `listeners:`)."""
    text = config.read_text()
    admin = re.search(r"^admin:\n(.*?)^\S", text, re.S | re.M)
    listeners = re.search(r"^  listeners:\n(.*?)^  clusters:", text, re.S | re.M)
    ports = {}
    for block, what in ((listeners, "Envoy's listener"), (admin, "Envoy's admin")):
        for port in re.findall(r"port_value: (\d+)", block.group(1) if block else ""):
            ports[int(port)] = what
    return ports


def say(line: str = "") -> None:
    print("make run: " + line if line else "", flush=True)


def _stop_on(signum, _frame) -> None:
    """The first stop signal ends the run through the `finally` in main; the ones after it are
    ignored from here on, so a second Ctrl-C cannot cut the cleanup short."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envoy", required=True, help="the Envoy binary")
    p.add_argument("--config", default=None,
                   help="default: envoy/envoy.yaml, or envoy/envoy-etcd.yaml with --etcd")
    p.add_argument("--etcd", action="store_true", help="start etcd on :2379 for the etcd store")
    p.add_argument("--concurrency", type=int, default=2)
    # Envoy's own startup chatter is hidden; the filter's messages (wasm) are shown.
    p.add_argument("--log-level", default="warn")
    p.add_argument("--component-log-level", default="wasm:info")
    a = p.parse_args(argv)
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_on)

    config = Path(a.config or REPO_ROOT / "envoy" / ("envoy-etcd.yaml" if a.etcd else "envoy.yaml"))
    # A port something else holds stops the run before anything starts. (The shipped listeners
    # do not reuse the port either: Envoy alone would fail to bind, not share the port.)
    ports = {UPSTREAM_PORT: "the orders upstream", **({ETCD_PORT: "etcd"} if a.etcd else {})}
    ports.update(config_ports(config) if config.is_file() else {})
    busy = taken(ports)
    if busy:
        for line in busy:
            print("make run: " + line, file=sys.stderr, flush=True)
        return 1
    upstream = Upstream("demo-upstream", port=UPSTREAM_PORT)
    etcd = Etcd("demo-etcd", client_port=ETCD_PORT, durable=True) if a.etcd else None
    envoy = Envoy(a.envoy, config, "demo", a.concurrency, a.log_level,
                  a.component_log_level, console=True)
    try:
        say("pid %d; Ctrl-C here (or kill %d) stops everything it started" % (os.getpid(), os.getpid()))
        if etcd is not None:
            say("starting etcd on 127.0.0.1:%d ..." % ETCD_PORT)
            etcd.start()
            say("  etcd        %s  pid %d  log %s (its data is removed at the end)"
                % (etcd.client_url, etcd.proc.pid, etcd.log_path))
        say("starting the orders upstream (demo/orders_upstream.py) on 127.0.0.1:%d ..." % UPSTREAM_PORT)
        upstream.start()
        say("  upstream    http://127.0.0.1:%d  pid %d  logs in %s"
            % (upstream.port, upstream.proc.pid, upstream.log_dir))
        say("starting Envoy with %s (compiles the Wasm module: a few seconds) ..." % _shown(config))
        envoy.start(timeout=60)
        say("  Envoy       http://127.0.0.1:%d  pid %d  logs to this terminal" % (envoy.port, envoy.proc.pid))
        say("  Envoy admin http://127.0.0.1:%d  (/stats/prometheus, /stats?filter=idempotency)"
            % envoy.admin_port)
        say("ready. Paste these lines into another shell, bash or zsh (README.md, Quick start, says")
        say("what each one answers):")
        say()
        print("\n".join("  " + line if line else "" for line in _quickstart()), flush=True)
        say()
        say("Ctrl-C here stops %s." % ("Envoy, the upstream and etcd" if etcd else "Envoy and the upstream"))
        return envoy.wait_exit(None) or 0
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, OSError) as exc:  # did not start (port taken, bad config, no binary)
        print("make run: %s" % exc, file=sys.stderr)
        return 1
    finally:
        # Whatever ended the run (Envoy exited, a start failed): no signal cuts the cleanup short.
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        stopped = []
        for name, proc in (("Envoy", envoy), ("upstream", upstream), ("etcd", etcd)):
            pid = proc.proc.pid if proc is not None and proc.proc is not None else None
            if proc is not None:
                proc.stop()
            if pid is not None:
                stopped.append("%s (pid %d)" % (name, pid))
        say("stopped " + (", ".join(stopped) or "nothing"))


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def _quickstart() -> list[str]:
    try:
        return quickstart_block((REPO_ROOT / "README.md").read_text())
    except (OSError, ValueError) as exc:
        return ["(no quick-start lines: %s)" % exc]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
