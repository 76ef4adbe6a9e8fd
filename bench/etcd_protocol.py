"""etcd's JSON gateway against its native gRPC API, for the operations the etcd store issues.

    python -m bench.etcd_protocol [--concurrency 1,8] [--ops 1500] [--rounds 3] [--json-out FILE]

Starts one etcd (Debian's etcd-server, idemkit.etcd: free loopback ports, temporary data
directory, stopped at the end) and sends it the same three operations both ways:

- claim: a transaction guarded by create_revision == 0 on a fresh record key that puts the
  record (120 bytes) with a lease: the store's claim write;
- read: a range of one record key holding a completed record (1 KiB): the store's settle read
  and, in its begin read's transaction, a replay;
- lease grant (TTL 22 s): once per expiry window and worker.

(a) JSON gateway: HTTP/1.1 POST /v3/kv/txn, /v3/kv/range, /v3/lease/grant with the bodies the
filter sends (src/store/etcd/wire/json.rs: base64 keys and values, int64 as strings) and the headers
its worker sends, one keep-alive connection per concurrent caller (as Envoy's HTTP/1.1 pool).
(b) gRPC: HTTP/2, one connection multiplexing every caller (as Envoy's HTTP/2 pool), generic
unary calls on /etcdserverpb.KV/Txn, /etcdserverpb.KV/Range, /etcdserverpb.Lease/LeaseGrant
with hand-encoded protobuf, as a module without a protobuf library would have to send them.

Per operation and protocol: client-side latency p50/p99 at fixed numbers of callers in flight,
etcd's CPU per operation (every thread's run time from /proc/<pid>/task/*/schedstat, in ns) and
the bytes on the wire per operation both ways (tcp_info of etcd's client-port sockets, `ss -ti`).
The gateway's own loop back into etcd's gRPC server is measured the same way and reported
apart. Needs grpcio (not part of the test venv: `make bench-etcd-protocol` installs it into
.tools/bench-grpc).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc

from bench import read_varint
from idemkit.etcd import Etcd
from idemkit.process import cpu_ns

PREFIX = b"/idempotency/"
CLAIM_VALUE = bytes(range(120))
RECORD_VALUE = bytes(i % 251 for i in range(1024))
LEASE_TTL_S = 22
OPS = ("claim", "read", "lease_grant")

# ---- the JSON gateway's bodies, exactly as src/store/etcd/wire/json.rs writes them -----------------


def b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def json_claim(key: bytes, value: bytes, lease: int) -> bytes:
    # wire::txn(Some((key, Guard::Absent)), [Put{key, value, lease}], [])
    return ('{"compare":[{"key":"%s","target":"CREATE","result":"EQUAL","create_revision":"0"}],'
            '"success":[{"request_put":{"key":"%s","value":"%s","lease":"%d"}}],"failure":[]}'
            % (b64(key), b64(key), b64(value), lease)).encode()


def json_range(key: bytes) -> bytes:
    return ('{"key":"%s"}' % b64(key)).encode()


def json_lease_grant(ttl_s: int) -> bytes:
    return ('{"TTL":"%d","ID":"0"}' % ttl_s).encode()


# ---- the same messages in protobuf (etcdserverpb, rpc.proto of etcd 3.4) ----------------------


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf encodes it: two's complement, ten bytes when negative
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def f_varint(field: int, n: int) -> bytes:
    return varint(field << 3) + varint(n)


def f_bytes(field: int, b: bytes) -> bytes:
    return varint((field << 3) | 2) + varint(len(b)) + b


def pb_claim(key: bytes, value: bytes, lease: int) -> bytes:
    # Compare{result=EQUAL (0, omitted), target=CREATE (1), key, create_revision=0 (a oneof
    # member: encoded even when zero)}
    compare = f_varint(2, 1) + f_bytes(3, key) + f_varint(5, 0)
    put = f_bytes(1, key) + f_bytes(2, value) + f_varint(3, lease)
    request_op = f_bytes(2, put)  # RequestOp.request_put
    return f_bytes(1, compare) + f_bytes(2, request_op)  # TxnRequest{compare, success}


def pb_range(key: bytes) -> bytes:
    return f_bytes(1, key)


def pb_lease_grant(ttl_s: int) -> bytes:
    return f_varint(1, ttl_s)


def pb_fields(buf: bytes) -> dict[int, list]:
    """A protobuf message's top-level fields (varints as ints, the rest as bytes)."""
    out: dict[int, list] = {}
    i = 0
    while i < len(buf):
        tag, i = read_varint(buf, i)
        field, kind = tag >> 3, tag & 7
        if kind == 0:
            v, i = read_varint(buf, i)
        elif kind == 2:
            n, i = read_varint(buf, i)
            v, i = buf[i:i + n], i + n
        elif kind == 1:
            v, i = buf[i:i + 8], i + 8
        elif kind == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            raise ValueError("wire type %d" % kind)
        out.setdefault(field, []).append(v)
    return out


# ---- measurement helpers ---------------------------------------------------------------------


def cpu_ticks_ns(pid: int) -> int:
    """utime + stime from /proc/<pid>/stat (clock ticks), as a cross-check of cpu_ns."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def sockets(port: int) -> dict[tuple[int, int], tuple[int, int]]:
    """etcd's sockets on its client port: (local port, peer port) -> (bytes received, bytes
    acked), i.e. request and response payload bytes since the connection opened."""
    out = subprocess.run(["ss", "-tinH", "state", "established", "( sport = :%d )" % port],
                         capture_output=True, text=True, check=True).stdout
    conns: dict[tuple[int, int], tuple[int, int]] = {}
    current = None
    for line in out.splitlines():
        m = re.match(r"\s*\d+\s+\d+\s+\S+:(\d+)\s+\S+:(\d+)", line)
        if m:
            current = (int(m.group(1)), int(m.group(2)))
            conns[current] = (0, 0)
            continue
        if current is not None:
            rx = re.search(r"bytes_received:(\d+)", line)
            tx = re.search(r"bytes_acked:(\d+)", line)
            conns[current] = (int(rx.group(1)) if rx else 0, int(tx.group(1)) if tx else 0)
    return conns


def own_ports(port: int, pid: int) -> set[int]:
    """Local ports of the connections etcd itself opened to its client port: the gateway's
    gRPC client (embed/serve.go registerGateway dials the member's own address)."""
    out = subprocess.run(["ss", "-tnpH", "state", "established", "( dport = :%d )" % port],
                         capture_output=True, text=True, check=True).stdout
    ports = set()
    for line in out.splitlines():
        m = re.match(r"\s*\d+\s+\d+\s+\S+:(\d+)\s+\S+:(\d+)", line)
        if m and "pid=%d," % pid in line:
            ports.add(int(m.group(1)))
    return ports


def wire_delta(before, after, loopback: set[int]):
    """Bytes (up, down) that moved on etcd's client-port sockets between two `sockets()`
    readings, split into our client's connections and the gateway's own gRPC connection back
    into etcd (`loopback`: its local ports)."""
    mine = [0, 0]
    other = [0, 0]
    for conn, (rx, tx) in after.items():
        rx0, tx0 = before.get(conn, (0, 0))
        acc = other if conn[1] in loopback else mine
        acc[0] += rx - rx0
        acc[1] += tx - tx0
    return mine, other


def percentile(sorted_ns: list[int], p: float) -> float:
    return sorted_ns[min(len(sorted_ns) - 1, int(p / 100 * len(sorted_ns)))] / 1e6


# ---- the two clients -------------------------------------------------------------------------


class Http1:
    """A keep-alive HTTP/1.1 connection sending the filter's callouts (headers as the worker sets
    them; Envoy adds a few of its own on the way)."""

    def __init__(self, port: int):
        self.port = port

    async def open(self) -> "Http1":
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.local_port = self.writer.get_extra_info("sockname")[1]
        return self

    async def post(self, path: str, body: bytes) -> bytes:
        head = ("POST %s HTTP/1.1\r\nhost: etcd\r\ncontent-type: application/json\r\n"
                "content-length: %d\r\n\r\n" % (path, len(body))).encode()
        self.writer.write(head + body)
        status = await self.reader.readline()
        length = None
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if length is None:
            raise RuntimeError("etcd answered without content-length: %r" % status)
        payload = await self.reader.readexactly(length)
        if not status.startswith(b"HTTP/1.1 200"):
            raise RuntimeError("etcd answered %r: %r" % (status, payload[:200]))
        return payload

    def close(self) -> None:
        self.writer.close()


JSON_PATHS = {"claim": "/v3/kv/txn", "read": "/v3/kv/range", "lease_grant": "/v3/lease/grant"}
GRPC_METHODS = {"claim": "/etcdserverpb.KV/Txn", "read": "/etcdserverpb.KV/Range",
                "lease_grant": "/etcdserverpb.Lease/LeaseGrant"}


def check_json(op: str, answer: bytes) -> None:
    doc = json.loads(answer)
    if op == "claim" and doc.get("succeeded") is not True:
        raise RuntimeError("claim refused: %s" % doc)
    if op == "read" and len(base64.b64decode(doc["kvs"][0]["value"])) != len(RECORD_VALUE):
        raise RuntimeError("read the wrong record: %s" % doc)
    if op == "lease_grant" and int(doc["ID"]) == 0:
        raise RuntimeError("no lease: %s" % doc)


def check_pb(op: str, answer: bytes) -> None:
    fields = pb_fields(answer)
    if op == "claim" and fields.get(2) != [1]:  # TxnResponse.succeeded
        raise RuntimeError("claim refused: %r" % answer[:200])
    if op == "read":  # RangeResponse.kvs[0].value
        kv = pb_fields(fields[2][0])
        if len(kv[5][0]) != len(RECORD_VALUE):
            raise RuntimeError("read the wrong record")
    if op == "lease_grant" and not fields.get(2):  # LeaseGrantResponse.ID
        raise RuntimeError("no lease: %r" % answer)


class Bench:
    def __init__(self, etcd: Etcd, ops: int):
        self.etcd = etcd
        self.port = etcd.client_port
        self.pid = etcd.proc.pid
        self.concurrency = 1
        self.ops = ops
        self.lease = 0
        self.serial = 0

    def bodies(self, op: str, proto: bool):
        """A generator of request bodies for `op`: fresh record keys for claims."""
        read_key = PREFIX + b"r/" + b"f" * 64
        while True:
            if op == "claim":
                self.serial += 1
                key = PREFIX + b"r/" + ("%064x" % (self.serial + (1 << 200))).encode()[-64:]
                yield (pb_claim if proto else json_claim)(key, CLAIM_VALUE, self.lease)
            elif op == "read":
                yield (pb_range if proto else json_range)(read_key)
            else:
                yield (pb_lease_grant if proto else json_lease_grant)(LEASE_TTL_S)

    async def setup(self) -> None:
        conn = await Http1(self.port).open()
        doc = json.loads(await conn.post("/v3/lease/grant", json_lease_grant(600)))
        self.lease = int(doc["ID"])
        put = '{"key":"%s","value":"%s"}' % (b64(PREFIX + b"r/" + b"f" * 64), b64(RECORD_VALUE))
        await conn.post("/v3/kv/put", put.encode())
        conn.close()

    async def run(self, op: str, proto: bool, warmup: int) -> dict:
        bodies = self.bodies(op, proto)
        latencies: list[int] = []
        if proto:
            channel = grpc.aio.insecure_channel("127.0.0.1:%d" % self.port)
            call = channel.unary_unary(GRPC_METHODS[op])
            check = check_pb

            async def send(_worker, body):
                return await call(body, timeout=5)
            await send(None, next(bodies))  # connect before the readings
            workers = [None] * self.concurrency
        else:
            workers = [await Http1(self.port).open() for _ in range(self.concurrency)]
            check = check_json

            async def send(worker, body):
                return await worker.post(JSON_PATHS[op], body)

        async def loop(worker, count: int, record: bool):
            for _ in range(count):
                body = next(bodies)
                t0 = time.perf_counter_ns()
                answer = await send(worker, body)
                if record:
                    latencies.append(time.perf_counter_ns() - t0)
                check(op, answer)

        await asyncio.gather(*(loop(w, warmup // self.concurrency, False) for w in workers))
        wire0, cpu0, ticks0 = sockets(self.port), cpu_ns(self.pid), cpu_ticks_ns(self.pid)
        t0 = time.perf_counter()
        per = self.ops // self.concurrency
        await asyncio.gather(*(loop(w, per, True) for w in workers))
        elapsed = time.perf_counter() - t0
        cpu, ticks, wire1 = cpu_ns(self.pid) - cpu0, cpu_ticks_ns(self.pid) - ticks0, sockets(self.port)
        (up, down), (loop_up, loop_down) = wire_delta(wire0, wire1, own_ports(self.port, self.pid))
        if proto:
            await channel.close()
        else:
            for w in workers:
                w.close()
        n = len(latencies)
        latencies.sort()
        return {
            "op": op, "protocol": "grpc" if proto else "json", "concurrency": self.concurrency, "ops": n,
            "p50_ms": round(percentile(latencies, 50), 3),
            "p99_ms": round(percentile(latencies, 99), 3),
            "ops_per_s": round(n / elapsed),
            "etcd_cpu_us_per_op": round(cpu / n / 1000, 1),
            "etcd_cpu_us_per_op_stat": round(ticks / n / 1000, 1),
            "wire_up_per_op": round(up / n), "wire_down_per_op": round(down / n),
            "loopback_up_per_op": round(loop_up / n), "loopback_down_per_op": round(loop_down / n),
        }


def table(rows: list[dict]) -> str:
    lines = [
        "| operation | protocol | in flight | p50 ms | p99 ms | ops/s | etcd CPU µs/op | bytes up/op | bytes down/op | gateway loopback bytes/op |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append("| %s | %s | %d | %.2f | %.2f | %d | %.0f | %d | %d | %s |" % (
            r["op"], "JSON gateway (HTTP/1.1)" if r["protocol"] == "json" else "gRPC (HTTP/2)",
            r["concurrency"],
            r["p50_ms"], r["p99_ms"], r["ops_per_s"], r["etcd_cpu_us_per_op"],
            r["wire_up_per_op"], r["wire_down_per_op"],
            "%d" % (r["loopback_up_per_op"] + r["loopback_down_per_op"]) if r["protocol"] == "json" else "-"))
    lines.append("")
    lines.append("Median round by etcd CPU; etcd CPU from /proc/<pid>/task/*/schedstat; bytes: TCP payload "
                 "(tcp_info), HTTP/2 framing and HTTP/1.1 headers included.")
    return "\n".join(lines)


async def main_async(args) -> list[dict]:
    etcd = Etcd("etcd-protocol", durable=True).start()
    try:
        bench = Bench(etcd, args.ops)
        await bench.setup()
        rows = []
        for _ in range(args.rounds):
            for concurrency in args.concurrency:
                bench.concurrency = concurrency
                for op in OPS:
                    for proto in (False, True):
                        rows.append(await bench.run(op, proto, warmup=max(40, concurrency * 20)))
        return rows
    finally:
        etcd.stop()


def merge(rows: list[dict]) -> list[dict]:
    """Rounds of one (op, protocol): the median round by etcd CPU per op."""
    out = []
    for concurrency in sorted({r["concurrency"] for r in rows}):
        for op in OPS:
            for protocol in ("json", "grpc"):
                mine = sorted((r for r in rows if r["op"] == op and r["protocol"] == protocol
                               and r["concurrency"] == concurrency),
                              key=lambda r: r["etcd_cpu_us_per_op"])
                if mine:
                    out.append(mine[len(mine) // 2])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=lambda v: [int(c) for c in v.split(",")], default=[1, 8],
                    help="callers in flight, comma-separated (default 1,8)")
    ap.add_argument("--ops", type=int, default=1500, help="measured operations per op and protocol")
    ap.add_argument("--rounds", type=int, default=3, help="rounds (alternating protocols); the median is reported")
    ap.add_argument("--json-out", type=Path, help="also write every round's numbers here")
    args = ap.parse_args()
    rows = asyncio.run(main_async(args))
    if args.json_out:
        args.json_out.write_text(json.dumps({"rounds": rows}, indent=1))
    print(table(merge(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
