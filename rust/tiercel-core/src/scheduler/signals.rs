//! `Traffic`: what the training loop tells the store about its own communication, and the
//! gate every checkpoint chunk passes before it leaves on its link.
//!
//! The loop (or an adapter's hook) signals `busy()` / `idle()` around its collectives and
//! `iteration()` at the start of each iteration. A chunk bound for a network link then waits:
//! - while a restore reads (any link): a restore preempts background writes between chunks;
//! - mode `signals`: while the training job communicates (or goes at the `floor` rate);
//! - mode `learned`: also until the chunk, costed by the link's model, fits the rest of one
//!   of the idle spans learned over the first `warmup` iterations (see `plan`), so that it
//!   ends before the next collective starts rather than being cut off by its signal.
//!
//! Time comes from a `Clock`, so the profile can be fed synthetic timelines in tests.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::plan::{self, IdleProfile, Interval, IterationTrace, EPS};
use crate::error::{Error, Result};
use crate::policy::{TrafficConfig, TrafficMode};

/// Seconds since some fixed origin.
pub trait Clock: Send + Sync {
    fn now(&self) -> f64;
}

pub struct SystemClock(Instant);

impl SystemClock {
    pub fn shared() -> Arc<dyn Clock> {
        Arc::new(SystemClock(Instant::now()))
    }
}

impl Clock for SystemClock {
    fn now(&self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }
}

/// Background writes wait this long after a restore's last chunk, so that the chunks of one
/// restore do not let a persist chunk through between each other.
const RESTORE_GRACE: f64 = 0.02;
/// Waits re-check at least this often (a clock that moved, a span that began).
const POLL: Duration = Duration::from_millis(50);
/// The timeline keeps at most this many events.
const MAX_EVENTS: usize = 200_000;

/// One entry of the timeline (`Traffic::timeline`): `kind` is "busy", "idle", "iteration",
/// or "chunk" (`bytes` admitted onto `link`; `seconds`: how long it took to send, once known).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub t: f64,
    pub kind: &'static str,
    pub link: String,
    pub bytes: u64,
    pub seconds: Option<f64>,
}

#[derive(Default)]
struct State {
    busy: u32,
    busy_since: f64,
    /// How much later (negative: earlier) than learned the idle spans of this iteration
    /// begin, as the last `idle()` found (`drift`); 0 at each iteration's start.
    drift: f64,
    iteration_start: Option<f64>,
    iterations: u64,
    current: IterationTrace,
    traces: Vec<IterationTrace>,
    profile: Option<IdleProfile>,
    restores: u32,
    restore_end: Option<f64>,
    recording: bool,
    events: Vec<Event>,
    /// Chunks that waited for the gate, and for how long in all.
    waits: u64,
    wait_seconds: f64,
}

impl State {
    fn record(&mut self, ev: Event) {
        if self.recording && self.events.len() < MAX_EVENTS {
            self.events.push(ev);
        }
    }
}

/// What a chunk does now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Decision {
    Go,
    /// Go after this many seconds (the floor rate during training communication).
    Floor(f64),
    /// Wait for a signal (idle, a restore's end).
    Wait,
    /// Wait until this clock time (a learned span starts).
    Until(f64),
}

/// What the gate knows of a link when a chunk asks to pass.
pub(super) struct LinkView {
    pub network: bool,
    /// The chunk's size.
    pub bytes: u64,
    /// The chunk's cost on the link (None: no model yet; the chunk will be the measurement).
    pub cost: Option<f64>,
    /// Clock time at which the chunks this link already admitted are expected to be sent.
    pub pipeline_end: f64,
}

pub struct Traffic {
    pub config: TrafficConfig,
    clock: Arc<dyn Clock>,
    st: Mutex<State>,
    changed: Condvar,
    /// A preemption's flush runs (`set_unthrottled`): chunks pass the gate and the links'
    /// bandwidth limits at once, for the job is about to stop and has nothing left to protect.
    unthrottled: std::sync::atomic::AtomicBool,
}

/// A snapshot for `stats` (Python's `store.traffic.stats()`).
#[derive(Debug, Clone)]
pub struct TrafficStats {
    pub busy: bool,
    pub iterations: u64,
    pub profiled: usize,
    pub profile: Option<IdleProfile>,
    pub waits: u64,
    pub wait_seconds: f64,
}

impl Traffic {
    pub fn new(config: TrafficConfig, clock: Arc<dyn Clock>) -> Arc<Traffic> {
        Arc::new(Traffic { config, clock, st: Mutex::new(State::default()), changed: Condvar::new(), unthrottled: Default::default() })
    }

    /// Lifts (true) or restores (false) every gate and bandwidth limit of the store's links:
    /// a preemption's flush (`Store::persist_now`) sends at the links' full speed. Chunks
    /// already waiting at the gate go at once.
    pub fn set_unthrottled(&self, on: bool) {
        self.unthrottled.store(on, std::sync::atomic::Ordering::SeqCst);
        let _st = self.st.lock();
        self.changed.notify_all();
    }

    pub fn unthrottled(&self) -> bool {
        self.unthrottled.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub fn now(&self) -> f64 {
        self.clock.now()
    }

    /// The training job starts communicating (nested calls count).
    pub fn busy(&self) {
        let now = self.clock.now();
        let mut st = self.st.lock();
        st.busy += 1;
        if st.busy == 1 {
            st.busy_since = now;
            st.record(Event { t: now, kind: "busy", link: String::new(), bytes: 0, seconds: None });
        }
    }

    /// The training job's communication that `busy` announced is over.
    pub fn idle(&self) -> Result<()> {
        let now = self.clock.now();
        let mut st = self.st.lock();
        if st.busy == 0 {
            return Err(Error::invalid("traffic.idle() without a matching busy(): call them in pairs (or use training_comm())"));
        }
        st.busy -= 1;
        if st.busy == 0 {
            let since = st.busy_since;
            close_busy(&mut st, since, now);
            if let (Some(p), Some(it)) = (&st.profile, st.iteration_start) {
                st.drift = drift(p, now - it, st.drift);
            }
            st.record(Event { t: now, kind: "idle", link: String::new(), bytes: 0, seconds: None });
            self.changed.notify_all();
        }
        Ok(())
    }

    /// A training iteration starts. The first `warmup` iterations are profiled; then, in
    /// mode `learned`, their idle spans become the schedule.
    pub fn iteration(&self) {
        let now = self.clock.now();
        let mut st = self.st.lock();
        if let Some(start) = st.iteration_start {
            if st.busy > 0 {
                // Communication that runs across the boundary belongs to both iterations.
                let since = st.busy_since;
                close_busy(&mut st, since, now);
                st.busy_since = now;
            }
            let mut trace = std::mem::take(&mut st.current);
            trace.length = now - start;
            if st.profile.is_none() && trace.length > 0.0 {
                st.traces.push(trace);
                if st.traces.len() >= self.config.warmup as usize {
                    st.profile = plan::learn(&st.traces);
                    if let Some(p) = &st.profile {
                        log::info!(
                            "traffic: learned {} idle spans ({:.1} ms idle of a {:.1} ms iteration) over {} iterations",
                            p.spans.len(),
                            p.idle() * 1e3,
                            p.iteration * 1e3,
                            p.iterations
                        );
                    }
                }
            }
        }
        st.iteration_start = Some(now);
        st.drift = 0.0;
        st.iterations += 1;
        st.record(Event { t: now, kind: "iteration", link: String::new(), bytes: 0, seconds: None });
        self.changed.notify_all();
    }

    /// The learned idle spans, once `warmup` iterations were profiled.
    pub fn profile(&self) -> Option<IdleProfile> {
        self.st.lock().profile.clone()
    }

    pub fn stats(&self) -> TrafficStats {
        let st = self.st.lock();
        TrafficStats {
            busy: st.busy > 0,
            iterations: st.iterations,
            profiled: st.traces.len(),
            profile: st.profile.clone(),
            waits: st.waits,
            wait_seconds: st.wait_seconds,
        }
    }

    /// Starts (or stops) keeping the timeline of signals and chunks; starting clears it.
    pub fn set_recording(&self, on: bool) {
        let mut st = self.st.lock();
        st.recording = on;
        if on {
            st.events.clear();
        }
    }

    pub fn timeline(&self) -> Vec<Event> {
        self.st.lock().events.clone()
    }

    pub(super) fn restore_begin(&self) {
        self.st.lock().restores += 1;
    }

    pub(super) fn restore_end(&self) {
        let now = self.clock.now();
        let mut st = self.st.lock();
        st.restores -= 1;
        st.restore_end = Some(now);
        self.changed.notify_all();
    }

    /// A chunk of `bytes` that was sent in `seconds` on `link` (for the timeline).
    pub(super) fn sent(&self, link: &str, start: f64, seconds: f64) {
        let mut st = self.st.lock();
        if st.recording {
            if let Some(ev) = st.events.iter_mut().rev().take(256).find(|e| e.kind == "chunk" && e.link == link && e.t == start) {
                ev.seconds = Some(seconds);
            }
        }
    }

    /// Blocks until a chunk of `bytes` may leave on link `name` (`link_id`), which `view`
    /// describes; returns the clock time it was admitted at. `admit` runs under the lock when
    /// it goes (the link moves its pipeline on). While it waits, its job's slot is lent.
    pub(super) fn wait_turn(&self, name: &str, link_id: u64, bytes: u64, view: impl Fn() -> LinkView, admit: impl FnOnce(f64)) -> f64 {
        let mut st = self.st.lock();
        let mut waited_from = None;
        let mut lent = None;
        loop {
            let now = self.clock.now();
            let d = self.decide(&st, &view(), now);
            let floor = match d {
                Decision::Go => None,
                Decision::Floor(s) => Some(s),
                Decision::Wait | Decision::Until(_) => {
                    waited_from.get_or_insert(now);
                    if lent.is_none() {
                        lent = super::lend(link_id);
                    }
                    let dt = match d {
                        Decision::Until(t) => Duration::from_secs_f64((t - now).clamp(0.0, POLL.as_secs_f64())),
                        _ => POLL,
                    };
                    self.changed.wait_for(&mut st, dt.max(Duration::from_micros(100)));
                    continue;
                }
            };
            if let Some(from) = waited_from {
                st.waits += 1;
                st.wait_seconds += now - from;
            }
            admit(now);
            st.record(Event { t: now, kind: "chunk", link: name.to_string(), bytes, seconds: None });
            drop(st);
            if let Some(s) = floor {
                let _lent = lent.or_else(|| super::lend(link_id));
                std::thread::sleep(Duration::from_secs_f64(s));
            }
            return now;
        }
    }

    /// The gate's rule (see the module's comment), as a function of the state and the time.
    #[cfg(test)]
    pub(super) fn decide_at(&self, link: &LinkView, now: f64) -> Decision {
        self.decide(&self.st.lock(), link, now)
    }

    fn decide(&self, st: &State, link: &LinkView, now: f64) -> Decision {
        if self.unthrottled() {
            return Decision::Go;
        }
        if st.restores > 0 || st.restore_end.is_some_and(|t| now - t < RESTORE_GRACE) {
            return if st.restores > 0 { Decision::Wait } else { Decision::Until(st.restore_end.unwrap_or(now) + RESTORE_GRACE) };
        }
        if self.config.mode == TrafficMode::Off || !link.network {
            return Decision::Go;
        }
        if st.busy > 0 {
            return match self.config.floor {
                Some(rate) => Decision::Floor(link.bytes as f64 / rate as f64),
                None => Decision::Wait,
            };
        }
        match (self.config.mode, &st.profile, st.iteration_start, link.cost) {
            (TrafficMode::Learned, Some(p), Some(it), Some(cost)) if now - it < 2.0 * p.iteration => {
                learned_slot(p, self.config.mu, it + st.drift, now, link.pipeline_end, cost)
            }
            _ => Decision::Go,
        }
    }
}

/// How much further (a share of the learned iteration) an idle span may start from a learned
/// one than the one before it did, and still be taken for it.
const DRIFT: f64 = 0.05;

/// Where the learned spans lie in this iteration, from an idle span that began `began`
/// seconds into it: the learned span nearest to it (allowing for the `previous` drift) is
/// taken to start then, and the later spans move with it.
///
/// The training job's collectives drift against the profile: a checkpoint's chunks slowed
/// them during the warmup (the learned spans start late), or an iteration runs a little
/// slower or faster; each collective shifts all that follows it, so the drift grows
/// through the iteration. Fitted to the offsets alone, a chunk would wait for a span that
/// has already begun and run into the collective that ends it. An idle span whose drift
/// differs from the previous one's by more than `DRIFT` of the iteration is not one of the
/// learned spans (a short gap where the profile, taken while chunks slowed the collectives,
/// saw them merged): giving it a learned span's length would send chunks into the
/// collective that ends it, so the previous drift stands.
fn drift(p: &IdleProfile, began: f64, previous: f64) -> f64 {
    let d = p.spans.iter().map(|s| began - s.offset).min_by(|a, b| (a - previous).abs().total_cmp(&(b - previous).abs()));
    match d {
        Some(d) if (d - previous).abs() <= DRIFT * p.iteration => d,
        _ => previous,
    }
}

/// In iteration started at `it`, a chunk of `cost` seconds that could start at `now` or when
/// the link's earlier chunks are sent (`pipeline_end`), whichever is later: goes
/// if it ends within a learned span's usable part, else waits for the next span that holds it.
/// A chunk longer than every usable span goes at the start of the longest one (one per
/// iteration: the plan reports the lowered frequency).
fn learned_slot(p: &IdleProfile, mu: f64, it: f64, now: f64, pipeline_end: f64, cost: f64) -> Decision {
    let t = now.max(pipeline_end) - it;
    if p.spans.is_empty() {
        // No idle time at all: one chunk per iteration, outside the communication signals.
        return if pipeline_end <= it { Decision::Go } else { Decision::Until(it + p.iteration) };
    }
    let usable = |s: &plan::Span| mu * s.length;
    let fits = p.spans.iter().any(|s| cost <= usable(s));
    let longest = p.spans.iter().enumerate().max_by(|a, b| a.1.length.total_cmp(&b.1.length)).map(|(i, _)| i);
    for (i, s) in p.spans.iter().enumerate() {
        let end = s.offset + usable(s);
        // Spans the chunk cannot fit are skipped; a chunk that fits none uses the longest.
        if (fits && cost > usable(s)) || (!fits && Some(i) != longest) {
            continue;
        }
        if t + EPS >= s.offset && (t + cost <= end + EPS || (!fits && t < end)) {
            return Decision::Go;
        }
        if t + EPS < s.offset {
            return Decision::Until(it + s.offset);
        }
    }
    // Past the last span: the next iteration (its `iteration()` signal wakes the wait).
    Decision::Until(it + p.iteration + p.spans.first().map_or(0.0, |s| s.offset))
}

/// Ends a busy interval `[since, now]`, adding it to the iteration being profiled.
fn close_busy(st: &mut State, since: f64, now: f64) {
    if let Some(start) = st.iteration_start {
        st.current.busy.push(Interval { start: since.max(start) - start, end: now - start });
    }
}
