//! The peer tier's reads of a saved rank's copy: from this host's replica store (its files,
//! no connection), else from the hosts `Cluster::sources` names, one answer per host. A job
//! restarted on fewer hosts finds the copies of the job before it this way (an elastic
//! restore: each surviving host serves the replicas it holds and its own ranks' copies).

use super::*;

/// Where the manifests cache says a copy came from this host's own replica store.
pub(super) const LOCAL: &str = "this host";

impl PeerTier {
    /// One chunk of this host's replica, checked against its checksum here (a peer's data
    /// frames are checked by `Conn::read`; `verifies_reads` speaks for both).
    pub(super) fn read_local(&self, m: &Manifest, c: &ChunkMeta, dst: &mut [u8]) -> Result<()> {
        if c.codec != crate::codec::RAW {
            return self.replicas.read_stored(m, c, dst); // decoded and verified by the reader
        }
        let mut digest = crate::checksum::Crc32c::new();
        self.replicas.read_stored_blocks(m, c, dst, &mut |b| digest.update(b))?;
        let got = digest.finish();
        if got != c.crc32c {
            return Err(Error::integrity(format!(
                "tier '{}': step {} rank {}: this host's replica of a chunk has checksum {got:08x}, the manifest says {:08x}",
                self.name, m.step, m.rank, c.crc32c
            ))
            .with_tier(&self.name)
            .at(m.step, m.rank));
        }
        Ok(())
    }

    /// The hosts a read of saved rank `rank`'s copy asks, in order (`Cluster::sources`).
    /// `saved_world`: how many ranks saved the step, where known. Only a step saved by
    /// another number of ranks than this job has (or a rank this job does not have) is looked
    /// for beyond the placement's holders: for a step of this job's shape they are where its
    /// copies are, and asking every host instead (a step whose replication was skipped) would
    /// cost each rank a request per host, the job a number that grows as the square of it.
    pub(super) fn sources(&self, rank: u32, saved_world: Option<u32>) -> Result<Vec<HolderHost>> {
        let sources = self.with_cluster(|c| {
            let n = c.world_size;
            let elastic = rank >= n || saved_world.is_some_and(|w| w != n);
            c.sources(rank, self.rank, elastic)
        })?;
        Ok(sources.unwrap_or_default())
    }

    /// How many ranks saved `step`, as this host knows without asking anyone: its memory
    /// tier's commit record of it, else a replica of it that this host holds.
    fn saved_world(&self, step: u64) -> Option<u32> {
        self.holding.own_world_size(step).or_else(|| {
            let held = self.replicas.ranks_written(step).ok()?;
            held.into_iter().find_map(|r| self.local_manifest(step, r)).map(|m| m.world_size)
        })
    }

    /// This host's replica of `rank`'s `step`, read straight from the replica store (no
    /// connection): a host holds replicas for ranks of other hosts, which a job restarted
    /// on fewer hosts may have placed on this one.
    pub(super) fn local_manifest(&self, step: u64, rank: u32) -> Option<Manifest> {
        self.replicas.read_manifest(step, rank).ok()
    }

    /// The manifest of `rank`'s `step` from the first holder that has it.
    pub(super) fn fetch_manifest(&self, step: u64, rank: u32) -> Result<(Manifest, String)> {
        if let Some(hit) = self.manifests.lock().get(&(step, rank)) {
            return Ok(hit.clone());
        }
        if let Some(m) = self.local_manifest(step, rank) {
            self.manifests.lock().insert((step, rank), (m.clone(), LOCAL.to_string()));
            return Ok((m, LOCAL.to_string()));
        }
        let sources = self.sources(rank, self.saved_world(step))?;
        if let Some(why) = self.degraded.read().clone() {
            return Err(Error::not_found(format!(
                "tier '{}': no peer copies ({why}): read rank {rank}'s part from another tier",
                self.name
            ))
            .with_tier(&self.name)
            .at(step, rank));
        }
        if sources.is_empty() {
            // A process learns the members of its own host and its placement neighbours only
            // (O(m) hosts), not where every rank's copies are.
            return Err(Error::not_found(format!(
                "tier '{}': no host this process knows holds step {step} of rank {rank} (it knows its own host and its \
                 placement neighbours, which hold rank {rank}'s replicas only if rank {rank} is on one of them); read rank \
                 {rank}'s part from another tier",
                self.name
            ))
            .with_tier(&self.name)
            .at(step, rank));
        }
        let mut errs = vec![];
        let mut kinds = vec![];
        for host in sources {
            // One answer per host (its processes serve the same root): the next address
            // only when one cannot answer.
            for addr in host.addrs {
                match self.with_conn(&addr, &host.name, |c| c.manifest(step, rank)) {
                    Ok(Some(m)) if m.step == step && m.rank == rank => {
                        self.manifests.lock().insert((step, rank), (m.clone(), addr.clone()));
                        return Ok((m, addr));
                    }
                    Ok(_) => {
                        kinds.push(ErrorKind::Integrity);
                        errs.push(format!("{addr}: wrong manifest"));
                        break;
                    }
                    Err(e) => {
                        let answered = e.kind != ErrorKind::TierUnavailable;
                        kinds.push(e.kind);
                        errs.push(e.message);
                        if answered {
                            break;
                        }
                    }
                }
            }
        }
        let msg = format!("tier '{}': no peer holds step {step} of rank {rank} ({})", self.name, errs.join("; "));
        Err(Error::new(combined_kind(&kinds), msg).with_tier(&self.name).at(step, rank))
    }
}
