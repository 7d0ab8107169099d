"""The chart's Grafana dashboards and alert rules: rendered with their values on and off and
labelled for Grafana's dashboard sidecar and the prometheus-operator's rule selector, the
committed JSON equal to what the generator writes, and the rendered rules checked and
unit-tested by the real promtool. (e2e/tests/monitoring.rs asks every dashboard query and rule
of a real Prometheus scraping real engines.)"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from render import CHART, by_kind, render

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "charts" / "ferrite" / "rules" / "ferrite-alerts.yaml"
DASHBOARDS = ROOT / "charts" / "ferrite" / "dashboards"
RULE_TESTS = ROOT / "tests" / "monitoring" / "alerts.test.yaml"
RUNBOOKS = ROOT / "docs" / "monitoring.md"


def promtool() -> Path:
    """promtool from the cache `make k8s` fills (FERRITE_PROMETHEUS_DIR, else the script's)."""
    folder = os.environ.get("FERRITE_PROMETHEUS_DIR") or subprocess.run(
        [str(ROOT / "scripts" / "build-prometheus.sh"), "--print-dir"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    return Path(folder) / "promtool"


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_dashboards_and_rules_are_off_by_default():
    kinds = by_kind(render(None, "ferrite", "ferrite-system"))
    assert "ConfigMap" not in kinds and "PrometheusRule" not in kinds


def test_dashboards_render_as_configmaps_for_the_grafana_sidecar():
    values = {"metrics": {"dashboards": {"enabled": True}}}
    maps = by_kind(render(values, "ferrite", "ferrite-system"))["ConfigMap"]
    files = sorted(p.name for p in DASHBOARDS.glob("*.json"))
    assert files == ["ferrite-control-plane.json", "ferrite-overview.json",
                     "ferrite-replicas.json"]
    assert sorted(m["metadata"]["name"] for m in maps) == [
        "ferrite-control-plane", "ferrite-overview", "ferrite-replicas"
    ]
    for m in maps:
        assert m["metadata"]["namespace"] == "ferrite-system"
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert m["metadata"]["annotations"] == {"grafana_folder": "Ferrite"}
        ((name, text),) = m["data"].items()
        assert json.loads(text) == json.loads((DASHBOARDS / name).read_text())
    # Where the sidecar looks, with the labels it selects by.
    values["metrics"]["dashboards"].update(
        {"namespace": "monitoring", "labels": {"team": "ml"}})
    maps = by_kind(render(values, "ml", "platform"))["ConfigMap"]
    for m in maps:
        assert m["metadata"]["name"].startswith("ml-ferrite-")
        assert m["metadata"]["namespace"] == "monitoring"
        assert m["metadata"]["labels"]["team"] == "ml"


def test_committed_dashboards_are_what_the_generator_writes():
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "dashboards.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def dashcheck(paths: list[Path]) -> subprocess.CompletedProcess:
    """tests/monitoring/dashcheck (Grafana's dashboard schema, as grafana-foundation-sdk types
    it) on `paths`; Go caches the build."""
    env = {**os.environ, "GOFLAGS": "-mod=readonly"}
    return subprocess.run(["go", "run", ".", *map(str, paths)],
                          cwd=ROOT / "tests" / "monitoring" / "dashcheck",
                          capture_output=True, text=True, env=env)


def test_dashboards_follow_grafanas_dashboard_schema(tmp_path):
    run = dashcheck(sorted(DASHBOARDS.glob("*.json")))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("OK ") == 3, run.stdout
    # A field the schema does not know is caught.
    dash = json.loads((DASHBOARDS / "ferrite-overview.json").read_text())
    dash["panels"][1]["fieldConfig"]["defaults"]["colour"] = "red"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dash))
    run = dashcheck([bad])
    assert run.returncode == 1 and "colour" in run.stdout, run.stdout + run.stderr


def test_dashboards_have_variables_for_namespace_llmservice_and_pod():
    for path in DASHBOARDS.glob("*.json"):
        dash = json.loads(path.read_text())
        names = [v["name"] for v in dash["templating"]["list"]]
        assert names[:3] == ["datasource", "namespace", "llmservice"], path.name
        if path.name == "ferrite-replicas.json":
            assert "pod" in names
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), path.name
        for panel in dash["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["title"] and panel["description"], panel
            assert panel["targets"], panel["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
            pos = panel["gridPos"]
            assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]


def test_prometheus_rule_renders_for_the_operators_rule_selector():
    values = {"metrics": {"prometheusRule": {"enabled": True,
                                             "labels": {"release": "kube-prometheus-stack"}}}}
    (rule,) = by_kind(render(values, "ferrite", "ferrite-system"))["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "ferrite-system"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == {"groups": yaml.safe_load(RULES.read_text())["groups"]}


def test_rendered_rules_pass_promtool_check_and_unit_tests(tmp_path):
    values = {"metrics": {"prometheusRule": {"enabled": True}}}
    (rule,) = by_kind(render(values, "ferrite", "ferrite-system"))["PrometheusRule"]
    # The unit tests name the rule file the chart's groups are written to.
    (tmp_path / "ferrite-alerts.yaml").write_text(yaml.safe_dump(rule["spec"]))
    (tmp_path / "alerts.test.yaml").write_text(RULE_TESTS.read_text())
    tool = str(promtool())
    check = subprocess.run([tool, "check", "rules", "ferrite-alerts.yaml"], cwd=tmp_path,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in check.stdout + check.stderr
    test = subprocess.run([tool, "test", "rules", "alerts.test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert test.returncode == 0, test.stdout + test.stderr


def test_a_broken_rule_fails_the_promtool_unit_tests(tmp_path):
    """The unit tests can fail: with the stalled-engine alert's threshold changed, they do."""
    text = RULES.read_text().replace("increase(vllm:generation_tokens_total[2m])) == 0",
                                     "increase(vllm:generation_tokens_total[2m])) < 0")
    assert text != RULES.read_text()
    (tmp_path / "ferrite-alerts.yaml").write_text(text)
    (tmp_path / "alerts.test.yaml").write_text(RULE_TESTS.read_text())
    test = subprocess.run([str(promtool()), "test", "rules", "alerts.test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert test.returncode != 0
    assert "FerriteEngineStalled" in test.stdout + test.stderr


def test_every_alert_has_its_words_a_runbook_and_a_unit_test_in_which_it_fires():
    runbooks = RUNBOOKS.read_text()
    anchors = {re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
               for h in re.findall(r"^#+ (.+)$", runbooks, flags=re.M)}
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    for a in alerts():
        name = a["alert"]
        ann = a["annotations"]
        assert ann["summary"] and ann["description"], name
        assert a["labels"]["severity"] in ("warning", "critical"), name
        anchor = ann["runbook_url"].rsplit("#", 1)[1]
        assert anchor == name.lower() and anchor in anchors, f"{name}: no runbook section"
        checks = [c for t in tests for c in t["alert_rule_test"] if c["alertname"] == name]
        fires = [c for c in checks if c.get("exp_alerts")]
        assert fires, f"{name}: no unit test in which it fires"


@pytest.mark.parametrize("field", ["enabled", "labels"])
def test_schema_refuses_wrong_monitoring_values(field):
    values = {"metrics": {"prometheusRule": {field: "yes" if field == "enabled" else ["a"]}}}
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError) as err:
            chart.validate_schema(values)
    assert field in str(err.value)
