//! Tensor parallelism on one host: the T ranks of a pipeline stage each hold 1/T of every
//! projection's output rows and exchange activations through a region of shared memory
//! ([`TensorGroup`]), never a socket. Every collective is a gather: each rank writes the
//! values it computed whole, a barrier, then each reads them all, so no value is ever summed
//! across ranks and the group computes exactly what one process computes.
//!
//! The region is a 4 KiB header of 64-bit words (identity, each rank's pid and report, the
//! barrier's arrival count, a stop word) and two data slots. Collective `k` writes slot
//! `k % 2`, so a rank writing collective `k + 2` has passed barrier `k + 1`, which every
//! rank reaches only after reading collective `k`: one barrier per collective suffices.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferrite_kernels::buffers::Buf;
use ferrite_kernels::shm::{shared_dir, SharedRegion};

use crate::error::{Error, Result};

const MAGIC: u64 = u64::from_le_bytes(*b"FERRTP01");
const HEADER: usize = 4096;
/// Header words.
const W_MAGIC: usize = 0;
const W_RANKS: usize = 1;
const W_SLOT: usize = 2;
const W_READY: usize = 3;
const W_ARRIVALS: usize = 4;
const W_STOP: usize = 5;
const W_GO: usize = 6;
/// Where rank `r`'s words start, and how many it has: pid, joined, KV blocks, weight
/// bytes, then its 32-byte identity.
const W_RANK0: usize = 32;
const RANK_WORDS: usize = 8;
/// The most ranks the header has room for.
pub const MAX_TENSOR_RANKS: usize = (HEADER / 8 - W_RANK0) / RANK_WORDS;
/// [`W_STOP`]'s value once rank 0 has shut the group down; below it, `r + 1` says rank `r`
/// failed.
const SHUTDOWN: u64 = u64::MAX;
/// [`W_GO`]'s value when rank 0 refused a peer.
const REFUSED: u64 = u64::MAX;

/// `n` items split among `size` ranks: rank `rank`'s contiguous share (sizes differ by at
/// most one).
pub fn share(n: usize, size: usize, rank: usize) -> std::ops::Range<usize> {
    let size = size.max(1);
    n * rank / size..n * (rank + 1) / size
}

/// Every rank's share size of `n` items, in rank order.
pub fn shares(n: usize, size: usize) -> Vec<usize> {
    (0..size.max(1)).map(|r| share(n, size, r).len()).collect()
}

/// A fresh, unused path for a group's region.
pub fn region_path() -> PathBuf {
    let id: [u8; 12] = rand::random();
    shared_dir().join(format!("ferrite-tp-{}", super::hex(&id)))
}

/// What a peer reported when it joined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerReport {
    /// Its tensor rank.
    pub rank: usize,
    /// KV blocks its own budget allows.
    pub kv_blocks: u64,
    /// Bytes of weights it holds.
    pub weight_bytes: u64,
}

/// Counters of the collectives this rank has run, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CollectiveStats {
    /// Collectives run.
    pub collectives: u64,
    /// Seconds spent in them: copying to and from the region and waiting on the others.
    pub seconds: f64,
    /// Bytes this rank wrote to the region and read from it.
    pub bytes: u64,
}

/// One rank's handle on its stage's tensor-parallel group.
pub struct TensorGroup {
    region: SharedRegion,
    rank: usize,
    size: usize,
    slot_bytes: usize,
    /// Collectives this rank has entered.
    ops: AtomicU64,
    /// Every rank's process id, for telling a slow rank from a dead one.
    pids: Vec<u32>,
    peers: Vec<PeerReport>,
    collectives: AtomicU64,
    nanos: AtomicU64,
    bytes: AtomicU64,
}

impl std::fmt::Debug for TensorGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorGroup")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("slot_bytes", &self.slot_bytes)
            .finish_non_exhaustive()
    }
}

fn region_error(path: &Path, e: std::io::Error) -> Error {
    Error::Group(format!(
        "tensor-parallel shared memory {}: {e}",
        path.display()
    ))
}

/// Whether process `pid` is running (not exited, not a zombie). Where `/proc` cannot be
/// read, every process counts as running.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit_once(") ")
                .and_then(|(_, rest)| rest.chars().next()),
            Some('Z' | 'X')
        ),
        Err(_) => !Path::new("/proc/self/stat").exists(),
    }
}

impl TensorGroup {
    /// Rank 0's side: creates the region at `path` for `size` ranks with data slots of
    /// `slot_bytes`, stamped with `identity` (what every rank must have loaded), for the
    /// peers to join.
    pub fn create(path: &Path, size: usize, slot_bytes: usize, identity: [u8; 32]) -> Result<Self> {
        if !(2..=MAX_TENSOR_RANKS).contains(&size) {
            return Err(Error::internal(format!(
                "a tensor-parallel group of {size} ranks (2 to {MAX_TENSOR_RANKS})"
            )));
        }
        let slot_bytes = slot_bytes.next_multiple_of(64);
        let region = SharedRegion::create(path, HEADER + 2 * slot_bytes)
            .map_err(|e| region_error(path, e))?;
        let w = |i: usize, v: u64| region.word(i).store(v, Ordering::Relaxed);
        w(W_RANKS, size as u64);
        w(W_SLOT, slot_bytes as u64);
        Self::write_rank(&region, 0, 0, 0, &identity);
        w(W_MAGIC, MAGIC);
        region.word(W_READY).store(1, Ordering::Release);
        Ok(Self::new(region, 0, size, slot_bytes))
    }

    fn new(region: SharedRegion, rank: usize, size: usize, slot_bytes: usize) -> Self {
        TensorGroup {
            region,
            rank,
            size,
            slot_bytes,
            ops: AtomicU64::new(0),
            pids: vec![std::process::id(); size],
            peers: Vec::new(),
            collectives: AtomicU64::new(0),
            nanos: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
        }
    }

    fn write_rank(region: &SharedRegion, rank: usize, kv_blocks: u64, weights: u64, id: &[u8; 32]) {
        let base = W_RANK0 + rank * RANK_WORDS;
        region
            .word(base)
            .store(u64::from(std::process::id()), Ordering::Relaxed);
        region.word(base + 2).store(kv_blocks, Ordering::Relaxed);
        region.word(base + 3).store(weights, Ordering::Relaxed);
        for (i, chunk) in id.chunks_exact(8).enumerate() {
            let mut b = [0u8; 8];
            b.copy_from_slice(chunk);
            region
                .word(base + 4 + i)
                .store(u64::from_le_bytes(b), Ordering::Relaxed);
        }
    }

    fn identity_of(&self, rank: usize) -> [u8; 32] {
        let mut id = [0u8; 32];
        let base = W_RANK0 + rank * RANK_WORDS + 4;
        for (i, chunk) in id.chunks_exact_mut(8).enumerate() {
            chunk.copy_from_slice(&self.word(base + i).load(Ordering::Relaxed).to_le_bytes());
        }
        id
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        self.region.word(i)
    }

    /// Rank 0 waits until every peer has joined: each must carry rank 0's identity; a peer
    /// whose process is in `children` (pids of ranks 1.., as started) and has exited, or
    /// that has not joined within `timeout`, fails startup naming it. Then the region's name
    /// is removed (every rank has it mapped) and the peers are let go.
    pub fn wait_for_peers(&mut self, timeout: Duration, children: &[u32]) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let own = self.identity_of(0);
        loop {
            let mut missing = Vec::new();
            for r in 1..self.size {
                let base = W_RANK0 + r * RANK_WORDS;
                if self.word(base + 1).load(Ordering::Acquire) == 0 {
                    if let Some(&pid) = children.get(r - 1) {
                        if !alive(pid) {
                            self.refuse();
                            return Err(Error::Group(format!(
                                "tensor rank {r} (pid {pid}) exited before it joined the group; \
                                 its log says why"
                            )));
                        }
                    }
                    missing.push(r);
                    continue;
                }
                if self.identity_of(r) != own {
                    self.refuse();
                    return Err(Error::Group(format!(
                        "tensor rank {r} loaded a different model or was started with other \
                         settings than tensor rank 0; start every rank with the same flags"
                    )));
                }
            }
            if missing.is_empty() {
                break;
            }
            if Instant::now() >= deadline {
                self.refuse();
                let names: Vec<String> =
                    missing.iter().map(|r| format!("tensor rank {r}")).collect();
                return Err(Error::Group(format!(
                    "the tensor-parallel group did not form within {} s: missing {}",
                    timeout.as_secs(),
                    names.join(", ")
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        self.read_members();
        self.region.unlink();
        self.word(W_GO).store(1, Ordering::Release);
        Ok(())
    }

    fn refuse(&self) {
        self.word(W_GO).store(REFUSED, Ordering::Release);
        self.region.unlink();
    }

    fn read_members(&mut self) {
        for r in 0..self.size {
            let base = W_RANK0 + r * RANK_WORDS;
            self.pids[r] = self.word(base).load(Ordering::Relaxed) as u32;
        }
        self.peers = (1..self.size)
            .map(|r| {
                let base = W_RANK0 + r * RANK_WORDS;
                PeerReport {
                    rank: r,
                    kv_blocks: self.word(base + 2).load(Ordering::Relaxed),
                    weight_bytes: self.word(base + 3).load(Ordering::Relaxed),
                }
            })
            .collect();
    }

    /// A peer's side: maps the region rank 0 created at `path` (waiting for it until
    /// `timeout`), checks it is for `size` ranks, reports this rank, and waits for rank 0
    /// to let the group go — or to refuse it.
    pub fn join(
        path: &Path,
        rank: usize,
        size: usize,
        identity: [u8; 32],
        report: (u64, u64),
        timeout: Duration,
    ) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        let late = || {
            Error::Group(format!(
                "tensor rank {rank}: tensor rank 0 did not open the group at {} within {} s",
                path.display(),
                timeout.as_secs()
            ))
        };
        let region = loop {
            match SharedRegion::open(path) {
                Ok(r) if r.len() > HEADER && r.word(W_READY).load(Ordering::Acquire) == 1 => {
                    break r
                }
                Ok(_) => {}
                // Rank 0 has yet to create it (a region appears at its name already at its
                // full length, so nothing else means "wait").
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(region_error(path, e)),
            }
            if Instant::now() >= deadline {
                return Err(late());
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let word = |i: usize| region.word(i).load(Ordering::Acquire);
        if word(W_MAGIC) != MAGIC || word(W_RANKS) != size as u64 || !(1..size).contains(&rank) {
            return Err(Error::Group(format!(
                "{} is not the shared memory of a {size}-rank tensor-parallel group with a \
                 rank {rank}",
                path.display()
            )));
        }
        let slot_bytes = word(W_SLOT) as usize;
        if HEADER + 2 * slot_bytes != region.len() {
            return Err(Error::Group(format!(
                "{} is {} bytes, not the {} its header describes",
                path.display(),
                region.len(),
                HEADER + 2 * slot_bytes
            )));
        }
        Self::write_rank(&region, rank, report.0, report.1, &identity);
        region
            .word(W_RANK0 + rank * RANK_WORDS + 1)
            .store(1, Ordering::Release);
        let driver = region.word(W_RANK0).load(Ordering::Relaxed) as u32;
        loop {
            match region.word(W_GO).load(Ordering::Acquire) {
                1 => break,
                REFUSED => {
                    return Err(Error::Group(format!(
                        "tensor rank 0 did not form the group (its log says why); tensor rank \
                         {rank} stops"
                    )))
                }
                _ => {}
            }
            if !alive(driver) {
                return Err(Error::Group(format!(
                    "tensor rank 0 (pid {driver}) exited; tensor rank {rank} stops"
                )));
            }
            if Instant::now() >= deadline {
                return Err(late());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut group = Self::new(region, rank, size, slot_bytes);
        group.read_members();
        Ok(group)
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// What the peers reported when they joined (rank 0's view; empty on peers).
    pub fn peers(&self) -> &[PeerReport] {
        match self.rank {
            0 => &self.peers,
            _ => &[],
        }
    }

    /// The largest collective a data slot holds, in bytes.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// The collectives' counters so far.
    pub fn stats(&self) -> CollectiveStats {
        CollectiveStats {
            collectives: self.collectives.load(Ordering::Relaxed),
            seconds: self.nanos.load(Ordering::Relaxed) as f64 * 1e-9,
            bytes: self.bytes.load(Ordering::Relaxed),
        }
    }

    /// Whether rank 0 has shut the group down.
    pub fn is_shut_down(&self) -> bool {
        self.word(W_STOP).load(Ordering::Acquire) == SHUTDOWN
    }

    /// Enters the next collective: its sequence number and its slot's first byte.
    fn enter(&self) -> (u64, usize) {
        let op = self.ops.fetch_add(1, Ordering::Relaxed);
        (op, HEADER + (op % 2) as usize * self.slot_bytes)
    }

    /// Arrives at barrier `op` and waits for every rank to: spinning first, then yielding,
    /// then sleeping in short naps (a rank idle between steps costs next to nothing), and
    /// every 50 ms checking that the others are alive. Fails when a rank has stopped or
    /// died, or the group was shut down.
    fn barrier(&self, op: u64) -> Result<()> {
        let target = (op + 1) * self.size as u64;
        let arrivals = self.word(W_ARRIVALS);
        arrivals.fetch_add(1, Ordering::AcqRel);
        let started = Instant::now();
        let mut check = Duration::from_millis(50);
        let mut spins = 0u32;
        while arrivals.load(Ordering::Acquire) < target {
            spins = spins.saturating_add(1);
            if spins < 2048 {
                std::hint::spin_loop();
                continue;
            }
            self.check_stop()?;
            let waited = started.elapsed();
            if waited >= check {
                self.check_peers()?;
                check = waited + Duration::from_millis(50);
            }
            match waited > Duration::from_millis(2) {
                true => std::thread::sleep(
                    (waited / 64).clamp(Duration::from_micros(20), Duration::from_micros(500)),
                ),
                false => std::thread::yield_now(),
            }
        }
        Ok(())
    }

    fn check_stop(&self) -> Result<()> {
        match self.word(W_STOP).load(Ordering::Acquire) {
            0 => Ok(()),
            SHUTDOWN => Err(Error::Group("tensor rank 0 shut the group down".into())),
            r => Err(Error::Group(format!(
                "tensor rank {} failed; the group stops",
                r - 1
            ))),
        }
    }

    fn check_peers(&self) -> Result<()> {
        for (r, &pid) in self.pids.iter().enumerate() {
            if r != self.rank && !alive(pid) {
                self.fail();
                return Err(Error::Group(format!(
                    "lost tensor rank {r} (pid {pid}): it exited"
                )));
            }
        }
        Ok(())
    }

    /// Tells every rank this one has failed (their next wait returns an error).
    pub fn fail(&self) {
        let _ = self.word(W_STOP).compare_exchange(
            0,
            self.rank as u64 + 1,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    fn count(&self, started: Instant, bytes: usize) {
        self.collectives.fetch_add(1, Ordering::Relaxed);
        self.nanos
            .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn fits(&self, bytes: usize, what: &str) -> Result<()> {
        match bytes + 8 <= self.slot_bytes {
            true => Ok(()),
            false => {
                self.fail();
                Err(Error::Group(format!(
                    "{what} of {bytes} bytes does not fit the group's {}-byte slots",
                    self.slot_bytes
                )))
            }
        }
    }

    /// Rank 0 passes `message` to every rank; every rank gets it (rank 0 an empty vector).
    /// Peers pass `None`.
    pub fn broadcast(&self, message: Option<&[u8]>) -> Result<Vec<u8>> {
        let started = Instant::now();
        let (op, slot) = self.enter();
        if let (0, Some(m)) = (self.rank, message) {
            self.fits(m.len(), "a step")?;
            self.region.write(slot, &(m.len() as u64).to_le_bytes());
            self.region.write(slot + 8, m);
        }
        self.barrier(op)?;
        if self.rank == 0 {
            self.count(started, message.map_or(0, <[u8]>::len));
            return Ok(Vec::new());
        }
        let mut len = [0u8; 8];
        self.region.read(slot, &mut len);
        let len = u64::from_le_bytes(len) as usize;
        if len + 8 > self.slot_bytes {
            return Err(Error::Group(format!(
                "tensor rank 0 broadcast {len} bytes, beyond the {}-byte slots",
                self.slot_bytes
            )));
        }
        let mut out = vec![0u8; len];
        self.region.read(slot + 8, &mut out);
        self.count(started, len);
        Ok(out)
    }

    /// Each rank's columns of a `[rows, Σ widths]` matrix (`local`: `[rows, widths[rank]]`)
    /// put side by side in rank order; every rank gets the whole when `everyone`, else only
    /// rank 0 (the others `None`).
    pub fn gather_columns(
        &self,
        local: &[f32],
        rows: usize,
        widths: &[usize],
        everyone: bool,
    ) -> Result<Option<Buf>> {
        let started = Instant::now();
        let total: usize = widths.iter().sum();
        let (own, offset) = (widths[self.rank], widths[..self.rank].iter().sum::<usize>());
        if local.len() != rows * own {
            return Err(Error::internal(format!(
                "tensor rank {} gathers {} values as {rows} rows of {own}",
                self.rank,
                local.len()
            )));
        }
        self.fits(rows * total * 4, "a gather")?;
        let (op, slot) = self.enter();
        if own > 0 {
            for (i, row) in local.chunks_exact(own).enumerate() {
                self.region.write_f32(slot + (i * total + offset) * 4, row);
            }
        }
        self.barrier(op)?;
        if !everyone && self.rank != 0 {
            self.count(started, local.len() * 4);
            return Ok(None);
        }
        let mut out = Buf::take(rows * total);
        self.region.read_f32(slot, &mut out);
        self.count(started, (local.len() + out.len()) * 4);
        Ok(Some(out))
    }

    /// Rows `owned` of `x` (`[rows, width]`), each computed by exactly one rank, written by
    /// their owners; afterwards every rank's `x` holds every row.
    pub fn gather_rows(&self, x: &mut [f32], width: usize, owned: &[usize]) -> Result<()> {
        let started = Instant::now();
        self.fits(x.len() * 4, "an embedding gather")?;
        let (op, slot) = self.enter();
        for &i in owned {
            self.region
                .write_f32(slot + i * width * 4, &x[i * width..(i + 1) * width]);
        }
        self.barrier(op)?;
        self.region.read_f32(slot, x);
        self.count(started, (owned.len() * width + x.len()) * 4);
        Ok(())
    }
}

impl Drop for TensorGroup {
    fn drop(&mut self) {
        match self.rank {
            // Rank 0 going away ends the group: the peers' next wait returns.
            0 => self.word(W_STOP).store(SHUTDOWN, Ordering::Release),
            _ => self.fail(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_every_item_once_in_order() {
        for (n, size) in [(576, 2), (49152, 3), (5, 4), (3, 3)] {
            let mut next = 0;
            for r in 0..size {
                let s = share(n, size, r);
                assert_eq!(s.start, next);
                next = s.end;
            }
            assert_eq!(next, n);
            assert_eq!(shares(n, size).iter().sum::<usize>(), n);
        }
    }

    #[test]
    fn ranks_gather_each_others_columns_and_rows_and_see_a_dead_group() {
        let path = region_path();
        let id = [7u8; 32];
        let mut driver = TensorGroup::create(&path, 2, 1 << 12, id).expect("creates");
        let p = path.clone();
        let peer = std::thread::spawn(move || {
            let g =
                TensorGroup::join(&p, 1, 2, id, (5, 9), Duration::from_secs(10)).expect("joins");
            let cols = g
                .gather_columns(&[10.0, 11.0, 12.0, 13.0], 2, &[1, 2], true)
                .expect("gathers");
            let mut x = vec![0f32; 6];
            x[2..4].copy_from_slice(&[3.0, 4.0]);
            g.gather_rows(&mut x, 2, &[1]).expect("gathers rows");
            let msg = g.broadcast(None).expect("receives");
            (cols.map(|b| b.to_vec()), x, msg, g.broadcast(None).is_err())
        });
        driver
            .wait_for_peers(Duration::from_secs(10), &[])
            .expect("the peer joins");
        assert!(
            !path.exists(),
            "the name is removed once every rank has mapped it"
        );
        assert_eq!(
            driver.peers(),
            &[PeerReport {
                rank: 1,
                kv_blocks: 5,
                weight_bytes: 9
            }]
        );
        let cols = driver
            .gather_columns(&[1.0, 2.0], 2, &[1, 2], false)
            .expect("gathers")
            .expect("rank 0 gets the whole");
        assert_eq!(&cols[..], &[1.0, 10.0, 11.0, 2.0, 12.0, 13.0]);
        let mut x = vec![0f32; 6];
        x[0..2].copy_from_slice(&[1.0, 2.0]);
        x[4..6].copy_from_slice(&[5.0, 6.0]);
        driver
            .gather_rows(&mut x, 2, &[0, 2])
            .expect("gathers rows");
        assert_eq!(x, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        driver.broadcast(Some(b"step")).expect("sends");
        drop(driver);
        let (cols, rows, msg, stopped) = peer.join().expect("peer thread");
        assert_eq!(cols.expect("everyone"), [1.0, 10.0, 11.0, 2.0, 12.0, 13.0]);
        assert_eq!(rows, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(msg, b"step");
        assert!(stopped, "a peer's wait ends when rank 0 is gone");
    }

    #[test]
    fn a_peer_that_looks_for_the_region_before_rank_0_creates_it_waits_for_it() {
        let (path, id) = (region_path(), [3u8; 32]);
        let p = path.clone();
        let peer = std::thread::spawn(move || {
            TensorGroup::join(&p, 1, 2, id, (1, 1), Duration::from_secs(10)).map(|g| g.rank())
        });
        // The peer polls meanwhile; the region appears at its name already at full length
        // (`SharedRegion::create`), so no poll can find it half made.
        std::thread::sleep(Duration::from_millis(100));
        let mut driver = TensorGroup::create(&path, 2, 4096, id).expect("creates");
        driver
            .wait_for_peers(Duration::from_secs(10), &[])
            .expect("the peer joins");
        assert_eq!(peer.join().expect("peer thread").expect("joins"), 1);
    }

    #[test]
    fn a_peer_of_another_model_is_refused_and_told() {
        let path = region_path();
        let mut driver = TensorGroup::create(&path, 2, 4096, [1u8; 32]).expect("creates");
        let p = path.clone();
        let peer = std::thread::spawn(move || {
            TensorGroup::join(&p, 1, 2, [2u8; 32], (1, 1), Duration::from_secs(10))
        });
        let err = driver
            .wait_for_peers(Duration::from_secs(10), &[])
            .expect_err("refused");
        assert!(
            err.to_string()
                .contains("tensor rank 1 loaded a different model"),
            "{err}"
        );
        let err = peer.join().expect("thread").expect_err("told");
        assert!(err.to_string().contains("did not form the group"), "{err}");
    }

    #[test]
    fn a_peer_that_never_comes_is_named_when_the_wait_times_out() {
        let mut driver = TensorGroup::create(&region_path(), 3, 4096, [1u8; 32]).expect("creates");
        let err = driver
            .wait_for_peers(Duration::from_millis(100), &[])
            .expect_err("times out");
        assert!(
            err.to_string()
                .contains("missing tensor rank 1, tensor rank 2"),
            "{err}"
        );
    }
}
