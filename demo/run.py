"""`make run`: the orders upstream on 127.0.0.1:8080 behind Envoy on 127.0.0.1:10000 (admin
127.0.0.1:9901, envoy/envoy.yaml), started and stopped together through the kit (idemkit/).
Envoy logs to this terminal; Ctrl-C (or SIGTERM) stops both. With `--etcd` (`make run-etcd`) the
filter keeps its records in an etcd started here on 127.0.0.1:2379 (envoy/envoy-etcd.yaml; its
data directory is temporary and removed at the end).

    python -m demo.run --envoy BIN [--etcd] [--log-level warn] [--component-log-level wasm:info]

Run from the repository root (envoy/envoy.yaml names dist/idempotency_filter.wasm relative to it).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from idemkit import REPO_ROOT
from idemkit.envoy import Envoy
from idemkit.etcd import Etcd
from idemkit.process import Upstream

UPSTREAM_PORT = 8080  # envoy/envoy.yaml's cluster `orders`
ETCD_PORT = 2379  # envoy/envoy-etcd.yaml's cluster `etcd`

HELP = """
orders upstream on 127.0.0.1:8080, Envoy on 127.0.0.1:10000 (admin 127.0.0.1:9901).
Try, from another shell (Ctrl-C here stops both):

  K=order-$RANDOM

  # 1. first call: 201, executed by the upstream
  curl -si localhost:10000/orders -H "idempotency-key: $K" -H 'content-type: application/json' -d '{"item":"book","qty":1}'

  # 2. the same call again: a replay (same body, header idempotent-replayed: true)
  curl -si localhost:10000/orders -H "idempotency-key: $K" -H 'content-type: application/json' -d '{"item":"book","qty":1}'

  # 3. same key, different body: 422 application/problem+json
  curl -si localhost:10000/orders -H "idempotency-key: $K" -H 'content-type: application/json' -d '{"item":"book","qty":2}'

  # 4. in-flight conflict: a slow call (3 s) in the background, then the same key again: 409
  curl -s -o /dev/null -w 'slow call: %{http_code}\\n' localhost:10000/orders -H "idempotency-key: $K-slow" -H 'x-delay-ms: 3000' -d '{}' &
  sleep 0.5; curl -si localhost:10000/orders -H "idempotency-key: $K-slow" -d '{}'

  # how often the upstream really executed, and the filter's counters
  curl -s localhost:8080/_admin/executions; echo; curl -s 'localhost:9901/stats?filter=wasmcustom'
"""


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
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop both in the finally below

    config = a.config or str(REPO_ROOT / "envoy" / ("envoy-etcd.yaml" if a.etcd else "envoy.yaml"))
    upstream = Upstream("demo-upstream", port=UPSTREAM_PORT)
    etcd = Etcd("demo-etcd", client_port=ETCD_PORT) if a.etcd else None
    envoy = Envoy(a.envoy, Path(config), "demo", a.concurrency, a.log_level,
                  a.component_log_level, console=True)
    try:
        if etcd is not None:
            etcd.start()
        upstream.start()
        envoy.start(timeout=60)
        print(HELP, flush=True)
        return envoy.wait_exit(None) or 0
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:  # the upstream or Envoy did not start (port taken, bad config)
        print("make run: %s" % exc, file=sys.stderr)
        return 1
    finally:
        envoy.stop()
        upstream.stop()
        if etcd is not None:
            etcd.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
