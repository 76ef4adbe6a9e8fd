"""Istio's bootstrap `stats_config`, rendered here as istio-agent renders it, and what Envoy makes
of it with a bootstrap override.

istio_upstream/envoy_bootstrap_stats_config.json.tmpl is that member of Istio's template
(tools/packaging/common/envoy_bootstrap.json), verbatim. `render` runs the Go template actions it
uses (`range`, `if`, `{{ $x }}`, `{{js $x}}`, `toJson`, `{{-` trimming) with the values
pkg/bootstrap/config.go gives them; `merge_override` applies a `sidecar.istio.io/bootstrapOverride`
file the way Envoy applies `--config-yaml` (istio-agent passes the file so): a protobuf merge,
in which repeated fields such as `stats_tags` are appended to.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent / "istio_upstream" / "envoy_bootstrap_stats_config.json.tmpl"

# pkg/bootstrap/config.go: what every proxy gets (requiredEnvoyStatsMatcherInclusionPrefixes,
# rbacEnvoyStatsMatcherInclusionSuffix, requiredEnvoyStatsMatcherInclusionRegexes).
DEFAULTS = {
    "extraStatTags": [],
    "inclusionPrefix": "cluster_manager,listener_manager,server,cluster.xds-grpc,wasm".split(","),
    "inclusionSuffix": "rbac.allowed,rbac.denied,shadow_allowed,shadow_denied".split(","),
    "inclusionRegexps": [r"vhost\..*\.route\..*"],
}

_ACTION = re.compile(r"(\s*)\{\{(-?)\s*(.*?)\s*(-?)\}\}(\s*)", re.S)


def _js(s: str) -> str:
    """Go's text/template `js`, for the characters a stats regex holds."""
    return (s.replace("\\", "\\\\").replace("'", "\\'").replace('"', '\\"')
            .replace("<", "\\u003C").replace(">", "\\u003E").replace("&", "\\u0026").replace("=", "\\u003D"))


def _tokens(text: str):
    pos = 0
    for m in _ACTION.finditer(text):
        lead = m.group(1) if not m.group(2) else ""
        yield ("text", text[pos:m.start()] + lead)
        yield ("action", m.group(3))
        # A trailing `-}}` would trim what follows; the template uses none, so keep it.
        pos = m.end() - len(m.group(5)) if not m.group(4) else m.end()
    yield ("text", text[pos:])


def _parse(tokens, until_end: bool = False) -> list:
    nodes = []
    for kind, value in tokens:
        if kind == "text":
            nodes.append(("text", value))
        elif value == "end":
            assert until_end, "unbalanced {{ end }}"
            return nodes
        elif value.startswith(("range ", "if ")):
            nodes.append(("block", value, _parse(tokens, True)))
        elif value.startswith("/*"):
            continue
        else:
            nodes.append(("expr", value))
    assert not until_end, "missing {{ end }}"
    return nodes


def _value(expr: str, env: dict):
    if expr.startswith("."):
        return env.get(expr[1:])
    if expr.startswith("$"):
        return env[expr]
    raise ValueError("unsupported template expression %r" % expr)


def _exec(nodes: list, env: dict) -> str:
    out = []
    for node in nodes:
        if node[0] == "text":
            out.append(node[1])
        elif node[0] == "expr":
            parts = node[1].split()
            if parts[0] == "js":
                out.append(_js(str(_value(parts[1], env))))
            elif parts[0] == "toJson":
                out.append(json.dumps(_value(parts[1], env)))
            else:
                (expr,) = parts
                out.append(str(_value(expr, env)))
        else:
            head, body = node[1], node[2]
            m = re.fullmatch(r"range \$\w+, (\$\w+) := (\.\w+)", head)
            if m:
                for item in _value(m.group(2), env) or []:
                    out.append(_exec(body, dict(env, **{m.group(1): item})))
            else:
                m = re.fullmatch(r"if (\.\w+)", head)
                assert m, head
                if _value(m.group(1), env):
                    out.append(_exec(body, env))
    return "".join(out)


def render(**values) -> dict:
    """Istio's `stats_config` for a proxy with these template values (DEFAULTS for the rest)."""
    params = dict(DEFAULTS, **values)
    text = _exec(_parse(_tokens(TEMPLATE.read_text())), params)
    return json.loads("{" + text + "}")["stats_config"]


def merge_override(bootstrap: dict, override: dict) -> dict:
    """`bootstrap` with `override` merged in as Envoy merges --config-yaml (protobuf MergeFrom:
    messages merge member by member, repeated fields are appended to, scalars replaced)."""
    out = copy.deepcopy(bootstrap)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_override(out[key], value)
        elif isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = out[key] + copy.deepcopy(value)
        else:
            out[key] = copy.deepcopy(value)
    return out
