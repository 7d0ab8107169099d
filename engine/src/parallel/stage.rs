//! A worker rank's side of a group: joining the leader ([`join_group`]) and running every
//! step it sends through this stage's layers ([`serve_stage`]) until it says to stop or
//! the connection is lost; and a tensor-parallel peer's side, running every step its
//! stage's tensor rank 0 passes it ([`serve_tensor_peer`]).

use std::io::{BufReader, BufWriter};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::tensor::TensorGroup;
use super::wire::{self, Message, StageReport, StepWork, HANDSHAKE_FRAME};
use super::GroupSettings;
use crate::error::{Error, Result};
use crate::kv::cache::PagedCache;
use crate::model::llama::{Batch, Llama, SeqSlice};

/// Connects to the leader at `addr` (retrying until `settings.timeout`), proves it holds
/// the secret, checks that the leader does too, and reports what this stage holds. The
/// error says why the leader refused it.
pub fn join_group(
    addr: &str,
    rank: usize,
    settings: &GroupSettings,
    report: StageReport,
) -> Result<TcpStream> {
    let deadline = Instant::now() + settings.timeout;
    let stream = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("leader at {addr} not reachable yet: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => {
                return Err(Error::Group(format!(
                    "rank {rank} could not reach the leader at {addr} within {} s: {e}",
                    settings.timeout.as_secs()
                )))
            }
        }
    };
    let _ = stream.set_nodelay(true);
    stream.set_read_timeout(Some(settings.timeout))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = BufWriter::new(stream.try_clone()?);
    let bad =
        |e: wire::WireError| Error::Group(format!("handshake with the leader at {addr}: {e}"));
    let (version, challenge) = match wire::read_frame(&mut reader, HANDSHAKE_FRAME).map_err(bad)? {
        Message::Hello { version, nonce } => (version, nonce),
        _ => return Err(Error::Group(format!("{addr} did not greet as a leader"))),
    };
    if version != wire::PROTOCOL_VERSION {
        return Err(Error::Group(format!(
            "the leader at {addr} speaks protocol version {version}, this rank {}; run the \
             same Ferrite release on every rank",
            wire::PROTOCOL_VERSION
        )));
    }
    let nonce = wire::nonce();
    let rank32 = rank as u32;
    let (layout, model) = (settings.layout, settings.fingerprint);
    let mac = wire::join_mac(
        settings.secret.bytes(),
        &challenge,
        version,
        rank32,
        &layout,
        &model,
        &nonce,
    );
    let join = Message::Join {
        version,
        rank: rank32,
        layout,
        model,
        nonce,
        mac,
    };
    wire::write_frame(&mut writer, &join).map_err(bad)?;
    match wire::read_frame(&mut reader, HANDSHAKE_FRAME).map_err(bad)? {
        Message::Welcome { mac } => {
            let want = wire::welcome_mac(settings.secret.bytes(), &nonce, &challenge, rank32);
            if !wire::macs_equal(&mac, &want) {
                return Err(Error::Group(format!(
                    "the leader at {addr} failed authentication: its group secret is not \
                     this rank's"
                )));
            }
        }
        Message::Refused { reason } => {
            return Err(Error::Group(format!(
                "the leader at {addr} refused rank {rank}: {reason}"
            )))
        }
        _ => {
            return Err(Error::Group(format!(
                "{addr} answered the join with something else"
            )))
        }
    }
    wire::write_frame(&mut writer, &Message::Report(report)).map_err(bad)?;
    stream.set_read_timeout(None)?;
    Ok(stream)
}

/// Runs the leader's steps through `model` (this stage's part) and `cache` until the
/// leader shuts the group down (`Ok`) or the connection is lost or sends something that
/// is not a valid step (`Err`). `kv_blocks` bounds the block ids a step may name.
pub fn serve_stage(
    stream: TcpStream,
    model: &Llama,
    cache: &mut dyn PagedCache,
    kv_blocks: usize,
    max_frame: usize,
) -> Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = BufWriter::new(stream);
    let lost = |e: wire::WireError| Error::Group(format!("lost the leader: {e}"));
    loop {
        let work = match wire::read_frame(&mut reader, max_frame).map_err(lost)? {
            Message::Step(w) => w,
            Message::Shutdown => return Ok(()),
            _ => {
                return Err(Error::Group(
                    "the leader sent something other than a step".into(),
                ))
            }
        };
        let started = Instant::now();
        let step = work.step;
        let passed = match model.tensor_group() {
            Some(group) => broadcast_step(group, &work),
            None => Ok(()),
        };
        let reply = match passed.and_then(|()| run_step(model, cache, kv_blocks, work)) {
            Ok((values, logits)) => {
                let compute_ns = started.elapsed().as_nanos() as u64;
                match logits {
                    true => Message::Logits {
                        step,
                        compute_ns,
                        values,
                    },
                    false => Message::Hidden {
                        step,
                        compute_ns,
                        values,
                    },
                }
            }
            Err(e) => {
                let reason = e.to_string();
                let _ = wire::write_frame(&mut writer, &Message::Failed { step, reason });
                return Err(e);
            }
        };
        wire::write_frame(&mut writer, &reply).map_err(lost)?;
    }
}

/// Passes `work` to the other tensor ranks of this stage (so they run the same step).
pub fn broadcast_step(group: &TensorGroup, work: &StepWork) -> Result<()> {
    let mut bytes = Vec::new();
    wire::write_frame(&mut bytes, &Message::Step(work.clone()))
        .map_err(|e| Error::Group(format!("encoding a step for the tensor ranks: {e}")))?;
    group.broadcast(Some(&bytes)).map(drop)
}

/// Runs every step tensor rank 0 of this stage passes on, with `model` (this rank's share
/// of the stage) and `cache`, until rank 0 shuts the group down (`Ok`) or a rank fails
/// (`Err`, after telling the others). `kv_blocks` bounds the blocks a step may name.
pub fn serve_tensor_peer(
    model: &Llama,
    cache: &mut dyn PagedCache,
    kv_blocks: usize,
    max_frame: usize,
) -> Result<()> {
    let group = model
        .tensor_group()
        .ok_or_else(|| Error::internal("a tensor-parallel peer without its group"))?;
    let result = (|| loop {
        let bytes = match group.broadcast(None) {
            Ok(b) => b,
            Err(_) if group.is_shut_down() => return Ok(()),
            Err(e) => return Err(e),
        };
        let work = match wire::read_frame(&mut bytes.as_slice(), max_frame) {
            Ok(Message::Step(w)) => w,
            Ok(_) | Err(_) => {
                return Err(Error::Group(
                    "tensor rank 0 passed something other than a step".into(),
                ))
            }
        };
        run_step(model, cache, kv_blocks, work)?;
    })();
    if result.is_err() {
        group.fail();
    }
    result
}

/// One step through this stage: the residual stream leaving its last layer, or with the
/// head the logits of the step's rows (`true`). The first stage embeds the tokens itself.
fn run_step(
    model: &Llama,
    cache: &mut dyn PagedCache,
    kv_blocks: usize,
    work: StepWork,
) -> Result<(Vec<f32>, bool)> {
    let c = model.config();
    let part = model.part().clone();
    let hidden = if part.embed { 0 } else { c.hidden_size };
    check_step(&work, hidden, c.max_position_embeddings, kv_blocks)?;
    let positions: Vec<usize> = work.positions.iter().map(|&p| p as usize).collect();
    let seqs: Vec<SeqSlice> = work
        .seqs
        .iter()
        .enumerate()
        .map(|(slot, &(start, len))| SeqSlice {
            start: start as usize,
            len: len as usize,
            cache_slot: slot,
        })
        .collect();
    let batch = Batch {
        tokens: &work.tokens,
        positions: &positions,
        seqs: &seqs,
    };
    cache.set_tables(work.tables);
    let hidden = work.hidden;
    let (rows, head) = (&work.rows, part.head);
    let out = rayon::scope(|_| -> Result<Vec<f32>> {
        let mut x = match part.embed {
            true => model.embed(&batch)?,
            false => ferrite_kernels::buffers::Buf::from_vec(hidden),
        };
        model.run_layers(part.layers.clone(), &batch, cache, &mut x)?;
        match head {
            true => Ok(model.head(x, rows)?.values().to_vec()),
            false => Ok(x.to_vec()),
        }
    })?;
    Ok((out, head))
}

/// Refuses a step whose parts disagree or that names positions or blocks this stage does
/// not have, before anything is computed.
fn check_step(w: &StepWork, hidden: usize, max_pos: usize, kv_blocks: usize) -> Result<()> {
    let n = w.tokens.len();
    let bad = |what: String| Err(Error::Group(format!("the leader sent a step whose {what}")));
    if n == 0 || w.positions.len() != n || w.hidden.len() != n * hidden {
        return bad(format!(
            "sizes disagree: {n} tokens, {} positions, {} hidden values of width {hidden}",
            w.positions.len(),
            w.hidden.len()
        ));
    }
    if w.tables.len() != w.seqs.len() {
        return bad(format!(
            "{} sequences have {} tables",
            w.seqs.len(),
            w.tables.len()
        ));
    }
    let mut next = 0usize;
    for &(start, len) in &w.seqs {
        if start as usize != next || len == 0 {
            return bad("sequences do not cover its tokens in order".into());
        }
        next += len as usize;
    }
    if next != n {
        return bad(format!("sequences cover {next} of {n} tokens"));
    }
    if let Some(p) = w.positions.iter().find(|&&p| p as usize >= max_pos) {
        return bad(format!("position {p} is beyond the context of {max_pos}"));
    }
    if let Some(b) = w
        .tables
        .iter()
        .flatten()
        .find(|&&b| b as usize >= kv_blocks)
    {
        return bad(format!(
            "block {b} is beyond this stage's {kv_blocks} blocks"
        ));
    }
    if w.rows.iter().any(|&r| r as usize >= n) || w.rows.windows(2).any(|p| p[0] >= p[1]) {
        return bad("logits rows are not increasing token indexes".into());
    }
    Ok(())
}
