//! The leader's side of a group: admitting ranks ([`form_group`]) and running each step
//! through the stages ([`Pipeline`]).

use std::io::{BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferrite_kernels::buffers::Buf;

use super::wire::{self, Message, StageReport, StepWork, WireError, HANDSHAKE_FRAME};
use super::GroupSettings;
use crate::error::{Error, Result};
use crate::kv::cache::PagedCache;
use crate::kv::BlockId;
use crate::model::llama::{Batch, Llama, Logits};

/// A rank that joined: its connection and what it reported.
#[derive(Debug)]
pub struct Member {
    /// Its rank (pipeline stage).
    pub rank: usize,
    /// What it holds and its KV capacity.
    pub report: StageReport,
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

/// Waits on `listener` until ranks `1..stages` have all joined, each admitted by
/// [`wire`]'s handshake; fails after `settings.timeout` naming the ranks still missing and
/// the last refusal each met. Connections that fail the handshake are answered with the
/// reason and closed; the rank may try again.
pub fn form_group(
    listener: &TcpListener,
    settings: &GroupSettings,
    stages: usize,
) -> Result<Vec<Member>> {
    let deadline = Instant::now() + settings.timeout;
    let mut members: Vec<Option<Member>> = (0..stages).map(|_| None).collect();
    let mut last_refusal: Vec<Option<String>> = vec![None; stages];
    listener.set_nonblocking(true)?;
    while members.iter().skip(1).any(Option::is_none) {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = (1..stages)
                        .filter(|&r| members[r].is_none())
                        .map(|r| match &last_refusal[r] {
                            Some(why) => format!("rank {r} (refused: {why})"),
                            None => format!("rank {r} (never connected)"),
                        })
                        .collect();
                    return Err(Error::Group(format!(
                        "the group did not form within {} s on {}: missing {}",
                        settings.timeout.as_secs(),
                        listener
                            .local_addr()
                            .map_or_else(|_| "?".into(), |a| a.to_string()),
                        missing.join(", ")
                    )));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        stream.set_nonblocking(false)?;
        match admit(stream, settings, stages, &members) {
            Ok(member) => {
                tracing::info!(
                    "rank {} joined: layers {}..{}",
                    member.rank,
                    member.report.first_layer,
                    member.report.end_layer
                );
                let r = member.rank;
                members[r] = Some(member);
            }
            Err((rank, why)) => {
                tracing::warn!("refused a rank joining the group: {why}");
                if let Some(r) = rank.filter(|&r| r < stages) {
                    last_refusal[r] = Some(why);
                }
            }
        }
    }
    Ok(members.into_iter().flatten().collect())
}

/// Runs the handshake on a new connection: the admitted member, or the rank it claimed
/// (if it got that far) and why it was refused.
fn admit(
    stream: TcpStream,
    settings: &GroupSettings,
    stages: usize,
    members: &[Option<Member>],
) -> std::result::Result<Member, (Option<usize>, String)> {
    let fail = |rank: Option<usize>, why: String| (rank, why);
    let io = |e: std::io::Error| (None, format!("connection: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io)?;
    let _ = stream.set_nodelay(true);
    let mut reader = BufReader::new(stream.try_clone().map_err(io)?);
    let mut writer = BufWriter::new(stream);
    let challenge = wire::nonce();
    let hello = Message::Hello {
        version: wire::PROTOCOL_VERSION,
        nonce: challenge,
    };
    wire::write_frame(&mut writer, &hello).map_err(|e| fail(None, e.to_string()))?;
    let join =
        wire::read_frame(&mut reader, HANDSHAKE_FRAME).map_err(|e| fail(None, e.to_string()))?;
    let Message::Join {
        version,
        rank,
        layout,
        model,
        nonce,
        mac,
    } = join
    else {
        return Err(fail(None, "the first message was not a join".into()));
    };
    let r = rank as usize;
    let mut refuse = |why: String| {
        let _ = wire::write_frame(
            &mut writer,
            &Message::Refused {
                reason: why.clone(),
            },
        );
        fail(Some(r), why)
    };
    if version != wire::PROTOCOL_VERSION {
        return Err(refuse(format!(
            "rank {rank} speaks protocol version {version}, the leader speaks {}; run the same \
             Ferrite release on every rank",
            wire::PROTOCOL_VERSION
        )));
    }
    let want = wire::join_mac(
        settings.secret.bytes(),
        &challenge,
        version,
        rank,
        &layout,
        &model,
        &nonce,
    );
    if !wire::macs_equal(&mac, &want) {
        return Err(refuse(format!(
            "rank {rank} failed authentication: its group secret is not the leader's"
        )));
    }
    if model != settings.fingerprint {
        return Err(refuse(format!(
            "rank {rank} loaded a different model (fingerprint {}, the leader's {}); every \
             rank must load the same weights with the same --quantization",
            &super::hex(&model)[..16],
            &super::hex(&settings.fingerprint)[..16]
        )));
    }
    if layout != settings.layout {
        return Err(refuse(format!(
            "rank {rank} was started with other settings ({layout:?}) than the leader \
             ({:?}); start every rank with the same flags",
            settings.layout
        )));
    }
    if r == 0 || r >= stages {
        return Err(refuse(format!(
            "rank {rank} is not a worker rank of a {stages}-stage group (1 to {})",
            stages - 1
        )));
    }
    if members[r].is_some() {
        return Err(refuse(format!("rank {rank} has already joined")));
    }
    let welcome = Message::Welcome {
        mac: wire::welcome_mac(settings.secret.bytes(), &nonce, &challenge, rank),
    };
    wire::write_frame(&mut writer, &welcome).map_err(|e| fail(Some(r), e.to_string()))?;
    let report = match wire::read_frame(&mut reader, HANDSHAKE_FRAME) {
        Ok(Message::Report(report)) => report,
        Ok(other) => return Err(fail(Some(r), format!("expected its report, got {other:?}"))),
        Err(e) => return Err(fail(Some(r), e.to_string())),
    };
    // Steps may take long (a large prefill on a slow stage); a lost peer closes the socket.
    let _ = reader.get_ref().set_read_timeout(None);
    Ok(Member {
        rank: r,
        report,
        reader,
        writer,
    })
}

/// What one stage has done so far, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageStats {
    /// Steps the stage ran.
    pub steps: u64,
    /// Seconds it spent computing them.
    pub compute_seconds: f64,
    /// Seconds its steps spent on the wire and in (de)serialising, both ways (zero for
    /// the leader's own stage).
    pub transfer_seconds: f64,
    /// Bytes sent to it.
    pub bytes_sent: u64,
    /// Bytes received from it.
    pub bytes_received: u64,
    /// Tensor-parallel collectives its tensor rank 0 ran (the leader's stage only).
    pub collectives: u64,
    /// Seconds those collectives took: copying through shared memory and waiting for the
    /// stage's other tensor ranks.
    pub collective_seconds: f64,
    /// Bytes those collectives copied to and from shared memory.
    pub collective_bytes: u64,
}

/// The leader's view of the stages: its own part of the model, then each remote stage in
/// order. Dropping it tells every rank to shut down.
#[derive(Debug)]
pub struct Pipeline {
    members: Vec<Member>,
    max_frame: usize,
    step: u64,
    stats: Arc<Mutex<Vec<StageStats>>>,
}

impl Pipeline {
    /// A pipeline over `members` (ranks `1..`, in rank order) whose frames are at most
    /// `max_frame` bytes; without members the leader's stage is the whole model (split
    /// among tensor-parallel ranks).
    pub fn new(mut members: Vec<Member>, max_frame: usize) -> Self {
        members.sort_by_key(|m| m.rank);
        let stats = vec![StageStats::default(); members.len() + 1];
        Pipeline {
            members,
            max_frame,
            step: 0,
            stats: Arc::new(Mutex::new(stats)),
        }
    }

    /// Each remote stage's rank and report, in rank order.
    pub fn reports(&self) -> impl Iterator<Item = (usize, &StageReport)> {
        self.members.iter().map(|m| (m.rank, &m.report))
    }

    /// The stages' counters, shared with whoever renders them.
    pub fn stats(&self) -> Arc<Mutex<Vec<StageStats>>> {
        Arc::clone(&self.stats)
    }

    /// Runs `batch` through every stage (call it outside the thread pool) — `model` (the leader's part: the embedding and
    /// the first layers) here, then each rank's layers — and returns the logits of `rows`
    /// from the last. `tables` are the sequences' block tables, which every stage's cache
    /// reads; `cache` is the leader's.
    pub fn forward(
        &mut self,
        model: &Llama,
        batch: &Batch<'_>,
        tables: &[Vec<BlockId>],
        cache: &mut dyn PagedCache,
        rows: &[u32],
    ) -> Result<Logits> {
        self.step += 1;
        let started = Instant::now();
        let meta = self.step_meta(batch, tables, rows);
        if let Some(group) = model.tensor_group() {
            super::stage::broadcast_step(group, &meta)?;
        }
        let local = self.members.is_empty();
        // One injection into the thread pool for the local layers (and, alone, the head);
        // the waits on other stages below hold no pool thread.
        let x = rayon::scope(|_| -> Result<std::result::Result<Buf, Logits>> {
            let mut x = model.embed(batch)?;
            model.run_layers(model.part().layers.clone(), batch, &mut *cache, &mut x)?;
            match local {
                true => Ok(Err(model.head(x, rows)?)),
                false => Ok(Ok(x)),
            }
        })?;
        self.record(0, |s| s.compute_seconds += started.elapsed().as_secs_f64());
        if let Some(group) = model.tensor_group() {
            let c = group.stats();
            self.record(0, |s| {
                s.collectives = c.collectives;
                s.collective_seconds = c.seconds;
                s.collective_bytes = c.bytes;
            });
        }
        let x = match x {
            Ok(x) => x,
            Err(logits) => {
                self.bump_steps();
                return Ok(logits);
            }
        };
        let mut hidden = x.to_vec();
        drop(x);
        let last = self.members.len();
        for i in 0..last {
            let hop = Instant::now();
            let member = &mut self.members[i];
            let rank = member.rank;
            let lost = |e: WireError| {
                Error::Group(format!("lost rank {rank} (pipeline stage {rank}): {e}"))
            };
            let work = StepWork {
                hidden,
                ..meta.clone()
            };
            let sent = wire::write_frame(&mut member.writer, &Message::Step(work)).map_err(lost)?;
            let (reply, received) =
                wire::read_frame_sized(&mut member.reader, self.max_frame).map_err(lost)?;
            let (step, compute_ns, values, logits) = match reply {
                Message::Hidden {
                    step,
                    compute_ns,
                    values,
                } => (step, compute_ns, values, false),
                Message::Logits {
                    step,
                    compute_ns,
                    values,
                } => (step, compute_ns, values, true),
                Message::Failed { reason, .. } => {
                    return Err(Error::Group(format!("rank {rank} failed a step: {reason}")))
                }
                other => {
                    return Err(Error::Group(format!(
                        "rank {rank} answered a step with {}",
                        kind(&other)
                    )))
                }
            };
            if step != self.step || logits != (i + 1 == last) {
                return Err(Error::Group(format!(
                    "rank {rank} answered step {step} with {} while step {} was in flight",
                    if logits { "logits" } else { "hidden states" },
                    self.step
                )));
            }
            let compute = compute_ns as f64 * 1e-9;
            self.record(i + 1, |s| {
                s.compute_seconds += compute;
                s.transfer_seconds += (hop.elapsed().as_secs_f64() - compute).max(0.0);
                s.bytes_sent += sent as u64;
                s.bytes_received += received as u64;
            });
            if logits {
                let vocab = model.config().vocab_size;
                if values.len() != rows.len() * vocab {
                    return Err(Error::Group(format!(
                        "rank {rank} sent {} logits for {} rows of {vocab}",
                        values.len(),
                        rows.len()
                    )));
                }
                self.bump_steps();
                return Ok(Logits::from_values(Buf::from_vec(values), vocab));
            }
            hidden = values;
        }
        Err(Error::Group("a pipeline without a last stage".into()))
    }

    /// The step's batch as every stage receives it, without hidden states.
    fn step_meta(&self, batch: &Batch<'_>, tables: &[Vec<BlockId>], rows: &[u32]) -> StepWork {
        StepWork {
            step: self.step,
            tokens: batch.tokens.to_vec(),
            positions: batch.positions.iter().map(|&p| p as u32).collect(),
            seqs: batch
                .seqs
                .iter()
                .map(|s| (s.start as u32, s.len as u32))
                .collect(),
            tables: tables.to_vec(),
            rows: rows.to_vec(),
            hidden: Vec::new(),
        }
    }

    fn record(&self, stage: usize, f: impl FnOnce(&mut StageStats)) {
        if let Ok(mut stats) = self.stats.lock() {
            if let Some(s) = stats.get_mut(stage) {
                f(s);
            }
        }
    }

    fn bump_steps(&self) {
        if let Ok(mut stats) = self.stats.lock() {
            stats.iter_mut().for_each(|s| s.steps += 1);
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        for m in &mut self.members {
            let _ = wire::write_frame(&mut m.writer, &Message::Shutdown);
        }
    }
}

/// A message's kind, for errors (never its contents).
fn kind(m: &Message) -> &'static str {
    match m {
        Message::Hello { .. } => "hello",
        Message::Join { .. } => "join",
        Message::Welcome { .. } => "welcome",
        Message::Refused { .. } => "refused",
        Message::Report(_) => "report",
        Message::Step(_) => "step",
        Message::Hidden { .. } => "hidden states",
        Message::Logits { .. } => "logits",
        Message::Failed { .. } => "failure",
        Message::Shutdown => "shutdown",
    }
}
