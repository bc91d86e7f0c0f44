//! `Link`: a named path for bytes (a tier: peer hosts, an object-store endpoint, a local
//! disk). Every chunk a tier sends passes `acquire` first; restore reads take `read`. Here:
//! the token bucket of the policy's `bandwidth`, the `Traffic` gate (signals, learned spans,
//! restores first) and the measurement of what each chunk cost, for the learned model.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::plan::{fit_link, LinkModel};
use super::signals::{LinkView, Traffic};

/// Whether a link shares the network with the training job's own communication (peer and
/// object-store tiers), so that checkpoint chunks on it wait for the training traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkKind {
    Local,
    Network,
}

/// Chunk transfers remembered per link for its cost model.
const OBSERVATIONS: usize = 256;
/// Two chunks further apart than this belong to different jobs: the gap is not a transfer.
const MAX_CHUNK_GAP: Duration = Duration::from_secs(2);

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The last chunk this thread was admitted: (link id, when acquire returned, bytes,
    /// clock time of its admission). The next `acquire` on the same link by the same thread
    /// (tiers send a job's chunks one after the other) ends it: the gap is what it cost.
    static LAST: Cell<Option<(u64, Instant, u64, f64)>> = const { Cell::new(None) };
}

pub struct Link {
    pub name: String,
    pub kind: LinkKind,
    id: u64,
    rate: Option<f64>,
    bucket: Mutex<(f64, Instant)>,
    traffic: Option<Arc<Traffic>>,
    observed: Mutex<VecDeque<(u64, f64)>>,
    /// Clock time at which the chunks already admitted are expected to be sent (learned mode).
    pipeline_end: Mutex<f64>,
    sent: AtomicU64,
}

impl Link {
    /// A link with no traffic signals (tools, tests): only its bandwidth limit applies.
    pub fn new(name: &str, bytes_per_sec: Option<u64>) -> Arc<Link> {
        Self::build(name, bytes_per_sec, LinkKind::Local, None)
    }

    /// A store's link: its chunks also pass `traffic`'s gate.
    pub fn with_traffic(name: &str, bytes_per_sec: Option<u64>, kind: LinkKind, traffic: Arc<Traffic>) -> Arc<Link> {
        Self::build(name, bytes_per_sec, kind, Some(traffic))
    }

    fn build(name: &str, bytes_per_sec: Option<u64>, kind: LinkKind, traffic: Option<Arc<Traffic>>) -> Arc<Link> {
        Arc::new(Link {
            name: name.into(),
            kind,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            rate: bytes_per_sec.map(|r| r as f64),
            bucket: Mutex::new((0.0, Instant::now())),
            traffic,
            observed: Mutex::new(VecDeque::new()),
            pipeline_end: Mutex::new(f64::NEG_INFINITY),
            sent: AtomicU64::new(0),
        })
    }

    /// A background chunk of `bytes` is about to leave: waits for the traffic gate, then for
    /// the token bucket. Returns once the chunk may go; a chunk already on its way is never
    /// held back, so pauses and preemption are chunk-granular.
    pub fn acquire(&self, bytes: u64) {
        let entered = Instant::now();
        self.observe_previous(entered);
        let admitted = match &self.traffic {
            Some(t) => {
                let view = || LinkView {
                    network: self.kind == LinkKind::Network,
                    bytes,
                    cost: self.cost(bytes),
                    pipeline_end: *self.pipeline_end.lock(),
                };
                t.wait_turn(&self.name, bytes, view, |now| {
                    if let Some(c) = self.cost(bytes) {
                        let mut end = self.pipeline_end.lock();
                        *end = end.max(now) + c;
                    }
                })
            }
            None => 0.0,
        };
        self.take_tokens(bytes);
        self.sent.fetch_add(bytes, Ordering::Relaxed);
        LAST.with(|l| l.set(Some((self.id, Instant::now(), bytes, admitted))));
    }

    /// A restore reads `bytes` over this link: background chunks (on every link of the store)
    /// wait until the returned guard is dropped, and the read takes its tokens first.
    pub fn read(&self, bytes: u64) -> ReadGuard {
        if let Some(t) = &self.traffic {
            t.restore_begin();
        }
        self.take_tokens(bytes);
        ReadGuard { traffic: self.traffic.clone() }
    }

    /// Whether its chunks wait for the training job's traffic (`[traffic] mode` other than
    /// off, on a network link): then a chunk must be on the wire when its write returns.
    pub fn paced(&self) -> bool {
        self.kind == LinkKind::Network && self.traffic.as_ref().is_some_and(|t| t.config.mode != super::Mode::Off)
    }

    /// The link's cost model from the chunks it sent, capped by its bandwidth limit.
    pub fn model(&self) -> Option<LinkModel> {
        let obs: Vec<(u64, f64)> = self.observed.lock().iter().copied().collect();
        fit_link(&obs).map(|m| m.capped(self.rate))
    }

    /// Bytes admitted onto this link so far.
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }

    pub fn bandwidth_limit(&self) -> Option<u64> {
        self.rate.map(|r| r as u64)
    }

    fn cost(&self, bytes: u64) -> Option<f64> {
        self.model().map(|m| m.cost(bytes))
    }

    /// Ends this thread's previous chunk on this link, if it was one: records what it cost.
    fn observe_previous(&self, now: Instant) {
        let Some((id, returned, bytes, admitted)) = LAST.with(|l| l.take()) else { return };
        let took = now.duration_since(returned);
        if id != self.id || took > MAX_CHUNK_GAP {
            return;
        }
        let mut obs = self.observed.lock();
        if obs.len() == OBSERVATIONS {
            obs.pop_front();
        }
        obs.push_back((bytes, took.as_secs_f64()));
        drop(obs);
        if let Some(t) = &self.traffic {
            t.sent(&self.name, admitted, took.as_secs_f64());
        }
    }

    /// Takes `bytes` tokens, sleeping while the bucket is in debt. The bucket holds at most
    /// 50 ms worth of tokens, so an idle link cannot burst far above its rate.
    fn take_tokens(&self, bytes: u64) {
        let Some(rate) = self.rate else { return };
        let wait = {
            let mut b = self.bucket.lock();
            let now = Instant::now();
            let burst = rate * 0.05;
            b.0 = (b.0 + now.duration_since(b.1).as_secs_f64() * rate).min(burst);
            b.1 = now;
            b.0 -= bytes as f64;
            if b.0 < 0.0 {
                -b.0 / rate
            } else {
                0.0
            }
        };
        if wait > 0.0 {
            std::thread::sleep(Duration::from_secs_f64(wait));
        }
    }
}

/// A restore read in progress on a link (see `Link::read`).
pub struct ReadGuard {
    traffic: Option<Arc<Traffic>>,
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        if let Some(t) = &self.traffic {
            t.restore_end();
        }
    }
}

#[cfg(test)]
#[path = "link_tests.rs"]
mod tests;
