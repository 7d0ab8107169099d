//! Helpers every crate's tests share: where the repository, the default model and the
//! built `ferrite-engine` binary are, free ports, and processes that end with their test.

#![forbid(unsafe_code)]

use std::path::PathBuf;

/// The repository root.
pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The default model fetched by `make model` (override with `FERRITE_TEST_MODEL`).
pub fn default_model() -> PathBuf {
    let path = match std::env::var_os("FERRITE_TEST_MODEL") {
        Some(p) => PathBuf::from(p),
        None => workspace().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(
        path.is_file(),
        "{} is missing: run `make model` (make test does)",
        path.display()
    );
    path
}

/// The `ferrite-engine` binary the same `cargo test` built, beside this test's own
/// directory (`cargo test --workspace`, which `make test` runs, builds every binary first).
pub fn engine_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its own path");
    // target/<profile>/deps/<test> -> target/<profile>/ferrite-engine
    let bin = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join("ferrite-engine"))
        .expect("the test runs from a target directory");
    assert!(
        bin.is_file(),
        "{} is missing: build it with `cargo test --workspace` (make test does)",
        bin.display()
    );
    bin
}

/// A TCP port on 127.0.0.1 that is free now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A child process that is killed and reaped when this is dropped, however the test ends.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
