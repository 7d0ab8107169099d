//! `ferrite-engine bench` prints every table `make bench` puts in the README: the
//! single-stream figures, the burst batching table and the steady-traffic table, with a row
//! per concurrency and the ratios to one request.

mod common;

use std::process::Command;

#[test]
fn bench_prints_burst_and_steady_tables_with_a_row_per_concurrency() {
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
        ])
        .args(["--concurrency", "1,3", "--naive-requests", "2"])
        .args(["--request-tokens", "8", "--rounds", "2"])
        .output()
        .expect("runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
