//! The default model reproduces llama.cpp's greedy tokens, log-probability margins,
//! chat rendering and tokenization on the same GGUF; tiny random models quantized by
//! llama.cpp's own quantizer to every K-quant, Q5_0 and Q5_1 reproduce its greedy tokens and
//! margins.

mod common;

use candle_core::Device;
use ferrite_engine::model::{load, LoadedModel};
use ferrite_engine::reference::generate;
use ferrite_engine::sampling::SamplingParams;
use ferrite_engine::tokenizer::ChatMessage;
use serde::Deserialize;

#[derive(Deserialize)]
struct TinyCase {
    model: String,
    prompt_ids: Vec<u32>,
    n: usize,
    ids: Vec<u32>,
    top2_margin: Vec<f32>,
    exact_until: usize,
}

#[derive(Deserialize)]
struct Case {
    chat: bool,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    rendered: Option<String>,
    prompt_ids: Vec<u32>,
    n: usize,
    ids: Vec<u32>,
    top2_margin: Vec<f32>,
    exact_until: usize,
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(common::fixture("smollm2-llamacpp-greedy.json"))
        .expect("fixture tests/fixtures/smollm2-llamacpp-greedy.json");
    serde_json::from_str(&text).expect("fixture parses")
}

fn model() -> LoadedModel {
    load(&common::default_model(), &Device::Cpu).expect("default model loads")
}

fn prompt_text(m: &LoadedModel, case: &Case) -> String {
    if case.chat {
        let messages = case.messages.as_ref().expect("chat case has messages");
        let rendered = m
            .tokenizer
            .chat_template()
            .expect("template")
            .render(messages, true)
            .expect("renders");
        assert_eq!(
            Some(&rendered),
            case.rendered.as_ref(),
            "chat template rendering differs"
        );
        rendered
    } else {
        case.prompt.clone().expect("completion case has a prompt")
    }
}

#[test]
fn tokenization_matches_llama_cpp() {
    let m = model();
    for case in cases() {
        let text = prompt_text(&m, &case);
        let ids = m.tokenizer.encode(&text, !case.chat).expect("encodes");
        assert_eq!(ids, case.prompt_ids, "tokens of {text:?}");
        assert_eq!(
            m.tokenizer.decode(&ids, false).expect("decodes"),
            text,
            "round trip of {text:?}"
        );
    }
}

/// How `m` decodes `prompt` greedily for `n` tokens against llama.cpp's `ids` and margins:
/// the failures, and a line for the log.
fn compare(
    m: &LoadedModel,
    label: &str,
    prompt: &[u32],
    n: usize,
    (ids, margins, exact): (&[u32], &[f32], usize),
) -> (Vec<String>, String) {
    let params = SamplingParams {
        logprobs: Some(2),
        ..SamplingParams::greedy(n)
    };
    let g = generate(m, prompt, params, |_| {}).expect("generates");
    let ours: Vec<u32> = g.tokens.iter().map(|t| t.id).collect();
    let first_diff = (0..exact).find(|&i| ours.get(i) != ids.get(i));
    let mut worst = (0.0f32, 0usize);
    for (step, tok) in g
        .tokens
        .iter()
        .take(first_diff.unwrap_or(exact))
        .enumerate()
    {
        let margin = tok.top[0].1 - tok.top[1].1;
        let err = (margin - margins[step]).abs();
        if err > worst.0 {
            worst = (err, step);
        }
    }
    let line = format!(
        "{label:<50} exact {exact:>2}: first difference {:>9}, worst margin error {:.4} at step {}",
        first_diff
            .map(|d| d.to_string())
            .unwrap_or_else(|| "none".into()),
        worst.0,
        worst.1
    );
    let mut failures = Vec::new();
    if let Some(d) = first_diff {
        failures.push(format!(
            "{label}: token {d} is {:?}, llama.cpp {}",
            ours.get(d),
            ids[d]
        ));
    }
    if worst.0 > 0.05 {
        failures.push(format!(
            "{label}: top-2 log-probability margin off by {:.4} nats at step {}",
            worst.0, worst.1
        ));
    }
    if ids.len() < n && first_diff.is_none() {
        // llama.cpp stopped at its end token (the last id): so must we, with `stop`.
        if ours.len() != ids.len() || g.finish_reason.as_str() != "stop" {
            failures.push(format!("{label}: does not stop where llama.cpp stops"));
        }
    }
    (failures, line)
}

#[test]
fn greedy_decoding_matches_llama_cpp() {
    let m = model();
    let mut failures = Vec::new();
    for case in cases() {
        let text = prompt_text(&m, &case);
        let label = format!("{:.48?}", text.chars().take(48).collect::<String>());
        let reference = (&case.ids[..], &case.top2_margin[..], case.exact_until);
        let (f, line) = compare(&m, &label, &case.prompt_ids, case.n, reference);
        println!("{line}");
        failures.extend(f);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn greedy_decoding_matches_llama_cpp_on_every_quantized_tiny_model() {
    let text = std::fs::read_to_string(common::fixture("tiny-llamacpp-greedy.json"))
        .expect("fixture tests/fixtures/tiny-llamacpp-greedy.json");
    let cases: Vec<TinyCase> = serde_json::from_str(&text).expect("fixture parses");
    let mut failures = Vec::new();
    let mut models = std::collections::BTreeMap::new();
    for case in &cases {
        let m = models.entry(case.model.clone()).or_insert_with(|| {
            let path = common::fixture("tiny").join(&case.model);
            load(&path, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        });
        let label = format!(
            "{} {:?}",
            case.model,
            &case.prompt_ids[..case.prompt_ids.len().min(6)]
        );
        let reference = (&case.ids[..], &case.top2_margin[..], case.exact_until);
        let (f, line) = compare(m, &label, &case.prompt_ids, case.n, reference);
        println!("{line}");
        failures.extend(f);
    }
    assert!(
        models.len() >= 7,
        "every K-quant, Q5_0 and Q5_1 model is in the fixture"
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
