"""C8, C9, C10, C14: `make run` and the README's quick start (a first call, its replay, another
body's 422, a retry in flight's 409, a detached payment replayed). The demo is started the way
`make run` starts it (`python -m demo.run --envoy BIN`, envoy/envoy.yaml on its fixed ports
8080, 10000 and 9901), the README's marked curl lines are run against it one by one with bash
and curl, and what each one prints is checked: the docs cannot drift from the product. Then the
demo is stopped the ways a user stops it, and nothing it started may be left running or
listening.

These tests need ports 8080, 10000 and 9901 free: they fail (never skip) when another demo holds
them."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from demo.run import quickstart_block
from harness import REPO_ROOT, Demo

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
