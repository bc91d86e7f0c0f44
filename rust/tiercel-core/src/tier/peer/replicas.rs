//! The holder's side of the peer tier: the replicas this host keeps for ranks on other hosts,
//! in a memory tier of their own under `<memory root>/peers`, served through the transport's
//! server. A replica is written straight into its segments as it arrives and exists once its
//! manifest is published (after every chunk matched its checksum).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use super::Cluster;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{self, Manifest};
use crate::gc;
use crate::shm::{Segment, View};
use crate::tier::memory::MemoryTier;
use crate::tier::Tier;
use crate::transport::server::Handler;
use crate::transport::Ident;

/// Where a host's replica store lives under its memory tier's root.
pub const REPLICA_DIR: &str = "peers";

pub(super) struct ReplicaStore {
    tier: String,
    /// The rank of the process serving this store.
    rank: u32,
    replicas: Arc<MemoryTier>,
    /// The job's membership (shared with the peer tier; None until it is connected).
    cluster: Arc<RwLock<Option<Cluster>>>,
    /// Replica steps kept (the peer tier's `keep`).
    keep: usize,
    /// Steps with a replica on its way in (by count): retention leaves them alone.
    receiving: Mutex<HashMap<u64, usize>>,
    /// Steps whose chunks a replica on its way in is being filled from (`reuse`, by count):
    /// retention leaves them alone too.
    pinned: Mutex<HashMap<u64, usize>>,
    /// The host's own memory tier, served too (`serve_own`): after a host is lost, a rank's
    /// own copy may be the only one left of it, and a job restarted on fewer hosts reads it
    /// from here (an elastic restore, docs/restore.md).
    own: RwLock<Option<Arc<MemoryTier>>>,
}

impl ReplicaStore {
    pub(super) fn new(
        tier: &str,
        rank: u32,
        replicas: Arc<MemoryTier>,
        keep: usize,
        cluster: Arc<RwLock<Option<Cluster>>>,
    ) -> ReplicaStore {
        ReplicaStore {
            tier: tier.into(),
            rank,
            replicas,
            cluster,
            keep,
            receiving: Mutex::new(HashMap::new()),
            pinned: Mutex::new(HashMap::new()),
            own: RwLock::new(None),
        }
    }

    pub(super) fn serve_own(&self, memory: Arc<MemoryTier>) {
        *self.own.write() = Some(memory);
    }

    /// How many ranks saved `step`, as this host's memory tier's commit record of it says.
    pub(super) fn own_world_size(&self, step: u64) -> Option<u32> {
        let own = self.own.read().clone()?;
        own.commit_record(step).ok().map(|r| r.world_size)
    }

    /// `rank`'s own copy of `step` in this host's memory tier: served only where that tier
    /// committed the step with the rank in it and the manifest is of the committed save (a
    /// part being saved again is never handed out).
    fn own_manifest(&self, step: u64, rank: u32) -> Result<(Arc<MemoryTier>, Manifest)> {
        let not_here = || Error::not_found(format!("tier '{}': no copy of step {step} rank {rank} on this host", self.tier));
        let own = self.own.read().clone().ok_or_else(not_here)?;
        let record = own.commit_record(step)?;
        if record.ranks.as_ref().is_some_and(|rs| !rs.contains(&rank)) {
            return Err(not_here());
        }
        let m = own.read_manifest(step, rank)?;
        if m.generation != record.generation {
            return Err(not_here());
        }
        Ok((own, m))
    }

    /// Runs `f` on the membership, or says it is not known yet.
    fn with_cluster<T>(&self, f: impl FnOnce(&Cluster) -> Result<T>) -> Result<T> {
        let c = self.cluster.read();
        f(c.as_ref().ok_or_else(|| Error::unavailable(format!("tier '{}': this peer does not know its job's members yet", self.tier)))?)
    }

    /// The retention rule of every tier (`gc`), on replica steps: a step counts as
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
        let pinned = self.pinned.lock().clone();
        let plan: Vec<u64> = gc::steps_of(&gc::step_removals(&complete, &all, Some(self.keep)))
            .into_iter()
            .filter(|s| !receiving.contains_key(s) && !pinned.contains_key(s))
            .collect();
        for &s in &plan {
            // Manifests first: a replica is listed and served while its manifest exists, so
            // a process killed in the middle of an eviction leaves a step that is no longer
            // listed, never one that is listed with its data gone (found by the chaos suite).
            for r in self.replicas.ranks_written(s)? {
                self.replicas.remove_object(s, &format::manifest_name(r))?;
            }
            self.replicas.evict(s)?;
        }
        Ok(plan)
    }

    /// Replicas on their way in now.
    pub(super) fn receiving(&self) -> usize {
        self.receiving.lock().values().sum()
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

    /// The steps of `rank` with a complete replica here, other than `step`, newest first,
    /// pinned against retention until `unpin`. (A retention that listed the steps before
    /// they were pinned may still remove one: `reuse::fill` then finds it gone.)
    pub(super) fn pin_bases(&self, step: u64, rank: u32) -> Vec<u64> {
        let mut pinned = self.pinned.lock();
        let mut bases: Vec<u64> = self
            .replicas
            .all_steps()
            .unwrap_or_default()
            .into_iter()
            .filter(|&s| s != step && self.replicas.ranks_written(s).is_ok_and(|rs| rs.contains(&rank)))
            .collect();
        bases.sort_unstable_by(|a, b| b.cmp(a));
        for &s in &bases {
            *pinned.entry(s).or_default() += 1;
        }
        bases
    }

    pub(super) fn unpin(&self, bases: &[u64]) {
        let mut pinned = self.pinned.lock();
        for s in bases {
            if let Some(n) = pinned.get_mut(s) {
                *n -= 1;
                if *n == 0 {
                    pinned.remove(s);
                }
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

    fn identity(&self) -> Option<Ident> {
        self.cluster.read().as_ref().map(|c| c.ident(self.rank))
    }

    fn admit(&self, client: &Ident, to_host: &str) -> Result<()> {
        self.with_cluster(|c| {
            let me = c.ident(self.rank);
            if client.job != me.job {
                return Err(Error::invalid(format!("this peer serves job {}, not job {}", me.job, client.job)));
            }
            // A rank may read what its own host holds for others (to_host is this host), but
            // an address meant for another host that reaches this one is a misrouted push.
            if client.host == me.host && to_host != me.host {
                return Err(Error::invalid(format!(
                    "a connection from this host ({}) itself: a replica here would not survive the host",
                    me.host
                )));
            }
            if to_host != me.host {
                return Err(Error::invalid(format!("this is host {}, not host {to_host}", me.host)));
            }
            // This host knows its own ranks and its placement neighbours': the ranks that push
            // here and the ranks of this host; the others have nothing to ask of it.
            match c.host_of.get(&client.rank) {
                Some(&h) if c.names[&h] == client.host => Ok(()),
                Some(&h) => {
                    Err(Error::invalid(format!("rank {} is on host {} in this job, not {}", client.rank, c.names[&h], client.host)))
                }
                None => Err(Error::invalid(format!(
                    "rank {} (host {}) is on no host that this one holds replicas for or sends to",
                    client.rank, client.host
                ))),
            }
        })
    }

    fn may_receive(&self, client: &Ident, rank: u32) -> Result<()> {
        if rank != client.rank {
            return Err(Error::invalid(format!("rank {} may push only its own replicas, not rank {rank}'s", client.rank)));
        }
        self.with_cluster(|c| {
            if client.host == c.ident(self.rank).host {
                return Err(Error::invalid(format!(
                    "a connection from this host ({}) itself: a replica here would not survive the host",
                    client.host
                )));
            }
            let mine = c.host_of[&self.rank];
            // `admit` let the client in, so its rank is known here.
            let theirs = *c.host_of.get(&rank).ok_or_else(|| Error::invalid(format!("rank {rank} is not known to this host")))?;
            if !c.placement.peers(theirs).contains(&mine) {
                return Err(Error::invalid(format!(
                    "placement does not assign rank {rank}'s replicas (host {}) to host {}",
                    c.names[&theirs], c.names[&mine]
                )));
            }
            Ok(())
        })
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

    /// From this host's replicas of earlier steps of the same rank (`reuse::fill`).
    fn reuse(&self, m: &Manifest, segs: &[Arc<Segment>]) -> Vec<bool> {
        let bases = self.pin_bases(m.step, m.rank);
        let filled = super::reuse::fill(&self.tier, &self.replicas, m, segs, &bases);
        self.unpin(&bases);
        filled
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

    /// The steps of `rank` this host holds: its replicas, and its own copies (`serve_own`).
    fn list(&self, rank: u32) -> Result<Vec<u64>> {
        let mut out = std::collections::BTreeSet::new();
        for step in self.replicas.all_steps()? {
            if self.replicas.ranks_written(step)?.contains(&rank) {
                out.insert(step);
            }
        }
        let own = self.own.read().clone();
        for step in own.map(|t| t.committed_steps()).transpose()?.unwrap_or_default() {
            if self.own_manifest(step, rank).is_ok() {
                out.insert(step);
            }
        }
        Ok(out.into_iter().collect())
    }

    /// A replica first; else the rank's own copy in this host's memory tier.
    fn manifest(&self, step: u64, rank: u32) -> Result<Manifest> {
        match self.replicas.read_manifest(step, rank) {
            Err(e) if e.kind == ErrorKind::NotFound => self.own_manifest(step, rank).map(|(_, m)| m).map_err(|_| e),
            r => r,
        }
    }

    fn view(&self, step: u64, rank: u32, object: &str) -> Result<Arc<View>> {
        let prefix = format!("rank-{rank:05}.");
        if !object.starts_with(&prefix) || object.contains('/') {
            return Err(Error::invalid(format!("object '{object}' is not rank {rank}'s")));
        }
        // From where `manifest` answers: the replica while its manifest is there.
        if self.replicas.read_manifest(step, rank).is_err() {
            if let Ok((own, _)) = self.own_manifest(step, rank) {
                return own.map_view(step, object);
            }
        }
        self.replicas.map_view(step, object)
    }
}
