//! `ferrite-engine generate` refuses flags out of range with an error naming the flag and
//! what it allows, accepts the negative values the OpenAI sampling ranges include, and sums
//! up a run of many prompts in whole-run figures.

mod common;

use std::process::Command;

/// Runs `ferrite-engine generate` on the default model with `args`; returns whether it
/// succeeded and what it wrote to stderr (then stdout).
fn generate(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite-engine"))
        .args(["generate", "--model"])
        .arg(common::default_model())
        .args(["--max-tokens", "2"])
        .args(args)
        .output()
        .expect("runs");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stderr) + &text(&out.stdout))
}

#[test]
fn out_of_range_flags_are_refused_naming_the_flag_and_its_range() {
    let dir = tempfile::tempdir().expect("tempdir");
    let blank = dir.path().join("blank.txt");
    std::fs::write(&blank, "\n  \n").expect("write");
    let blank = blank.to_string_lossy().into_owned();
    let cases: [(&[&str], &str); 8] = [
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
        (&["--prompt", "hi", "--logit-bias", "5"], "expected ID=BIAS"),
        (
            &["--prompt", "hi", "--quantization", "fp8"],
            "--quantization fp8: fp8 is a GPU quantization method and this engine computes on \
             CPU; quantize at load to one of q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, q3_k_s, \
             q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m",
        ),
        (
            &["--prompt", "hi", "--quantization", "q3"],
            "--quantization q3: unknown method; expected one of q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, q3_k_s, \
             q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s, q5_k_m",
        ),
    ];
    for (args, want) in cases {
        let (ok, out) = generate(args);
        assert!(!ok && out.contains(want), "{args:?}: {out}");
    }
}

#[test]
fn negative_penalties_are_accepted() {
    let (ok, out) = generate(&[
        "--prompt",
        "hi",
        "--presence-penalty",
        "-0.5",
        "--frequency-penalty",
        "-1",
    ]);
    assert!(ok, "{out}");
}

#[test]
fn logit_bias_from_the_command_line_forces_a_token() {
    // 3575 is " capital" in the default model's vocabulary.
    let (ok, out) = generate(&[
        "--prompt",
        "The capital of France is",
        "--logit-bias",
        "3575=100",
    ]);
    assert!(ok && out.contains(" capital capital"), "{out}");
}

#[test]
fn many_prompts_report_whole_run_figures_with_the_prefix_cache_s_share() {
    // Three copies of a 40-token prompt: the first computes it, the others share its two
    // full blocks (32 tokens each) in the same step.
    let prompt = "one two three four five six seven eight nine ten ".repeat(4);
    let (ok, out) = generate(&["--prompt", prompt.trim(), "--num-prompts", "3"]);
    assert!(ok, "{out}");
    let summary = out
        .lines()
        .find(|l| l.starts_with("3 request(s) in "))
        .unwrap_or_else(|| panic!("no summary line: {out}"));
    assert!(
        summary.contains("(64 from the prefix cache), 6 tokens generated"),
        "{summary}"
    );
    assert!(
        summary.contains("output tok/s | first tokens after "),
        "{summary}"
    );
}
