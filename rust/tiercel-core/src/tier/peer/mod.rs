//! The peer tier: copies of this rank's memory-tier data in the RAM of m-1 other hosts
//! (GEMINI), so a lost host's checkpoints survive in its peers' memory.
//!
//! Every process serves its host's replica store (`<memory root>/peers`, the memory-tier
//! layout) over the transport. A save pushes each chunk straight from the shared-memory
//! segment to one process on every peer host, which writes it straight into its own segment
//! and acknowledges once every chunk has arrived with a valid checksum; the step is then on
//! the peer tier for this rank. A restore pulls chunks from the first holder that answers,
//! falling back holder by holder, then (in the store) tier by tier.
//!
//! `replicas` is the holder's side (what this process stores for others and serves through
//! the transport's server); this file is the saving and restoring rank's side.

mod replicas;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use tokio::net::TcpListener;

use crate::error::{Error, ErrorKind, Result};
use crate::format::{ChunkMeta, CommitRecord, Manifest};
use crate::placement::{Placement, Strategy};
use crate::scheduler::{Link, Priority};
use crate::tier::gc::{GcOptions, Removal};
use crate::tier::memory::MemoryTier;
use crate::tier::{ChunkSource, Tier};
use crate::transport::{server, Conn};
use replicas::ReplicaStore;

pub use replicas::REPLICA_DIR;

/// Who is where: filled in once every rank has published its address via the coordinator.
pub struct Cluster {
    /// Host index of each rank (failure domain = host).
    pub host_of: Vec<usize>,
    /// Address ("ip:port") of each rank's peer server.
    pub addrs: Vec<String>,
    pub placement: Placement,
}

impl Cluster {
    /// Addresses that may hold `rank`'s replicas, grouped by peer host: on each peer host the
    /// process with the same local index first (it received them), then its neighbours,
    /// which serve the same shared-memory root if that one is gone.
    fn holders(&self, rank: u32) -> Vec<Vec<String>> {
        let host = self.host_of[rank as usize];
        let local: Vec<usize> = (0..self.host_of.len()).filter(|r| self.host_of[*r] == host).collect();
        let my_index = local.iter().position(|r| *r == rank as usize).unwrap_or(0);
        self.placement
            .peers(host)
            .into_iter()
            .map(|h| {
                let ranks: Vec<usize> = (0..self.host_of.len()).filter(|r| self.host_of[*r] == h).collect();
                let n = ranks.len();
                (0..n).map(|i| self.addrs[ranks[(my_index + i) % n]].clone()).collect()
            })
            .collect()
    }
}

pub struct PeerTier {
    name: String,
    rank: u32,
    replicas: Arc<MemoryTier>,
    keep: usize,
    replicas_wanted: usize,
    strategy: Strategy,
    timeout: Duration,
    secret: Arc<RwLock<Option<Vec<u8>>>>,
    cluster: RwLock<Option<Cluster>>,
    /// Why the tier runs degraded, when the job spans fewer hosts than `replicas`: saves go
    /// on without peer copies (their handles say so) and restores find none here.
    degraded: RwLock<Option<String>>,
    /// The one warning about running degraded has been logged.
    warned: AtomicBool,
    idle: Mutex<HashMap<String, Vec<Conn>>>,
    manifests: Mutex<HashMap<(u64, u32), (Manifest, String)>>,
    local_addr: SocketAddr,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
}

pub struct PeerOptions {
    pub listen: String,
    pub replicas: usize,
    pub strategy: Strategy,
    pub keep: usize,
    pub secret: Option<Vec<u8>>,
    pub timeout: Duration,
}

impl PeerTier {
    /// Opens the replica store under the memory root and starts serving it on `listen`.
    pub fn open(name: &str, rank: u32, memory_root: &std::path::Path, opts: PeerOptions) -> Result<Arc<PeerTier>> {
        let replicas = MemoryTier::open(name, &memory_root.join(REPLICA_DIR), None)?;
        let std_listener = std::net::TcpListener::bind(&opts.listen)
            .map_err(|e| Error::unavailable(format!("tier '{name}': cannot listen on {}: {e}", opts.listen)))?;
        std_listener.set_nonblocking(true).map_err(|e| Error::unavailable(format!("tier '{name}': {e}")))?;
        let local_addr = std_listener.local_addr().map_err(|e| Error::unavailable(format!("tier '{name}': {e}")))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tiercel-peer")
            .enable_all()
            .build()
            .map_err(|e| Error::unavailable(format!("tier '{name}': cannot start the peer server: {e}")))?;
        let secret = Arc::new(RwLock::new(opts.secret));
        let store = Arc::new(ReplicaStore::new(name, replicas.clone(), opts.keep));
        {
            let _guard = runtime.enter();
            let listener = TcpListener::from_std(std_listener).map_err(|e| Error::unavailable(format!("tier '{name}': {e}")))?;
            runtime.spawn(server::serve(listener, store, secret.clone()));
        }
        Ok(Arc::new(PeerTier {
            name: name.into(),
            rank,
            replicas,
            keep: opts.keep,
            replicas_wanted: opts.replicas,
            strategy: opts.strategy,
            timeout: opts.timeout,
            secret,
            cluster: RwLock::new(None),
            degraded: RwLock::new(None),
            warned: AtomicBool::new(false),
            idle: Mutex::new(HashMap::new()),
            manifests: Mutex::new(HashMap::new()),
            local_addr,
            runtime: Mutex::new(Some(runtime)),
        }))
    }

    /// The address the server is bound to (the port is the real one when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Sets the shared secret (when it is handed out through the coordinator).
    pub fn set_secret(&self, secret: Vec<u8>) {
        *self.secret.write() = Some(secret);
    }

    pub fn has_secret(&self) -> bool {
        self.secret.read().is_some()
    }

    /// Tells the tier where every rank is: host names and server addresses, by rank.
    pub fn set_cluster(&self, hosts_by_rank: &[String], addrs: &[String]) -> Result<()> {
        if hosts_by_rank.len() != addrs.len() || self.rank as usize >= addrs.len() {
            return Err(Error::invalid(format!(
                "tier '{}': {} hosts and {} addresses for rank {}",
                self.name,
                hosts_by_rank.len(),
                addrs.len(),
                self.rank
            )));
        }
        let (host_of, names) = crate::placement::host_of_ranks(hosts_by_rank);
        self.idle.lock().clear();
        self.manifests.lock().clear();
        if names.len() < self.replicas_wanted {
            // Every copy must live on a distinct host: with too few hosts there is nowhere to
            // put one. A job on one machine still saves and restores, without peer copies.
            *self.cluster.write() = None;
            *self.degraded.write() = Some(format!("not enough hosts ({} < {})", names.len(), self.replicas_wanted));
            return Ok(());
        }
        // (At least `replicas` >= 2 hosts here: "hosts" is plural.)
        let placement = Placement::new(names.len(), self.replicas_wanted, self.strategy)
            .map_err(|e| e.context(format!("tier '{}': {} hosts ({})", self.name, names.len(), names.join(", "))))?;
        *self.cluster.write() = Some(Cluster { host_of, addrs: addrs.to_vec(), placement });
        *self.degraded.write() = None;
        Ok(())
    }

    /// Why the tier cannot keep copies now ("not enough hosts (1 < 2)"), if it cannot. The
    /// first time a save meets it, one warning is logged.
    pub fn degraded(&self) -> Option<String> {
        let why = self.degraded.read().clone()?;
        if !self.warned.swap(true, Ordering::Relaxed) {
            log::warn!(
                "tier '{}': {why}: replicas = {} needs as many hosts (the failure domain); saves go on without peer copies",
                self.name,
                self.replicas_wanted
            );
        }
        Some(why)
    }

    fn secret(&self) -> Result<Vec<u8>> {
        self.secret.read().clone().ok_or_else(|| Error::unavailable(format!("tier '{}': no shared secret yet", self.name)))
    }

    fn holders(&self, rank: u32) -> Result<Vec<Vec<String>>> {
        if self.degraded.read().is_some() {
            return Ok(vec![]); // no peer host: nothing is held, nothing to ask
        }
        let c = self.cluster.read();
        let c = c.as_ref().ok_or_else(|| {
            Error::unavailable(format!("tier '{}': the peers are not known yet (the store was not connected to its cluster)", self.name))
        })?;
        if rank as usize >= c.addrs.len() {
            return Err(Error::invalid(format!("tier '{}': no rank {rank} in a cluster of {}", self.name, c.addrs.len())));
        }
        Ok(c.holders(rank))
    }

    fn conn(&self, addr: &str) -> Result<Conn> {
        if let Some(c) = self.idle.lock().get_mut(addr).and_then(|v| v.pop()) {
            return Ok(c);
        }
        Conn::connect(addr, &self.secret()?, self.timeout)
    }

    fn give_back(&self, addr: &str, c: Conn) {
        self.idle.lock().entry(addr.to_string()).or_default().push(c);
    }

    /// Runs `f` on a connection to `addr`; a connection that failed is dropped, one that
    /// worked is kept for the next call.
    fn with_conn<T>(&self, addr: &str, f: impl FnOnce(&mut Conn) -> Result<T>) -> Result<T> {
        let mut c = self.conn(addr)?;
        let r = f(&mut c)?;
        self.give_back(addr, c);
        Ok(r)
    }

    /// Pushes one rank's step to one process on `candidates`' host (trying them in order).
    fn push(&self, candidates: &[String], m: &Manifest, src: &dyn ChunkSource, link: &Link) -> Result<()> {
        let mut errs = vec![];
        for addr in candidates {
            let res = self.with_conn(addr, |c| c.put_replica(m, src, link));
            match res {
                Ok(()) => return Ok(()),
                Err(e) => errs.push(e.message),
            }
        }
        Err(Error::unavailable(format!(
            "tier '{}': step {} rank {}: no process on peer host took the replica: {}",
            self.name,
            m.step,
            m.rank,
            errs.join("; ")
        ))
        .with_tier(&self.name)
        .at(m.step, m.rank))
    }

    /// The manifest of `rank`'s `step` from the first holder that has it.
    fn fetch_manifest(&self, step: u64, rank: u32) -> Result<(Manifest, String)> {
        if let Some(hit) = self.manifests.lock().get(&(step, rank)) {
            return Ok(hit.clone());
        }
        let mut errs = vec![];
        let mut kinds = vec![];
        for addr in self.holders(rank)?.into_iter().flatten() {
            match self.with_conn(&addr, |c| c.manifest(step, rank)) {
                Ok(Some(m)) if m.step == step && m.rank == rank => {
                    self.manifests.lock().insert((step, rank), (m.clone(), addr.clone()));
                    return Ok((m, addr));
                }
                Ok(_) => {
                    kinds.push(ErrorKind::Integrity);
                    errs.push(format!("{addr}: wrong manifest"));
                }
                Err(e) => {
                    kinds.push(e.kind);
                    errs.push(e.message)
                }
            }
        }
        // Nobody has it: not found. Someone has a bad copy, nobody a good one: integrity.
        // Anything else (a holder that could not answer) may yet have it: unavailable.
        let kind = if kinds.iter().all(|k| *k == ErrorKind::NotFound) {
            ErrorKind::NotFound
        } else if kinds.iter().all(|k| matches!(k, ErrorKind::NotFound | ErrorKind::Integrity)) {
            ErrorKind::Integrity
        } else {
            ErrorKind::TierUnavailable
        };
        let msg = format!("tier '{}': no peer holds step {step} of rank {rank} ({})", self.name, errs.join("; "));
        Err(Error::new(kind, msg).with_tier(&self.name).at(step, rank))
    }

    /// Stops serving (on store close).
    pub fn shutdown(&self) {
        if let Some(rt) = self.runtime.lock().take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
        self.idle.lock().clear();
        self.replicas.release_pool();
    }
}

impl Tier for PeerTier {
    fn name(&self) -> &str {
        &self.name
    }

    fn write_rank(&self, logical: &Manifest, src: &dyn ChunkSource, link: &Link) -> Result<Manifest> {
        let mut m = logical.clone();
        m.tier = self.name.clone();
        let hosts = self.holders(m.rank)?;
        // One copy per peer host, pushed in parallel.
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = hosts.iter().map(|cands| s.spawn(|| self.push(cands, &m, src, link))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::unavailable("replication thread panicked")))).collect()
        });
        for r in results {
            r?;
        }
        Ok(m)
    }

    fn read_stored(&self, m: &Manifest, c: &ChunkMeta, dst: &mut [u8]) -> Result<()> {
        let first = self.manifests.lock().get(&(m.step, m.rank)).map(|(_, a)| a.clone());
        let mut addrs: Vec<String> = first.into_iter().collect();
        for a in self.holders(m.rank)?.into_iter().flatten() {
            if !addrs.contains(&a) {
                addrs.push(a);
            }
        }
        let object = m.objects[c.object as usize].name.clone();
        let mut errs = vec![];
        for addr in &addrs {
            let res = self.with_conn(addr, |conn| conn.read(m.step, m.rank, &object, c.stored_offset, c.crc32c, dst));
            match res {
                Ok(()) => return Ok(()),
                Err(e) => errs.push(e.message),
            }
        }
        Err(Error::unavailable(format!("tier '{}': no peer could send the chunk: {}", self.name, errs.join("; ")))
            .with_tier(&self.name)
            .at(m.step, m.rank))
    }

    /// The peer tier commits per rank: `write_rank` returns only once every peer host has
    /// acknowledged its complete, verified copy.
    fn try_commit(&self, _step: u64, _world_size: u32) -> Result<bool> {
        Ok(true)
    }

    /// Steps of this rank that some peer holds a complete copy of.
    fn committed_steps(&self) -> Result<Vec<u64>> {
        let mut all = std::collections::BTreeSet::new();
        let mut errs = vec![];
        let mut any = false;
        for host in self.holders(self.rank)? {
            for addr in host {
                match self.with_conn(&addr, |c| c.list(self.rank)) {
                    Ok(steps) => {
                        all.extend(steps);
                        any = true;
                        break;
                    }
                    Err(e) => errs.push(e.message),
                }
            }
        }
        if !any && !errs.is_empty() {
            return Err(Error::unavailable(format!("tier '{}': no peer answered: {}", self.name, errs.join("; "))));
        }
        Ok(all.into_iter().collect())
    }

    fn all_steps(&self) -> Result<Vec<u64>> {
        self.committed_steps()
    }

    fn commit_record(&self, step: u64) -> Result<CommitRecord> {
        let (m, _) = self.fetch_manifest(step, self.rank)?;
        Ok(CommitRecord::new(step, m.world_size, &self.name))
    }

    fn read_manifest(&self, step: u64, rank: u32) -> Result<Manifest> {
        self.fetch_manifest(step, rank).map(|(m, _)| m)
    }

    /// This rank's, when a peer holds its complete copy (the tier is per rank).
    fn ranks_written(&self, step: u64) -> Result<Vec<u32>> {
        Ok(if self.committed_steps()?.contains(&step) { vec![self.rank] } else { vec![] })
    }

    /// Peer copies are dropped by their holders' own retention (`keep`), not from here.
    fn delete_step(&self, step: u64) -> Result<()> {
        Err(Error::invalid(format!(
            "tier '{}': step {step}: peer copies are removed by their holders' retention (keep = {})",
            self.name, self.keep
        )))
    }

    /// Nothing to remove from here: each holder applies the retention rule to the replicas
    /// it keeps, as they arrive (see `replicas`).
    fn gc_plan(&self, _opts: &GcOptions) -> Result<Vec<Removal>> {
        Ok(vec![])
    }

    fn gc_apply(&self, _plan: Vec<Removal>) -> Result<Vec<Removal>> {
        Ok(vec![])
    }

    /// Replication runs after flushes and before persists to slower tiers.
    fn priority(&self) -> Priority {
        Priority::Replicate
    }
}
