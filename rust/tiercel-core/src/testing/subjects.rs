//! The implementations under test, each fresh and empty, with what keeps its storage alive.
//! Object stores need a server: `{var}_ENDPOINT` and `{var}_BUCKET` name it (for s3 the moto
//! server and bucket that `tests/servers.py`, run by `make test-rust`, starts and makes);
//! without them the runner reports those kinds as ignored, saying why.

use std::sync::Arc;
use std::time::Duration;

use super::{Guard, Rules};
use crate::blobs::{Blobs, FsBlobs};
use crate::codec::{Codec, Compression};
use crate::lease::WriterLease;
use crate::object::{Env, ObjectBlobs};
use crate::placement::Strategy;
use crate::policy::{Policy, TierKind, TierSpec};
use crate::tier::blob::BlobTier;
use crate::tier::memory::MemoryTier;
use crate::tier::peer::{PeerOptions, PeerTier, REPLICA_DIR};
use crate::tier::Tier;
use crate::transport::server::Limits;

/// A tier under test, the objects its bytes are stored in (to look at and damage them), its
/// rules, and what keeps its storage alive.
pub struct TierSubject {
    pub tier: Arc<dyn Tier>,
    pub storage: Arc<dyn Blobs>,
    pub rules: Rules,
    /// Rank 1's view of the same tier, where ranks write through tiers of their own (peer).
    pub rank1: Option<Arc<dyn Tier>>,
    pub guard: Guard,
}

/// A `Blobs` backend under test, empty, and what keeps it alive.
pub struct BlobsSubject {
    pub blobs: Arc<dyn Blobs>,
    pub guard: Guard,
}

pub fn zstd3() -> Compression {
    Compression { codec: Codec::Zstd { level: 3 }, bytegroup: false }
}

pub fn bytegroup_zstd3() -> Compression {
    Compression { codec: Codec::Zstd { level: 3 }, bytegroup: true }
}

fn tempdir_in(base: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix("tiercel-conformance-").tempdir_in(base).expect("tempdir")
}

fn temp_base() -> String {
    std::env::temp_dir().display().to_string()
}

/// A memory tier with a live writer, as a running job's: the subject holds rank 0's writer
/// lease on its root (a Store takes it at its first save), so an uncommitted step newer than
/// every committed one is a save in progress, not a dead writer's leftover (`gc`).
pub fn memory_tier() -> TierSubject {
    let dir = tempdir_in("/dev/shm");
    let tier: Arc<dyn Tier> = MemoryTier::open("ram", dir.path(), None).expect("open memory tier");
    let storage = Arc::new(FsBlobs::new("ram", dir.path()).expect("open fs blobs"));
    let writer = WriterLease::take(dir.path(), 0, "the conformance suite").expect("writer lease").expect("no other writer");
    TierSubject { tier, storage, rules: Rules::default(), rank1: None, guard: Box::new((writer, dir)) }
}

pub fn fs_tier(compression: Compression) -> TierSubject {
    let dir = tempdir_in(&temp_base());
    let storage: Arc<dyn Blobs> = Arc::new(FsBlobs::new("disk", dir.path()).expect("open fs blobs"));
    let tier: Arc<dyn Tier> = Arc::new(BlobTier::new("disk", storage.clone(), compression));
    TierSubject { tier, storage, rules: Rules::default(), rank1: None, guard: Box::new(dir) }
}

/// Why the object-store kinds of `var` cannot run here (`hint`: how to make them run), or
/// None when they can.
pub fn server_missing(var: &str, hint: &str) -> Option<String> {
    let missing: Vec<String> =
        ["ENDPOINT", "BUCKET"].iter().map(|k| format!("{var}_{k}")).filter(|v| std::env::var_os(v).is_none()).collect();
    (!missing.is_empty()).then(|| format!("${} not set ({hint})", missing.join(" and $")))
}

/// Objects under a fresh prefix of the bucket `{var}_BUCKET` at `{var}_ENDPOINT`, removed
/// with the guard. No GCS emulator here takes the XML API writes the gcs kind sends (see
/// docs/object-store.md), so gcs runs only when pointed at a real bucket.
pub fn object_blobs(kind: TierKind, var: &str) -> BlobsSubject {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let get = |k: &str| std::env::var(format!("{var}_{k}")).unwrap_or_else(|_| panic!("${var}_{k} is not set"));
    let (endpoint, bucket) = (get("ENDPOINT"), get("BUCKET"));
    let scheme = if kind == TierKind::Gcs { "gs" } else { "s3" };
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let prefix = format!("conformance-{}-{n}", std::process::id());
    // Through the policy parser, as a user's tier would be.
    let spec = |url: String| -> TierSpec {
        let json = serde_json::json!({"tier": [
            {"name": "ram", "kind": "memory", "root": "/unused"},
            {"name": kind.as_str(), "kind": kind.as_str(), "url": url, "endpoint": endpoint, "retries": 3,
             "part_size": "5MiB"},
        ]});
        Policy::from_json(&json.to_string(), "<conformance>").expect("policy").tiers.remove(1).spec
    };
    // The process's settings (to run the suite against a real bucket), else the test
    // servers' key.
    let mut env = Env::process();
    if !env.vars.contains_key("AWS_ACCESS_KEY_ID") {
        env.vars.insert("AWS_ACCESS_KEY_ID".into(), "tiercel-test-key".into());
        env.vars.insert("AWS_SECRET_ACCESS_KEY".into(), "tiercel-test-secret-0123456789".into());
    }
    let blobs = ObjectBlobs::open_with(kind.as_str(), &spec(format!("{scheme}://{bucket}/{prefix}")), &env).expect("open object store");
    let root = ObjectBlobs::open_with(kind.as_str(), &spec(format!("{scheme}://{bucket}")), &env).expect("open bucket");
    struct Cleanup(ObjectBlobs, String);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = self.0.delete_prefix(&self.1);
        }
    }
    BlobsSubject { blobs: Arc::new(blobs), guard: Box::new(Cleanup(root, prefix)) }
}

pub fn object_tier(kind: TierKind, var: &str, compression: Compression) -> TierSubject {
    let BlobsSubject { blobs, guard } = object_blobs(kind, var);
    let tier: Arc<dyn Tier> = Arc::new(BlobTier::new(kind.as_str(), blobs.clone(), compression));
    TierSubject { tier, storage: blobs, rules: Rules::default(), rank1: None, guard }
}

/// The scale simulator's object store (`sim::store`), without latency or rate limits: it
/// must keep the same contract as the stores it stands in for. Parts of 5 MiB, as the
/// object-store subjects', so that the suite's large object goes up as a multipart upload.
pub fn sim_blobs() -> BlobsSubject {
    use super::sim::store::{SimBlobs, SimOptions};
    let opts = SimOptions { latency: Duration::ZERO, write_rate: 1e9, read_rate: 1e9, part_size: 5 << 20, ..Default::default() };
    BlobsSubject { blobs: Arc::new(SimBlobs::new(opts)), guard: Box::new(()) }
}

pub fn fs_blobs() -> BlobsSubject {
    let dir = tempdir_in(&temp_base());
    BlobsSubject { blobs: Arc::new(FsBlobs::new("disk", dir.path()).expect("open fs blobs")), guard: Box::new(dir) }
}

/// The peer tier of rank 0 on "host A", with rank 1 on "host B", both in this process and
/// each with its own memory root, talking over loopback. Host B holds rank 0's replicas:
/// `storage` is its replica store.
pub fn peer_tier() -> TierSubject {
    let dir = tempdir_in("/dev/shm");
    let open = |rank: u32, host: &str| {
        let opts = PeerOptions {
            listen: "127.0.0.1:0".into(),
            replicas: 2,
            strategy: Strategy::Mixed,
            // More than any test writes: retention is the holders' business, tested apart.
            keep: 100,
            secret: Some(b"conformance-suite-peer-secret-32b".to_vec()),
            timeout: Duration::from_secs(10),
            limits: Limits::default(),
        };
        PeerTier::open("peer", rank, &dir.path().join(host), opts).expect("open peer tier")
    };
    let (a, b) = (open(0, "hostA"), open(1, "hostB"));
    let hosts = ["hostA".to_string(), "hostB".to_string()];
    let addrs = [a.local_addr().to_string(), b.local_addr().to_string()];
    a.set_cluster("conformance", &hosts, &addrs).expect("cluster");
    b.set_cluster("conformance", &hosts, &addrs).expect("cluster");
    let storage = Arc::new(FsBlobs::new("peer", &dir.path().join("hostB").join(REPLICA_DIR)).expect("open replica store"));
    struct Peers(Vec<Arc<PeerTier>>, #[allow(dead_code)] tempfile::TempDir);
    impl Drop for Peers {
        fn drop(&mut self) {
            self.0.iter().for_each(|p| p.shutdown());
        }
    }
    let guard = Box::new(Peers(vec![a.clone(), b.clone()], dir));
    TierSubject { tier: a, storage, rules: Rules { per_rank_commit: true, deletes: false }, rank1: Some(b), guard }
}
