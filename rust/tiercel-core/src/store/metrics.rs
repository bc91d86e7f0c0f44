//! What this process's store has done per tier: the counters behind `Store::metrics` (and
//! Python's `store.metrics()`, Prometheus text and `tiercel stats`). Counted where the work
//! happens (save.rs, restore.rs); read without stopping it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

/// How many saves' times are remembered, to tell how far behind a tier is in seconds.
const SAVE_TIMES_KEPT: usize = 4096;

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
    /// Steps handed to the tier that it has not written yet, nor any later step: the tier's
    /// lag counts from the oldest (a tier that never finishes a write still lags).
    outstanding: Mutex<std::collections::BTreeSet<u64>>,
    /// The learned traffic schedule's checkpoint interval (0: none planned).
    interval: AtomicU64,
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
    /// `step` was handed to the tier (queued for it): it lags until the tier has it.
    pub fn scheduled(&self, step: u64) {
        self.outstanding.lock().insert(step);
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
}

/// One tier's numbers at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct TierMetrics {
    pub tier: String,
    /// Steps (this rank's part of each) written to the tier, and their raw bytes.
    pub steps_written: u64,
    pub bytes_written: u64,
    /// Seconds spent writing them (background work: the memory tier's flush, persists).
    pub write_seconds: f64,
    /// bytes_written / write_seconds, when something was written.
    pub write_bytes_per_second: Option<f64>,
    /// Steps read with this tier first in line (readers that read something), and bytes
    /// read from it.
    pub steps_read: u64,
    pub bytes_read: u64,
    /// The newest step this rank finished writing to the tier.
    pub last_step: Option<u64>,
    /// How far the tier is behind the newest save, in steps: from `last_step`, or before the
    /// tier's first write from just before the oldest save handed to it. None while the tier
    /// was handed nothing.
    pub lag_steps: Option<u64>,
    /// Seconds since the oldest save handed to the tier that it has not written (nor a later
    /// one) was made, and still growing while the tier hangs; 0 when it is caught up.
    pub lag_seconds: Option<f64>,
    /// Jobs for the tier waiting in the scheduler's queue.
    pub queue_depth: u64,
    /// Saves the tier did not get (a newer save replaced a queued one, not enough hosts).
    pub skips: u64,
    /// Writes that failed.
    pub failures: u64,
    /// Iterations between checkpoints that reach the tier under the learned traffic
    /// schedule (`[traffic] mode = "learned"`), once it has planned one.
    pub effective_interval: Option<u64>,
}

/// The counters of every tier of a store, and when each recent save was made.
pub struct Metrics {
    tiers: Vec<(String, TierCounters)>,
    saves: Mutex<BTreeMap<u64, f64>>,
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

impl Metrics {
    pub fn new(tiers: impl IntoIterator<Item = String>) -> Metrics {
        Metrics { tiers: tiers.into_iter().map(|t| (t, TierCounters::default())).collect(), saves: Mutex::new(BTreeMap::new()) }
    }

    /// The counters of the tier in slot `i`.
    pub fn tier(&self, i: usize) -> &TierCounters {
        &self.tiers[i].1
    }

    /// A save of `step` was made now.
    pub fn saved(&self, step: u64) {
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
                let oldest = c.outstanding.lock().first().copied();
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
                    lag_steps,
                    lag_seconds,
                    queue_depth: c.queued.load(Relaxed).max(0) as u64,
                    skips: c.skips.load(Relaxed),
                    failures: c.failures.load(Relaxed),
                    effective_interval: Some(c.interval.load(Relaxed)).filter(|n| *n > 0),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            m.tier(0).scheduled(s);
            m.tier(0).written(s, 1, Duration::ZERO);
            m.tier(1).scheduled(s);
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
}
