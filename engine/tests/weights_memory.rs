//! A loaded model keeps one copy of its weights resident: the copies the loader reads them
//! into are handed back once the weights move into their huge-page arena, and a quantized
//! embedding tied to the output projection is that same matrix, not an f32 table beside it.

mod common;

use candle_core::Device;
use ferrite_engine::model::load;

/// This process's resident anonymous memory, bytes.
fn resident_anon() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("an RssAnon line");
    kib * 1024
}

#[test]
fn loading_the_default_model_leaves_one_copy_of_its_weights_resident() {
    let before = resident_anon();
    let m = load(&common::default_model(), &Device::Cpu).expect("default model loads");
    let grown = resident_anon() - before;
    let weights = m.model.weight_bytes_per_token() as u64;
    assert_eq!(
        m.model.resident_weight_bytes() as u64,
        weights,
        "tied: nothing apart"
    );
    // One copy of the weights and room for the rest of the model (norms, rotary tables, the
    // tokenizer); a second copy of the weights would be ~90 MB more, an f32 embedding table
    // ~110 MB more.
    assert!(
        grown < weights + weights / 2,
        "{} MB resident after loading {} MB of weights",
        grown >> 20,
        weights >> 20
    );
}
