//! Single-replica and striped restore of replicated items: the ranks of a replica group read
//! each chunk of their shared items from the slow tier once between them and pass it on over
//! the relay (`transport::relay`).
//!
//! - `single`: the group's first rank reads every chunk; each other rank takes it from the
//!   rank before it (a chain: every host sends and receives each byte about once).
//! - `striped`: chunk j is read by rank j mod R, which passes it to the R-1 others: each host
//!   reads 1/R from the tier, so R host links to the bucket add up.
//!
//! Chunks go in windows of `[restore] relay_window` bytes, in the same order on every rank
//! (items by name, chunks in order). A rank keeps what it passes on until taken, and before
//! window w it waits (at most `relay_timeout`) until window w-2 was taken: at most two
//! windows are held per rank beyond the restored data itself. Every chunk is verified against
//! this rank's own manifest on arrival. A rank that cannot get a chunk from the rank meant to
//! send it (gone, too slow, a bad copy) reads it from the tier itself and says so; a rank
//! that stops taking chunks is dropped by its sender when its connection ends, or at the
//! deadline. No wait is without a deadline.

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

/// One chunk's task: its global index, item, chunk index and where it lands.
type Task<'a> = (usize, usize, usize, &'a mut [u8]);

impl StepReader {
    /// Reads every replicated item of this rank's step together with the other members of
    /// `group` (collective: each member calls it for the same step). The items are then
    /// served by `read_items`/`read_range` from memory.
    pub fn broadcast(&self, group: &Group) -> Result<BroadcastStats> {
        let t0 = Instant::now();
        // Checkpoint traffic of this store waits until the group's transfers are done: the
        // relay shares the hosts' links with the peer and object-store tiers.
        let _restoring = crate::scheduler::ReadGuard::restoring(self.store.traffic());
        let relay = self.store.relay()?;
        let relay = &*relay;
        let me = group
            .members
            .iter()
            .position(|m| m.rank == self.rank)
            .ok_or_else(|| Error::invalid(format!("rank {} is not in its own replica group {:?}", self.rank, group.members)))?;
        let r = group.members.len();
        let m = self.manifest();
        let mut items: Vec<usize> = (0..m.items.len()).filter(|&i| m.items[i].replica.is_some() && m.items[i].nbytes > 0).collect();
        items.sort_by(|a, b| m.items[*a].name.cmp(&m.items[*b].name));
        let mut bufs: Vec<Vec<u8>> = items.iter().map(|&i| vec![0u8; m.items[i].nbytes as usize]).collect();
        let mut windows: Vec<Vec<Task>> = vec![vec![]];
        let (mut j, mut in_window) = (0usize, 0u64);
        for (&i, buf) in items.iter().zip(bufs.iter_mut()) {
            let mut rest = &mut buf[..];
            for (c, ch) in m.items[i].chunks.iter().enumerate() {
                let (dst, tail) = rest.split_at_mut(ch.len as usize);
                rest = tail;
                if in_window >= group.window {
                    windows.push(vec![]);
                    in_window = 0;
                }
                windows.last_mut().expect("one").push((j, i, c, dst));
                in_window += ch.len;
                j += 1;
            }
        }
        let others: Vec<u32> = group.members.iter().filter(|x| x.rank != self.rank).map(|x| x.rank).collect();
        // Per chunk j: the member it comes from (None: this rank reads it) and who takes it from here.
        let plan = |j: usize| -> (Option<usize>, Vec<u32>) {
            match group.mode {
                ReplicatedMode::Striped if j % r == me => (None, others.clone()),
                ReplicatedMode::Striped => (Some(j % r), vec![]),
                _ => (me.checked_sub(1), group.members.get(me + 1).map(|x| vec![x.rank]).unwrap_or_default()),
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
        let sources: HashSet<usize> = (0..j.min(r.max(1) * 2)).filter_map(|k| plan(k).0).collect();
        for s in sources {
            let x = &group.members[s];
            if let Err(e) = relay.warm(&x.addr, &x.host) {
                warn(format!(
                    "step {} rank {}: rank {} cannot send replicated chunks ({e}); reading them from the tier",
                    self.step, self.rank, x.rank
                ));
                dead.lock().insert(s);
            }
        }
        let (read, received, fallbacks) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
        let (read_ns, receive_ns) = (AtomicU64::new(0), AtomicU64::new(0));
        let mut dropped = vec![];
        // One chunk: from the rank meant to send it, else (or when that fails) from the tier;
        // then offered to the ranks that take it from here.
        let process = |w: usize, (j, i, c, dst): Task| -> Result<()> {
            let it = &m.items[i];
            let ch = &it.chunks[c];
            let key = ChunkKey { step: self.step, item: it.name.clone(), chunk: c as u32 };
            let (source, takers) = plan(j);
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
                            "step {} rank {}: item '{}' chunk {c} not received from rank {} ({}); read from the tier instead",
                            self.step, self.rank, it.name, x.rank, e.message
                        ));
                        fallbacks.fetch_add(1, Ordering::Relaxed);
                    }
                }
            } else if source.is_some() {
                fallbacks.fetch_add(1, Ordering::Relaxed);
            }
            if !got {
                let t = Instant::now();
                self.read_chunk_anywhere(it, c, dst)?;
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
                dropped.extend(self.drain(relay, Some(w as u64 - 2), group.timeout, &warn));
            }
            // This rank's own reads run on the copy threads, the chunks it receives on
            // threads of their own: a read never waits behind a chunk another rank has yet
            // to read, so the link to the tier stays busy.
            let (mine, theirs): (Vec<Task>, Vec<Task>) = window.into_iter().partition(|t| plan(t.0).0.is_none());
            let queue = Mutex::new(theirs.into_iter());
            let process = &process;
            std::thread::scope(|sc| {
                let fetchers: Vec<_> = (0..FETCHERS)
                    .map(|_| {
                        sc.spawn(|| -> Result<()> {
                            loop {
                                let Some(t) = queue.lock().next() else { return Ok(()) };
                                process(w, t)?;
                            }
                        })
                    })
                    .collect();
                let mut res = self.store.copy_pool.install(|| mine.into_par_iter().try_for_each(|t| process(w, t)));
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
        dropped.extend(self.drain(relay, None, group.timeout, &warn));
        let mut pre = self.prefetched.lock();
        for (i, buf) in items.into_iter().zip(bufs) {
            pre.insert(i, buf);
        }
        let warnings = warnings.into_inner();
        self.warnings.lock().extend(warnings.iter().cloned());
        Ok(BroadcastStats {
            mode: group.mode.name(),
            items: pre.len(),
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

    fn drain(&self, relay: &Relay, window: Option<u64>, timeout: Duration, warn: &dyn Fn(String)) -> Vec<u32> {
        let late = relay.drain(window, timeout);
        if !late.is_empty() {
            warn(format!(
                "step {} rank {}: rank(s) {late:?} took no replicated chunks for {} s; dropped (they read from the tier)",
                self.step,
                self.rank,
                timeout.as_secs_f64()
            ));
        }
        late
    }
}

/// The prefetched items of a reader, by item index (filled by `broadcast`).
pub(super) type Prefetched = Mutex<HashMap<usize, Vec<u8>>>;

impl super::Store {
    /// This process's relay, started on first use on `listen` ("ip:port"); `job`, `host`
    /// and `secret` are what the group agreed on. Returns its address.
    pub fn start_relay(&self, listen: &str, job: &str, host: &str, secret: Vec<u8>) -> Result<std::net::SocketAddr> {
        let mut r = self.relay.lock();
        if let Some(relay) = r.as_ref() {
            return Ok(relay.local_addr());
        }
        let me = crate::transport::Ident { job: job.into(), host: host.into(), rank: self.rank };
        let relay = Relay::start(listen, me, secret, self.policy.replicated.timeout)?;
        let addr = relay.local_addr();
        *r = Some(relay);
        Ok(addr)
    }

    pub fn relay(&self) -> Result<std::sync::Arc<Relay>> {
        self.relay.lock().clone().ok_or_else(|| Error::invalid("the relay was not started (start_relay)"))
    }
}
