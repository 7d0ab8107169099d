//! `ferrite-engine generate` refuses flags out of range with an error naming the flag and
//! what it allows, and accepts the negative values the OpenAI sampling ranges include.

mod common;

use std::process::Command;

/// Runs `ferrite-engine generate` on the default model with `args`; returns whether it
/// succeeded and what it wrote to stderr.
fn generate(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite-engine"))
        .args(["generate", "--model"])
        .arg(common::default_model())
        .args(["--max-tokens", "2"])
        .args(args)
        .output()
        .expect("runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn out_of_range_flags_are_refused_naming_the_flag_and_its_range() {
    let dir = tempfile::tempdir().expect("tempdir");
    let blank = dir.path().join("blank.txt");
    std::fs::write(&blank, "\n  \n").expect("write");
    let blank = blank.to_string_lossy().into_owned();
    let cases: [(&[&str], &str); 5] = [
        (
            &["--prompt", "hi", "--num-prompts", "0"],
            "--num-prompts must be at least 1, got 0",
        ),
        (
            &["--prompts-file", &blank],
            "holds no prompts: it needs one prompt per line",
        ),
        (
            &["--prompt", "hi", "--temperature", "-1"],
            "`temperature` must be in [0, 2], got -1",
        ),
        (
            &["--prompt", "hi", "--block-size", "100000"],
            "--block-size must be between 1 and 256 tokens, got 100000",
        ),
        (
            &["--prompt", "hi", "--max-model-len", "0"],
            "--max-model-len must be at least 1",
        ),
    ];
    for (args, want) in cases {
        let (ok, stderr) = generate(args);
        assert!(!ok && stderr.contains(want), "{args:?}: {stderr}");
    }
}

#[test]
fn negative_penalties_are_accepted() {
    let (ok, stderr) = generate(&[
        "--prompt",
        "hi",
        "--presence-penalty",
        "-0.5",
        "--frequency-penalty",
        "-1",
    ]);
    assert!(ok, "{stderr}");
}
