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
//! - one listing of the area, one of the step directories when a manifest may be gone, one
//!   batched delete: O(1) requests per rank and step.
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
    /// The steps whose manifest the rank has here, as last seen: None until this process
    /// listed the area (then a save of a step not in it needs no uncommit: nothing can be
    /// there).
    pub manifests: Option<BTreeSet<u64>>,
    /// The object keys each manifest of the area refers to, by step, where known (this
    /// process wrote or read it).
    pub refs: BTreeMap<u64, BTreeSet<String>>,
    /// Steps known to stand committed (seen so in a listing): with `keep` unset they stay.
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

    /// A write ended: `written` is its manifest when it succeeded.
    pub fn end(&mut self, id: u64, written: Option<Arc<Manifest>>) {
        self.inflight.remove(&id);
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

/// What one sweep removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    /// Steps whose manifest went.
    pub manifests: Vec<u64>,
    /// Data objects (keys) that went.
    pub objects: Vec<String>,
}

/// The committed steps of the tier, from one listing of its root: a step's directory holds
/// its commit record (version 3: nothing else); where listing costs nothing (a filesystem)
/// the record itself is looked at, so a directory a commit is being written into does not
/// count yet.
pub fn committed_steps(blobs: &dyn Blobs) -> Result<BTreeSet<u64>> {
    let mut out = BTreeSet::new();
    for n in blobs.list("")? {
        let Some(s) = format::parse_step_dir(&n) else { continue };
        if !blobs.lists_cheaply() || blobs.exists(&format!("{n}/{}", format::COMMIT_NAME))? {
            out.insert(s);
        }
    }
    Ok(out)
}

/// Sweeps rank `rank`'s area (see the module's invariants). `keep` is the tier's retention:
/// with it, the step directories are listed only when the area holds more manifests than
/// `keep` + 1 (or one this process does not know stands committed); `read` reads a manifest
/// of the area this process did not write.
pub fn sweep(
    blobs: &dyn Blobs,
    area: &parking_lot::Mutex<RankArea>,
    rank: u32,
    keep: Option<usize>,
    read: &dyn Fn(u64) -> Result<Manifest>,
) -> Result<Swept> {
    let dir = format::rank_area(rank);
    let mut manifests = BTreeSet::new();
    let mut data = vec![];
    for n in blobs.list(&dir)? {
        match format::parse_area_name(&n) {
            Some(AreaEntry::Manifest(s)) => {
                manifests.insert(s);
            }
            Some(AreaEntry::Data(_)) => data.push(format!("{dir}/{n}")),
            None => {}
        }
    }
    let (last_step, unknown) = {
        let mut a = area.lock();
        // What the listing shows, and the manifests written since (their references are known).
        a.manifests = Some(manifests.iter().copied().chain(a.refs.keys().copied()).collect());
        let last = a.last.as_ref().map(|m| m.step);
        let unknown = manifests.iter().any(|s| !a.confirmed.contains(s) && Some(*s) != last);
        (last, unknown)
    };
    // Which manifests are gone: only a listing of the step directories tells. Not needed
    // while every manifest but the last is known to stand committed and no more of them
    // are here than retention keeps.
    let crowded = keep.is_some_and(|k| manifests.len() > k + 1);
    let mut gone = BTreeSet::new();
    if crowded || unknown {
        let committed = committed_steps(blobs)?;
        let newest = committed.last().copied();
        let mut a = area.lock();
        let busy: BTreeSet<u64> = a.inflight.values().map(|(s, _)| *s).collect();
        for &t in &manifests {
            if !committed.contains(&t) && newest.is_some_and(|n| t < n) && Some(t) != last_step && !busy.contains(&t) {
                gone.insert(t);
            }
        }
        a.confirmed = committed.intersection(&manifests).copied().collect();
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
        objects = data.into_iter().filter(|k| !referenced.contains(k) && !pinned.contains(k)).collect();
    }
    names.extend(objects.iter().cloned());
    if !names.is_empty() {
        crate::failpoint::hit("sweep");
        blobs.delete_names(&names)?;
    }
    let mut a = area.lock();
    for t in &gone {
        a.refs.remove(t);
        if let Some(set) = &mut a.manifests {
            set.remove(t);
        }
    }
    Ok(Swept { manifests: gone.into_iter().collect(), objects })
}
