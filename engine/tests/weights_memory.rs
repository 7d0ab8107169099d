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
    let grown = resident_anon().saturating_sub(before);
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
    let paths: Vec<_> = std::fs::read_dir(&dir)
        .expect("tiny models")
        .map(|e| e.expect("entry").path())
        .collect();
    // The process's first load builds tables every later load shares (the tokenizer's
    // pre-tokenizer, the thread pool): paid here, outside the measurements.
    drop(load(&paths[0], &Device::Cpu).expect("loads"));
    for path in paths {
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
        // Eight copies held at once, so what the allocator keeps from one load to the next
        // (a megabyte or two, whatever the model) averages out and a second copy of the
        // weights would show eight times over.
        const COPIES: u64 = 8;
        let before = resident_anon();
        let models: Vec<_> = (0..COPIES)
            .map(|_| load(&path, &Device::Cpu).expect("loads"))
            .collect();
        let grown = resident_anon().saturating_sub(before) / COPIES;
        for m in &models {
            assert_eq!(
                m.model.resident_weight_bytes() as u64,
                matrices,
                "{}: weights held as in the file",
                path.display()
            );
        }
        drop(models);
        // The weights once, in a huge-page arena (whole 2 MiB pages), plus the rotary
        // tables and tokenizer (well under a megabyte); as f32 they would be 2-13 times more.
        assert!(
            grown < matrices.next_multiple_of(2 << 20) + (1 << 20),
            "{}: {} KB resident per copy for {} KB of weights",
            path.display(),
            grown >> 10,
            matrices >> 10
        );
        checked += 1;
    }
    assert!(checked >= 7, "only {checked} tiny models");
}

#[test]
fn a_bf16_checkpoint_is_held_in_bf16() {
    use candle_core::DType;
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = common::TinySpec::llama();
    common::write_tiny_hf(dir.path(), &spec, DType::BF16);
    let matrices: u64 = common::tiny_weights(&spec)
        .iter()
        .filter(|(_, t)| t.rank() == 2)
        .map(|(_, t)| 2 * t.elem_count() as u64)
        .sum();
    let _alone = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
    drop(ferrite_engine::model::load_model(dir.path(), &Device::Cpu).expect("loads"));
    const COPIES: u64 = 8;
    let before = resident_anon();
    let models: Vec<_> = (0..COPIES)
        .map(|_| ferrite_engine::model::load_model(dir.path(), &Device::Cpu).expect("loads"))
        .collect();
    let grown = resident_anon().saturating_sub(before) / COPIES;
    for m in &models {
        assert_eq!(
            m.resident_weight_bytes() as u64,
            matrices,
            "two bytes a weight"
        );
    }
    assert!(
        grown < matrices.next_multiple_of(2 << 20) + (1 << 20),
        "{} KB resident per copy for {} KB of bf16 weights",
        grown >> 10,
        matrices >> 10
    );
}
