//! `ferrite-engine bench` prints every table `make bench` puts in the README: the
//! single-stream figures, the burst batching table and the steady-traffic table, with a row
//! per concurrency and the ratios to one request.

mod common;

use std::process::Command;

/// Runs `ferrite-engine bench` on the default model with small sizes plus `extra`, and
/// returns what it printed (failing the test if it failed).
fn bench(extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite-engine"))
        .args(["bench", "--model"])
        .arg(common::default_model())
        .args([
            "--prompt-tokens",
            "24",
            "--decode-tokens",
            "4",
            "--repeat",
            "1",
            "--request-tokens",
            "8",
        ])
        .args(extra)
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[test]
fn bench_prints_burst_and_steady_tables_with_a_row_per_concurrency() {
    let stdout = bench(&[
        "--concurrency",
        "1,3",
        "--naive-requests",
        "2",
        "--rounds",
        "2",
    ]);
    for want in [
        "| prompt processing (24 tokens) |",
        "| single-stream decode (4 tokens) |",
        "all requests sent at once",
        "| naive: 2 requests, --max-num-seqs 1 |",
        "Steady traffic: clients join one at a time",
        "send 2 requests each back to back",
    ] {
        assert!(stdout.contains(want), "missing {want:?} in:\n{stdout}");
    }
    let rows = |c: &str| stdout.lines().filter(|l| l.starts_with(c)).count();
    // One row per concurrency in each of the two batching tables; the first is the baseline.
    assert_eq!(rows("| 1 | "), 2, "{stdout}");
    assert_eq!(rows("| 3 | "), 2, "{stdout}");
    assert!(
        stdout
            .lines()
            .filter(|l| l.starts_with("| 1 | "))
            .all(|l| l.contains("| 1.00× |")),
        "{stdout}"
    );
}

#[test]
fn zero_naive_requests_and_zero_rounds_skip_those_rows() {
    let stdout = bench(&[
        "--concurrency",
        "1",
        "--naive-requests",
        "0",
        "--rounds",
        "0",
    ]);
    assert!(stdout.contains("all requests sent at once"), "{stdout}");
    assert!(!stdout.contains("naive"), "{stdout}");
    assert!(!stdout.contains("Steady traffic"), "{stdout}");
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("| 1 | ")).count(),
        1,
        "{stdout}"
    );
}
