//! The peer tier: copies of this rank's memory-tier data in the RAM of m-1 other hosts
//! (GEMINI), so a lost host's checkpoints survive in its peers' memory.
//!
//! Every process serves its host's replica store (`<memory root>/peers`, the memory-tier
//! layout) over the transport. A save pushes each chunk straight from the shared-memory
//! segment to one process on every peer host, which writes it straight into its own segment
//! and acknowledges once every chunk has arrived with a valid checksum; the step is then on
//! the peer tier for this rank. A restore pulls chunks from the first holder that answers,
//! falling back holder by holder, then (in the store) tier by tier.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::blobs::Blobs;
use crate::error::{Error, ErrorKind, Result};
use crate::format::{self, ChunkMeta, CommitRecord, Manifest};
use crate::placement::{Placement, Strategy};
use crate::scheduler::Link;
use crate::tier::memory::{MemoryTier, View};
use crate::tier::{ChunkSource, Tier};
use crate::transport::{self, Conn, DataHeader, Kind, WireError};

pub const REPLICA_DIR: &str = "peers";

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Request {
    Put { step: u64, rank: u32, manifest: Manifest },
    List { rank: u32 },
    Manifest { step: u64, rank: u32 },
    Read { step: u64, rank: u32, object: String, offset: u64, len: u64, crc32c: u32 },
}

#[derive(Debug, Serialize, Deserialize, Default)]
struct Reply {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    steps: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    manifest: Option<Manifest>,
}

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
        let server = Server { tier: name.to_string(), replicas: replicas.clone(), keep: opts.keep, secret: secret.clone() };
        {
            let _guard = runtime.enter();
            let listener = TcpListener::from_std(std_listener).map_err(|e| Error::unavailable(format!("tier '{name}': {e}")))?;
            runtime.spawn(Arc::new(server).serve(listener));
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
        let placement = Placement::new(names.len(), self.replicas_wanted, self.strategy)
            .map_err(|e| e.context(format!("tier '{}': {} hosts ({})", self.name, names.len(), names.join(", "))))?;
        *self.cluster.write() = Some(Cluster { host_of, addrs: addrs.to_vec(), placement });
        self.idle.lock().clear();
        self.manifests.lock().clear();
        Ok(())
    }

    fn secret(&self) -> Result<Vec<u8>> {
        self.secret.read().clone().ok_or_else(|| Error::unavailable(format!("tier '{}': no shared secret yet", self.name)))
    }

    fn holders(&self, rank: u32) -> Result<Vec<Vec<String>>> {
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
            let res = self.with_conn(addr, |c| {
                let _: Reply = c.request(&Request::Put { step: m.step, rank: m.rank, manifest: m.clone() })?;
                let mut buf = vec![];
                for (i, it) in m.items.iter().enumerate() {
                    for (k, ch) in it.chunks.iter().enumerate() {
                        link.acquire(ch.len);
                        let d = DataHeader { object: ch.object, offset: ch.stored_offset, crc32c: ch.crc32c };
                        match src.raw_slice(i, k) {
                            Some(s) => c.send_data(&d, s)?,
                            None => {
                                buf.resize(ch.len as usize, 0);
                                src.read_raw(i, k, &mut buf)?;
                                c.send_data(&d, &buf)?;
                            }
                        }
                    }
                }
                c.send(Kind::End, &[])?;
                let _: Reply = c.response()?;
                Ok(())
            });
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
        )))
    }

    /// The manifest of `rank`'s `step` from the first holder that has it.
    fn fetch_manifest(&self, step: u64, rank: u32) -> Result<(Manifest, String)> {
        if let Some(hit) = self.manifests.lock().get(&(step, rank)) {
            return Ok(hit.clone());
        }
        let mut errs = vec![];
        let mut not_found = true;
        for addr in self.holders(rank)?.into_iter().flatten() {
            match self.with_conn(&addr, |c| c.request::<_, Reply>(&Request::Manifest { step, rank })) {
                Ok(Reply { manifest: Some(m), .. }) if m.step == step && m.rank == rank => {
                    self.manifests.lock().insert((step, rank), (m.clone(), addr.clone()));
                    return Ok((m, addr));
                }
                Ok(_) => errs.push(format!("{addr}: wrong manifest")),
                Err(e) => {
                    not_found &= e.kind == ErrorKind::NotFound;
                    errs.push(e.message)
                }
            }
        }
        let msg = format!("tier '{}': no peer holds step {step} of rank {rank} ({})", self.name, errs.join("; "));
        Err(if not_found { Error::not_found(msg) } else { Error::unavailable(msg) })
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

    fn kind(&self) -> &'static str {
        "peer"
    }

    fn blobs(&self) -> &dyn Blobs {
        self.replicas.blobs()
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
            let req = Request::Read {
                step: m.step,
                rank: m.rank,
                object: object.clone(),
                offset: c.stored_offset,
                len: c.stored_len,
                crc32c: c.crc32c,
            };
            let res = self.with_conn(addr, |conn| {
                conn.send(Kind::Request, &serde_json::to_vec(&req).unwrap())?;
                // read_chunk verifies the chunk against the manifest right after.
                conn.recv_data_into(dst, false)?;
                Ok(())
            });
            match res {
                Ok(()) => return Ok(()),
                Err(e) => errs.push(e.message),
            }
        }
        Err(Error::unavailable(format!("tier '{}': no peer could send the chunk: {}", self.name, errs.join("; "))))
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
                match self.with_conn(&addr, |c| c.request::<_, Reply>(&Request::List { rank: self.rank })) {
                    Ok(r) => {
                        all.extend(r.steps.unwrap_or_default());
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

    /// Peer copies are dropped by their holders' own retention (`keep`), not from here.
    fn delete_step(&self, step: u64) -> Result<()> {
        Err(Error::invalid(format!(
            "tier '{}': step {step}: peer copies are removed by their holders' retention (keep = {})",
            self.name, self.keep
        )))
    }
}

/// The serving half: one task per connection, on the peer runtime.
struct Server {
    tier: String,
    replicas: Arc<MemoryTier>,
    keep: usize,
    secret: Arc<RwLock<Option<Vec<u8>>>>,
}

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);

impl Server {
    async fn serve(self: Arc<Self>, listener: TcpListener) {
        loop {
            let (sock, addr) = match listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    log::warn!("tier '{}': accept failed: {e}", self.tier);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            sock.set_nodelay(true).ok();
            let me = self.clone();
            tokio::spawn(async move {
                if let Err(e) = me.connection(sock).await {
                    log::warn!("tier '{}': connection from {addr} dropped: {e}", me.tier);
                }
            });
        }
    }

    async fn connection(&self, mut s: TcpStream) -> Result<()> {
        // The secret may still be on its way through the coordinator: a peer that got it a
        // moment earlier can already be knocking. Wait a while rather than turn it away.
        let mut secret = self.secret.read().clone();
        for _ in 0..300 {
            if secret.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            secret = self.secret.read().clone();
        }
        let Some(secret) = secret else {
            send_error(&mut s, &Error::unavailable("this peer has no shared secret yet")).await;
            return Err(Error::unavailable("refused: no shared secret yet"));
        };
        let sn = transport::nonce();
        send(&mut s, Kind::Hello, &sn).await?;
        let (h, body) = tokio::time::timeout(HANDSHAKE_TIMEOUT, recv(&mut s))
            .await
            .map_err(|_| Error::unavailable("no authentication within 10 s"))??;
        if h.kind != Kind::Auth || body.len() != transport::NONCE_LEN + transport::MAC_LEN {
            return Err(Error::unavailable(format!("expected AUTH, got {:?}", h.kind)));
        }
        let (cn, got) = body.split_at(transport::NONCE_LEN);
        if !transport::verify_mac(&secret, b"client", &sn, cn, got) {
            send_error(&mut s, &Error::unavailable("authentication failed (wrong shared secret)")).await;
            return Err(Error::unavailable("authentication failed (wrong shared secret)"));
        }
        send(&mut s, Kind::AuthOk, &transport::mac(&secret, b"server", cn, &sn)).await?;
        let mut views: HashMap<(u64, u32, String), Arc<View>> = HashMap::new();
        loop {
            let (h, body) = match tokio::time::timeout(IDLE_TIMEOUT, recv(&mut s)).await {
                Err(_) => return Ok(()),                                      // idle: the client reconnects when it needs to
                Ok(Err(e)) if e.kind == ErrorKind::NotFound => return Ok(()), // clean close
                Ok(r) => r?,
            };
            if h.kind != Kind::Request {
                return Err(Error::unavailable(format!("expected a request, got {:?}", h.kind)));
            }
            let req: Request = serde_json::from_slice(&body).map_err(|e| Error::unavailable(format!("malformed request: {e}")))?;
            match req {
                Request::Put { step, rank, manifest } => match self.put(&mut s, step, rank, manifest).await {
                    Ok(r) => reply(&mut s, r).await?,
                    Err(e) => {
                        // The client may still be streaming data frames: tell it why, then
                        // drop the connection rather than parse the rest as requests.
                        send_error(&mut s, &e).await;
                        return Err(e);
                    }
                },
                Request::Read { step, rank, object, offset, len, crc32c } => {
                    match self.read(&mut views, step, rank, &object, offset, len) {
                        Ok((view, start)) => {
                            let d = DataHeader { object: 0, offset, crc32c };
                            let mut head = transport::encode_header(Kind::Data, transport::DATA_SUBHEADER_LEN as u64 + len).to_vec();
                            head.extend_from_slice(&transport::encode_data_header(&d));
                            s.write_all(&head).await.map_err(io)?;
                            s.write_all(&view[start..start + len as usize]).await.map_err(io)?;
                        }
                        Err(e) => send_error(&mut s, &e).await,
                    }
                }
                // Errors about what was asked go back to the client; the connection stays.
                Request::List { rank } => match self.list(rank) {
                    Ok(steps) => reply(&mut s, Reply { steps: Some(steps), ..Default::default() }).await?,
                    Err(e) => send_error(&mut s, &e).await,
                },
                Request::Manifest { step, rank } => match self.replicas.read_manifest(step, rank) {
                    Ok(m) => reply(&mut s, Reply { manifest: Some(m), ..Default::default() }).await?,
                    Err(e) => send_error(&mut s, &e).await,
                },
            }
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

    fn read(
        &self,
        views: &mut HashMap<(u64, u32, String), Arc<View>>,
        step: u64,
        rank: u32,
        object: &str,
        offset: u64,
        len: u64,
    ) -> Result<(Arc<View>, usize)> {
        let prefix = format!("rank-{rank:05}.");
        if !object.starts_with(&prefix) || object.contains('/') {
            return Err(Error::invalid(format!("object '{object}' is not rank {rank}'s")));
        }
        let key = (step, rank, object.to_string());
        let view = match views.get(&key) {
            Some(v) => v.clone(),
            None => {
                let v = self.replicas.view(step, object)?;
                views.insert(key, v.clone());
                v
            }
        };
        if offset.checked_add(len).is_none_or(|end| end > view.len() as u64) {
            return Err(Error::invalid(format!("step {step} rank {rank} object {object}: range {offset}+{len} is outside it")));
        }
        Ok((view, offset as usize))
    }

    /// Receives one rank's step: segments are allocated from the manifest, every data frame
    /// lands straight in its segment and must match its chunk's checksum; the manifest is
    /// published (the replica is complete) only after every chunk has arrived.
    async fn put(&self, s: &mut TcpStream, step: u64, rank: u32, mut m: Manifest) -> Result<Reply> {
        if m.step != step || m.rank != rank {
            return Err(Error::invalid("manifest does not match the put request"));
        }
        m = Manifest::from_json(&m.to_json(), &format!("replica of step {step} rank {rank}"))?;
        m.tier = self.tier.clone();
        let mut segs = vec![];
        for (i, o) in m.objects.iter().enumerate() {
            if o.name != format::part_name(rank, i) {
                return Err(Error::invalid(format!("unexpected object name '{}'", o.name)));
            }
            segs.push(self.replicas.allocate(step, rank, i, o.len)?);
        }
        // chunk lookup: (object, stored offset) -> (len, crc, received)
        let mut expect: HashMap<(u32, u64), (u64, u32, bool)> = HashMap::new();
        for it in &m.items {
            for c in &it.chunks {
                expect.insert((c.object, c.stored_offset), (c.len, c.crc32c, false));
            }
        }
        send(s, Kind::Response, &serde_json::to_vec(&Reply::default()).unwrap()).await?;
        let result: Result<()> = async {
            loop {
                let h = recv_header(s).await?;
                match h.kind {
                    Kind::End => break,
                    Kind::Data => {}
                    k => return Err(Error::unavailable(format!("expected data, got {k:?}"))),
                }
                let mut sub = [0u8; transport::DATA_SUBHEADER_LEN];
                s.read_exact(&mut sub).await.map_err(io)?;
                let d = transport::decode_data_header(&sub);
                let len = h.len - transport::DATA_SUBHEADER_LEN as u64;
                let slot = expect.get_mut(&(d.object, d.offset)).filter(|(l, crc, _)| *l == len && *crc == d.crc32c).ok_or_else(|| {
                    Error::integrity(format!("data frame (object {}, offset {}, {len} bytes) matches no chunk", d.object, d.offset))
                })?;
                let seg = &segs[d.object as usize];
                // Safety: the chunk lies inside the segment (manifest checked by from_json),
                // and this connection is the only writer of this fresh segment.
                let dst = unsafe { std::slice::from_raw_parts_mut(seg.ptr().add(d.offset as usize), len as usize) };
                s.read_exact(dst).await.map_err(io)?;
                if crc32c::crc32c(dst) != d.crc32c {
                    return Err(Error::integrity(format!("chunk at object {} offset {} arrived corrupted", d.object, d.offset)));
                }
                slot.2 = true;
            }
            if let Some(((o, off), _)) = expect.iter().find(|(_, v)| !v.2) {
                return Err(Error::integrity(format!("chunk at object {o} offset {off} never arrived")));
            }
            self.replicas.publish(&m)
        }
        .await;
        let sizes: Vec<u64> = segs.iter().map(|s| s.len() as u64).collect();
        drop(segs);
        if let Err(e) = result {
            // Drain nothing more: the connection is dropped, and the partial replica with it.
            for i in 0..m.objects.len() {
                let _ = self.replicas.blobs().delete(&format!("{}/{}", format::step_dir(step), format::part_name(rank, i)));
            }
            return Err(Error::unavailable(format!("receiving step {step} of rank {rank}: {}", e.message)));
        }
        self.retain();
        // Pre-fault segments for the next replica of this shape off the connection's path:
        // allocating fresh shared memory runs at ~1 GB/s, writing into touched pages at 10+.
        let replicas = self.replicas.clone();
        tokio::task::spawn_blocking(move || {
            if let Err(e) = replicas.prefault(&sizes) {
                log::warn!("pre-faulting replica segments: {e}");
            }
        });
        Ok(Reply::default())
    }

    /// Keeps the newest `keep` replica steps.
    fn retain(&self) {
        let Ok(steps) = self.replicas.all_steps() else { return };
        for s in steps.iter().rev().skip(self.keep) {
            if let Err(e) = self.replicas.evict(*s) {
                log::warn!("tier '{}': dropping replica step {s}: {e}", self.tier);
            }
        }
    }
}

fn io(e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::not_found("connection closed")
    } else {
        Error::unavailable(e.to_string())
    }
}

async fn send(s: &mut TcpStream, kind: Kind, payload: &[u8]) -> Result<()> {
    s.write_all(&transport::encode_header(kind, payload.len() as u64)).await.map_err(io)?;
    s.write_all(payload).await.map_err(io)
}

async fn reply(s: &mut TcpStream, r: Reply) -> Result<()> {
    send(s, Kind::Response, &serde_json::to_vec(&r).unwrap()).await
}

async fn send_error(s: &mut TcpStream, e: &Error) {
    let _ = send(s, Kind::Error, &serde_json::to_vec(&WireError::from_error(e)).unwrap()).await;
}

async fn recv_header(s: &mut TcpStream) -> Result<transport::Header> {
    let mut h = [0u8; transport::HEADER_LEN];
    s.read_exact(&mut h).await.map_err(io)?;
    transport::decode_header(&h)
}

async fn recv(s: &mut TcpStream) -> Result<(transport::Header, Vec<u8>)> {
    let h = recv_header(s).await?;
    if h.kind == Kind::Data {
        return Err(Error::unavailable("unexpected data frame"));
    }
    let mut body = vec![0u8; h.len as usize];
    s.read_exact(&mut body).await.map_err(io)?;
    Ok((h, body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    struct VecSource(Vec<Vec<u8>>);
    impl ChunkSource for VecSource {
        fn read_raw(&self, item: usize, chunk: usize, dst: &mut [u8]) -> Result<()> {
            let off = chunk * 1024;
            dst.copy_from_slice(&self.0[item][off..off + dst.len()]);
            Ok(())
        }
    }

    fn manifest(step: u64, rank: u32, data: &[Vec<u8>]) -> Manifest {
        let mut m = Manifest::new(step, rank, 2, "ram", 1024);
        let mut pos = 0;
        for (i, d) in data.iter().enumerate() {
            let chunks = format::chunk_ranges(d.len() as u64, 1024)
                .map(|(off, len)| ChunkMeta {
                    offset: off,
                    len,
                    crc32c: crc32c::crc32c(&d[off as usize..(off + len) as usize]),
                    object: 0,
                    stored_offset: pos + off,
                    stored_len: len,
                    codec: "raw".into(),
                })
                .collect();
            m.items.push(format::ItemMeta {
                name: format!("m/{i}"),
                kind: "array".into(),
                dtype: "uint8".into(),
                shape: vec![d.len() as u64],
                nbytes: d.len() as u64,
                meta: serde_json::Value::Null,
                shard: None,
                chunks,
            });
            pos = format::align_up(pos + d.len() as u64, 64);
        }
        m.objects.push(format::ObjectMeta { name: format::part_name(rank, 0), len: pos });
        m
    }

    fn pair(secret: &[u8]) -> (tempfile::TempDir, Arc<PeerTier>, Arc<PeerTier>) {
        let dir = tempfile::Builder::new().prefix("tiercel-peer-test").tempdir_in("/dev/shm").unwrap();
        let open = |rank: u32, host: &str| {
            PeerTier::open(
                "peer",
                rank,
                &dir.path().join(host),
                PeerOptions {
                    listen: "127.0.0.1:0".into(),
                    replicas: 2,
                    strategy: Strategy::Mixed,
                    keep: 2,
                    secret: Some(secret.to_vec()),
                    timeout: Duration::from_secs(5),
                },
            )
            .unwrap()
        };
        let (a, b) = (open(0, "hostA"), open(1, "hostB"));
        let hosts = vec!["hostA".to_string(), "hostB".to_string()];
        let addrs = vec![a.local_addr().to_string(), b.local_addr().to_string()];
        a.set_cluster(&hosts, &addrs).unwrap();
        b.set_cluster(&hosts, &addrs).unwrap();
        (dir, a, b)
    }

    /// A peer that dies mid-transfer: the rest of the chunks come from another holder.
    #[test]
    fn a_holder_dying_mid_restore_is_replaced_by_another() {
        let dir = tempfile::Builder::new().prefix("tiercel-peer-test").tempdir_in("/dev/shm").unwrap();
        let tiers: Vec<Arc<PeerTier>> = (0..3)
            .map(|r| {
                PeerTier::open(
                    "peer",
                    r,
                    &dir.path().join(format!("h{r}")),
                    PeerOptions {
                        listen: "127.0.0.1:0".into(),
                        replicas: 3,
                        strategy: Strategy::Mixed,
                        keep: 2,
                        secret: Some(b"s".to_vec()),
                        timeout: Duration::from_secs(5),
                    },
                )
                .unwrap()
            })
            .collect();
        let hosts: Vec<String> = (0..3).map(|h| format!("h{h}")).collect();
        let addrs: Vec<String> = tiers.iter().map(|t| t.local_addr().to_string()).collect();
        for t in &tiers {
            t.set_cluster(&hosts, &addrs).unwrap();
        }
        let data = vec![(0..8192u32).map(|i| (i % 251) as u8).collect::<Vec<u8>>()];
        let m = manifest(1, 0, &data);
        tiers[0].write_rank(&m, &VecSource(data.clone()), &Link::new("p", None)).unwrap();
        let got = tiers[0].read_manifest(1, 0).unwrap();
        let first = tiers[0].manifests.lock().get(&(1, 0)).unwrap().1.clone();
        let n = got.items[0].chunks.len();
        assert!(n >= 4);
        let mut buf = vec![0u8; 8192];
        for (c, ch) in got.items[0].chunks.iter().enumerate() {
            if c == n / 2 {
                // The holder that served so far goes away in the middle of the restore.
                let dead = tiers.iter().find(|t| t.local_addr().to_string() == first).unwrap();
                dead.shutdown();
            }
            crate::tier::read_chunk(&*tiers[0], &got, 0, c, &mut buf[ch.offset as usize..(ch.offset + ch.len) as usize]).unwrap();
        }
        assert_eq!(buf, data[0]);
        for t in &tiers {
            t.shutdown();
        }
    }

    #[test]
    fn replicate_and_read_back() {
        let (_dir, a, b) = pair(b"secret");
        let data = vec![(0..3000u32).map(|i| (i * 7) as u8).collect::<Vec<u8>>(), vec![5u8; 10], vec![]];
        let m = manifest(3, 0, &data);
        let link = Link::new("peer", None);
        a.write_rank(&m, &VecSource(data.clone()), &link).unwrap();
        // Rank 0's copy now lives on host B; rank 0 sees it through its peer tier.
        assert_eq!(a.committed_steps().unwrap(), vec![3]);
        let got = a.read_manifest(3, 0).unwrap();
        assert_eq!(got.items, m.items);
        for (i, it) in got.items.iter().enumerate() {
            let mut buf = vec![0u8; it.nbytes as usize];
            for (c, ch) in it.chunks.iter().enumerate() {
                crate::tier::read_chunk(&*a, &got, i, c, &mut buf[ch.offset as usize..(ch.offset + ch.len) as usize]).unwrap();
            }
            assert_eq!(buf, data[i]);
        }
        // Host B holds it; host A holds nothing of its own rank.
        assert_eq!(b.replicas.all_steps().unwrap(), vec![3]);
        // Retention on the holder: keep = 2.
        for step in 4..7 {
            a.write_rank(&manifest(step, 0, &data), &VecSource(data.clone()), &link).unwrap();
        }
        assert_eq!(a.committed_steps().unwrap(), vec![5, 6]);
        a.shutdown();
        b.shutdown();
    }

    #[test]
    fn strangers_and_garbage_are_refused_and_the_server_lives_on() {
        let (_dir, a, b) = pair(b"right");
        let addr = b.local_addr().to_string();
        // 1. Garbage instead of AUTH.
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        let mut hello = [0u8; transport::HEADER_LEN + transport::NONCE_LEN];
        s.read_exact(&mut hello).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut rest = vec![];
        let _ = s.read_to_end(&mut rest); // the server closes the connection
                                          // 2. A client with the wrong secret is told so and gets nothing.
        let e = Conn::connect(&addr, b"wrong", Duration::from_secs(5)).err().expect("refused");
        assert!(e.message.contains("secret") || e.message.contains("authentication"), "{}", e.message);
        // 3. A huge length prefix is refused before anything is allocated.
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.read_exact(&mut hello).unwrap();
        s.write_all(&transport::encode_header(Kind::Auth, 64)[..8]).unwrap();
        s.write_all(&u64::MAX.to_le_bytes()).unwrap();
        let _ = s.read_to_end(&mut rest);
        // 4. An authenticated client sending a malformed request and a bad data frame.
        let mut c = Conn::connect(&addr, b"right", Duration::from_secs(5)).unwrap();
        c.send(Kind::Request, b"{not json").unwrap();
        assert!(c.recv().is_err(), "connection dropped after a malformed request");
        // The server still serves the real client.
        let data = vec![vec![1u8; 5000]];
        a.write_rank(&manifest(1, 0, &data), &VecSource(data.clone()), &Link::new("p", None)).unwrap();
        assert_eq!(a.committed_steps().unwrap(), vec![1]);
        a.shutdown();
        b.shutdown();
    }

    #[test]
    fn corrupt_data_frame_is_rejected_and_leaves_no_replica() {
        let (_dir, a, b) = pair(b"k");
        let data = vec![vec![9u8; 2048]];
        let m = manifest(2, 0, &data);
        let mut c = Conn::connect(&b.local_addr().to_string(), b"k", Duration::from_secs(5)).unwrap();
        let _: Reply = c.request(&Request::Put { step: 2, rank: 0, manifest: m.clone() }).unwrap();
        let ch = &m.items[0].chunks[0];
        let bad = vec![8u8; ch.len as usize];
        c.send_data(&DataHeader { object: 0, offset: ch.stored_offset, crc32c: ch.crc32c }, &bad).unwrap();
        c.send(Kind::End, &[]).unwrap();
        let e = c.response::<Reply>().unwrap_err();
        assert!(e.message.contains("corrupted"), "{}", e.message);
        assert!(a.committed_steps().unwrap().is_empty());
        a.shutdown();
        b.shutdown();
    }
}
