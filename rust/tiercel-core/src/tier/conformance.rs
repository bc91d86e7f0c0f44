//! The conformance suite every tier kind passes: written once, generic over a constructor,
//! and instantiated per kind by `conformance_suite!` at the bottom of this file. Adding a kind
//! (s3, gcs, a Python tier behind a shim) is one line there.
//!
//! The suite goes through the `Tier` trait and `tier::read_chunk` only. To damage stored
//! bytes it rewrites objects in place when `blobs().describe(key)` is a local file (so a
//! memory tier's mapped segment keeps its inode, as real bit rot would), and through
//! `blobs().put` otherwise (object stores).

use std::any::Any;
use std::path::Path;
use std::sync::Arc;

use crate::blobs::{Blobs, FsBlobs};
use crate::error::{Error, ErrorKind, Result};
use crate::format::{self, ChunkMeta, ItemMeta, Manifest};
use crate::policy::{Codec, Compression, TierKind};
use crate::scheduler::Link;
use crate::tier::blob::BlobTier;
use crate::tier::memory::MemoryTier;
use crate::tier::{read_chunk, ChunkSource, Tier};

/// Keeps a tier's storage alive for the test and removes it afterwards (a temp dir, a bucket
/// prefix, a server process).
pub type Guard = Box<dyn Any>;

/// A fresh, empty tier of one kind under test, with the objects its bytes are stored in (to
/// look at and damage them) and what keeps its storage alive.
pub struct Subject {
    pub tier: Arc<dyn Tier>,
    pub storage: Arc<dyn Blobs>,
    pub guard: Guard,
}

/// Makes a fresh, empty tier of one kind.
pub type Make = dyn Fn() -> Subject;

// ---------------------------------------------------------------------------------------------
// Constructors, one per kind
// ---------------------------------------------------------------------------------------------

fn tempdir_in(base: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix("tiercel-conformance-").tempdir_in(base).expect("tempdir")
}

pub fn memory_tier() -> Subject {
    let dir = tempdir_in("/dev/shm");
    let tier: Arc<dyn Tier> = MemoryTier::open("ram", dir.path(), None).expect("open memory tier");
    let storage = Arc::new(FsBlobs::new("ram", dir.path()).expect("open fs blobs"));
    Subject { tier, storage, guard: Box::new(dir) }
}

pub fn fs_tier(compression: Compression) -> Subject {
    let dir = tempdir_in(&std::env::temp_dir().display().to_string());
    let storage: Arc<dyn Blobs> = Arc::new(FsBlobs::new("disk", dir.path()).expect("open fs blobs"));
    let tier: Arc<dyn Tier> = Arc::new(BlobTier::new("disk", storage.clone(), compression));
    Subject { tier, storage, guard: Box::new(dir) }
}

/// An object-store tier under a fresh prefix of a bucket named by `{var}_ENDPOINT` and
/// `{var}_BUCKET`: for s3, the moto server and bucket that the test wrapper
/// (`tests/servers.py`, run by `make test-rust`) starts and makes. No GCS emulator here takes
/// the XML API writes that the gcs kind sends (see docs/object-store.md), so the gcs kind runs
/// only when pointed at a real bucket. The prefix is deleted afterwards.
pub fn object_tier(kind: TierKind, var: &str, compression: Compression) -> Subject {
    use crate::object::{Env, ObjectBlobs};
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let get = |k: &str| std::env::var(format!("{var}_{k}")).unwrap_or_else(|_| panic!("${var}_{k} is not set"));
    let (endpoint, bucket) = (get("ENDPOINT"), get("BUCKET"));
    let scheme = if kind == TierKind::Gcs { "gs" } else { "s3" };
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let prefix = format!("conformance-{}-{n}", std::process::id());
    // Through the policy parser, as a user's tier would be.
    let cfg = |url: String| -> crate::policy::TierConfig {
        let json = serde_json::json!({"tier": [
            {"name": "ram", "kind": "memory", "root": "/unused"},
            {"name": kind.as_str(), "kind": kind.as_str(), "url": url, "endpoint": endpoint, "retries": 3,
             "compression": compression.to_string()},
        ]});
        crate::policy::Policy::from_json(&json.to_string(), "<conformance>").expect("policy").tiers.remove(1)
    };
    // The process's settings (to run the suite against a real bucket), else the test
    // servers' key.
    let mut env = Env::process();
    if !env.vars.contains_key("AWS_ACCESS_KEY_ID") {
        env.vars.insert("AWS_ACCESS_KEY_ID".into(), "tiercel-test-key".into());
        env.vars.insert("AWS_SECRET_ACCESS_KEY".into(), "tiercel-test-secret-0123456789".into());
    }
    let storage: Arc<dyn Blobs> = Arc::new(
        ObjectBlobs::open_with(kind.as_str(), &cfg(format!("{scheme}://{bucket}/{prefix}")).spec, &env).expect("open object tier"),
    );
    let tier: Arc<dyn Tier> = Arc::new(BlobTier::new(kind.as_str(), storage.clone(), compression));
    let root = ObjectBlobs::open_with(kind.as_str(), &cfg(format!("{scheme}://{bucket}")).spec, &env).expect("open bucket");
    struct Cleanup(ObjectBlobs, String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = self.0.delete_prefix(&self.1);
        }
    }
    Subject { tier, storage, guard: Box::new(Cleanup(root, prefix)) }
}

pub fn zstd3() -> Compression {
    Compression { codec: Codec::Zstd { level: 3 }, bytegroup: false }
}

pub fn bytegroup_zstd3() -> Compression {
    Compression { codec: Codec::Zstd { level: 3 }, bytegroup: true }
}

// ---------------------------------------------------------------------------------------------
// Test data: a logical manifest over in-memory items
// ---------------------------------------------------------------------------------------------

const CHUNK: u64 = 4096;

fn link() -> Arc<Link> {
    Link::new("t", None)
}

/// Deterministic bytes: xorshift noise (incompressible) or smooth float32 values
/// (compressible, and more so after bytegroup).
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn floats(count: usize, seed: u64) -> Vec<u8> {
    (0..count).flat_map(|i| ((i as f32 + seed as f32) * 0.001).sin().to_le_bytes()).collect()
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
const TARGET: &str = "model/several";

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

/// A logical manifest (stored offsets meaningless) and its source.
fn logical(step: u64, rank: u32, world_size: u32) -> (Manifest, VecSource) {
    let mut m = Manifest::new(step, rank, world_size, "logical", CHUNK);
    m.trees.push(("state".into(), serde_json::json!({"model": {"w": "@item:model/several"}, "step": step})));
    let mut data = vec![];
    for (name, dtype, bytes) in items(step * 31 + rank as u64) {
        let size = if dtype == "float32" { 4 } else { 1 };
        let chunks = format::chunk_ranges(bytes.len() as u64, CHUNK)
            .map(|(off, len)| ChunkMeta {
                offset: off,
                len,
                crc32c: crc32c::crc32c(&bytes[off as usize..(off + len) as usize]),
                object: 0,
                stored_offset: 0,
                stored_len: len,
                codec: "raw".into(),
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
            chunks,
        });
        data.push(bytes);
    }
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

fn object_key(m: &Manifest, object: u32) -> String {
    format!("{}/{}", format::step_dir(m.step), m.objects[object as usize].name)
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

pub fn write_and_read_back(make: &Make) {
    let subject = make();
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
        let key = format!("{}/{}", format::step_dir(1), obj.name);
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

pub fn invisible_until_committed(make: &Make) {
    let subject = make();
    let tier = &*subject.tier;
    write(tier, 1, 0, 2);
    assert_eq!(tier.committed_steps().unwrap(), Vec::<u64>::new());
    assert_eq!(tier.all_steps().unwrap(), vec![1]);
    assert!(!tier.try_commit(1, 2).unwrap(), "committed with one of two ranks");
    assert_eq!(tier.committed_steps().unwrap(), Vec::<u64>::new());
    assert_eq!(tier.commit_record(1).unwrap_err().kind, ErrorKind::NotFound);
    write(tier, 1, 1, 2);
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

pub fn flipped_byte_is_integrity_error(make: &Make) {
    let subject = make();
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

pub fn truncated_data_is_a_clear_error(make: &Make) {
    let subject = make();
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

pub fn missing_data_is_a_clear_error(make: &Make) {
    let subject = make();
    let (tier, storage) = (&*subject.tier, &*subject.storage);
    let m = write_committed(tier, 1);
    let item = m.item_index(TARGET).unwrap();
    storage.delete(&object_key(&m, m.items[item].chunks[0].object)).unwrap();
    let mut dst = vec![0u8; m.items[item].chunks[0].len as usize];
    let e = read_chunk(tier, &m, item, 0, &mut dst).unwrap_err();
    assert_names(&e, tier, 1, 0, TARGET, 0);
    assert!(e.message.contains(&m.objects[0].name), "message lacks the object: {}", e.message);
}

pub fn corrupt_manifest_is_integrity_error(make: &Make) {
    let subject = make();
    let (tier, storage) = (&*subject.tier, &*subject.storage);
    write_committed(tier, 1);
    let key = format!("{}/{}", format::step_dir(1), format::manifest_name(0));
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
    let good = storage.get(&format!("{}/{}", format::step_dir(2), format::manifest_name(0))).unwrap();
    storage.put(&key, &good).unwrap();
    let e = tier.read_manifest(1, 0).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Integrity, "{}", e.message);
    assert!(e.message.contains("step 2") && e.message.contains(&place), "{}", e.message);

    // A rank that never wrote is NotFound, not Integrity.
    assert_eq!(tier.read_manifest(1, 7).unwrap_err().kind, ErrorKind::NotFound);
}

pub fn delete_step_removes_it(make: &Make) {
    let subject = make();
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

pub fn steps_are_in_numeric_order(make: &Make) {
    let subject = make();
    let tier = &*subject.tier;
    for step in [100, 2, 10, 1] {
        write_committed(tier, step);
    }
    assert_eq!(tier.committed_steps().unwrap(), vec![1, 2, 10, 100]);
    assert_eq!(tier.all_steps().unwrap(), vec![1, 2, 10, 100]);
}

pub fn uncommitted_leftovers(make: &Make) {
    let subject = make();
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

pub fn failed_write_leaves_no_manifest(make: &Make) {
    let subject = make();
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

/// Instantiates every test of the suite for one tier kind: `conformance_suite!(module, ctor)`.
/// A kind that needs a server names the variable that says where one runs:
/// `conformance_suite!(module, ctor, needs = "VAR")`; without it set, its tests pass as skipped
/// (and say so), so that `cargo test` runs anywhere.
macro_rules! conformance_suite {
    ($kind:ident, $make:expr) => {
        conformance_suite!($kind, $make, needs = "");
    };
    ($kind:ident, $make:expr, needs = $var:literal) => {
        mod $kind {
            use super::*;

            fn make() -> Subject {
                ($make)()
            }

            fn skip() -> bool {
                super::server_missing($var, stringify!($kind))
            }

            #[test]
            fn write_and_read_back() {
                if !skip() {
                    super::write_and_read_back(&make)
                }
            }
            #[test]
            fn invisible_until_committed() {
                if !skip() {
                    super::invisible_until_committed(&make)
                }
            }
            #[test]
            fn flipped_byte_is_integrity_error() {
                if !skip() {
                    super::flipped_byte_is_integrity_error(&make)
                }
            }
            #[test]
            fn truncated_data_is_a_clear_error() {
                if !skip() {
                    super::truncated_data_is_a_clear_error(&make)
                }
            }
            #[test]
            fn missing_data_is_a_clear_error() {
                if !skip() {
                    super::missing_data_is_a_clear_error(&make)
                }
            }
            #[test]
            fn corrupt_manifest_is_integrity_error() {
                if !skip() {
                    super::corrupt_manifest_is_integrity_error(&make)
                }
            }
            #[test]
            fn delete_step_removes_it() {
                if !skip() {
                    super::delete_step_removes_it(&make)
                }
            }
            #[test]
            fn steps_are_in_numeric_order() {
                if !skip() {
                    super::steps_are_in_numeric_order(&make)
                }
            }
            #[test]
            fn uncommitted_leftovers() {
                if !skip() {
                    super::uncommitted_leftovers(&make)
                }
            }
            #[test]
            fn failed_write_leaves_no_manifest() {
                if !skip() {
                    super::failed_write_leaves_no_manifest(&make)
                }
            }
        }
    };
}

/// True, after saying so, when `var` (a server a kind needs) is named but not set.
pub fn server_missing(var: &str, kind: &str) -> bool {
    if var.is_empty() || std::env::var_os(var).is_some() {
        return false;
    }
    eprintln!("conformance {kind}: skipped: ${var} is not set (`make test-rust` starts the servers and sets it)");
    true
}

// One line per tier kind.
conformance_suite!(memory, memory_tier);
conformance_suite!(fs_none, || fs_tier(Compression::none()));
conformance_suite!(fs_zstd, || fs_tier(zstd3()));
conformance_suite!(fs_bytegroup_zstd, || fs_tier(bytegroup_zstd3()));
conformance_suite!(s3, || object_tier(TierKind::S3, "TIERCEL_TEST_S3", zstd3()), needs = "TIERCEL_TEST_S3_ENDPOINT");
conformance_suite!(s3_none, || object_tier(TierKind::S3, "TIERCEL_TEST_S3", Compression::none()), needs = "TIERCEL_TEST_S3_ENDPOINT");
conformance_suite!(gcs, || object_tier(TierKind::Gcs, "TIERCEL_TEST_GCS", zstd3()), needs = "TIERCEL_TEST_GCS_ENDPOINT");

/// The compressed kinds really exercise their codecs on this data (else the suite would test
/// the raw path three times).
#[test]
fn compressed_kinds_use_their_codecs() {
    for (compression, want) in [(zstd3(), "zstd"), (bytegroup_zstd3(), "bytegroup4+zstd")] {
        let subject = fs_tier(compression);
        let m = write(&*subject.tier, 1, 0, 1);
        let codecs = |name: &str| -> Vec<String> { m.items[m.item_index(name).unwrap()].chunks.iter().map(|c| c.codec.clone()).collect() };
        assert!(codecs(TARGET).iter().any(|c| c == want), "{compression}: {TARGET} codecs {:?}", codecs(TARGET));
        // Noise does not shrink and is stored raw.
        assert!(codecs("optim/noise").iter().all(|c| c == "raw"), "{:?}", codecs("optim/noise"));
        assert!(m.objects[0].len < m.total_bytes(), "{compression}: nothing was compressed");
    }
    let subject = memory_tier();
    let m = write(&*subject.tier, 1, 0, 1);
    assert!(m.items.iter().flat_map(|i| &i.chunks).all(|c| c.codec == "raw"));
    for it in &m.items {
        if let Some(c) = it.chunks.first() {
            assert_eq!(c.stored_offset % format::ITEM_ALIGN, 0, "item {} is not aligned", it.name);
        }
    }
}
