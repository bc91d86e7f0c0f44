//! Single-replica and striped restore of shared items: the ranks that restore the same bytes
//! read each chunk of them from the slow tier once between them and pass it on over the relay
//! (`transport::relay`). Shared items are the replicated puts of a replica group (every
//! member holds the same item: `StepReader::broadcast`), or shards that several processes
//! restore from one saved rank's manifest (a JAX job's data-parallel replicas:
//! `Store::broadcast_items`, each item with the members that read it).
//!
//! - `single`: an item's first member reads every chunk; each other member takes it from the
//!   member before it (a chain: every host sends and receives each byte about once).
//! - `striped`: chunk c of the item at position p is read by its member (p + c) mod R, which
//!   passes it to the R-1 others: each host reads 1/R from the tier, so R host links to the
//!   bucket add up.
//!
//! Chunks go in windows of `[restore] relay_window` bytes, in the same order on every rank
//! (items by their agreed position, chunks in order). A rank keeps what it passes on until
//! taken, and before window w it waits (at most `relay_timeout`) until window w-2 was taken:
//! at most two windows are held per rank beyond the restored data itself. Every chunk is
//! verified against this rank's own manifest on arrival. A rank that cannot get a chunk from
//! the rank meant to send it (gone, too slow, a bad copy) reads it from the tier itself and
//! says so; a rank that stops taking chunks is dropped by its sender when its connection
//! ends, or at the deadline. No wait is without a deadline.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rayon::prelude::*;

use super::StepReader;
use crate::error::{Error, ErrorKind, Result};
use crate::policy::ReplicatedMode;
use crate::transport::relay::{ChunkKey, Relay};

/// One rank of the replica group: where its relay listens, on which host.
#[derive(Debug, Clone)]
pub struct Member {
    pub rank: u32,
    pub host: String,
    pub addr: String,
}

/// The ranks restoring the same replicated items together (this rank among them), and how.
pub struct Group {
    pub members: Vec<Member>,
    /// `Single` or `Striped` (the caller resolves `Auto`; `All` needs no group).
    pub mode: ReplicatedMode,
    pub window: u64,
    pub timeout: Duration,
}

/// What one rank's broadcast did.
#[derive(Debug, Clone, Default)]
pub struct BroadcastStats {
    pub mode: &'static str,
    pub items: usize,
    /// Raw bytes this rank read from the tiers itself.
    pub bytes_read: u64,
    /// Raw bytes this rank received from other ranks.
    pub bytes_received: u64,
    /// Raw bytes this rank's relay sent to other ranks during this restore.
    pub bytes_sent: u64,
    /// Seconds spent in reads from the tier and in receiving from other ranks, summed over the
    /// threads: bytes over these are per-stream rates, comparable with each other (`auto`).
    pub read_seconds: f64,
    pub receive_seconds: f64,
    /// Chunks read from the tier because the rank meant to send them could not.
    pub fallbacks: u64,
    /// Ranks dropped because they did not take their chunks in time.
    pub dropped: Vec<u32>,
    pub warnings: Vec<String>,
    pub seconds: f64,
}

/// Chunks a rank receives at once (each request waits for its sender to have the chunk).
const FETCHERS: usize = 4;

/// One item that members of a group read together.
pub struct SharedItem<'a> {
    /// The reader of the manifest the item is in, and its index there.
    pub reader: &'a StepReader,
    pub item: usize,
    /// The rank whose copy it is, the same on every member: the replica group's primary for a
    /// replicated put; the rank that saved it for a shard that several processes restore.
    pub owner: u32,
    /// Its place in the list of shared items every member agrees on: windows follow it, and
    /// striped reads of its chunks rotate from it.
    pub position: usize,
    /// The members that read it (indices into `Group::members`, sorted; this rank among them).
    pub members: Vec<usize>,
}

/// The prefetched items of a reader, by item index (filled by `broadcast_items`).
pub(super) type Prefetched = Mutex<HashMap<usize, Vec<u8>>>;

/// One chunk's task: its window, item (index into the shared items), chunk index and where it lands.
type Task<'a> = (usize, usize, usize, &'a mut [u8]);

impl StepReader {
    /// Reads every replicated item of this rank's step together with the other members of
    /// `group` (collective: each member calls it for the same step). The items are then
    /// served by `read_items`/`read_range` from memory.
    pub fn broadcast(&self, group: &Group) -> Result<BroadcastStats> {
        let m = self.manifest();
        let all: Vec<usize> = (0..group.members.len()).collect();
        let mut items: Vec<(u32, usize)> = m
            .items
            .iter()
            .enumerate()
            .filter(|(_, it)| it.nbytes > 0)
            .filter_map(|(i, it)| Some((it.replica.as_ref().filter(|r| !r.matched)?.primary, i)))
            .collect();
        items.sort_by(|a, b| m.items[a.1].name.cmp(&m.items[b.1].name));
        let items = items
            .into_iter()
            .enumerate()
            .map(|(position, (owner, item))| SharedItem { reader: self, item, owner, position, members: all.clone() })
            .collect();
        self.store.broadcast_items(items, group)
    }
}

impl super::Store {
    /// Reads `items` together with the other members of `group` (collective: each member calls
    /// it for the same step, with the items it takes part in, in any order), each chunk from
    /// the tiers by one member only. Each item is then served from memory by its reader.
    pub fn broadcast_items(&self, mut items: Vec<SharedItem>, group: &Group) -> Result<BroadcastStats> {
        let t0 = Instant::now();
        // Checkpoint traffic of this store waits until the group's transfers are done: the
        // relay shares the hosts' links with the peer and object-store tiers.
        let _restoring = crate::scheduler::ReadGuard::restoring(self.traffic());
        let relay = self.relay()?;
        let relay = &*relay;
        let me = group
            .members
            .iter()
            .position(|m| m.rank == self.rank)
            .ok_or_else(|| Error::invalid(format!("rank {} is not in its own replica group {:?}", self.rank, group.members)))?;
        if let Some(x) = items.iter().find(|x| !x.members.contains(&me) || x.members.iter().any(|&k| k >= group.members.len())) {
            return Err(Error::invalid(format!(
                "rank {}: shared item {} of rank {} names members {:?} of a group of {}, without this rank",
                self.rank,
                x.item,
                x.owner,
                x.members,
                group.members.len()
            )));
        }
        items.sort_by_key(|x| x.position);
        let step = items.first().map(|x| x.reader.step).unwrap_or_default();
        let meta = |k: usize| &items[k].reader.manifest().items[items[k].item];
        let mut bufs: Vec<Vec<u8>> = (0..items.len()).map(|k| vec![0u8; meta(k).nbytes as usize]).collect();
        let mut windows: Vec<Vec<Task>> = vec![vec![]];
        let mut in_window = 0u64;
        for (k, buf) in bufs.iter_mut().enumerate() {
            let mut rest = &mut buf[..];
            for (c, ch) in meta(k).chunks.iter().enumerate() {
                let (dst, tail) = rest.split_at_mut(ch.len as usize);
                rest = tail;
                if in_window >= group.window {
                    windows.push(vec![]);
                    in_window = 0;
                }
                let w = windows.len() - 1;
                windows[w].push((w, k, c, dst));
                in_window += ch.len;
            }
        }
        // Per chunk c of shared item k: the member it comes from (None: this rank reads it)
        // and the ranks that take it from here.
        let plan = |k: usize, c: usize| -> (Option<usize>, Vec<u32>) {
            let ms = &items[k].members;
            let pos = ms.iter().position(|&x| x == me).expect("checked above");
            let rank_of = |i: usize| group.members[ms[i]].rank;
            match group.mode {
                ReplicatedMode::Striped => match (items[k].position + c) % ms.len() {
                    r if r == pos => (None, (0..ms.len()).filter(|&i| i != pos).map(rank_of).collect()),
                    r => (Some(ms[r]), vec![]),
                },
                _ => (pos.checked_sub(1).map(|i| ms[i]), ms.get(pos + 1).map(|_| vec![rank_of(pos + 1)]).unwrap_or_default()),
            }
        };
        relay.reset();
        let served0 = relay.served.load(Ordering::Relaxed);
        let dead: Mutex<HashSet<usize>> = Mutex::new(HashSet::new());
        let warnings: Mutex<Vec<String>> = Mutex::new(vec![]);
        let warn = |w: String| {
            log::warn!("{w}");
            warnings.lock().push(w);
        };
        let first: Vec<(usize, usize)> = windows.iter().flatten().take(2 * group.members.len()).map(|t| (t.1, t.2)).collect();
        let sources: HashSet<usize> = first.into_iter().filter_map(|(k, c)| plan(k, c).0).collect();
        for s in sources {
            let x = &group.members[s];
            if let Err(e) = relay.warm(&x.addr, &x.host) {
                warn(format!(
                    "step {step} rank {}: rank {} cannot send shared chunks ({e}); reading them from the tier",
                    self.rank, x.rank
                ));
                dead.lock().insert(s);
            }
        }
        let (read, received, fallbacks) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
        let (read_ns, receive_ns) = (AtomicU64::new(0), AtomicU64::new(0));
        let mut dropped = vec![];
        // One chunk: from the rank meant to send it, else (or when that fails) from the tier;
        // then offered to the ranks that take it from here.
        let process = |(w, k, c, dst): Task| -> Result<()> {
            let it = meta(k);
            let ch = &it.chunks[c];
            let key = ChunkKey { step, owner: items[k].owner, item: it.name.clone(), chunk: c as u32 };
            let (source, takers) = plan(k, c);
            let mut got = false;
            if let Some(s) = source.filter(|s| !dead.lock().contains(s)) {
                let x = &group.members[s];
                let t = Instant::now();
                match relay.fetch(&x.addr, &x.host, &key, ch.crc32c, dst) {
                    Ok(()) => {
                        receive_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        crate::failpoint::hit("relay_recv");
                        received.fetch_add(ch.len, Ordering::Relaxed);
                        got = true;
                    }
                    Err(e) => {
                        // A bad copy on the wire: read that chunk from the tier. A sender
                        // gone or stalled: read the rest of its chunks too.
                        if e.kind != ErrorKind::Integrity {
                            dead.lock().insert(s);
                        }
                        warn(format!(
                            "step {step} rank {}: item '{}' chunk {c} not received from rank {} ({}); read from the tier instead",
                            self.rank, it.name, x.rank, e.message
                        ));
                        fallbacks.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else if source.is_some() {
                fallbacks.fetch_add(1, Ordering::Relaxed);
            }
            if !got {
                let t = Instant::now();
                items[k].reader.read_chunk_anywhere(it, c, dst)?;
                read_ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                read.fetch_add(ch.len, Ordering::Relaxed);
            }
            if !takers.is_empty() {
                relay.offer(key, dst, ch.crc32c, &takers, w as u64);
            }
            Ok(())
        };
        for (w, window) in windows.into_iter().enumerate() {
            if w >= 2 {
                dropped.extend(self.drain_relay(relay, Some(w as u64 - 2), group.timeout, step, &warn));
            }
            // This rank's own reads run on the copy threads, the chunks it receives on
            // threads of their own: a read never waits behind a chunk another rank has yet
            // to read, so the link to the tier stays busy.
            let (mine, theirs): (Vec<Task>, Vec<Task>) = window.into_iter().partition(|t| plan(t.1, t.2).0.is_none());
            let queue = Mutex::new(theirs.into_iter());
            let process = &process;
            std::thread::scope(|sc| {
                let fetchers: Vec<_> = (0..FETCHERS)
                    .map(|_| {
                        sc.spawn(|| -> Result<()> {
                            loop {
                                let Some(t) = queue.lock().next() else { return Ok(()) };
                                process(t)?;
                            }
                        })
                    })
                    .collect();
                let mut res = self.copy_pool.install(|| mine.into_par_iter().try_for_each(process));
                for f in fetchers {
                    let r = f.join().unwrap_or_else(|_| Err(Error::invalid("a relay fetch thread panicked")));
                    if res.is_ok() {
                        res = r;
                    }
                }
                res
            })?;
        }
        // The last windows: wait until the others took them (or went).
        dropped.extend(self.drain_relay(relay, None, group.timeout, step, &warn));
        let n = items.len();
        for (x, buf) in items.iter().zip(bufs) {
            x.reader.prefetched.lock().insert(x.item, buf);
        }
        let warnings = warnings.into_inner();
        // Each reader's restore info shows what happened, once.
        let mut seen: Vec<*const StepReader> = vec![];
        for x in &items {
            if !seen.contains(&(x.reader as *const _)) {
                seen.push(x.reader);
                x.reader.warnings.lock().extend(warnings.iter().cloned());
            }
        }
        Ok(BroadcastStats {
            mode: group.mode.name(),
            items: n,
            bytes_read: read.into_inner(),
            bytes_received: received.into_inner(),
            bytes_sent: relay.served.load(Ordering::Relaxed) - served0,
            read_seconds: read_ns.into_inner() as f64 / 1e9,
            receive_seconds: receive_ns.into_inner() as f64 / 1e9,
            fallbacks: fallbacks.into_inner(),
            dropped,
            warnings,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    fn drain_relay(&self, relay: &Relay, window: Option<u64>, timeout: Duration, step: u64, warn: &dyn Fn(String)) -> Vec<u32> {
        let late = relay.drain(window, timeout);
        if !late.is_empty() {
            warn(format!(
                "step {step} rank {}: rank(s) {late:?} took no shared chunks for {} s; dropped (they read from the tier)",
                self.rank,
                timeout.as_secs_f64()
            ));
        }
        late
    }

    /// This process's relay, started on first use on `listen` ("ip:port"); `job`, `host`
    /// and `secret` are what the group agreed on. Returns its address.
    pub fn start_relay(&self, listen: &str, job: &str, host: &str, secret: Vec<u8>) -> Result<std::net::SocketAddr> {
        let mut r = self.relay.lock();
        if let Some(relay) = r.as_ref() {
            return Ok(relay.local_addr());
        }
        let me = crate::transport::Ident { job: job.into(), host: host.into(), rank: self.rank };
        // Chunks between hosts go over the cluster tier's network: under its link and limit.
        let link = match self.cluster() {
            Some(c) => c.link().clone(),
            None => crate::scheduler::Link::with_traffic("relay", None, crate::scheduler::LinkKind::Network, self.traffic().clone()),
        };
        let relay = Relay::start(listen, me, secret, self.policy.replicated.timeout, link)?;
        let addr = relay.local_addr();
        *r = Some(relay);
        Ok(addr)
    }

    pub fn relay(&self) -> Result<std::sync::Arc<Relay>> {
        self.relay.lock().clone().ok_or_else(|| Error::invalid("the relay was not started (start_relay)"))
    }
}
