"""The Helm chart, rendered and linted by the real Helm SDK (helm-python-sdk, Helm v4).

The objects are applied to a real API server, and the operator run with exactly the chart's
RBAC, by operator/tests/chart.rs; these tests check what Helm itself decides: lint, the
values schema, and what each value renders to.
"""

from pathlib import Path

import helm_python as helm
import pytest
import yaml

from render import CHART, by_kind, render

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def custom_values() -> dict:
    return yaml.safe_load((HERE / "values-custom.yaml").read_text())


@pytest.mark.parametrize("values", [None, "custom"], ids=["defaults", "custom"])
def test_lint_is_clean(values):
    report = helm.lint(str(CHART), custom_values() if values else None, strict=True)
    assert report["errors"] == []
    # Severity 2 = warning, 3 = error; the only info-level finding allowed is the icon.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_crd_is_the_generated_one():
    """One source of truth: the chart ships exactly what `make crds` writes."""
    with helm.Chart.load(str(CHART)) as chart:
        crds = chart.crds
    assert [c["name"] for c in crds] == ["crds/llmservice.yaml"]
    assert crds[0]["data"] == (ROOT / "crds" / "llmservice.yaml").read_text()


def test_defaults_install_a_hardened_cluster_wide_operator():
    kinds = by_kind(render(None, "ferrite", "ferrite-system"))
    assert sorted(kinds) == [
        "ClusterRole", "ClusterRoleBinding", "Deployment", "Role", "RoleBinding",
        "Service", "ServiceAccount",
    ]
    dep = kinds["Deployment"][0]
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ferrite"
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/ferrite-serving/ferrite-operator:0.1.0"
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert c["resources"]["requests"] and c["resources"]["limits"]
    # Leader election stays on: no --no-leader-election, and the Lease is named after the release.
    assert "--no-leader-election" not in c["args"]
    assert "--lease-name=ferrite" in c["args"]
    assert "--engine-image=ghcr.io/ferrite-serving/ferrite-engine:0.1.0" in c["args"]
    assert "--inference-pools" not in c["args"]
    assert not any(a.startswith("--namespace") for a in c["args"])
    # The binding gives the ClusterRole to the chart's ServiceAccount.
    binding = kinds["ClusterRoleBinding"][0]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ferrite", "namespace": "ferrite-system"}
    ]
    # Least privilege: no wildcard, no reading of other Secrets (only the group secrets the
    # operator makes, by name: get, create, delete), no deletes of what users own.
    for rule in kinds["ClusterRole"][0]["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        if "secrets" in rule["resources"]:
            assert rule["resources"] == ["secrets"]
            assert set(rule["verbs"]) == {"get", "create", "delete"}
        if "llmservices" in rule["resources"]:
            assert set(rule["verbs"]) == {"get", "list", "watch"}
    svc = next(s for s in kinds["Service"] if s["metadata"]["name"] == "ferrite-metrics")
    assert svc["spec"]["ports"][0]["port"] == 8080


def test_custom_values_render_a_namespaced_operator_with_monitors():
    kinds = by_kind(render(custom_values(), "ml", "platform"))
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    roles = {r["metadata"]["name"]: r for r in kinds["Role"]}
    assert roles["ml-ferrite"]["metadata"]["namespace"] == "team-a"
    assert roles["ml-ferrite-leader-election"]["metadata"]["namespace"] == "platform"
    binding = next(b for b in kinds["RoleBinding"] if b["metadata"]["name"] == "ml-ferrite")
    assert binding["metadata"]["namespace"] == "team-a"
    assert binding["subjects"][0] == {
        "kind": "ServiceAccount", "name": "ferrite-controller", "namespace": "platform"
    }
    dep = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "ml-ferrite")
    assert dep["spec"]["replicas"] == 2
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "registry.example.com/ferrite/operator:0.1.0-rc1"
    assert c["imagePullPolicy"] == "Always"
    assert "--namespace=team-a" in c["args"]
    assert "--engine-image=registry.example.com/ferrite/engine:0.1.0-custom" in c["args"]
    assert "--drain-timeout-seconds=120" in c["args"]
    assert "--autoscale-interval=10" in c["args"]
    assert "--inference-pools" in c["args"]
    assert {"name": "RUST_LOG", "value": "ferrite_operator=debug"} in c["env"]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["tolerations"][0]["key"] == "dedicated"
    assert pod["priorityClassName"] == "system-cluster-critical"
    sa = next(a for a in kinds["ServiceAccount"] if a["metadata"]["name"] == "ferrite-controller")
    assert "iam.gke.io/gcp-service-account" in sa["metadata"]["annotations"]
    sm = kinds["ServiceMonitor"][0]
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    pm = kinds["PodMonitor"][0]
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
    # The engines' series carry the LLMService they serve, which the dashboards select by.
    assert pm["spec"]["podMetricsEndpoints"][0] == {
        "port": "http", "path": "/metrics", "interval": "10s",
        "relabelings": [{
            "sourceLabels": ["__meta_kubernetes_pod_label_serving_ferrite_dev_llmservice"],
            "targetLabel": "llmservice",
        }],
    }
    # The operator's series name their LLMService themselves; the router has its own monitor.
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
    router_sm = next(m for m in kinds["ServiceMonitor"]
                     if m["metadata"]["name"] == "ml-ferrite-router")
    assert router_sm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "ferrite-router"


def test_the_router_is_installed_by_default_with_its_own_least_privilege():
    kinds = by_kind(render(None, "ferrite", "ferrite-system"))
    dep = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "ferrite-router")
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ferrite-router"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["terminationGracePeriodSeconds"] == 45
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/ferrite-serving/ferrite-router:0.1.0"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert "--listen=0.0.0.0:8000" in c["args"] and "--load-factor=1.25" in c["args"]
    assert not any(a.startswith("--namespace") for a in c["args"])
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # The cluster's OpenAI endpoint: Service `ferrite`, port 8000, selecting the router only.
    svc = next(s for s in kinds["Service"] if s["metadata"]["name"] == "ferrite")
    assert svc["spec"]["ports"][0]["port"] == 8000
    assert svc["spec"]["selector"]["app.kubernetes.io/name"] == "ferrite-router"
    role = next(r for r in kinds["ClusterRole"] if r["metadata"]["name"] == "ferrite-router")
    assert role["rules"] == [
        {"apiGroups": ["serving.ferrite.dev"], "resources": ["llmservices"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["serving.ferrite.dev"], "resources": ["llmservices/status"],
         "verbs": ["patch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
         "verbs": ["list", "watch"]},
    ]
    binding = next(b for b in kinds["ClusterRoleBinding"]
                   if b["metadata"]["name"] == "ferrite-router")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "ferrite-router", "namespace": "ferrite-system"}
    ]
    # Namespaced: a Role in the watched namespace, and the flag.
    kinds = by_kind(render(custom_values(), "ml", "platform"))
    role = next(r for r in kinds["Role"] if r["metadata"]["name"] == "ml-ferrite-router")
    assert role["metadata"]["namespace"] == "team-a"
    dep = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "ml-ferrite-router")
    assert "--namespace=team-a" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    # Off: nothing of the router is rendered.
    off = render({"router": {"enabled": False}}, "ferrite", "x")
    assert not any("router" in o["metadata"]["name"] for o in off)
    assert [s["metadata"]["name"] for s in by_kind(off)["Service"]] == ["ferrite-metrics"]


@pytest.mark.parametrize(
    "values, field",
    [
        ({"operator": {"replicas": "two"}}, "replicas"),
        ({"operator": {"metricsPort": "8080"}}, "metricsPort"),
        ({"operator": {"image": {"pullPolicy": "Sometimes"}}}, "pullPolicy"),
        ({"watchNamespace": ["a", "b"]}, "watchNamespace"),
        ({"rbac": {"create": "yes"}}, "create"),
        ({"metrics": {"podMonitor": {"enabled": 1}}}, "enabled"),
        ({"autoscaler": {"intervalSeconds": 0}}, "intervalSeconds"),
        ({"replicas": 3}, "replicas"),
        ({"router": {"loadFactor": 0.5}}, "loadFactor"),
        ({"router": {"holdTimeoutSeconds": 0}}, "holdTimeoutSeconds"),
        ({"router": {"enable": True}}, "enable"),
    ],
)
def test_schema_rejects_wrong_values(values, field):
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError) as err:
            chart.validate_schema(values)
        # Rendering refuses them too, so `helm install` would.
        with pytest.raises(helm.HelmError):
            chart.render(values, name="ferrite", namespace="ferrite-system")
    assert field in str(err.value)


def test_notes_tell_how_to_reach_the_first_model():
    with helm.Chart.load(str(CHART)) as chart:
        notes = chart.render(None, name="ferrite", namespace="ferrite-system")[
            "ferrite/templates/NOTES.txt"
        ]
    assert "kubectl apply" in notes and "examples/smollm2-cpu.yaml" in notes
    assert "kubectl get llms" in notes
    assert "/v1/chat/completions" in notes
    assert "http://ferrite.ferrite-system.svc.cluster.local:8000/v1" in notes
    assert (ROOT / "examples" / "smollm2-cpu.yaml").exists()
