//! Requests a tier's object-store client sent, by kind, with the answers that said "slow
//! down" and the throttle's waits (`object::gate` counts them; `store::metrics` shows them).
//! Here, below both, so that the blob and tier layers can hand the counters up.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Kinds of request to an object store, as `RequestCounters` counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestKind {
    Get,
    Put,
    List,
    Head,
    Delete,
    /// One part of a multipart upload.
    Part,
    /// The start or the completion of a multipart upload.
    Multipart,
}

const REQUEST_KINDS: usize = 7;

/// What a tier's client sent, counted where it sends each HTTP request (`object::gate`):
/// requests by kind (retries included: each is billed and counted against the server's rate),
/// the answers that said "slow down", the time requests waited for the tier's throttle, and
/// the rate it allows now.
#[derive(Debug)]
pub struct RequestCounters {
    by_kind: [AtomicU64; REQUEST_KINDS],
    throttled: AtomicU64,
    wait_nanos: AtomicU64,
    /// The throttle's rate limit as f64 bits; `NO_LIMIT`: none.
    limit: AtomicU64,
}

const NO_LIMIT: u64 = u64::MAX;

impl Default for RequestCounters {
    fn default() -> Self {
        RequestCounters {
            by_kind: Default::default(),
            throttled: AtomicU64::new(0),
            wait_nanos: AtomicU64::new(0),
            limit: AtomicU64::new(NO_LIMIT),
        }
    }
}

impl RequestCounters {
    pub fn sent(&self, kind: RequestKind) {
        self.by_kind[kind as usize].fetch_add(1, Relaxed);
    }
    /// The server answered a request "slow down" (503, 429).
    pub fn throttled(&self) {
        self.throttled.fetch_add(1, Relaxed);
    }
    /// A request waited this long for the throttle (backoff or pace).
    pub fn waited(&self, d: Duration) {
        self.wait_nanos.fetch_add(d.as_nanos() as u64, Relaxed);
    }
    /// The requests per second the throttle allows now (None: unlimited).
    pub fn set_limit(&self, limit: Option<f64>) {
        self.limit.store(limit.map_or(NO_LIMIT, f64::to_bits), Relaxed);
    }
    pub fn count(&self, kind: RequestKind) -> u64 {
        self.by_kind[kind as usize].load(Relaxed)
    }
    /// Every request sent, of every kind.
    pub fn total(&self) -> u64 {
        self.by_kind.iter().map(|c| c.load(Relaxed)).sum()
    }
    pub fn throttled_count(&self) -> u64 {
        self.throttled.load(Relaxed)
    }
    /// Seconds requests waited for the throttle (backoff and pace), in all.
    pub fn waited_seconds(&self) -> f64 {
        self.wait_nanos.load(Relaxed) as f64 / 1e9
    }
    pub(crate) fn limit(&self) -> Option<f64> {
        Some(self.limit.load(Relaxed)).filter(|b| *b != NO_LIMIT).map(f64::from_bits)
    }
}

/// What a tier's writes put on the network against what they delivered, for a tier that
/// sends a destination only what it lacks (the peer tier: a holder rebuilds a replica from
/// the chunks it holds of an earlier step plus those it is sent). Both sum over the write's
/// destinations (every holder of a step); `last_*` are the newest write's.
#[derive(Debug, Default)]
pub struct SentCounters {
    sent: AtomicU64,
    delivered: AtomicU64,
    last_sent: AtomicU64,
    last_delivered: AtomicU64,
}

impl SentCounters {
    /// A write sent `sent` bytes of chunks to deliver `delivered` raw bytes of replicas.
    pub fn wrote(&self, sent: u64, delivered: u64) {
        self.sent.fetch_add(sent, Relaxed);
        self.delivered.fetch_add(delivered, Relaxed);
        self.last_sent.store(sent, Relaxed);
        self.last_delivered.store(delivered, Relaxed);
    }
    /// (sent, delivered) over every write.
    pub fn total(&self) -> (u64, u64) {
        (self.sent.load(Relaxed), self.delivered.load(Relaxed))
    }
    /// (sent, delivered) of the newest write.
    pub fn last(&self) -> (u64, u64) {
        (self.last_sent.load(Relaxed), self.last_delivered.load(Relaxed))
    }
}
