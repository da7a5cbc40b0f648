"""prometheus/: the scrape configuration and the alert rules pass promtool, and every alert has unit
tests (prometheus/rules/tests/) that make it fire and keep it silent."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.obs.promtool import needs_promtool, promtool

ROOT = Path(__file__).resolve().parents[2] / "prometheus"
DOC = ROOT.parent / "docs" / "observability.md"
RULES = ROOT / "rules" / "kafila-alerts.yml"
RULE_TESTS = sorted((ROOT / "rules" / "tests").glob("*.yml"))


def alerts() -> list[dict[str, object]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def test_every_alert_has_a_summary_a_runbook_a_severity_and_unit_tests_both_ways() -> None:
    tested: dict[str, list[bool]] = {}  # alert -> for each evaluation: expects it firing
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                tested.setdefault(t["alertname"], []).append(bool(t.get("exp_alerts")))
    for rule in alerts():
        name = str(rule["alert"])
        annotations = rule.get("annotations")
        assert isinstance(annotations, dict) and annotations.get("summary") and annotations.get("runbook"), (
            name
        )
        assert isinstance(rule.get("labels"), dict) and rule["labels"].get("severity"), name  # type: ignore[union-attr]
        assert True in tested.get(name, []), f"{name}: no unit test where it fires"
        assert False in tested.get(name, []), f"{name}: no unit test where it stays silent"


def test_the_documented_alerts_are_all_there() -> None:
    names = {str(r["alert"]) for r in alerts()}
    assert names >= {
        "KafilaMemberDown", "KafilaRingBroken", "KafilaReplanned", "KafilaStageSlowerThanPredicted",
        "KafilaEdgeRelayedAgainstPlan", "KafilaTimeToFirstTokenHigh", "KafilaRequestsWaiting",
        "KafilaKVCacheNearlyFull", "KafilaJoinsRejected", "KafilaRelayNearCapacity", "KafilaRendezvousDown",
        "KafilaRingDegraded", "KafilaSessionEnded", "KafilaSessionStuckForming", "KafilaRequestErrors",
        "KafilaRequestsRefused", "KafilaHopRoundTripAbovePrediction", "KafilaTargetsMissing",
    }  # fmt: skip


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def test_every_runbook_url_is_a_section_of_the_observability_doc_that_names_its_alert() -> None:
    sections: dict[str, str] = {}
    for part in re.split(r"^#{2,4} ", DOC.read_text(), flags=re.MULTILINE)[1:]:
        heading, _, body = part.partition("\n")
        sections[github_anchor(heading)] = heading + body
    for rule in alerts():
        url = str(rule["annotations"]["runbook_url"])  # type: ignore[index]
        path, _, anchor = url.partition("#")
        assert path == "docs/observability.md" and anchor in sections, (rule["alert"], url)
        assert str(rule["alert"]) in sections[anchor], (rule["alert"], anchor)
        assert str(rule["annotations"]["runbook"]) in sections[anchor], rule["alert"]  # type: ignore[index]


def test_no_runbook_advises_restarting_a_member_that_re_joins() -> None:
    """A member lost re-joins the serving session (the host plans it back in): the advice says so."""
    for rule in alerts():
        if "member" in str(rule["alert"]).lower() or "Degraded" in str(rule["alert"]):
            runbook = str(rule["annotations"]["runbook"])  # type: ignore[index]
            assert "restart" not in runbook and "re-joins" in runbook, rule["alert"]


def test_every_flag_a_runbook_names_is_a_flag_of_kafila_and_none_asks_for_a_port_forward() -> None:
    """Advice an operator can follow: each --flag it names is one of kafila's (the CLI reference is
    rendered from the parsers, tests/cli/test_reference.py), and it asks for no port forward, which a
    member cannot use (it binds any free UDP port)."""
    cli = (ROOT.parent / "docs" / "reference" / "cli.md").read_text()
    flags = set(re.findall(r"`(--[a-z][a-z0-9-]*)`", cli))
    for rule in alerts():
        runbook = str(rule["annotations"]["runbook"])  # type: ignore[index]
        named = set(re.findall(r"(--[a-z][a-z0-9-]*)", runbook))
        assert named <= flags, (rule["alert"], sorted(named - flags))
        assert "port forward" not in runbook, rule["alert"]


def test_members_come_from_file_sd_labelled_site_and_host() -> None:
    config = yaml.safe_load((ROOT / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    [static] = jobs["kafila-rendezvous"]["static_configs"]
    assert set(static["labels"]) == {"site", "host"}
    assert jobs["kafila-members"]["file_sd_configs"][0]["files"] == ["targets/*.yml", "targets/*.json"]
    for entry in yaml.safe_load((ROOT / "targets" / "members.yml.example").read_text()):
        assert set(entry["labels"]) == {"site", "host"}  # not `member`: members export that label


@needs_promtool
def test_promtool_checks_the_config_and_the_rules() -> None:
    done = promtool("check", "config", str(ROOT / "prometheus.yml"))
    assert done.returncode == 0, done.stdout
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0 and f"SUCCESS: {len(alerts())} rules found" in done.stdout, done.stdout


@needs_promtool
def test_promtool_unit_tests_of_every_rule_pass() -> None:
    assert RULE_TESTS
    done = promtool("test", "rules", *map(str, RULE_TESTS))
    assert done.returncode == 0 and "FAILED" not in done.stdout, done.stdout


def test_amtool_checks_the_alertmanager_config_and_routes_pages_and_warnings() -> None:
    """prometheus/alertmanager.yml passes Alertmanager's own check, and its routing tree sends a
    page and a warning of any session to the operators' receiver (amtool's route test)."""
    import shutil
    import subprocess

    import pytest

    amtool = shutil.which("amtool")
    if amtool is None:
        pytest.skip("no amtool (apt-get install --no-install-recommends prometheus-alertmanager)")
    config = str(ROOT / "alertmanager.yml")
    check = subprocess.run([amtool, "check-config", config], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    for severity in ("page", "warning"):
        route = subprocess.run(
            [amtool, "config", "routes", "test", f"--config.file={config}", "alertname=KafilaMemberDown",
             f"severity={severity}", "session=s1"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert route.returncode == 0 and route.stdout.strip() == "operators", route.stdout + route.stderr


@needs_promtool
def test_the_live_test_s_rate_arithmetic_is_prometheus_s(tmp_path: Path) -> None:
    """tests/obs/test_live_replan.py computes KafilaStageSlowerThanPredicted's ratio of two rates
    from raw samples; promtool evaluates the same ratio (its output names what it got: every
    expectation here is a deliberate 0) at times where a series is young (extrapolated only to its
    zero), inside, and at the window's end."""
    from tests.obs.test_live_replan import increase

    window = 37.5
    sums = [0.5 + 0.37 * i for i in range(11)] + [4.2 + 0.05 * i for i in range(31)]
    counts = [0.25 + i for i in range(11)] + [14.0 + i for i in range(31)]
    # 57: the window starts 0.5 s before the first samples, the count extrapolates to its zero 0.23 s before
    times = (25, 40, 57, 57.4, 58)
    ratio = f"rate(s[{int(window * 1000)}ms]) / rate(c[{int(window * 1000)}ms])"
    (tmp_path / "rules.yml").write_text(
        yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "r", "expr": ratio}]}]})
    )
    series = [
        {"series": n, "values": "_x20 " + " ".join(str(v) for v in vs)}
        for n, vs in (("s", sums), ("c", counts))
    ]
    tests = [
        {"expr": ratio, "eval_time": f"{int(t * 1000)}ms", "exp_samples": [{"labels": "{}", "value": 0}]}
        for t in times
    ]
    (tmp_path / "t.yml").write_text(yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1s",
        "tests": [{"interval": "1s", "input_series": series, "promql_expr_test": tests}]}))  # fmt: skip
    out = promtool("test", "rules", str(tmp_path / "t.yml")).stdout
    got = [float(v) for v in re.findall(r"got: \{\} (\S+)", out)]
    assert len(got) == len(times), out
    points = {n: [(20.0 + i, v) for i, v in enumerate(vs)] for n, vs in (("s", sums), ("c", counts))}
    ours = []
    for t in times:
        seconds, steps = increase(points["s"], t - window, t), increase(points["c"], t - window, t)
        assert seconds is not None and steps
        ours.append(seconds / steps)
    assert ours == pytest.approx(got, rel=1e-9)
