//! `ferrite-bench`: parses flags, runs load levels against an OpenAI-compatible server, and
//! writes results, tables and plots.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};
use ferrite_bench::client::tokenize;
use ferrite_bench::report::{ratios, table, Results, Run};
use ferrite_bench::run::{run_level, Load, Target};
use ferrite_bench::stats::Summary;
use ferrite_bench::workload::{requests, Shape, TEXT};
use ferrite_bench::{plot, Error, Result};
use indicatif::{ProgressBar, ProgressStyle};

/// Load generator for OpenAI-compatible `/v1/completions` endpoints.
#[derive(Debug, Parser)]
#[command(name = "ferrite-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measure one server at each concurrency and/or request rate; add the runs to a results file.
    Run(RunArgs),
    /// Print the tables (and ratios against a peer) from a results file; draw plots.
    Report(ReportArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Base URL of the server (its /v1/completions and /tokenize are used).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// The `model` field of requests.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Name of this server in tables and plots.
    #[arg(long, default_value = "ferrite")]
    label: String,
    /// Closed-loop levels: requests kept in flight (comma-separated).
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(1..))]
    concurrency: Vec<u32>,
    /// Open-loop levels: Poisson arrivals per second (comma-separated).
    #[arg(long, value_delimiter = ',')]
    request_rate: Vec<f64>,
    /// Requests per level (default: 2 × concurrency, at least 8; 32 per rate level).
    #[arg(long)]
    requests: Option<usize>,
    /// `fixed:<prompt tokens>:<output tokens>` or `mixed` (chat-like lengths).
    #[arg(long, default_value = "fixed:128:128")]
    workload: Shape,
    /// Seed of prompt offsets, mixed lengths and arrival times.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Runs of every level, made round by round (each round runs every level once, so the
    /// slow and fast phases of a shared machine fall on all levels alike); the median run
    /// is kept, with the range of output tokens/s.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    repeat: u32,
    /// Results file the runs are added to.
    #[arg(long, default_value = "bench/results/results.json")]
    results: PathBuf,
    /// JSON object merged into every request body, for server-specific switches
    /// (llama.cpp: '{"cache_prompt": false}', so repeated prompts are computed like the first).
    #[arg(long, value_parser = parse_object)]
    extra_body: Option<serde_json::Value>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// No progress bar (for logs).
    #[arg(long)]
    no_progress: bool,
}

#[derive(Debug, clap::Args)]
struct ReportArgs {
    /// Results file to read.
    #[arg(long, default_value = "bench/results/results.json")]
    results: PathBuf,
    /// The server the ratio tables are about.
    #[arg(long, default_value = "ferrite")]
    ours: String,
    /// Write the report here as well as printing it.
    #[arg(long)]
    markdown: Option<PathBuf>,
    /// Draw SVG plots into this folder.
    #[arg(long)]
    plot: Option<PathBuf>,
}

fn parse_object(s: &str) -> std::result::Result<serde_json::Value, String> {
    match serde_json::from_str::<serde_json::Value>(s) {
        Ok(v) if v.is_object() => Ok(v),
        _ => Err(format!(
            "`{s}` is not a JSON object, e.g. '{{\"cache_prompt\": false}}'"
        )),
    }
}

async fn run(args: RunArgs) -> Result<()> {
    if args.concurrency.is_empty() && args.request_rate.is_empty() {
        return Err(Error::Invalid(
            "nothing to run: give --concurrency (e.g. 1,4,16) and/or --request-rate (e.g. 0.5,1)"
                .into(),
        ));
    }
    if let Some(r) = args
        .request_rate
        .iter()
        .find(|r| !(**r > 0.0 && r.is_finite()))
    {
        return Err(Error::Invalid(format!(
            "--request-rate {r}: rates must be positive requests per second"
        )));
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(args.timeout))
        .build()
        .map_err(|e| Error::Http(e.to_string()))?;
    let base = args.url.trim_end_matches('/').to_string();
    let corpus = tokenize(&http, &base, &args.model, TEXT).await?;
    let target = Target {
        base,
        model: args.model.clone(),
        extra_body: args.extra_body.clone().unwrap_or(serde_json::Value::Null),
    };
    // One short request first, so a cold server's first-request costs are not measured.
    let warm = requests(args.workload, &corpus, 1, args.seed ^ 1);
    let _ = ferrite_bench::client::complete(
        &http,
        &target.base,
        &target.model,
        &warm[0],
        &target.extra_body,
    )
    .await;

    let mut levels: Vec<Load> = args
        .concurrency
        .iter()
        .map(|&c| Load::Concurrency(c as usize))
        .collect();
    levels.extend(args.request_rate.iter().map(|&r| Load::Rate(r)));
    let mut results = Results::load(&args.results)?;
    let mut runs: Vec<Vec<Summary>> = vec![Vec::new(); levels.len()];
    for round in 1..=args.repeat {
        for (load, runs) in levels.iter().zip(&mut runs) {
            let summary = run_once(&args, &http, &target, &corpus, *load, round).await?;
            runs.push(summary);
        }
    }
    let mut measured = Vec::new();
    for (load, runs) in levels.into_iter().zip(runs) {
        let workload = args.workload.to_string();
        let Some(run) = Run::median(&args.label, &workload, load, runs) else {
            continue;
        };
        results.upsert(run.clone());
        measured.push(run);
    }
    results.save(&args.results)?;
    println!("{}", table(&measured.iter().collect::<Vec<_>>()));
    Ok(())
}

/// One run of one level: `round` of `args.repeat`, reported on stderr.
async fn run_once(
    args: &RunArgs,
    http: &reqwest::Client,
    target: &Target,
    corpus: &[u32],
    load: Load,
    round: u32,
) -> Result<Summary> {
    let n = args.requests.unwrap_or(match load {
        Load::Concurrency(c) => (2 * c).max(8),
        Load::Rate(_) => 32,
    });
    let specs = requests(args.workload, corpus, n, args.seed);
    let bar = if args.no_progress {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(n as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{prefix:>34} [{bar:30}] {pos}/{len} requests {elapsed}")
            .map_err(|e| Error::Invalid(e.to_string()))?
            .progress_chars("=> "),
    );
    let of = if args.repeat > 1 {
        format!(" (run {round}/{})", args.repeat)
    } else {
        String::new()
    };
    bar.set_prefix(format!("{} {load}{of}", args.label));
    let (summary, first_error) = run_level(http, target, load, specs, args.seed, &bar).await;
    bar.finish_and_clear();
    if let Some(e) = first_error {
        eprintln!(
            "{} {load}{of}: {} request(s) failed; first: {e}",
            args.label, summary.errors
        );
    }
    eprintln!(
        "{} {load}{of}: {:.1} output tok/s, TTFT p90 {:.2} s",
        args.label, summary.output_tokens_per_s, summary.ttft_s[1]
    );
    Ok(summary)
}

fn report(args: ReportArgs) -> Result<()> {
    let results = Results::load(&args.results)?;
    if results.runs.is_empty() {
        return Err(Error::Invalid(format!(
            "{} holds no runs: run `ferrite-bench run` first",
            args.results.display()
        )));
    }
    let mut out = format!("{}\n\n", results.machine.header());
    out.push_str(&table(&results.runs.iter().collect::<Vec<_>>()));
    for peer in results.labels().into_iter().filter(|l| *l != args.ours) {
        if let Some(t) = ratios(&results, &args.ours, &peer) {
            out.push_str(&format!("\n{} against {peer}:\n\n{t}", args.ours));
        }
    }
    print!("{out}");
    if let Some(path) = &args.markdown {
        std::fs::write(path, &out).map_err(|e| Error::Io {
            path: path.display().to_string(),
            source: e,
        })?;
    }
    if let Some(dir) = &args.plot {
        for f in plot::plot(&results, dir)? {
            eprintln!("wrote {}", f.display());
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Run(a) => run(a).await,
        Command::Report(a) => report(a),
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
