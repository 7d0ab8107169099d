//! The leader's side of a group: admitting ranks ([`form_group`]) and running steps
//! through the stages ([`Pipeline`]), up to one per stage at once.

use std::collections::VecDeque;
use std::io::{BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::sync::mpsc::{sync_channel, Receiver, TryRecvError};
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
    /// the leader's own stage): from when the stage could start a step (it was sent, or
    /// the stage answered the step before it) to its answer, less its compute.
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
    /// The most steps that were in flight through the pipeline at once (the leader's
    /// stage only; at most one per stage).
    pub most_in_flight: u64,
}

/// A remote stage as the pipeline drives it: frames go out on `writer`; a thread of its own
/// reads every reply into `replies`, so a stage sending its reply never waits on the
/// leader, which may be sending it the next step.
#[derive(Debug)]
struct Remote {
    rank: usize,
    report: StageReport,
    writer: BufWriter<TcpStream>,
    replies: Receiver<std::result::Result<(Message, usize), WireError>>,
    /// When its last reply arrived: a step it received while busy starts no earlier.
    last_reply: Instant,
}

/// A step sent into the pipeline whose logits have not come back yet.
#[derive(Debug)]
struct Flight {
    /// The step as every stage receives it, without hidden states.
    meta: StepWork,
    /// Which remote stage holds it (an index into the remote stages).
    at: usize,
    /// When it was sent there.
    sent: Instant,
    /// The logits, when the leader's own stage is the last.
    logits: Option<Logits>,
}

/// The leader's view of the stages: its own part of the model, then each remote stage in
/// order. Up to one step per stage is in flight at once ([`Pipeline::send`], then
/// [`Pipeline::receive`] in the same order), so every stage can compute while the others
/// do; the engine keeps the steps' sequences apart. Dropping it tells every rank to shut
/// down.
#[derive(Debug)]
pub struct Pipeline {
    remotes: Vec<Remote>,
    step: u64,
    flights: VecDeque<Flight>,
    stats: Arc<Mutex<Vec<StageStats>>>,
}

impl Pipeline {
    /// A pipeline over `members` (ranks `1..`, in rank order) whose frames are at most
    /// `max_frame` bytes; without members the leader's stage is the whole model (split
    /// among tensor-parallel ranks).
    pub fn new(mut members: Vec<Member>, max_frame: usize) -> Self {
        members.sort_by_key(|m| m.rank);
        let stats = vec![StageStats::default(); members.len() + 1];
        let depth = members.len() + 1;
        let remotes = members
            .into_iter()
            .map(|m| {
                // Each stage holds at most one step per stage in flight, so its replies
                // are bounded by the depth (and one more for the error that ends it).
                let (tx, replies) = sync_channel(depth + 1);
                let mut reader = m.reader;
                let _ = std::thread::Builder::new()
                    .name(format!("ferrite-stage-{}", m.rank))
                    .spawn(move || loop {
                        let frame = wire::read_frame_sized(&mut reader, max_frame);
                        let end = frame.is_err();
                        if tx.send(frame).is_err() || end {
                            return;
                        }
                    });
                Remote {
                    rank: m.rank,
                    report: m.report,
                    writer: m.writer,
                    replies,
                    last_reply: Instant::now(),
                }
            })
            .collect();
        Pipeline {
            remotes,
            step: 0,
            flights: VecDeque::new(),
            stats: Arc::new(Mutex::new(stats)),
        }
    }

    /// Each remote stage's rank and report, in rank order.
    pub fn reports(&self) -> impl Iterator<Item = (usize, &StageReport)> {
        self.remotes.iter().map(|m| (m.rank, &m.report))
    }

    /// The stages' counters, shared with whoever renders them.
    pub fn stats(&self) -> Arc<Mutex<Vec<StageStats>>> {
        Arc::clone(&self.stats)
    }

    /// How many steps may be in flight at once: one per stage.
    pub fn depth(&self) -> usize {
        self.remotes.len() + 1
    }

    /// Starts `batch` through the stages (call it outside the thread pool): `model` (the
    /// leader's part — the embedding and the first layers) runs it here, then it goes to
    /// the first remote stage while the leader plans the next. `tables` are the sequences'
    /// block tables, which every stage's cache reads; `cache` is the leader's. Its logits
    /// (of `rows`) come from [`Pipeline::receive`], in the order the steps were sent; the
    /// caller keeps at most [`Pipeline::depth`] in flight.
    pub fn send(
        &mut self,
        model: &Llama,
        batch: &Batch<'_>,
        tables: &[Vec<BlockId>],
        cache: &mut dyn PagedCache,
        rows: &[u32],
    ) -> Result<()> {
        if self.flights.len() >= self.depth() {
            return Err(Error::internal(format!(
                "a step sent with {} already in flight through {} stages",
                self.flights.len(),
                self.depth()
            )));
        }
        self.step += 1;
        let started = Instant::now();
        let meta = self.step_meta(batch, tables, rows);
        if let Some(group) = model.tensor_group() {
            super::stage::broadcast_step(group, &meta)?;
        }
        let local = self.remotes.is_empty();
        // One injection into the thread pool for the local layers (and, alone, the head);
        // waits on other stages hold no pool thread.
        let x = rayon::scope(|_| -> Result<std::result::Result<Buf, Logits>> {
            let mut x = model.embed(batch)?;
            model.run_layers(model.part().layers.clone(), batch, &mut *cache, &mut x)?;
            match local {
                true => Ok(Err(model.head(x, rows)?)),
                false => Ok(Ok(x)),
            }
        });
        let x = match (x, model.tensor_group()) {
            (Ok(x), _) => x,
            // The peers are somewhere in the same step: no later step could line up with
            // theirs, so the group stops.
            (Err(e), Some(group)) => {
                group.fail();
                return Err(Error::Group(format!("tensor rank 0 failed a step: {e}")));
            }
            (Err(e), None) => return Err(e),
        };
        self.record(0, |s| s.compute_seconds += started.elapsed().as_secs_f64());
        if let Some(group) = model.tensor_group() {
            let c = group.stats();
            self.record(0, |s| {
                s.collectives = c.collectives;
                s.collective_seconds = c.seconds;
                s.collective_bytes = c.bytes;
            });
        }
        let (logits, hidden) = match x {
            Err(logits) => (Some(logits), None),
            Ok(x) => (None, Some(x.to_vec())),
        };
        self.flights.push_back(Flight {
            meta,
            at: 0,
            sent: Instant::now(),
            logits,
        });
        if let Some(hidden) = hidden {
            self.hand_on(self.flights.len() - 1, 0, hidden)?;
        }
        let n = self.flights.len() as u64;
        self.record(0, |s| s.most_in_flight = s.most_in_flight.max(n));
        Ok(())
    }

    /// Sends the step of flight `j` with `hidden` to remote stage `to`.
    fn hand_on(&mut self, j: usize, to: usize, hidden: Vec<f32>) -> Result<()> {
        let flight = &mut self.flights[j];
        let remote = &mut self.remotes[to];
        let rank = remote.rank;
        let work = StepWork {
            hidden,
            ..flight.meta.clone()
        };
        let sent = wire::write_frame(&mut remote.writer, &Message::Step(work))
            .map_err(|e| Error::Group(format!("lost rank {rank} (pipeline stage {rank}): {e}")))?;
        flight.at = to;
        flight.sent = Instant::now();
        self.record(to + 1, |s| s.bytes_sent += sent as u64);
        Ok(())
    }

    /// The logits (rows of `vocab`) of the oldest step in flight, once its last stage has
    /// sent them; replies of later steps that arrive meanwhile are passed on to their next
    /// stage. A stage answers its steps in the order it got them, so a reply belongs to
    /// the oldest step in flight at that stage.
    pub fn receive(&mut self, vocab: usize) -> Result<Logits> {
        let oldest = self
            .flights
            .front_mut()
            .ok_or_else(|| Error::internal("no pipeline step in flight to receive"))?;
        if let Some(logits) = oldest.logits.take() {
            self.flights.pop_front();
            self.bump_steps();
            return Ok(logits);
        }
        let last = self.remotes.len() - 1;
        loop {
            // Replies that have already come in go on to their next stage at once.
            for i in 0..last {
                while let Some(j) = self.flights.iter().position(|f| f.at == i) {
                    match self.remotes[i].replies.try_recv() {
                        Ok(reply) => {
                            let values = self.accept(i, j, reply, false)?;
                            self.hand_on(j, i + 1, values)?;
                        }
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => return Err(self.lost(i)),
                    }
                }
            }
            let i = self.flights[0].at;
            let reply = self.remotes[i].replies.recv().map_err(|_| self.lost(i))?;
            let values = self.accept(i, 0, reply, i == last)?;
            if i < last {
                self.hand_on(0, i + 1, values)?;
                continue;
            }
            let rows = self.flights[0].meta.rows.len();
            if values.len() != rows * vocab {
                return Err(Error::Group(format!(
                    "rank {} sent {} logits for {rows} rows of {vocab}",
                    self.remotes[i].rank,
                    values.len(),
                )));
            }
            self.flights.pop_front();
            self.bump_steps();
            return Ok(Logits::from_values(Buf::from_vec(values), vocab));
        }
    }

    fn lost(&self, i: usize) -> Error {
        let rank = self.remotes[i].rank;
        Error::Group(format!(
            "lost rank {rank} (pipeline stage {rank}): its connection closed"
        ))
    }

    /// Checks remote stage `i`'s reply to flight `j` (hidden states, or logits when
    /// `logits`), counts it, and returns its values.
    fn accept(
        &mut self,
        i: usize,
        j: usize,
        reply: std::result::Result<(Message, usize), WireError>,
        logits: bool,
    ) -> Result<Vec<f32>> {
        let rank = self.remotes[i].rank;
        let (reply, received) = reply
            .map_err(|e| Error::Group(format!("lost rank {rank} (pipeline stage {rank}): {e}")))?;
        let (step, compute_ns, values, got_logits) = match reply {
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
        let (want, sent) = (self.flights[j].meta.step, self.flights[j].sent);
        if step != want || got_logits != logits {
            return Err(Error::Group(format!(
                "rank {rank} answered step {step} with {} while step {want} was due",
                if got_logits {
                    "logits"
                } else {
                    "hidden states"
                },
            )));
        }
        // A stage busy with an earlier step started this one when it answered that one.
        let now = Instant::now();
        let remote = &mut self.remotes[i];
        let began = sent.max(remote.last_reply);
        remote.last_reply = now;
        let compute = compute_ns as f64 * 1e-9;
        let wire = (now.saturating_duration_since(began).as_secs_f64() - compute).max(0.0);
        self.record(i + 1, |s| {
            s.compute_seconds += compute;
            s.transfer_seconds += wire;
            s.bytes_received += received as u64;
        });
        Ok(values)
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
        for m in &mut self.remotes {
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
