"""What operators look at, as data: the Grafana dashboard's panels, Prometheus' recording and
alert rules, and the scrape targets of a running ``pd-fsm cluster``.

Every PromQL expression pd_fsm ships is written here once. ``python -m
pd_fsm.io_trio.cluster.observability`` writes ``deploy/grafana/pd_fsm.json`` and
``deploy/prometheus/rules/pd_fsm.rules.yml`` from it (a test checks the committed files are what
it writes), and ``tests/integration/test_observability.py`` evaluates each expression against a
real Prometheus scraping a real cluster: a panel whose query returns no series for the traffic
sent, or a rule that does not parse, fails it.

Labels: Prometheus' own ``job`` and ``instance``, and ``role`` (bootstrap, prefill, decode,
colocated, proxy) and ``name`` (``prefill-0``, ...) from the file-based service discovery the
cluster runner writes (:func:`scrape_targets`). Grafana's ``$__rate_interval`` is the only
macro the panels use; the test evaluates them with ``1m``.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

RATE = "$__rate_interval"
SERVING = 'role=~"decode|colocated"'  # the workers whose answers reach clients (P's leg: one token)
P_PHASES = ("prefill_queue", "prefill_forward", "kv_gather", "kv_register")
D_PHASES = ("decode_bootstrap", "decode_page_wait", "decode_ready_wait", "kv_pull", "kv_scatter",
            "decode_pull_report")
PROXY_PHASES = ("decode_first_byte", "prefill_leg", "decode_leg")
# The defaults of `pd-fsm serve --slo-ttft/--slo-itl` (goodput's targets, DistServe's measure).
SLO_TTFT_S = 2.0
SLO_ITL_S = 0.1


@attrs.frozen
class Target:
    """One query of a panel: PromQL and its legend."""

    expr: str
    legend: str


@attrs.frozen
class Panel:
    title: str
    targets: tuple[Target, ...]
    unit: str = "short"
    stacked: bool = False
    description: str = ""


@attrs.frozen
class DashboardRow:
    title: str
    panels: tuple[Panel, ...]


def _q(q: float, metric: str, by: str = "", selector: str = "") -> str:
    """The ``q`` quantile of histogram ``metric`` over the rate window, by the labels ``by``."""
    labels = ", ".join(["le", *([by] if by else [])])
    return (f"histogram_quantile({q}, sum by ({labels}) "
            f"(rate({metric}_bucket{{{selector}}}[{RATE}])))")


def _quantiles(metric: str, legend: str, by: str = "", selector: str = "") -> tuple[Target, ...]:
    return tuple(Target(_q(q, metric, by, selector), f"{legend} p{int(q * 100)}")
                 for q in (0.5, 0.99))


def _phases(prefix: str, phases: Sequence[str], q: float) -> tuple[Target, ...]:
    return tuple(Target(_q(q, f"{prefix}_{p}_seconds"), p) for p in phases)


def rows() -> tuple[DashboardRow, ...]:
    """The dashboard, top to bottom."""
    return (_requests(), _pd_phases(), _data_plane(), _capacity(), _control_plane(),
            _roles_and_planner(), _restarts())


def _requests() -> DashboardRow:
    """What clients get: request rates, TTFT, inter-token latency, goodput, errors."""
    return DashboardRow("Requests", (
        Panel("Client requests/s by path and status (proxy)", (Target(
            f"sum by (path, status) (rate(pd_fsm_proxy_http_requests_total[{RATE}]))",
            "{{path}} {{status}}"),), "reqps"),
        Panel("Worker requests/s by role and outcome", (Target(
            f"sum by (role, outcome) (rate(pd_fsm_worker_http_requests_total[{RATE}]))",
            "{{role}} {{outcome}}"),), "reqps"),
        Panel("Time to first token", _quantiles(
            "pd_fsm_worker_time_to_first_token_seconds", "{{role}}", "role", SERVING), "s",
            description="HTTP arrival to first token, on the worker that answers the client "
                        "(D under PD, where it includes P's leg; the colocated worker)"),
        Panel("Inter-token latency", _quantiles(
            "pd_fsm_worker_inter_token_latency_seconds", "{{role}}", "role", SERVING), "s"),
        Panel("Goodput: requests/s within the SLO", (
            Target(f'sum by (role) (rate(pd_fsm_worker_requests_slo_total{{met="true", '
                   f'{SERVING}}}[{RATE}]))', "{{role}} within SLO"),
            Target(f"sum by (role) (rate(pd_fsm_worker_requests_slo_total{{{SERVING}}}"
                   f"[{RATE}]))", "{{role}} finished"),
        ), "reqps", description="finished requests whose TTFT and mean inter-token latency "
                                "met the worker's --slo-ttft and --slo-itl (DistServe's "
                                "goodput; defaults 2 s and 100 ms)"),
        Panel("Errors", (
            Target(f'sum by (role, outcome) (rate(pd_fsm_worker_http_requests_total'
                   f'{{outcome!="ok"}}[{RATE}]))', "{{role}} {{outcome}}"),
            Target(f'sum by (key) (rate(pd_fsm_proxy_rooms_total{{key!="COMPLETED"}}'
                   f"[{RATE}]))", "proxy rooms {{key}}"),
        ), "reqps"),
    ))


def _pd_phases() -> DashboardRow:
    """Where a PD request's time goes, phase by phase, on P, on D and in the proxy."""
    return DashboardRow("PD phases", (
        Panel("Prefill worker phases p50", _phases("pd_fsm_worker", P_PHASES, 0.5), "s",
              stacked=True),
        Panel("Prefill worker phases p99", _phases("pd_fsm_worker", P_PHASES, 0.99), "s",
              stacked=True),
        Panel("Decode worker phases p50", _phases("pd_fsm_worker", D_PHASES, 0.5), "s",
              stacked=True),
        Panel("Decode worker phases p99", _phases("pd_fsm_worker", D_PHASES, 0.99), "s",
              stacked=True),
        Panel("Proxy legs", tuple(t for p in PROXY_PHASES for t in _quantiles(
            f"pd_fsm_proxy_{p}_seconds", p)), "s"),
    ))


def _data_plane() -> DashboardRow:
    """The KV transfer: bytes per pull, its rate, pulls in flight and their results."""
    return DashboardRow("Data plane", (
        Panel("KV bytes per pull", _quantiles("pd_fsm_worker_kv_transfer_bytes", "bytes"),
              "bytes"),
        Panel("Pull rate (GB/s)", _quantiles(
            "pd_fsm_worker_kv_transfer_gigabytes_per_second", "GB/s"), "short"),
        Panel("Pulls in flight and KV bytes/s", (
            Target('sum by (name) (pd_fsm_worker_backend_pd_queues{key="pulls_inflight"})',
                   "{{name}} in flight"),
            Target(f'sum by (name) (rate(pd_fsm_worker_backend_transfer{{key="bytes"}}'
                   f"[{RATE}]))", "{{name}} bytes/s"),
        )),
        Panel("Pulls/s by result and P's transfer registrations", (
            Target(f'sum by (name, key) (rate(pd_fsm_worker_backend_transfer'
                   f'{{key=~"pulls_ok|pulls_failed"}}[{RATE}]))', "{{name}} {{key}}"),
            Target('sum by (name) (pd_fsm_worker_backend_transfer_registrations'
                   '{role="prefill"})', "{{name}} registrations held"),
        )),
    ))


def _capacity() -> DashboardRow:
    """KV pages, queues and running requests per worker."""
    return DashboardRow("Capacity", (
        Panel("KV pages per worker", (
            Target("sum by (name) (pd_fsm_worker_backend_free_pages)", "{{name}} free"),
            Target("sum by (name) (pd_fsm_worker_backend_cached_pages)", "{{name}} cached"),
            Target("sum by (name) (pd_fsm_worker_backend_total_pages)", "{{name}} total"),
        )),
        Panel("Queues and running requests", (
            Target("sum by (name) (pd_fsm_worker_backend_waiting)", "{{name}} waiting"),
            Target("sum by (name) (pd_fsm_worker_backend_running)", "{{name}} running"),
            Target('sum by (name, key) (pd_fsm_worker_backend_pd_queues'
                   '{key=~"alloc_queue|recv_queue|held_rooms"})', "{{name}} {{key}}"),
            Target("sum(pd_fsm_proxy_rooms_live)", "proxy rooms live"),
        )),
    ))


def _control_plane() -> DashboardRow:
    """The registry, routing decisions, and what was refused or contained."""
    return DashboardRow("Control plane", (
        Panel("Registry: instances by role", (Target(
            "sum by (key) (pd_fsm_bootstrap_instances_by_role)", "{{key}}"),)),
        Panel("Registry heartbeats/s and failures", (
            Target(f"sum by (name) (rate(pd_fsm_worker_backend_bootstrap_heartbeats_total"
                   f"[{RATE}]))", "{{name}} heartbeats"),
            Target(f"sum by (name) (increase(pd_fsm_worker_backend_bootstrap_heartbeat"
                   f"_failures_total[{RATE}]))", "{{name}} failed"),
            Target(f"sum by (key) (rate(pd_fsm_bootstrap_writes_total[{RATE}]))",
                   "registry {{key}}"),
        )),
        Panel("Route decisions/s by reason (proxy)", (Target(
            f"sum by (key) (rate(pd_fsm_proxy_route_decisions_total[{RATE}]))", "{{key}}"),),
            "reqps"),
        Panel("Refused and contained", (
            Target(f"sum by (role) (increase(pd_fsm_bootstrap_bad_requests_total[{RATE}]))"
                   " or sum by (role) (increase(pd_fsm_worker_backend_request_failures"
                   f"_total[{RATE}])) or sum by (role) (increase(pd_fsm_proxy_request"
                   f"_failures_total[{RATE}]))", "{{role}}"),
            Target(f'sum by (key) (increase(pd_fsm_worker_backend_side_channel'
                   f'{{key=~"malformed|replayed|stale|oversized|wrong_parts"}}[{RATE}]))',
                   "side channel {{key}}"),
        ), description="registry writes refused (bad bodies, bad signatures); requests whose "
                       "handler raised (answered 500); side-channel frames dropped"),
    ))


def _roles_and_planner() -> DashboardRow:
    """Each worker's role and epoch, role switches and the planner's view."""
    return DashboardRow("Roles and the planner", (
        Panel("Worker roles (1: served) and role epochs", (
            Target("pd_fsm_worker_role == 1", "{{name}} {{key}}"),
            Target("pd_fsm_worker_role_epoch", "{{name}} epoch"),
        ), description="a worker's role changes at runtime (POST /switch_role); its epoch "
                       "counts completed switches"),
        Panel("Role switches and planner decisions", (
            Target(f"sum by (name, outcome) (increase(pd_fsm_worker_role_switches_total"
                   f"[{RATE}]))", "{{name}} switch {{outcome}}"),
            Target(f"sum by (kind, to, outcome) (increase(pd_fsm_planner_decisions_total"
                   f"[{RATE}]))", "planner {{kind}} {{to}} {{outcome}}"),
        ), description="a switchable worker's series start at 0; planner decisions carry "
                       "their reasons in its log and GET /decisions"),
        Panel("Planner: pressure per side and workers per role", (
            Target("pd_fsm_planner_pressure", "{{side}} pressure"),
            Target("pd_fsm_planner_workers", "{{side}} workers"),
        ), description="pressure 1.0 is at the target (TTFT for P, ITL or KV for D); "
                       "`pd-fsm cluster --planner` runs the planner"),
    ))


def _restarts() -> DashboardRow:
    """Processes up, restarted, and the restarts of peers D saw."""
    return DashboardRow("Restarts", (
        Panel("Up, restarts and peer incarnations", (
            Target('up{job="pd_fsm"}', "{{name}} up"),
            Target("resets(pd_fsm_worker_backend_steps_total[1h])", "{{name}} restarts (1h)"),
            Target('pd_fsm_worker_backend_pd_events{key="peer_restarts"}',
                   "{{name}} peer restarts seen"),
        ), description="a restarted worker's counters start again (resets); D counts each "
                       "new incarnation of a P it pulls from"),
    ))


def panel_exprs() -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) of every query on the dashboard."""
    for row in rows():
        for panel in row.panels:
            for target in panel.targets:
                yield panel.title, target.expr


# ----------------------------------------------------------------------------- rules


@attrs.frozen
class Rule:
    name: str  # a recording rule's series, or an alert's name
    expr: str
    alert: bool = False
    for_: str = ""
    severity: str = "warning"
    summary: str = ""
    labels: tuple[tuple[str, str], ...] = ()


def _q_fixed(q: float, metric: str, by: str = "", selector: str = "", window: str = "1m"
             ) -> str:
    return _q(q, metric, by, selector).replace(RATE, window)


def rules() -> tuple[Rule, ...]:
    recording = [
        Rule("pd_fsm:goodput_requests:rate1m",
             f'sum by (role) (rate(pd_fsm_worker_requests_slo_total{{met="true", {SERVING}}}'
             "[1m]))"),
        Rule("pd_fsm:slo_attainment:ratio_rate1m",
             f'sum by (role) (rate(pd_fsm_worker_requests_slo_total{{met="true", {SERVING}}}'
             f"[1m])) / sum by (role) (rate(pd_fsm_worker_requests_slo_total{{{SERVING}}}[1m]))"),
    ]
    for q in (0.5, 0.99):
        tag = f"p{int(q * 100)}"
        recording += [
            Rule(f"pd_fsm:ttft_seconds:{tag}_1m", _q_fixed(
                q, "pd_fsm_worker_time_to_first_token_seconds", "role", SERVING)),
            Rule(f"pd_fsm:itl_seconds:{tag}_1m", _q_fixed(
                q, "pd_fsm_worker_inter_token_latency_seconds", "role", SERVING)),
        ]
        recording += [
            Rule(f"pd_fsm:phase_seconds:{tag}_1m",
                 _q_fixed(q, f"pd_fsm_worker_{phase}_seconds"), labels=(("phase", phase),))
            for phase in (*P_PHASES, *D_PHASES)
        ]
    alerts = [
        Rule("PdFsmWorkerDown", 'up{job="pd_fsm"} == 0', True, "1m", "critical",
             "{{ $labels.name }} ({{ $labels.instance }}) does not answer its /metrics"),
        Rule("PdFsmWorkerMissingFromRegistry",
             'count by (role) (up{job="pd_fsm", role=~"prefill|decode"} == 1) > on (role) '
             'sum by (role) (label_replace(pd_fsm_bootstrap_instances_by_role, "role", "$1", '
             '"key", "(.*)"))', True, "1m", "critical",
             "fewer {{ $labels.role }} workers are in the registry than are up: routers "
             "cannot find them"),
        Rule("PdFsmRegistryHeartbeatsFailing",
             "increase(pd_fsm_worker_backend_bootstrap_heartbeat_failures_total[5m]) > 0",
             True, "1m", "warning",
             "{{ $labels.name }}'s registry heartbeats fail: it expires after the TTL"),
        Rule("PdFsmKvPagesExhausted",
             "(pd_fsm_worker_backend_free_pages + pd_fsm_worker_backend_cached_pages) "
             "< 0.05 * pd_fsm_worker_backend_total_pages", True, "2m", "warning",
             "{{ $labels.name }} has under 5 % of its KV pages free: requests queue"),
        Rule("PdFsmPullsFailing",
             'increase(pd_fsm_worker_backend_transfer{key="pulls_failed"}[5m]) > 0',
             True, "1m", "warning", "{{ $labels.name }}'s KV pulls fail"),
        Rule("PdFsmItlP99OverSlo",
             _q_fixed(0.99, "pd_fsm_worker_inter_token_latency_seconds", "role", SERVING,
                      "5m") + f" > {SLO_ITL_S}", True, "5m", "warning",
             f"{{{{ $labels.role }}}} inter-token latency p99 over the {SLO_ITL_S * 1000:g} ms "
             "SLO for 5 minutes"),
        Rule("PdFsmTtftP99OverSlo",
             _q_fixed(0.99, "pd_fsm_worker_time_to_first_token_seconds", "role", SERVING,
                      "5m") + f" > {SLO_TTFT_S}", True, "5m", "warning",
             f"{{{{ $labels.role }}}} time to first token p99 over the {SLO_TTFT_S:g} s SLO "
             "for 5 minutes"),
        Rule("PdFsmContainedFailures",
             "increase(pd_fsm_worker_backend_request_failures_total[5m]) > 0 or "
             "increase(pd_fsm_proxy_request_failures_total[5m]) > 0 or "
             "increase(pd_fsm_bootstrap_request_failures_total[5m]) > 0",
             True, "0m", "warning",
             "{{ $labels.name }} answered a request with a 500 (a handler raised; see its log)"),
    ]
    return (*recording, *alerts)


def rules_yaml() -> str:
    """The rule file, as Prometheus reads it (YAML; written as JSON, which YAML contains)."""
    recording = [_rule_json(r) for r in rules() if not r.alert]
    alerting = [_rule_json(r) for r in rules() if r.alert]
    groups = {"groups": [{"name": "pd_fsm_recording", "interval": "15s", "rules": recording},
                         {"name": "pd_fsm_alerts", "rules": alerting}]}
    return "# Generated by `python -m pd_fsm.io_trio.cluster.observability`: edit that.\n" + \
        json.dumps(groups, indent=2) + "\n"


def _rule_json(r: Rule) -> dict[str, Any]:
    if not r.alert:
        out: dict[str, Any] = {"record": r.name, "expr": r.expr}
        if r.labels:
            out["labels"] = dict(r.labels)
        return out
    return {"alert": r.name, "expr": r.expr, "for": r.for_,
            "labels": {"severity": r.severity}, "annotations": {"summary": r.summary}}


# ----------------------------------------------------------------------------- Grafana


def dashboard() -> dict[str, Any]:
    """A Grafana dashboard (schema 39), importable as is: it asks for a Prometheus data source."""
    panels: list[dict[str, Any]] = []
    y = 0
    next_id = 1
    for row in rows():
        panels.append({"type": "row", "title": row.title, "id": next_id, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id += 1
        y += 1
        for i, panel in enumerate(row.panels):
            panels.append(_panel_json(panel, next_id, x=(i % 3) * 8, y=y + (i // 3) * 8))
            next_id += 1
        y += ((len(row.panels) + 2) // 3) * 8
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "title": "pd_fsm",
        "uid": "pd-fsm",
        "description": "pd_fsm prefill/decode disaggregation: requests, PD phases, data plane, "
                       "capacity, control plane. Generated by "
                       "`python -m pd_fsm.io_trio.cluster.observability`.",
        "tags": ["pd_fsm", "llm", "disaggregation"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "templating": {"list": [{"name": "datasource", "label": "Prometheus",
                                 "type": "datasource", "query": "prometheus",
                                 "current": {}, "hide": 0}]},
        "panels": panels,
    }


def _panel_json(panel: Panel, id_: int, x: int, y: int) -> dict[str, Any]:
    return {
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "id": id_,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
        "fieldConfig": {"defaults": {
            "unit": panel.unit,
            "custom": {"stacking": {"mode": "normal" if panel.stacked else "none"},
                       "fillOpacity": 30 if panel.stacked else 0},
        }, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"},
                    "tooltip": {"mode": "multi"}},
        "targets": [{"refId": chr(ord("A") + i), "expr": t.expr, "legendFormat": t.legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, t in enumerate(panel.targets)],
    }


# ----------------------------------------------------------------------------- targets


def scrape_targets(urls: dict[str, str]) -> list[dict[str, Any]]:
    """File-based service discovery for a cluster's processes: ``urls`` maps each process's
    name (``bootstrap``, ``prefill-0``, ``proxy``, ...) to its base URL."""
    out: list[dict[str, Any]] = []
    for name, url in sorted(urls.items()):
        scheme, _, hostport = url.partition("://")
        role = name.rsplit("-", 1)[0] if name[-1].isdigit() else name
        out.append({"targets": [hostport.rstrip("/")],
                    "labels": {"role": role, "name": name, "__scheme__": scheme}})
    return out


def write_targets(path: Path, urls: dict[str, str]) -> None:
    """The file-based service discovery file for ``urls``, replaced whole (Prometheus may read
    it at any moment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(scrape_targets(urls), indent=2) + "\n")
    tmp.replace(path)


def prepare_prometheus(dest: Path, urls: dict[str, str], *, scrape_interval: str | None = None,
                       ca_file: Path | None = None) -> Path:
    """A Prometheus configuration folder at ``dest`` for a cluster: the shipped
    ``deploy/prometheus`` (config and rules) and the cluster's targets. ``scrape_interval``
    replaces the shipped 5 s (tests scrape every second); ``ca_file`` verifies HTTPS workers
    (``pd-fsm cluster --tls``). Returns the config file's path."""
    source = deploy_dir() / "prometheus"
    text = (source / "prometheus.yml").read_text()
    if scrape_interval is not None:
        text = text.replace("scrape_interval: 5s", f"scrape_interval: {scrape_interval}")
    if ca_file is not None:
        text = text.replace("  - job_name: pd_fsm\n", "  - job_name: pd_fsm\n    tls_config:\n"
                            f"      ca_file: {json.dumps(str(ca_file))}\n")
    (dest / "rules").mkdir(parents=True, exist_ok=True)
    for rule_file in sorted((source / "rules").glob("*.yml")):
        shutil.copy(rule_file, dest / "rules" / rule_file.name)
    write_targets(dest / "targets" / "pd_fsm_cluster.json", urls)
    config = dest / "prometheus.yml"
    config.write_text(text)
    return config


def deploy_dir() -> Path:
    """``deploy/`` of this source tree (the cluster runner and the tests read it)."""
    return Path(__file__).resolve().parents[3] / "deploy"


def write(root: Path) -> list[Path]:
    """Write the dashboard and the rule file under ``root`` (a ``deploy/`` folder)."""
    dash = root / "grafana" / "pd_fsm.json"
    rule_file = root / "prometheus" / "rules" / "pd_fsm.rules.yml"
    for path in (dash, rule_file):
        path.parent.mkdir(parents=True, exist_ok=True)
    dash.write_text(json.dumps(dashboard(), indent=2) + "\n")
    rule_file.write_text(rules_yaml())
    return [dash, rule_file]


if __name__ == "__main__":
    for written in write(Path(sys.argv[1]) if len(sys.argv) > 1 else deploy_dir()):
        print(written)
