//! The Store: one per training process (rank). It copies a step into the memory tier (the
//! only blocking part of a save), then commits, persists and evicts in the background through
//! the scheduler; it reads a step back chunk by chunk from the first tier that has a valid copy.
//!
//! `save` holds the writer (the blocking copy) and the background flush, `handle` what a
//! save has done where, `restore` the reader, `copy` the copy of a step between tiers.

mod copy;
mod handle;
mod restore;
mod save;

use std::sync::Arc;
use std::time::Duration;

use crate::blobs::FsBlobs;
use crate::error::{Error, Result};
use crate::policy::{PeerConfig, Policy, TierConfig, TierKind, TierSpec};
use crate::scheduler::{Link, Scheduler};
use crate::tier::blob::BlobTier;
use crate::tier::memory::MemoryTier;
use crate::tier::peer::{PeerOptions, PeerTier};
use crate::tier::Tier;

pub use copy::copy_step;
pub use handle::{SaveHandle, TierState};
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
    memory: Arc<MemoryTier>,
    slots: Vec<TierSlot>,
    scheduler: Arc<Scheduler>,
    copy_pool: rayon::ThreadPool,
    peer: Option<Arc<PeerTier>>,
}

/// Opens the tier a policy entry describes.
pub fn open_tier(cfg: &TierConfig) -> Result<Arc<dyn Tier>> {
    let at = |e: Error| e.context(format!("opening tier '{}' ({})", cfg.name, cfg.location()));
    Ok(match &cfg.spec {
        TierSpec::Memory { root } => MemoryTier::open(&cfg.name, root.as_ref(), cfg.capacity).map_err(at)?,
        TierSpec::Fs { path } => {
            let blobs = FsBlobs::new(&cfg.name, path.as_ref()).map_err(at)?;
            Arc::new(BlobTier::new(&cfg.name, "fs", Arc::new(blobs), cfg.compression))
        }
        spec @ (TierSpec::S3(_) | TierSpec::Gcs(_)) => {
            let blobs = crate::object::ObjectBlobs::open(&cfg.name, spec).map_err(at)?;
            Arc::new(BlobTier::new(&cfg.name, cfg.kind().as_str(), Arc::new(blobs), cfg.compression))
        }
        TierSpec::Peer(_) => {
            return Err(Error::invalid(format!("tier '{}': a peer tier is opened by its Store (it needs the rank)", cfg.name)))
        }
    })
}

/// Opens a peer tier for `rank`: its replica store lives under the memory tier's root.
fn open_peer(cfg: &TierConfig, p: &PeerConfig, rank: u32, memory: &MemoryTier) -> Result<Arc<PeerTier>> {
    let secret = p.secret.clone().or_else(|| std::env::var("TIERCEL_PEER_SECRET").ok()).map(String::into_bytes);
    let opts = PeerOptions {
        listen: p.listen.clone(),
        replicas: p.replicas,
        strategy: crate::placement::Strategy::parse(&p.placement)?,
        keep: cfg.keep.unwrap_or(2),
        secret,
        timeout: Duration::from_secs(30),
    };
    PeerTier::open(&cfg.name, rank, memory.root(), opts).map_err(|e| e.context(format!("opening tier '{}'", cfg.name)))
}

impl Store {
    pub fn open(policy: Policy, rank: u32, world_size: u32) -> Result<Arc<Store>> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::invalid(format!("rank {rank} is not in a world of size {world_size}")));
        }
        let mem_cfg = policy.memory_tier().clone();
        let memory = MemoryTier::open(&mem_cfg.name, mem_cfg.location().as_ref(), mem_cfg.capacity)
            .map_err(|e| e.context(format!("opening tier '{}' ({})", mem_cfg.name, mem_cfg.location())))?;
        let mut slots = vec![];
        let mut peer = None;
        for cfg in &policy.tiers {
            let tier: Arc<dyn Tier> = match &cfg.spec {
                TierSpec::Memory { .. } => memory.clone(),
                TierSpec::Peer(p) => {
                    let p = open_peer(cfg, p, rank, &memory)?;
                    peer = Some(p.clone());
                    p
                }
                _ => open_tier(cfg)?,
            };
            slots.push(TierSlot { link: Link::new(&cfg.name, cfg.bandwidth), config: cfg.clone(), tier });
        }
        let copy_pool = rayon::ThreadPoolBuilder::new()
            .num_threads(policy.threads)
            .thread_name(|i| format!("tiercel-copy-{i}"))
            .build()
            .map_err(|e| Error::invalid(format!("cannot start copy threads: {e}")))?;
        let scheduler = Scheduler::new(policy.io_threads);
        Ok(Arc::new(Store { policy, rank, world_size, memory, slots, scheduler, copy_pool, peer }))
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

    /// The peer tier, when the policy has one.
    pub fn peer(&self) -> Option<&Arc<PeerTier>> {
        self.peer.as_ref()
    }

    /// Committed steps per tier, in policy order.
    pub fn steps(&self) -> Result<Vec<(String, Vec<u64>)>> {
        self.slots.iter().map(|s| Ok((s.config.name.clone(), s.tier.committed_steps()?))).collect()
    }

    /// Steps this rank could restore from some tier in restore order, newest last. A tier
    /// that cannot be listed right now is skipped (logged): restore falls back past it.
    pub fn restorable_steps(&self) -> Vec<u64> {
        let mut all = std::collections::BTreeSet::new();
        for name in &self.policy.restore_order {
            let Ok(slot) = self.slot(name) else { continue };
            match slot.tier.committed_steps() {
                Ok(v) => all.extend(v),
                Err(e) => log::warn!("tier '{name}' cannot be listed, skipped: {e}"),
            }
        }
        all.into_iter().collect()
    }

    fn memory_name(&self) -> String {
        self.policy.memory_tier().name.clone()
    }

    /// Waits for every background job; then stops the workers and frees this process's
    /// spare shared memory. Committed steps stay.
    pub fn close(&self) {
        self.scheduler.shutdown();
        if let Some(p) = &self.peer {
            p.shutdown();
        }
        self.memory.release_pool();
    }

    /// Blocks until the background queue is empty.
    pub fn flush(&self) {
        self.scheduler.wait_idle();
    }

    pub fn scheduler(&self) -> &Arc<Scheduler> {
        &self.scheduler
    }

    /// Applies `keep` on a tier and removes uncommitted leftovers older than its newest
    /// committed step. Returns the removed steps.
    pub fn retain(&self, slot: &TierSlot) -> Result<Vec<u64>> {
        match slot.config.kind() {
            TierKind::Memory => return self.memory.retain(slot.config.keep.unwrap_or(usize::MAX)),
            // Holders apply `keep` to the copies they hold, as they receive new ones.
            TierKind::Peer => return Ok(vec![]),
            _ => {}
        }
        // Uploads that killed writers left (object stores) go first: a step deleted below may
        // be the one such an upload was writing.
        match slot.tier.blobs().sweep() {
            Ok(done) => done.iter().for_each(|d| log::info!("tier '{}': {d}", slot.config.name)),
            Err(e) => log::warn!("tier '{}': cleaning up abandoned uploads failed: {e}", slot.config.name),
        }
        let committed = slot.tier.committed_steps()?;
        let victims = crate::tier::retention_victims(&committed, &slot.tier.all_steps()?, slot.config.keep);
        for s in &victims {
            slot.tier.delete_step(*s)?;
        }
        Ok(victims)
    }
}
