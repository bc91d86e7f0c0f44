//! The suite every tier kind passes. It goes through the `Tier` trait and
//! `tier::read_chunk` only. To damage stored bytes it rewrites objects of the subject's
//! storage in place when `describe(key)` is a local file (so a memory tier's mapped segment
//! keeps its inode, as real bit rot would), and through `put` otherwise (object stores).

use std::path::Path;
use std::sync::Arc;

use super::subjects::TierSubject;
use super::{always, floats, noise, Case, Rules};
use crate::blobs::Blobs;
use crate::error::{Error, ErrorKind, Result};
use crate::format::ChunkSource;
use crate::format::{self, ChunkMeta, ItemMeta, Manifest, ObjectMeta};
use crate::gc::{self, GcOptions};
use crate::scheduler::Link;
use crate::tier::{read_chunk, Tier};

// ---------------------------------------------------------------------------------------------
// Test data: one rank's manifest over in-memory items
// ---------------------------------------------------------------------------------------------

const CHUNK: u64 = 4096;

fn link() -> Arc<Link> {
    Link::new("t", None)
}

/// (name, dtype, bytes) of one rank's items: empty, one byte, exactly one chunk, one chunk
/// plus one byte, several chunks with a short tail; float32 and uint8.
fn items(seed: u64) -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let c = CHUNK as usize;
    vec![
        ("empty", "uint8", vec![]),
        ("one", "uint8", vec![0xA5 ^ seed as u8]),
        ("exact", "float32", floats(c / 4, seed)),
        ("exact_plus_one", "uint8", noise(c + 1, seed + 1)),
        ("model/several", "float32", floats((5 * c + 100) / 4, seed + 2)),
        ("optim/noise", "uint8", noise(3 * c + 7, seed + 3)),
    ]
}

/// The index of the multi-chunk float item that the damage tests aim at.
pub const TARGET: &str = "model/several";

struct VecSource {
    data: Vec<Vec<u8>>,
    chunk_size: u64,
}

impl ChunkSource for VecSource {
    fn read_raw(&self, item: usize, chunk: usize, dst: &mut [u8]) -> Result<()> {
        let off = chunk * self.chunk_size as usize;
        dst.copy_from_slice(&self.data[item][off..off + dst.len()]);
        Ok(())
    }
}

/// A source that fails partway, like a device that goes away during a copy.
struct FailingSource(VecSource);

impl ChunkSource for FailingSource {
    fn read_raw(&self, item: usize, chunk: usize, dst: &mut [u8]) -> Result<()> {
        if item == 4 && chunk == 2 {
            return Err(Error::unavailable("source went away"));
        }
        self.0.read_raw(item, chunk, dst)
    }
}

/// A rank's manifest and its source, laid out as a save lays it out in the memory tier (one
/// part, items 64-byte aligned, raw chunks): a tier lays out its own copy (the peer tier
/// keeps this one).
fn logical(step: u64, rank: u32, world_size: u32) -> (Manifest, VecSource) {
    let mut m = Manifest::new(step, rank, world_size, "logical", CHUNK);
    let mut pos = 0u64;
    m.trees.push(("state".into(), serde_json::json!({"model": {"w": "@item:model/several"}, "step": step})));
    let mut data = vec![];
    for (name, dtype, bytes) in items(step * 31 + rank as u64) {
        let size = if dtype == "float32" { 4 } else { 1 };
        pos = format::align_up(pos, format::ITEM_ALIGN);
        let chunks = format::chunk_ranges(bytes.len() as u64, CHUNK)
            .map(|(off, len)| ChunkMeta {
                offset: off,
                len,
                crc32c: crate::checksum::crc32c(&bytes[off as usize..(off + len) as usize]),
                object: 0,
                stored_offset: pos + off,
                stored_len: len,
                codec: "raw".into(),
                hash: None,
            })
            .collect();
        m.items.push(ItemMeta {
            name: name.into(),
            kind: "array".into(),
            dtype: dtype.into(),
            shape: vec![bytes.len() as u64 / size],
            nbytes: bytes.len() as u64,
            meta: serde_json::json!({"framework": "test"}),
            // Every item is the second of two shards of a global array, on replica 1.
            shard: Some(format::ShardInfo {
                global_shape: vec![2 * (bytes.len() as u64 / size)],
                offsets: vec![bytes.len() as u64 / size],
                replica_id: 1,
            }),
            replica: None,
            chunks,
        });
        pos += bytes.len() as u64;
        data.push(bytes);
    }
    m.objects = vec![ObjectMeta { name: format::part_name(rank, 0), len: pos, key: None }];
    (m, VecSource { data, chunk_size: CHUNK })
}

fn write(tier: &dyn Tier, step: u64, rank: u32, world_size: u32) -> Manifest {
    let (m, src) = logical(step, rank, world_size);
    tier.write_rank(&m, &src, &link()).unwrap_or_else(|e| panic!("tier '{}': write_rank step {step} rank {rank}: {e}", tier.name()))
}

fn write_committed(tier: &dyn Tier, step: u64) -> Manifest {
    let m = write(tier, step, 0, 1);
    assert!(tier.try_commit(step, 1).unwrap(), "tier '{}': step {step} did not commit", tier.name());
    m
}

/// Where rank `rank`'s manifest of `step` is stored: its rank area (blob tiers, version 3),
/// else the step's directory.
fn manifest_key(storage: &dyn Blobs, step: u64, rank: u32) -> String {
    let area = format::area_manifest_key(step, rank);
    if storage.exists(&area).unwrap() {
        return area;
    }
    format!("{}/{}", format::step_dir(step), format::manifest_name(rank))
}

fn object_key(m: &Manifest, object: u32) -> String {
    m.objects[object as usize].key_in(m.step)
}

/// Rewrites a stored object with `f` applied: in place when it is a local file.
fn damage(storage: &dyn Blobs, key: &str, f: impl FnOnce(&mut Vec<u8>)) {
    let mut bytes = storage.get(key).unwrap();
    f(&mut bytes);
    let place = storage.describe(key);
    let path = Path::new(&place);
    if path.is_file() {
        std::fs::write(path, &bytes).unwrap();
    } else {
        storage.put(key, &bytes).unwrap();
    }
}

fn read_item(tier: &dyn Tier, m: &Manifest, item: usize) -> Result<Vec<u8>> {
    let it = &m.items[item];
    let mut out = vec![0u8; it.nbytes as usize];
    for (c, ch) in it.chunks.iter().enumerate() {
        read_chunk(tier, m, item, c, &mut out[ch.offset as usize..(ch.offset + ch.len) as usize])?;
    }
    Ok(out)
}

fn assert_names(e: &Error, tier: &dyn Tier, step: u64, rank: u32, item: &str, chunk: usize) {
    for want in [
        format!("tier '{}'", tier.name()),
        format!("step {step}"),
        format!("rank {rank}"),
        format!("item '{item}'"),
        format!("chunk {chunk}"),
    ] {
        assert!(e.message.contains(&want), "message lacks {want:?}: {}", e.message);
    }
}

// ---------------------------------------------------------------------------------------------
// The suite
// ---------------------------------------------------------------------------------------------

fn write_and_read_back(subject: &TierSubject) {
    let (tier, storage) = (&*subject.tier, &*subject.storage);
    let (lm, src) = logical(1, 0, 1);
    let written = tier.write_rank(&lm, &src, &link()).unwrap();
    let m = tier.read_manifest(1, 0).unwrap();
    assert_eq!(m, written, "read_manifest differs from what write_rank returned");
    assert_eq!(m.tier, tier.name());
    assert_eq!((m.step, m.rank, m.world_size, m.chunk_size), (1, 0, 1, CHUNK));
    assert_eq!(m.trees, lm.trees);
    assert!(!m.objects.is_empty());
    for obj in &m.objects {
        let key = obj.key_in(1);
        assert_eq!(storage.get(&key).unwrap().len() as u64, obj.len, "object {key} length");
    }
    assert_eq!(m.items.len(), lm.items.len());
    for (i, (got, want)) in m.items.iter().zip(&lm.items).enumerate() {
        assert_eq!(
            (&got.name, &got.kind, &got.dtype, &got.shape, got.nbytes, &got.meta, &got.shard),
            (&want.name, &want.kind, &want.dtype, &want.shape, want.nbytes, &want.meta, &want.shard)
        );
        assert_eq!(got.chunks.len(), want.chunks.len(), "item {}", got.name);
        for (c, (g, w)) in got.chunks.iter().zip(&want.chunks).enumerate() {
            assert_eq!((g.offset, g.len, g.crc32c), (w.offset, w.len, w.crc32c), "item {} chunk {c}", got.name);
            let mut dst = vec![0u8; g.len as usize];
            read_chunk(tier, &m, i, c, &mut dst).unwrap();
            assert!(dst == src.data[i][g.offset as usize..(g.offset + g.len) as usize], "item {} chunk {c}", got.name);
        }
        assert!(read_item(tier, &m, i).unwrap() == src.data[i], "item {}", got.name);
    }
    let sizes: Vec<usize> = lm.items.iter().map(|it| it.chunks.len()).collect();
    assert_eq!(sizes, vec![0, 1, 1, 2, 6, 4], "the test data covers the chunking edge cases");
}

fn invisible_until_committed(subject: &TierSubject) {
    let tier = &*subject.tier;
    write(tier, 1, 0, 2);
    assert_eq!(tier.committed_steps().unwrap(), Vec::<u64>::new());
    assert_eq!(tier.all_steps().unwrap(), vec![1]);
    assert_eq!(tier.ranks_written(1).unwrap(), vec![0]);
    assert!(!tier.try_commit(1, 2).unwrap(), "committed with one of two ranks");
    assert_eq!(tier.committed_steps().unwrap(), Vec::<u64>::new());
    assert_eq!(tier.commit_record(1).unwrap_err().kind, ErrorKind::NotFound);
    write(tier, 1, 1, 2);
    assert_eq!(tier.ranks_written(1).unwrap(), vec![0, 1]);
    assert_eq!(tier.committed_steps().unwrap(), Vec::<u64>::new(), "visible before try_commit");
    assert!(tier.try_commit(1, 2).unwrap());
    assert_eq!(tier.committed_steps().unwrap(), vec![1]);
    let rec = tier.commit_record(1).unwrap();
    assert_eq!((rec.step, rec.world_size, rec.tier.as_str()), (1, 2, tier.name()));
    // Idempotent: a second call (the other rank finishing) keeps the first record.
    assert!(tier.try_commit(1, 2).unwrap());
    assert_eq!(tier.commit_record(1).unwrap(), rec);
    assert_eq!(tier.committed_steps().unwrap(), vec![1]);
    for rank in 0..2 {
        let m = tier.read_manifest(1, rank).unwrap();
        assert_eq!((m.rank, m.world_size), (rank, 2));
    }
}

fn flipped_byte_is_integrity_error(subject: &TierSubject) {
    let (tier, storage) = (&*subject.tier, &*subject.storage);
    let m = write_committed(tier, 1);
    let item = m.item_index(TARGET).unwrap();
    let c = &m.items[item].chunks[1];
    let key = object_key(&m, c.object);
    let at = (c.stored_offset + c.stored_len / 2) as usize;
    damage(storage, &key, |b| b[at] ^= 0x10);
    let mut dst = vec![0u8; c.len as usize];
    let e = read_chunk(tier, &m, item, 1, &mut dst).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Integrity, "{}", e.message);
    assert_names(&e, tier, 1, 0, TARGET, 1);
    // The neighbours are intact and still read.
    let mut ok = vec![0u8; m.items[item].chunks[0].len as usize];
    read_chunk(tier, &m, item, 0, &mut ok).unwrap();
    read_chunk(tier, &m, item, 2, &mut ok).unwrap();
}

fn truncated_data_is_a_clear_error(subject: &TierSubject) {
    let (tier, storage) = (&*subject.tier, &*subject.storage);
    let m = write_committed(tier, 1);
    let item = m.item_index(TARGET).unwrap();
    let last = m.items[item].chunks.len() - 1;
    let c = &m.items[item].chunks[last];
    let key = object_key(&m, c.object);
    let cut = (c.stored_offset + c.stored_len / 2) as usize;
    damage(storage, &key, |b| b.truncate(cut));
    let mut dst = vec![0u8; c.len as usize];
    let e = read_chunk(tier, &m, item, last, &mut dst).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Integrity, "{}", e.message);
    assert_names(&e, tier, 1, 0, TARGET, last);
    // Chunks before the cut still read.
    read_item(tier, &m, m.item_index("exact").unwrap()).unwrap();
}

fn missing_data_is_a_clear_error(subject: &TierSubject) {
    let (tier, storage) = (&*subject.tier, &*subject.storage);
    let m = write_committed(tier, 1);
    let item = m.item_index(TARGET).unwrap();
    storage.delete(&object_key(&m, m.items[item].chunks[0].object)).unwrap();
    let mut dst = vec![0u8; m.items[item].chunks[0].len as usize];
    let e = read_chunk(tier, &m, item, 0, &mut dst).unwrap_err();
    assert_names(&e, tier, 1, 0, TARGET, 0);
    assert!(e.message.contains(&m.objects[0].name), "message lacks the object: {}", e.message);
}

fn corrupt_manifest_is_integrity_error(subject: &TierSubject) {
    let (tier, storage) = (&*subject.tier, &*subject.storage);
    write_committed(tier, 1);
    let key = manifest_key(storage, 1, 0);
    damage(storage, &key, |b| {
        let n = b.len() / 2;
        b.truncate(n);
        b.extend_from_slice(b"#garbage");
    });
    let e = tier.read_manifest(1, 0).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Integrity, "{}", e.message);
    let place = storage.describe(&key);
    assert!(e.message.contains(&place), "message lacks {place:?}: {}", e.message);

    // Well-formed JSON under the wrong name (a manifest copied by hand) is caught too.
    write_committed(tier, 2);
    let good = storage.get(&manifest_key(storage, 2, 0)).unwrap();
    storage.put(&key, &good).unwrap();
    let e = tier.read_manifest(1, 0).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Integrity, "{}", e.message);
    assert!(e.message.contains("step 2") && e.message.contains(&place), "{}", e.message);

    // A rank that never wrote is NotFound, not Integrity.
    assert_eq!(tier.read_manifest(1, 1).unwrap_err().kind, ErrorKind::NotFound);
}

fn delete_step_removes_it(subject: &TierSubject) {
    let (tier, storage) = (&*subject.tier, &*subject.storage);
    write_committed(tier, 1);
    write_committed(tier, 2);
    tier.delete_step(1).unwrap();
    assert_eq!(tier.committed_steps().unwrap(), vec![2]);
    assert_eq!(tier.all_steps().unwrap(), vec![2]);
    assert_eq!(tier.commit_record(1).unwrap_err().kind, ErrorKind::NotFound);
    assert_eq!(tier.read_manifest(1, 0).unwrap_err().kind, ErrorKind::NotFound);
    assert!(storage.list(&format::step_dir(1)).unwrap().is_empty());
    // Step 2 is untouched; deleting twice or deleting what never was is no error.
    let m = tier.read_manifest(2, 0).unwrap();
    read_item(tier, &m, m.item_index(TARGET).unwrap()).unwrap();
    tier.delete_step(1).unwrap();
    tier.delete_step(99).unwrap();
    // An uncommitted step is deleted as well.
    write(tier, 3, 0, 2);
    tier.delete_step(3).unwrap();
    assert_eq!(tier.all_steps().unwrap(), vec![2]);
}

fn steps_are_in_numeric_order(subject: &TierSubject) {
    let tier = &*subject.tier;
    for step in [100, 2, 10, 1] {
        write_committed(tier, step);
    }
    assert_eq!(tier.committed_steps().unwrap(), vec![1, 2, 10, 100]);
    assert_eq!(tier.all_steps().unwrap(), vec![1, 2, 10, 100]);
}

fn uncommitted_leftovers(subject: &TierSubject) {
    let (tier, storage) = (&*subject.tier, &*subject.storage);
    write_committed(tier, 1);
    write(tier, 3, 0, 2); // rank 1 of 2 never came
    write_committed(tier, 5);
    // Things in the root that are not steps are ignored.
    storage.put("notes.txt", b"hello").unwrap();
    storage.put("step-7/rank-00000.manifest.json", b"{}").unwrap();
    assert_eq!(tier.all_steps().unwrap(), vec![1, 3, 5]);
    assert_eq!(tier.committed_steps().unwrap(), vec![1, 5]);
    assert!(!tier.try_commit(3, 2).unwrap());
    assert_eq!(tier.commit_record(3).unwrap_err().kind, ErrorKind::NotFound);
}

fn failed_write_leaves_no_manifest(subject: &TierSubject) {
    let tier = &*subject.tier;
    let (m, src) = logical(1, 0, 1);
    let e = tier.write_rank(&m, &FailingSource(src), &link()).unwrap_err();
    assert!(e.message.contains("source went away"), "{}", e.message);
    assert_eq!(tier.read_manifest(1, 0).unwrap_err().kind, ErrorKind::NotFound);
    assert!(!tier.try_commit(1, 1).unwrap());
    assert!(tier.committed_steps().unwrap().is_empty());
    // A retry of the same rank succeeds.
    write_committed(tier, 1);
    assert_eq!(tier.committed_steps().unwrap(), vec![1]);
}

/// The peer tier's commit: a rank's step is there once that rank's copy is complete, whatever
/// the other ranks did; another rank's copy is readable once that rank has written it.
fn commits_per_rank(subject: &TierSubject) {
    let tier = &*subject.tier;
    assert!(tier.committed_steps().unwrap().is_empty());
    assert_eq!(tier.commit_record(1).unwrap_err().kind, ErrorKind::NotFound);
    write(tier, 1, 0, 2);
    assert!(tier.try_commit(1, 2).unwrap());
    assert_eq!(tier.committed_steps().unwrap(), vec![1]);
    assert_eq!(tier.ranks_written(1).unwrap(), vec![0]);
    let rec = tier.commit_record(1).unwrap();
    assert_eq!((rec.step, rec.world_size, rec.tier.as_str()), (1, 2, tier.name()));
    assert_eq!(tier.read_manifest(1, 1).unwrap_err().kind, ErrorKind::NotFound);
    // Rank 1 writes through its own tier: a holder takes a replica only from its own rank.
    write(subject.rank1.as_deref().unwrap_or(tier), 1, 1, 2);
    let m = tier.read_manifest(1, 1).unwrap();
    assert_eq!((m.rank, m.world_size), (1, 2));
    read_item(tier, &m, m.item_index(TARGET).unwrap()).unwrap();
}

/// gc removes what its plan lists, by the one step rule, and nothing more.
fn gc_follows_the_step_rule(subject: &TierSubject) {
    let tier = &*subject.tier;
    let opts = GcOptions { keep: Some(1), temp_age: Some(std::time::Duration::from_secs(600)), ..Default::default() };
    assert!(tier.gc_plan(&opts).unwrap().is_empty(), "an empty tier has nothing to collect");
    for step in [1, 2, 4] {
        write_committed(tier, step);
    }
    write(tier, 3, 0, 2); // rank 1 of 2 never came
    write(tier, 5, 0, 2); // newer than every committed step: a save in progress
    let plan = tier.gc_plan(&opts).unwrap();
    // The steps it removes: whole steps, or (rank areas) a step's manifests; an uncommitted
    // step of rank areas has nothing else to remove.
    let mut gone = gc::steps_of(&plan);
    gone.extend(plan.iter().filter_map(|r| match format::parse_area_name(r.key()?.rsplit('/').next()?) {
        Some(format::AreaEntry::Manifest(s)) => Some(s),
        _ => None,
    }));
    gone.sort_unstable();
    gone.dedup();
    assert_eq!(gone, vec![1, 2, 3], "{plan:?}");
    // Besides steps, only what a blob tier keeps in rank areas: those steps' manifests and
    // the data objects only they refer to.
    let objects: Vec<&str> = plan.iter().filter(|r| r.step().is_none()).map(|r| r.key().unwrap_or_default()).collect();
    assert!(objects.iter().all(|k| k.starts_with(format::AREAS) && !k.contains("step-000000000004") && !k.contains("step-000000000005")), "{plan:?}");
    assert_eq!(tier.all_steps().unwrap(), vec![1, 2, 3, 4, 5], "planning removes nothing");
    assert_eq!(tier.gc_apply(plan.clone()).unwrap(), plan);
    assert_eq!(tier.all_steps().unwrap(), vec![4, 5]);
    assert_eq!(tier.committed_steps().unwrap(), vec![4]);
    assert!(tier.gc_plan(&opts).unwrap().is_empty());
}

fn per_rank(r: &Rules) -> Option<&'static str> {
    r.per_rank_commit.then_some("a step is visible per rank here (tested by commits_per_rank)")
}

fn all_ranks(r: &Rules) -> Option<&'static str> {
    (!r.per_rank_commit).then_some("steps commit once every rank has written them (tested by invisible_until_committed)")
}

fn no_delete(r: &Rules) -> Option<&'static str> {
    (!r.deletes).then_some("copies are removed by their holders' retention, not by delete_step or gc")
}

/// Every test of the suite, for one tier kind.
pub fn cases() -> Vec<Case<TierSubject>> {
    vec![
        Case { name: "write_and_read_back", run: write_and_read_back, skip: always },
        Case { name: "invisible_until_committed", run: invisible_until_committed, skip: per_rank },
        Case { name: "commits_per_rank", run: commits_per_rank, skip: all_ranks },
        Case { name: "flipped_byte_is_integrity_error", run: flipped_byte_is_integrity_error, skip: always },
        Case { name: "truncated_data_is_a_clear_error", run: truncated_data_is_a_clear_error, skip: always },
        Case { name: "missing_data_is_a_clear_error", run: missing_data_is_a_clear_error, skip: always },
        Case { name: "corrupt_manifest_is_integrity_error", run: corrupt_manifest_is_integrity_error, skip: always },
        Case { name: "delete_step_removes_it", run: delete_step_removes_it, skip: no_delete },
        Case { name: "steps_are_in_numeric_order", run: steps_are_in_numeric_order, skip: always },
        Case { name: "uncommitted_leftovers", run: uncommitted_leftovers, skip: per_rank },
        Case { name: "failed_write_leaves_no_manifest", run: failed_write_leaves_no_manifest, skip: always },
        Case { name: "gc_follows_the_step_rule", run: gc_follows_the_step_rule, skip: no_delete },
    ]
}

/// The chunks `write` stores for item `name` of a fresh step on `tier`: their codecs, and
/// whether every item starts 64-byte aligned in its object (for tests of one kind's layout).
pub fn stored_layout(tier: &dyn Tier, name: &str) -> (Vec<String>, u64, u64, bool) {
    let m = write(tier, 1, 0, 1);
    let codecs = m.items[m.item_index(name).expect("item")].chunks.iter().map(|c| c.codec.clone()).collect();
    let aligned = m.items.iter().all(|it| it.chunks.first().is_none_or(|c| c.stored_offset % format::ITEM_ALIGN == 0));
    (codecs, m.objects.iter().map(|o| o.len).sum(), m.total_bytes(), aligned)
}
