//! What a save has done where: one `TierState` per tier, waited on through a `SaveHandle`;
//! `probe_commit` asks a tier whether a save left `written` there has committed since.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::TierSlot;
use crate::error::Error;
use crate::tier::Tier;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierState {
    Pending,
    Running,
    /// This rank's data and manifest are on the tier; other ranks have not all finished.
    Written,
    /// Committed: every rank's data is on the tier.
    Done,
    /// `every` does not select this step for the tier.
    NotScheduled,
    Skipped(String),
    /// The error, kind and fields kept: a background failure surfaces as what it was.
    Failed(Error),
}

impl TierState {
    pub fn is_final(&self) -> bool {
        !matches!(self, TierState::Pending | TierState::Running)
    }
    pub fn describe(&self) -> String {
        match self {
            TierState::Pending => "pending".into(),
            TierState::Running => "running".into(),
            TierState::Written => "written".into(),
            TierState::Done => "committed".into(),
            TierState::NotScheduled => "not scheduled".into(),
            TierState::Skipped(r) => format!("skipped: {r}"),
            TierState::Failed(e) => format!("failed: {}", e.message),
        }
    }
}

/// What a save has done where, tier by tier.
pub struct SaveHandle {
    pub step: u64,
    states: Mutex<Vec<(String, TierState)>>,
    changed: Condvar,
    started: Instant,
    /// For each tier left `Written` (this rank done, other ranks not yet): tells whether the
    /// step has committed there since, by another rank's hand. Looked at by every `wait`
    /// when `always` (the memory tier, which commits per host), else by `wait(commit)`.
    probes: Mutex<Vec<(String, Probe, bool)>>,
    /// Per tier: the effective checkpoint interval of the learned traffic schedule, when it
    /// is longer than the tier's `every`, and why.
    notes: Mutex<Vec<(String, u64, String)>>,
}

/// Where a step left `Written` stands on its tier now.
pub enum Probed {
    /// Committed there (by another rank's hand).
    Committed,
    /// Still waiting for other ranks.
    Pending,
    /// It will never commit there (why): this rank's part was removed or replaced meanwhile.
    Gone(String),
}

/// Looks at where a step left `Written` stands on its tier.
pub type Probe = Box<dyn Fn() -> Probed + Send + Sync>;

/// How often `wait` looks again at a tier whose commit another process writes: from the
/// first value, doubling up to the second.
const PROBE_PAUSE: (Duration, Duration) = (Duration::from_millis(1), Duration::from_millis(50));

impl SaveHandle {
    pub(super) fn new(step: u64, slots: &[TierSlot]) -> Arc<SaveHandle> {
        Arc::new(SaveHandle {
            step,
            states: Mutex::new(slots.iter().map(|s| (s.config.name.clone(), TierState::Pending)).collect()),
            changed: Condvar::new(),
            started: Instant::now(),
            probes: Mutex::new(vec![]),
            notes: Mutex::new(vec![]),
        })
    }

    pub(super) fn set(&self, tier: &str, st: TierState) {
        let mut v = self.states.lock();
        if let Some(e) = v.iter_mut().find(|(n, _)| n == tier) {
            e.1 = st;
        }
        self.changed.notify_all();
    }

    /// The learned schedule reaches `tier` only every `interval` iterations (see `notes`).
    pub(super) fn note(&self, tier: &str, interval: u64, why: &str) {
        self.notes.lock().push((tier.to_string(), interval, why.to_string()));
    }

    /// (tier, effective interval in iterations, why) for each tier whose checkpoints do not
    /// fit the training job's idle time at the policy's `every`.
    pub fn notes(&self) -> Vec<(String, u64, String)> {
        self.notes.lock().clone()
    }

    /// Sets how to learn that `tier`, left `Written`, has committed since; `always`: every
    /// `wait` looks (the memory tier), else only `wait` for the commit.
    pub(super) fn set_probe(&self, tier: &str, probe: Probe, always: bool) {
        let mut probes = self.probes.lock();
        probes.retain(|(t, _, _)| t != tier);
        probes.push((tier.to_string(), probe, always));
    }

    /// A `Written` tier whose commit another rank has written since becomes `Done` (and
    /// one whose part was removed meanwhile `Skipped`): the rank that commits a step on a
    /// tier is whichever finishes last, and the others' handles learn it here rather than
    /// staying `written` for ever. `all`: every probed tier, else those probed `always`.
    /// True while such a tier is still pending.
    fn refresh(&self, all: bool) -> bool {
        let probes = self.probes.lock();
        let mut pending = false;
        for (tier, check, always) in probes.iter() {
            if !(all || *always) || self.state(tier) != Some(TierState::Written) {
                continue;
            }
            match check() {
                Probed::Committed => self.set(tier, TierState::Done),
                Probed::Pending => pending = true,
                Probed::Gone(why) => self.set(tier, TierState::Skipped(why)),
            }
        }
        pending
    }

    pub fn states(&self) -> Vec<(String, TierState)> {
        self.refresh(false);
        self.states.lock().clone()
    }

    /// The state of one tier (None: no such tier).
    pub fn state(&self, tier: &str) -> Option<TierState> {
        self.states.lock().iter().find(|(n, _)| n == tier).map(|(_, s)| s.clone())
    }

    /// Waits until `tier`'s state is final and returns it.
    pub fn wait_tier(&self, tier: &str) -> TierState {
        let mut v = self.states.lock();
        loop {
            match v.iter().find(|(n, _)| n == tier) {
                Some((_, s)) if !s.is_final() => self.changed.wait(&mut v),
                Some((_, s)) => return s.clone(),
                None => return TierState::NotScheduled,
            }
        }
    }

    pub fn done(&self) -> bool {
        self.states.lock().iter().all(|(_, s)| s.is_final())
    }

    /// Waits until every tier is final, and a tier that commits per host (the memory tier)
    /// has committed the step or will never (the other ranks of the host save it in other
    /// processes, so this looks again every few milliseconds), or until `timeout` passes.
    /// `commit`: every tier this rank has written the step to, too, until its commit record
    /// is there (`Done`) or the step will never commit there (`Skipped`): `written` is then
    /// not final. True when all that is so.
    pub fn wait(&self, timeout: Option<Duration>, commit: bool) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut v = self.states.lock();
        while !v.iter().all(|(_, s)| s.is_final()) {
            match deadline {
                Some(d) => {
                    if self.changed.wait_until(&mut v, d).timed_out() {
                        drop(v);
                        self.refresh(commit);
                        return false;
                    }
                }
                None => self.changed.wait(&mut v),
            }
        }
        drop(v);
        let mut pause = PROBE_PAUSE.0;
        while self.refresh(commit) {
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return false;
            }
            std::thread::sleep(deadline.map_or(pause, |d| pause.min(d - now)));
            pause = (pause * 2).min(PROBE_PAUSE.1);
        }
        true
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

/// Where this rank's save of `step` (of `generation`) stands on `tier`, whose commit the
/// last rank to finish writes (on the memory tier, the last of the host): committed (a commit
/// of this save, not of a later save of the step), pending, or gone (retention removed this
/// rank's part as an uncommitted leftover, or a later save replaced it) and never to commit.
pub(super) fn probe_commit(tier: Option<&dyn Tier>, step: u64, rank: u32, generation: &Option<String>) -> Probed {
    let Some(t) = tier else { return Probed::Gone("the store was closed".into()) };
    if t.commit_record(step).is_ok_and(|r| &r.generation == generation) {
        return Probed::Committed;
    }
    match t.read_manifest(step, rank) {
        Ok(mine) if &mine.generation == generation => Probed::Pending,
        Ok(_) => Probed::Gone(format!("step {step} was saved again before the other ranks saved this save of it")),
        Err(e) if e.kind == crate::error::ErrorKind::NotFound => {
            Probed::Gone(format!("step {step} was removed before the other ranks saved it (retention keeps newer steps)"))
        }
        Err(_) => Probed::Pending, // unreadable for a moment (being replaced, a server down): look again
    }
}
