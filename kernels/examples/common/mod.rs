//! What the kernel examples share: their command-line handling, their timing and a fixed
//! pseudo-random sequence for their inputs.

use std::process::ExitCode;
use std::time::Instant;

/// Runs an example named `name`: prints `run`'s line and exits 0, or prints its error and
/// `usage` and exits 2.
pub fn main_with(
    name: &str,
    usage: impl FnOnce() -> String,
    run: impl FnOnce(Vec<String>) -> Result<String, String>,
) -> ExitCode {
    match run(std::env::args().skip(1).collect()) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{name}: {e}");
            eprintln!("usage: {name} {}", usage());
            ExitCode::from(2)
        }
    }
}

/// The fastest of five runs of `round`, in seconds, each on a pool of `threads` threads of
/// its own, as the engine runs its kernels (called from outside a pool, a kernel would be
/// timed with the hand-over to it).
pub fn best_of_five(threads: usize, mut round: impl FnMut() + Send) -> Result<f64, String> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| format!("a pool of {threads} threads: {e}"))?;
    Ok(pool.install(|| {
        (0..5)
            .map(|_| {
                let t = Instant::now();
                round();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::MAX, f64::min)
    }))
}

/// `value` as a whole number from 1, or an error naming `what`.
pub fn whole(what: &str, value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!(
            "{what} must be a whole number from 1, not {value:?}"
        )),
    }
}

/// A fixed xorshift sequence.
pub struct Xorshift(u64);

impl Xorshift {
    /// The sequence every example starts from.
    pub fn new() -> Self {
        Xorshift(0x1234_5678_9abc_def0)
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// The next value, uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}
