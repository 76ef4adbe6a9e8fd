"""deploy/compose/docker-compose.yaml without a Docker engine: the file is valid, its images are
pinned to what the tests run, everything it mounts exists, its Envoy config is envoy/envoy-etcd.yaml
with compose addresses (and passes `envoy --mode validate`), and that config run for real, twice,
against one real etcd and the demo upstream, runs the curl lines of docs/DEPLOYMENT.md: a call on replica A is
replayed on replica B."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import urllib.parse
from pathlib import Path, PurePosixPath

import pytest

from conftest import envoy_validate
from idemkit import REPO_ROOT
from idemkit.client import Response, request
from idemkit.envoy import Envoy
from idemkit.etcd import Etcd, etcd_binary
from idemkit.process import ClosedPort, Upstream
from manifests import COMPOSE_FILE, envoy_version, load, walk

COMPOSE_DIR = COMPOSE_FILE.parent
ENVOY_SERVICES = ("envoy-a", "envoy-b")


@pytest.fixture(scope="module")
def compose() -> dict:
    return load(COMPOSE_FILE)


def _mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each volume, short or long syntax."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            assert v["type"] in ("bind", "volume"), v
            out.append((v["source"], v["target"]))
            continue
        parts = v.split(":")
        assert len(parts) in (2, 3), v
        out.append((parts[0], parts[1]))
    return out


def _bind_source(src: str) -> Path | None:
    """The repository path of a bind mount, None for a named volume."""
    if not src.startswith((".", "/")):
        return None
    assert not src.startswith("/"), "absolute host path in the compose file: %s" % src
    return (COMPOSE_DIR / src).resolve()


def _envoy_config_source(service: dict) -> Path:
    cmd = service["command"]
    target = cmd[cmd.index("-c") + 1]
    sources = [_bind_source(s) for s, t in _mounts(service) if t == target]
    assert len(sources) == 1 and sources[0] is not None, "%s is not bind-mounted" % target
    return sources[0]


def test_services(compose):
    assert set(compose["services"]) == {"etcd", "orders", *ENVOY_SERVICES}
    for name, svc in compose["services"].items():
        assert svc.get("image"), name
    # Two replicas on their own host ports, loopback only.
    published = [p for name in ENVOY_SERVICES for p in compose["services"][name]["ports"]]
    assert len(set(published)) == len(published)
    assert all(p.startswith("127.0.0.1:") for p in published), published
    listener_ports = {name: [p for p in compose["services"][name]["ports"] if p.endswith(":10000")]
                      for name in ENVOY_SERVICES}
    assert all(len(v) == 1 for v in listener_ports.values()), listener_ports


def current_etcd() -> str:
    """The current etcd release `make etcd-current` unpacks (the compose file's)."""
    current = os.environ.get("ETCD_CURRENT_BIN") or str(REPO_ROOT / ".tools" / "etcd-3.5.16" / "usr" / "bin" / "etcd")
    if not os.access(current, os.X_OK):
        pytest.fail("no current etcd at %s: run `make etcd-current`" % current, pytrace=False)
    return current


def test_images_are_pinned_to_what_the_tests_run(compose):
    services = compose["services"]
    for name in ENVOY_SERVICES:
        assert services[name]["image"] == "envoyproxy/envoy:v" + envoy_version()
    # etcd: a current release from etcd's own multi-arch image (amd64, arm64, ppc64le, s390x),
    # the version the store's conformance also runs against (make etcd-current, next to Debian
    # stable's etcd that every other etcd test uses).
    out = subprocess.run([current_etcd(), "--version"], capture_output=True, text=True, timeout=30)
    m = re.search(r"etcd Version: (\S+)", out.stdout)
    assert m, out.stdout + out.stderr
    assert services["etcd"]["image"] == "gcr.io/etcd-development/etcd:v" + m.group(1), services["etcd"]["image"]
    # The file's own header names that release and where the tests get it.
    header = COMPOSE_FILE.read_text().split("\nname:", 1)[0]
    assert "# %s, the current release" % m.group(1) in header and "(`make etcd-current`;" in header, header
    debian = subprocess.run([str(etcd_binary()), "--version"], capture_output=True, text=True, timeout=30)
    assert m.group(1) != re.search(r"etcd Version: (\S+)", debian.stdout).group(1), "the same etcd twice"
    # The upstream image: an exact release, not a moving tag.
    assert re.fullmatch(r"python:3\.\d+\.\d+-slim-\w+", services["orders"]["image"]), services["orders"]["image"]


def _etcd_tuning(compose) -> list[str]:
    """The compose etcd's flags other than its name, addresses and data directory."""
    cmd = compose["services"]["etcd"]["command"]
    return [a for a in cmd[1:] if not a.startswith(("--name", "--data-dir", "--listen-", "--advertise-"))]


def test_etcd_compacts_as_the_etcd_doc_asks(compose):
    """docs/ETCD.md: periodic compaction on every member, or every revision of every record
    stays. The flags also run for real below, on the compose file's etcd release."""
    tuning = _etcd_tuning(compose)
    assert "--auto-compaction-mode=periodic" in tuning and "--auto-compaction-retention=1h" in tuning, tuning
    doc = (REPO_ROOT / "docs" / "ETCD.md").read_text()
    assert "`--auto-compaction-mode periodic --auto-compaction-retention 1h`" in doc


def test_every_mount_exists(compose):
    declared = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        for src, target in _mounts(svc):
            assert PurePosixPath(target).is_absolute(), (name, target)
            path = _bind_source(src)
            if path is None:
                assert src in declared, "%s: named volume %s is not declared" % (name, src)
                continue
            assert path.is_relative_to(REPO_ROOT), (name, src)
            # dist/ is `make build`'s output; everything else is in the repository.
            assert path.is_file(), "%s mounts %s, which does not exist (make build?)" % (name, path)


# The compose spec's long-syntax volume keys (schema/compose-spec.json of compose-spec/compose-spec).
LONG_SYNTAX_KEYS = {"type", "source", "target", "read_only", "consistency", "bind", "volume", "tmpfs", "image"}
BIND_KEYS = {"propagation", "create_host_path", "recursive", "selinux"}


def test_the_module_mount_never_creates_a_host_directory(compose):
    """Short syntax makes Docker create a missing bind source as a directory: `docker compose up`
    before `make build` would leave dist/idempotency_filter.wasm a directory, and the build then
    fails. The module's mount is long syntax with create_host_path false."""
    for name in ENVOY_SERVICES:
        mounts = [v for v in compose["services"][name]["volumes"]
                  if (v["target"] if isinstance(v, dict) else v.split(":")[1]).endswith(".wasm")]
        assert len(mounts) == 1, (name, mounts)
        (mount,) = mounts
        assert isinstance(mount, dict), "%s: short-syntax module mount %r" % (name, mount)
        assert set(mount) <= LONG_SYNTAX_KEYS and set(mount["bind"]) <= BIND_KEYS, mount
        assert mount["type"] == "bind" and mount["read_only"] is True, mount
        assert mount["bind"]["create_host_path"] is False, mount


def test_what_the_services_run_is_mounted(compose):
    services = compose["services"]
    orders_targets = {t for _, t in _mounts(services["orders"])}
    script = [a for a in services["orders"]["command"] if a.endswith(".py")]
    assert script and script[0] in orders_targets
    for name in ENVOY_SERVICES:
        svc = services[name]
        targets = {t: _bind_source(s) for s, t in _mounts(svc)}
        config_path = _envoy_config_source(svc)
        # The file that `make validate` and tests/e2e/operations/test_config.py validate (every envoy/*.yaml).
        assert config_path.parent == REPO_ROOT / "envoy", config_path
        cfg = load(config_path)
        modules = [d["filename"] for d in walk(cfg) if "filename" in d and str(d["filename"]).endswith(".wasm")]
        # The data plane's filter and the admin listener's (C24) load the one module.
        assert len(modules) == 2 and set(modules) == {"dist/idempotency_filter.wasm"}, modules
        mounted_at = str(PurePosixPath(svc["working_dir"]) / modules[0])
        assert targets.get(mounted_at) == REPO_ROOT / "dist" / "idempotency_filter.wasm", (mounted_at, targets)


def _without_addresses(cfg: dict) -> dict:
    cfg = copy.deepcopy(cfg)
    for d in walk(cfg):
        if "socket_address" in d:
            d["socket_address"] = "<address>"
    for c in cfg["static_resources"]["clusters"]:
        c.pop("type", None)
        c.pop("dns_lookup_family", None)
    return cfg


def test_compose_envoy_config_is_the_etcd_config_with_other_addresses(compose):
    compose_cfg = load(_envoy_config_source(compose["services"]["envoy-a"]))
    etcd_cfg = load(REPO_ROOT / "envoy" / "envoy-etcd.yaml")
    assert _without_addresses(compose_cfg) == _without_addresses(etcd_cfg)
    addresses = {(d["socket_address"]["address"], d["socket_address"]["port_value"])
                 for d in walk(compose_cfg) if "socket_address" in d}
    # Service names of this compose file, and the container's own interfaces; the admin API's
    # listener (C24) stays on the container's loopback, as in every shipped config.
    assert addresses == {("0.0.0.0", 9901), ("0.0.0.0", 10000), ("127.0.0.1", 9902), ("orders", 8080),
                         ("etcd", 2379)}
    assert set(compose["services"]) >= {"orders", "etcd"}


def test_compose_envoy_config_validates(compose, envoy_bin, filter_wasm):
    proc = envoy_validate(envoy_bin, _envoy_config_source(compose["services"]["envoy-a"]))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK" in proc.stdout + proc.stderr


def _native(cfg: dict, upstream_port: int, etcd_port: int, wasm: Path) -> dict:
    """The compose config on loopback: what Docker's network does, done with free ports."""
    cfg = copy.deepcopy(cfg)
    cfg["admin"]["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": 0}
    for listener in cfg["static_resources"]["listeners"]:
        listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": 0}
    ports = {"orders": upstream_port, "etcd": etcd_port}
    for c in cfg["static_resources"]["clusters"]:
        c["type"] = "STATIC"
        c.pop("dns_lookup_family", None)
        for d in walk(c["load_assignment"]):
            if "socket_address" in d:
                assert d["socket_address"]["address"] == c["name"]
                d["socket_address"] = {"address": "127.0.0.1", "port_value": ports[c["name"]]}
    for d in walk(cfg):
        if str(d.get("filename", "")).endswith(".wasm"):
            d["filename"] = str(wasm)
    return cfg


def _curl_lines(text: str, prefix: str = "") -> list[str]:
    return [l[len(prefix):] for l in text.splitlines() if l.startswith(prefix + "curl ")]


DEPLOYMENT_DOC = REPO_ROOT / "docs" / "DEPLOYMENT.md"


def _doc_compose_curls() -> list[str]:
    """The curl lines of the compose recipe (the sh block that runs docker compose): one in the
    docs (README.md and docs/*.md), and it is docs/DEPLOYMENT.md's."""
    docs = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    found = [(doc, b) for doc in docs for b in re.findall(r"```sh\n(.*?)```", doc.read_text(), re.S)
             if "docker compose" in b]
    assert [doc for doc, _ in found] == [DEPLOYMENT_DOC], (
        "one compose recipe expected, in docs/DEPLOYMENT.md: %s" % [str(d) for d, _ in found])
    return _curl_lines(found[0][1])


def _curl(line: str, ports: dict[int, int]) -> Response:
    """What curl does with `line`, sent to the local port standing in for its published port."""
    args = shlex.split(line)
    assert args[0] == "curl"
    headers: list[tuple[str, str]] = []
    body = url = None
    i = 1
    while i < len(args):
        a = args[i]
        if a == "-H":
            name, _, value = args[i + 1].partition(":")
            headers.append((name.strip().lower(), value.strip()))
            i += 2
        elif a == "-d":
            body = args[i + 1].encode()
            i += 2
        elif re.fullmatch(r"-[si]+", a):
            i += 1
        else:
            assert url is None and not a.startswith("-"), "curl option not understood: %s" % a
            url = a
            i += 1
    assert url is not None
    parts = urllib.parse.urlsplit("http://" + url)
    names = {n for n, _ in headers}
    if "host" not in names:  # curl's default Host is the URL's authority
        headers.append(("host", parts.netloc))
    if body is not None and "content-type" not in names:
        headers.append(("content-type", "application/x-www-form-urlencoded"))
    path = parts.path + ("?" + parts.query if parts.query else "")
    return request(ports[parts.port], "POST" if body is not None else "GET", path, body, headers)


def _health(service: dict, admin_port: int) -> int:
    """The exit status of the service's Docker health check, run here with bash against a local
    Envoy whose admin listens on `admin_port` (the compose config's 9901)."""
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "bash", "-c"], test
    script = test[3].replace("/dev/tcp/127.0.0.1/9901", "/dev/tcp/127.0.0.1/%d" % admin_port)
    assert script != test[3], "the health check asks another port than the admin's 9901"
    return subprocess.run(["bash", "-c", script], timeout=10).returncode


def test_the_envoy_health_check_fails_where_no_envoy_answers(compose):
    closed = ClosedPort()
    try:
        for name in ENVOY_SERVICES:
            assert _health(compose["services"][name], closed.port) != 0, name
    finally:
        closed.close()


# What the recipe's executions line answers, as docs/DEPLOYMENT.md and the compose file say it.
PROMISED_EXECUTIONS = '{"key": "k-1", "count": 1}'


def test_the_compose_file_shows_the_deployment_doc_curl_lines():
    assert _curl_lines(COMPOSE_FILE.read_text(), "#   ") == _doc_compose_curls()
    assert "`%s`" % PROMISED_EXECUTIONS in DEPLOYMENT_DOC.read_text()
    assert "# %s." % PROMISED_EXECUTIONS in COMPOSE_FILE.read_text()


def test_the_deployment_doc_curl_lines_replay_on_the_other_replica(compose, envoy_bin, filter_wasm):
    """C9, C14, C8: docs/DEPLOYMENT.md's compose recipe against the compose config run twice on one
    real etcd: the call on A is replayed on B, executed once; a different payload on B gets 422;
    and without a common Host header (curl's default), B's call is another scope and executes
    again."""
    cfg = load(_envoy_config_source(compose["services"]["envoy-a"]))
    # "127.0.0.1:10001:10000" -> 10001, the port the recipe's curl lines name
    published = {name: int(p.split(":")[1]) for name in ENVOY_SERVICES
                 for p in compose["services"][name]["ports"] if p.endswith(":10000")}
    up = Upstream("compose-orders").start()
    # The compose file's release, with its flags.
    etcd = Etcd("compose-etcd", binary=current_etcd(), extra_args=_etcd_tuning(compose)).start()
    replicas = {}
    try:
        native = _native(cfg, up.port, etcd.client_port, filter_wasm)
        for name in ENVOY_SERVICES:
            replicas[name] = Envoy(envoy_bin, native, name=name, log_level="warn",
                                   component_log_level="wasm:info").start()
        ports = {published[name]: replicas[name].port for name in ENVOY_SERVICES}
        # Each replica is healthy by the compose file's own health check (its admin port here).
        for name in ENVOY_SERVICES:
            assert _health(compose["services"][name], replicas[name].admin_port) == 0, name
        first_line, retry_line, executions_line = _doc_compose_curls()
        first = _curl(first_line, ports)
        assert first.status == 201 and not first.replayed, first
        retry = _curl(retry_line, ports)
        assert retry.status == 201 and retry.replayed and retry.body == first.body, retry
        executions = _curl(executions_line, ports)
        assert executions.status == 200
        assert json.loads(executions.body) == json.loads(PROMISED_EXECUTIONS) == {"key": "k-1", "count": 1}

        other = _curl(retry_line.replace('{"item":"book"}', '{"item":"pen"}'), ports)
        assert other.status == 422, other

        def without_host(line: str) -> str:
            return line.replace(" -H 'host: orders.example'", "").replace("k-1", "k-2")

        _curl(without_host(first_line), ports)
        again = _curl(without_host(retry_line), ports)
        assert again.status == 201 and not again.replayed, again
        assert up.executions("k-2") == 2
    finally:
        for r in replicas.values():
            r.stop()
        etcd.stop()
        up.stop()
