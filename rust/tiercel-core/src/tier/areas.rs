//! What a blob tier's writer knows of its rank areas (version 3, docs/format.md "Rank
//! areas"), and the two things it does with that: cross-step chunk references (dedup: a
//! chunk whose bytes the rank's last manifest here already stores is referred to, not
//! written again) and the rank's sweep of its own area after each persist (manifests of
//! steps that are gone, data objects no remaining manifest refers to).
//!
//! The sweep's invariants (`tests` below holds it to them):
//! - a manifest goes only when its step is gone: not committed while a newer step is
//!   (retention removed its commit, or it never committed), and never the manifest this
//!   process wrote last for the rank (the next save refers to its chunks);
//! - a data object goes only when no manifest left in the area refers to it (each manifest's
//!   references known from this process's own writes, else read once), and never one that a
//!   write in flight in this process writes or refers to;
//! - no listing on a save's path after the first (a process lists its area once, for what
//!   an earlier process left), a look at one or two commit records, one batched delete:
//!   O(1) requests per rank and step.
//!
//! A killed save leaves a data object without a manifest (or a manifest of a step that never
//! commits): the next sweep of the rank, or `tiercel gc`, removes it. A killed sweep leaves
//! what it had not deleted yet, which the next one finds again.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::blobs::Blobs;
use crate::error::{ErrorKind, Result};
use crate::format::{self, AreaEntry, ChunkMeta, Manifest, ObjectMeta};

/// One rank's area as this process knows it.
#[derive(Default)]
pub(crate) struct RankArea {
    /// The manifest this process wrote last for the rank here, as stored: what the next save
    /// refers to (its dedup source).
    pub last: Option<Arc<Manifest>>,
    /// The steps whose manifest the rank has here: None until this process listed the area
    /// (`learn`, before its first write), then kept up to date by its own writes and sweeps (a save of a step
    /// not in it needs no uncommit: nothing can be there).
    pub manifests: Option<BTreeSet<u64>>,
    /// The data objects (keys) of the area: listed once, then this process's own.
    pub data: BTreeSet<String>,
    /// The object keys each manifest of the area refers to, by step, where known (this
    /// process wrote or read it).
    pub refs: BTreeMap<u64, BTreeSet<String>>,
    /// Steps seen committed (a look at their commit record). A step once committed stays
    /// evidence that every uncommitted step before it is gone.
    pub confirmed: BTreeSet<u64>,
    /// Writes in flight: the keys each writes or refers to, and its step.
    pub inflight: HashMap<u64, (u64, BTreeSet<String>)>,
    next_write: u64,
}

impl RankArea {
    /// Registers a write of `step` that writes or refers to `keys`; returns its id.
    pub fn begin(&mut self, step: u64, keys: BTreeSet<String>) -> u64 {
        self.next_write += 1;
        self.inflight.insert(self.next_write, (step, keys));
        self.next_write
    }

    /// A write ended: `written` is its manifest when it succeeded; `data` the key of the
    /// data object it wrote or began (a failed write may have left it: the next sweep
    /// removes it if no manifest refers to it).
    pub fn end(&mut self, id: u64, data: &str, written: Option<Arc<Manifest>>) {
        self.inflight.remove(&id);
        self.data.insert(data.to_string());
        if let Some(m) = written {
            if let Some(set) = &mut self.manifests {
                set.insert(m.step);
            }
            self.refs.insert(m.step, object_keys(&m));
            self.confirmed.remove(&m.step);
            self.last = Some(m);
        }
    }

    /// Whether the rank may have a manifest of `step` here (and so a commit of it may be).
    pub fn may_hold(&self, step: u64) -> bool {
        self.manifests.as_ref().is_none_or(|s| s.contains(&step))
    }
}

/// The root-relative keys of every object `m` refers to.
pub fn object_keys(m: &Manifest) -> BTreeSet<String> {
    m.objects.iter().map(|o| o.key_in(m.step)).collect()
}

/// Where a chunk's stored bytes already are: the object (with its key) and the chunk's
/// stored place and codec there.
#[derive(Clone)]
pub struct StoredRef {
    pub object: ObjectMeta,
    pub chunk: ChunkMeta,
}

/// The chunks `prev` stores, by (hash, length): what a save may refer to instead of writing.
/// Shared items are left out (their bytes are the primary's, found through its manifest) and
/// so are chunks without a hash (written before hashes existed).
pub fn stored_chunks(prev: &Manifest) -> HashMap<(String, u64), StoredRef> {
    let mut out = HashMap::new();
    for it in prev.items.iter().filter(|i| !i.replica.as_ref().is_some_and(|r| r.shared)) {
        for c in &it.chunks {
            let (Some(h), Some(o)) = (&c.hash, prev.objects.get(c.object as usize)) else { continue };
            // Always the object that holds the bytes (its own key), never a chain of references.
            let object = ObjectMeta { key: Some(o.key_in(prev.step)), ..o.clone() };
            out.entry((h.clone(), c.len)).or_insert_with(|| StoredRef { object, chunk: c.clone() });
        }
    }
    out
}

/// Whether `c` (a chunk about to be saved) has the same bytes as `r`'s: hash, length and
/// CRC32C all equal.
pub fn same_bytes(c: &ChunkMeta, r: &StoredRef) -> bool {
    c.hash.is_some() && c.hash == r.chunk.hash && c.len == r.chunk.len && c.crc32c == r.chunk.crc32c
}

/// Lists rank `rank`'s area once per process (what an earlier process left: its manifests
/// and data objects), before the rank's first write there and, where that failed, at its
/// next sweep; after that the process knows the area from its own writes and sweeps. One
/// LIST of the rank's own prefix, never of a step's: a launch's first save then knows
/// whether the rank has a manifest of the step to take back (`RankArea::may_hold`) instead
/// of every rank sending an uncommit DELETE to the step's one prefix. Two first writes of
/// one rank at once may both list (the later listing is dropped).
pub fn learn(blobs: &dyn Blobs, area: &parking_lot::Mutex<RankArea>, rank: u32) -> Result<()> {
    if area.lock().manifests.is_some() {
        return Ok(());
    }
    let dir = format::rank_area(rank);
    let mut manifests = BTreeSet::new();
    let mut data = BTreeSet::new();
    for n in blobs.list(&dir)? {
        match format::parse_area_name(&n) {
            Some(AreaEntry::Manifest(s)) => {
                manifests.insert(s);
            }
            Some(AreaEntry::Data(_)) => {
                data.insert(format!("{dir}/{n}"));
            }
            None => {}
        }
    }
    let mut a = area.lock();
    if a.manifests.is_some() {
        return Ok(()); // another write listed meanwhile
    }
    // And what writes that ended meanwhile added.
    manifests.extend(a.refs.keys().copied());
    a.manifests = Some(manifests);
    a.data.extend(data);
    Ok(())
}

/// What one sweep removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    /// Steps whose manifest went.
    pub manifests: Vec<u64>,
    /// Data objects (keys) that went.
    pub objects: Vec<String>,
}

/// Sweeps rank `rank`'s area (see the module's invariants). `keep` is the tier's retention;
/// `committed` looks at a step's commit record; `read` reads a manifest of the area this
/// process did not write. The area is listed once per process (`learn`, normally before the
/// rank's first write); after that this process knows what is there, and a sweep looks
/// at the commit records of at most a few steps: the newest step it has not seen committed
/// yet, a step at the edge of `keep`, and (where a step is gone) one committed step newer.
pub fn sweep(
    blobs: &dyn Blobs,
    area: &parking_lot::Mutex<RankArea>,
    rank: u32,
    keep: Option<usize>,
    committed: &dyn Fn(u64) -> Result<bool>,
    read: &dyn Fn(u64) -> Result<Manifest>,
) -> Result<Swept> {
    learn(blobs, area, rank)?;
    let (manifests, last, busy, mut confirmed) = {
        let a = area.lock();
        let busy: BTreeSet<u64> = a.inflight.values().map(|(s, _)| *s).collect();
        (a.manifests.clone().unwrap_or_default(), a.last.as_ref().map(|m| m.step), busy, a.confirmed.clone())
    };
    // Newest first: a step seen committed is the evidence that the uncommitted ones before
    // it are gone.
    let mut checked: BTreeSet<u64> = BTreeSet::new();
    let mut gone = BTreeSet::new();
    for &t in manifests.iter().rev() {
        if Some(t) == last || busy.contains(&t) {
            continue;
        }
        let newer = confirmed.range(t + 1..).count();
        if confirmed.contains(&t) && keep.is_none_or(|k| newer < k) {
            continue; // committed and within keep: stays
        }
        checked.insert(t);
        if committed(t)? {
            confirmed.insert(t);
            continue;
        }
        let mut evidence = confirmed.contains(&t) || newer > 0;
        // Not seen committed, nothing newer seen committed either: look at the newer steps
        // not looked at yet (the last save's above all).
        for &u in manifests.range(t + 1..).rev() {
            if evidence {
                break;
            }
            if checked.insert(u) && committed(u)? {
                confirmed.insert(u);
                evidence = true;
            }
        }
        if evidence {
            gone.insert(t);
        }
    }
    // The references of every manifest that stays.
    let mut referenced: BTreeSet<String> = BTreeSet::new();
    let mut complete = true;
    for &t in manifests.difference(&gone) {
        let known = area.lock().refs.get(&t).cloned();
        let keys = match known {
            Some(k) => k,
            None => match read(t) {
                Ok(m) => {
                    let k = object_keys(&m);
                    area.lock().refs.insert(t, k.clone());
                    k
                }
                Err(e) if e.kind == ErrorKind::NotFound => continue,
                Err(e) => {
                    // Its references unknown: no data object may go this time.
                    log::warn!("rank {rank}'s manifest of step {t}: {e}; its area keeps every data object until it can be read");
                    complete = false;
                    continue;
                }
            },
        };
        referenced.extend(keys);
    }
    let mut names: Vec<String> = gone.iter().map(|&t| format::area_manifest_key(t, rank)).collect();
    let mut objects = vec![];
    if complete {
        let a = area.lock();
        let pinned: BTreeSet<&String> = a
            .inflight
            .values()
            .flat_map(|(_, k)| k.iter())
            .chain(a.last.iter().flat_map(|m| m.objects.iter().filter_map(|o| o.key.as_ref())))
            .collect();
        objects = a.data.iter().filter(|k| !referenced.contains(*k) && !pinned.contains(k)).cloned().collect();
    }
    names.extend(objects.iter().cloned());
    if !names.is_empty() {
        crate::failpoint::hit("sweep");
        blobs.delete_names(&names)?;
    }
    let mut a = area.lock();
    a.confirmed.extend(confirmed);
    for t in &gone {
        a.refs.remove(t);
        a.confirmed.remove(t);
        if let Some(set) = &mut a.manifests {
            set.remove(t);
        }
    }
    for k in &objects {
        a.data.remove(k);
    }
    Ok(Swept { manifests: gone.into_iter().collect(), objects })
}
