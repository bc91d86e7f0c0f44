//! The version-3 blob layout: cross-step chunk references (dedup), each rank's sweep of its
//! own area, gc's mark-and-sweep, and steps of the layout of versions 1-2 read and removed.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use crate::blobs::{Blobs, FsBlobs};
use crate::codec::Compression;
use crate::error::{ErrorKind, Result};
use crate::format::{self, ChunkMeta, ChunkSource, ItemMeta, Manifest, ObjectMeta};
use crate::gc::{GcOptions, Target};
use crate::scheduler::Link;
use crate::tier::blob::BlobTier;
use crate::tier::layout::StepLayout;
use crate::tier::{read_chunk, run_gc, Tier};

const CHUNK: u64 = 64 << 10;
const BASE: usize = 2 << 20;
const ADAPTER: usize = 64 << 10;

struct Src(Vec<Vec<u8>>);
impl ChunkSource for Src {
    fn read_raw(&self, item: usize, chunk: usize, dst: &mut [u8]) -> Result<()> {
        let off = chunk * CHUNK as usize;
        dst.copy_from_slice(&self.0[item][off..off + dst.len()]);
        Ok(())
    }
}

/// A LoRA-like rank state: a frozen base (the same every step) and a small adapter that
/// changes every step; chunks carry their hash as the memory flush computes it.
fn lora(step: u64, rank: u32) -> (Manifest, Src) {
    let items = vec![("base", crate::testing::noise(BASE, 7)), ("adapter", crate::testing::noise(ADAPTER, 1000 + step))];
    let mut m = Manifest::new(step, rank, 1, "logical", CHUNK);
    m.generation = Some(format!("t.{step}"));
    for (name, bytes) in &items {
        let chunks = format::chunk_ranges(bytes.len() as u64, CHUNK)
            .map(|(off, len)| {
                let (crc32c, hash) = crate::checksum::crc32c_and_hash(&bytes[off as usize..(off + len) as usize]);
                ChunkMeta {
                    offset: off,
                    len,
                    crc32c,
                    object: 0,
                    stored_offset: off,
                    stored_len: len,
                    codec: "raw".into(),
                    hash: Some(hash),
                }
            })
            .collect();
        m.items.push(ItemMeta {
            name: (*name).into(),
            kind: "array".into(),
            dtype: "uint8".into(),
            shape: vec![bytes.len() as u64],
            nbytes: bytes.len() as u64,
            meta: serde_json::Value::Null,
            shard: None,
            replica: None,
            chunks,
        });
    }
    m.objects = vec![ObjectMeta { name: "logical".into(), len: (BASE + ADAPTER) as u64, key: None }];
    (m, Src(items.into_iter().map(|(_, b)| b).collect()))
}

fn save(tier: &BlobTier, step: u64, commit: bool) -> Manifest {
    let (m, src) = lora(step, 0);
    let out = tier.write_rank(&m, &src, &Link::new("l", None)).unwrap();
    if commit {
        assert!(tier.try_commit(step, 1).unwrap());
    }
    out
}

/// Every chunk of `step` read back from `tier` alone, checked against what was saved.
fn restores(tier: &dyn Tier, step: u64) -> Result<()> {
    tier.commit_record(step)?;
    let m = tier.read_manifest(step, 0)?;
    let (_, src) = lora(step, 0);
    for (i, it) in m.items.iter().enumerate() {
        let mut got = vec![0u8; it.nbytes as usize];
        for (c, ch) in it.chunks.iter().enumerate() {
            read_chunk(tier, &m, i, c, &mut got[ch.offset as usize..(ch.offset + ch.len) as usize])?;
        }
        assert!(got == src.0[i], "step {step} item {}: other bytes", it.name);
    }
    Ok(())
}

fn bytes_under(p: &Path) -> u64 {
    walk(p).iter().map(|f| std::fs::metadata(f).unwrap().len()).sum()
}

fn walk(p: &Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(p).unwrap().flatten() {
        if e.file_type().unwrap().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path());
        }
    }
    out
}

fn fs_tier(root: &Path, dedup: bool) -> BlobTier {
    BlobTier::with_dedup("disk", Arc::new(FsBlobs::new("disk", root).unwrap()), Compression::zstd(3), dedup)
}

fn counted_tier(root: &Path, dedup: bool) -> (BlobTier, Arc<Counting>) {
    let counting = Arc::new(Counting {
        inner: Arc::new(FsBlobs::new("disk", root).unwrap()),
        gets: Default::default(),
        lists: Default::default(),
        heads: Default::default(),
    });
    (BlobTier::with_dedup("disk", counting.clone(), Compression::zstd(3), dedup), counting)
}

/// Data objects (keys) of rank 0's area.
fn data_objects(tier: &BlobTier) -> BTreeSet<String> {
    let area = format::rank_area(0);
    tier.blobs().list(&area).unwrap().into_iter().filter(|n| n.ends_with(".data")).map(|n| format!("{area}/{n}")).collect()
}

/// Issue 31's LoRA case: 8 steps every step; the tier holds at most 1.35x one step's bytes
/// (without dedup: 8x), every step restores bit-identical from it alone; with keep = 2 it
/// shrinks back to about one step and the kept steps restore.
#[test]
fn a_frozen_base_is_stored_once_and_every_step_restores() {
    let one_step = (BASE + ADAPTER) as f64;
    for dedup in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let (tier, counting) = counted_tier(dir.path(), dedup);
        for step in 1..=8 {
            let m = save(&tier, step, true);
            assert_eq!(m.version, format::AREAS_VERSION);
            tier.sweep(0, None, &|_| None).unwrap();
            if dedup && step > 1 {
                assert_eq!(m.objects.len(), 2, "its own data object and step 1's");
                assert_eq!(m.objects[0].len, ADAPTER as u64, "only the adapter is written again");
            }
        }
        let held = bytes_under(dir.path()) as f64;
        if dedup {
            assert!(held <= 1.35 * one_step, "the tier holds {held} bytes, one step is {one_step}");
        } else {
            assert!(held >= 7.9 * one_step, "without dedup every step is whole: {held}");
        }
        for step in 1..=8 {
            restores(&tier, step).unwrap_or_else(|e| panic!("dedup {dedup}: step {step}: {e}"));
        }
        // Then keep = 2, as a Store runs it after each save: the committer's retention (commit
        // records), then the rank's sweep of its area.
        let mut swept = vec![];
        for step in 9..=12 {
            save(&tier, step, true);
            run_gc(&tier, &GcOptions { keep: Some(2), ..Default::default() }).unwrap();
            let (lists, heads) = (counting.lists.load(Relaxed), counting.heads.load(Relaxed));
            let gone = tier.sweep_rank(0, Some(2), &|_| None).unwrap().manifests;
            // O(1) requests per step: no listing, a look at one commit record per step the
            // sweep decides on (the newest not seen committed, the one at the edge of keep),
            // and one per manifest that goes.
            assert_eq!(counting.lists.load(Relaxed) - lists, 0, "step {step}: the sweep listed");
            assert!(counting.heads.load(Relaxed) - heads <= 2 + gone.len(), "step {step}: {} looks", counting.heads.load(Relaxed) - heads);
            swept.extend(gone);
        }
        assert_eq!(tier.committed_steps().unwrap(), vec![11, 12]);
        assert_eq!(swept, (1..=9).collect::<Vec<_>>(), "each step's manifest goes once its commit did");
        let held = bytes_under(dir.path()) as f64;
        let want = if dedup { 1.1 * one_step } else { 3.1 * one_step };
        assert!(held <= want, "dedup {dedup}: after keep 2 the tier holds {held} bytes");
        for step in [11, 12] {
            restores(&tier, step).unwrap();
        }
    }
}

/// A damaged chunk of the frozen base is caught on every step that refers to it.
#[test]
fn a_damaged_shared_chunk_fails_every_step_that_uses_it() {
    let dir = tempfile::tempdir().unwrap();
    let tier = fs_tier(dir.path(), true);
    for step in 1..=3 {
        save(&tier, step, true);
    }
    let base = tier.read_manifest(1, 0).unwrap().objects[0].key.clone().unwrap();
    let path = dir.path().join(&base);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    for step in 1..=3 {
        let e = restores(&tier, step).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Integrity, "step {step}: {e}");
        assert!(e.message.contains("item 'base', chunk 0") && e.message.contains(&format!("step {step}")), "{e}");
    }
}

/// The sweep: a killed save's data object and an uncommitted older step's manifest go; what
/// a kept manifest, the last manifest of this process or a write in flight refers to stays.
#[test]
fn the_sweep_removes_leftovers_and_never_a_referenced_object() {
    let dir = tempfile::tempdir().unwrap();
    let earlier = fs_tier(dir.path(), true); // a process killed after step 2's manifest
    save(&earlier, 1, true);
    save(&earlier, 2, false);
    let dead = format::area_data_key(3, 0, "deadbeefdeadbeef");
    earlier.blobs().put(&dead, b"a killed save's data").unwrap();
    let tier = fs_tier(dir.path(), true); // the restarted process
    let m3 = save(&tier, 3, true);
    assert_eq!(m3.objects.len(), 1, "its first save is whole");
    // In flight here: a data object being written for step 4 is not removed.
    let writing = format::area_data_key(4, 0, "0123456789abcdef");
    tier.blobs().put(&writing, b"half").unwrap();
    let id = tier.area(0).lock().begin(4, [writing.clone()].into());
    let swept = tier.sweep_rank(0, None, &|_| None).unwrap();
    assert_eq!(swept.manifests, vec![2], "step 2 never committed and step 3 did");
    let step1_data = tier.read_manifest(1, 0).unwrap().objects[0].key.clone().unwrap();
    let step2_data = format!("{}/{}.", format::rank_area(0), format::step_dir(2));
    assert!(swept.objects.contains(&dead), "{swept:?}");
    assert!(swept.objects.iter().any(|k| k.starts_with(&step2_data)), "{swept:?}");
    assert!(!swept.objects.contains(&writing) && !swept.objects.contains(&step1_data), "{swept:?}");
    for step in [1, 3] {
        restores(&tier, step).unwrap();
    }
    // The write ended without a manifest (it failed): the next sweep removes its object.
    tier.area(0).lock().end(id, &writing, None);
    assert_eq!(tier.sweep_rank(0, None, &|_| None).unwrap().objects, vec![writing]);
    // The last manifest this process wrote stays, even where a newer step committed
    // without it (another process's): its chunks are what the next save refers to.
    save(&tier, 5, false);
    save(&earlier, 6, true);
    assert!(tier.sweep_rank(0, None, &|_| None).unwrap().manifests.is_empty());
    assert!(tier.read_manifest(5, 0).is_ok());
}

/// gc marks every kept, in-flight and newest manifest and sweeps the rest, in every area
/// (an older world size's too); an object written after its plan was made stays.
#[test]
fn gc_marks_what_is_kept_and_sweeps_every_area() {
    let dir = tempfile::tempdir().unwrap();
    let tier = fs_tier(dir.path(), true);
    // Rank 7 of an earlier, larger job saved step 1 (its data object and manifest).
    let (mut m7, src7) = lora(1, 7);
    m7.world_size = 8;
    fs_tier(dir.path(), true).write_rank(&m7, &src7, &Link::new("l", None)).unwrap();
    for step in 1..=4 {
        save(&tier, step, true);
    }
    save(&tier, 5, false); // in flight
    let dead = format::area_data_key(3, 0, "deadbeefdeadbeef");
    tier.blobs().put(&dead, b"a killed save's data").unwrap();
    let opts = GcOptions { keep: Some(2), temp_age: Some(Duration::ZERO), ..Default::default() };
    let plan = tier.gc_plan(&opts).unwrap();
    let late = format::area_data_key(2, 0, "1a7e1a7e1a7e1a7e");
    tier.blobs().put(&late, b"written after the plan").unwrap();
    let done = tier.gc_apply(plan).unwrap();
    let objects: BTreeSet<&str> = done.iter().filter(|r| matches!(r.target, Target::Object { .. })).filter_map(|r| r.key()).collect();
    let want: BTreeSet<String> =
        [format::area_manifest_key(1, 0), format::area_manifest_key(2, 0), format::area_manifest_key(1, 7), dead.clone()].into();
    assert!(want.iter().all(|k| objects.contains(k.as_str())), "{objects:?}");
    assert_eq!(crate::gc::steps_of(&done), vec![1, 2]);
    assert!(tier.blobs().exists(&late).unwrap(), "an object younger than the gc's plan stays");
    assert!(tier.blobs().list(&format::rank_area(7)).unwrap().is_empty(), "the old rank's area is emptied");
    for step in [3, 4] {
        restores(&tier, step).unwrap();
    }
    assert!(tier.read_manifest(5, 0).is_ok(), "the save in flight keeps its manifest");
    // No data object is left that no manifest refers to, but the late one.
    let mut referenced = BTreeSet::new();
    for s in [3, 4, 5] {
        referenced.extend(super::areas::object_keys(&tier.read_manifest(s, 0).unwrap()));
    }
    let left: BTreeSet<String> = data_objects(&tier).into_iter().filter(|k| !referenced.contains(k)).collect();
    assert_eq!(left, [late.clone()].into());
    // Once more, the late object goes too; nothing else does.
    let again = run_gc(&tier, &opts).unwrap();
    assert_eq!(again.iter().filter_map(|r| r.key()).collect::<Vec<_>>(), vec![late.as_str()]);
}

/// A tier main's code wrote (version 1-2: every rank's objects in the step's directory) is
/// read with one request per manifest, saved on in version 3, and gc'd.
#[test]
fn a_tier_of_the_old_layout_is_read_and_collected() {
    let dir = tempfile::tempdir().unwrap();
    let blobs: Arc<dyn Blobs> = Arc::new(FsBlobs::new("disk", dir.path()).unwrap());
    let old = StepLayout::new("disk", blobs.clone());
    for step in [1, 2] {
        let (m, src) = lora(step, 0);
        let object = ObjectMeta { name: format::data_name(0), len: 0, key: None };
        let mut w = blobs.create(&format!("{}/{}", format::step_dir(step), format::data_name(0))).unwrap();
        let link = Link::new("l", None);
        let m = crate::tier::encode_rank("disk", &m, &src, Compression::zstd(3), into(object), &link, &mut |b| w.write(b)).unwrap();
        w.finish().unwrap();
        old.write_manifest(&m).unwrap();
        assert!(old.try_commit(step, 1, None).unwrap());
    }
    let counting = Arc::new(Counting { inner: blobs, gets: Default::default(), lists: Default::default(), heads: Default::default() });
    let tier = BlobTier::new("disk", counting.clone(), Compression::zstd(3));
    assert_eq!(tier.commit_record(1).unwrap().version, format::PLAIN_VERSION);
    let before = counting.gets.load(Relaxed);
    tier.read_manifest(1, 0).unwrap();
    assert_eq!(counting.gets.load(Relaxed) - before, 1, "one GET for an old step's manifest");
    restores(&tier, 1).unwrap();
    assert_eq!(tier.ranks_written(2).unwrap(), vec![0]);
    for step in [3, 4] {
        save(&tier, step, true);
    }
    assert_eq!(tier.commit_record(4).unwrap().version, format::AREAS_VERSION);
    assert_eq!(tier.all_steps().unwrap(), vec![1, 2, 3, 4]);
    let done = run_gc(&tier, &GcOptions { keep: Some(1), temp_age: Some(Duration::ZERO), ..Default::default() }).unwrap();
    assert_eq!(crate::gc::steps_of(&done), vec![1, 2, 3]);
    assert!(!dir.path().join(format::step_dir(1)).exists(), "an old step's directory goes whole");
    restores(&tier, 4).unwrap();
    assert_eq!(tier.all_steps().unwrap(), vec![4]);
}

/// Every chunk into `object`.
fn into(object: ObjectMeta) -> crate::tier::EncodeInto<'static> {
    crate::tier::EncodeInto { object, store: &|_, _| true }
}

/// `Blobs` that counts its GETs, listings and existence checks.
struct Counting {
    inner: Arc<dyn Blobs>,
    gets: std::sync::atomic::AtomicUsize,
    lists: std::sync::atomic::AtomicUsize,
    heads: std::sync::atomic::AtomicUsize,
}

impl Blobs for Counting {
    fn describe(&self, key: &str) -> String {
        self.inner.describe(key)
    }
    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        self.inner.put(key, data)
    }
    fn put_if_absent(&self, key: &str, data: &[u8]) -> Result<bool> {
        self.inner.put_if_absent(key, data)
    }
    fn create(&self, key: &str) -> Result<Box<dyn crate::blobs::BlobWriter>> {
        self.inner.create(key)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.gets.fetch_add(1, Relaxed);
        self.inner.get(key)
    }
    fn get_range(&self, key: &str, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.inner.get_range(key, offset, dst)
    }
    fn exists(&self, key: &str) -> Result<bool> {
        self.heads.fetch_add(1, Relaxed);
        self.inner.exists(key)
    }
    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        self.lists.fetch_add(1, Relaxed);
        self.inner.list(prefix)
    }
    fn lists_cheaply(&self) -> bool {
        true
    }
    fn delete(&self, key: &str) -> Result<()> {
        self.inner.delete(key)
    }
    fn delete_prefix(&self, prefix: &str) -> Result<()> {
        self.inner.delete_prefix(prefix)
    }
}
