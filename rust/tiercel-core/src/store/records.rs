//! What a job with a counter (`StepCounter`) tells its ranks about commit records, so that a
//! rank's sweep (`tier::areas`) learns whether a step of this launch is committed from the
//! coordinator rather than by a HEAD of `step-<12>/COMMIT`: every rank sweeps after every
//! step, and N HEADs of one step's record is the one place where all ranks meet on one
//! prefix of the object store (docs/scale.md, "Commit").
//!
//! One key per (launch, tier, step, generation), `tiercel/committed/...`:
//! - the committer adds 1 once `COMMIT` of that generation is written (`committed`);
//! - the rank that runs retention reads the keys of the steps it is about to remove, and
//!   after their removal adds `REMOVED` to each that held a recorded commit (`retain`);
//! - the committer of a step deletes the keys of the step `FORGET_AFTER` saves older than the
//!   tier's `keep` (`forget`): the coordinator holds a bounded number of them.
//!
//! What a value says (`state`): 0, nothing known (not recorded yet, never committed, the key
//! forgotten, a counter error): the sweep HEADs the record as before. From 1 to `REMOVED`:
//! that generation's `COMMIT` was written. `REMOVED` or more: it was written and then
//! removed. A generation is one save, committed at most once, so it is never committed again
//! after its removal: "removed" is final. "Committed" may be stale (a save of the step again
//! took the record back; retention removed it and died before adding `REMOVED`): that is
//! what a HEAD earlier would have answered, and a sweep keeps what such an answer keeps (the
//! step's manifest; a step once seen committed stays evidence in `areas` anyway), so it is
//! as safe as the HEAD it replaces. A rank asks only about the generation of its own save of
//! the step (the manifest in its area); a save of the step again has a new generation, so a
//! new key, unknown until its commit is recorded.

use super::StepCounter;
use crate::error::Result;
use crate::gc::{self, GcOptions, Removal};
use crate::tier::Tier;

/// What retention adds to a removed step's key: more than any number of commits.
pub const REMOVED: i64 = 1 << 40;

/// How many saves older than `keep` a step's keys outlive: the ranks' sweeps ask about a step
/// until the sweep after the save that follows its removal (a late retention: one more).
pub const FORGET_AFTER: usize = 3;

/// The key of generation `generation`'s commit of `step` on tier `tier` in launch `launch`.
pub fn record_key(launch: &str, tier: &str, step: u64, generation: &str) -> String {
    format!("tiercel/committed/{launch}/{tier}/{step}/{generation}")
}

/// What the value of a record key says: Some(true) committed, Some(false) committed and
/// removed since, None unknown.
pub fn state_of(value: i64) -> Option<bool> {
    match value {
        v if v >= REMOVED => Some(false),
        v if v > 0 => Some(true),
        _ => None,
    }
}

/// One tier's record keys in one launch, on the job's counter.
pub struct Records<'a> {
    pub counter: &'a dyn StepCounter,
    pub launch: &'a str,
    pub tier: &'a str,
}

impl Records<'_> {
    fn key(&self, step: u64, generation: &str) -> String {
        record_key(self.launch, self.tier, step, generation)
    }

    /// After `COMMIT` of `generation` is written (a failure leaves the key unknown: the
    /// sweeps HEAD the record).
    pub fn committed(&self, step: u64, generation: &str) {
        if let Err(e) = self.counter.add(&self.key(step, generation), 1) {
            log::debug!("tier '{}': step {step}: cannot record its commit on the counter: {e}", self.tier);
        }
    }

    /// Whether `generation`'s commit of `step` is there, as recorded; None: not known.
    pub fn state(&self, step: u64, generation: &str) -> Option<bool> {
        self.counter.add(&self.key(step, generation), 0).ok().and_then(state_of)
    }

    /// Retention (`run_gc` with `opts`) that records the commits it removes: the keys of the
    /// steps in the plan are read before anything is removed (a commit recorded then was
    /// written before the removal, which therefore removed it), and `REMOVED` is added to
    /// those once their step is gone. `generations` names this launch's saves of a step.
    pub fn retain(&self, tier: &dyn Tier, opts: &GcOptions, generations: &dyn Fn(u64) -> Vec<String>) -> Result<Vec<Removal>> {
        let plan = tier.gc_plan(opts)?;
        let mut recorded = vec![];
        for step in gc::steps_of(&plan) {
            for g in generations(step) {
                if self.state(step, &g) == Some(true) {
                    recorded.push((step, g));
                }
            }
        }
        let done = tier.gc_apply(plan)?;
        let removed = gc::steps_of(&done);
        for (step, g) in recorded.iter().filter(|(s, _)| removed.contains(s)) {
            if let Err(e) = self.counter.add(&self.key(*step, g), REMOVED) {
                // Stays "committed": the sweeps keep the step's manifests until the key is
                // forgotten and a HEAD tells.
                log::debug!("tier '{}': step {step}: cannot record its removal on the counter: {e}", self.tier);
            }
        }
        Ok(done)
    }

    /// Deletes the keys of `step` (its generations `generations`): no sweep asks about it
    /// any more.
    pub fn forget(&self, step: u64, generations: &[String]) {
        for g in generations {
            let _ = self.counter.delete(&self.key(step, g));
        }
    }
}

/// The step whose keys the committer of `step` deletes (`Records::forget`): among `saved`,
/// the steps this process saved in ascending order, the one `keep + FORGET_AFTER` saves
/// before `step` (`FORGET_AFTER` before where the tier keeps every step: a committed step is
/// then asked about once).
pub fn to_forget(saved: impl DoubleEndedIterator<Item = u64>, step: u64, keep: Option<usize>) -> Option<u64> {
    saved.rev().filter(|&s| s < step).nth(keep.unwrap_or(0) + FORGET_AFTER - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_says_committed_removed_or_nothing() {
        assert_eq!(state_of(0), None);
        assert_eq!(state_of(-REMOVED), None, "a counter that went below 0 knows nothing");
        assert_eq!(state_of(1), Some(true));
        assert_eq!(state_of(REMOVED), Some(false));
        assert_eq!(state_of(REMOVED + 1), Some(false));
        assert_eq!(state_of(2 * REMOVED + 1), Some(false), "removed by two retentions");
    }

    #[test]
    fn the_committer_forgets_the_step_keep_plus_three_saves_back() {
        assert_eq!(to_forget(1..10, 10, Some(1)), Some(6));
        assert_eq!(to_forget(1..5, 5, Some(1)), Some(1));
        assert_eq!(to_forget(1..4, 4, Some(1)), None);
        assert_eq!(to_forget([100, 200, 300, 400].into_iter(), 500, None), Some(200));
        assert_eq!(to_forget(1..20, 10, Some(2)), Some(5), "steps saved after this one do not count");
    }
}
