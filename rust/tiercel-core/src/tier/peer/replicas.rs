//! The holder's side of the peer tier: the replicas this host keeps for ranks on other hosts,
//! in a memory tier of their own under `<memory root>/peers`, served through the transport's
//! server. A replica is written straight into its segments as it arrives and exists once its
//! manifest is published (after every chunk matched its checksum).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::format::{self, Manifest};
use crate::tier::gc;
use crate::tier::memory::{MemoryTier, Segment, View};
use crate::tier::Tier;
use crate::transport::server::Handler;

/// Where a host's replica store lives under its memory tier's root.
pub const REPLICA_DIR: &str = "peers";

pub(super) struct ReplicaStore {
    tier: String,
    replicas: Arc<MemoryTier>,
    /// Replica steps kept (the peer tier's `keep`).
    keep: usize,
    /// Steps with a replica on its way in (by count): retention leaves them alone.
    receiving: Mutex<HashMap<u64, usize>>,
}

impl ReplicaStore {
    pub(super) fn new(tier: &str, replicas: Arc<MemoryTier>, keep: usize) -> ReplicaStore {
        ReplicaStore { tier: tier.into(), replicas, keep, receiving: Mutex::new(HashMap::new()) }
    }

    /// The retention rule of every tier (`tier::gc`), on replica steps: a step counts as
    /// committed here once some rank's replica of it is complete (its manifest is there);
    /// steps still being received are never removed.
    fn retain(&self) -> Result<Vec<u64>> {
        let all = self.replicas.all_steps()?;
        let mut complete = vec![];
        for &s in &all {
            if !self.replicas.ranks_written(s)?.is_empty() {
                complete.push(s);
            }
        }
        let receiving = self.receiving.lock().clone();
        let plan: Vec<u64> =
            gc::steps_of(&gc::step_removals(&complete, &all, Some(self.keep))).into_iter().filter(|s| !receiving.contains_key(s)).collect();
        for &s in &plan {
            self.replicas.evict(s)?;
        }
        Ok(plan)
    }

    fn done_receiving(&self, step: u64) {
        let mut r = self.receiving.lock();
        if let Some(n) = r.get_mut(&step) {
            *n -= 1;
            if *n == 0 {
                r.remove(&step);
            }
        }
    }

    /// Removes what arrived of an incomplete replica.
    fn discard(&self, m: &Manifest) {
        for i in 0..m.objects.len() {
            let _ = self.replicas.remove_object(m.step, &format::part_name(m.rank, i));
        }
    }
}

impl Handler for ReplicaStore {
    fn tier(&self) -> &str {
        &self.tier
    }

    fn begin_put(&self, m: &mut Manifest) -> Result<Vec<Arc<Segment>>> {
        m.tier = self.tier.clone();
        if let Some(o) = m.objects.iter().enumerate().find(|(i, o)| o.name != format::part_name(m.rank, *i)) {
            return Err(Error::invalid(format!("unexpected object name '{}'", o.1.name)));
        }
        *self.receiving.lock().entry(m.step).or_default() += 1;
        let mut segs = vec![];
        for (i, o) in m.objects.iter().enumerate() {
            match self.replicas.allocate(m.step, m.rank, i, o.len) {
                Ok(seg) => segs.push(seg),
                Err(e) => {
                    drop(segs);
                    self.discard(m);
                    self.done_receiving(m.step);
                    return Err(e);
                }
            }
        }
        Ok(segs)
    }

    fn end_put(&self, m: &Manifest, received: Result<()>) -> Result<()> {
        let res = received.and_then(|()| self.replicas.publish(m));
        self.done_receiving(m.step);
        match res {
            Ok(()) => {
                if let Err(e) = self.retain() {
                    log::warn!("tier '{}': retention of replicas after step {}: {e}", self.tier, m.step);
                }
                Ok(())
            }
            Err(e) => {
                self.discard(m);
                Err(e)
            }
        }
    }

    fn after_put(&self, sizes: Vec<u64>) {
        if let Err(e) = self.replicas.prefault(&sizes) {
            log::warn!("tier '{}': pre-faulting replica segments: {e}", self.tier);
        }
    }

    fn list(&self, rank: u32) -> Result<Vec<u64>> {
        let mut out = vec![];
        for step in self.replicas.all_steps()? {
            if self.replicas.ranks_written(step)?.contains(&rank) {
                out.push(step);
            }
        }
        Ok(out)
    }

    fn manifest(&self, step: u64, rank: u32) -> Result<Manifest> {
        self.replicas.read_manifest(step, rank)
    }

    fn view(&self, step: u64, rank: u32, object: &str) -> Result<Arc<View>> {
        let prefix = format!("rank-{rank:05}.");
        if !object.starts_with(&prefix) || object.contains('/') {
            return Err(Error::invalid(format!("object '{object}' is not rank {rank}'s")));
        }
        self.replicas.map_view(step, object)
    }
}
