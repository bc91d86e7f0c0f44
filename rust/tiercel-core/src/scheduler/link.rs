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
/// A chunk admitted this soon after the previous one left went back to back with it.
const BACK_TO_BACK: Duration = Duration::from_micros(500);
/// Back-to-back chunks the model needs before it prefers them to all chunks.
const MIN_BACK_TO_BACK: usize = 4;
/// Whole persists remembered per link (`whole_seconds`): the last few, so that the plan
/// follows a link that slows down or speeds up within a few checkpoints.
const WHOLE_JOBS: usize = 4;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A chunk on its way: admitted, not yet followed by the next.
#[derive(Clone, Copy)]
struct InFlight {
    link: u64,
    /// When `acquire` returned, and the clock time of its admission.
    returned: Instant,
    admitted: f64,
    bytes: u64,
    /// It went right behind the chunk before it (no pause between them).
    back_to_back: bool,
}

thread_local! {
    /// The last chunk this thread was admitted. The next `acquire` on the same link by the
    /// same thread (tiers send a job's chunks one after the other) ends it: the gap is what
    /// it cost.
    static LAST: Cell<Option<InFlight>> = const { Cell::new(None) };
}

pub struct Link {
    pub name: String,
    pub kind: LinkKind,
    id: u64,
    rate: Option<f64>,
    bucket: Mutex<(f64, Instant)>,
    traffic: Option<Arc<Traffic>>,
    /// (bytes, seconds, back to back) of the chunks sent last.
    observed: Mutex<VecDeque<(u64, f64, bool)>>,
    /// (bytes, seconds) of the last whole persists over the link, start to commit.
    whole: Mutex<VecDeque<(u64, f64)>>,
    /// Clock time at which the chunks already admitted are expected to be sent (learned mode).
    pipeline_end: Mutex<f64>,
    sent: AtomicU64,
    /// Set when the store closes without waiting (`close`): background chunks stop here.
    closed: std::sync::atomic::AtomicBool,
}

/// What a background job's chunk unwinds with when its link was closed under it (the store
/// closed without waiting for it): the job's runner catches it and says the job was cut off.
/// Unwound with `resume_unwind`, so no panic message is printed.
pub struct LinkClosed;

/// How long a background chunk sleeps at most between two looks at whether its link closed.
const CLOSED_POLL: Duration = Duration::from_millis(50);

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
            whole: Mutex::new(VecDeque::new()),
            pipeline_end: Mutex::new(f64::NEG_INFINITY),
            sent: AtomicU64::new(0),
            closed: Default::default(),
        })
    }

    /// A background chunk of `bytes` is about to leave: waits for the traffic gate, then for
    /// the token bucket. Returns once the chunk may go; a chunk already on its way is never
    /// held back, so pauses and preemption are chunk-granular.
    pub fn acquire(&self, bytes: u64) {
        self.unwind_if_closed();
        let entered = Instant::now();
        let followed = self.observe_previous(entered);
        let admitted = match &self.traffic {
            Some(t) => {
                let view = || LinkView {
                    network: self.kind == LinkKind::Network,
                    bytes,
                    cost: self.cost(bytes),
                    pipeline_end: *self.pipeline_end.lock(),
                };
                t.wait_turn(&self.name, self.id, bytes, view, |now| {
                    if let Some(c) = self.cost(bytes) {
                        let mut end = self.pipeline_end.lock();
                        *end = end.max(now) + c;
                    }
                })
            }
            None => 0.0,
        };
        self.take_tokens(bytes, true);
        self.unwind_if_closed();
        self.sent.fetch_add(bytes, Ordering::Relaxed);
        let now = Instant::now();
        let back_to_back = followed && now.duration_since(entered) < BACK_TO_BACK;
        LAST.with(|l| l.set(Some(InFlight { link: self.id, returned: now, admitted, bytes, back_to_back })));
    }

    /// A restore reads `bytes` over this link: background chunks (on every link of the store)
    /// wait until the returned guard is dropped, and the read takes its tokens first.
    pub fn read(&self, bytes: u64) -> ReadGuard {
        if let Some(t) = &self.traffic {
            t.restore_begin();
        }
        self.take_tokens(bytes, false);
        ReadGuard { traffic: self.traffic.clone() }
    }

    /// A restore sends `bytes` over this link (the relay passing a chunk to another rank,
    /// under a `ReadGuard::restoring` of its own): they take the link's tokens, as every byte
    /// on it does, but never wait at the traffic gate.
    pub fn send_restored(&self, bytes: u64) {
        self.take_tokens(bytes, false);
        self.sent.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Whether its chunks wait for the training job's traffic (`[traffic] mode` other than
    /// off, on a network link): then a chunk must be on the wire when its write returns.
    pub fn paced(&self) -> bool {
        self.kind == LinkKind::Network && self.traffic.as_ref().is_some_and(|t| t.config.mode != crate::policy::TrafficMode::Off)
    }

    /// The link's cost model from the chunks it sent, capped by its bandwidth limit: from
    /// the chunks that went back to back with the one before, where there are enough of them.
    /// A chunk that starts after a pause is written into an emptied send buffer and returns
    /// before most of it is on the wire, so it reads the link faster than it is (a plan too
    /// large for its spans); a chunk behind another waits for the wire.
    pub fn model(&self) -> Option<LinkModel> {
        let all: Vec<(u64, f64, bool)> = self.observed.lock().iter().copied().collect();
        let queued: Vec<(u64, f64)> = all.iter().filter(|o| o.2).map(|o| (o.0, o.1)).collect();
        let obs = if queued.len() >= MIN_BACK_TO_BACK { queued } else { all.iter().map(|o| (o.0, o.1)).collect() };
        fit_link(&obs).map(|m| m.capped(self.rate))
    }

    /// A persist of `bytes` over this link took `seconds` from its start to its commit.
    pub fn whole_took(&self, bytes: u64, seconds: f64) {
        if bytes == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let mut w = self.whole.lock();
        if w.len() == WHOLE_JOBS {
            w.pop_front();
        }
        w.push_back((bytes, seconds));
    }

    /// The seconds a persist of `bytes` takes at the rate of the last whole persists (their
    /// bytes over their seconds), if there were any: what the learned plan holds its
    /// interval to where the chunk model reads the link faster than it is. Only persists of
    /// at least a quarter of `bytes` count: a small one is mostly its fixed costs (a peer
    /// tier's step whose chunks the holder had), and scaled up to a whole checkpoint it would
    /// make the plan wait for hours, so that no new persist came to correct it.
    pub fn whole_seconds(&self, bytes: u64) -> Option<f64> {
        let w = self.whole.lock();
        let (b, t) = w.iter().filter(|o| o.0.saturating_mul(4) >= bytes).fold((0u64, 0.0), |(b, t), o| (b + o.0, t + o.1));
        (b > 0).then(|| bytes as f64 * t / b as f64)
    }

    /// What tells this link from the others (the scheduler lends waiting jobs' slots by it).
    pub(crate) fn id(&self) -> u64 {
        self.id
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
    /// True when there was one (the chunk now entering follows it).
    fn observe_previous(&self, now: Instant) -> bool {
        let Some(InFlight { link, returned, admitted, bytes, back_to_back }) = LAST.with(|l| l.take()) else { return false };
        let took = now.duration_since(returned);
        if link != self.id || took > MAX_CHUNK_GAP {
            return false;
        }
        let mut obs = self.observed.lock();
        if obs.len() == OBSERVATIONS {
            obs.pop_front();
        }
        obs.push_back((bytes, took.as_secs_f64(), back_to_back));
        drop(obs);
        if let Some(t) = &self.traffic {
            t.sent(&self.name, admitted, took.as_secs_f64());
        }
        true
    }

    /// Closes the link to background chunks: the next `acquire` (or one sleeping for its
    /// tokens) unwinds with `LinkClosed`; the job it belongs to ends there, its tier never
    /// committing the step (the commit record is written last).
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    fn unwind_if_closed(&self) {
        if self.closed.load(Ordering::SeqCst) {
            std::panic::resume_unwind(Box::new(LinkClosed));
        }
    }

    /// Takes `bytes` tokens, sleeping while the bucket is in debt (not while a preemption's
    /// flush runs: `Traffic::set_unthrottled`). The bucket holds at most
    /// 50 ms worth of tokens, so an idle link cannot burst far above its rate. `background`:
    /// a background chunk, whose sleep ends early when the link closes.
    fn take_tokens(&self, bytes: u64, background: bool) {
        let Some(rate) = self.rate else { return };
        if self.traffic.as_ref().is_some_and(|t| t.unthrottled()) {
            return;
        }
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
            let _lent = super::lend(self.id);
            let until = Instant::now() + Duration::from_secs_f64(wait);
            loop {
                let now = Instant::now();
                // A preemption lifting the limits ends the sleep too: a persist running when
                // the notice came finishes at full speed.
                let lifted = self.traffic.as_ref().is_some_and(|t| t.unthrottled());
                if lifted {
                    // The debt this chunk ran up went out unthrottled: it is not owed later.
                    *self.bucket.lock() = (0.0, now);
                }
                if now >= until || lifted || (background && self.closed.load(Ordering::SeqCst)) {
                    break;
                }
                std::thread::sleep((until - now).min(CLOSED_POLL));
            }
        }
    }
}

/// A restore read in progress on a link (see `Link::read`).
pub struct ReadGuard {
    traffic: Option<Arc<Traffic>>,
}

impl ReadGuard {
    /// A restore whose bytes also move outside the store's links (the relay of a replicated
    /// restore passes chunks between ranks): background chunks on every link wait while it
    /// runs, as they do for `Link::read`.
    pub fn restoring(traffic: &Arc<Traffic>) -> ReadGuard {
        traffic.restore_begin();
        ReadGuard { traffic: Some(traffic.clone()) }
    }
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
