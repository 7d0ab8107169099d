//! The results file (JSON: the machine and every run) and what is made from it: markdown
//! tables per server and ratio tables of one server against a peer.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::run::Load;
use crate::stats::Summary;
use crate::{Error, Result};

/// The machine the runs were measured on.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Machine {
    /// CPU model name, with its family and model numbers where `/proc/cpuinfo` gives them.
    pub cpu: String,
    /// Ferrite's kernel tiers on this CPU, lowest first, as a process started with the
    /// benchmark's environment detects them (`FERRITE_CPU_TIER` caps them); empty in results
    /// recorded before the tiers were.
    #[serde(default)]
    pub tiers: Vec<String>,
    /// Whether the batch kernel of the 32-value formats runs 512-bit (`true`) or 256-bit
    /// (`false`) on this CPU ([`ferrite_kernels::cpu::full_width_512`]); `None` without the
    /// AVX-512 VNNI tier and in results recorded before this was.
    #[serde(default)]
    pub full_width_512: Option<bool>,
    /// Logical cores.
    pub cores: usize,
    /// Memory, GiB.
    pub memory_gib: f64,
}

impl Machine {
    /// This machine, from `/proc/cpuinfo`, `/proc/meminfo` and the kernels' CPU detection
    /// (empty fields where there is no `/proc`).
    pub fn this() -> Self {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib: f64 = meminfo
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0);
        let tiers = ferrite_kernels::cpu::detect().tiers();
        Self {
            cpu: ferrite_kernels::cpu::model_name(),
            tiers: tiers.into_iter().map(String::from).collect(),
            full_width_512: ferrite_kernels::cpu::full_width_512(),
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            memory_gib: (kib / 1024.0 / 1024.0 * 10.0).round() / 10.0,
        }
    }

    /// The line that heads a report: the CPU, Ferrite's kernel tiers on it, cores and memory.
    pub fn header(&self) -> String {
        let tiers = if self.tiers.is_empty() {
            "not recorded".to_string()
        } else {
            self.tiers.join(", ")
        };
        let wide = self.full_width_512.map_or(String::new(), |full| {
            let words = ferrite_kernels::cpu::full_width_512_words(Some(full));
            format!(" (32-value batch kernel {words})")
        });
        format!(
            "Machine: {}; Ferrite's kernel tiers: {tiers}{wide}; {} logical cores, {} GiB.",
            self.cpu, self.cores, self.memory_gib
        )
    }
}

/// One load level against one server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Run {
    /// The server, e.g. `ferrite` or `llama.cpp`.
    pub label: String,
    /// The workload, e.g. `fixed:128:128`.
    pub workload: String,
    /// The offered load.
    pub load: Load,
    /// What it measured (with several runs, the median one by output tokens/s).
    pub summary: Summary,
    /// With several runs of the level, their range; absent for a single run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spread: Option<Spread>,
}

/// How the runs of one level spread, by output tokens/s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    /// Runs made.
    pub runs: usize,
    /// The slowest run's output tokens/s.
    pub low: f64,
    /// The fastest run's output tokens/s.
    pub high: f64,
}

impl Run {
    /// One level's runs as one: the median run (of an even count, the lower of the middle
    /// two) and, for more than one, their range; `None` for no runs.
    pub fn median(label: &str, workload: &str, load: Load, mut runs: Vec<Summary>) -> Option<Self> {
        runs.sort_by(|a, b| a.output_tokens_per_s.total_cmp(&b.output_tokens_per_s));
        let spread = (runs.len() > 1).then(|| Spread {
            runs: runs.len(),
            low: runs[0].output_tokens_per_s,
            high: runs[runs.len() - 1].output_tokens_per_s,
        });
        let summary = runs.get(runs.len().saturating_sub(1) / 2)?.clone();
        Some(Run {
            label: label.into(),
            workload: workload.into(),
            load,
            summary,
            spread,
        })
    }

    /// Output tokens/s as a table shows it: with the range of several runs.
    fn tokens_per_s(&self) -> String {
        let v = self.summary.output_tokens_per_s;
        match self.spread {
            Some(s) => format!("{v:.1} ({:.1}–{:.1})", s.low, s.high),
            None => format!("{v:.1}"),
        }
    }
}

/// Everything measured, as stored in the results file.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Results {
    /// Where.
    pub machine: Machine,
    /// Every run, in the order they were made.
    pub runs: Vec<Run>,
}

impl Results {
    /// Reads a results file; a missing file is an empty result set for this machine.
    pub fn load(path: &Path) -> Result<Self> {
        match std::fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| {
                Error::Invalid(format!(
                    "{} is not a ferrite-bench results file: {e}",
                    path.display()
                ))
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self {
                machine: Machine::this(),
                runs: Vec::new(),
            }),
            Err(e) => Err(Error::Io {
                path: path.display().to_string(),
                source: e,
            }),
        }
    }

    /// Writes the file (pretty JSON).
    pub fn save(&self, path: &Path) -> Result<()> {
        let io = |e| Error::Io {
            path: path.display().to_string(),
            source: e,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Invalid(format!("serialising results: {e}")))?;
        std::fs::write(path, text + "\n").map_err(io)
    }

    /// Adds a run, replacing an earlier one of the same server, workload and load.
    pub fn upsert(&mut self, run: Run) {
        self.machine = Machine::this();
        self.runs.retain(|r| {
            !(r.label == run.label && r.workload == run.workload && r.load == run.load)
        });
        self.runs.push(run);
    }

    /// The servers measured, in first-seen order.
    pub fn labels(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for r in &self.runs {
            if !out.contains(&r.label) {
                out.push(r.label.clone());
            }
        }
        out
    }
}

fn secs(v: f64) -> String {
    if v < 1.0 {
        format!("{:.0} ms", v * 1000.0)
    } else {
        format!("{v:.2} s")
    }
}

/// A markdown table of `runs`, one row per run; a level run several times shows its median
/// run with the range of output tokens/s in brackets.
pub fn table(runs: &[&Run]) -> String {
    let mut out = String::from(
        "| server | workload | load | req/s | output tok/s | TTFT p50 | TTFT p90 | TTFT p99 | ITL p50 | ITL p90 | e2e p50 | e2e p90 | errors |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in runs {
        let s = &r.summary;
        out.push_str(&format!(
            "| {} | {} | {} | {:.2} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.label,
            r.workload,
            r.load,
            s.requests_per_s,
            r.tokens_per_s(),
            secs(s.ttft_s[0]),
            secs(s.ttft_s[1]),
            secs(s.ttft_s[2]),
            secs(s.itl_s[0]),
            secs(s.itl_s[1]),
            secs(s.e2e_s[0]),
            secs(s.e2e_s[1]),
            s.errors
        ));
    }
    out
}

/// A markdown table of `ours` against `peer` on every (workload, load) both measured:
/// throughput ratio (higher is better for `ours`) and TTFT p90 ratio (lower is better).
pub fn ratios(results: &Results, ours: &str, peer: &str) -> Option<String> {
    let mut rows = String::new();
    for a in results.runs.iter().filter(|r| r.label == ours) {
        let Some(b) = results
            .runs
            .iter()
            .find(|r| r.label == peer && r.workload == a.workload && r.load == a.load)
        else {
            continue;
        };
        let (x, y) = (&a.summary, &b.summary);
        let ratio = |n: f64, d: f64| {
            if d > 0.0 {
                format!("{:.2}×", n / d)
            } else {
                "–".into()
            }
        };
        rows.push_str(&format!(
            "| {} | {} | {} | {} | **{}** | {} | {} | **{}** |\n",
            a.workload,
            a.load,
            a.tokens_per_s(),
            b.tokens_per_s(),
            ratio(x.output_tokens_per_s, y.output_tokens_per_s),
            secs(x.ttft_s[1]),
            secs(y.ttft_s[1]),
            ratio(x.ttft_s[1], y.ttft_s[1]),
        ));
    }
    (!rows.is_empty()).then(|| {
        format!(
            "| workload | load | {ours} tok/s | {peer} tok/s | {ours} / {peer} | {ours} TTFT p90 | {peer} TTFT p90 | TTFT {ours} / {peer} |\n\
             |---|---|---|---|---|---|---|---|\n{rows}"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_header_names_the_cpu_and_the_kernel_tiers() {
        // This machine as the kernels see it in this process.
        let this = Machine::this();
        assert_eq!(this.cpu, ferrite_kernels::cpu::model_name());
        assert_eq!(this.tiers, ferrite_kernels::cpu::detect().tiers());
        assert_eq!(this.full_width_512, ferrite_kernels::cpu::full_width_512());
        let machine = Machine {
            cpu: "Intel(R) Xeon(R) Processor (family 6, model 207)".into(),
            tiers: vec!["portable".into(), "avx2".into(), "avx512".into()],
            full_width_512: None,
            cores: 2,
            memory_gib: 23.5,
        };
        assert_eq!(
            machine.header(),
            "Machine: Intel(R) Xeon(R) Processor (family 6, model 207); Ferrite's kernel tiers: \
             portable, avx2, avx512; 2 logical cores, 23.5 GiB."
        );
        let zen5 = Machine {
            cpu: "AMD EPYC (family 26, model 2)".into(),
            tiers: vec!["portable".into(), "avx512-vnni".into()],
            full_width_512: Some(true),
            ..machine
        };
        assert_eq!(
            zen5.header(),
            "Machine: AMD EPYC (family 26, model 2); Ferrite's kernel tiers: portable, \
             avx512-vnni (32-value batch kernel paired in 512-bit registers); 2 logical cores, \
             23.5 GiB."
        );
        // Results recorded before the tiers were still load, and say so.
        let old: Machine = serde_json::from_str(
            r#"{"cpu": "AMD EPYC (family 25, model 17)", "cores": 2, "memory_gib": 23.5}"#,
        )
        .expect("an older machine record");
        assert_eq!(
            old.header(),
            "Machine: AMD EPYC (family 25, model 17); Ferrite's kernel tiers: not recorded; \
             2 logical cores, 23.5 GiB."
        );
    }

    fn run(label: &str, load: Load, tok_s: f64, ttft: f64) -> Run {
        Run {
            label: label.into(),
            workload: "fixed:128:128".into(),
            load,
            summary: Summary {
                completed: 4,
                errors: 0,
                duration_s: 1.0,
                requests_per_s: 4.0,
                output_tokens_per_s: tok_s,
                prompt_tokens: 512,
                output_tokens: 512,
                ttft_s: [ttft, ttft, ttft],
                itl_s: [0.01, 0.02],
                e2e_s: [1.0, 1.0],
            },
            spread: None,
        }
    }

    #[test]
    fn several_runs_keep_the_median_and_show_their_range() {
        let summaries: Vec<Summary> = [120.0, 100.0, 90.0, 110.0]
            .iter()
            .map(|&v| run("ferrite", Load::Concurrency(4), v, 0.5).summary)
            .collect();
        let r =
            Run::median("ferrite", "fixed:128:128", Load::Concurrency(4), summaries).expect("runs");
        assert_eq!(r.summary.output_tokens_per_s, 100.0);
        assert_eq!(
            r.spread,
            Some(Spread {
                runs: 4,
                low: 90.0,
                high: 120.0
            })
        );
        let md = table(&[&r]);
        assert!(
            md.contains("| 4.00 | 100.0 (90.0–120.0) | 500 ms |"),
            "{md}"
        );
        let one = Run::median("ferrite", "mixed", Load::Rate(1.0), vec![r.summary.clone()]);
        assert_eq!(one.and_then(|o| o.spread), None);
        assert!(Run::median("ferrite", "mixed", Load::Rate(1.0), Vec::new()).is_none());
    }

    #[test]
    fn upsert_replaces_the_same_level_and_round_trips() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("r/results.json");
        let mut r = Results::load(&path).expect("missing file is empty");
        r.upsert(run("ferrite", Load::Concurrency(4), 100.0, 0.5));
        r.upsert(run("ferrite", Load::Concurrency(4), 110.0, 0.5));
        r.upsert(run("llama.cpp", Load::Concurrency(4), 50.0, 1.0));
        assert_eq!(r.runs.len(), 2);
        r.save(&path).expect("save");
        assert_eq!(Results::load(&path).expect("load"), r);
        assert_eq!(r.labels(), ["ferrite", "llama.cpp"]);
        let t = ratios(&r, "ferrite", "llama.cpp").expect("a shared level");
        assert!(t.contains("| 110.0 | 50.0 | **2.20×** |"), "{t}");
        assert!(t.contains("**0.50×**"), "{t}");
        assert!(ratios(&r, "ferrite", "vllm").is_none());
        let md = table(&r.runs.iter().collect::<Vec<_>>());
        assert!(
            md.contains("| ferrite | fixed:128:128 | concurrency 4 | 4.00 | 110.0 | 500 ms |"),
            "{md}"
        );
    }

    #[test]
    fn a_foreign_file_is_refused_by_name() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("x.json");
        std::fs::write(&path, "{\"hello\": 1}").expect("write");
        let e = Results::load(&path).expect_err("not results").to_string();
        assert!(
            e.contains("x.json is not a ferrite-bench results file"),
            "{e}"
        );
    }
}
