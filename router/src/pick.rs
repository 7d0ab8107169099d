//! Choosing a replica for a request: consistent hashing with bounded loads (CHWBL, as KubeAI's
//! prefix-hash balancer does) on the prompt's prefix, so requests that share a prefix reach
//! the replica whose cache holds it unless that replica carries more than its share; the least
//! loaded replica otherwise. The bound counts the router's own requests in flight; "least
//! loaded" also weighs what the engines last reported. Pure functions of the replicas'
//! loads, tested as such.

/// Virtual nodes per replica on the hash ring.
const REPLICATION: u32 = 100;

/// What the router knows of one ready replica's load.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    /// Requests the router has in flight to it now.
    pub in_flight: u32,
    /// Requests it reported waiting and running at its last scrape.
    pub queued: Option<f64>,
    /// Its KV-cache usage (0 to 1) at its last scrape.
    pub kv_usage: f64,
}

impl Load {
    /// The requests it is working on: the router's own count, or the engine's when that is
    /// higher (requests that did not come through this router).
    pub fn requests(&self) -> f64 {
        f64::from(self.in_flight).max(self.queued.unwrap_or(0.0))
    }
}

/// Why a replica was picked (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The only ready replica.
    Only,
    /// The owner of the prompt's prefix on the ring, within its bounded share.
    Prefix,
    /// Further round the ring from the prefix's owner, which was over its share.
    PrefixSpilled,
    /// No prefix to place: the least loaded replica.
    LeastLoad,
    /// The replica that holds the stored response the request continues.
    Sticky,
}

impl Reason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Only => "only",
            Reason::Prefix => "prefix",
            Reason::PrefixSpilled => "prefix_spilled",
            Reason::LeastLoad => "least_load",
            Reason::Sticky => "sticky",
        }
    }
}

/// 64-bit FNV-1a, then splitmix64's finalizer for an even spread over the ring; the same in
/// every router replica, so they agree on where a prefix lives.
pub fn hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// Whether a replica carrying `requests` may take one more: at most `factor` times the mean
/// load counting the new request, `(total + 1) / n` (KubeAI's bound).
fn within_share(requests: f64, total: f64, n: usize, factor: f64) -> bool {
    requests + 1.0 <= ((total + 1.0) / n as f64 * factor).max(1.0)
}

/// Picks among `replicas` (each named by a stable key, its load beside it): by `prefix` on
/// the ring when there is one, else the least loaded. `None` when there is no replica.
pub fn pick(
    replicas: &[(&str, Load)],
    prefix: Option<&str>,
    factor: f64,
) -> Option<(usize, Reason)> {
    match replicas.len() {
        0 => return None,
        1 => return Some((0, Reason::Only)),
        _ => {}
    }
    let Some(prefix) = prefix.filter(|p| !p.is_empty()) else {
        return Some((least_loaded(replicas), Reason::LeastLoad));
    };
    let mut ring: Vec<(u64, usize)> = replicas
        .iter()
        .enumerate()
        .flat_map(|(i, (key, _))| {
            (0..REPLICATION).map(move |v| (hash(format!("{key}#{v}").as_bytes()), i))
        })
        .collect();
    ring.sort_unstable();
    // The bound counts the router's own requests, exact at every instant; the engines'
    // scraped queues are seconds old and would let a replica past its share.
    let total: f64 = replicas.iter().map(|(_, l)| f64::from(l.in_flight)).sum();
    let start = ring.partition_point(|&(h, _)| h < hash(prefix.as_bytes()));
    let mut owner = None;
    for k in 0..ring.len() {
        let i = ring[(start + k) % ring.len()].1;
        let owner = *owner.get_or_insert(i);
        if within_share(
            f64::from(replicas[i].1.in_flight),
            total,
            replicas.len(),
            factor,
        ) {
            let reason = if i == owner {
                Reason::Prefix
            } else {
                Reason::PrefixSpilled
            };
            return Some((i, reason));
        }
    }
    Some((least_loaded(replicas), Reason::PrefixSpilled))
}

/// The replica with the fewest requests, then the emptiest KV cache, then the first.
fn least_loaded(replicas: &[(&str, Load)]) -> usize {
    let mut best = 0;
    for (i, (_, l)) in replicas.iter().enumerate().skip(1) {
        let b = &replicas[best].1;
        if (l.requests(), l.kv_usage) < (b.requests(), b.kv_usage) {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(n: usize) -> Vec<(String, Load)> {
        (0..n)
            .map(|i| (format!("10.0.0.{i}:8000"), Load::default()))
            .collect()
    }

    fn view(r: &[(String, Load)]) -> Vec<(&str, Load)> {
        r.iter().map(|(k, l)| (k.as_str(), *l)).collect()
    }

    #[test]
    fn a_prefix_always_reaches_the_same_replica_while_loads_are_even() {
        let replicas = idle(4);
        let mut seen = std::collections::HashSet::new();
        for p in 0..200 {
            let prefix = format!("conversation {p}: hello");
            let first = pick(&view(&replicas), Some(&prefix), 1.25).expect("a replica");
            assert_eq!(first.1, Reason::Prefix);
            assert_eq!(pick(&view(&replicas), Some(&prefix), 1.25), Some(first));
            seen.insert(first.0);
        }
        assert_eq!(seen.len(), 4, "prefixes spread over every replica");
    }

    #[test]
    fn one_hot_prefix_spills_once_its_owner_carries_more_than_its_share() {
        let mut replicas = idle(2);
        let (owner, _) = pick(&view(&replicas), Some("hot"), 1.25).expect("a replica");
        let mut sent = [0u32; 2];
        for _ in 0..40 {
            let (i, _) = pick(&view(&replicas), Some("hot"), 1.25).expect("a replica");
            sent[i] += 1;
            replicas[i].1.in_flight += 1;
        }
        // Never above 1.25 times the mean of 20 (plus the one being placed).
        assert!(sent[owner] <= 26 && sent[1 - owner] >= 14, "{sent:?}");
        let (i, reason) = pick(&view(&replicas), Some("hot"), 1.25).expect("a replica");
        if i != owner {
            assert_eq!(reason, Reason::PrefixSpilled);
        }
    }

    #[test]
    fn without_a_prefix_the_least_loaded_replica_is_picked_and_the_engines_count_wins() {
        let mut replicas = idle(3);
        replicas[0].1.in_flight = 3;
        replicas[1].1.in_flight = 1;
        replicas[2].1.in_flight = 1;
        replicas[2].1.kv_usage = 0.5;
        assert_eq!(
            pick(&view(&replicas), None, 1.25),
            Some((1, Reason::LeastLoad))
        );
        // Replica 1 reports five requests of others in its queue: it is busier than it looks.
        replicas[1].1.queued = Some(5.0);
        assert_eq!(
            pick(&view(&replicas), Some(""), 1.25),
            Some((2, Reason::LeastLoad))
        );
        assert_eq!(pick(&[], None, 1.25), None);
        assert_eq!(
            pick(&view(&replicas[..1]), Some("x"), 1.25),
            Some((0, Reason::Only))
        );
    }

    #[test]
    fn the_hash_is_stable() {
        assert_eq!(hash(b"ferrite"), hash(b"ferrite"));
        assert_ne!(hash(b"ferrite"), hash(b"ferrit"));
    }
}
