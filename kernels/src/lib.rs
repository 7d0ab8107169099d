//! Ferrite's CPU kernels, where candle's generic ops are too slow or round differently:
//! quantized products, paged attention, activations, the memory they run in and the memory
//! tensor-parallel ranks share. Every
//! `unsafe` line of the workspace lives in this crate, in one file per instruction set,
//! behind the run-time tokens of [`cpu`]; the crates above it forbid `unsafe` code.

/// `eprintln!` for the kernel tests, written past the test harness's capture: a passing
/// test's `eprintln!` shows only under `--nocapture`, so a tier a test could not check on the
/// CPU at hand would pass silently in `cargo test` and `make test`. The line is formatted
/// first and written in one call, so the lines of tests running side by side stay whole.
#[cfg(test)]
macro_rules! tell {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let line = format!("{}\n", format_args!($($arg)*));
        let _ = std::io::stderr().write_all(line.as_bytes());
    }};
}

pub mod activation;
pub mod attention;
pub mod buffers;
pub mod cpu;
#[cfg(target_arch = "x86_64")]
mod fold;
#[allow(unsafe_code)]
pub mod hugepages;
pub mod quant;
#[allow(unsafe_code)]
pub mod shm;

/// Rows each parallel task takes in row-by-row work on rows of `len` values: enough for
/// about 32k values (below that, waking another thread costs more than it saves), at least
/// one.
pub fn rows_per_task(len: usize) -> usize {
    (1usize << 15).div_ceil(len.max(1))
}

#[cfg(test)]
mod tests {
    /// What `tell!` writes reaches the test run's own output, where `eprintln!` of a passing
    /// test does not: the test binary runs the CPU test that tells this CPU's tiers alone,
    /// capturing as by default, and its line must be in the child's standard error.
    #[test]
    fn a_told_line_shows_without_nocapture() {
        let exe = std::env::current_exe().expect("the test binary's path");
        let test = "cpu::tests::tiers_nest_and_are_named_lowest_first";
        let run = std::process::Command::new(exe)
            .args(["--exact", test, "--test-threads", "1"])
            .output();
        // Under qemu-user (the arm64 stage) a test binary cannot start itself: the spawn
        // fails, or the child exits having written nothing. Any other run is checked.
        let out = match run {
            Ok(out) if !(out.stdout.is_empty() && out.stderr.is_empty()) => out,
            failed => {
                let why = failed.map_or_else(|e| e.to_string(), |out| out.status.to_string());
                tell!("tell! not checked: the test binary could not run itself ({why})");
                return;
            }
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("running 1 test"),
            "{test} alone: {out:?}"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("kernel tiers this CPU runs: portable"),
            "stderr: {err}"
        );
    }
}
