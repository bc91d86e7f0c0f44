//! The gc rule (`crate::gc`) as the directory and memory tiers apply it: a plan that lists what
//! goes and why, and a run that removes exactly that.

use std::os::unix::fs::symlink;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::blobs::{Blobs, FsBlobs};
use crate::codec::Compression;
use crate::error::Result;
use crate::format::{self, ChunkSource, Manifest};
use crate::gc::{steps_of, GcOptions, ABANDONED};
use crate::lease::WriterLease;
use crate::scheduler::Link;
use crate::tier::blob::BlobTier;
use crate::tier::memory::MemoryTier;
use crate::tier::{run_gc, Tier};

/// The plan of a directory tier and of the memory tier: what goes and what stays, and a
/// run that removes exactly what the plan said.
#[test]
fn plans_of_directory_and_memory_tiers() {
    let old = SystemTime::now() - Duration::from_secs(7200);
    let touch = |p: &std::path::Path| {
        std::fs::write(p, b"tmp").unwrap();
        std::fs::File::options().write(true).open(p).unwrap().set_modified(old).unwrap();
    };
    let dir = tempfile::tempdir().unwrap();
    let outside = dir.path().join("outside.tmp-999999999-1");
    std::fs::write(&outside, b"keep me").unwrap();
    let disk = dir.path().join("disk");
    let blobs: Arc<dyn Blobs> = Arc::new(FsBlobs::new("disk", &disk).unwrap());
    let disk_tier = BlobTier::new("disk", blobs.clone(), Compression::none());
    let ram_root = tempfile::Builder::new().prefix("tiercel-gc-test").tempdir_in("/dev/shm").unwrap();
    let ram = MemoryTier::open("ram", ram_root.path(), None).unwrap();
    // A live writer of the memory root: its uncommitted steps may still commit.
    let writer = WriterLease::take(ram_root.path(), 0, "this test").unwrap().unwrap();
    for (tier, root) in [(&disk_tier as &dyn Tier, disk.as_path()), (&*ram as &dyn Tier, ram_root.path())] {
        // Steps 1..=4 committed, 5 written by a rank that died; 6 on its way (newest).
        for step in 1..=6u64 {
            let m = Manifest::new(step, 0, if step == 5 { 2 } else { 1 }, "x", 4096);
            tier.write_rank(&m, &NoChunks, &Link::new("l", None)).unwrap();
            if step != 5 && step != 6 {
                assert!(tier.try_commit(step, 1).unwrap());
            }
        }
        let step_dir = |s: u64| root.join(format::step_dir(s));
        let stale = step_dir(4).join("rank-00000.data.tmp-999999999-0");
        let live = step_dir(4).join(format!("rank-00001.data.tmp-{}-0", std::process::id()));
        let young = step_dir(4).join("rank-00002.data.tmp-999999999-0");
        touch(&stale);
        touch(&live);
        std::fs::write(&young, b"tmp").unwrap();
        touch(&step_dir(2).join("rank-00003.data.tmp-999999999-0")); // in a step that goes anyway
        symlink(&outside, step_dir(4).join("link.tmp-999999999-2")).unwrap();

        let opts = GcOptions { keep: Some(2), temp_age: Some(Duration::from_secs(600)), ..Default::default() };
        let plan = tier.gc_plan(&opts).unwrap();
        let shown: Vec<(String, Option<u64>, Option<String>)> =
            plan.iter().map(|r| (r.what().to_string(), r.step(), r.key().map(String::from))).collect();
        let tmp_key = format!("{}/rank-00000.data.tmp-999999999-0", format::step_dir(4));
        let mut want: Vec<(String, Option<u64>, Option<String>)> =
            vec![("step".into(), Some(1), None), ("step".into(), Some(2), None), ("temp file".into(), None, Some(tmp_key))];
        if std::ptr::eq(root, disk.as_path()) {
            // In rank areas (version 3): the removed steps' manifests too (no data objects:
            // these manifests have no chunks).
            for s in [1, 2] {
                want.push(("object".into(), None, Some(format::area_manifest_key(s, 0))));
            }
        }
        assert_eq!(shown, want, "{}", tier.name());
        assert!(plan[2].reason.contains("pid 999999999") && plan[2].bytes() == Some(3), "{:?}", plan[2]);
        // Without temp_age (the retention run after a save) files are left alone.
        assert_eq!(steps_of(&tier.gc_plan(&GcOptions { temp_age: None, ..opts.clone() }).unwrap()), vec![1, 2]);
        let done = run_gc(tier, &opts).unwrap();
        assert_eq!(done.len(), want.len());
        assert_eq!(tier.all_steps().unwrap(), vec![3, 4, 5, 6], "{}", tier.name());
        assert!(!stale.exists() && live.exists() && young.exists());
        assert!(step_dir(4).join("link.tmp-999999999-2").is_symlink());
        assert_eq!(std::fs::read(&outside).unwrap(), b"keep me");
        assert!(tier.gc_plan(&opts).unwrap().is_empty(), "{}: a second run finds nothing", tier.name());
    }

    // The writer gone (killed mid-save): nobody will commit steps 5 and 6 in memory.
    drop(writer);
    let opts = GcOptions { temp_age: Some(Duration::from_secs(600)), ..Default::default() };
    let plan = ram.gc_plan(&opts).unwrap();
    assert_eq!(plan.iter().map(|r| (r.step(), r.reason.as_str())).collect::<Vec<_>>(), vec![(Some(5), ABANDONED), (Some(6), ABANDONED)]);
    assert!(ram.gc_plan(&GcOptions::default()).unwrap().is_empty(), "only a run for dead writers' leftovers");
    assert_eq!(steps_of(&run_gc(&*ram, &opts).unwrap()), vec![5, 6]);
    assert_eq!(ram.all_steps().unwrap(), vec![3, 4]);

    // A spare segment of a process that is gone (a killed trainer's pool).
    let dead = ram_root.path().join(".pool").join("999999999-0.seg");
    std::fs::write(&dead, vec![0u8; 8192]).unwrap();
    let plan = ram.gc_plan(&GcOptions::default()).unwrap();
    assert_eq!(plan.len(), 1);
    assert_eq!((plan[0].what(), plan[0].key()), ("segment", Some(".pool/999999999-0.seg")));
    assert!(plan[0].reason.contains("pid 999999999"), "{}", plan[0].reason);
    run_gc(&*ram, &GcOptions::default()).unwrap();
    assert!(!dead.exists());
}

struct NoChunks;
impl ChunkSource for NoChunks {
    fn read_raw(&self, _: usize, _: usize, _: &mut [u8]) -> Result<()> {
        unreachable!("a manifest without items has no chunks")
    }
}
