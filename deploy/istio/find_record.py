#!/usr/bin/env python3
"""Which pod holds an idempotency record: asks the admin API of every pod of a workload for a key
and prints what each one has. Standard library only.

    deploy/istio/find_record.py --key ord-7 -n payments -l app=payments --token-secret idempotency-admin

With the local store each sidecar holds its own records, so the record of a key is in the pod
that served its first request: this finds it. With the etcd store (istio/mesh) every sidecar's
admin API reads the whole fleet's records, so any one pod answers for all (`--pods 1`).

Each pod is reached with `kubectl port-forward pod/<pod> :<port>` to the admin listener the mesh
manifest adds on the sidecar's loopback (127.0.0.1:9902). `--endpoint NAME=URL` (repeatable) asks
those URLs instead, with no kubectl: a port-forward you opened yourself, or, in the tests, two
local Envoys standing in for two pods. The token comes from `--token-file`, from a Secret's
`token` key (`--token-secret`), or from $IDEMPOTENCY_ADMIN_TOKEN; it is sent, never printed.

Exit status: 0 when some pod holds a record of the key, 1 when none does, 2 when a pod could not
be asked (the others are still printed).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

ADMIN_PORT = 9902


def kubectl(*args: str) -> str:
    return subprocess.run(["kubectl", *args], check=True, capture_output=True, text=True, timeout=30).stdout


def token_of(a: argparse.Namespace) -> str | None:
    if a.token_file:
        with open(a.token_file) as f:
            return f.read().strip()
    if a.token_secret:
        data = kubectl("get", "secret", a.token_secret, "-n", a.namespace, "-o", "jsonpath={.data.token}")
        return base64.b64decode(data).decode().strip()
    return os.environ.get("IDEMPOTENCY_ADMIN_TOKEN")


def ask(base_url: str, key: str, token: str | None, route: str | None, tenant: str | None) -> list[dict]:
    """The records of `key` the admin API at `base_url` lists (narrowed by route and tenant)."""
    query = {"key": key}
    if route:
        query["route"] = route
    if tenant:
        query["tenant"] = tenant
    req = urllib.request.Request(base_url.rstrip("/") + "/idempotency/records?" + urllib.parse.urlencode(query))
    if token:
        req.add_header("authorization", "Bearer " + token)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())["records"]


class PortForward:
    """`kubectl port-forward pod/<pod> :<port>` for as long as it is open: its local URL."""

    def __init__(self, namespace: str, pod: str, port: int) -> None:
        self.proc = subprocess.Popen(["kubectl", "port-forward", "-n", namespace, "pod/" + pod, ":%d" % port],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        m = re.search(r"Forwarding from 127\.0\.0\.1:(\d+)", line)
        if not m:
            self.close()
            raise RuntimeError("kubectl port-forward to %s: %s" % (pod, line.strip() or "no answer"))
        self.url = "http://127.0.0.1:%s" % m.group(1)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--key", required=True, help="the Idempotency-Key (or business key) to find")
    ap.add_argument("--route", help="narrow to one route rule")
    ap.add_argument("--tenant", help="narrow to one tenant")
    ap.add_argument("-n", "--namespace", default="default")
    ap.add_argument("-l", "--selector", help="the workload's pods, as kubectl -l takes them (app=payments)")
    ap.add_argument("--pods", type=int, default=0, help="ask at most this many pods (etcd store: 1 is enough)")
    ap.add_argument("--port", type=int, default=ADMIN_PORT, help="the admin listener's port in the pod")
    ap.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                    help="ask this admin API instead of kubectl's pods (repeatable)")
    ap.add_argument("--token-file")
    ap.add_argument("--token-secret", help="a Secret in the namespace whose `token` key is the admin token")
    a = ap.parse_args(argv)
    if not a.endpoint and not a.selector:
        ap.error("give -l SELECTOR (kubectl) or --endpoint NAME=URL")
    token = token_of(a)
    targets: list[tuple[str, str | None]] = []
    for e in a.endpoint:
        name, _, url = e.partition("=")
        targets.append((name, url))
    if a.selector:
        pods = kubectl("get", "pods", "-n", a.namespace, "-l", a.selector,
                       "-o", "jsonpath={.items[*].metadata.name}").split()
        targets += [(pod, None) for pod in pods]
    if a.pods:
        targets = targets[:a.pods]
    found, failed = False, False
    for name, url in targets:
        forward = None
        try:
            if url is None:
                forward = PortForward(a.namespace, name, a.port)
                url = forward.url
            records = ask(url, a.key, token, a.route, a.tenant)
        except (OSError, urllib.error.URLError, RuntimeError, ValueError, KeyError) as e:
            print("%s\terror: %s" % (name, e))
            failed = True
            continue
        finally:
            if forward is not None:
                forward.close()
        if not records:
            print("%s\tnone" % name)
        for r in records:
            found = True
            print("%s\t%s\troute=%s tenant=%s state=%s" % (name, r["tag"], r.get("route"), r.get("tenant"), r.get("state")))
    if failed:
        return 2
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
