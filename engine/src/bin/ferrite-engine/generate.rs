//! `ferrite-engine generate`: one prompt (or many at once through the batcher), printed
//! as it is generated, with the prompt and decode speed.

use std::io::Write;

use candle_core::Device;
use ferrite_engine::engine::{EngineHandle, Event};
use ferrite_engine::error::{ConfigError, Result};
use ferrite_engine::tokenizer::ChatMessage;

use crate::cli::{engine_config, GenerateArgs};

/// Generates for the prompt (or every prompt) and prints the text and the speed.
pub fn run(args: GenerateArgs) -> Result<()> {
    let texts: Vec<String> = match (&args.prompts_file, &args.prompt) {
        (Some(path), _) => {
            let input = |message: String| ConfigError::Input {
                what: format!("--prompts-file {}", path.display()),
                message,
            };
            let file = std::fs::read_to_string(path).map_err(|e| input(e.to_string()))?;
            let lines: Vec<String> = file
                .lines()
                .filter(|l| !l.trim().is_empty())
                .map(str::to_string)
                .collect();
            if lines.is_empty() {
                return Err(input(
                    "holds no prompts: it needs one prompt per line (blank lines are skipped)"
                        .into(),
                )
                .into());
            }
            lines
        }
        (None, Some(_)) if args.num_prompts == 0 => {
            return Err(ConfigError::OutOfRange {
                setting: "num_prompts",
                range: "at least 1".into(),
                got: "0".into(),
            }
            .into())
        }
        (None, Some(p)) => vec![p.clone(); args.num_prompts],
        (None, None) => Vec::new(),
    };
    let loaded = ferrite_engine::model::load_with(
        &args.model.model,
        &Device::Cpu,
        &args.model.load.options(),
    )?;
    let template = if args.chat {
        Some(loaded.tokenizer.chat_template()?)
    } else {
        None
    };
    let mut prompts = Vec::with_capacity(texts.len());
    for text in &texts {
        prompts.push(match &template {
            Some(t) => {
                let mut messages = Vec::new();
                if let Some(system) = &args.system {
                    messages.push(ChatMessage::new("system", system.clone()));
                }
                messages.push(ChatMessage::new("user", text.clone()));
                loaded
                    .tokenizer
                    .encode(&t.render(&messages, true)?, false)?
            }
            None => loaded.tokenizer.encode(text, true)?,
        });
    }
    let mut config = engine_config(&args.cache, &args.scheduler);
    // Every prompt is submitted at once.
    config.max_waiting_requests = config.max_waiting_requests.max(prompts.len());
    let engine = EngineHandle::start(loaded, config)?;
    let start = std::time::Instant::now();
    let streams = prompts
        .iter()
        .map(|p| engine.submit(p.clone(), args.sampling.params()))
        .collect::<Result<Vec<_>>>()?;
    let mut out = std::io::stdout();
    // Each request's first token time, and the prompt tokens served from the prefix cache.
    let (mut firsts, mut generated, mut cached) = (Vec::new(), 0usize, 0usize);
    let single = streams.len() == 1;
    for (i, mut stream) in streams.into_iter().enumerate() {
        if !single {
            writeln!(out, "--- {} ---", i + 1)?;
        }
        let mut first_token = None;
        while let Some(ev) = stream.next_blocking() {
            match ev {
                Event::Token { text, .. } => {
                    first_token.get_or_insert_with(std::time::Instant::now);
                    generated += 1;
                    out.write_all(text.as_bytes()).and_then(|()| out.flush())?;
                }
                // `generate` does not ask for them.
                Event::PromptLogprobs(_) => {}
                Event::Finished(f) => {
                    writeln!(out)?;
                    if single {
                        eprintln!("finish: {}", f.reason.as_str());
                    }
                    cached += f.cached_tokens;
                    break;
                }
            }
        }
        firsts.extend(first_token);
    }
    let end = std::time::Instant::now();
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let seconds = |t: std::time::Instant| (t - start).as_secs_f64();
    if let ([first], true) = (firsts.as_slice(), single) {
        eprintln!(
            "prompt: {prompt_tokens} tokens, {:.1} tok/s | decode: {generated} tokens, {:.1} tok/s",
            prompt_tokens as f64 / seconds(*first).max(1e-9),
            generated.saturating_sub(1) as f64 / (end - *first).as_secs_f64().max(1e-9),
        );
    } else {
        // Many requests share steps, so their prompts and decodes overlap: whole-run figures.
        let (soonest, latest) = firsts.iter().fold((f64::INFINITY, 0f64), |(lo, hi), &t| {
            (lo.min(seconds(t)), hi.max(seconds(t)))
        });
        let total = seconds(end);
        eprintln!(
            "{} request(s) in {total:.2} s: prompts {prompt_tokens} tokens ({cached} from the prefix cache), {generated} tokens generated, {:.1} output tok/s | first tokens after {:.2}–{:.2} s",
            prompts.len(),
            generated as f64 / total.max(1e-9),
            soonest.min(latest),
            latest
        );
    }
    Ok(())
}
