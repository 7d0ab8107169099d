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
    /// Tells a line, for [`a_told_line_shows_without_nocapture`], which runs it alone.
    #[test]
    fn tells_a_line() {
        tell!(
            "kernel tests' notes show here: this line is written past the test harness's {}",
            "capture"
        );
    }

    /// What `tell!` writes reaches the test run's own output, where `eprintln!` of a passing
    /// test does not: the test binary runs [`tells_a_line`] alone, capturing as by default.
    #[test]
    fn a_told_line_shows_without_nocapture() {
        let exe = std::env::current_exe().expect("the test binary's path");
        let run = std::process::Command::new(exe)
            .args(["--exact", "tests::tells_a_line", "--test-threads", "1"])
            .output();
        // Under qemu-user (the arm64 stage) a test binary cannot start itself: the spawn
        // fails, or the child exits before its harness prints anything.
        let out = match run {
            Ok(out) if String::from_utf8_lossy(&out.stdout).contains("running 1 test") => out,
            Ok(out) => {
                tell!(
                    "tell! not checked: the test binary could not run itself ({})",
                    out.status
                );
                return;
            }
            Err(e) => {
                tell!("tell! not checked: the test binary could not run itself ({e})");
                return;
            }
        };
        assert!(out.status.success(), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("written past the test harness's capture\n"),
            "stderr: {err}"
        );
    }
}
