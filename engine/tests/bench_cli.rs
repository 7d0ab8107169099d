//! `ferrite-engine bench` prints every table `make bench` puts in the README: the CPU and its
//! kernel tiers, the single-stream figures, the burst batching table, the split of each burst's
//! decode step and the steady-traffic table, with a row per concurrency and the ratios to one
//! request (over repeated rounds, the medians' ratio and the range of the rounds' own).

mod common;

use std::process::Command;

/// Runs `ferrite-engine bench` on the default model with small sizes plus `extra` (one
/// round unless `extra` sets `--repeat`), and returns what it printed (failing the test if
/// it failed).
fn bench(extra: &[&str]) -> String {
    let repeat = if extra.contains(&"--repeat") {
        &[][..]
    } else {
        &["--repeat", "1"][..]
    };
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite-engine"))
        .args(["bench", "--model"])
        .arg(common::default_model())
        .args([
            "--prompt-tokens",
            "24",
            "--decode-tokens",
            "4",
            "--request-tokens",
            "8",
        ])
        .args(repeat)
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
        "| CPU | ",
        "| kernel tiers | portable",
        "| 32-value batch kernel | ",
        "| prompt processing (24 tokens) |",
        "| single-stream decode (4 tokens) |",
        "all requests sent at once",
        "| naive: 2 requests, --max-num-seqs 1 |",
        "Steady traffic: clients join one at a time",
        "send 2 requests each back to back",
    ] {
        assert!(stdout.contains(want), "missing {want:?} in:\n{stdout}");
    }
    // Rows that split a decode step (times in ms) apart from the rows of ratios.
    let step_rows = |c: &str| -> Vec<&str> {
        stdout
            .lines()
            .filter(|l| l.starts_with(c) && l.contains(" ms |"))
            .collect()
    };
    let ratio_rows = |c: &str| -> Vec<&str> {
        stdout
            .lines()
            .filter(|l| l.starts_with(c) && !l.contains(" ms |"))
            .collect()
    };
    // One row per concurrency in each of the two batching tables; the first is the baseline.
    assert_eq!(ratio_rows("| 1 | ").len(), 2, "{stdout}");
    assert_eq!(ratio_rows("| 3 | ").len(), 2, "{stdout}");
    assert!(
        ratio_rows("| 1 | ").iter().all(|l| l.contains("| 1.00× |")),
        "{stdout}"
    );
    // And one per burst that splits its decode step: step, products, rest, two ceilings.
    assert!(stdout.contains("Where a decode step goes"), "{stdout}");
    for c in ["| 1 | ", "| 3 | "] {
        let rows = step_rows(c);
        assert_eq!(rows.len(), 1, "{stdout}");
        assert_eq!(rows[0].matches(" ms |").count(), 3, "{stdout}");
        assert_eq!(rows[0].matches("× |").count(), 2, "{stdout}");
    }
}

#[test]
fn concurrency_without_a_value_skips_the_batching_tables() {
    let stdout = bench(&["--concurrency", "--naive-requests", "0"]);
    assert!(
        stdout.contains("| single-stream decode (4 tokens) |"),
        "{stdout}"
    );
    assert!(!stdout.contains("all requests sent at once"), "{stdout}");
    assert!(!stdout.contains("Steady traffic"), "{stdout}");
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
    // The burst's row, and the split of its decode step.
    let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("| 1 | ")).collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert!(rows[1].contains(" ms |"), "{stdout}");
}

#[test]
fn repeated_rounds_report_the_median_and_the_range_of_each_rounds_ratio() {
    let stdout = bench(&[
        "--concurrency",
        "1,2",
        "--naive-requests",
        "0",
        "--rounds",
        "0",
        "--repeat",
        "2",
    ]);
    assert!(stdout.contains("the median of 2 rounds"), "{stdout}");
    let row = |c: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(c))
            .unwrap_or_else(|| panic!("no {c:?} row in:\n{stdout}"))
            .to_string()
    };
    // The baseline is 1.00x by definition; the other row shows its rounds' ratios as
    // "(low–high)" after the medians' ratio.
    assert!(row("| 1 | ").contains("| 1.00× |"), "{stdout}");
    let two = row("| 2 | ");
    let ratio = two.split(" | ").nth(2).unwrap_or_default();
    let (low, high) = ratio
        .split_once(" (")
        .and_then(|(_, r)| r.trim_end_matches(')').split_once('–'))
        .unwrap_or_else(|| panic!("no range in {two:?}"));
    let (low, high): (f64, f64) = (low.parse().expect("low"), high.parse().expect("high"));
    assert!(low <= high, "{two}");
}

#[test]
fn the_decode_bound_is_the_read_bandwidth_over_the_weights_read_per_token() {
    let stdout = bench(&["--concurrency", "--naive-requests", "0"]);
    // The number in the row that starts with `label`, before its unit.
    let figure = |label: &str| -> f64 {
        stdout
            .lines()
            .find(|l| l.starts_with(label))
            .and_then(|l| l.split(" | ").nth(1))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no figure in a {label:?} row:\n{stdout}"))
    };
    let read = figure("| memory bandwidth (read) |");
    let copy = figure("| memory bandwidth (copy, read+write) |");
    let weights = figure("| weights read per token |");
    let bound = figure("| decode bound (read bandwidth / weights) |");
    assert!(read > 0.0 && copy > 0.0 && weights > 0.0, "{stdout}");
    // GB/s over MB per token, to the printed figures' rounding.
    let want = read * 1e3 / weights;
    assert!(
        (bound - want).abs() <= 0.01 * want,
        "bound {bound} tok/s, read bandwidth / weights {want}:\n{stdout}"
    );
}
