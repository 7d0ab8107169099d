#!/usr/bin/env python3
"""Generates the chart's Grafana dashboards (charts/ferrite/dashboards/*.json) from one typed
source, as vLLM generates its own: `make dashboards` writes them, and the chart test fails
when the committed JSON differs from what this prints.

Every engine series is selected by the labels the chart's PodMonitor gives it (`namespace`,
`pod`, and `llmservice` from the pod's `serving.ferrite.dev/llmservice` label); the operator's
and router's series carry `namespace`/`llmservice` and `model` themselves.

    scripts/dashboards.py [--check] [OUT_DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "charts" / "ferrite" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's dashboard JSON schema version the output follows.
SCHEMA_VERSION = 39

# Selectors of the template variables.
SVC = 'namespace=~"$namespace", llmservice=~"$llmservice"'
POD = SVC + ', pod=~"$pod"'
OPERATOR = 'namespace=~"$namespace", llmservice=~"$llmservice"'
RATE = "$__rate_interval"


@dataclass
class Target:
    """One PromQL query of a panel."""

    expr: str
    legend: str = ""
    instant: bool = False

    def to_json(self, ref: str) -> dict:
        return {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": self.expr,
            "legendFormat": self.legend or "__auto",
            "range": not self.instant,
            "instant": self.instant,
            "refId": ref,
        }


@dataclass
class Panel:
    """A panel: a time series, a stat or a table, with its queries and unit."""

    title: str
    description: str
    targets: list[Target]
    kind: str = "timeseries"
    unit: str = "short"
    width: int = 12
    height: int = 8
    min: float | None = 0
    max: float | None = None

    def to_json(self, pid: int, x: int, y: int) -> dict:
        defaults: dict = {"unit": self.unit}
        if self.min is not None:
            defaults["min"] = self.min
        if self.max is not None:
            defaults["max"] = self.max
        # Every field the dashboard schema requires of each panel kind's options.
        options: dict = {"tooltip": {"mode": "multi", "sort": "desc"},
                         "legend": {"displayMode": "list", "placement": "bottom",
                                    "showLegend": True, "calcs": []}}
        if self.kind == "stat":
            options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                       "colorMode": "value", "graphMode": "area", "textMode": "auto",
                       "justifyMode": "auto", "orientation": "auto", "wideLayout": True,
                       "showPercentChange": False, "percentChangeColorMode": "standard"}
        elif self.kind == "table":
            options = {"showHeader": True, "frameIndex": 0}
        return {
            "id": pid,
            "type": self.kind,
            "title": self.title,
            "description": self.description,
            "datasource": DATASOURCE,
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": options,
            "targets": [t.to_json(chr(ord("A") + i)) for i, t in enumerate(self.targets)],
        }


@dataclass
class Row:
    """A titled row of panels."""

    title: str
    panels: list[Panel]


@dataclass
class Variable:
    """A query variable: label values of `label` in `query`'s series."""

    name: str
    label: str
    query: str
    include_all: bool = True

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "label": self.label,
            "type": "query",
            "datasource": DATASOURCE,
            "definition": self.query,
            "query": {"query": self.query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2,
            "includeAll": self.include_all,
            "allValue": ".*" if self.include_all else None,
            "multi": True,
            "sort": 1,
            "current": {"text": "", "value": ""},
            "options": [],
        }


@dataclass
class Dashboard:
    """A dashboard of rows, with the datasource variable and its own."""

    uid: str
    title: str
    description: str
    variables: list[Variable]
    rows: list[Row] = field(default_factory=list)

    def to_json(self) -> dict:
        panels, y, pid = [], 0, 1
        for row in self.rows:
            panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            pid, y, x, tallest = pid + 1, y + 1, 0, 0
            for p in row.panels:
                if x + p.width > 24:
                    x, y, tallest = 0, y + tallest, 0
                panels.append(p.to_json(pid, x, y))
                pid, x, tallest = pid + 1, x + p.width, max(tallest, p.height)
            y += tallest
        datasource = {"name": "datasource", "label": "Data source", "type": "datasource",
                      "query": "prometheus", "current": {"text": "", "value": ""}, "options": [], "refresh": 1,
                      "hide": 0}
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["ferrite", "llm"],
            "timezone": "browser",
            "editable": True,
            "graphTooltip": 1,
            "schemaVersion": SCHEMA_VERSION,
            "version": 1,
            "refresh": "30s",
            "time": {"from": "now-1h", "to": "now"},
            "timepicker": {},
            "annotations": {"list": []},
            "links": [],
            "templating": {"list": [datasource] + [v.to_json() for v in self.variables]},
            "panels": panels,
        }


def quantiles(metric: str, sel: str, by: str, qs=(0.5, 0.9, 0.99)) -> list[Target]:
    """p50/p90/p99 of a histogram, summed over the `by` labels."""
    return [
        Target(f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{sel}}}[{RATE}])))",
               f"{{{{{by}}}}} p{round(q * 100)}")
        for q in qs
    ]


def rate(metric: str, sel: str, by: str, legend: str = "") -> Target:
    return Target(f"sum by ({by}) (rate({metric}{{{sel}}}[{RATE}]))", legend or f"{{{{{by}}}}}")


ENGINE_VARS = [
    Variable("namespace", "Namespace", "label_values(vllm:num_requests_running, namespace)"),
    Variable("llmservice", "LLMService",
             'label_values(vllm:num_requests_running{namespace=~"$namespace"}, llmservice)'),
]
POD_VAR = Variable("pod", "Pod",
                   'label_values(vllm:num_requests_running{namespace=~"$namespace", '
                   'llmservice=~"$llmservice"}, pod)')


def overview() -> Dashboard:
    by = "llmservice"
    return Dashboard(
        uid="ferrite-overview",
        title="Ferrite / LLMService overview",
        description="Traffic, latency (TTFT, TPOT, ITL, end to end), throughput, queues, KV "
                    "cache and SLO attainment of each LLMService, over all its replicas.",
        variables=ENGINE_VARS,
        rows=[
            Row("Traffic and SLO", [
                Panel("Requests finished per second", "Finished requests by finish reason "
                      "(abort: the client left or the engine ended it).",
                      [rate("vllm:request_success_total", SVC, f"{by}, finished_reason",
                            "{{llmservice}} {{finished_reason}}")], unit="reqps", width=8),
                Panel("TTFT SLO attainment", "Share of the dashboard's range in which the "
                      "autoscaler's TTFT (spec.autoscaling.ttftQuantile over windowSeconds) was "
                      "within targetTTFTSeconds.",
                      [Target("avg_over_time((ferrite_operator_autoscale_ttft_seconds{"
                              + OPERATOR + "} <= bool on (namespace, llmservice) max by "
                              "(namespace, llmservice) (ferrite_operator_autoscale_target_ttft_seconds))"
                              "[$__range:])", "{{llmservice}}", instant=True)],
                      kind="stat", unit="percentunit", width=8, max=1),
                Panel("Errors per second", "Router answers of 5xx by model, and requests the "
                      "engines aborted.",
                      [Target('sum by (model, code) (rate(ferrite_router_requests_total{code=~"5.."}'
                              f"[{RATE}]))", "router {{model}} {{code}}"),
                       Target(f'sum by ({by}) (rate(vllm:request_success_total{{{SVC}, '
                              f'finished_reason="abort"}}[{RATE}]))', "{{llmservice}} aborted")],
                      unit="reqps", width=8),
            ]),
            Row("Latency", [
                Panel("Time to first token", "TTFT p50/p90/p99, with each LLMService's target.",
                      quantiles("vllm:time_to_first_token_seconds", SVC, by)
                      + [Target("max by (llmservice) (ferrite_operator_autoscale_target_ttft_seconds{"
                                + OPERATOR + "})", "{{llmservice}} target")], unit="s"),
                Panel("Time per output token", "Each request's decode time over its tokens "
                      "after the first (TPOT), p50/p90/p99.",
                      quantiles("vllm:request_time_per_output_token_seconds", SVC, by), unit="s"),
                Panel("Inter-token latency", "Time between consecutive tokens, p50/p90/p99.",
                      quantiles("vllm:inter_token_latency_seconds", SVC, by), unit="s"),
                Panel("End-to-end request latency", "Arrival to last token, p50/p90/p99.",
                      quantiles("vllm:e2e_request_latency_seconds", SVC, by), unit="s"),
                Panel("Request phases (p90)", "Waiting, prefill, decode: where a request's time "
                      "goes.",
                      [Target(f"histogram_quantile(0.9, sum by (le, {by}) (rate({m}_bucket{{{SVC}}}[{RATE}])))",
                              f"{{{{llmservice}}}} {name}")
                       for name, m in [("queue", "vllm:request_queue_time_seconds"),
                                       ("prefill", "vllm:request_prefill_time_seconds"),
                                       ("decode", "vllm:request_decode_time_seconds"),
                                       ("inference", "vllm:request_inference_time_seconds")]],
                      unit="s", width=24),
            ]),
            Row("Throughput", [
                Panel("Tokens per second", "Generated (output) and prompt tokens per second, "
                      "and the prompt tokens the prefix cache served.",
                      [rate("vllm:generation_tokens_total", SVC, by, "{{llmservice}} output"),
                       rate("vllm:prompt_tokens_total", SVC, by, "{{llmservice}} prompt"),
                       rate("vllm:prompt_tokens_cached_total", SVC, by,
                            "{{llmservice}} prompt from cache")],
                      unit="short"),
                Panel("Tokens per engine step", "Tokens each step computed, p50/p90: how full "
                      "the batches are.",
                      quantiles("vllm:iteration_tokens_total", SVC, by, (0.5, 0.9)), unit="short"),
                Panel("Request lengths (p50/p90)", "Prompt and generated tokens per request.",
                      quantiles("vllm:request_prompt_tokens", SVC, by, (0.5, 0.9))
                      + quantiles("vllm:request_generation_tokens", SVC, by, (0.5, 0.9)),
                      unit="short"),
                Panel("Requested max_tokens and n (p90)", "What clients ask for.",
                      [Target(f"histogram_quantile(0.9, sum by (le, {by}) (rate({m}_bucket{{{SVC}}}[{RATE}])))",
                              f"{{{{llmservice}}}} {name}")
                       for name, m in [("max_tokens", "vllm:request_params_max_tokens"),
                                       ("n", "vllm:request_params_n")]], unit="short"),
                Panel("Structured output and tool calls", "Requests held to a grammar, by kind, "
                      "and tool calls answered.",
                      [rate("ferrite:structured_output_requests_total", SVC, f"{by}, kind",
                            "{{llmservice}} {{kind}}"),
                       rate("ferrite:tool_calls_total", SVC, by, "{{llmservice}} tool calls")],
                      unit="reqps", width=24),
            ]),
            Row("Queues and KV cache", [
                Panel("Running and waiting requests", "Sequences in the batch, and requests "
                      "waiting to be scheduled.",
                      [Target(f"sum by ({by}) (vllm:num_requests_running{{{SVC}}})",
                              "{{llmservice}} running"),
                       Target(f"sum by ({by}) (vllm:num_requests_waiting{{{SVC}}})",
                              "{{llmservice}} waiting")], width=8),
                Panel("KV cache usage", "Mean and most-used replica.",
                      [Target(f"avg by ({by}) (vllm:kv_cache_usage_perc{{{SVC}}})",
                              "{{llmservice}} mean"),
                       Target(f"max by ({by}) (vllm:kv_cache_usage_perc{{{SVC}}})",
                              "{{llmservice}} max")], unit="percentunit", max=1, width=8),
                Panel("Preemptions per second", "Sequences whose blocks were taken back and "
                      "recomputed later (the cache is too small for the load), and the mean "
                      "number of preemptions a finished request went through.",
                      [rate("vllm:num_preemptions_total", SVC, by),
                       Target(f"sum by ({by}) (rate(vllm:request_num_preemptions_sum{{{SVC}}}[{RATE}])) / "
                              f"sum by ({by}) (rate(vllm:request_num_preemptions_count{{{SVC}}}[{RATE}]))",
                              "{{llmservice}} per request")], unit="short", width=8),
                Panel("Prefix cache hit rate", "Prompt tokens found in the prefix cache over "
                      "prompt tokens looked up.",
                      [Target(f"sum by ({by}) (rate(vllm:prefix_cache_hits_total{{{SVC}}}[{RATE}])) / "
                              f"sum by ({by}) (rate(vllm:prefix_cache_queries_total{{{SVC}}}[{RATE}]))",
                              "{{llmservice}}")], unit="percentunit", max=1, width=24),
            ]),
        ],
    )


def replicas() -> Dashboard:
    by = "pod"
    return Dashboard(
        uid="ferrite-replicas",
        title="Ferrite / replicas",
        description="Each replica of an LLMService side by side: whether the load is "
                    "balanced, and which replica is the bottleneck.",
        variables=ENGINE_VARS + [POD_VAR],
        rows=[
            Row("Balance", [
                Panel("Share of running requests", "Each replica's running requests over the "
                      "LLMService's; equal shares mean a balanced load.",
                      [Target(f"sum by (pod) (vllm:num_requests_running{{{POD}}}) / on () group_left "
                              f"sum(vllm:num_requests_running{{{POD}}})", "{{pod}}")],
                      unit="percentunit", max=1),
                Panel("Busiest replica", "The replica with the most waiting requests now.",
                      [Target(f"topk(1, sum by (pod) (vllm:num_requests_waiting{{{POD}}}))",
                              "{{pod}}", instant=True)], kind="stat"),
                Panel("Running requests", "Per replica.",
                      [Target(f"sum by (pod) (vllm:num_requests_running{{{POD}}})", "{{pod}}")]),
                Panel("Waiting requests", "Per replica.",
                      [Target(f"sum by (pod) (vllm:num_requests_waiting{{{POD}}})", "{{pod}}")]),
            ]),
            Row("Per replica", [
                Panel("Output tokens per second", "Per replica.",
                      [rate("vllm:generation_tokens_total", POD, by)]),
                Panel("TTFT p90", "Per replica.",
                      quantiles("vllm:time_to_first_token_seconds", POD, by, (0.9,)), unit="s"),
                Panel("KV cache usage", "Per replica.",
                      [Target(f"max by (pod) (vllm:kv_cache_usage_perc{{{POD}}})", "{{pod}}")],
                      unit="percentunit", max=1),
                Panel("Prefix cache hit rate", "Per replica: with prefix-aware routing, "
                      "replicas that hold a conversation's prefix hit more.",
                      [Target(f"sum by (pod) (rate(vllm:prefix_cache_hits_total{{{POD}}}[{RATE}])) / "
                              f"sum by (pod) (rate(vllm:prefix_cache_queries_total{{{POD}}}[{RATE}]))",
                              "{{pod}}")], unit="percentunit", max=1),
                Panel("Preemptions per second", "Per replica.",
                      [rate("vllm:num_preemptions_total", POD, by)]),
                Panel("Cache configuration", "Each replica's KV cache: blocks, block size, "
                      "memory fraction and device.",
                      [Target(f"max by (pod, block_size, num_gpu_blocks, gpu_memory_utilization, "
                              f"enable_prefix_caching, device) (vllm:cache_config_info{{{POD}}})",
                              "", instant=True)], kind="table"),
            ]),
        ],
    )


def control_plane() -> Dashboard:
    by = "llmservice"
    return Dashboard(
        uid="ferrite-control-plane",
        title="Ferrite / control plane",
        description="The operator (replicas wanted and ready, autoscaler decisions and why, "
                    "reconciles, scrapes) and the router (requests, holds, retries, picks).",
        variables=[Variable("namespace", "Namespace",
                            "label_values(ferrite_operator_llmservice_desired_replicas, namespace)"),
                   Variable("llmservice", "LLMService",
                            'label_values(ferrite_operator_llmservice_desired_replicas'
                            '{namespace=~"$namespace"}, llmservice)')],
        rows=[
            Row("Replicas", [
                Panel("Desired and ready replicas", "What each LLMService should run against "
                      "what is ready, with the autoscaler's bounds.",
                      [Target(f"ferrite_operator_llmservice_desired_replicas{{{OPERATOR}}}",
                              "{{llmservice}} desired"),
                       Target(f"ferrite_operator_llmservice_ready_replicas{{{OPERATOR}}}",
                              "{{llmservice}} ready"),
                       Target(f"ferrite_operator_autoscale_max_replicas{{{OPERATOR}}}",
                              "{{llmservice}} max"),
                       Target(f"ferrite_operator_autoscale_recommended_replicas{{{OPERATOR}}}",
                              "{{llmservice}} recommended")]),
                Panel("Autoscaler decisions", "Decisions per interval by direction and the "
                      "signal that decided them (ttft, queue, no_metrics, activation, idle).",
                      [Target(f"sum by ({by}, direction, reason) (increase("
                              f"ferrite_operator_autoscale_decisions_total{{{OPERATOR}}}[{RATE}]))",
                              "{{llmservice}} {{direction}} ({{reason}})")]),
                Panel("Autoscaler TTFT against target", "The TTFT quantile the autoscaler "
                      "computed, and targetTTFTSeconds.",
                      [Target(f"ferrite_operator_autoscale_ttft_seconds{{{OPERATOR}}}",
                              "{{llmservice}} measured"),
                       Target(f"ferrite_operator_autoscale_target_ttft_seconds{{{OPERATOR}}}",
                              "{{llmservice}} target p{{quantile}}")], unit="s"),
                Panel("Autoscaler queue against target", "Waiting requests per ready replica "
                      "and targetQueueDepth.",
                      [Target(f"ferrite_operator_autoscale_queue_depth_per_replica{{{OPERATOR}}}",
                              "{{llmservice}} measured"),
                       Target(f"ferrite_operator_autoscale_target_queue_depth{{{OPERATOR}}}",
                              "{{llmservice}} target")]),
            ]),
            Row("Operator", [
                Panel("Reconciles per second", "By result.",
                      [rate("ferrite_operator_reconciles_total", "", "result")], unit="ops", width=8),
                Panel("Reconcile errors per second", "By kind (api, client, invalid_spec, ...).",
                      [rate("ferrite_operator_reconcile_errors_total", "", "kind")], unit="ops",
                      width=8),
                Panel("Reconcile duration", "p50/p99.",
                      [Target(f"histogram_quantile({q}, sum by (le) (rate("
                              f"ferrite_operator_reconcile_duration_seconds_bucket[{RATE}])))",
                              f"p{round(q * 100)}") for q in (0.5, 0.99)], unit="s", width=8),
                Panel("Engine scrape errors per second", "The autoscaler's scrapes of engine "
                      "/metrics that failed; a failing pod counts as idle when scaling up.",
                      [rate("ferrite_operator_scrape_errors_total", OPERATOR, by)], unit="ops",
                      width=24),
            ]),
            Row("Router", [
                Panel("Router requests per second", "By model and HTTP status.",
                      [rate("ferrite_router_requests_total", "", "model, code",
                            "{{model}} {{code}}")], unit="reqps", width=8),
                Panel("Held requests", "Requests waiting for a model at zero to get a ready "
                      "replica.",
                      [Target("sum by (model) (ferrite_router_held_requests)", "{{model}}")],
                      width=8),
                Panel("Hold time p90", "How long held requests waited.",
                      [Target(f"histogram_quantile(0.9, sum by (le) (rate("
                              f"ferrite_router_hold_seconds_bucket[{RATE}])))", "p90")], unit="s",
                      width=8),
                Panel("Picks per second", "Replicas picked, by why (prefix affinity, load, ...).",
                      [rate("ferrite_router_picks_total", "", "model, reason",
                            "{{model}} {{reason}}")], unit="ops"),
                Panel("Retries per second", "Requests sent again before any byte reached the "
                      "client, by why.",
                      [rate("ferrite_router_retries_total", "", "model, reason",
                            "{{model}} {{reason}}")], unit="ops"),
            ]),
        ],
    )


DASHBOARDS = {"ferrite-overview.json": overview, "ferrite-replicas.json": replicas,
              "ferrite-control-plane.json": control_plane}


def render() -> dict[str, str]:
    """Each dashboard's file name and JSON text."""
    return {name: json.dumps(build().to_json(), indent=2, sort_keys=True) + "\n"
            for name, build in DASHBOARDS.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true",
                    help="exit 1, naming the files, if OUT differs from what would be written")
    args = ap.parse_args()
    stale = []
    for name, text in render().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale (run `make dashboards`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
