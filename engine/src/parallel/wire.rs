//! The group's wire protocol: length-prefixed frames of one message each, and the
//! authenticated handshake that admits a rank. A frame is an 8-byte little-endian body
//! length, then the body: a tag byte and the message's fields (integers little-endian,
//! sequences as a 4-byte count then the elements). A frame longer than the connection's
//! bound, a count larger than the bytes that follow, an unknown tag or trailing bytes end
//! the connection with an error; nothing is allocated before its size has been checked
//! against the bytes actually received.

use std::io::{Read, Write};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The protocol both ends must speak; a joiner with another version is refused.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest frame of the handshake (before the peer is known to hold the secret).
pub const HANDSHAKE_FRAME: usize = 4096;

/// 32 bytes: nonces, fingerprints and MACs.
pub type Bytes32 = [u8; 32];

/// The settings every rank of a group must share, checked at the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Pipeline stages.
    pub pipeline: u32,
    /// Tensor-parallel ranks per stage.
    pub tensor: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Most tokens in one step.
    pub max_num_batched_tokens: u32,
    /// Most sequences in one step.
    pub max_num_seqs: u32,
    /// Longest sequence.
    pub max_model_len: u32,
    /// Whether the KV cache holds f16 (else f32).
    pub kv_f16: bool,
}

/// What a stage holds and how many KV blocks its memory allows, sent once it has joined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageReport {
    /// First layer held.
    pub first_layer: u32,
    /// One past the last layer held.
    pub end_layer: u32,
    /// Bytes of weights held.
    pub weight_bytes: u64,
    /// KV blocks its budget allows.
    pub kv_blocks: u64,
    /// How the budget was derived (for the leader's log).
    pub explanation: String,
}

/// One step's work for a stage: the batch and the residual stream entering its first layer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepWork {
    /// The step's number (replies carry it back).
    pub step: u64,
    /// Token ids, sequence after sequence.
    pub tokens: Vec<u32>,
    /// Each token's position in its sequence.
    pub positions: Vec<u32>,
    /// Each sequence's (first token index, token count).
    pub seqs: Vec<(u32, u32)>,
    /// Each sequence's block table.
    pub tables: Vec<Vec<u32>>,
    /// Token rows whose logits the step needs (used by the last stage).
    pub rows: Vec<u32>,
    /// `[tokens, hidden]` residual stream, f32.
    pub hidden: Vec<f32>,
}

/// A message between the leader and a rank.
#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// Leader to joiner, first: the leader's version and a fresh challenge.
    Hello {
        /// The leader's protocol version.
        version: u32,
        /// The challenge the joiner's MAC covers.
        nonce: Bytes32,
    },
    /// Joiner to leader: who it is, what it loaded, and proof it holds the secret.
    Join {
        /// The joiner's protocol version.
        version: u32,
        /// Its rank (its pipeline stage).
        rank: u32,
        /// The settings it was started with.
        layout: Layout,
        /// Fingerprint of the model's metadata.
        model: Bytes32,
        /// The joiner's challenge for the leader.
        nonce: Bytes32,
        /// HMAC-SHA256 under the secret of the leader's nonce and every field above.
        mac: Bytes32,
    },
    /// Leader to joiner: admitted, with proof the leader holds the secret too.
    Welcome {
        /// HMAC-SHA256 under the secret of both nonces and the rank.
        mac: Bytes32,
    },
    /// Leader to joiner: not admitted, and why.
    Refused {
        /// What was wrong.
        reason: String,
    },
    /// Joiner to leader after the welcome.
    Report(StageReport),
    /// Leader to stage: run a step.
    Step(StepWork),
    /// Stage to leader: the residual stream leaving its last layer.
    Hidden {
        /// The step answered.
        step: u64,
        /// Nanoseconds the stage computed.
        compute_ns: u64,
        /// `[tokens, hidden]` values.
        values: Vec<f32>,
    },
    /// Last stage to leader: the logits of the step's rows.
    Logits {
        /// The step answered.
        step: u64,
        /// Nanoseconds the stage computed.
        compute_ns: u64,
        /// `[rows, vocab]` values.
        values: Vec<f32>,
    },
    /// Stage to leader: the step failed there.
    Failed {
        /// The step that failed.
        step: u64,
        /// Why.
        reason: String,
    },
    /// Leader to stage: the group is shutting down.
    Shutdown,
}

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The connection failed or closed.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// The frame announced more bytes than this connection accepts.
    #[error("a frame of {len} bytes exceeds the {max}-byte bound of this connection")]
    TooLarge {
        /// Announced length.
        len: u64,
        /// The bound.
        max: usize,
    },
    /// The body did not parse.
    #[error("malformed message: {0}")]
    Malformed(String),
}

mod tag {
    pub const HELLO: u8 = 1;
    pub const JOIN: u8 = 2;
    pub const WELCOME: u8 = 3;
    pub const REFUSED: u8 = 4;
    pub const REPORT: u8 = 5;
    pub const STEP: u8 = 6;
    pub const HIDDEN: u8 = 7;
    pub const LOGITS: u8 = 8;
    pub const FAILED: u8 = 9;
    pub const SHUTDOWN: u8 = 10;
}

/// Appends fields to a body.
#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend(v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend(v.to_le_bytes());
    }
    fn b32(&mut self, v: &Bytes32) {
        self.0.extend(v);
    }
    fn count(&mut self, n: usize) {
        self.u32(n as u32);
    }
    fn str(&mut self, s: &str) {
        self.count(s.len());
        self.0.extend(s.as_bytes());
    }
    fn u32s(&mut self, v: &[u32]) {
        self.count(v.len());
        v.iter().for_each(|&x| self.u32(x));
    }
    fn f32s(&mut self, v: &[f32]) {
        self.count(v.len());
        v.iter().for_each(|&x| self.0.extend(x.to_le_bytes()));
    }
    fn layout(&mut self, l: &Layout) {
        for v in [
            l.pipeline,
            l.tensor,
            l.block_size,
            l.max_num_batched_tokens,
            l.max_num_seqs,
            l.max_model_len,
        ] {
            self.u32(v);
        }
        self.u8(l.kv_f16 as u8);
    }
}

/// Reads fields from a body, never past its end.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], WireError> {
        if n > self.buf.len() {
            return Err(WireError::Malformed(format!(
                "{what} needs {n} bytes, {} remain",
                self.buf.len()
            )));
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }
    fn u8(&mut self, what: &str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32, WireError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64, WireError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn b32(&mut self, what: &str) -> Result<Bytes32, WireError> {
        let mut a = [0u8; 32];
        a.copy_from_slice(self.take(32, what)?);
        Ok(a)
    }
    /// A count of `size`-byte elements, checked against the bytes left before anything is
    /// allocated for them.
    fn count(&mut self, size: usize, what: &str) -> Result<usize, WireError> {
        let n = self.u32(what)? as usize;
        if n.saturating_mul(size) > self.buf.len() {
            return Err(WireError::Malformed(format!(
                "{what} claims {n} elements of {size} bytes, {} bytes remain",
                self.buf.len()
            )));
        }
        Ok(n)
    }
    fn str(&mut self, what: &str) -> Result<String, WireError> {
        let n = self.count(1, what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| WireError::Malformed(format!("{what}: not UTF-8")))
    }
    fn u32s(&mut self, what: &str) -> Result<Vec<u32>, WireError> {
        let n = self.count(4, what)?;
        (0..n).map(|_| self.u32(what)).collect()
    }
    fn f32s(&mut self, what: &str) -> Result<Vec<f32>, WireError> {
        let n = self.count(4, what)?;
        let b = self.take(n * 4, what)?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
    fn layout(&mut self) -> Result<Layout, WireError> {
        Ok(Layout {
            pipeline: self.u32("layout")?,
            tensor: self.u32("layout")?,
            block_size: self.u32("layout")?,
            max_num_batched_tokens: self.u32("layout")?,
            max_num_seqs: self.u32("layout")?,
            max_model_len: self.u32("layout")?,
            kv_f16: match self.u8("layout")? {
                0 => false,
                1 => true,
                v => return Err(WireError::Malformed(format!("kv_f16 flag {v}"))),
            },
        })
    }
}

impl Message {
    /// The message's body (without the length prefix).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Message::Hello { version, nonce } => {
                w.u8(tag::HELLO);
                w.u32(*version);
                w.b32(nonce);
            }
            Message::Join {
                version,
                rank,
                layout,
                model,
                nonce,
                mac,
            } => {
                w.u8(tag::JOIN);
                w.0.extend(join_fields(*version, *rank, layout, model, nonce));
                w.b32(mac);
            }
            Message::Welcome { mac } => {
                w.u8(tag::WELCOME);
                w.b32(mac);
            }
            Message::Refused { reason } => {
                w.u8(tag::REFUSED);
                w.str(reason);
            }
            Message::Report(r) => {
                w.u8(tag::REPORT);
                w.u32(r.first_layer);
                w.u32(r.end_layer);
                w.u64(r.weight_bytes);
                w.u64(r.kv_blocks);
                w.str(&r.explanation);
            }
            Message::Step(s) => {
                w.u8(tag::STEP);
                w.u64(s.step);
                w.u32s(&s.tokens);
                w.u32s(&s.positions);
                w.count(s.seqs.len());
                for &(start, len) in &s.seqs {
                    w.u32(start);
                    w.u32(len);
                }
                w.count(s.tables.len());
                s.tables.iter().for_each(|t| w.u32s(t));
                w.u32s(&s.rows);
                w.f32s(&s.hidden);
            }
            Message::Hidden {
                step,
                compute_ns,
                values,
            }
            | Message::Logits {
                step,
                compute_ns,
                values,
            } => {
                w.u8(match self {
                    Message::Hidden { .. } => tag::HIDDEN,
                    _ => tag::LOGITS,
                });
                w.u64(*step);
                w.u64(*compute_ns);
                w.f32s(values);
            }
            Message::Failed { step, reason } => {
                w.u8(tag::FAILED);
                w.u64(*step);
                w.str(reason);
            }
            Message::Shutdown => w.u8(tag::SHUTDOWN),
        }
        w.0
    }

    /// Parses one body; every byte must belong to the message.
    pub fn decode(body: &[u8]) -> Result<Message, WireError> {
        let mut r = Reader { buf: body };
        let msg = match r.u8("tag")? {
            tag::HELLO => Message::Hello {
                version: r.u32("version")?,
                nonce: r.b32("nonce")?,
            },
            tag::JOIN => Message::Join {
                version: r.u32("version")?,
                rank: r.u32("rank")?,
                layout: r.layout()?,
                model: r.b32("model")?,
                nonce: r.b32("nonce")?,
                mac: r.b32("mac")?,
            },
            tag::WELCOME => Message::Welcome { mac: r.b32("mac")? },
            tag::REFUSED => Message::Refused {
                reason: r.str("reason")?,
            },
            tag::REPORT => Message::Report(StageReport {
                first_layer: r.u32("first layer")?,
                end_layer: r.u32("end layer")?,
                weight_bytes: r.u64("weight bytes")?,
                kv_blocks: r.u64("kv blocks")?,
                explanation: r.str("explanation")?,
            }),
            tag::STEP => {
                let step = r.u64("step")?;
                let tokens = r.u32s("tokens")?;
                let positions = r.u32s("positions")?;
                let n = r.count(8, "seqs")?;
                let seqs = (0..n)
                    .map(|_| Ok((r.u32("seq start")?, r.u32("seq len")?)))
                    .collect::<Result<_, WireError>>()?;
                let n = r.count(4, "tables")?;
                let tables = (0..n)
                    .map(|_| r.u32s("table"))
                    .collect::<Result<_, WireError>>()?;
                Message::Step(StepWork {
                    step,
                    tokens,
                    positions,
                    seqs,
                    tables,
                    rows: r.u32s("rows")?,
                    hidden: r.f32s("hidden")?,
                })
            }
            t @ (tag::HIDDEN | tag::LOGITS) => {
                let (step, compute_ns) = (r.u64("step")?, r.u64("compute time")?);
                let values = r.f32s("values")?;
                match t {
                    tag::HIDDEN => Message::Hidden {
                        step,
                        compute_ns,
                        values,
                    },
                    _ => Message::Logits {
                        step,
                        compute_ns,
                        values,
                    },
                }
            }
            tag::FAILED => Message::Failed {
                step: r.u64("step")?,
                reason: r.str("reason")?,
            },
            tag::SHUTDOWN => Message::Shutdown,
            t => return Err(WireError::Malformed(format!("unknown message tag {t}"))),
        };
        if !r.buf.is_empty() {
            return Err(WireError::Malformed(format!(
                "{} bytes after the message",
                r.buf.len()
            )));
        }
        Ok(msg)
    }
}

/// The fields of a `Join` its MAC covers, encoded.
fn join_fields(
    version: u32,
    rank: u32,
    layout: &Layout,
    model: &Bytes32,
    nonce: &Bytes32,
) -> Vec<u8> {
    let mut w = Writer::default();
    w.u32(version);
    w.u32(rank);
    w.layout(layout);
    w.b32(model);
    w.b32(nonce);
    w.0
}

/// Writes `msg` as one frame and flushes it; returns the bytes written.
pub fn write_frame(w: &mut impl Write, msg: &Message) -> Result<usize, WireError> {
    let body = msg.encode();
    let mut frame = Vec::with_capacity(8 + body.len());
    frame.extend((body.len() as u64).to_le_bytes());
    frame.extend(body);
    w.write_all(&frame)?;
    w.flush()?;
    Ok(frame.len())
}

/// Reads one frame of at most `max` body bytes and parses it.
pub fn read_frame(r: &mut impl Read, max: usize) -> Result<Message, WireError> {
    read_frame_sized(r, max).map(|(m, _)| m)
}

/// [`read_frame`], with the bytes the frame took.
pub fn read_frame_sized(r: &mut impl Read, max: usize) -> Result<(Message, usize), WireError> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > max as u64 {
        return Err(WireError::TooLarge { len, max });
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    Ok((Message::decode(&body)?, 8 + body.len()))
}

/// HMAC-SHA256 of `parts` under `secret`.
fn mac(secret: &[u8], label: &[u8], parts: &[&[u8]]) -> Bytes32 {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut m =
        <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes keys of any length");
    m.update(label);
    parts.iter().for_each(|p| m.update(p));
    m.finalize().into_bytes().into()
}

/// The MAC a joiner sends: over the leader's challenge and every field of its `Join`.
pub fn join_mac(
    secret: &[u8],
    challenge: &Bytes32,
    version: u32,
    rank: u32,
    layout: &Layout,
    model: &Bytes32,
    nonce: &Bytes32,
) -> Bytes32 {
    let fields = join_fields(version, rank, layout, model, nonce);
    mac(secret, b"ferrite-join\0", &[challenge, &fields])
}

/// The MAC a leader welcomes with: over the joiner's challenge, its own and the rank.
pub fn welcome_mac(secret: &[u8], joiner: &Bytes32, leader: &Bytes32, rank: u32) -> Bytes32 {
    mac(
        secret,
        b"ferrite-welcome\0",
        &[joiner, leader, &rank.to_le_bytes()],
    )
}

/// Whether `got` equals `want`, in time that does not depend on where they differ.
pub fn macs_equal(got: &Bytes32, want: &Bytes32) -> bool {
    got.iter().zip(want).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// A fresh random 32-byte challenge.
pub fn nonce() -> Bytes32 {
    rand::random()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout() -> Layout {
        Layout {
            pipeline: 2,
            tensor: 1,
            block_size: 16,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            max_model_len: 8192,
            kv_f16: true,
        }
    }

    fn samples() -> Vec<Message> {
        vec![
            Message::Hello {
                version: 1,
                nonce: [7; 32],
            },
            Message::Join {
                version: 1,
                rank: 1,
                layout: layout(),
                model: [1; 32],
                nonce: [2; 32],
                mac: [3; 32],
            },
            Message::Welcome { mac: [9; 32] },
            Message::Refused {
                reason: "wrong model ✗".into(),
            },
            Message::Report(StageReport {
                first_layer: 15,
                end_layer: 30,
                weight_bytes: 1 << 33,
                kv_blocks: 999,
                explanation: "0.9 × 8 GiB".into(),
            }),
            Message::Step(StepWork {
                step: 42,
                tokens: vec![1, 2, 3],
                positions: vec![0, 1, 7],
                seqs: vec![(0, 2), (2, 1)],
                tables: vec![vec![4], vec![0, 9]],
                rows: vec![1, 2],
                hidden: vec![0.5, -0.0, f32::MIN_POSITIVE, 1e30, 3.25, -7.0],
            }),
            Message::Hidden {
                step: 3,
                compute_ns: 12,
                values: vec![1.0; 5],
            },
            Message::Logits {
                step: 3,
                compute_ns: 12,
                values: vec![-1.5; 4],
            },
            Message::Failed {
                step: 8,
                reason: "boom".into(),
            },
            Message::Shutdown,
        ]
    }

    #[test]
    fn every_message_comes_back_as_it_was_sent_through_a_frame() {
        for msg in samples() {
            let mut buf = Vec::new();
            let n = write_frame(&mut buf, &msg).expect("writes");
            assert_eq!(n, buf.len());
            let back = read_frame(&mut buf.as_slice(), 1 << 20).expect("reads");
            assert_eq!(back, msg);
        }
    }

    #[test]
    fn a_frame_longer_than_the_bound_is_refused_before_its_body_is_read() {
        // Claims 2^40 bytes and sends none: refused on the header, nothing allocated.
        let mut frame = (1u64 << 40).to_le_bytes().to_vec();
        frame.push(tag::SHUTDOWN);
        let err = read_frame(&mut frame.as_slice(), HANDSHAKE_FRAME).expect_err("too large");
        assert!(
            matches!(
                err,
                WireError::TooLarge {
                    max: HANDSHAKE_FRAME,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_count_beyond_the_bytes_received_is_malformed_not_an_allocation() {
        // A step claiming 2^32 - 1 tokens in a 13-byte body.
        let mut body = vec![tag::STEP];
        body.extend(5u64.to_le_bytes());
        body.extend(u32::MAX.to_le_bytes());
        let err = Message::decode(&body).expect_err("malformed");
        assert!(
            err.to_string().contains("tokens claims 4294967295"),
            "{err}"
        );
    }

    #[test]
    fn trailing_bytes_and_unknown_tags_are_malformed() {
        let mut body = Message::Shutdown.encode();
        body.push(0);
        assert!(Message::decode(&body).is_err());
        assert!(Message::decode(&[200]).is_err());
        assert!(Message::decode(&[]).is_err());
    }

    #[test]
    fn a_mac_changes_with_the_secret_and_with_every_field() {
        let l = layout();
        let base = join_mac(b"s3cret", &[1; 32], 1, 1, &l, &[2; 32], &[3; 32]);
        assert_eq!(
            base,
            join_mac(b"s3cret", &[1; 32], 1, 1, &l, &[2; 32], &[3; 32])
        );
        let others = [
            join_mac(b"s3cres", &[1; 32], 1, 1, &l, &[2; 32], &[3; 32]),
            join_mac(b"s3cret", &[0; 32], 1, 1, &l, &[2; 32], &[3; 32]),
            join_mac(b"s3cret", &[1; 32], 2, 1, &l, &[2; 32], &[3; 32]),
            join_mac(b"s3cret", &[1; 32], 1, 2, &l, &[2; 32], &[3; 32]),
            join_mac(
                b"s3cret",
                &[1; 32],
                1,
                1,
                &Layout { kv_f16: false, ..l },
                &[2; 32],
                &[3; 32],
            ),
            join_mac(b"s3cret", &[1; 32], 1, 1, &l, &[4; 32], &[3; 32]),
            join_mac(b"s3cret", &[1; 32], 1, 1, &l, &[2; 32], &[5; 32]),
        ];
        for other in others {
            assert!(!macs_equal(&other, &base));
        }
        assert_ne!(
            welcome_mac(b"k", &[1; 32], &[2; 32], 1),
            welcome_mac(b"k", &[1; 32], &[2; 32], 2)
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        /// Any bytes at all: decoding returns a message or an error, never panics, and a
        /// message it returns encodes back to the same bytes.
        #[test]
        fn decoding_arbitrary_bytes_never_panics(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            if let Ok(msg) = Message::decode(&body) {
                prop_assert_eq!(msg.encode(), body);
            }
        }

        /// Valid messages with bytes flipped or cut: still never a panic.
        #[test]
        fn corrupted_messages_never_panic(
            which in 0usize..10,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
            cut in any::<usize>(),
        ) {
            let mut body = samples()[which].encode();
            for (at, v) in flips {
                let i = at % body.len();
                body[i] ^= v;
            }
            body.truncate(cut % (body.len() + 1));
            let _ = Message::decode(&body);
            let mut frame = (body.len() as u64).to_le_bytes().to_vec();
            frame.extend(&body);
            let _ = read_frame(&mut frame.as_slice(), 1 << 16);
        }

        /// Steps of any shape come back bit for bit (f32 bits included).
        #[test]
        fn steps_round_trip(
            tokens in proptest::collection::vec(any::<u32>(), 0..40),
            tables in proptest::collection::vec(proptest::collection::vec(any::<u32>(), 0..6), 0..5),
            hidden in proptest::collection::vec(any::<u32>().prop_map(f32::from_bits), 0..64),
        ) {
            let msg = Message::Step(StepWork {
                step: 1,
                positions: tokens.clone(),
                seqs: tokens.iter().map(|&t| (t, t ^ 1)).collect(),
                rows: tokens.clone(),
                tokens,
                tables,
                hidden,
            });
            let body = msg.encode();
            let back = Message::decode(&body).expect("decodes");
            prop_assert_eq!(back.encode(), body);
        }
    }
}
