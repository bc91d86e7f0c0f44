//! The Store: one per training process (rank). It copies a step into the memory tier (the
//! only blocking part of a save), then commits, persists and evicts in the background through
//! the scheduler; it reads a step back chunk by chunk from the first tier that has a valid copy.
//!
//! `save` holds the writer (the blocking copy) and the background flush, `handle` what a
//! save has done where, `restore` the reader, `copy` the copy of a step between tiers,
//! `preempt` a preemption's flush.

mod broadcast;
mod cluster;
mod commit;
mod copy;
mod handle;
mod job;
mod matched;
pub mod metrics;
mod pending;
mod persist;
mod preempt;
pub mod records;
mod restore;
mod save;

use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::gc::{self, GcOptions, Removal, Target};
use crate::policy::{Policy, Role, TierConfig, TierSpec};
use crate::scheduler::plan::{self, Plan};
use crate::scheduler::{Link, LinkKind, Scheduler, SystemClock, Traffic};
use crate::tier::memory::MemoryTier;
use crate::tier::open::{open_tiers, Tiers};
use crate::tier::{run_gc, Tier};

pub use broadcast::{BroadcastStats, Group, Member, SharedItem};
pub use cluster::{Cluster, ServerStats};
pub use commit::{counter_key, LocalCounter, Outcome, StepCounter};
pub use copy::copy_step;
pub use handle::{SaveHandle, TierState};
pub use job::{job_of, JobFilter, RUN_ID_VARS};
pub use metrics::{Metrics, TierMetrics, TimingMetrics};
pub use pending::{PendingWork, Waited};
pub use restore::{ItemData, StepReader};
pub use save::{ItemSpec, StepWriter};

pub struct TierSlot {
    pub config: TierConfig,
    pub tier: Arc<dyn Tier>,
    pub link: Arc<Link>,
}

pub struct Store {
    pub policy: Policy,
    pub rank: u32,
    pub world_size: u32,
    /// The tier that plays `Role::Memory` (every save copies into it first), typed, and its
    /// slot.
    memory: Arc<MemoryTier>,
    memory_at: usize,
    slots: Vec<TierSlot>,
    scheduler: Arc<Scheduler>,
    /// The training job's communication signals, and the gate of every link's chunks.
    traffic: Arc<Traffic>,
    copy_pool: rayon::ThreadPool,
    /// The handle on the tier that joins the job's cluster, when the policy has one.
    cluster: Option<Cluster>,
    /// This process's saves whose memory-tier flush may not have finished, by step: a read
    /// of such a step waits for it (read-your-writes).
    recent: parking_lot::Mutex<std::collections::BTreeMap<u64, Arc<SaveHandle>>>,
    /// This job's identity, written into every commit record.
    job: crate::format::JobId,
    foreign: job::Foreign,
    /// The steps the memory tier keeps beyond its `keep` for a peer tier (`OwnCopies`).
    own_copies: parking_lot::Mutex<persist::OwnCopies>,
    /// This rank's writer leases, from its first save to close (`claim_writer`).
    writers: job::Writers,
    /// Opened for tools (`open_as`): every job's steps count as this job's.
    tool: bool,
    /// The object-store tiers' clients, for `check_open`'s bucket checks.
    buckets: Vec<Arc<crate::object::ObjectBlobs>>,
    metrics: Metrics,
    /// This launch of the job (the same on every rank: `set_launch`) and how many times this
    /// process has committed a save of each step: together a save's generation (`next_generation`).
    launch: parking_lot::RwLock<Option<String>>,
    committed: parking_lot::Mutex<std::collections::BTreeMap<u64, u32>>,
    /// The job-wide counter that commits on shared tiers count ranks in (`commit`): the
    /// coordinator's (`set_counter`), this process's own in a job of one; none: they list.
    commits: commit::Commits,
    /// What this process knows of the ranks that hold the same bytes as it (`matched`).
    matching: matched::Matching,
    /// The relay replicas of a group pass chunks over on restore (started on first use).
    relay: parking_lot::Mutex<Option<Arc<crate::transport::relay::Relay>>>,
    /// Whether segments for this process's next save are (being) pre-faulted: after each
    /// save, or after the restore a restarted job begins with (`prefault_after_restore`).
    prefaulting: std::sync::atomic::AtomicBool,
    /// Saves committed by this process so far: each save's place in the save order.
    save_order: std::sync::atomic::AtomicU64,
    /// Persists held back by the `persist_late` failpoint until a later save's are queued,
    /// with their save's order.
    held_persists: parking_lot::Mutex<HeldPersists>,
}

/// The persists of one save, handed to the scheduler when called (see `held_persists`).
type QueuePersists = Box<dyn FnOnce() + Send>;

/// The saves whose persists the `persist_late` failpoint holds back, and the saves already
/// due (every save before `due_below`). Both under one lock: a save held after the later save
/// released the ones before it would otherwise wait for a release that already happened, and
/// its handle would say `pending` forever.
#[derive(Default)]
struct HeldPersists {
    due_below: u64,
    held: Vec<(u64, QueuePersists)>,
}

impl HeldPersists {
    /// Holds the persists of the save at `order`; hands them back to be queued at once when
    /// a later save queued its own already.
    fn hold(&mut self, order: u64, queue: QueuePersists) -> Option<QueuePersists> {
        if order < self.due_below {
            return Some(queue);
        }
        self.held.push((order, queue));
        None
    }

    /// The held persists of the saves before `order`, due now (as are those held later).
    fn release(&mut self, order: u64) -> Vec<QueuePersists> {
        self.due_below = self.due_below.max(order);
        let (due, keep) = std::mem::take(&mut self.held).into_iter().partition(|(o, _)| *o < order);
        self.held = keep;
        due.into_iter().map(|(_, q)| q).collect()
    }

    /// Every held persist, leaving later saves' to the failpoint (a flush found nothing
    /// else to run: no later save is coming to release them).
    fn take_all(&mut self) -> Vec<QueuePersists> {
        std::mem::take(&mut self.held).into_iter().map(|(_, q)| q).collect()
    }
}

/// How many steps' save counts a process remembers: a step saved again after this many other
/// steps counts from 1 again (its generation then names the launch and 1).
const REMEMBERED_STEPS: usize = 4096;

/// A random token naming one launch of a job.
pub fn launch_token() -> String {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        b = (t.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(32)).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Whether a tier's link shares the network with the training job's collectives (its
/// capabilities say; an fs tier on NFS is not told apart).
fn link_kind(spec: &TierSpec) -> LinkKind {
    if spec.capabilities().network {
        LinkKind::Network
    } else {
        LinkKind::Local
    }
}

impl Store {
    pub fn open(policy: Policy, rank: u32, world_size: u32) -> Result<Arc<Store>> {
        Self::open_as(policy, rank, world_size, false)
    }

    /// `tool`: a store for tools that look at tiers as they are (the CLI): it reads every
    /// job's steps and does not check for other jobs' steps at open. Checks what the tiers
    /// hold (`check_open`).
    pub fn open_as(policy: Policy, rank: u32, world_size: u32, tool: bool) -> Result<Arc<Store>> {
        let store = Self::open_unchecked(policy, rank, world_size, tool)?;
        store.check_open()?;
        Ok(store)
    }

    /// `open_as` without `check_open`, which sends requests to every object store: a job
    /// with a coordinator checks on one rank and hands its answer to every rank (Python's
    /// `Store`), so that opening costs the other ranks no request (docs/scale.md, "Store open").
    pub fn open_unchecked(policy: Policy, rank: u32, world_size: u32, tool: bool) -> Result<Arc<Store>> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid(format!("rank {rank} is not in a world of size {world_size}")));
        }
        let Tiers { all, memory, memory_at, peer, buckets } = open_tiers(&policy, rank)?;
        let traffic = Traffic::new(policy.traffic.clone(), SystemClock::shared());
        let slots: Vec<TierSlot> = policy
            .tiers
            .iter()
            .zip(all)
            .map(|(cfg, tier)| TierSlot {
                link: Link::with_traffic(&cfg.name, cfg.bandwidth, link_kind(&cfg.spec), traffic.clone()),
                config: cfg.clone(),
                tier,
            })
            .collect();
        let copy_pool = rayon::ThreadPoolBuilder::new()
            .num_threads(policy.threads)
            .thread_name(|i| format!("tiercel-copy-{i}"))
            .build()
            .map_err(|e| Error::invalid(format!("cannot start copy threads: {e}")))?;
        let scheduler = Scheduler::new(policy.io_threads);
        let job = job_of(&policy, world_size, |v| std::env::var(v).ok());
        for s in &slots {
            s.tier.set_job(&job);
        }
        let cluster = peer.zip(policy.tier_in(Role::Cluster)).map(|(tier, (at, _))| Cluster::new(tier, slots[at].link.clone()));
        if let (Some(c), 1) = (&cluster, world_size) {
            // A job of one process is on one host (a larger job learns its hosts through the
            // coordinator: `Cluster::join`).
            c.join_alone(&job.run.clone().unwrap_or_default())?;
        }
        let metrics = Metrics::new(policy.tiers.iter().map(|t| t.name.clone()));
        for (i, s) in slots.iter().enumerate() {
            if let Some(r) = s.tier.requests() {
                metrics.tier(i).set_requests(r);
            }
            if let Some(sent) = s.tier.sent() {
                metrics.tier(i).set_sent(sent);
            }
        }
        let store = Store {
            policy,
            rank,
            world_size,
            memory,
            memory_at,
            slots,
            scheduler,
            traffic,
            copy_pool,
            cluster,
            recent: Default::default(),
            job,
            foreign: Default::default(),
            own_copies: Default::default(),
            writers: Default::default(),
            tool,
            buckets,
            metrics,
            // One process is the whole job: its own launch. A larger job's ranks agree on one
            // at open (`set_launch`); until then saves carry no generation.
            launch: parking_lot::RwLock::new((world_size == 1).then(launch_token)),
            committed: Default::default(),
            commits: if world_size == 1 { commit::Commits::local() } else { Default::default() },
            matching: Default::default(),
            relay: Default::default(),
            prefaulting: Default::default(),
            save_order: Default::default(),
            held_persists: Default::default(),
        };
        Ok(Arc::new(store))
    }

    pub fn slots(&self) -> &[TierSlot] {
        &self.slots
    }

    pub fn slot(&self, name: &str) -> Result<&TierSlot> {
        self.slots.iter().find(|s| s.config.name == name).ok_or_else(|| {
            let names: Vec<_> = self.slots.iter().map(|s| s.config.name.as_str()).collect();
            Error::invalid(format!("no tier named '{name}' in {} (tiers: {})", self.policy.source, names.join(", ")))
        })
    }

    pub fn memory(&self) -> &Arc<MemoryTier> {
        &self.memory
    }

    /// The memory tier's slot.
    fn memory_slot(&self) -> &TierSlot {
        &self.slots[self.memory_at]
    }

    /// The slots a flushed step goes to next (every one but the memory tier's), with their
    /// indices.
    fn later_slots(&self) -> impl Iterator<Item = (usize, &TierSlot)> {
        self.slots.iter().enumerate().filter(|(i, _)| *i != self.memory_at)
    }

    /// Remembers a save until its memory flush is over (see `await_own_save`).
    fn track(&self, handle: &Arc<SaveHandle>) {
        let mem = self.memory_slot().config.name.clone();
        let mut recent = self.recent.lock();
        recent.retain(|_, h| !h.state(&mem).is_some_and(|s| s.is_final()));
        recent.insert(handle.step, handle.clone());
    }

    /// Read-your-writes: when this process saved `step` and its memory flush still runs,
    /// waits for it. Returns why the step may not be readable from memory (this process's
    /// save of it failed or is still waiting for other ranks), for the caller's error.
    pub fn await_own_save(&self, step: u64) -> Option<String> {
        let h = self.recent.lock().get(&step).cloned()?;
        let mem = &self.memory_slot().config.name;
        let st = h.wait_tier(mem);
        match st {
            TierState::Done => None,
            TierState::Written => {
                Some(format!("this process saved step {step}; on tier '{mem}' it waits for the other ranks of this host to save it too"))
            }
            other => Some(format!("this process's save of step {step} on tier '{mem}': {}", other.describe())),
        }
    }

    /// Read-your-writes for "the newest step": waits until every save this process began
    /// has reached its memory commit or failed (`await_own_save` for each). Returns the steps
    /// this process has written whose host commit waits for other ranks of the host: they
    /// commit when the last of those ranks is done (`Store.latest_step` agrees on them
    /// after every rank has waited here).
    pub fn await_own_saves(&self) -> Vec<u64> {
        let handles: Vec<Arc<SaveHandle>> = self.recent.lock().values().cloned().collect();
        let mem = &self.memory_slot().config.name;
        handles.iter().filter(|h| h.wait_tier(mem) == TierState::Written).map(|h| h.step).collect()
    }

    /// Sets this launch of the job: a token every rank of the job was given at open (rank 0
    /// makes it), so that the ranks' saves of one step carry one generation.
    pub fn set_launch(&self, token: &str) {
        *self.launch.write() = Some(token.to_string());
    }

    /// The generation of a save of `step` that this process begins now: the launch and how
    /// many times this process has committed a save of `step` in it ("<launch>.<n>"). Every rank saves the
    /// same steps in the same order, so every rank's manifest of one save carries the same
    /// generation, and a save of the step again (or one of another launch) another one.
    /// None before the launch is known (a job of several ranks without a coordinator).
    pub(super) fn next_generation(&self, step: u64) -> Option<String> {
        let launch = self.launch.read().clone()?;
        let mut committed = self.committed.lock();
        let n = {
            let n = committed.entry(step).or_insert(0);
            *n += 1;
            *n
        };
        while committed.len() > REMEMBERED_STEPS {
            committed.pop_first();
        }
        Some(format!("{launch}.{n}"))
    }

    /// The handle on the tier that joins the job's cluster (the peer tier), when the policy
    /// has one.
    pub fn cluster(&self) -> Option<&Cluster> {
        self.cluster.as_ref()
    }

    /// What this process has done per tier, in policy order (see `metrics`).
    pub fn metrics(&self) -> Vec<TierMetrics> {
        self.metrics.snapshot()
    }

    /// The framework adapters' timings (see `metrics::TIMINGS`).
    pub fn timings(&self) -> Vec<TimingMetrics> {
        self.metrics.timings()
    }

    /// An adapter measured the timing `name` (one of `metrics::TIMINGS`) once more.
    pub fn timed(&self, name: &str, seconds: f64) -> Result<()> {
        self.metrics.timed(name, seconds)
    }

    /// Why tier `name` cannot take a step now, if it cannot: a peer tier on fewer hosts than
    /// its `replicas` ("not enough hosts (1 < 2)"). Saves skip it with that reason.
    pub fn degraded(&self, name: &str) -> Option<String> {
        self.cluster.as_ref().filter(|c| c.name() == name).and_then(|c| c.degraded())
    }

    /// Committed steps per tier, in policy order.
    pub fn steps(&self) -> Vec<(String, Result<Vec<u64>>)> {
        // Per tier: one that cannot be listed (a server down) gives its error and hides none
        // of the others.
        self.slots.iter().map(|s| (s.config.name.clone(), s.tier.committed_steps())).collect()
    }

    /// Steps this rank could restore from some tier in restore order, newest last. A tier
    /// that cannot be listed right now is skipped (logged): restore falls back past it.
    ///
    /// First waits for this process's own saves to reach the memory tier (`await_own_saves`),
    /// so a step it has just saved is among them; a step whose host commit waits for other
    /// ranks of the host is listed too (it commits once they are done).
    pub fn restorable_steps(&self) -> Vec<u64> {
        let mut all: std::collections::BTreeSet<u64> = self.await_own_saves().into_iter().collect();
        for name in &self.policy.restore_order {
            let Ok(slot) = self.slot(name) else { continue };
            match slot.tier.committed_steps() {
                Ok(v) => {
                    let foreign = self.foreign_steps(slot);
                    all.extend(v.into_iter().filter(|s| !foreign.contains(s)));
                }
                Err(e) => log::warn!("tier '{name}' cannot be listed, skipped: {e}"),
            }
        }
        all.into_iter().collect()
    }

    /// Waits for every background job; then stops the workers and frees this process's
    /// spare shared memory. Committed steps stay. (`wait_background` bounds the wait, and
    /// `close_now` leaves the rest.)
    pub fn close(&self) {
        self.release_held_persists(u64::MAX);
        self.scheduler.shutdown();
        self.finish_close(true);
    }

    /// Closes after `wait_background(.., closing = true, ..)` found nothing left (a peer
    /// tier's replicas coming in were waited for there).
    pub fn close_waited(&self) {
        self.scheduler.shutdown();
        self.finish_close(false);
    }

    /// Closes without waiting for the background work still queued or running: the queued
    /// jobs are dropped (their handles say so), the running ones end on their own threads
    /// or with the process. Logs and returns what was left, per tier. Committed steps stay
    /// committed; a step cut off on a tier is never visible there (its commit record is
    /// written last).
    pub fn close_now(&self) -> Vec<PendingWork> {
        self.release_held_persists(u64::MAX);
        let left = PendingWork::of(&self.scheduler.abandon());
        for slot in &self.slots {
            slot.link.close();
        }
        if !left.is_empty() {
            log::warn!(
                "rank {}: closed with background work unfinished: {}; it was not persisted there (committed steps stay committed)",
                self.rank,
                PendingWork::describe(&left)
            );
        }
        self.finish_close(false);
        left
    }

    /// `drain`: a peer tier first waits for the replicas still coming to it (bounded).
    fn finish_close(&self, drain: bool) {
        if let Some(c) = &self.cluster {
            c.close(drain);
        }
        self.memory.release_pool();
        self.release_writer();
        if let Some(r) = self.relay.lock().take() {
            r.stop();
        }
        self.log_skip_summary();
    }

    /// Blocks until the background queue is empty.
    pub fn flush(&self) {
        self.scheduler.wait_idle();
        while self.queue_held_when_idle() {
            self.scheduler.wait_idle();
        }
    }

    /// Queues the persists the `persist_late` failpoint still holds once the scheduler is
    /// idle (not before: a flush still running may be the later save that is to come
    /// first); whether there were any.
    fn queue_held_when_idle(&self) -> bool {
        let held = self.held_persists.lock().take_all();
        let any = !held.is_empty();
        for queue in held {
            queue();
        }
        any
    }

    /// Queues the persists the `persist_late` failpoint held back for saves before `order`.
    fn release_held_persists(&self, order: u64) {
        let due = self.held_persists.lock().release(order);
        for queue in due {
            queue();
        }
    }

    pub fn scheduler(&self) -> &Arc<Scheduler> {
        &self.scheduler
    }

    /// The training job's communication signals (`busy`, `idle`, `iteration`).
    pub fn traffic(&self) -> &Arc<Traffic> {
        &self.traffic
    }

    /// The learned schedule of `slot`'s link for a checkpoint of `bytes` (mode `learned`,
    /// once the warmup iterations were profiled and the link has sent chunks to measure).
    pub fn traffic_plan(&self, slot: &TierSlot, bytes: u64) -> Option<Plan> {
        if self.traffic.config.mode != crate::policy::TrafficMode::Learned || slot.link.kind != LinkKind::Network {
            return None;
        }
        let profile = self.traffic.profile()?;
        let model = slot.link.model()?;
        let whole = slot.link.whole_seconds(bytes);
        Some(plan::plan(&profile, model, self.traffic.config.mu, self.policy.chunk_size, bytes, slot.config.every, whole))
    }

    /// Retention on one tier, as after every save: `keep`, uncommitted leftovers, abandoned
    /// uploads (see `gc`). Returns the removed steps.
    pub fn retain(&self, slot: &TierSlot) -> Result<Vec<u64>> {
        // One listing serves the foreign steps and the plan (a tier with commit records).
        let opts = if slot.config.capabilities().commit_records {
            let listed = slot.tier.list_steps()?;
            GcOptions {
                keep: slot.config.keep,
                foreign: self.foreign_among(slot, &listed.committed),
                listed: Some(listed),
                ..Default::default()
            }
        } else {
            GcOptions { keep: slot.config.keep, ..Default::default() }
        };
        let pinned = if std::ptr::eq(slot, self.memory_slot()) { self.own_copies.lock().pinned() } else { vec![] };
        let done = self.run_retention(slot, &GcOptions { pinned, ..opts })?;
        for r in done.iter().filter(|r| r.step().is_none()) {
            log::info!("tier '{}': removed {}", slot.config.name, r.reason);
        }
        Ok(gc::steps_of(&done))
    }

    /// What `gc` would remove from tier `name` now: retention, and temporary files of dead
    /// writers at least `temp_age` old.
    pub fn gc_plan(&self, name: &str, temp_age: Duration) -> Result<Vec<Removal>> {
        let slot = self.slot(name)?;
        slot.tier.gc_plan(&GcOptions { keep: slot.config.keep, temp_age: Some(temp_age), ..Default::default() })
    }

    /// Aborts the abandoned uploads of tier `name` (object stores) and nothing else; one line
    /// per upload, as `tiercel gc` prints them.
    pub fn sweep_uploads(&self, name: &str) -> Result<Vec<String>> {
        let slot = self.slot(name)?;
        let plan: Vec<Removal> =
            slot.tier.gc_plan(&GcOptions::default())?.into_iter().filter(|r| matches!(r.target, Target::Upload { .. })).collect();
        let done = slot.tier.gc_apply(plan)?;
        Ok(done
            .iter()
            .map(|r| match &r.target {
                Target::Upload { upload_id, .. } if upload_id.is_empty() => format!("removed the {}", r.reason),
                _ => format!("aborted the {}", r.reason),
            })
            .collect())
    }

    /// Removes what `gc_plan` lists; returns what was removed.
    pub fn gc(&self, name: &str, temp_age: Duration) -> Result<Vec<Removal>> {
        let slot = self.slot(name)?;
        run_gc(&*slot.tier, &GcOptions { keep: slot.config.keep, temp_age: Some(temp_age), ..Default::default() })
    }
}

#[cfg(test)]
mod held_tests {
    use super::HeldPersists;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    fn counting(n: &Arc<AtomicUsize>) -> super::QueuePersists {
        let n = n.clone();
        Box::new(move || {
            n.fetch_add(1, Ordering::SeqCst);
        })
    }

    #[test]
    fn a_save_held_after_the_later_save_released_is_queued_at_once() {
        // The race of `persist_late`: save 8's flush finishes and releases the saves before
        // it before save 7's flush reaches its hold. Save 7 must not wait for a release that
        // already happened (its handle said `pending` forever).
        let queued = Arc::new(AtomicUsize::new(0));
        let mut held = HeldPersists::default();
        assert!(held.release(8).is_empty());
        let now = held.hold(7, counting(&queued)).expect("save 7 is due: save 8 queued first");
        now();
        assert_eq!(queued.load(Ordering::SeqCst), 1);
        assert!(held.held.is_empty());
    }

    #[test]
    fn a_save_held_first_waits_for_the_later_save() {
        let queued = Arc::new(AtomicUsize::new(0));
        let mut held = HeldPersists::default();
        assert!(held.hold(7, counting(&queued)).is_none());
        assert!(held.release(7).is_empty(), "save 7's own release does not free it");
        let due = held.release(8);
        assert_eq!(due.len(), 1);
        due.into_iter().for_each(|q| q());
        assert_eq!(queued.load(Ordering::SeqCst), 1);
    }
}
