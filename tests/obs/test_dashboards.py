"""The Grafana dashboards and the alert rules, offline: every panel's and rule's PromQL parses
(promql-parser) and names only Kafila's metrics: the live dashboards and the rules the series
kafila.obs.metrics defines, the Bench run dashboard the series `kafila-ops fleet traces` backfills
(ops.observe.BACKFILL); the provisioning and the compose profile hold together. Against a real session
and a real Prometheus: tests/obs/test_live_session.py; against backfilled blocks: tests/ops/test_observe.py
and the fleet lab (tests/ops/test_fleet_lab.py)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser as pp
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
# Dashboards that read the series `kafila-ops fleet traces` backfills, not a live session's
BACKFILLED_DASHBOARDS = [d for d in DASHBOARDS if d.name == "bench-run.json"]
LIVE_DASHBOARDS = [d for d in DASHBOARDS if d not in BACKFILLED_DASHBOARDS]
RULES = ROOT / "prometheus" / "rules" / "kafila-alerts.yml"
PROMETHEUS = shutil.which("prometheus")
# Grafana's variables as the dashboards use them: every session, and a rate window of several scrapes
# ($__range: the dashboard's time range, over which the Bench run finds the backfilled samples)
VARIABLES = {"$session": ".*", "$fleet": ".*", "$__rate_interval": "1m", "$__range": "6h"}
# Series the session does not feed yet: their panels must parse and name exported metrics, but may be
# empty until it does (none now: the session feeds every series its dashboards read).
AWAITING_SESSION_WIRING: frozenset[str] = frozenset()


def panel_queries(path: Path) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every target of every panel, and every templating query, of a dashboard."""
    board = json.loads(path.read_text())
    for panel in board["panels"]:
        for target in panel["targets"]:
            yield f"{path.name}: panel {panel['title']!r} {target['refId']}", target["expr"]
    for var in board["templating"]["list"]:
        if var["type"] != "query":  # the datasource variable: a choice of datasource, no PromQL
            continue
        query = var["query"]["query"]
        if query.startswith("label_values("):  # Grafana's own function over a series selector
            yield f"{path.name}: variable {var['name']}", query[len("label_values(") :].rsplit(",", 1)[0]


def rule_queries() -> Iterator[tuple[str, str]]:
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            yield f"rule {rule.get('alert') or rule.get('record')}", rule["expr"]


def substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def selectors(node: Any) -> Iterator[pp.VectorSelector]:
    """Every vector selector in a parsed PromQL expression."""
    if isinstance(node, pp.VectorSelector):
        yield node
    elif isinstance(node, pp.MatrixSelector):
        yield node.vector_selector
    elif isinstance(node, pp.BinaryExpr):
        yield from selectors(node.lhs)
        yield from selectors(node.rhs)
    elif isinstance(node, pp.Call):
        for arg in node.args:
            yield from selectors(arg)
    elif isinstance(node, pp.AggregateExpr):
        yield from selectors(node.expr)
        if node.param is not None:
            yield from selectors(node.param)
    elif isinstance(node, pp.ParenExpr | pp.UnaryExpr | pp.SubqueryExpr):
        yield from selectors(node.expr)


def metric_names(expr: str) -> set[str]:
    names = set()
    for vs in selectors(pp.parse(expr)):
        assert vs.name, f"{expr}: a selector without a metric name"
        names.add(vs.name)
    return names


def defined_metrics() -> set[str]:
    """Every metric kafila.obs.metrics defines, series or not yet (names as Prometheus stores them)."""
    from kafila.obs.metrics import REGISTRY

    names = set()
    for family in REGISTRY.collect():
        names.add(family.name + ("_total" if family.type == "counter" else ""))
        names.update(s.name for s in family.samples)
    return names


def test_every_query_parses_and_names_metrics_of_kafila_only() -> None:
    """The offline half (no Prometheus needed): parse, and name only kafila_ series, the process
    series and `up`."""
    queries = [q for d in DASHBOARDS for q in panel_queries(d)] + list(rule_queries())
    assert len(DASHBOARDS) == 3 and len(queries) > 40
    for where, expr in queries:
        for name in metric_names(substitute(expr)):
            assert name.startswith(("kafila_", "process_")) or name == "up", f"{where}: {name}"


def test_the_bench_run_reads_exactly_the_backfilled_series_and_the_others_only_live_ones() -> None:
    """The Bench run dashboard shows every series `fleet traces` backfills and nothing else; the live
    dashboards and the rules never name a backfilled one (that they name exported series is checked
    against a live session: tests/obs/test_live_session.py)."""
    from ops.observe import BACKFILL

    assert [d.name for d in BACKFILLED_DASHBOARDS] == ["bench-run.json"]
    queries = [q for d in BACKFILLED_DASHBOARDS for _, q in panel_queries(d)]
    bench = {name for q in queries for name in metric_names(substitute(q))}
    assert bench == set(BACKFILL)
    assert not defined_metrics() & set(BACKFILL)
    for where, expr in [q for d in LIVE_DASHBOARDS for q in panel_queries(d)] + list(rule_queries()):
        for name in metric_names(substitute(expr)):
            assert not name.startswith("kafila_trace_"), f"{where}: {name} is backfilled, not live"


def test_backfilled_series_are_named_in_base_units() -> None:
    """Prometheus's naming: base units as the last word (seconds, bytes), no abbreviated units."""
    from ops.observe import BACKFILL

    for name in BACKFILL:
        assert name.startswith("kafila_trace_"), name
        assert not any(f"_{unit}" in name for unit in ("ms", "us", "kb", "mb", "secs")), name
        assert name.endswith(("_seconds", "_bytes", "_tokens", "_per_second")), name


def test_dashboards_pick_their_datasource_so_they_import_into_any_grafana() -> None:
    """No panel or variable names a datasource uid: each reads the `datasource` variable, a choice
    among the Prometheus datasources of whichever Grafana the dashboard is imported into (the
    provisioned one here, as Grafana's default)."""
    provisioned = yaml.safe_load((ROOT / "grafana/provisioning/datasources/kafila.yml").read_text())
    [ds] = provisioned["datasources"]
    assert ds["type"] == "prometheus" and ds["isDefault"] is True
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        variable, *others = board["templating"]["list"]
        assert variable["name"] == "datasource" and variable["type"] == "datasource", path.name
        assert variable["query"] == "prometheus", path.name
        wanted = {"type": "prometheus", "uid": "${datasource}"}
        assert all(p["datasource"] == wanted for p in board["panels"]), path.name
        assert all(v["datasource"] == wanted for v in others), path.name
        assert "kafila-prometheus" not in path.read_text(), path.name
        assert len({p["id"] for p in board["panels"]}) == len(board["panels"]), path.name


def test_the_compose_monitoring_profile_mounts_what_the_repository_holds() -> None:
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    profiles = {"prometheus": ["monitoring"], "alertmanager": ["monitoring"], "grafana": ["grafana"]}
    for name, profile in profiles.items():
        service = compose["services"][name]
        assert service["profiles"] == profile
        for volume in service["volumes"]:
            source = volume.split(":", 1)[0]
            if source.startswith(".."):
                assert (ROOT / "compose" / source).resolve().exists(), f"{name}: {source}"
    for name in ("prometheus", "alertmanager"):  # built from Debian's packages: no registry image
        build = compose["services"][name]["build"]
        assert (ROOT / "compose" / build["context"] / build["dockerfile"]).is_file(), name
        assert build["args"]["PACKAGE"] in ("prometheus", "prometheus-alertmanager"), name
    config = yaml.safe_load((ROOT / "prometheus" / "prometheus.yml").read_text())
    [alerting] = config["alerting"]["alertmanagers"]
    [am] = alerting["static_configs"][0]["targets"]
    assert am.split(":")[0] in compose["services"]  # the alertmanager service by name
    [static] = next(j for j in config["scrape_configs"] if j["job_name"] == "kafila-rendezvous")[
        "static_configs"
    ]
    assert static["targets"][0].split(":")[0] in compose["services"]  # the rendezvous service by name


# what a time series panel draws, by the metric its query reads (rates per second unless multiplied)
UNITS = {
    "process_cpu_seconds_total": "short",  # CPU cores busy
    "process_resident_memory_bytes": "bytes",
    "kafila_rendezvous_relay_packets_total": "pps",
    "kafila_rendezvous_udp_datagrams_total": "pps",
}


def target_units(panel: dict[str, Any]) -> dict[str, tuple[str | None, str]]:
    """refId -> (unit, axis placement) of a panel's target: its default, or its override."""
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    got = {t["refId"]: (defaults.get("unit"), "auto") for t in panel["targets"]}
    for o in panel.get("fieldConfig", {}).get("overrides", []):
        if o["matcher"]["id"] == "byFrameRefID":
            props = {p["id"]: p["value"] for p in o["properties"]}
            unit, axis = got[o["matcher"]["options"]]
            got[o["matcher"]["options"]] = (props.get("unit", unit), props.get("custom.axisPlacement", axis))
    return got


def test_every_series_has_its_unit_and_two_units_never_share_an_axis() -> None:
    """CPU (cores) beside memory (bytes), bytes beside datagrams per second: each its unit, the
    second on an axis of its own; datagrams are never drawn in bytes per second."""
    for path in LIVE_DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            if panel["type"] != "timeseries":
                continue
            units = target_units(panel)
            for t in panel["targets"]:
                for name in metric_names(substitute(t["expr"])) & set(UNITS):
                    assert units[t["refId"]][0] == UNITS[name], (path.name, panel["title"], t["refId"], units)
            axes = {unit: {axis for u, axis in units.values() if u == unit} for unit, _ in units.values()}
            placed = [axis for placements in axes.values() for axis in placements]
            assert len(axes) == 1 or sorted(set(placed)) == sorted(placed), (path.name, panel["title"], units)


def edge_views(paths: dict[str, dict[str, str]]) -> list[dict[str, str]]:
    """kafila_edge_info as each member of ring a->b->c->d exports it, `paths[m]` the paths member m's
    own links run (edge -> path): each member's /session document fed to kafila.obs.metrics in turn,
    its series labelled with its own instance as Prometheus scrapes them."""
    from prometheus_client.parser import text_string_to_metric_families

    from kafila.obs import metrics
    from kafila.session.ring.info import RingInfo

    order = ("a", "b", "c", "d")
    planned = {f"{m}->{order[(i + 1) % 4]}": "direct" for i, m in enumerate(order)}
    blocks = {m: (3 * i, 3 * i + 3) for i, m in enumerate(order)}
    series = []
    for me, own in paths.items():
        info = RingInfo(
            "s1", "tiny", "kafila", order, blocks, {}, planned | own, planned, dict.fromkeys(own, me)
        )
        metrics.observe_document(info.document("serving", None) | {"epoch": 1, "me": me, "head": "a"})
        for family in text_string_to_metric_families(metrics.exposition().decode()):
            series += [s.labels | {"instance": me} for s in family.samples if s.name == "kafila_edge_info"]
    return series


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_the_edges_table_shows_one_row_per_edge_measured_where_an_end_measured_it(tmp_path: Path) -> None:
    """Every member exports every edge of its plan (its own two as its links run, the others as
    planned), so one edge is several series; the table's query, run by promtool on the series four
    members export, gives one row per edge: an end's relay before its other end's direct path (a
    link that just fell back), a measured path before the plan's."""
    from tests.obs.promtool import promtool

    views = {
        "a": {"a->b": "direct", "d->a": "direct"},
        "b": {"a->b": "direct", "b->c": "direct"},
        "c": {"b->c": "direct", "c->d": "relay"},  # c's link to d fell back to the relay ...
        "d": {"c->d": "direct", "d->a": "direct"},  # ... which d has not seen yet
    }
    exported = edge_views(views)
    assert len(exported) == 16  # four members, four edges each
    [panel] = [p for p in json.loads((ROOT / "grafana/dashboards/session.json").read_text())["panels"]
               if p["title"] == "Edges: planned and measured path"]  # fmt: skip
    [target] = panel["targets"]
    assert target["instant"] and target["format"] == "table"
    expr = substitute(target["expr"])

    def selector(labels: dict[str, str]) -> str:
        return "kafila_edge_info{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"

    (tmp_path / "t.yml").write_text(yaml.safe_dump({"evaluation_interval": "15s", "tests": [{
        "interval": "15s", "input_series": [{"series": selector(s), "values": "1x8"} for s in exported],
        "promql_expr_test": [{"expr": expr, "eval_time": "1m", "exp_samples": []}]}]}))  # fmt: skip
    out = promtool("test", "rules", str(tmp_path / "t.yml")).stdout
    got = out.partition("got:")[2]
    rows = [dict(re.findall(r'(\w+)="([^"]*)"', row)) for row in re.findall(r"\{[^}]*\}", got)]
    assert sorted((r["edge"], r["path"]) for r in rows) == [
        ("a->b", "direct"), ("b->c", "direct"), ("c->d", "relay"), ("d->a", "direct")
    ], out  # fmt: skip
    ends = {r["edge"]: r["measured_by"] for r in rows}
    assert ends["c->d"] == "c" and all(ends[e] in e.split("->") for e in ends), rows
    assert {r["session"] for r in rows} == {"s1"} and all(r["planned_path"] == "direct" for r in rows)
