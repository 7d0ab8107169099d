"""ferrite-bench against a real server: exact token counts, every request accounted for, and
the report with ratios and plots made from its results file."""

import json
import os
import subprocess
from pathlib import Path

from conftest import BIN, NAME

BENCH = os.environ.get("FERRITE_BENCH_BIN", str(Path(BIN).with_name("ferrite-bench")))


def bench(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([BENCH, *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return out


def test_closed_and_open_loop_against_the_engine(server, tmp_path):
    results = tmp_path / "results.json"
    common = ["--url", server.url, "--model", NAME, "--results", str(results),
              "--workload", "fixed:32:8", "--no-progress"]
    bench("run", *common, "--label", "ferrite", "--concurrency", "1,4", "--requests", "8")
    bench("run", *common, "--label", "ferrite", "--request-rate", "4", "--requests", "6")
    data = json.loads(results.read_text())
    assert data["machine"]["cores"] >= 1
    runs = {(r["load"]["mode"], r["load"]["value"]): r["summary"] for r in data["runs"]}
    assert set(runs) == {("concurrency", 1), ("concurrency", 4), ("rate", 4.0)}
    for (_, _), s in runs.items():
        n = s["completed"]
        assert s["errors"] == 0
        # ignore_eos and max_tokens give exactly 8 output tokens per request, 32 prompt tokens.
        assert s["output_tokens"] == 8 * n and s["prompt_tokens"] == 32 * n
        assert 0 < s["ttft_s"][0] <= s["ttft_s"][1] <= s["ttft_s"][2] <= s["e2e_s"][1]
    assert runs[("concurrency", 1)]["completed"] == 8
    assert runs[("rate", 4.0)]["completed"] == 6

    # A second label makes a ratio table; plots are SVG files.
    data["runs"].append({**data["runs"][0], "label": "peer"})
    results.write_text(json.dumps(data))
    report = bench("report", "--results", str(results), "--plot", str(tmp_path / "plots"),
                   "--markdown", str(tmp_path / "report.md")).stdout
    assert "ferrite against peer:" in report and "**1.00×**" in report
    svgs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert svgs == ["throughput-fixed-32-8.svg", "ttft-fixed-32-8.svg"]
    assert (tmp_path / "plots" / svgs[0]).read_text().startswith("<svg")
    assert (tmp_path / "report.md").read_text() == report


def test_repeated_levels_keep_the_median_run_and_its_range(server, tmp_path):
    results = tmp_path / "results.json"
    out = bench("run", "--url", server.url, "--model", NAME, "--results", str(results),
                "--workload", "fixed:16:4", "--no-progress", "--concurrency", "1,2", "--requests", "4",
                "--repeat", "3")
    # Round by round: every level once per round.
    order = [l.split(":")[0] for l in out.stderr.splitlines() if "output tok/s" in l]
    assert order == [f"ferrite concurrency {c} (run {r}/3)" for r in (1, 2, 3) for c in (1, 2)]
    runs = json.loads(results.read_text())["runs"]
    assert len(runs) == 2
    for r in runs:
        spread, median = r["spread"], r["summary"]["output_tokens_per_s"]
        assert spread["runs"] == 3 and spread["low"] <= median <= spread["high"]
        assert f"{median:.1f} ({spread['low']:.1f}–{spread['high']:.1f})" in out.stdout


def test_bad_flags_are_refused_with_what_is_allowed(server):
    out = subprocess.run([BENCH, "run", "--url", server.url, "--workload", "chat"],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "fixed:<prompt tokens>:<output tokens>" in out.stderr
    out = subprocess.run([BENCH, "run", "--url", server.url], capture_output=True, text=True)
    assert out.returncode != 0 and "give --concurrency" in out.stderr
    out = subprocess.run([BENCH, "run", "--url", server.url, "--concurrency", "1", "--repeat", "0"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "--repeat" in out.stderr
