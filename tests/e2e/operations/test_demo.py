"""C8, C9, C10, C14: `make run` and the README's quick start (a first call, its replay, another
body's 422, a retry in flight's 409, a detached payment replayed). The demo is started the way
`make run` starts it (`python -m demo.run --envoy BIN`, envoy/envoy.yaml on its fixed ports
8080, 10000 and 9901), the README's marked curl lines are run against it one by one with bash
and curl, and what each one prints is checked: the docs cannot drift from the product. Then the
whole block is pasted, as a user pastes it, into an interactive bash and an interactive zsh
(macOS's default shell, `zsh -f -i`: no `interactivecomments`, so a `#` there starts no
comment) through a pseudo-terminal, typed and as a bracketed paste, and what the terminal shows
must be what the block's steps promise. Then the demo is stopped the ways a user stops it, and
nothing it started may be left running or listening.

And a port another Envoy holds: the shipped listener does not share it (`enable_reuse_port:
false`), so a second Envoy with envoy/envoy.yaml fails to start instead of splitting the
connections (with Envoy's default reuse-port, they split), and `make run` beside another Envoy
exits at once naming the port.

These tests need ports 8080, 10000 and 9901 free: they fail (never skip) when another demo holds
them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from demo.run import quickstart_block
from harness import DEMO_PORTS as PORTS, REPO_ROOT, Demo, EnvoyStartError, free_port, listening, wait_until
from idemkit.client import request
from idemkit.envoy import Envoy
from idemkit.terminal import PASTE_MODES, SHELLS, Terminal

FILTER_CONFIG = None  # the demo runs envoy/envoy.yaml, not the harness's Envoy
README = REPO_ROOT / "README.md"


def curl_steps() -> tuple[dict[str, str], list[str]]:
    """The quick start as (variables, commands): assignments are evaluated once, as a shell
    session would, so every command sees the same key."""
    vars_: dict[str, str] = {}
    commands = []
    for line in quickstart_block(README.read_text()):
        code = line.split(" #", 1)[0].strip() if not line.startswith("#") else ""
        if not code:
            continue
        m = re.fullmatch(r"([A-Za-z_]\w*)=(\S+)", code)
        if m:
            vars_[m.group(1)] = subprocess.run(
                ["bash", "-c", "printf %s " + m.group(2)], capture_output=True, text=True, check=True
            ).stdout
        else:
            commands.append(code)
    return vars_, commands


def run(command: str, env: dict[str, str]) -> str:
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30,
                         env={**os.environ, **env}, cwd=REPO_ROOT)
    assert out.returncode == 0, (command, out.returncode, out.stderr)
    return out.stdout


def response(text: str) -> tuple[int, dict[str, str], str]:
    """curl -si output: status, headers (lowercased names), body."""
    head, _, body = text.replace("\r\n", "\n").partition("\n\n")
    lines = head.split("\n")
    status = int(lines[0].split()[1])
    headers = dict((n.strip().lower(), v.strip()) for n, _, v in (l.partition(":") for l in lines[1:]))
    return status, headers, body


def test_readme_quickstart_lines_work_against_make_run(envoy_bin):
    if shutil.which("curl") is None:
        pytest.fail("curl not found: the README's lines need it (`make e2e` installs it)", pytrace=False)
    env, commands = curl_steps()
    assert list(env) == ["K"] and len(commands) == 7, commands
    demo = Demo(envoy_bin)
    try:
        pids = demo.pids()
        # What it starts and where, and how to stop it.
        for url in ("http://127.0.0.1:8080", "http://127.0.0.1:10000", "http://127.0.0.1:9901"):
            assert url in demo.text()
        # It prints the README's lines themselves.
        assert commands[0] in demo.text()

        status, headers, first = response(run(commands[0], env))
        assert status == 201 and "idempotent-replayed" not in headers

        status, headers, replay = response(run(commands[1], env))
        assert (status, headers.get("idempotent-replayed"), replay) == (201, "true", first)

        status, headers, body = response(run(commands[2], env))
        assert status == 422 and headers["content-type"] == "application/problem+json"
        assert "payload-mismatch" in body

        out = run(commands[3], env)
        assert re.search(r"^HTTP/1\.1 409 ", out, re.M) and "request-in-flight" in out, out
        assert "slow call: 201" in out, out

        # The client gave up (curl's own timeout: no status); the root finished the payment, and
        # the retry is its replay.
        out = run(commands[4], env)
        assert "gave up: 000" in out, out
        status, headers, body = response(out[out.index("HTTP/1.1"):])
        assert (status, headers.get("idempotent-replayed")) == (201, "true"), out
        pays = subprocess.run(["curl", "-s", "localhost:8080/_admin/executions?key=%s-pay" % env["K"]],
                              capture_output=True, text=True, timeout=10).stdout
        assert '"count": 1' in pays, pays

        # The route timed out while the upstream worked; after the lease the retry's lookup
        # found the answer the upstream committed.
        out = run(commands[5], env)
        assert "timed out: 504" in out, out
        status, headers, body = response(out[out.index("HTTP/1.1"):])
        assert (status, headers.get("idempotent-reconciled"), headers.get("idempotent-replayed")) == (
            201, "true", "true"), out
        charges = subprocess.run(["curl", "-s", "localhost:8080/_admin/executions?key=%s-charge" % env["K"]],
                                 capture_output=True, text=True, timeout=10).stdout
        assert '"count": 1' in charges, charges

        series = dict(re.findall(r'^(idempotency_requests_total\{route="orders",outcome="\w+"\}) (\d+)$',
                                 run(commands[6], env), re.M))
        for outcome in ("claimed", "replayed", "mismatch", "in_flight"):
            assert int(series['idempotency_requests_total{route="orders",outcome="%s"}' % outcome]) >= 1
    finally:
        rc = demo.stop(signal.SIGINT, group=False)
    assert rc == 130, demo.text()
    demo.assert_all_gone(pids)


def pasted_responses(shown: str) -> list[tuple[int, dict[str, str], object]]:
    """Every response `curl -si` printed to the terminal, in order: status, headers (lowercased
    names), and the JSON value its body starts with. A body has no newline of its own: what
    follows it (the next prompt, the next response, a -w line) starts on its line."""
    out = []
    for m in re.finditer(r"HTTP/1\.1 (\d{3}) [^\n]*\n((?:[^\n]+\n)*)\n((?:(?!HTTP/1\.1 )[^\n])*)", shown):
        headers = dict((n.strip().lower(), v.strip()) for n, _, v in
                       (l.partition(":") for l in m.group(2).splitlines()))
        try:
            body = json.JSONDecoder().raw_decode(m.group(3))[0]
        except ValueError:
            body = None
        out.append((int(m.group(1)), headers, body))
    return out


def _need_shell(shell: str) -> None:
    for tool, target in ((SHELLS[shell][0], "make zsh"), ("curl", "make curl")):
        if shutil.which(tool) is None:
            pytest.fail("%s not found: the pasted quick start needs it (`%s`)" % (tool, target), pytrace=False)


@pytest.mark.parametrize("mode", PASTE_MODES)
@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_the_readme_quickstart_pasted_whole_into_an_interactive_shell(envoy_bin, shell, mode):
    """The README's quick-start block, as `make run` prints it, pasted whole into
    `bash --norc -i` or `zsh -f -i` in a pseudo-terminal (typed line by line, as tmux send-keys
    does, or as one bracketed paste and Enter, as a terminal pastes), against that fresh
    `make run`: each step answers what the README says it answers, each key executed once, and
    the shell reported no error."""
    _need_shell(shell)
    demo = Demo(envoy_bin)
    try:
        pids = demo.pids()
        # What is pasted: the README's block as `make run` printed it (indented), where a user
        # running it copies it from.
        block = "\n".join("  " + line if line else "" for line in quickstart_block(README.read_text()))
        assert block in demo.text(), demo.text()
        with Terminal(shell) as term:
            shown = term.paste_block(block, bracketed=mode == "bracketed", timeout=60)
            term.type('printf "K=<%s>\\n" "$K"\n')
            key = term.wait_for(r"^K=<(.*)>$", 10).group(1)
            context = "%s, %s paste; the terminal showed:\n%s" % (shell, mode, term.text())
            errors = term.errors()

        got = pasted_responses(shown)
        assert [status for status, _, _ in got] == [201, 201, 422, 409, 201, 201], context
        (first, h1, b1), (_, h2, b2), (_, h3, b3), (_, h4, b4), (_, h5, _), (_, h6, _) = got
        # 1. executed; 2. its replay, the same body; 3. another body: 422 payload-mismatch
        assert "idempotent-replayed" not in h1 and b1 and b1["path"] == "/orders", context
        assert (h2.get("idempotent-replayed"), b2) == ("true", b1), context
        assert h3["content-type"] == "application/problem+json", context
        assert b3["type"] == "urn:idempotency-filter:payload-mismatch", context
        # 4. the retry while the slow call runs: 409 request-in-flight; the slow call itself: 201
        assert b4["type"] == "urn:idempotency-filter:request-in-flight" and "retry-after" in h4, context
        assert re.findall(r"slow call: (\d{3})", shown) == ["201"], context
        # 5. the payment's client gave up (no status); its retry is the stored 201, replayed
        assert re.findall(r"gave up: (\d{3})", shown) == ["000"], context
        assert h5.get("idempotent-replayed") == "true", context
        # 6. the charge timed out (504); its retry after the lease: the committed 201, reconciled
        assert re.findall(r"timed out: (\d{3})", shown) == ["504"], context
        assert (h6.get("idempotent-reconciled"), h6.get("idempotent-replayed")) == ("true", "true"), context
        # 7. the counters, as Prometheus scrapes them
        series = dict(re.findall(r'idempotency_requests_total\{route="orders",outcome="(\w+)"\} (\d+)$',
                                 shown, re.M))
        assert {o: series.get(o) for o in ("claimed", "replayed", "mismatch", "in_flight")} == {
            "claimed": "2", "replayed": "1", "mismatch": "1", "in_flight": "1"}, context
        # Each key executed once by the upstream, and nothing else; not one shell error.
        assert re.fullmatch(r"order-\d+", key), context
        executions = request(8080, "GET", "/_admin/executions", timeout=5).json()["by_key"]
        assert executions == {key: 1, key + "-slow": 1, key + "-pay": 1, key + "-charge": 1}, (
            executions, context)
        assert not errors, context
    finally:
        rc = demo.stop(signal.SIGINT, group=False)
    assert rc == 130, demo.text()
    demo.assert_all_gone(pids)


@pytest.mark.parametrize("how", ["ctrl-c", "term", "hup"])
def test_make_run_stops_everything_it_started(envoy_bin, how):
    demo = Demo(envoy_bin)
    pids = demo.pids()
    sig, group, code = {
        "ctrl-c": (signal.SIGINT, True, 130),  # the terminal signals the runner and its children
        "term": (signal.SIGTERM, False, 143),  # kill <runner pid>: only the runner is told
        "hup": (signal.SIGHUP, False, 129),  # the terminal went away
    }[how]
    if how == "ctrl-c":
        # A second Ctrl-C while it cleans up must not leave anything behind.
        os.killpg(demo.proc.pid, sig)
        time.sleep(0.05)
    assert demo.stop(sig, group) == code, demo.text()
    demo.assert_all_gone(pids)


# ---- a port another Envoy holds ----------------------------------------------------------------

SHIPPED = REPO_ROOT / "envoy" / "envoy.yaml"


def shipped_envoy(listener_port: int, upstream_port: int, wasm, as_shipped: bool = True) -> dict:
    """envoy/envoy.yaml (what `make run` runs) with its listener on `listener_port`, Envoy's admin
    and the idempotency admin API on free ports and its cluster on `upstream_port`. `as_shipped=False`: without the listener's
    `enable_reuse_port: false`, so with Envoy's default (reuse-port on), as another Envoy's
    config would be."""
    cfg = yaml.safe_load(SHIPPED.read_text().replace("dist/idempotency_filter.wasm", str(wasm)))
    cfg["admin"]["address"]["socket_address"]["port_value"] = 0
    listener, admin_api = cfg["static_resources"]["listeners"]
    assert admin_api["name"] == "idempotency_admin", admin_api["name"]
    admin_api["address"]["socket_address"]["port_value"] = 0
    listener["address"]["socket_address"]["port_value"] = listener_port
    if not as_shipped:
        listener.pop("enable_reuse_port", None)
    (orders,) = cfg["static_resources"]["clusters"]
    orders["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"]["port_value"] = upstream_port
    return cfg


def _served(envoys: list, port: int, n: int) -> list[int]:
    """`n` requests, each on a fresh connection, to `port`: how many each Envoy took."""
    name = "http.ingress_http.downstream_rq_total"
    before = [e.counter(name, settle=False) for e in envoys]
    for i in range(n):
        assert request(port, "GET", "/served/%d" % i, timeout=10).status == 201  # the upstream executed it
    return [e.counter(name, settle=False) - b for e, b in zip(envoys, before)]


def test_shipped_listeners_do_not_reuse_the_port():
    """Every listener of every shipped Envoy config binds without reuse-port: two Envoys on one
    port do not share it."""
    for path in sorted((REPO_ROOT / "envoy").glob("*.yaml")):
        for listener in yaml.safe_load(path.read_text())["static_resources"]["listeners"]:
            assert listener.get("enable_reuse_port") is False, (path.name, listener["name"])


def test_a_second_envoy_on_the_shipped_listener_port_fails_to_start(envoy_bin, filter_wasm, upstream):
    """A second Envoy with envoy/envoy.yaml on the port the first one holds exits at start, the
    log naming the port, and the first one takes every connection. Without the listener's
    `enable_reuse_port: false` (Envoy's default), the second one starts and the connections
    split between the two: what the setting prevents."""
    port = free_port()
    first = Envoy(envoy_bin, shipped_envoy(port, upstream.port, filter_wasm), name="reuse-first",
                  log_level="warn", component_log_level=None).start()
    second = Envoy(envoy_bin, shipped_envoy(port, upstream.port, filter_wasm), name="reuse-second",
                   log_level="warn", component_log_level=None)
    try:
        with pytest.raises(EnvoyStartError):
            second.start()
        assert second.proc.returncode not in (None, 0), second.failure_report()
        assert "cannot bind '127.0.0.1:%d': Address already in use" % port in second.log_text(), (
            second.failure_report())
        assert _served([first], port, 20) == [20]
    finally:
        second.stop()
        first.stop()

    # The control: both with Envoy's default.
    port = free_port()
    envoys = [Envoy(envoy_bin, shipped_envoy(port, upstream.port, filter_wasm, as_shipped=False),
                    name="reuse-default-%d" % i, log_level="warn", component_log_level=None)
              for i in (1, 2)]
    try:
        for e in envoys:
            e.start()
        served = _served(envoys, port, 40)
        assert sum(served) == 40 and min(served) > 0, served
    finally:
        for e in envoys:
            e.stop()


def test_make_run_refuses_the_port_another_envoy_holds(envoy_bin, filter_wasm, upstream):
    """Another Envoy (with Envoy's default reuse-port) listens on :10000: `make run` does not
    start beside it, splitting the traffic, but exits at once with one line naming the port,
    having started nothing; the other Envoy keeps every connection."""
    busy = [name for name, port in PORTS.items() if listening(port)]
    if busy:
        pytest.fail("ports taken (%s): is a `make run` running?" % ", ".join(busy), pytrace=False)
    other = Envoy(envoy_bin, shipped_envoy(PORTS["Envoy"], upstream.port, filter_wasm, as_shipped=False),
                  name="other-envoy", log_level="warn", component_log_level=None).start()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "demo.run", "--envoy", str(envoy_bin)],
                                cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        try:
            wait_until(lambda: proc.poll() is not None or any("Ctrl-C here stops" in l for l in lines),
                       90, 0.1, "`make run` to exit or start")
            started = proc.poll() is None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                proc.wait(30)
            reader.join(10)
        out = "".join(lines)
        assert not started, "make run started beside the other Envoy:\n" + out
        assert proc.returncode == 1, out
        assert re.search(r"^make run: port 10000 \(Envoy's listener\) is taken", out, re.M), out
        assert "starting" not in out, out  # nothing was started
        assert not listening(PORTS["upstream"]) and not listening(PORTS["Envoy admin"]), out
        assert _served([other], PORTS["Envoy"], 20) == [20]
    finally:
        other.stop()


def runbook_block(name: str) -> list[str]:
    """The lines of docs/OPERATIONS.md's `<!-- runbook: name -->` shell block."""
    text = (REPO_ROOT / "docs" / "OPERATIONS.md").read_text()
    _, marker, rest = text.partition("<!-- runbook: %s -->" % name)
    m = re.search(r"^```sh\n(.*?)^```", rest, re.S | re.M) if marker else None
    assert m, "docs/OPERATIONS.md has no runbook block %r" % name
    return [line for line in m.group(1).splitlines() if line.strip()]


def test_the_outcome_unknown_runbook_settles_a_record_against_make_run(envoy_bin):
    # C24: the admin API on envoy/envoy.yaml's loopback listener, the runbook's lines as they are.
    lines = runbook_block("outcome_unknown")
    assert len(lines) == 7, lines
    # One bash session, as a terminal would run the block; each line's output apart.
    script = "".join("%s\nprintf '\\n@@@ %d\\n'\n" % (line, i) for i, line in enumerate(lines))
    demo = Demo(envoy_bin)
    try:
        pids = demo.pids()
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        parts = [p.strip("\n") for p in re.split(r"^@@@ \d+\n", out.stdout, flags=re.M)]
        assert len(parts) == len(lines) + 1, (out.stdout, out.stderr)
        listed, looked_up, resolved, retry = parts[2], parts[4], parts[5], parts[6]
        assert '"state":"outcome_unknown"' in listed and '"route":"orders"' in listed, listed
        assert '"tenant":"acme"' in listed and '"method":"POST"' in listed, listed
        assert listed.count('"tag"') == 1, listed
        tag = re.search(r'"tag":"([0-9a-f]{12})"', listed).group(1)
        assert '"tag":"%s"' % tag in looked_up and '"state":"outcome_unknown"' in looked_up, looked_up
        assert resolved == '{"resolved":"%s"}' % tag, resolved
        status, headers, body = response(retry)
        assert (status, headers.get("idempotent-replayed"), body) == (201, "true", '{"order": "placed"}'), retry
        key = re.search(r'"key":"(gave-up-\d+)"', listed).group(1)
        executions = subprocess.run(["curl", "-s", "localhost:8080/_admin/executions?key=" + key],
                                    capture_output=True, text=True, timeout=10).stdout
        assert '"count": 1' in executions, executions
    finally:
        demo.stop(signal.SIGINT, group=False)
    demo.assert_all_gone(pids)
