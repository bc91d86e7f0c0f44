//! What this process's store has done per tier: the counters behind `Store::metrics` (and
//! Python's `store.metrics()`, Prometheus text and `tiercel stats`). Counted where the work
//! happens (save.rs, restore.rs); read without stopping it. Beside them, the times the
//! framework adapters measure where training waits on a checkpoint (`TIMINGS`).
//!
//! Every field is listed once, in a `snapshot!` below: the struct, its field list (name,
//! Prometheus type, help) and its values come from that list; the bindings and the
//! Prometheus text iterate it, and tests/test_metrics.py holds docs/api.md's tables to it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use crate::error::{Error, Result};

/// How many saves' times are remembered, to tell how far behind a tier is in seconds.
const SAVE_TIMES_KEPT: usize = 4096;

pub use crate::requests::{RequestCounters, RequestKind, SentCounters};

/// Counters of one tier.
#[derive(Default)]
pub struct TierCounters {
    steps_written: AtomicU64,
    bytes_written: AtomicU64,
    write_nanos: AtomicU64,
    steps_read: AtomicU64,
    bytes_read: AtomicU64,
    skips: AtomicU64,
    /// Of the skips, those of a save a newer one replaced while it waited.
    superseded: AtomicU64,
    failures: AtomicU64,
    queued: AtomicI64,
    last_step: Mutex<Option<u64>>,
    /// The newest step this rank knows committed on the tier.
    committed_step: Mutex<Option<u64>>,
    /// Steps handed to the tier that it has not written yet, nor any later step, with their
    /// raw bytes: the tier's lag counts from the oldest (a tier that never finishes a write
    /// still lags), and their bytes are what is not on the tier yet.
    outstanding: Mutex<BTreeMap<u64, u64>>,
    /// The learned traffic schedule's checkpoint interval (0: none planned).
    interval: AtomicU64,
    /// What the tier's client sends (object stores; unset for the others).
    requests: std::sync::OnceLock<std::sync::Arc<RequestCounters>>,
    /// What the tier's writes send against what they deliver (the peer tier; unset for the others).
    sent: std::sync::OnceLock<std::sync::Arc<SentCounters>>,
    /// Where the newest save's requests count from: (step, requests, throttled answers) when
    /// it was made.
    save_mark: Mutex<Option<(u64, u64, u64)>>,
}

impl TierCounters {
    /// This rank's part of `step` (`bytes` raw) is on the tier, after `took`.
    pub fn written(&self, step: u64, bytes: u64, took: Duration) {
        self.steps_written.fetch_add(1, Relaxed);
        self.bytes_written.fetch_add(bytes, Relaxed);
        self.write_nanos.fetch_add(took.as_nanos() as u64, Relaxed);
        let mut last = self.last_step.lock();
        *last = Some(last.map_or(step, |l| l.max(step)));
        // This step on the tier covers every earlier one still waiting (a restore takes the
        // newest); a skipped or failed save stays outstanding until then.
        let mut out = self.outstanding.lock();
        *out = out.split_off(&(step + 1));
    }
    /// `step` (`bytes` raw) was handed to the tier (queued for it): it lags until the tier has it.
    pub fn scheduled(&self, step: u64, bytes: u64) {
        self.outstanding.lock().insert(step, bytes);
    }
    /// `step` is committed on the tier (this rank's commit, or another rank's it saw): a
    /// restart from the tier gets it.
    pub fn committed(&self, step: u64) {
        let mut c = self.committed_step.lock();
        *c = Some(c.map_or(step, |s| s.max(step)));
    }
    pub fn failed(&self) {
        self.failures.fetch_add(1, Relaxed);
    }
    /// One more save the tier did not get; returns how many so far.
    pub fn skipped(&self) -> u64 {
        self.skips.fetch_add(1, Relaxed) + 1
    }
    /// A save a newer one replaced while it waited (a skip); returns how many so far.
    pub fn superseded(&self) -> u64 {
        self.skipped();
        self.superseded.fetch_add(1, Relaxed) + 1
    }
    pub fn superseded_count(&self) -> u64 {
        self.superseded.load(Relaxed)
    }
    /// A job for this tier entered the scheduler's queue (`+1`) or left it (`-1`).
    pub fn queue(&self, by: i64) {
        self.queued.fetch_add(by, Relaxed);
    }
    /// The learned traffic schedule sends a checkpoint to this tier every `n` iterations.
    pub fn set_interval(&self, n: u64) {
        self.interval.store(n, Relaxed);
    }
    /// A reader with this tier first in line read its first bytes.
    pub fn step_read(&self) {
        self.steps_read.fetch_add(1, Relaxed);
    }
    pub fn read(&self, bytes: u64) {
        self.bytes_read.fetch_add(bytes, Relaxed);
    }
    /// The tier's client counts its requests in `r`.
    pub fn set_requests(&self, r: std::sync::Arc<RequestCounters>) {
        let _ = self.requests.set(r);
    }
    /// The tier counts what its writes send in `s`.
    pub fn set_sent(&self, s: std::sync::Arc<SentCounters>) {
        let _ = self.sent.set(s);
    }
    /// A save of `step` begins: the tier's requests count from here for it.
    fn mark_save(&self, step: u64) {
        if let Some(r) = self.requests.get() {
            *self.save_mark.lock() = Some((step, r.total(), r.throttled_count()));
        }
    }
}

/// Whether a metric only grows (a Prometheus counter) or goes up and down (a gauge).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        }
    }
}

/// One field of a metrics snapshot: what the bindings, the Prometheus text and the docs
/// iterate, so that a new metric is one line in a `snapshot!` below (and where it is counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub name: &'static str,
    pub kind: Kind,
    /// What it means: the field's doc comment and the Prometheus HELP line.
    pub help: &'static str,
}

/// A metric's value: counts stay whole numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    Int(u64),
    Float(f64),
}

/// A snapshot field's value, None where nothing is known yet.
pub trait ToValue {
    fn value(&self) -> Option<Value>;
}
impl ToValue for u64 {
    fn value(&self) -> Option<Value> {
        Some(Value::Int(*self))
    }
}
impl ToValue for f64 {
    fn value(&self) -> Option<Value> {
        Some(Value::Float(*self))
    }
}
impl<T: ToValue> ToValue for Option<T> {
    fn value(&self) -> Option<Value> {
        self.as_ref().and_then(ToValue::value)
    }
}

/// A snapshot struct whose fields are listed once: the struct, its `FIELDS` (name, kind,
/// help) and `values()` in the same order come from the one list.
macro_rules! snapshot {
    ($(#[$meta:meta])* $name:ident { $key_doc:literal $key:ident: $key_ty:ty } $fields:ident {
        $($field:ident: $ty:ty, $kind:ident, $help:literal;)*
    }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq)]
        pub struct $name {
            #[doc = $key_doc]
            pub $key: $key_ty,
            $(#[doc = $help] pub $field: $ty,)*
        }

        #[doc = concat!("The fields of `", stringify!($name), "`, in order.")]
        pub const $fields: &[Field] = &[$(Field { name: stringify!($field), kind: Kind::$kind, help: $help },)*];

        impl $name {
            /// Each field's value, in the order of its field list.
            pub fn values(&self) -> Vec<(&'static str, Option<Value>)> {
                vec![$((stringify!($field), ToValue::value(&self.$field)),)*]
            }
        }
    };
}

snapshot! {
    /// One tier's numbers at one moment.
    TierMetrics { "The tier's name." tier: String } TIER_FIELDS {
        steps_written: u64, Counter, "steps (this rank's part of each) written to the tier";
        bytes_written: u64, Counter, "raw bytes of the steps written to the tier";
        write_seconds: f64, Counter, "seconds spent writing to the tier, in the background";
        write_bytes_per_second: Option<f64>, Gauge, "bytes_written / write_seconds";
        steps_read: u64, Counter, "steps opened for reading with the tier first in restore order";
        bytes_read: u64, Counter, "bytes read from the tier";
        last_step: Option<u64>, Gauge, "the newest step this rank finished writing to the tier";
        committed_step: Option<u64>, Gauge, "the newest step this rank knows committed on the tier (every rank's part there): what a restart from the tier gets";
        committed_age_seconds: Option<f64>, Gauge, "seconds since committed_step was saved: the training a restart from the tier loses (the recovery point)";
        unwritten_bytes: u64, Gauge, "raw bytes of this rank's saves handed to the tier that it has not written, nor a later step (on a persistent tier: not durable yet)";
        lag_steps: Option<u64>, Gauge, "steps the tier is behind the newest save (before its first write: from its oldest save)";
        lag_seconds: Option<f64>, Gauge, "seconds since the oldest save the tier has not written was made (0: caught up)";
        queue_depth: u64, Gauge, "background jobs for the tier waiting in the queue";
        skips: u64, Counter, "saves the tier did not get (replaced by a newer save while queued, not enough hosts)";
        failures: u64, Counter, "writes to the tier that failed";
        effective_interval: Option<u64>, Gauge, "iterations between checkpoints that reach the tier (learned traffic schedule)";
        requests_get: Option<u64>, Counter, "GET requests the tier's client sent (object stores; every retry counts)";
        requests_put: Option<u64>, Counter, "PUT requests of whole objects (data no larger than one part, manifests, commit records, upload markers)";
        requests_list: Option<u64>, Counter, "LIST requests (one per page of a listing)";
        requests_head: Option<u64>, Counter, "HEAD requests";
        requests_delete: Option<u64>, Counter, "DELETE requests (objects, aborted uploads, multi-object deletes)";
        requests_part: Option<u64>, Counter, "parts of multipart uploads (PUT)";
        requests_multipart: Option<u64>, Counter, "multipart uploads started and completed (POST)";
        requests_throttled: Option<u64>, Counter, "answers that said slow down (503 SlowDown, 429): each met with a backoff, and a lower request rate for the tier";
        throttle_wait_seconds: Option<f64>, Counter, "seconds requests waited for the tier's throttle: backoff after a slow-down answer, pacing at the lowered rate";
        request_rate_limit: Option<f64>, Gauge, "requests per second the tier's throttle allows now (None: unlimited, never told to slow down)";
        save_step: Option<u64>, Gauge, "the step of this rank's newest save (what save_requests counts for)";
        save_requests: Option<u64>, Gauge, "requests the tier's client sent since save_step was saved: its persist (data, manifest, commit record), retention, and what the save had other tiers ask of this one";
        save_throttled: Option<u64>, Gauge, "slow-down answers among save_requests";
        bytes_sent: Option<u64>, Counter, "bytes of chunks the tier's writes sent over the network, over all destinations (peer tier: each holder is sent only the chunks it lacks)";
        bytes_replicated: Option<u64>, Counter, "raw bytes of the copies those writes made, over all destinations (peer tier: the step's bytes times its holders); bytes_sent of them moved, holders rebuilt the rest from their copies of earlier steps";
        last_bytes_sent: Option<u64>, Gauge, "bytes_sent by the newest write";
        last_bytes_replicated: Option<u64>, Gauge, "bytes_replicated by the newest write";
    }
}

snapshot! {
    /// One timing at one moment: how often the time it measures was taken, and how long.
    TimingMetrics { "The timing's name (one of `TIMINGS`)." timing: &'static str } TIMING_FIELDS {
        count: u64, Counter, "times the timing was taken";
        seconds: f64, Counter, "seconds in all";
        last_seconds: Option<f64>, Gauge, "seconds the last time";
    }
}

/// Times the framework adapters take where training waits on a checkpoint, and what each
/// means: recorded by the adapter (`Metrics::timed`) so that `metrics()` and the Prometheus
/// text show them beside the tiers' numbers.
pub const TIMINGS: &[(&str, &str)] = &[
    ("deepspeed_stall", "DeepSpeed's optimizer step waiting for the last save's snapshot (tiercel.deepspeed)"),
    ("orbax_blocking", "an Orbax save holding its caller in tiercel's checkpoint handler (tiercel.orbax)"),
    ("dcp_staging", "DCP's async_save staging the state into shared memory (tiercel.dcp)"),
];

/// The counters of one timing.
#[derive(Default)]
struct TimingCounters {
    count: AtomicU64,
    nanos: AtomicU64,
    last_nanos: AtomicU64,
}

/// The counters of every tier of a store, and when each recent save was made.
pub struct Metrics {
    tiers: Vec<(String, TierCounters)>,
    saves: Mutex<BTreeMap<u64, f64>>,
    /// By `TIMINGS`' order.
    timings: Vec<TimingCounters>,
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl Metrics {
    pub fn new(tiers: impl IntoIterator<Item = String>) -> Metrics {
        Metrics {
            tiers: tiers.into_iter().map(|t| (t, TierCounters::default())).collect(),
            saves: Mutex::new(BTreeMap::new()),
            timings: TIMINGS.iter().map(|_| TimingCounters::default()).collect(),
        }
    }

    /// The timing `name` (one of `TIMINGS`) took `seconds` once more.
    pub fn timed(&self, name: &str, seconds: f64) -> Result<()> {
        let Some(i) = TIMINGS.iter().position(|(n, _)| *n == name) else {
            let known: Vec<&str> = TIMINGS.iter().map(|(n, _)| *n).collect();
            return Err(Error::invalid(format!("no timing '{name}' (known: {}); add it to TIMINGS in store/metrics.rs", known.join(", "))));
        };
        if !(seconds.is_finite() && seconds >= 0.0) {
            return Err(Error::invalid(format!("timing '{name}': {seconds} is no number of seconds")));
        }
        let c = &self.timings[i];
        let nanos = (seconds * 1e9) as u64;
        c.nanos.fetch_add(nanos, Relaxed);
        c.last_nanos.store(nanos, Relaxed);
        c.count.fetch_add(1, Relaxed);
        Ok(())
    }

    /// Every timing of `TIMINGS`, taken or not.
    pub fn timings(&self) -> Vec<TimingMetrics> {
        TIMINGS
            .iter()
            .zip(&self.timings)
            .map(|(&(name, _), c)| {
                let count = c.count.load(Relaxed);
                TimingMetrics {
                    timing: name,
                    count,
                    seconds: c.nanos.load(Relaxed) as f64 / 1e9,
                    last_seconds: (count > 0).then(|| c.last_nanos.load(Relaxed) as f64 / 1e9),
                }
            })
            .collect()
    }

    /// The counters of the tier in slot `i`.
    pub fn tier(&self, i: usize) -> &TierCounters {
        &self.tiers[i].1
    }

    /// A save of `step` was made now.
    pub fn saved(&self, step: u64) {
        for (_, c) in &self.tiers {
            c.mark_save(step);
        }
        let mut s = self.saves.lock();
        s.insert(step, now());
        while s.len() > SAVE_TIMES_KEPT {
            s.pop_first();
        }
    }

    pub fn snapshot(&self) -> Vec<TierMetrics> {
        let saves = self.saves.lock();
        let newest = saves.last_key_value().map(|(s, t)| (*s, *t));
        let at_now = now();
        self.tiers
            .iter()
            .map(|(name, c)| {
                let bytes_written = c.bytes_written.load(Relaxed);
                let write_seconds = c.write_nanos.load(Relaxed) as f64 / 1e9;
                let last_step = *c.last_step.lock();
                let (oldest, unwritten_bytes) = {
                    let out = c.outstanding.lock();
                    (out.first_key_value().map(|(s, _)| *s), out.values().sum())
                };
                let committed_step = *c.committed_step.lock();
                let req = c.requests.get();
                let sent = c.sent.get();
                let mark = *c.save_mark.lock();
                // A step saved before this process (restored) or forgotten has no known age.
                let committed_age_seconds = committed_step.and_then(|s| saves.get(&s)).map(|then| (at_now - then).max(0.0));
                let lag_steps = match (newest, last_step, oldest) {
                    (Some((n, _)), Some(l), _) => Some(n.saturating_sub(l)),
                    (Some((n, _)), None, Some(o)) => Some(n.saturating_sub(o) + 1),
                    _ => None,
                };
                let lag_seconds = match (oldest, last_step) {
                    // A save old enough to be forgotten counts from the oldest remembered.
                    (Some(o), _) => saves.range(o..).next().map(|(_, then)| (at_now - then).max(0.0)),
                    (None, Some(_)) => Some(0.0),
                    (None, None) => None,
                };
                TierMetrics {
                    tier: name.clone(),
                    steps_written: c.steps_written.load(Relaxed),
                    bytes_written,
                    write_seconds,
                    write_bytes_per_second: (write_seconds > 0.0).then(|| bytes_written as f64 / write_seconds),
                    steps_read: c.steps_read.load(Relaxed),
                    bytes_read: c.bytes_read.load(Relaxed),
                    last_step,
                    committed_step,
                    committed_age_seconds,
                    unwritten_bytes,
                    lag_steps,
                    lag_seconds,
                    queue_depth: c.queued.load(Relaxed).max(0) as u64,
                    skips: c.skips.load(Relaxed),
                    failures: c.failures.load(Relaxed),
                    effective_interval: Some(c.interval.load(Relaxed)).filter(|n| *n > 0),
                    requests_get: req.map(|r| r.count(RequestKind::Get)),
                    requests_put: req.map(|r| r.count(RequestKind::Put)),
                    requests_list: req.map(|r| r.count(RequestKind::List)),
                    requests_head: req.map(|r| r.count(RequestKind::Head)),
                    requests_delete: req.map(|r| r.count(RequestKind::Delete)),
                    requests_part: req.map(|r| r.count(RequestKind::Part)),
                    requests_multipart: req.map(|r| r.count(RequestKind::Multipart)),
                    requests_throttled: req.map(|r| r.throttled_count()),
                    throttle_wait_seconds: req.map(|r| r.waited_seconds()),
                    request_rate_limit: req.and_then(|r| r.limit()),
                    save_step: mark.map(|m| m.0),
                    save_requests: mark.zip(req).map(|(m, r)| r.total().saturating_sub(m.1)),
                    save_throttled: mark.zip(req).map(|(m, r)| r.throttled_count().saturating_sub(m.2)),
                    bytes_sent: sent.map(|s| s.total().0),
                    bytes_replicated: sent.map(|s| s.total().1),
                    last_bytes_sent: sent.map(|s| s.last().0),
                    last_bytes_replicated: sent.map(|s| s.last().1),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The field lists name each field once, in the order of the values handed out.
    #[test]
    fn the_field_lists_are_the_values() {
        let m = Metrics::new(["ram".to_string()]);
        let names: Vec<&str> = m.snapshot()[0].values().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, TIER_FIELDS.iter().map(|f| f.name).collect::<Vec<_>>());
        assert_eq!(&names[..3], ["steps_written", "bytes_written", "write_seconds"]);
        assert_eq!(TIER_FIELDS[3], Field { name: "write_bytes_per_second", kind: Kind::Gauge, help: "bytes_written / write_seconds" });
        let names: Vec<&str> = m.timings()[0].values().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["count", "seconds", "last_seconds"]);
    }

    #[test]
    fn timings_count_sum_and_keep_the_last() {
        let m = Metrics::new(["ram".to_string()]);
        assert_eq!(m.timings()[0], TimingMetrics { timing: "deepspeed_stall", count: 0, seconds: 0.0, last_seconds: None });
        m.timed("dcp_staging", 0.25).unwrap();
        m.timed("dcp_staging", 0.5).unwrap();
        let t = m.timings().into_iter().find(|t| t.timing == "dcp_staging").unwrap();
        assert_eq!((t.count, t.seconds, t.last_seconds), (2, 0.75, Some(0.5)));
        assert_eq!(t.values()[0], ("count", Some(Value::Int(2))));
        let e = m.timed("orbax_stall", 1.0).unwrap_err();
        assert!(e.message.contains("no timing 'orbax_stall' (known: deepspeed_stall, orbax_blocking, dcp_staging)"), "{e}");
        assert!(m.timed("dcp_staging", f64::NAN).is_err());
    }

    #[test]
    fn lag_and_throughput_follow_the_counts() {
        let m = Metrics::new(["ram".to_string(), "disk".to_string()]);
        assert_eq!(m.snapshot()[1].lag_steps, None);
        for s in 1..=5 {
            m.saved(s);
        }
        m.tier(0).written(5, 1000, Duration::from_millis(10));
        m.tier(1).written(2, 4000, Duration::from_secs(2));
        m.tier(1).skipped();
        m.tier(1).queue(1);
        let [ram, disk] = <[TierMetrics; 2]>::try_from(m.snapshot()).unwrap();
        assert_eq!((ram.last_step, ram.lag_steps, ram.lag_seconds), (Some(5), Some(0), Some(0.0)));
        assert_eq!((disk.last_step, disk.lag_steps, disk.skips, disk.queue_depth), (Some(2), Some(3), 1, 1));
        assert_eq!(disk.lag_seconds, Some(0.0)); // nothing handed to it is outstanding
        assert_eq!(disk.write_bytes_per_second, Some(2000.0));
    }

    /// A tier that never finishes a write lags from the oldest save handed to it, and the lag
    /// in seconds keeps growing (issue 28, 9).
    #[test]
    fn a_tier_that_never_wrote_lags_from_its_oldest_outstanding_save() {
        let m = Metrics::new(["ram".to_string(), "bucket".to_string()]);
        let save = |s| {
            m.saved(s);
            m.tier(0).scheduled(s, 1);
            m.tier(0).written(s, 1, Duration::ZERO);
            m.tier(1).scheduled(s, 1);
        };
        save(2);
        save(4);
        let first = m.snapshot()[1].clone();
        assert_eq!((first.last_step, first.lag_steps), (None, Some(3)));
        std::thread::sleep(Duration::from_millis(30));
        save(6);
        std::thread::sleep(Duration::from_millis(30));
        let later = m.snapshot()[1].clone();
        assert_eq!((later.last_step, later.lag_steps), (None, Some(5)));
        assert!(later.lag_seconds.unwrap() >= first.lag_seconds.unwrap() + 0.055, "{first:?} {later:?}");
        // Step 4 written: step 6, saved 30 ms before, is what it lags by now.
        m.tier(1).written(4, 1, Duration::ZERO);
        let after = m.snapshot()[1].clone();
        assert_eq!((after.last_step, after.lag_steps), (Some(4), Some(2)));
        assert!(after.lag_seconds.unwrap() < later.lag_seconds.unwrap());
    }

    /// What is at risk (issue 32, 3): a tier's newest committed step, how old its save is,
    /// and the bytes handed to it that it does not have yet.
    #[test]
    fn the_newest_commit_ages_and_unwritten_bytes_clear_when_written() {
        let m = Metrics::new(["ram".to_string(), "disk".to_string()]);
        assert_eq!(
            (m.snapshot()[1].committed_step, m.snapshot()[1].committed_age_seconds, m.snapshot()[1].unwritten_bytes),
            (None, None, 0)
        );
        m.saved(1);
        m.tier(1).scheduled(1, 100);
        m.tier(1).written(1, 100, Duration::ZERO);
        m.tier(1).committed(1);
        std::thread::sleep(Duration::from_millis(30));
        m.saved(2);
        m.tier(1).scheduled(2, 100);
        m.saved(3);
        m.tier(1).scheduled(3, 120); // step 2 is skipped (superseded): it stays unwritten until 3 is written
        let disk = m.snapshot()[1].clone();
        assert_eq!((disk.committed_step, disk.unwritten_bytes), (Some(1), 220));
        assert!(disk.committed_age_seconds.unwrap() >= 0.03, "{disk:?}");
        std::thread::sleep(Duration::from_millis(20));
        assert!(m.snapshot()[1].committed_age_seconds.unwrap() >= disk.committed_age_seconds.unwrap() + 0.02);
        // Written but not committed (another rank commits it): nothing unwritten, the commit unchanged.
        m.tier(1).written(3, 120, Duration::ZERO);
        let disk = m.snapshot()[1].clone();
        assert_eq!((disk.committed_step, disk.unwritten_bytes, disk.last_step), (Some(1), 0, Some(3)));
        m.tier(1).committed(3);
        m.tier(1).committed(2); // an older commit seen late does not go back
        let after = m.snapshot()[1].clone();
        assert_eq!(after.committed_step, Some(3));
        // Step 3 was saved 30 ms after step 1: the recovery point moved up.
        assert!(after.committed_age_seconds.unwrap() + 0.025 < disk.committed_age_seconds.unwrap(), "{disk:?} {after:?}");
    }
}
