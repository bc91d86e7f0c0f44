//! The background work a store still has (per tier: which steps, how many bytes), the
//! bounded wait for it that `flush(timeout)` and `close(timeout)` make, with a progress line
//! while it lasts, and how skipped persists are told: the first one, then a count.

use std::time::{Duration, Instant};

use super::Store;
use crate::policy::format_size;
use crate::scheduler::PendingJob;

/// How often a bounded wait wakes up to run its caller's check (Python looks for Ctrl-C).
const POLL: Duration = Duration::from_millis(100);
/// A wait longer than this says what it waits for, and again every `PROGRESS_EVERY`.
const PROGRESS_AFTER: Duration = Duration::from_secs(2);
const PROGRESS_EVERY: Duration = Duration::from_secs(10);
/// After the first skip of a tier (logged with its reason), one line per this many.
pub const SKIP_SUMMARY_EVERY: u64 = 100;

/// One tier's unfinished background work.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingWork {
    pub tier: String,
    /// Its jobs ("step 8"), running ones first; `running` of them are running.
    pub jobs: Vec<String>,
    pub running: usize,
    /// The raw bytes of those jobs' steps (what is left of them at most).
    pub bytes: u64,
}

impl PendingWork {
    /// The scheduler's jobs, grouped by tier in the order they come.
    pub fn of(jobs: &[PendingJob]) -> Vec<PendingWork> {
        let mut out: Vec<PendingWork> = vec![];
        for j in jobs {
            let i = match out.iter().position(|w| w.tier == j.link) {
                Some(i) => i,
                None => {
                    out.push(PendingWork { tier: j.link.clone(), jobs: vec![], running: 0, bytes: 0 });
                    out.len() - 1
                }
            };
            let w = &mut out[i];
            w.jobs.push(j.label.clone());
            w.running += usize::from(j.running);
            w.bytes += j.size;
        }
        out
    }

    /// "tier 'disk': step 7 (running), step 8 (2.0 MiB); tier 'peer': ..."
    pub fn describe(work: &[PendingWork]) -> String {
        work.iter()
            .map(|w| {
                let jobs: Vec<String> =
                    w.jobs.iter().enumerate().map(|(i, j)| if i < w.running { format!("{j} (running)") } else { j.clone() }).collect();
                format!("tier '{}': {} ({} in all)", w.tier, jobs.join(", "), format_size(w.bytes))
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// How a bounded wait for the background work ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// Nothing is queued or running.
    Idle,
    TimedOut,
    /// The caller's check said to stop (Ctrl-C).
    Stopped,
}

impl Store {
    /// The background work queued or running, per tier.
    pub fn pending_work(&self) -> Vec<PendingWork> {
        PendingWork::of(&self.scheduler.pending_jobs())
    }

    /// Waits until no background work is left, `timeout` passed, or `check` (run every
    /// 100 ms, on this thread) returns false. `closing`: a peer tier's server is about to
    /// stop, so this also waits (up to the tier's `drain_limit`) for the replicas other
    /// hosts still push to it (`Cluster::still_coming`); then `close_waited` closes.
    /// While it lasts longer than 2 s, logs which tiers, steps and bytes it waits for, every
    /// 10 s.
    pub fn wait_background(&self, timeout: Option<Duration>, closing: bool, mut check: impl FnMut() -> bool) -> Waited {
        let start = Instant::now();
        let mut next_progress = start + PROGRESS_AFTER;
        let mut idle_since: Option<Instant> = None;
        loop {
            let now = Instant::now();
            let left = timeout.map(|t| t.saturating_sub(now - start));
            let slice = left.map_or(POLL, |l| l.min(POLL));
            let expected = if self.scheduler.wait_idle_for(slice) {
                if self.queue_held_when_idle() {
                    continue;
                }
                let cluster = match (&self.cluster, closing) {
                    (Some(c), true) => c,
                    _ => return Waited::Idle,
                };
                let since = *idle_since.get_or_insert_with(Instant::now);
                match cluster.still_coming(since.elapsed()) {
                    None => return Waited::Idle,
                    Some(what) => {
                        std::thread::sleep(slice);
                        Some(what)
                    }
                }
            } else {
                None
            };
            if left.is_some_and(|l| l <= slice) {
                return Waited::TimedOut;
            }
            if !check() {
                return Waited::Stopped;
            }
            let now = Instant::now();
            if now >= next_progress {
                let mut what: Vec<String> = expected.into_iter().collect();
                let work = self.pending_work();
                if !work.is_empty() {
                    what.insert(0, PendingWork::describe(&work));
                }
                if !what.is_empty() {
                    log::warn!("rank {}: waiting {:.0} s for background work: {}", self.rank, (now - start).as_secs_f64(), what.join("; "));
                }
                next_progress = now + PROGRESS_EVERY;
            }
        }
    }

    /// Says (once per Ctrl-C) that `close` goes on waiting, for what, and how to leave.
    pub fn note_interrupt(&self) {
        log::warn!(
            "rank {}: interrupted while closing; still waiting for {}. Press Ctrl-C again to leave without it \
             (committed steps stay committed)",
            self.rank,
            PendingWork::describe(&self.pending_work())
        );
    }

    /// Counts a persist that tier `idx` did not get, and tells it: the first with its reason
    /// at the default level (the tier falls behind), then one line per `SKIP_SUMMARY_EVERY`
    /// and a sum at close; each one at debug level.
    pub(super) fn skip_logged(&self, idx: usize, step: u64, why: &str) {
        let n = self.metrics.tier(idx).superseded();
        let name = &self.slots[idx].config.name;
        let rank = self.rank;
        if n == 1 {
            log::warn!(
                "tier '{name}': step {step} of rank {rank} skipped: {why}; the tier falls behind the saves (its bandwidth, \
                 or `every`): further skips are counted (metrics: skips) and summed up every {SKIP_SUMMARY_EVERY} and at close"
            );
        } else if n.is_multiple_of(SKIP_SUMMARY_EVERY) {
            log::warn!("tier '{name}': {n} saves of rank {rank} skipped so far (the latest, step {step}: {why})");
        } else {
            log::debug!("tier '{name}': step {step} of rank {rank} skipped: {why}");
        }
    }

    /// At close: how many saves each tier did not get because newer ones replaced them,
    /// where more than the first one (logged) did.
    pub(super) fn log_skip_summary(&self) {
        for (i, (m, slot)) in self.metrics().iter().zip(&self.slots).enumerate() {
            let n = self.metrics.tier(i).superseded_count();
            if n > 1 {
                let newest = m.last_step.map_or("none".to_string(), |s| format!("step {s}"));
                log::warn!(
                    "tier '{}': {n} saves of rank {} were skipped in all: newer saves replaced them while they waited \
                     (newest on the tier: {newest})",
                    slot.config.name,
                    self.rank
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_work_is_grouped_by_tier_and_described() {
        let job = |link: &str, label: &str, size, running| PendingJob { link: link.into(), label: label.into(), size, running };
        let work = PendingWork::of(&[
            job("disk", "step 7", 1 << 20, true),
            job("peer", "step 8", 10, false),
            job("disk", "step 8", 1 << 20, false),
        ]);
        assert_eq!(
            PendingWork::describe(&work),
            "tier 'disk': step 7 (running), step 8 (2.0 MiB in all); tier 'peer': step 8 (10 B in all)"
        );
    }
}
