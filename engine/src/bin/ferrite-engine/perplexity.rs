//! `ferrite-engine perplexity`: how well the model predicts a text, as llama.cpp's
//! `llama-perplexity` measures it — the text cut into windows of `--ctx` tokens, each run
//! from an empty cache, and every token of a window's second half scored given all before
//! it in the window; the perplexity is `exp` of their mean negative log-likelihood.

use candle_core::Device;
use ferrite_engine::error::{ConfigError, Result};
use ferrite_engine::kv::cache::SingleSequence;
use ferrite_engine::kv::KvDtype;
use ferrite_engine::model::llama::log_softmax;

use crate::cli::PerplexityArgs;

/// What one run measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    /// `exp` of the mean negative log-likelihood.
    pub perplexity: f64,
    /// Tokens scored.
    pub scored: usize,
    /// Windows run.
    pub windows: usize,
}

/// Scores the text and prints the perplexity (and, with `--json`, a JSON line).
pub fn run(args: PerplexityArgs) -> Result<()> {
    let input = |message: String| ConfigError::Input {
        what: format!("--file {}", args.file.display()),
        message,
    };
    let text = std::fs::read_to_string(&args.file).map_err(|e| input(e.to_string()))?;
    if args.ctx < 4 {
        return Err(ConfigError::OutOfRange {
            setting: "ctx",
            range: "at least 4 tokens".into(),
            got: args.ctx.to_string(),
        }
        .into());
    }
    let loaded = ferrite_engine::model::load_with(
        &args.model.model,
        &Device::Cpu,
        &args.model.load.options(),
    )?;
    let ids = loaded.tokenizer.encode(&text, false)?;
    let windows = match args.max_windows {
        Some(n) => (ids.len() / args.ctx).min(n),
        None => ids.len() / args.ctx,
    };
    if windows == 0 {
        return Err(input(format!(
            "is {} tokens long; one window of --ctx {} tokens needs a longer text",
            ids.len(),
            args.ctx
        ))
        .into());
    }
    let bos = loaded.tokenizer.bos_token_id();
    let mut nll = 0f64;
    let mut scored = 0usize;
    for w in 0..windows {
        let mut window = ids[w * args.ctx..(w + 1) * args.ctx].to_vec();
        // As llama-perplexity does: a model that starts its inputs with BOS sees one here.
        if let Some(bos) = bos.filter(|_| loaded.tokenizer.adds_bos()) {
            window[0] = bos;
        }
        let mut cache = SingleSequence::new(&loaded.model, KvDtype::Auto);
        let logits = cache.forward_all(&loaded.model, &window)?;
        for i in args.ctx / 2..args.ctx - 1 {
            let lp = log_softmax(logits.row(i));
            nll -= f64::from(lp[window[i + 1] as usize]);
            scored += 1;
        }
        eprintln!(
            "window {}/{windows}: running perplexity {:.4}",
            w + 1,
            (nll / scored as f64).exp()
        );
    }
    let result = Perplexity {
        perplexity: (nll / scored as f64).exp(),
        scored,
        windows,
    };
    println!(
        "perplexity {:.4} over {} tokens ({} windows of {})",
        result.perplexity, result.scored, result.windows, args.ctx
    );
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "model": args.model.model.display().to_string(),
                "quantization": args.model.load.quantization.map(|q| q.name()),
                "file": args.file.display().to_string(),
                "ctx": args.ctx,
                "perplexity": result.perplexity,
                "tokens_scored": result.scored,
                "windows": result.windows,
            })
        );
    }
    Ok(())
}
