//! The holder's side of the peer tier: the replicas this host keeps for ranks on other hosts,
//! in a memory tier of their own under `<memory root>/peers`, served through the transport's
//! server. A replica is written straight into its segments as it arrives and exists once its
//! manifest is published (after every chunk matched its checksum).

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::{self, Manifest};
use crate::tier::memory::{MemoryTier, Segment, View};
use crate::tier::Tier;
use crate::transport::server::Handler;

/// Where a host's replica store lives under its memory tier's root.
pub const REPLICA_DIR: &str = "peers";

pub(super) struct ReplicaStore {
    pub(super) tier: String,
    pub(super) replicas: Arc<MemoryTier>,
    /// Replica steps kept (the peer tier's `keep`).
    pub(super) keep: usize,
}

impl ReplicaStore {
    /// Keeps the newest `keep` replica steps.
    fn retain(&self) {
        let Ok(steps) = self.replicas.all_steps() else { return };
        for s in steps.iter().rev().skip(self.keep) {
            if let Err(e) = self.replicas.evict(*s) {
                log::warn!("tier '{}': dropping replica step {s}: {e}", self.tier);
            }
        }
    }

    fn discard(&self, m: &Manifest) {
        for i in 0..m.objects.len() {
            let _ = self.replicas.blobs().delete(&format!("{}/{}", format::step_dir(m.step), format::part_name(m.rank, i)));
        }
    }
}

impl Handler for ReplicaStore {
    fn tier(&self) -> &str {
        &self.tier
    }

    fn begin_put(&self, m: &mut Manifest) -> Result<Vec<Arc<Segment>>> {
        m.tier = self.tier.clone();
        let mut segs = vec![];
        for (i, o) in m.objects.iter().enumerate() {
            if o.name != format::part_name(m.rank, i) {
                return Err(Error::invalid(format!("unexpected object name '{}'", o.name)));
            }
            segs.push(self.replicas.allocate(m.step, m.rank, i, o.len)?);
        }
        Ok(segs)
    }

    fn end_put(&self, m: &Manifest, received: Result<()>) -> Result<()> {
        match received.and_then(|()| self.replicas.publish(m)) {
            Ok(()) => {
                self.retain();
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
            if self.replicas.blobs().exists(&format!("{}/{}", format::step_dir(step), format::manifest_name(rank)))? {
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
        self.replicas.view(step, object)
    }
}
