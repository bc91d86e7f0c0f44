//! `SimBlobs`: an in-process object store, as `Blobs`, that answers the way S3 does where
//! it matters at scale: every request costs a round trip (`SimOptions::latency`, slept half
//! on the way there and half on the way back, so an object becomes visible mid-request), and
//! each key prefix admits at most `write_rate` PUT/POST/DELETE and `read_rate` GET/HEAD/LIST
//! requests per second (token buckets holding one second's worth), answering 503 SlowDown
//! above that. A refused request is retried as object_store's client retries a 5xx (the
//! client `ObjectBlobs` runs on): exponential backoff with jitter from 100 ms, at most 15 s,
//! 10 retries, then the call fails.
//!
//! Each `Blobs` call is charged the S3 requests `ObjectBlobs` makes for it (object/mod.rs):
//! `put`, `put_if_absent` one PUT; a streamed object one PUT up to a part, else a multipart
//! upload (POST, marker PUT, one PUT per part, POST, marker DELETE); `get`, `get_range` one
//! GET; `exists` one HEAD; `list` one LIST per 1,000 names; `delete` one DELETE;
//! `delete_names` one DeleteObjects POST per 1,000 keys; `delete_prefix` a recursive LIST
//! and one DeleteObjects POST per 1,000 keys; `leftovers` a LIST of `.uploads/` (which gc
//! skips where the root has none, as on S3).
//!
//! A prefix, for the rates (`prefix_of`), is a key's first `SimOptions::prefix_depth`
//! '/'-separated parts (2: the key up to its second '/'), or its whole directory where the
//! key has fewer; for a listing, the listed prefix cut the same way. Whatever layout the
//! keys follow, that is what S3 can rate separately once it has split its partitions at
//! those '/' boundaries: a step directory `step-<12>/` is one prefix for all its ranks'
//! objects, and a layout that puts each rank's objects under `<2 hex digits>/...` spreads
//! them over up to 256 (or more, one per second part). A real bucket splits partitions only
//! after minutes of sustained load, so this is the optimistic reading of S3's limit. A
//! DeleteObjects request is rated on the prefix of its first key (S3 documents no finer
//! rule for a request that names keys under several).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use crate::blobs::{BlobWriter, Blobs};
use crate::error::{Error, Result};
use crate::format;

/// How the simulated store answers.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// The round trip of one request.
    pub latency: Duration,
    /// PUT/POST/DELETE requests per second one prefix admits (S3: 3,500).
    pub write_rate: f64,
    /// GET/HEAD/LIST requests per second one prefix admits (S3: 5,500).
    pub read_rate: f64,
    /// Objects larger than this go up as multipart uploads (the tier's `part_size`).
    pub part_size: usize,
    /// Retries of a request answered 503 before the call fails (object_store: 10).
    pub retries: u32,
    /// How many leading '/'-separated parts of a key make its prefix for the rates
    /// (`prefix_of`).
    pub prefix_depth: usize,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            latency: Duration::from_millis(20),
            write_rate: 3500.0,
            read_rate: 5500.0,
            part_size: crate::policy::DEFAULT_PART_SIZE as usize,
            retries: 10,
            prefix_depth: 2,
        }
    }
}

/// The kinds of S3 request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Req {
    Get,
    Head,
    List,
    Put,
    Delete,
    /// Multipart create/complete and DeleteObjects (one per 1,000 keys).
    Post,
}

impl Req {
    pub const ALL: [Req; 6] = [Req::Get, Req::Head, Req::List, Req::Put, Req::Delete, Req::Post];

    pub fn name(self) -> &'static str {
        match self {
            Req::Get => "GET",
            Req::Head => "HEAD",
            Req::List => "LIST",
            Req::Put => "PUT",
            Req::Delete => "DELETE",
            Req::Post => "POST",
        }
    }

    fn is_write(self) -> bool {
        matches!(self, Req::Put | Req::Delete | Req::Post)
    }
}

/// What a request is about, from its key: the step layout's objects, or the root listing.
pub fn object_class(key: &str) -> &'static str {
    let name = key.rsplit('/').next().unwrap_or("");
    if key.is_empty() {
        "root"
    } else if name == format::COMMIT_NAME {
        "commit"
    } else if name.ends_with(".manifest.json") {
        "manifest"
    } else if name.ends_with(".data") {
        "data"
    } else if format::parse_step_dir(key).is_some() {
        "step"
    } else if format::parse_rank_dir(name).is_some() {
        // A listing of a rank's area (version 3).
        "area"
    } else {
        "other"
    }
}

struct Bucket {
    tokens: f64,
    at: Instant,
    /// Requests admitted since the last `take_tally`.
    admitted: u64,
}

/// The prefix whose rate a request about `key` takes: its first `depth` '/'-separated parts,
/// or all of its directory where it has fewer (a key at the root: ""). `listing` says that
/// `key` is itself a prefix (a LIST's, a recursive delete's), not an object's name.
pub fn prefix_of(key: &str, depth: usize, listing: bool) -> String {
    let key = key.trim_matches('/');
    let parts: Vec<&str> = key.split('/').filter(|p| !p.is_empty()).collect();
    let dir = if listing { parts.len() } else { parts.len().saturating_sub(1) };
    parts[..dir.min(depth)].join("/")
}

/// What one run of requests did: counts by (kind, object class), 503s, and the peak demand
/// on one prefix.
#[derive(Debug, Clone, Default)]
pub struct Tally {
    pub requests: BTreeMap<(Req, &'static str), u64>,
    pub slowdowns: u64,
    /// Requests admitted on the busiest prefix (writes, reads), 503s left out.
    pub admitted: (u64, u64),
    /// Requests (refused ones included) that arrived at the busiest prefix in its busiest
    /// second, by class: (writes, reads), and that prefix.
    pub peak_writes: (u64, String),
    pub peak_reads: (u64, String),
    /// Write requests (refused ones included) by prefix, and read requests by prefix.
    pub writes_by_prefix: BTreeMap<String, u64>,
    pub reads_by_prefix: BTreeMap<String, u64>,
    /// When the last manifest was put, and the last commit record (the step's, in a step's
    /// tally): the time from the last rank's data to the commit, whatever the key layout.
    pub last_manifest: Option<Instant>,
    pub last_commit: Option<Instant>,
}

impl Tally {
    pub fn by_kind(&self, kind: Req) -> u64 {
        self.requests.iter().filter(|((k, _), _)| *k == kind).map(|(_, n)| n).sum()
    }

    pub fn of(&self, kind: Req, class: &str) -> u64 {
        self.requests.iter().filter(|((k, c), _)| *k == kind && *c == class).map(|(_, n)| n).sum()
    }

    pub fn total(&self) -> u64 {
        self.requests.values().sum()
    }
}

/// The store (cheap to clone: its writers hold it too).
#[derive(Clone)]
pub struct SimBlobs(Arc<SimState>);

impl std::ops::Deref for SimBlobs {
    type Target = SimState;
    fn deref(&self) -> &SimState {
        &self.0
    }
}

pub struct SimState {
    opts: SimOptions,
    /// Objects by directory, then name: a listing reads one directory, not the whole store.
    dirs: RwLock<BTreeMap<String, BTreeMap<String, Vec<u8>>>>,
    buckets: Mutex<HashMap<(String, bool), Bucket>>,
    tally: Mutex<Tally>,
    /// Arrivals per (prefix, is_write, second since `start`).
    arrivals: Mutex<HashMap<(String, bool, u64), u64>>,
    start: Instant,
    /// Set to fail every request from now on (a run past its time limit).
    pub stop: AtomicBool,
    seed: AtomicU64,
}

/// Where `key` lives, for messages.
fn describe(key: &str) -> String {
    format!("sim://{}", key.trim_matches('/'))
}

fn split(key: &str) -> (&str, &str) {
    let key = key.trim_matches('/');
    match key.rfind('/') {
        Some(i) => (&key[..i], &key[i + 1..]),
        None => ("", key),
    }
}

impl SimBlobs {
    pub fn new(opts: SimOptions) -> SimBlobs {
        SimBlobs(Arc::new(SimState {
            opts,
            dirs: Default::default(),
            buckets: Default::default(),
            tally: Default::default(),
            arrivals: Default::default(),
            start: Instant::now(),
            stop: AtomicBool::new(false),
            seed: AtomicU64::new(0x9E37_79B9_7F4A_7C15),
        }))
    }
}

impl SimState {
    /// The tally since the last `take_tally`, and a fresh one from now.
    pub fn take_tally(&self) -> Tally {
        let mut t = std::mem::take(&mut *self.tally.lock());
        for ((_, write), b) in self.buckets.lock().iter_mut() {
            let most = if *write { &mut t.admitted.0 } else { &mut t.admitted.1 };
            *most = (*most).max(std::mem::take(&mut b.admitted));
        }
        let arrivals = std::mem::take(&mut *self.arrivals.lock());
        for ((prefix, write, _), n) in arrivals {
            *(if write { &mut t.writes_by_prefix } else { &mut t.reads_by_prefix }).entry(prefix.clone()).or_default() += n;
            let peak = if write { &mut t.peak_writes } else { &mut t.peak_reads };
            if n > peak.0 {
                *peak = (n, prefix);
            }
        }
        t
    }

    /// Keys in the store (for tests).
    pub fn keys(&self) -> Vec<String> {
        let dirs = self.dirs.read();
        dirs.iter().flat_map(|(d, m)| m.keys().map(move |n| if d.is_empty() { n.clone() } else { format!("{d}/{n}") })).collect()
    }

    fn jitter(&self, lo: f64, hi: f64) -> f64 {
        // xorshift64*: enough spread for backoff jitter, no dependency.
        let mut x = self.seed.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let u = (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64;
        lo + (hi - lo) * u
    }

    /// Whether prefix `prefix` admits one more request of this class now.
    fn admit(&self, prefix: &str, write: bool) -> bool {
        let rate = if write { self.opts.write_rate } else { self.opts.read_rate };
        let sec = self.start.elapsed().as_secs();
        *self.arrivals.lock().entry((prefix.to_string(), write, sec)).or_default() += 1;
        let mut buckets = self.buckets.lock();
        // The time is read under the lock: a clock read before it could be older than the
        // bucket's, and refill the same interval twice.
        let now = Instant::now();
        let b = buckets.entry((prefix.to_string(), write)).or_insert(Bucket { tokens: rate, at: now, admitted: 0 });
        b.tokens = (b.tokens + rate * now.duration_since(b.at).as_secs_f64()).min(rate);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            b.admitted += 1;
            true
        } else {
            false
        }
    }

    /// One request of `kind` about `key` on `prefix`: admitted (after 503s and backoff, as
    /// the client retries them), `op` runs at its midpoint; or the call fails.
    fn request<T>(&self, kind: Req, key: &str, prefix: &str, op: impl FnOnce() -> T) -> Result<T> {
        let half = self.opts.latency / 2;
        let mut backoff = 0.1f64;
        for attempt in 0..=self.opts.retries {
            if self.stop.load(Ordering::Relaxed) {
                let what = describe(key);
                return Err(Error::unavailable(format!("sim store: {} {what}: the run was stopped (past its time limit)", kind.name()))
                    .with_path(what));
            }
            *self.tally.lock().requests.entry((kind, object_class(key))).or_default() += 1;
            if self.admit(prefix, kind.is_write()) {
                std::thread::sleep(half);
                let out = op();
                std::thread::sleep(half);
                return Ok(out);
            }
            self.tally.lock().slowdowns += 1;
            std::thread::sleep(self.opts.latency);
            if attempt < self.opts.retries {
                // object_store's backoff: a random wait between the first and twice the last.
                let wait = self.jitter(0.1, (backoff * 2.0).min(15.0));
                backoff = wait;
                std::thread::sleep(Duration::from_secs_f64(wait));
            }
        }
        Err(Error::unavailable(format!(
            "sim store: {} {}: 503 SlowDown after {} retries (prefix '{prefix}' is over its rate: spread the keys, or lower \
             the request rate)",
            kind.name(),
            describe(key),
            self.opts.retries
        ))
        .with_path(describe(key)))
    }

    fn store(&self, key: &str, data: Vec<u8>, only_new: bool) -> bool {
        let (dir, name) = split(key);
        let mut dirs = self.dirs.write();
        let m = dirs.entry(dir.to_string()).or_default();
        if only_new && m.contains_key(name) {
            return false;
        }
        m.insert(name.to_string(), data);
        drop(dirs);
        let class = object_class(key);
        if matches!(class, "manifest" | "commit") {
            let now = Instant::now();
            let mut t = self.tally.lock();
            let at = if class == "manifest" { &mut t.last_manifest } else { &mut t.last_commit };
            *at = Some(at.map_or(now, |a| a.max(now)));
        }
        true
    }

    /// The prefix whose rate a request about object `key` takes.
    fn prefix(&self, key: &str) -> String {
        prefix_of(key, self.opts.prefix_depth, false)
    }

    /// The prefix whose rate a listing (or a recursive delete) of `prefix` takes.
    fn listing_prefix(&self, prefix: &str) -> String {
        prefix_of(prefix, self.opts.prefix_depth, true)
    }

    fn remove(&self, keys: &[String]) {
        let mut dirs = self.dirs.write();
        for k in keys {
            let (dir, name) = split(k);
            if let Some(m) = dirs.get_mut(dir) {
                m.remove(name);
                if m.is_empty() {
                    dirs.remove(dir);
                }
            }
        }
    }

    fn lookup(&self, key: &str) -> Option<Vec<u8>> {
        let (dir, name) = split(key);
        self.dirs.read().get(dir)?.get(name).cloned()
    }

    fn missing(&self, key: &str) -> Error {
        Error::not_found(format!("sim store: {}: not found", describe(key))).with_path(describe(key))
    }

    /// Keys under `prefix`, recursively (what a LIST without a delimiter returns).
    fn under(&self, prefix: &str) -> Vec<String> {
        let p = prefix.trim_matches('/');
        let dirs = self.dirs.read();
        let mut out = vec![];
        for (d, m) in dirs.iter() {
            if d == p || d.starts_with(&format!("{p}/")) || p.is_empty() {
                out.extend(m.keys().map(|n| if d.is_empty() { n.clone() } else { format!("{d}/{n}") }));
            }
        }
        out
    }

    fn pages(n: usize) -> usize {
        n.max(1).div_ceil(1000)
    }
}

impl Blobs for SimBlobs {
    fn describe(&self, key: &str) -> String {
        describe(key)
    }

    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        self.request(Req::Put, key, &self.prefix(key), || self.store(key, data.to_vec(), false)).map(|_| ())
    }

    fn put_if_absent(&self, key: &str, data: &[u8]) -> Result<bool> {
        self.request(Req::Put, key, &self.prefix(key), || self.store(key, data.to_vec(), true))
    }

    fn create(&self, key: &str) -> Result<Box<dyn BlobWriter>> {
        Ok(Box::new(SimWriter { blobs: self.0.clone(), key: key.to_string(), buf: vec![] }))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.request(Req::Get, key, &self.prefix(key), || self.lookup(key))?.ok_or_else(|| self.missing(key))
    }

    fn get_range(&self, key: &str, offset: u64, dst: &mut [u8]) -> Result<()> {
        let data = self.get(key)?;
        let (a, b) = (offset as usize, offset as usize + dst.len());
        if b > data.len() {
            return Err(
                Error::integrity(format!("sim store: {} is shorter than its manifest says", describe(key))).with_path(describe(key))
            );
        }
        dst.copy_from_slice(&data[a..b]);
        Ok(())
    }

    fn exists(&self, key: &str) -> Result<bool> {
        self.request(Req::Head, key, &self.prefix(key), || self.lookup(key).is_some())
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        let p = prefix.trim_matches('/').to_string();
        let names = {
            let dirs = self.dirs.read();
            let mut names: Vec<String> = dirs.get(&p).map(|m| m.keys().cloned().collect()).unwrap_or_default();
            for d in dirs.keys() {
                let rest = if p.is_empty() { Some(d.as_str()) } else { d.strip_prefix(&format!("{p}/")) };
                if let Some(first) = rest.and_then(|r| r.split('/').next()).filter(|f| !f.is_empty()) {
                    names.push(first.to_string());
                }
            }
            names.sort();
            names.dedup();
            names
        };
        // One LIST per page of 1,000 names; the names are those of the first page's time.
        let at = self.listing_prefix(&p);
        for _ in 1..SimState::pages(names.len()) {
            self.request(Req::List, &p, &at, || ())?;
        }
        self.request(Req::List, &p, &at, || names)
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.request(Req::Delete, key, &self.prefix(key), || self.remove(&[key.to_string()]))
    }

    /// One DeleteObjects per 1,000 names, as `ObjectBlobs` sends them: no listing.
    fn delete_names(&self, names: &[String]) -> Result<()> {
        for batch in names.chunks(1000) {
            self.request(Req::Post, &batch[0], &self.prefix(&batch[0]), || self.remove(batch))?;
        }
        Ok(())
    }

    fn delete_prefix(&self, prefix: &str) -> Result<()> {
        let p = prefix.trim_matches('/').to_string();
        let keys = self.under(&p);
        let at = self.listing_prefix(&p);
        for _ in 0..SimState::pages(keys.len()) {
            self.request(Req::List, &p, &at, || ())?;
        }
        for batch in keys.chunks(1000) {
            self.request(Req::Post, &p, &at, || self.remove(batch))?;
        }
        Ok(())
    }

    fn leftovers_under(&self) -> Option<&str> {
        Some(crate::object::UPLOADS_DIR)
    }

    fn leftovers(&self, _temp_age: Option<std::time::Duration>) -> Result<Vec<crate::gc::Removal>> {
        // ObjectBlobs lists the upload markers; a run without multipart uploads has none.
        let uploads = crate::object::UPLOADS_DIR;
        self.request(Req::List, uploads, uploads, || ())?;
        Ok(vec![])
    }
}

struct SimWriter {
    blobs: Arc<SimState>,
    key: String,
    buf: Vec<u8>,
}

impl BlobWriter for SimWriter {
    fn write(&mut self, data: &[u8]) -> Result<()> {
        self.buf.extend_from_slice(data);
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<()> {
        let SimWriter { blobs, key, buf } = *self;
        let dir = blobs.prefix(&key);
        let dir = dir.as_str();
        let part = blobs.opts.part_size.max(1);
        if buf.len() > part {
            // A multipart upload, recorded by a marker while it runs (object::uploads).
            let marker = format!("{}/sim-upload", crate::object::UPLOADS_DIR);
            blobs.request(Req::Post, &key, dir, || ())?;
            blobs.request(Req::Put, &marker, crate::object::UPLOADS_DIR, || ())?;
            for _ in 0..buf.len().div_ceil(part) {
                blobs.request(Req::Put, &key, dir, || ())?;
            }
            blobs.request(Req::Post, &key, dir, || blobs.store(&key, buf, false))?;
            blobs.request(Req::Delete, &marker, crate::object::UPLOADS_DIR, || ())?;
            return Ok(());
        }
        blobs.request(Req::Put, &key, dir, || blobs.store(&key, buf, false)).map(|_| ())
    }

    fn abort(self: Box<Self>) {}
}
