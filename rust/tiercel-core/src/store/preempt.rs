//! A preemption's flush: a step this rank holds in the memory tier (the newest all ranks
//! hold, as the ranks agree in `tiercel.preempt`; `preempt_steps` lists them) goes to every
//! tier that persists, now, whatever the tiers' `every`, ahead of every other background job
//! (`Priority::Restore`, the top), with every link's limits lifted (`Traffic::set_unthrottled`).
//! The Python side (`tiercel.preempt`) bounds the wait by the grace period, names the ranks
//! a tier still lacks, and reports per tier.
//!
//! The jobs are ordinary persists (`PersistJob`), read from views of the step's files rather
//! than this process's segments (a process that restored the step and saved nothing since
//! flushes it too), under the tier's persist key: a queued persist of an older save to the
//! tier is replaced by this one, a running one finishes first (at full speed, its limits lifted).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::persist::{Part, PersistJob};
use super::{SaveHandle, Store, TierSlot, TierState};
use crate::error::Result;
use crate::format::Manifest;
use crate::scheduler::{Priority, Supersede, SupersedeKey};
use crate::tier::Tier;

impl Store {
    /// The steps a preemption may flush, oldest first: this process's saves that reached the
    /// memory tier (after waiting for those still being flushed there) and this job's steps
    /// committed in the memory tier, of which the tier still holds this rank's part. Empty:
    /// the memory tier holds no step of this rank. The ranks agree on one of them
    /// (`tiercel.preempt`): the newest every rank holds.
    pub fn preempt_steps(&self) -> Vec<u64> {
        self.await_own_saves();
        let mem = self.memory_slot();
        let mut steps: Vec<u64> = {
            let recent = self.recent.lock();
            let reached = |h: &Arc<SaveHandle>| matches!(h.state(&mem.config.name), Some(TierState::Done | TierState::Written));
            recent.iter().filter(|(_, h)| reached(h)).map(|(s, _)| *s).collect()
        };
        let foreign = self.foreign_steps(mem);
        match self.memory.committed_steps() {
            Ok(v) => steps.extend(v.into_iter().filter(|s| !foreign.contains(s))),
            Err(e) => log::warn!("tier '{}': cannot list its steps for the preemption's flush: {e}", mem.config.name),
        }
        steps.sort_unstable();
        steps.dedup();
        // A save that reached the tier may have gone since (its `keep`): only what can be read.
        steps.retain(|s| self.memory.read_manifest(*s, self.rank).is_ok());
        steps
    }

    /// The newest of `preempt_steps`: what this rank flushes on its own.
    pub fn preempt_step(&self) -> Option<u64> {
        self.preempt_steps().last().copied()
    }

    /// Persists `step` (this rank's part, read from the memory tier) to every tier that
    /// persists now: one job per tier at the top priority, `every` and supersession by later
    /// saves aside, with the links' limits lifted until `end_preempt`. A tier that holds this
    /// save already is not written again. The handle tells each tier's outcome (tiers that do
    /// not persist, the peer tier among them: not scheduled).
    pub fn persist_now(self: &Arc<Self>, step: u64) -> Result<Arc<SaveHandle>> {
        self.traffic.set_unthrottled(true);
        // The persists a test failpoint held back are due now, like everything else.
        self.release_held_persists(u64::MAX);
        let mem = &self.memory_slot().config.name;
        let at = |e: crate::error::Error| {
            e.context(format!("the preemption's flush of step {step} of rank {} reads it from tier '{mem}'", self.rank))
                .with_tier(mem)
                .at(step, self.rank)
        };
        let manifest = Arc::new(self.memory.read_manifest(step, self.rank).map_err(at)?);
        let parts: Vec<Part> =
            manifest.objects.iter().map(|o| self.memory.open_view(step, &o.name).map(|v| v as Part)).collect::<Result<_>>().map_err(at)?;
        let handle = SaveHandle::new(step, &self.slots);
        handle.set(mem, TierState::Done);
        // The newest save's place in the save order: this job replaces the queued persists of
        // every save so far, and the saves after it (training goes on: `exit = false`) replace it.
        let order = self.save_order.load(Ordering::SeqCst);
        for (slot, s) in self.later_slots() {
            let name = &s.config.name;
            if !s.config.capabilities().persists {
                handle.set(name, TierState::NotScheduled);
                continue;
            }
            let job = PersistJob {
                store: self.clone(),
                handle: handle.clone(),
                manifest: manifest.clone(),
                parts: parts.clone(),
                slot,
                again: true,
            };
            let supersede = Supersede { key: SupersedeKey::Persist { tier: name.clone() }, order };
            self.submit_persist(job, Priority::Restore, supersede, format!("step {step} (preemption)"));
        }
        log::warn!("rank {}: preemption: flushing step {step} to every tier that persists", self.rank);
        Ok(handle)
    }

    /// The preemption's flush is over (training goes on): the links' limits apply again.
    pub fn end_preempt(&self) {
        self.traffic.set_unthrottled(false);
    }
}

/// Whether `slot`'s tier holds this save already (`PersistJob::again`): committed there (of
/// this save's generation), or this rank's part written, whose commit is then tried. None:
/// it does not; the job writes it.
pub(super) fn held(slot: &TierSlot, m: &Manifest, world_size: u32) -> Option<Result<bool>> {
    let tier: &dyn Tier = &*slot.tier;
    if tier.commit_record(m.step).is_ok_and(|r| r.generation == m.generation) {
        return Some(Ok(true));
    }
    match tier.read_manifest(m.step, m.rank) {
        Ok(mine) if mine.generation == m.generation => Some(tier.try_commit(m.step, world_size)),
        _ => None,
    }
}
