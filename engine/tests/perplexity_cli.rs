//! `ferrite-engine perplexity` scores a text as llama.cpp's `llama-perplexity` does: the
//! default model finds the Declaration of Independence far more predictable than the same
//! words shuffled, and a text too short for one window is refused naming the file.

mod common;

use std::process::Command;

/// Runs `perplexity` on the default model; whether it succeeded, stdout and stderr.
fn perplexity(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite-engine"))
        .args(["perplexity", "--model"])
        .arg(common::default_model())
        .args(args)
        .output()
        .expect("runs");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// The perplexity of the JSON line a `--json` run printed.
fn value(stdout: &str) -> f64 {
    let line = stdout.lines().last().expect("a JSON line");
    let v: serde_json::Value = serde_json::from_str(line).expect("JSON");
    assert_eq!(v["windows"], 2, "{line}");
    assert_eq!(v["tokens_scored"], 2 * 63, "{line}");
    v["perplexity"].as_f64().expect("a number")
}

#[test]
fn coherent_text_scores_far_lower_than_its_words_shuffled() {
    let text = common::workspace().join("bench/data/declaration.txt");
    let original = std::fs::read_to_string(&text).expect("the text");
    let mut words: Vec<&str> = original.split_whitespace().collect();
    // A fixed shuffle: every seventh word to the front, then the rest.
    words.sort_by_key(|w| w.len() % 7);
    let dir = tempfile::tempdir().expect("tempdir");
    let shuffled = dir.path().join("shuffled.txt");
    std::fs::write(&shuffled, words.join(" ")).expect("write");
    let args = ["--ctx", "128", "--max-windows", "2", "--json", "--file"];
    let (ok, out, err) = perplexity(&[&args[..], &[text.to_str().expect("utf-8")]].concat());
    assert!(ok, "{err}");
    let coherent = value(&out);
    let (ok, out, err) = perplexity(&[&args[..], &[shuffled.to_str().expect("utf-8")]].concat());
    assert!(ok, "{err}");
    let scrambled = value(&out);
    assert!(
        (1.0..200.0).contains(&coherent) && scrambled > 2.0 * coherent,
        "perplexity {coherent} on the text, {scrambled} shuffled"
    );
}

#[test]
fn a_text_too_short_for_one_window_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "We hold these truths to be self-evident.").expect("write");
    let (ok, _, err) = perplexity(&["--file", short.to_str().expect("utf-8")]);
    assert!(!ok, "{err}");
    assert!(
        err.contains(
            "short.txt: is 10 tokens long; one window of --ctx 512 tokens needs a longer text"
        ),
        "{err}"
    );
}
