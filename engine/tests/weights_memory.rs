//! A loaded model keeps one copy of its weights resident: the copies the loader reads them
//! into are handed back once the weights move into their huge-page arena, and a quantized
//! embedding tied to the output projection is that same matrix, not an f32 table beside it.

mod common;

use candle_core::Device;
use ferrite_engine::model::load;

/// Held by each test while it measures: the process's memory is shared by its threads.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

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
    let _alone = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
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

#[test]
fn every_quantized_format_is_kept_in_its_file_encoding() {
    use candle_core::quantized::gguf_file;
    let dir = common::fixture("tiny");
    let mut checked = 0;
    let _alone = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    for entry in std::fs::read_dir(&dir).expect("tiny models") {
        let path = entry.expect("entry").path();
        let mut file = std::fs::File::open(&path).expect("opens");
        let content = gguf_file::Content::read(&mut file).expect("GGUF");
        // Every matrix's bytes as the file stores them (norms are vectors).
        let matrices: u64 = content
            .tensor_infos
            .values()
            .filter(|t| t.shape.dims().len() == 2)
            .map(|t| {
                (t.shape.elem_count() / t.ggml_dtype.block_size() * t.ggml_dtype.type_size()) as u64
            })
            .sum();
        let before = resident_anon();
        let m = load(&path, &Device::Cpu).expect("loads");
        let grown = resident_anon() - before;
        assert_eq!(
            m.model.resident_weight_bytes() as u64,
            matrices,
            "{}: weights held as in the file",
            path.display()
        );
        // The weights once, in a huge-page arena (whole 2 MiB pages), plus the rotary
        // tables and tokenizer (well under a megabyte); as f32 they would be 4-13 times more.
        assert!(
            grown < matrices.next_multiple_of(2 << 20) + (1 << 20),
            "{}: {} KB resident for {} KB of weights",
            path.display(),
            grown >> 10,
            matrices >> 10
        );
        checked += 1;
    }
    assert!(checked >= 7, "only {checked} tiny models");
}
