//! The peer tier: copies of this rank's memory-tier data in the RAM of m-1 other hosts
//! (GEMINI), so a lost host's checkpoints survive in its peers' memory.
//!
//! Every process serves its host's replica store (`<memory root>/peers`, the memory-tier
//! layout) over the transport. A save pushes each chunk straight from the shared-memory
//! segment to one process on every peer host, which writes it straight into its own segment
//! and acknowledges once every chunk has arrived with a valid checksum; the step is then on
//! the peer tier for this rank. A holder that keeps a replica of an earlier step of the rank
//! is sent only the chunks it does not hold (by hash; `reuse`), and copies the others from
//! that replica, checked against their CRC32C as received ones are. A restore pulls chunks from the first holder that answers,
//! falling back holder by holder, then (in the store) tier by tier.
//!
//! `replicas` is the holder's side (what this process stores for others and serves through
//! the transport's server); this file is the saving and restoring rank's side.

mod connections;
#[cfg(test)]
mod dedup_tests;
mod drain;
mod membership;
mod reads;
mod replicas;
mod reuse;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod trust_tests;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tokio::net::TcpListener;

use crate::error::{Error, ErrorKind, Result};
use crate::format::{ChunkMeta, ChunkSource, CommitRecord, Manifest};
use crate::gc::{GcOptions, Removal};
use crate::placement::{Placement, Strategy};
use crate::policy::check_secret;
use crate::scheduler::{Link, Priority};
use crate::tier::memory::MemoryTier;
use crate::tier::Tier;
use crate::transport::server::{self, Limits, Stats};
use crate::transport::{Conn, Ident};
use membership::HolderHost;
pub use membership::{neighbours, Cluster, HostMembers};
use reads::LOCAL;
use replicas::ReplicaStore;

pub use replicas::REPLICA_DIR;

/// Steps whose pushes this process remembers (for `try_commit`): far more than any `keep`.
const PUSHED_KEPT: usize = 1024;

/// What failed when every holder failed: nobody has it, not found; someone has a bad copy and
/// nobody a good one, integrity; anything else (a holder that could not answer, and may yet
/// have it) unavailable.
fn combined_kind(kinds: &[ErrorKind]) -> ErrorKind {
    if kinds.iter().all(|k| *k == ErrorKind::NotFound) {
        ErrorKind::NotFound
    } else if kinds.iter().all(|k| matches!(k, ErrorKind::NotFound | ErrorKind::Integrity)) {
        ErrorKind::Integrity
    } else {
        ErrorKind::TierUnavailable
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
    cluster: Arc<RwLock<Option<Cluster>>>,
    /// Why the tier runs degraded, when the job spans fewer hosts than `replicas`: saves go
    /// on without peer copies (their handles say so) and restores find none here.
    degraded: RwLock<Option<String>>,
    /// The one warning about running degraded has been logged.
    warned: AtomicBool,
    idle: Mutex<HashMap<String, Vec<Conn>>>,
    /// Addresses whose last connect or transfer failed, and since when.
    down: Mutex<HashMap<String, Instant>>,
    stats: Arc<Stats>,
    manifests: Mutex<HashMap<(u64, u32), (Manifest, String)>>,
    /// Steps this process has pushed to every peer host (newest `PUSHED_KEPT`).
    pushed: Mutex<std::collections::BTreeSet<u64>>,
    local_addr: SocketAddr,
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
    /// The replica store the server serves (what arrives from other hosts).
    holding: Arc<ReplicaStore>,
    /// What the pushes sent against what they replicated (`store.metrics()`).
    sent: Arc<crate::requests::SentCounters>,
    /// The chunk hashes of the newest step pushed to every holder: what the holders are
    /// likely to hold at the next push (`bytes_to_move`).
    last_pushed: Mutex<std::collections::HashSet<String>>,
}

pub struct PeerOptions {
    pub listen: String,
    pub replicas: usize,
    pub strategy: Strategy,
    pub keep: usize,
    /// Checked by the caller (`policy::check_secret`, naming where it came from).
    pub secret: Option<Vec<u8>>,
    /// The progress deadline of every transfer (and the connect timeout).
    pub timeout: Duration,
    pub limits: Limits,
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
        let cluster = Arc::new(RwLock::new(None));
        let stats = Arc::new(Stats::default());
        let store = Arc::new(ReplicaStore::new(name, rank, replicas.clone(), opts.keep, cluster.clone()));
        {
            let _guard = runtime.enter();
            let listener = TcpListener::from_std(std_listener).map_err(|e| Error::unavailable(format!("tier '{name}': {e}")))?;
            runtime.spawn(server::serve(listener, store.clone(), secret.clone(), opts.limits, stats.clone()));
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
            cluster,
            degraded: RwLock::new(None),
            warned: AtomicBool::new(false),
            idle: Mutex::new(HashMap::new()),
            down: Mutex::new(HashMap::new()),
            stats,
            manifests: Mutex::new(HashMap::new()),
            pushed: Mutex::new(Default::default()),
            local_addr,
            runtime: Mutex::new(Some(runtime)),
            holding: store,
            sent: Default::default(),
            last_pushed: Default::default(),
        }))
    }

    /// The address the server is bound to (the port is the real one when 0 was asked).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What the server has seen (open, unauthenticated, refused, idle-closed connections).
    pub fn server_stats(&self) -> &Stats {
        &self.stats
    }

    /// Sets the shared secret (when it is handed out through the coordinator).
    pub fn set_secret(&self, secret: Vec<u8>) -> Result<()> {
        check_secret(&secret, "the coordinator").map_err(|e| e.context(format!("tier '{}'", self.name)))?;
        *self.secret.write() = Some(secret);
        Ok(())
    }

    pub fn has_secret(&self) -> bool {
        self.secret.read().is_some()
    }

    /// Tells the tier where every rank is (host names and server addresses, by rank) and
    /// which job they run; connections to or from another job are refused. Hosts are
    /// numbered in the order their first rank comes (`placement::host_of_ranks`).
    pub fn set_cluster(&self, job: &str, hosts_by_rank: &[String], addrs: &[String]) -> Result<()> {
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
        let mut members: Vec<HostMembers> =
            names.iter().enumerate().map(|(index, name)| HostMembers { index, name: name.clone(), ranks: vec![] }).collect();
        for (rank, (h, a)) in host_of.iter().zip(addrs).enumerate() {
            members[*h].ranks.push((rank as u32, a.clone()));
        }
        self.set_members(job, addrs.len() as u32, names.len(), &members)
    }

    /// The placement of `hosts` hosts, or None when they are too few for `replicas` (the
    /// tier then runs degraded).
    fn placement(&self, hosts: usize) -> Result<Option<Placement>> {
        if hosts < self.replicas_wanted {
            return Ok(None);
        }
        // (At least `replicas` >= 2 hosts here: "hosts" is plural.)
        Placement::new(hosts, self.replicas_wanted, self.strategy)
            .map(Some)
            .map_err(|e| e.context(format!("tier '{}': {hosts} hosts", self.name)))
    }

    /// For each of `hosts` hosts, by index, the hosts it must know (`neighbours`); None when
    /// the tier would run degraded with that many.
    pub fn neighbours(&self, hosts: usize) -> Result<Option<Vec<Vec<usize>>>> {
        Ok(self.placement(hosts)?.map(|p| neighbours(&p, hosts)))
    }

    /// Tells the tier which job it runs (connections to or from another job are refused),
    /// how many ranks and hosts the job has, and the hosts it must know: its own, with this rank,
    /// and its placement neighbours (`neighbours`), each with its ranks' server addresses.
    pub fn set_members(&self, job: &str, world_size: u32, hosts: usize, members: &[HostMembers]) -> Result<()> {
        let mine = members.iter().find(|h| h.ranks.iter().any(|(r, _)| *r == self.rank));
        let Some(mine) = mine else {
            return Err(Error::invalid(format!("tier '{}': rank {} is on none of the hosts it was given", self.name, self.rank)));
        };
        if let Some(h) = members.iter().find(|h| h.index >= hosts) {
            return Err(Error::invalid(format!("tier '{}': host {} has index {} of {hosts} hosts", self.name, h.name, h.index)));
        }
        self.idle.lock().clear();
        self.manifests.lock().clear();
        let Some(placement) = self.placement(hosts)? else {
            // Every copy must live on a distinct host: with too few hosts there is nowhere to
            // put one. A job on one machine still saves and restores, without peer copies.
            *self.cluster.write() = None;
            *self.degraded.write() = Some(format!("not enough hosts ({hosts} < {})", self.replicas_wanted));
            return Ok(());
        };
        let known: std::collections::HashSet<usize> = members.iter().map(|h| h.index).collect();
        let lacking: Vec<usize> = neighbours_of(&placement, mine.index).into_iter().filter(|h| !known.contains(h)).collect();
        if !lacking.is_empty() {
            return Err(Error::invalid(format!(
                "tier '{}': host {} (index {}) was not told the members of its placement neighbours {lacking:?}",
                self.name, mine.name, mine.index
            )));
        }
        *self.cluster.write() = Some(Cluster::new(job, world_size, members, placement));
        self.idle.lock().clear();
        self.down.lock().clear();
        self.manifests.lock().clear();
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

    /// `f` of the cluster as this process knows it; None while the tier runs degraded (no
    /// peer host: nothing is held, nothing to ask).
    fn with_cluster<T>(&self, f: impl FnOnce(&Cluster) -> T) -> Result<Option<T>> {
        if self.degraded.read().is_some() {
            return Ok(None);
        }
        let c = self.cluster.read();
        let c = c.as_ref().ok_or_else(|| {
            Error::unavailable(format!("tier '{}': the peers are not known yet (the store was not connected to its cluster)", self.name))
        })?;
        Ok(Some(f(c)))
    }

    fn holders(&self, rank: u32) -> Result<Vec<HolderHost>> {
        let Some(holders) = self.with_cluster(|c| c.holders(rank))? else {
            return Ok(vec![]);
        };
        holders.ok_or_else(|| {
            // A process learns the members of its own host and its placement neighbours
            // only (O(m) hosts), not where every rank's replicas are.
            Error::not_found(format!(
                "tier '{}': rank {rank}'s replicas are not held by this host's placement neighbours (this process \
                 knows the holders of its own host's and its neighbours' ranks only); read rank {rank}'s part from \
                 another tier",
                self.name
            ))
            .with_tier(&self.name)
        })
    }

    /// Serves this host's own memory tier too, besides the replicas it holds: a job
    /// restarted on fewer hosts reads a lost host's ranks from their replicas and the
    /// survivors' ranks from wherever a copy is left, their own host's RAM included.
    pub fn serve_own(&self, memory: Arc<MemoryTier>) {
        self.holding.serve_own(memory);
    }

    /// Pushes one rank's step to one process on `host` (trying its addresses in order):
    /// the bytes of the chunks sent (those the holder lacked).
    fn push(&self, host: &HolderHost, m: &Manifest, src: &dyn ChunkSource, link: &Link) -> Result<u64> {
        let mut errs = vec![];
        for addr in &host.addrs {
            let res = self.with_conn(addr, &host.name, |c| c.put_replica(m, src, link));
            match res {
                Ok(sent) => return Ok(sent),
                Err(e) => errs.push(e.message),
            }
        }
        Err(Error::unavailable(format!(
            "tier '{}': step {} rank {}: no process on peer host {} took the replica: {}",
            self.name,
            m.step,
            m.rank,
            host.name,
            errs.join("; ")
        ))
        .with_tier(&self.name)
        .at(m.step, m.rank))
    }

    /// Stops serving (on store close), once the replicas other hosts still push here have
    /// arrived (`drain`).
    pub fn shutdown(&self) {
        self.drain();
        self.stop();
    }

    /// Stops serving now.
    pub fn stop(&self) {
        if let Some(rt) = self.runtime.lock().take() {
            rt.shutdown_timeout(Duration::from_secs(1));
        }
        self.idle.lock().clear();
        self.replicas.release_pool();
    }
}

/// The hosts `host` talks to: its peers and the hosts it is a peer of.
fn neighbours_of(placement: &Placement, host: usize) -> Vec<usize> {
    let mut out = placement.peers(host);
    out.extend(placement.keeps(host).into_iter().skip(1));
    out.sort_unstable();
    out.dedup();
    out
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
        let results: Vec<Result<u64>> = std::thread::scope(|s| {
            let handles: Vec<_> = hosts.iter().map(|host| s.spawn(|| self.push(host, &m, src, link))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(Error::unavailable("replication thread panicked")))).collect()
        });
        // A step written again must not be served from an old copy's manifest.
        self.manifests.lock().remove(&(m.step, m.rank));
        let done: Vec<u64> = results.iter().filter_map(|r| r.as_ref().ok().copied()).collect();
        self.sent.wrote(done.iter().sum(), m.total_bytes() * done.len() as u64);
        for r in results {
            r?;
        }
        *self.last_pushed.lock() = m.items.iter().flat_map(|it| &it.chunks).filter_map(|c| c.hash.clone()).collect();
        let mut pushed = self.pushed.lock();
        pushed.insert(m.step);
        while pushed.len() > PUSHED_KEPT {
            pushed.pop_first();
        }
        Ok(m)
    }

    fn sent(&self) -> Option<Arc<crate::requests::SentCounters>> {
        Some(self.sent.clone())
    }

    /// The chunks of `m` that the step pushed last did not have (by hash), and those without
    /// a hash: what a holder that kept that step's replica lacks. (A holder that lost it is
    /// sent more; the schedule learns the link's real cost per chunk as they go.)
    fn bytes_to_move(&self, m: &Manifest) -> u64 {
        let held = self.last_pushed.lock();
        m.items.iter().flat_map(|it| &it.chunks).filter(|c| c.hash.as_ref().is_none_or(|h| !held.contains(h))).map(|c| c.len).sum()
    }

    fn read_stored(&self, m: &Manifest, c: &ChunkMeta, dst: &mut [u8]) -> Result<()> {
        // The holder that sent the manifest first, then the others.
        let first = self.manifests.lock().get(&(m.step, m.rank)).map(|(_, a)| a.clone());
        let (mut errs, mut kinds) = (vec![], vec![]);
        if first.as_deref() == Some(LOCAL) {
            match self.read_local(m, c, dst) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    kinds.push(e.kind);
                    errs.push(e.message)
                }
            }
        }
        let mut addrs: Vec<(String, String)> = self
            .sources(m.rank, Some(m.world_size))?
            .into_iter()
            .flat_map(|h| h.addrs.into_iter().map(move |a| (a, h.name.clone())))
            .collect();
        addrs.sort_by_key(|(a, _)| Some(a) != first.as_ref());
        let object = m.objects[c.object as usize].name.clone();
        for (addr, host) in &addrs {
            let res = self.with_conn(addr, host, |conn| conn.read(m.step, m.rank, &object, c.stored_offset, c.crc32c, dst));
            match res {
                Ok(()) => return Ok(()),
                Err(e) => {
                    kinds.push(e.kind);
                    errs.push(e.message)
                }
            }
        }
        let msg = format!("tier '{}': no peer could send the chunk: {}", self.name, errs.join("; "));
        Err(Error::new(combined_kind(&kinds), msg).with_tier(&self.name).at(m.step, m.rank))
    }

    /// `Conn::read` verifies every chunk against its checksum block by block as it arrives.
    fn verifies_reads(&self) -> bool {
        true
    }

    /// The peer tier commits per rank: `write_rank` returns only once every peer host has
    /// acknowledged its complete, verified copy, so a step is committed once this process
    /// has written it.
    fn try_commit(&self, step: u64, _world_size: u32) -> Result<bool> {
        Ok(self.pushed.lock().contains(&step))
    }

    /// Steps of this rank that some peer holds a complete copy of.
    fn committed_steps(&self) -> Result<Vec<u64>> {
        let mut all = std::collections::BTreeSet::new();
        let mut errs = vec![];
        let mut any = false;
        for host in self.holders(self.rank)? {
            for addr in &host.addrs {
                match self.with_conn(addr, &host.name, |c| c.list(self.rank)) {
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

    /// From this rank's copy on a peer; else (a job restarted on fewer hosts, whose rank's
    /// copy is in its own host's RAM only) from any rank's replica of the step this host
    /// holds: the record says who saved the step and which save it is, for any rank's read.
    fn commit_record(&self, step: u64) -> Result<CommitRecord> {
        let m = match self.fetch_manifest(step, self.rank) {
            Ok((m, _)) => m,
            Err(e) => {
                let held = self.replicas.ranks_written(step).unwrap_or_default();
                match held.into_iter().find_map(|r| self.local_manifest(step, r)) {
                    Some(m) => m,
                    None => return Err(e),
                }
            }
        };
        let mut record = CommitRecord::new(step, m.world_size, &self.name);
        record.generation = m.generation;
        Ok(record)
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
