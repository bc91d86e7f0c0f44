//! The commit of a step on a tier that every rank writes to (fs, s3, gcs, python), once this
//! rank's data and manifest are durable there, and who runs retention after it.
//!
//! With a job-wide counter (`StepCounter`: torch's TCPStore `add`, JAX's key-value
//! increment), each rank adds 1 to one key per (launch, tier, step, generation) after its
//! manifest is written; the rank whose add returns the number of ranks writes the commit
//! record, create-if-absent, without listing the step or reading a manifest. Each rank makes
//! O(1) requests and O(1) counter operations, whatever the number of ranks.
//!
//! Without one (a job without a coordinator), each rank lists the step and the last to see
//! every manifest reads them all for the generation rule (`StepLayout::try_commit`): O(N)
//! requests per rank. Either way one rank per step runs retention. docs/scale.md, "Commit",
//! has the protocol, why it is correct and what a crash at each point leaves.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::records::{self, Records};
use super::{Store, TierSlot};
use crate::error::{Error, Result};
use crate::format::Manifest;

/// An atomic counter every rank of the job reaches: `add` adds `by` to the number under
/// `key` (0 when absent) and returns the sum, atomically across ranks.
pub trait StepCounter: Send + Sync {
    fn add(&self, key: &str, by: i64) -> Result<i64>;

    /// Removes `key` once nobody adds to it any more; a counter that cannot delete keeps it
    /// (the default: one small key per step and tier).
    fn delete(&self, _key: &str) -> Result<()> {
        Ok(())
    }
}

/// A counter inside this process: for a job of one process (its own counter needs no
/// coordinator), tests and the simulator.
#[derive(Default)]
pub struct LocalCounter {
    counts: Mutex<HashMap<String, i64>>,
}

impl StepCounter for LocalCounter {
    fn add(&self, key: &str, by: i64) -> Result<i64> {
        let mut counts = self.counts.lock();
        let n = counts.entry(key.to_string()).or_insert(0);
        *n += by;
        Ok(*n)
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.counts.lock().remove(key);
        Ok(())
    }
}

/// The counter key of one save (`generation`) of `step` on `tier` in launch `launch`. The
/// generation names the launch too; the launch comes first so that a job's keys share a
/// prefix per launch.
pub fn counter_key(launch: &str, tier: &str, step: u64, generation: &str) -> String {
    format!("tiercel/commit/{launch}/{tier}/{step}/{generation}")
}

/// What a retraction adds to a count (`Store::retract_count`): more than any job has ranks,
/// so a poisoned count never reaches the world size again.
const POISON: i64 = 1 << 40;

/// How long a rank that saves a step again waits for the commit of its earlier save, once
/// that save's count has reached every rank (its committer is writing the record).
const RETRACT_WAIT: Duration = Duration::from_secs(30);

/// How many counted saves a process remembers (per tier and step), as `REMEMBERED_STEPS`.
const REMEMBERED_COUNTS: usize = 4096;

/// The counter and what this process counted with it.
#[derive(Default)]
pub(super) struct Commits {
    pub(super) counter: RwLock<Option<Arc<dyn StepCounter>>>,
    /// (tier, step) -> (counter key, generation) of this rank's save counted in there, until
    /// it is known committed: what `retract_count` poisons before the step is written again.
    counted: Mutex<BTreeMap<(String, u64), Counted>>,
}

/// One save this rank counted in: its counter key and generation.
type Counted = (String, Option<String>);

impl Commits {
    /// A job of one process counts in this process.
    pub(super) fn local() -> Commits {
        let c = Commits::default();
        *c.counter.write() = Some(Arc::new(LocalCounter::default()));
        c
    }
}

/// How one rank's commit attempt on a tier ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The step is committed there (by this rank, or seen committed by another).
    pub committed: bool,
    /// This rank runs retention on the tier after the step: the rank that wrote the commit
    /// record on the counted path, rank 0 on the listing path.
    pub retains: bool,
}

impl Store {
    /// Sets the job-wide counter that commits count ranks in (`commit`); None: commits list.
    pub fn set_counter(&self, counter: Option<Arc<dyn StepCounter>>) {
        *self.commits.counter.write() = counter;
    }

    /// Whether commits count ranks in rather than list (a counter is set).
    pub fn has_counter(&self) -> bool {
        self.commits.counter.read().is_some()
    }

    /// Before this rank writes step `step` to `slot`'s tier again: the count of its earlier
    /// save of the step there, if it counted one in that may not have committed, is poisoned
    /// (`POISON` taken off), so that the ranks still to count that save in never bring it to
    /// the world size: their manifests would be committed with this rank's new one. Where
    /// the count had reached every rank already, its committer is writing (or has written)
    /// the record: this waits for it (bounded), so that the uncommit that follows removes
    /// it rather than race it. Without this, rank 0 saving step 5 again while rank 1 still
    /// writes the first save would let rank 1 commit rank 0's new part with its old one.
    pub(super) fn retract_count(&self, slot: &TierSlot, step: u64) {
        let tier = &slot.config.name;
        let Some((key, generation)) = self.commits.counted.lock().remove(&(tier.clone(), step)) else { return };
        let Some(counter) = self.commits.counter.read().clone() else { return };
        let before = match counter.add(&key, -POISON) {
            Ok(n) => n + POISON,
            Err(e) => {
                // The earlier save may still commit with this rank's new part: a reader then
                // finds its manifest of another save than the commit's, and skips the tier.
                log::warn!("tier '{tier}': step {step} rank {}: cannot retract the earlier save's count '{key}': {e}", self.rank);
                return;
            }
        };
        if before == 0 {
            // The committer removed the key: the record was written before, and the uncommit
            // removes it. Nobody counts under the key any more.
            let _ = counter.delete(&key);
            return;
        }
        if before < i64::from(self.world_size) {
            return; // poisoned before it was whole: that save never commits here
        }
        let deadline = Instant::now() + RETRACT_WAIT;
        while Instant::now() < deadline {
            if slot.tier.commit_record(step).is_ok_and(|r| r.generation == generation) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        log::warn!(
            "tier '{tier}': step {step}: the earlier save's count reached every rank but its commit record did not appear in {} s \
             (its committer died?); writing the step again",
            RETRACT_WAIT.as_secs()
        );
    }

    /// Commits this rank's save `manifest`, now durable on `slot`'s tier, there if it is the
    /// last of the ranks: counted where the job has a counter, the save a generation and the
    /// tier counts commits; else by listing.
    pub(super) fn commit_persisted(&self, slot: &TierSlot, manifest: &Manifest) -> Result<Outcome> {
        let counter = self.commits.counter.read().clone();
        let launch = self.launch.read().clone();
        if let (Some(counter), Some(launch), Some(generation)) = (counter, launch, &manifest.generation) {
            if slot.tier.counts_commits() {
                let key = counter_key(&launch, &slot.config.name, manifest.step, generation);
                let records = Records { counter: &*counter, launch: &launch, tier: &slot.config.name };
                if let Some(outcome) = self.commit_counted(slot, manifest, &records, &key)? {
                    return Ok(outcome);
                }
            }
        }
        let committed = slot.tier.try_commit(manifest.step, self.world_size)?;
        Ok(Outcome { committed, retains: self.rank == 0 })
    }

    /// The counted commit: this rank's manifest of `manifest.generation` is durable, so it
    /// counts itself in under `key`; the rank that brings the count to the world size writes
    /// the commit record. Every add under `key` came from a rank whose manifest of this
    /// generation was durable (a rank adds only after writing it, once per save and tier),
    /// so N adds mean every rank's part of this one save is there: the generation rule (never
    /// commit two saves mixed) holds without reading a manifest. A save of the step again has
    /// another generation, so another key: two racing saves never count towards one commit
    /// (and the rank that saves again takes its count off the earlier key: `retract_count`).
    /// None: the counter failed (logged), and the caller commits by listing: whether the add
    /// happened is unknown, and the listing path is correct either way (it checks every
    /// manifest itself).
    /// Once `COMMIT` is written, the commit is recorded for the ranks' sweeps, and the keys of
    /// a step no sweep asks about any more go (`records`).
    fn commit_counted(&self, slot: &TierSlot, manifest: &Manifest, records: &Records, key: &str) -> Result<Option<Outcome>> {
        let (tier, step, rank, counter) = (&slot.config.name, manifest.step, self.rank, records.counter);
        let counting_failed = |e: Error| {
            log::warn!("tier '{tier}': step {step} rank {rank}: the counter key '{key}': {e}; committing by listing the step instead");
            Ok(None)
        };
        let n = match counter.add(key, 1) {
            Ok(n) => n,
            Err(e) => return counting_failed(e),
        };
        let world = i64::from(self.world_size);
        if n < world {
            // Remembered until a save of the step again retracts it (`retract_count`).
            let mut counted = self.commits.counted.lock();
            counted.insert((tier.clone(), step), (key.to_string(), manifest.generation.clone()));
            while counted.len() > REMEMBERED_COUNTS {
                counted.pop_first();
            }
            return Ok(Some(Outcome { committed: false, retains: false }));
        }
        if n > world {
            // More adds than ranks: another job counts under the same key (two jobs sharing
            // one store and launch token), so the count proves nothing here.
            return counting_failed(Error::integrity(format!("the count is {n}, more than the {world} ranks of this job")));
        }
        crate::failpoint::hit("commit_counted");
        slot.tier.commit_counted(step, self.world_size, &manifest.generation).map_err(|e| e.with_tier(tier).at(step, rank))?;
        if let Err(e) = counter.delete(key) {
            log::debug!("tier '{tier}': step {step}: the counter key '{key}' stays: {e}");
        }
        if let Some(g) = &manifest.generation {
            records.committed(step, g);
        }
        let old = records::to_forget(self.committed.lock().keys().copied(), step, slot.config.keep);
        if let Some(old) = old {
            records.forget(old, &self.generations(old));
        }
        Ok(Some(Outcome { committed: true, retains: true }))
    }
}

impl Store {
    /// This launch's generations of `step` (the saves this process began of it), oldest first.
    fn generations(&self, step: u64) -> Vec<String> {
        let (Some(launch), Some(&n)) = (self.launch.read().clone(), self.committed.lock().get(&step)) else { return vec![] };
        (1..=n).map(|i| format!("{launch}.{i}")).collect()
    }

    /// Whether `step` is committed on `slot`'s tier, as the job's counter knows it for this
    /// rank's own save of it (its newest generation: the manifest in its area); None where
    /// it cannot know (no counter, a step this launch did not save, nothing recorded yet).
    pub(super) fn commit_known(&self, slot: &TierSlot, step: u64) -> Option<bool> {
        let counter = self.commits.counter.read().clone()?;
        let launch = self.launch.read().clone()?;
        let generation = self.generations(step).pop()?;
        if !slot.tier.counts_commits() {
            return None;
        }
        Records { counter: &*counter, launch: &launch, tier: &slot.config.name }.state(step, &generation)
    }

    /// Retention on `slot`'s tier with `opts`, recording the commits it removes where the
    /// job has a counter and the tier counts commits (`records`).
    pub(super) fn run_retention(&self, slot: &TierSlot, opts: &crate::gc::GcOptions) -> Result<Vec<crate::gc::Removal>> {
        let counter = self.commits.counter.read().clone();
        let launch = self.launch.read().clone();
        match (counter, launch) {
            (Some(counter), Some(launch)) if slot.tier.counts_commits() => {
                let records = Records { counter: &*counter, launch: &launch, tier: &slot.config.name };
                records.retain(&*slot.tier, opts, &|s| self.generations(s))
            }
            _ => crate::tier::run_gc(&*slot.tier, opts),
        }
    }
}
