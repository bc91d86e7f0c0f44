//! The Store end to end through its public API: save steps into the memory tier, let the
//! background persist and evict them per policy, and restore them bit-identical from the
//! fastest tier that has a valid copy.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tempfile::TempDir;
use tiercel_core::format;
use tiercel_core::policy::Policy;
use tiercel_core::store::{ItemData, ItemSpec, JobFilter, SaveHandle, StepReader, Store, TierState};
use tiercel_core::tier::Tier;
use tiercel_core::{ErrorKind, Result};

const WAIT: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Fixtures
// ---------------------------------------------------------------------------------------------

/// Where one test's tiers live; removed when the test ends.
struct Dirs {
    shm: TempDir,
    disk: TempDir,
}

impl Dirs {
    fn new() -> Dirs {
        Dirs {
            shm: tempfile::Builder::new().prefix("tiercel-store-test-").tempdir_in("/dev/shm").unwrap(),
            disk: tempfile::Builder::new().prefix("tiercel-store-test-").tempdir().unwrap(),
        }
    }
    fn ram(&self) -> PathBuf {
        self.shm.path().join("ram")
    }
    fn disk(&self) -> PathBuf {
        self.disk.path().join("disk")
    }
    /// A policy of a memory tier "ram" (with `ram` settings) and, unless `disk` is None, an
    /// fs tier "disk" (with `disk` settings), restored in that order.
    fn policy(&self, ram: &str, disk: Option<&str>, store: &str) -> Policy {
        let mut text = format!("[[tier]]\nname = \"ram\"\nkind = \"memory\"\nroot = {:?}\n{ram}\n", self.ram().display().to_string());
        let mut order = vec!["\"ram\""];
        if let Some(disk) = disk {
            text += &format!("\n[[tier]]\nname = \"disk\"\nkind = \"fs\"\nurl = {:?}\n{disk}\n", self.disk().display().to_string());
            order.push("\"disk\"");
        }
        text += &format!("\n[restore]\norder = [{}]\n\n[store]\nthreads = 2\nio_threads = 2\n{store}\n", order.join(", "));
        Policy::from_toml(&text, "test.toml").unwrap_or_else(|e| panic!("{e}\n{text}"))
    }
}

/// Deterministic noise (incompressible).
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

/// Smooth float32 values (compressible).
fn floats(count: usize, seed: u64) -> Vec<u8> {
    (0..count).flat_map(|i| ((i as f32 + seed as f32 * 10.0) * 0.001).sin().to_le_bytes()).collect()
}

/// One item to save: name, dtype, bytes.
struct Item {
    name: String,
    dtype: &'static str,
    bytes: Vec<u8>,
}

fn item(name: &str, dtype: &'static str, bytes: Vec<u8>) -> Item {
    Item { name: name.into(), dtype, bytes }
}

/// Two puts per step ("model", "optim"): a multi-chunk float item (64 KiB chunks), a small
/// one, random bytes over two chunks, and an empty one.
fn step_items(step: u64) -> Vec<Vec<Item>> {
    vec![
        vec![item("model/w", "float32", floats(50_003, step)), item("model/b", "float32", noise(4096, step))],
        vec![item("optim/m", "uint8", noise(100_000, step + 1000)), item("optim/empty", "uint8", vec![])],
    ]
}

fn spec(it: &Item) -> ItemSpec {
    let size = if it.dtype == "float32" { 4 } else { 1 };
    ItemSpec {
        name: it.name.clone(),
        kind: "array".into(),
        dtype: it.dtype.into(),
        shape: vec![it.bytes.len() as u64 / size],
        nbytes: it.bytes.len() as u64,
        meta: json!({"framework": "test"}),
        shard: None,
        replica: None,
    }
}

/// Saves `puts` as `step`: one part per put, copied from the items' memory.
fn save(store: &Arc<Store>, step: u64, puts: &[Vec<Item>]) -> Result<Arc<SaveHandle>> {
    let mut w = store.begin(step).unwrap();
    for (p, items) in puts.iter().enumerate() {
        let tree = json!(items.iter().map(|i| i.name.clone()).collect::<Vec<_>>());
        let (_, placed) = w.add_part(&format!("put{p}"), tree, items.iter().map(spec).collect())?;
        let srcs: Vec<(usize, usize)> = placed.iter().zip(items).map(|(&(idx, _), it)| (idx, it.bytes.as_ptr() as usize)).collect();
        // SAFETY: the items outlive the call and nothing writes to them meanwhile.
        unsafe { w.copy_items(&srcs)? };
    }
    w.commit()
}

/// Saves and waits until every tier is final.
fn save_wait(store: &Arc<Store>, step: u64, puts: &[Vec<Item>]) -> Arc<SaveHandle> {
    let h = save(store, step, puts).unwrap_or_else(|e| panic!("save step {step}: {e}"));
    assert!(h.wait(Some(WAIT), false), "step {step} not done: {:?}", h.states());
    h
}

fn state(h: &SaveHandle, tier: &str) -> TierState {
    h.states().into_iter().find(|(n, _)| n == tier).unwrap().1
}

/// Restores every item of `step` (rank 0) and checks it against `puts`. Returns, per item
/// name, the tier label and whether it came back as a zero-copy view.
fn restore_check(store: &Arc<Store>, step: u64, tiers: Option<&[String]>, puts: &[Vec<Item>]) -> Vec<(String, String, bool)> {
    let reader = StepReader::open(store, step, 0, tiers, &JobFilter::Mine).unwrap_or_else(|e| panic!("open step {step}: {e}"));
    let m = reader.manifest().clone();
    let want: Vec<&Item> = puts.iter().flatten().collect();
    assert_eq!(m.items.len(), want.len());
    let idx: Vec<usize> = (0..m.items.len()).collect();
    let got = reader.read_items(&idx).unwrap_or_else(|e| panic!("read step {step}: {e}"));
    let mut out = vec![];
    for (i, (data, label)) in got.iter().enumerate() {
        let it = want.iter().find(|w| w.name == m.items[i].name).unwrap();
        assert_eq!(m.items[i].dtype, it.dtype);
        assert!(data.bytes() == &it.bytes[..], "step {step} item {} (from {label}) differs", it.name);
        out.push((it.name.clone(), label.clone(), matches!(data, ItemData::View { .. })));
    }
    out
}

fn steps_of(store: &Store) -> Vec<(String, Vec<u64>)> {
    store.steps().into_iter().map(|(name, steps)| (name, steps.unwrap())).collect()
}

fn files_under(p: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            if e.path().is_dir() {
                out.extend(files_under(&e.path()));
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

/// Flips one byte of a stored file in place (the memory tier's segment keeps its inode).
fn flip_byte(path: &Path, offset: u64) {
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 0x40;
    f.write_all_at(&b, offset).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[test]
fn keep_and_every_then_restore_each_step() {
    let dirs = Dirs::new();
    let policy = dirs.policy("keep = 2", Some("every = 2\ncompression = \"zstd:3\""), "chunk_size = \"64KiB\"");
    let store = Store::open(policy, 0, 1).unwrap();
    let data: Vec<_> = (1..=5).map(step_items).collect();
    for step in 1..=5u64 {
        let h = save_wait(&store, step, &data[step as usize - 1]);
        assert_eq!(state(&h, "ram"), TierState::Done);
        let disk = if step % 2 == 0 { TierState::Done } else { TierState::NotScheduled };
        assert_eq!(state(&h, "disk"), disk, "step {step}");
    }
    store.flush();
    assert_eq!(steps_of(&store), vec![("ram".to_string(), vec![4, 5]), ("disk".to_string(), vec![2, 4])]);
    assert_eq!(store.restorable_steps(), vec![2, 4, 5]);

    // The multi-chunk item is chunked at 64 KiB and compressed on disk.
    let m = store.slot("disk").unwrap().tier.read_manifest(4, 0).unwrap();
    let w = &m.items[m.item_index("model/w").unwrap()];
    assert_eq!(w.chunks.len(), 4);
    assert!(w.chunks.iter().any(|c| c.codec == "zstd"), "{:?}", w.chunks);

    for step in [4, 5] {
        for (name, label, view) in restore_check(&store, step, None, &data[step as usize - 1]) {
            assert_eq!(label, "ram", "step {step} item {name}");
            assert!(view || name == "optim/empty", "step {step} item {name} is not a zero-copy view");
        }
    }
    for (name, label, view) in restore_check(&store, 2, None, &data[1]) {
        assert_eq!(label, "disk", "step 2 item {name}");
        assert!(!view);
    }
    // Step 4 restores from disk alone too.
    for (_, label, _) in restore_check(&store, 4, Some(&["disk".to_string()]), &data[3]) {
        assert_eq!(label, "disk");
    }
    for step in [1, 3, 6] {
        let e = StepReader::open(&store, step, 0, None, &JobFilter::Mine).err().expect("step should not be restorable");
        assert_eq!(e.kind, ErrorKind::NotFound, "{}", e.message);
        assert!(e.message.contains(&format!("step {step}")), "{}", e.message);
    }
    store.close();
}

#[test]
fn corrupt_ram_copy_falls_back_to_disk() {
    let dirs = Dirs::new();
    let policy = dirs.policy("keep = 2", Some("every = 2\ncompression = \"zstd:3\""), "chunk_size = \"64KiB\"");
    let store = Store::open(policy, 0, 1).unwrap();
    let data: Vec<_> = (1..=4).map(step_items).collect();
    for step in 1..=4u64 {
        save_wait(&store, step, &data[step as usize - 1]);
    }
    store.flush();

    // Damage chunk 1 of model/w in the ram copy of step 4.
    let ram = store.memory();
    let m = ram.read_manifest(4, 0).unwrap();
    let c = &m.items[m.item_index("model/w").unwrap()].chunks[1];
    let path = dirs.ram().join(format::step_dir(4)).join(&m.objects[c.object as usize].name);
    assert_eq!(path.file_name().unwrap(), "rank-00000.part-000.data");
    flip_byte(&path, c.stored_offset + 1000);

    let reader = StepReader::open(&store, 4, 0, None, &JobFilter::Mine).unwrap();
    assert_eq!(reader.tiers(), vec!["ram", "disk"]);
    let w = reader.manifest().item_index("model/w").unwrap();
    let got = restore_check(&store, 4, None, &data[3]);
    for (name, label, view) in &got {
        if name == "model/w" {
            assert!(label == "ram+disk" || label == "disk", "model/w came from {label}");
            assert!(!view);
        } else {
            assert_eq!(label, "ram", "{name}");
        }
    }
    let (bytes, _) = reader.read_items(&[w]).unwrap().remove(0);
    assert!(bytes.bytes() == &data[3][0][0].bytes[..]);
    let warnings = reader.warnings.lock().clone();
    assert!(warnings.iter().any(|w| w.contains("model/w") && w.contains("tier 'ram'")), "{warnings:?}");

    // With ram alone there is nothing to fall back to.
    let only_ram = ["ram".to_string()];
    let reader = StepReader::open(&store, 4, 0, Some(&only_ram), &JobFilter::Mine).unwrap();
    let e = reader.read_items(&[w]).err().expect("corrupt chunk must not restore");
    assert_eq!(e.kind, ErrorKind::Integrity, "{}", e.message);
    for want in ["tier 'ram'", "step 4", "rank 0", "'model/w'", "chunk 1"] {
        assert!(e.message.contains(want), "message lacks {want:?}: {}", e.message);
    }
    // The other items of the step are fine.
    let b = reader.manifest().item_index("optim/m").unwrap();
    assert!(reader.read_items(&[b]).unwrap()[0].0.bytes() == &data[3][1][0].bytes[..]);
    store.close();
}

#[test]
fn capacity_evicts_old_steps_and_refuses_what_cannot_fit() {
    let dirs = Dirs::new();
    // A step is 256 KiB of data plus a manifest and a commit record (a page each).
    let step_puts = |step: u64| vec![vec![item("a", "uint8", noise(192 << 10, step)), item("b", "float32", floats(16 << 10, step))]];
    let policy = dirs.policy("keep = 100\ncapacity = \"680KiB\"", None, "chunk_size = \"64KiB\"");
    let cap = policy.memory_tier().capacity.unwrap();
    let store = Store::open(policy, 0, 1).unwrap();
    for step in 1..=6u64 {
        let h = save_wait(&store, step, &step_puts(step));
        assert_eq!(state(&h, "ram"), TierState::Done);
        store.flush();
        let used = store.memory().used_bytes().unwrap();
        assert!(used <= cap, "step {step}: {used} bytes used of {cap}");
        let ram = store.memory().committed_steps().unwrap();
        assert_eq!(ram.last(), Some(&step));
        assert!(ram.len() <= 2, "step {step}: ram holds {ram:?}");
        for s in ram {
            restore_check(&store, s, None, &step_puts(s));
        }
    }
    let before = store.memory().committed_steps().unwrap();
    assert_eq!(before.last(), Some(&6));

    // A step bigger than the whole tier.
    let big = vec![vec![item("huge", "uint8", noise(1 << 20, 7))]];
    let e = save(&store, 7, &big).err().expect("a step larger than capacity must fail");
    assert_eq!(e.kind, ErrorKind::Capacity, "{}", e.message);
    for want in ["tier 'ram'", "step 7", "capacity"] {
        assert!(e.message.contains(want), "message lacks {want:?}: {}", e.message);
    }
    store.flush();
    let after = store.memory().committed_steps().unwrap();
    assert!(after.contains(&6), "the newest committed step was evicted: {after:?}");
    for s in &after {
        restore_check(&store, *s, None, &step_puts(*s));
    }
    assert!(!store.memory().all_steps().unwrap().contains(&7));
    assert!(!dirs.ram().join(format::step_dir(7)).exists() || files_under(&dirs.ram().join(format::step_dir(7))).is_empty());

    // And saving goes on.
    save_wait(&store, 8, &step_puts(8));
    restore_check(&store, 8, None, &step_puts(8));
    store.close();
}

#[test]
fn dropped_writer_leaves_nothing() {
    let dirs = Dirs::new();
    let policy = dirs.policy("keep = 5", Some("compression = \"zstd:3\""), "chunk_size = \"64KiB\"");
    let store = Store::open(policy, 0, 1).unwrap();
    let data: Vec<_> = (1..=3).map(step_items).collect();
    save_wait(&store, 1, &data[0]);
    save_wait(&store, 2, &data[1]);
    store.flush();
    let before = steps_of(&store);

    {
        let puts = &data[2];
        let mut w = store.begin(3).unwrap();
        let (_, placed) = w.add_part("put0", json!([]), puts[0].iter().map(spec).collect()).unwrap();
        let srcs: Vec<(usize, usize)> = placed.iter().zip(&puts[0]).map(|(&(i, _), it)| (i, it.bytes.as_ptr() as usize)).collect();
        unsafe { w.copy_items(&srcs).unwrap() };
        w.add_part("put1", json!([]), puts[1].iter().map(spec).collect()).unwrap();
        assert!(!files_under(&dirs.ram().join(format::step_dir(3))).is_empty(), "the writer allocated nothing");
        // Dropped here without commit, as when the training step raises.
    }
    store.flush();
    let leftovers = files_under(&dirs.ram().join(format::step_dir(3)));
    assert!(leftovers.is_empty(), "the dropped step left {leftovers:?}");
    assert!(files_under(&dirs.disk().join(format::step_dir(3))).is_empty());
    assert_eq!(steps_of(&store), before);
    restore_check(&store, 1, None, &data[0]);
    restore_check(&store, 2, None, &data[1]);
    assert!(StepReader::open(&store, 3, 0, None, &JobFilter::Mine).is_err());

    // The same step can be saved again afterwards.
    let h = save_wait(&store, 3, &data[2]);
    assert_eq!(h.states().iter().filter(|(_, s)| *s == TierState::Done).count(), 2);
    store.flush();
    restore_check(&store, 3, None, &data[2]);
    restore_check(&store, 3, Some(&["disk".to_string()]), &data[2]);
    store.close();
}

#[test]
fn bandwidth_limits_persistence() {
    let dirs = Dirs::new();
    let policy = dirs.policy("", Some("bandwidth = \"20MB/s\"\ncompression = \"none\""), "chunk_size = \"1MiB\"");
    assert_eq!(policy.tier("disk").unwrap().bandwidth, Some(20_000_000));
    let store = Store::open(policy, 0, 1).unwrap();
    let puts = vec![vec![item("big", "uint8", (0..10_000_000u32).map(|i| (i ^ (i >> 11)) as u8).collect())]];
    let h = save_wait(&store, 1, &puts);
    let took = h.elapsed().as_secs_f64();
    // 10 MB at 20 MB/s is 0.5 s, less the 50 ms burst the bucket allows.
    assert!(took >= 0.4, "10 MB persisted in {took:.3} s despite a 20 MB/s limit");
    assert!(took < 10.0, "persisting 10 MB took {took:.3} s");
    assert_eq!(state(&h, "disk"), TierState::Done);
    restore_check(&store, 1, Some(&["disk".to_string()]), &puts);
    store.close();
}

/// Byte ranges of one item: at chunk boundaries, inside one chunk, across chunks, the whole
/// item, empty; zero-copy from ram, owned from disk; only the chunks the range touches are
/// read (a corrupt chunk outside it goes unnoticed, one inside falls back to the next tier).
#[test]
fn read_range_reads_only_the_chunks_it_needs() {
    let dirs = Dirs::new();
    let policy = dirs.policy("keep = 2", Some("compression = \"zstd:3\""), "chunk_size = \"64KiB\"");
    let store = Store::open(policy, 0, 1).unwrap();
    let data = step_items(1);
    save_wait(&store, 1, &data);
    store.flush();
    let want = &data[0][0].bytes; // model/w: 200012 bytes, chunks of 65536 (4, the last short)
    const C: u64 = 64 << 10;
    let n = want.len() as u64;
    let ranges = [(C, C), (C + 100, 300), (C - 10, 2 * C + 20), (0, n), (3 * C, n - 3 * C), (n - 1, 1), (5, 0), (n, 0)];
    let only = |t: &str| vec![t.to_string()];
    let check = |tiers: Option<&[String]>, label: &str, view: bool| {
        let reader = StepReader::open(&store, 1, 0, tiers, &JobFilter::Mine).unwrap();
        let w = reader.manifest().item_index("model/w").unwrap();
        assert_eq!(reader.manifest().items[w].chunks.len(), 4);
        for (start, len) in ranges {
            let (d, from) = reader.read_range(w, start, len).unwrap_or_else(|e| panic!("{start}+{len}: {e}"));
            assert!(d.bytes() == &want[start as usize..(start + len) as usize], "{start}+{len} from {from}");
            assert_eq!(from, label, "{start}+{len}");
            if len > 0 {
                assert_eq!(matches!(d, ItemData::View { .. }), view, "{start}+{len}");
            }
        }
        for (start, len) in [(n, 1), (0, n + 1), (u64::MAX, 2)] {
            let e = reader.read_range(w, start, len).err().expect("out of range");
            assert_eq!(e.kind, ErrorKind::InvalidArgument, "{}", e.message);
            assert!(e.message.contains("model/w") && e.message.contains("outside"), "{}", e.message);
        }
        assert_eq!(reader.read_range(99, 0, 1).err().unwrap().kind, ErrorKind::InvalidArgument);
        assert!(reader.warnings.lock().is_empty(), "{:?}", reader.warnings.lock());
    };
    check(None, "ram", true);
    check(Some(&only("disk")), "disk", false);

    // Damage the last chunk of model/w on both tiers' copies... first on disk alone.
    let disk_m = store.slot("disk").unwrap().tier.read_manifest(1, 0).unwrap();
    let w = disk_m.item_index("model/w").unwrap();
    let c3 = &disk_m.items[w].chunks[3];
    flip_byte(&dirs.disk().join(disk_m.objects[c3.object as usize].key_in(1)), c3.stored_offset + c3.stored_len / 2);
    let reader = StepReader::open(&store, 1, 0, Some(&only("disk")), &JobFilter::Mine).unwrap();
    let (d, _) = reader.read_range(w, 0, 3 * C).unwrap();
    assert!(d.bytes() == &want[..3 * C as usize]);
    assert!(reader.warnings.lock().is_empty(), "a chunk outside the range was read: {:?}", reader.warnings.lock());
    let e = reader.read_range(w, 3 * C - 1, 2).err().expect("the damaged chunk is in range");
    assert_eq!(e.kind, ErrorKind::Integrity, "{}", e.message);
    assert!(e.message.contains("chunk 3") && e.message.contains("tier 'disk'"), "{}", e.message);
    assert_eq!(reader.read_items(&[w]).err().expect("whole item").kind, ErrorKind::Integrity);

    // Then on ram: outside the range it stays unread (still zero-copy); inside, that chunk
    // comes from disk, whose copy of chunk 3 is damaged too: only chunk 1 is tested there.
    let ram_m = store.memory().read_manifest(1, 0).unwrap();
    let c1 = &ram_m.items[w].chunks[1];
    flip_byte(&dirs.ram().join(format::step_dir(1)).join(&ram_m.objects[c1.object as usize].name), c1.stored_offset + 7);
    let reader = StepReader::open(&store, 1, 0, None, &JobFilter::Mine).unwrap();
    let (d, from) = reader.read_range(w, 2 * C + 5, C).unwrap();
    assert_eq!(from, "ram");
    assert!(matches!(d, ItemData::View { .. }));
    assert!(d.bytes() == &want[(2 * C + 5) as usize..(3 * C + 5) as usize]);
    assert!(reader.warnings.lock().is_empty(), "{:?}", reader.warnings.lock());
    let (d, from) = reader.read_range(w, C + 10, 20).unwrap();
    assert_eq!(from, "disk");
    assert!(d.bytes() == &want[(C + 10) as usize..(C + 30) as usize]);
    let (d, from) = reader.read_range(w, C / 2, 2 * C).unwrap();
    assert_eq!(from, "ram+disk");
    assert!(!matches!(d, ItemData::View { .. }));
    assert!(d.bytes() == &want[(C / 2) as usize..(C / 2 + 2 * C) as usize]);
    let warnings = reader.warnings.lock().clone();
    assert!(warnings.iter().all(|w| w.contains("chunk 1")) && !warnings.is_empty(), "{warnings:?}");
    store.close();
}

/// A background failure keeps its error whole: kind, message and fields.
#[test]
fn a_failed_persist_keeps_its_error() {
    let dirs = Dirs::new();
    let store = Store::open(dirs.policy("", Some("compression = \"none\""), "chunk_size = \"64KiB\""), 0, 1).unwrap();
    save_wait(&store, 1, &step_items(1));
    std::fs::remove_dir_all(dirs.disk()).unwrap();
    std::fs::write(dirs.disk(), b"in the way").unwrap();
    let h = save_wait(&store, 2, &step_items(2));
    assert_eq!(state(&h, "ram"), TierState::Done);
    let TierState::Failed(e) = state(&h, "disk") else { panic!("{:?}", h.states()) };
    assert_eq!(e.kind, ErrorKind::TierUnavailable, "{e}");
    let f = &e.fields;
    assert_eq!((f.tier.as_deref(), f.step, f.rank), (Some("disk"), Some(2), Some(0)));
    assert!(f.path.as_deref().is_some_and(|p| p.starts_with(&dirs.disk().display().to_string())), "{e:?}");
    assert!(e.message.starts_with("persisting step 2 of rank 0 to tier 'disk': "), "{e}");
    store.close();
}

// ---------------------------------------------------------------------------------------------
// Known core bugs: the behaviour these check is what the API promises; each is ignored until
// the fix named in its reason lands (then drop the `ignore`).
// ---------------------------------------------------------------------------------------------

/// A step that can never fit must fail before anything is evicted for it.
#[test]
fn oversized_step_evicts_nothing() {
    let dirs = Dirs::new();
    let puts = |step: u64| vec![vec![item("a", "uint8", noise(64 << 10, step))]];
    let store = Store::open(dirs.policy("keep = 100\ncapacity = \"1MiB\"", None, "chunk_size = \"64KiB\""), 0, 1).unwrap();
    for step in 1..=3 {
        save_wait(&store, step, &puts(step));
    }
    store.flush();
    let before = store.memory().committed_steps().unwrap();
    let big = vec![vec![item("huge", "uint8", noise(2 << 20, 9))]];
    assert_eq!(save(&store, 4, &big).err().expect("must not fit").kind, ErrorKind::Capacity);
    assert_eq!(store.memory().committed_steps().unwrap(), before, "steps were evicted for a step that could never fit");
    for s in before {
        restore_check(&store, s, None, &puts(s));
    }
    store.close();
}

/// A dropped writer removes its (then empty) step directory, so no phantom step is listed.
#[test]
fn dropped_writer_removes_its_step_dir() {
    let dirs = Dirs::new();
    let store = Store::open(dirs.policy("", None, "chunk_size = \"64KiB\""), 0, 1).unwrap();
    let puts = step_items(1);
    {
        let mut w = store.begin(1).unwrap();
        w.add_part("put0", json!([]), puts[0].iter().map(spec).collect()).unwrap();
    }
    assert!(!dirs.ram().join(format::step_dir(1)).exists());
    assert_eq!(store.memory().all_steps().unwrap(), Vec::<u64>::new());
    store.close();
}

#[test]
fn a_new_job_told_its_state_size_prefaults_its_first_save() {
    let dirs = Dirs::new();
    let store = Store::open(dirs.policy("keep = 2", Some(""), "chunk_size = \"64KiB\""), 0, 1).unwrap();
    // The bytes of each part's items, as a caller knows them from its state (no alignment).
    let sizes: Vec<u64> = step_items(1).iter().map(|part| part.iter().map(|it| it.bytes.len() as u64).sum()).collect();
    store.prefault(&sizes);
    store.prefault(&[1 << 30]); // once per process: a second call queues nothing
    store.flush();
    assert_eq!(store.memory().pool_len(), sizes.len(), "one segment per part");
    let mut w = store.begin(1).unwrap();
    for (p, items) in step_items(1).iter().enumerate() {
        w.add_part(&format!("put{p}"), json!([]), items.iter().map(spec).collect()).unwrap();
    }
    assert_eq!(store.memory().pool_len(), 0, "the first save used the pre-faulted segments");
    drop(w);
    store.close();
}

#[test]
fn a_restarted_job_prefaults_its_first_save_after_restoring_from_ram() {
    let dirs = Dirs::new();
    let policy = || dirs.policy("keep = 2", Some(""), "chunk_size = \"64KiB\"");
    let first = Store::open(policy(), 0, 1).unwrap();
    save_wait(&first, 1, &step_items(1));
    first.close();

    // Restored from the fs tier only: its layout says nothing of the memory tier's segments.
    let again = Store::open(policy(), 0, 1).unwrap();
    restore_check(&again, 1, Some(&["disk".to_string()]), &step_items(1));
    again.flush();
    assert_eq!(again.memory().pool_len(), 0, "a restore from disk pre-faults nothing");
    again.close();

    // Restored from RAM: segments of the restored parts' sizes wait for the first save,
    // queued once the restore is done, so that they take no core from it.
    let restarted = Store::open(policy(), 0, 1).unwrap();
    assert_eq!(restarted.memory().pool_len(), 0, "nothing is pre-faulted at open");
    let looked = StepReader::open(&restarted, 1, 0, None, &JobFilter::Mine).unwrap();
    drop(looked);
    restarted.flush();
    assert_eq!(restarted.memory().pool_len(), 0, "a reader that read nothing pre-faults nothing");
    let reading = StepReader::open(&restarted, 1, 0, None, &JobFilter::Mine).unwrap();
    let got = reading.read_items(&(0..reading.manifest().items.len()).collect::<Vec<_>>()).unwrap();
    restarted.flush();
    assert_eq!(restarted.memory().pool_len(), 0, "nothing is pre-faulted while the restore's reader lives");
    drop((got, reading));
    restore_check(&restarted, 1, None, &step_items(1));
    restarted.flush();
    assert_eq!(restarted.memory().pool_len(), step_items(1).len(), "one segment per part of the restored step");
    let pooled = files_under(&dirs.ram().join(".pool"));
    assert_eq!(pooled.len(), 2, "{pooled:?}");
    // The first save takes them (the flush then pre-faults the next step's, as after any save).
    let mut w = restarted.begin(2).unwrap();
    for (p, items) in step_items(2).iter().enumerate() {
        w.add_part(&format!("put{p}"), json!([]), items.iter().map(spec).collect()).unwrap();
    }
    assert_eq!(restarted.memory().pool_len(), 0, "the first save used the pre-faulted segments");
    drop(w);
    restarted.close();
}
