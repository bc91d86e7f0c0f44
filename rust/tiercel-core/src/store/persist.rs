//! The persist half of a save: once the memory tier holds a step, which later tiers get it
//! and how. `plan` decides, as a pure function of plain facts about each tier (`TierFacts`),
//! so that tests call it without a store; `Store::queue_persists` carries a plan out: the
//! states and metrics of the tiers it skips, and one scheduler job per tier it queues, which
//! writes the step from the memory tier's segments and commits it there. A preemption's
//! flush (`preempt`) queues the same job, at the top priority, from read views of the step.

use std::sync::Arc;
use std::time::Instant;

use super::handle::{probe_commit, Probed};
use super::{SaveHandle, Store, TierSlot, TierState};
use crate::error::Result;
use crate::format::{ChunkSource, Manifest};
use crate::scheduler::{Job, LinkClosed, Priority, Start, Supersede, SupersedeKey};
use crate::shm::{Segment, View};

/// One stored object of a step in the memory tier, as a persist reads it: a segment this
/// process wrote (a save's persists), or a read view of one (a preemption's flush).
pub(super) trait StoredPart: Send + Sync {
    fn bytes(&self) -> &[u8];
}

impl StoredPart for Segment {
    fn bytes(&self) -> &[u8] {
        Segment::bytes(self)
    }
}

impl StoredPart for View {
    fn bytes(&self) -> &[u8] {
        self
    }
}

pub(super) type Part = Arc<dyn StoredPart>;

/// What a persist plan reads about one later tier at the time of a save.
#[derive(Debug, Clone, PartialEq)]
pub struct TierFacts {
    /// The tier's slot in the store (policy order).
    pub slot: usize,
    pub name: String,
    /// The tier's `every`: it gets the steps that are multiples of it.
    pub every: u64,
    /// The scheduler priority of jobs that write to the tier (`Tier::priority`).
    pub priority: Priority,
    /// Why the tier is degraded now (`Store::degraded`: a peer tier short of hosts), if it is.
    pub degraded: Option<String>,
    /// The learned schedule of the tier's link for this checkpoint (`Store::traffic_plan`).
    pub learned: Option<LearnedInterval>,
}

/// What the learned schedule says of a tier: the checkpoint reaches it every `interval`
/// iterations (`every`, or more where the checkpoint does not fit one iteration's idle time:
/// the saves in between are superseded while they wait), and why, when more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LearnedInterval {
    pub interval: u64,
    pub note: Option<String>,
}

/// One save's persists: what happens on each tier after the memory tier, in policy order.
#[derive(Debug, Clone, PartialEq)]
pub struct PersistPlan {
    pub step: u64,
    pub tiers: Vec<TierPersist>,
}

/// What happens to one save on one later tier.
#[derive(Debug, Clone, PartialEq)]
pub struct TierPersist {
    pub slot: usize,
    pub name: String,
    pub action: PersistAction,
}

#[derive(Debug, Clone, PartialEq)]
pub enum PersistAction {
    /// The tier's `every` does not select this step.
    NotScheduled,
    /// The learned schedule's interval (longer than `every`) does not select this step.
    Thinned(LearnedInterval),
    /// The tier is degraded: the step is skipped there, for this reason.
    Degraded(String),
    /// A job for the scheduler: it replaces a job of an earlier save with the same key that
    /// still waits (and is skipped itself when a later save's came first).
    Queue { priority: Priority, supersede: Supersede, learned: Option<LearnedInterval> },
}

/// The persist plan of `step`, the save at `order` in this process's save order, over the
/// later tiers' `facts`. `every` comes first (a step it does not select is not the tier's,
/// degraded or not), then the learned interval, then a degraded tier's skip. The learned
/// interval selects its multiples, as `every` does, so that every rank persists the same
/// steps (a queued persist that a newer save replaces is each rank's own affair: ranks that
/// replaced different steps would leave the tier few steps every rank wrote).
pub fn plan(step: u64, order: u64, facts: Vec<TierFacts>) -> PersistPlan {
    let tiers = facts
        .into_iter()
        .map(|f| {
            let thinned = f.learned.as_ref().filter(|l| l.interval > f.every && !step.is_multiple_of(l.interval));
            let action = if !step.is_multiple_of(f.every) {
                PersistAction::NotScheduled
            } else if let Some(l) = thinned {
                PersistAction::Thinned(l.clone())
            } else if let Some(why) = f.degraded {
                PersistAction::Degraded(why)
            } else {
                let supersede = Supersede { key: SupersedeKey::Persist { tier: f.name.clone() }, order };
                PersistAction::Queue { priority: f.priority, supersede, learned: f.learned }
            };
            TierPersist { slot: f.slot, name: f.name, action }
        })
        .collect();
    PersistPlan { step, tiers }
}

impl Store {
    /// The facts a persist plan reads about every later tier, for the checkpoint `m`: the
    /// learned schedule plans for the bytes that will move over each tier's link
    /// (`Tier::bytes_to_move`), not the step's size.
    pub(super) fn persist_facts(&self, m: &Manifest) -> Vec<TierFacts> {
        self.later_slots()
            .map(|(slot, s)| TierFacts {
                slot,
                name: s.config.name.clone(),
                every: s.config.every,
                priority: s.tier.priority(),
                degraded: self.degraded(&s.config.name),
                learned: self
                    .traffic_plan(s, s.tier.bytes_to_move(m))
                    .map(|p| LearnedInterval { interval: p.effective_interval, note: p.note }),
            })
            .collect()
    }

    /// Carries out `plan` for a step the memory tier holds in `parts`, described by
    /// `manifest`: a tier it skips is told so on `handle` (and in its metrics); each queued
    /// tier gets one scheduler job.
    pub(super) fn queue_persists(self: &Arc<Self>, plan: PersistPlan, handle: &Arc<SaveHandle>, manifest: &Arc<Manifest>, parts: &[Part]) {
        for t in plan.tiers {
            let counters = self.metrics.tier(t.slot);
            let (priority, supersede) = match t.action {
                PersistAction::NotScheduled => {
                    handle.set(&t.name, TierState::NotScheduled);
                    continue;
                }
                PersistAction::Thinned(l) => {
                    counters.set_interval(l.interval);
                    if let Some(note) = &l.note {
                        handle.note(&t.name, l.interval, note);
                    }
                    handle.set(&t.name, TierState::NotScheduled);
                    continue;
                }
                PersistAction::Degraded(why) => {
                    counters.skipped();
                    handle.set(&t.name, TierState::Skipped(why));
                    continue;
                }
                PersistAction::Queue { priority, supersede, learned } => {
                    if let Some(l) = learned {
                        counters.set_interval(l.interval);
                        if let Some(note) = &l.note {
                            handle.note(&t.name, l.interval, note);
                        }
                    }
                    (priority, supersede)
                }
            };
            let job = PersistJob {
                store: self.clone(),
                handle: handle.clone(),
                manifest: manifest.clone(),
                parts: parts.to_vec(),
                slot: t.slot,
                again: false,
            };
            self.submit_persist(job, priority, supersede, format!("step {}", plan.step));
        }
    }

    /// Hands one persist to the scheduler (and counts it queued on its tier).
    pub(super) fn submit_persist(&self, job: PersistJob, priority: Priority, supersede: Supersede, label: String) {
        let counters = self.metrics.tier(job.slot);
        counters.queue(1);
        if self.pins_own_copy(job.slot) {
            self.own_copies.lock().replicating.insert(job.manifest.step);
        }
        counters.scheduled(job.manifest.step, job.manifest.total_bytes());
        self.scheduler.submit(Job {
            link: self.slots[job.slot].link.clone(),
            priority,
            size: job.manifest.total_bytes(),
            label,
            supersede: Some(supersede),
            run: Box::new(move |start| job.run(start)),
        });
    }
}

/// The steps whose own copy the memory tier keeps beyond its `keep`, for a peer tier (one
/// that joins the cluster): a peer tier's copy of a rank's part on the rank's own host is the
/// memory tier's. Without them a host loss finds the lost rank's replica of a step whose
/// other parts the survivors' memory already evicted (the memory tier keeps fewer steps than
/// replication lags behind, or the peer tier gets every few), and reads a slower tier.
#[derive(Default)]
pub(super) struct OwnCopies {
    /// The newest steps committed on the peer tier, as many as it keeps (one where its `keep`
    /// is unset).
    replicated: std::collections::BTreeSet<u64>,
    /// Steps whose persist to the peer tier is queued or running (else a step could leave
    /// memory while its replication runs, and be missing once it commits).
    replicating: std::collections::BTreeSet<u64>,
}

impl OwnCopies {
    pub(super) fn pinned(&self) -> Vec<u64> {
        self.replicated.union(&self.replicating).copied().collect()
    }
}

impl Store {
    fn pins_own_copy(&self, slot: usize) -> bool {
        slot != self.memory_at && self.slots[slot].config.capabilities().cluster
    }

    /// `step`'s persist to `slot` is over (`committed` or not).
    fn own_copy_done(&self, slot: usize, step: u64, committed: bool) {
        if !self.pins_own_copy(slot) {
            return;
        }
        let mut o = self.own_copies.lock();
        o.replicating.remove(&step);
        if committed {
            o.replicated.insert(step);
            while o.replicated.len() > self.slots[slot].config.keep.unwrap_or(1).max(1) {
                o.replicated.pop_first();
            }
        }
    }
}

/// One queued persist: the step in the memory tier's segments, bound for one tier.
pub(super) struct PersistJob {
    pub(super) store: Arc<Store>,
    pub(super) handle: Arc<SaveHandle>,
    pub(super) manifest: Arc<Manifest>,
    pub(super) parts: Vec<Part>,
    pub(super) slot: usize,
    /// The save may be on the tier already (a preemption's flush of a step its own persist
    /// took too): a tier where it committed is not written again, nor one that holds this
    /// rank's part of it (only the commit is tried).
    pub(super) again: bool,
}

impl PersistJob {
    fn run(self, start: Start) {
        let PersistJob { store, handle, manifest, parts, slot: idx, again } = self;
        let slot = &store.slots[idx];
        let (name, step) = (&slot.config.name, manifest.step);
        store.metrics.tier(idx).queue(-1);
        // Whatever way the job ends, its step is no longer being replicated; a commit (below)
        // counts it replicated first.
        let _done = OwnCopyDone(&store, idx, step);
        match start {
            Start::Run => {}
            Start::Superseded { by } => {
                let why = format!("a newer save ({by}) replaced it while it waited");
                store.skip_logged(idx, step, &why);
                handle.set(name, TierState::Skipped(why));
                return;
            }
            Start::Abandoned => {
                handle.set(name, TierState::Skipped("the store was closed before it ran".into()));
                return;
            }
        }
        handle.set(name, TierState::Running);
        // What crosses the link, as the learned plan counts it (before the write: a peer
        // tier's holders have the step's chunks after it).
        let moving = slot.tier.bytes_to_move(&manifest);
        let started = Instant::now();
        // A preemption's flush of a save the tier holds already only tries its commit (by
        // listing: this rank counted itself in when it wrote), and leaves retention alone.
        let held = if again { super::preempt::held(slot, &manifest, store.world_size) } else { None };
        let held = held.map(|res| Some(res.map(|committed| super::Outcome { committed, retains: false })));
        let res = match held.unwrap_or_else(|| write_and_commit(&store, slot, &manifest, &parts)) {
            Some(res) => res,
            None => {
                // The store closed without waiting: cut off between two chunks.
                handle.set(name, TierState::Skipped("the store was closed before it finished".into()));
                return;
            }
        };
        drop(parts);
        match res {
            Ok(super::Outcome { committed, retains }) => {
                let took = started.elapsed();
                if !again {
                    // (A preemption's flush runs unthrottled: not what the link does.)
                    slot.link.whole_took(moving, took.as_secs_f64());
                }
                store.metrics.tier(idx).written(step, manifest.total_bytes(), took);
                if committed {
                    store.metrics.tier(idx).committed(step);
                    store.own_copy_done(idx, step, true);
                }
                log::info!(
                    "tier '{name}': step {step} of rank {} {} ({} bytes in {:.2} s)",
                    store.rank,
                    if committed { "committed" } else { "written" },
                    manifest.total_bytes(),
                    took.as_secs_f64()
                );
                if !committed {
                    // Another rank commits it (the one that counts last, or the last to
                    // finish where ranks list): `wait(commit)` looks for that.
                    let (weak, rank, generation) = (Arc::downgrade(&store), store.rank, manifest.generation.clone());
                    let probe = move || {
                        let store = weak.upgrade();
                        let probed = probe_commit(store.as_ref().map(|s| &*s.slots[idx].tier), step, rank, &generation);
                        if let (Some(s), Probed::Committed) = (&store, &probed) {
                            s.metrics.tier(idx).committed(step);
                        }
                        probed
                    };
                    handle.set_probe(name, Box::new(probe), false);
                }
                handle.set(name, if committed { TierState::Done } else { TierState::Written });
                // One rank per step deletes (`commit::Outcome::retains`), not every rank.
                if retains {
                    if let Err(e) = store.retain(slot) {
                        log::warn!("tier '{name}': retention after step {step} failed: {e}");
                    }
                }
                // Each rank then sweeps what its own earlier saves left (a blob tier's area).
                if let Err(e) = slot.tier.sweep(store.rank, slot.config.keep, &|t| store.commit_known(slot, t)) {
                    log::warn!("tier '{name}': rank {}'s sweep after step {step} failed: {e}", store.rank);
                }
            }
            Err(e) => {
                let e = e
                    .context(format!("persisting step {step} of rank {} to tier '{name}'", store.rank))
                    .with_tier(name)
                    .at(step, store.rank);
                log::error!("{e}");
                store.metrics.tier(idx).failed();
                handle.set(name, TierState::Failed(e));
            }
        }
    }
}

/// Ends a persist's `OwnCopies::replicating` entry when the job ends, whichever way.
struct OwnCopyDone<'a>(&'a Store, usize, u64);

impl Drop for OwnCopyDone<'_> {
    fn drop(&mut self) {
        self.0.own_copy_done(self.1, self.2, false);
    }
}

/// Writes the step to `slot`'s tier and commits it there if this rank is the last
/// (`Store::commit_persisted`): whether it committed and whether this rank runs retention;
/// None when the store closed without waiting and cut the write off (`LinkClosed`).
fn write_and_commit(store: &Store, slot: &TierSlot, manifest: &Manifest, parts: &[Part]) -> Option<Result<super::Outcome>> {
    let src = SegmentSource { manifest, segments: parts };
    let write = || {
        store.retract_count(slot, manifest.step);
        // Items another rank stores for this save are written as references to its copy.
        let matched = store.match_ranks(slot, manifest);
        slot.tier.write_rank(matched.as_ref().unwrap_or(manifest), &src, &slot.link).and_then(|_| store.commit_persisted(slot, manifest))
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(write)) {
        Ok(res) => Some(res),
        Err(p) if p.is::<LinkClosed>() => None,
        Err(p) => std::panic::resume_unwind(p),
    }
}

/// Raw bytes of chunks stored raw in memory-tier segments.
struct SegmentSource<'a> {
    manifest: &'a Manifest,
    segments: &'a [Part],
}

impl ChunkSource for SegmentSource<'_> {
    fn read_raw(&self, item: usize, chunk: usize, dst: &mut [u8]) -> Result<()> {
        dst.copy_from_slice(self.raw(item, chunk));
        Ok(())
    }

    fn raw_slice(&self, item: usize, chunk: usize) -> Option<&[u8]> {
        Some(self.raw(item, chunk))
    }
}

impl SegmentSource<'_> {
    fn raw(&self, item: usize, chunk: usize) -> &[u8] {
        let c = &self.manifest.items[item].chunks[chunk];
        let start = c.stored_offset as usize;
        &self.segments[c.object as usize].bytes()[start..start + c.len as usize]
    }
}

#[cfg(test)]
#[path = "persist_tests.rs"]
mod tests;
