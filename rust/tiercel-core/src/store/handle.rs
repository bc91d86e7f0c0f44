//! What a save has done where: one `TierState` per tier, waited on through a `SaveHandle`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::TierSlot;
use crate::error::Error;

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
}

impl SaveHandle {
    pub(super) fn new(step: u64, slots: &[TierSlot]) -> Arc<SaveHandle> {
        Arc::new(SaveHandle {
            step,
            states: Mutex::new(slots.iter().map(|s| (s.config.name.clone(), TierState::Pending)).collect()),
            changed: Condvar::new(),
            started: Instant::now(),
        })
    }

    pub(super) fn set(&self, tier: &str, st: TierState) {
        let mut v = self.states.lock();
        if let Some(e) = v.iter_mut().find(|(n, _)| n == tier) {
            e.1 = st;
        }
        self.changed.notify_all();
    }

    pub fn states(&self) -> Vec<(String, TierState)> {
        self.states.lock().clone()
    }

    pub fn done(&self) -> bool {
        self.states.lock().iter().all(|(_, s)| s.is_final())
    }

    /// Waits until every tier is final or `timeout` passes; true when all are final.
    pub fn wait(&self, timeout: Option<Duration>) -> bool {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut v = self.states.lock();
        while !v.iter().all(|(_, s)| s.is_final()) {
            match deadline {
                Some(d) => {
                    if self.changed.wait_until(&mut v, d).timed_out() {
                        return v.iter().all(|(_, s)| s.is_final());
                    }
                }
                None => self.changed.wait(&mut v),
            }
        }
        true
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}
