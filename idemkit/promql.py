"""Just enough PromQL for the shipped Grafana dashboard (deploy/grafana): what an expression
refers to (metric names, label matchers, `by` labels), checked against a scrape of
/stats/prometheus; and an evaluator of the forms the dashboard uses (`sum [by (...)]`,
`rate`/`increase` over a range, `+ - * /` between vectors with the same labels or a number), run
over a series of scrapes, so the dashboard can be drawn without Prometheus or Grafana."""

from __future__ import annotations

import re
from typing import Iterable

# Labels Prometheus adds to every scraped series itself (not in Envoy's output): `instance` and
# `job` always, `namespace` and `pod` where the Prometheus Operator's PodMonitor scrapes a pod
# (deploy/prometheus/podmonitor.yaml); a `by` over them keeps them where they exist.
TARGET_LABELS = {"instance", "job", "namespace", "pod"}

_SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?\s*(\[[^\]]*\])?")
_MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_KEYWORDS = {"sum", "by", "rate", "increase", "without", "avg", "max", "min", "count"}
_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Grafana's `$name` variables replaced (longest names first)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("$" + name, variables[name])
    return expr


def references(expr: str) -> tuple[list[tuple[str, list[tuple[str, str, str]]]], set[str]]:
    """([(metric, [(label, op, value)])], the labels of every `by (...)`)."""
    selectors = []
    for m in _SELECTOR.finditer(expr):
        name = m.group(1)
        if name in _KEYWORDS or expr[m.end(1):].lstrip().startswith("(") or name.isdigit():
            continue
        before = expr[:m.start()].rstrip()
        if before.endswith(("by (", "by(", ",")) and not m.group(2):
            continue  # a label inside by (...)
        matchers = _MATCHER.findall(m.group(2) or "")
        selectors.append((name, matchers))
    by = {label.strip() for group in _BY.findall(expr) for label in group.split(",") if label.strip()}
    return selectors, by


def parse_scrape(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """/stats/prometheus as {metric: [(labels, value)]}."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        m = _SERIES.match(line)
        if m and not line.startswith("#"):
            out.setdefault(m.group(1), []).append((dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def check(expr: str, scrape: dict, variables: dict[str, str]) -> list[str]:
    """What `expr` names that the scrape lacks: metrics, labels of its matchers and of its `by`
    clauses, and each literal value (or regex alternative) an `=`/`=~` matcher asks for."""
    problems = []
    selectors, by = references(substitute(expr, variables))
    if not selectors:
        problems.append("no metric in %r" % expr)
    labels_seen: set[str] = set()
    for metric, matchers in selectors:
        series = scrape.get(metric)
        if not series:
            problems.append("metric %s is not in the scrape" % metric)
            continue
        have = {k for labels, _ in series for k in labels}
        labels_seen |= have
        for label, op, value in matchers:
            if label not in have:
                problems.append("%s has no label %s" % (metric, label))
                continue
            values = {labels.get(label) for labels, _ in series}
            if op == "=" and value not in values:
                problems.append('%s{%s="%s"}: no such series' % (metric, label, value))
            if op == "=~" and value != ".*":
                for alt in value.split("|"):
                    if not any(re.fullmatch(alt, v or "") for v in values):
                        problems.append('%s{%s=~"...%s..."}: no such series' % (metric, label, alt))
    for label in by - TARGET_LABELS:
        if label not in labels_seen:
            problems.append("by (%s): no metric of the expression has it" % label)
    return problems


# ---- evaluation over scrapes -----------------------------------------------------------------

_TOKEN = re.compile(r'\s*(?:(\d+(?:\.\d+)?(?:[smhd])?)|([a-zA-Z_:][a-zA-Z0-9_:]*)|("(?:[^"\\]|\\.)*")|(=~|!~|!=|[(){}\[\],=+\-*/]))')

Vector = dict[frozenset, float]


def _duration(s: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return float(s[:-1]) * units[s[-1]] if s[-1] in units else float(s)


def _tokens(expr: str) -> list[str]:
    out, pos = [], 0
    expr = expr.strip()
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise ValueError("cannot read %r at %d" % (expr, pos))
        out.append(next(g for g in m.groups() if g is not None))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.t, self.i = tokens, 0

    def peek(self) -> str | None:
        return self.t[self.i] if self.i < len(self.t) else None

    def take(self, want: str | None = None) -> str:
        tok = self.t[self.i]
        if want is not None and tok != want:
            raise ValueError("expected %r, got %r" % (want, tok))
        self.i += 1
        return tok

    def expr(self):
        node = self.unary()
        while self.peek() in ("+", "-", "*", "/"):
            op = self.take()
            node = ("op", op, node, self.unary())
        return node

    def unary(self):
        tok = self.peek()
        if tok == "(":
            self.take("(")
            node = self.expr()
            self.take(")")
            return node
        if tok is not None and re.fullmatch(r"\d+(\.\d+)?", tok):
            return ("num", float(self.take()))
        if tok == "sum":
            self.take()
            by = None
            if self.peek() == "by":
                self.take()
                self.take("(")
                by = []
                while self.peek() != ")":
                    tok = self.take()
                    if tok != ",":
                        by.append(tok)
                self.take(")")
            self.take("(")
            inner = self.expr()
            self.take(")")
            return ("sum", by, inner)
        if tok in ("rate", "increase"):
            fn = self.take()
            self.take("(")
            sel = self.selector()
            self.take("[")
            window = _duration(self.take())
            self.take("]")
            self.take(")")
            return (fn, sel, window)
        return ("sel", self.selector())

    def selector(self):
        name = self.take()
        matchers = []
        if self.peek() == "{":
            self.take("{")
            while self.peek() != "}":
                label = self.take()
                op = self.take()
                value = self.take()[1:-1].replace('\\"', '"').replace("\\\\", "\\")
                matchers.append((label, op, value))
                if self.peek() == ",":
                    self.take(",")
            self.take("}")
        return name, matchers


def parse(expr: str):
    p = _Parser(_tokens(expr))
    node = p.expr()
    if p.peek() is not None:
        raise ValueError("unread: %r" % p.t[p.i:])
    return node


def _matches(labels: dict, matchers: Iterable[tuple[str, str, str]]) -> bool:
    for label, op, value in matchers:
        v = labels.get(label, "")
        ok = {"=": v == value, "!=": v != value,
              "=~": re.fullmatch(value, v) is not None, "!~": re.fullmatch(value, v) is None}[op]
        if not ok:
            return False
    return True


def _select(scrape: dict, sel) -> Vector:
    name, matchers = sel
    return {frozenset(labels.items()): value for labels, value in scrape.get(name, []) if _matches(labels, matchers)}


def evaluate(node, history: list[tuple[float, dict]], at: int):
    """`node` at history[at] (history: [(time, parse_scrape(...))], oldest first)."""
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "sel":
        return _select(history[at][1], node[1])
    if kind in ("rate", "increase"):
        _, sel, window = node
        t = history[at][0]
        start = max((i for i, (ts, _) in enumerate(history) if ts <= t - window), default=0)
        now, then = _select(history[at][1], sel), _select(history[start][1], sel)
        span = t - history[start][0]
        out = {}
        for k, v in now.items():
            if span > 0:
                delta = max(v - then.get(k, 0.0), 0.0)
                out[k] = delta / span if kind == "rate" else delta * window / span
        return out
    if kind == "sum":
        _, by, inner = node
        vec = evaluate(inner, history, at)
        out: Vector = {}
        for k, v in vec.items():
            key = frozenset((a, b) for a, b in k if by is not None and a in by)
            out[key] = out.get(key, 0.0) + v
        return out
    if kind == "op":
        _, op, left, right = node
        a, b = evaluate(left, history, at), evaluate(right, history, at)
        f = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y,
             "/": lambda x, y: x / y if y else None}[op]
        if isinstance(a, dict) and isinstance(b, dict):
            pairs = {k: f(a[k], b[k]) for k in a if k in b}
        elif isinstance(a, dict):
            pairs = {k: f(v, b) for k, v in a.items()}
        elif isinstance(b, dict):
            pairs = {k: f(a, v) for k, v in b.items()}
        else:
            return f(a, b)
        return {k: v for k, v in pairs.items() if v is not None}
    raise ValueError(kind)
