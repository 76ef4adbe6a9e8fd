"""What a record costs etcd, measured (issue 33, sizing): for each response size, with and without
quotas, starts a fresh etcd member (data on disk), writes records through the filter's own
exchanges (examples/etcd_sizing.rs), and reads etcd's database before and after: the bytes in
use with every revision still there (what etcd holds until it compacts), then after compacting
to the last revision and defragmenting (what the live records hold), per record; with the keys,
revisions and leases a record makes. Prints docs/ETCD.md's sizing table. Not part of
`make bench`.

    make bench-etcd-sizing [SIZING_ARGS='--records 2000 --bodies 0 2048 16384']
"""

from __future__ import annotations

import argparse
import base64
import subprocess

from idemkit.etcd import Etcd


def in_use(etcd: Etcd) -> tuple[int, int, int]:
    s = etcd.status()
    return int(s["dbSizeInUse"]), int(s["dbSize"]), int(s["header"]["revision"])


def settle(etcd: Etcd, revision: int) -> None:
    """Compacts to `revision` and defragments: what is left is the live keys."""
    etcd.post("/v3/kv/compaction", {"revision": revision, "physical": True}, timeout=60)
    etcd.post("/v3/maintenance/defragment", {}, timeout=120)


def count(etcd: Etcd, prefix: str) -> int:
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    doc = etcd.post("/v3/kv/range", {
        "key": base64.b64encode(prefix.encode()).decode(),
        "range_end": base64.b64encode(end.encode()).decode(),
        "count_only": True,
    })
    return int(doc.get("count", 0))


def measure(binary: str, records: int, body: int, quota: bool, tombstones: bool = False) -> dict:
    etcd = Etcd("sizing", durable=True).start()
    try:
        _, _, rev = in_use(etcd)
        settle(etcd, rev)
        empty, _, rev0 = in_use(etcd)
        args = [binary, "127.0.0.1:%d" % etcd.client_port, str(records), str(body)] + (["quota"] if quota else [])
        args += ["tombstones"] if tombstones else []
        subprocess.run(args, check=True, capture_output=True, text=True)
        before, _, rev1 = in_use(etcd)
        leases = len(etcd.post("/v3/lease/leases", {}).get("leases", []))
        keys = count(etcd, "/idempotency/")
        settle(etcd, rev1)
        after, _, _ = in_use(etcd)
    finally:
        etcd.stop()
    return {
        "body": body, "quota": quota,
        "uncompacted": (before - empty) / records,
        "live": (after - empty) / records,
        "revisions": (rev1 - rev0) / records,
        "keys": keys / records,
        "leases": leases,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default="target/release/examples/etcd_sizing")
    ap.add_argument("--records", type=int, default=2000)
    ap.add_argument("--bodies", type=int, nargs="+", default=[0, 2048, 16384])
    ap.add_argument("--tombstones", action="store_true",
                    help="instead: each body with and without a tombstone per record (no quotas)")
    a = ap.parse_args()
    if a.tombstones:
        tombstones(a)
        return
    print("| response body | quotas | live bytes per record | until compacted | keys | revisions | leases |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for body in a.bodies:
        for quota in (False, True):
            m = measure(a.binary, a.records, body, quota)
            print("| %d B | %s | %.0f | %.0f | %.1f | %.1f | %d |" % (
                m["body"], "tenant + caller" if quota else "none", m["live"], m["uncompacted"],
                m["keys"], m["revisions"], m["leases"]), flush=True)
    print("(%d records per row, written through the filter's exchanges to one fresh etcd member each; "
          "bytes are etcd's dbSizeInUse, after compaction and defragmentation for the live column)" % a.records)


def tombstones(a: argparse.Namespace) -> None:
    """What a tombstone costs etcd: the same records with and without one each."""
    print("| response body | live bytes per record | with its tombstone | the tombstone | keys | revisions |")
    print("|---:|---:|---:|---:|---:|---:|")
    for body in a.bodies:
        plain = measure(a.binary, a.records, body, False)
        kept = measure(a.binary, a.records, body, False, tombstones=True)
        print("| %d B | %.0f | %.0f | %.0f (%.0f%%) | %.1f -> %.1f | %.1f -> %.1f |" % (
            body, plain["live"], kept["live"], kept["live"] - plain["live"],
            100 * (kept["live"] - plain["live"]) / plain["live"], plain["keys"], kept["keys"],
            plain["revisions"], kept["revisions"]), flush=True)
    print("(%d records per row, each on a fresh etcd member; etcd's dbSizeInUse after compaction and "
          "defragmentation)" % a.records)


if __name__ == "__main__":
    main()
