//! One `[[tier]]` of a policy: what every tier has (name, schedule, retention, compression,
//! bandwidth, capacity) and, as an enum, what only its kind has.

use crate::codec::Compression;
use crate::error::{Error, Result};

/// The kinds of tier a policy may name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierKind {
    Memory,
    Fs,
    /// Replicas in the memory of m-1 peer hosts (GEMINI).
    Peer,
    /// An S3-compatible object store: `url = "s3://bucket/prefix"`.
    S3,
    /// Google Cloud Storage: `url = "gs://bucket/prefix"`.
    Gcs,
    /// A tier built outside the core (`tier::external`): `kind = "python"` with a `factory`,
    /// `kind = "fsspec"` with a `url`, or the kind name an installed plugin registers.
    Python,
}

impl TierKind {
    /// Every kind a policy may name, in the order error messages list them.
    pub(super) const ALL: &'static [TierKind] =
        &[TierKind::Memory, TierKind::Fs, TierKind::Peer, TierKind::S3, TierKind::Gcs, TierKind::Python];

    pub fn as_str(self) -> &'static str {
        match self {
            TierKind::Memory => "memory",
            TierKind::Fs => "fs",
            TierKind::Peer => "peer",
            TierKind::S3 => "s3",
            TierKind::Gcs => "gcs",
            TierKind::Python => "python",
        }
    }

    /// An object store (s3, gcs): a bucket reached over HTTP.
    pub fn is_object_store(self) -> bool {
        matches!(self, TierKind::S3 | TierKind::Gcs)
    }

    pub(super) fn from_name(name: &str) -> Option<TierKind> {
        Self::ALL.iter().find(|k| k.as_str() == name).copied()
    }
}

#[derive(Debug, Clone)]
pub struct TierConfig {
    pub name: String,
    /// The kind and what only it has (its location first of all).
    pub spec: TierSpec,
    /// Keep a copy of every Nth step on this tier (`step % every == 0`).
    pub every: u64,
    /// How many steps to retain; `None` keeps all.
    pub keep: Option<usize>,
    /// How chunks are stored; always none for the memory and peer tiers.
    pub compression: Compression,
    /// Whether a save refers to the chunks its rank's previous save on this tier stores
    /// instead of writing them again (blob tiers; docs/config.md).
    pub dedup: bool,
    /// Bytes per second.
    pub bandwidth: Option<u64>,
    /// Bytes (enforced on the memory tier).
    pub capacity: Option<u64>,
    /// 1-based line where this `[[tier]]` table starts (0 when not from TOML).
    pub line: usize,
}

/// What a tier is, with the settings only its kind takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierSpec {
    /// Shared memory: `root`, a directory (under /dev/shm, so it outlives the process).
    Memory { root: String },
    /// A directory: `url` as a plain path (a file:// URL becomes its path).
    Fs { path: String },
    /// An S3-compatible object store: `url = "s3://bucket/prefix"`.
    S3(ObjectSpec),
    /// Google Cloud Storage: `url = "gs://bucket/prefix"`.
    Gcs(ObjectSpec),
    /// Replicas in the memory of m-1 peer hosts (GEMINI).
    Peer(PeerConfig),
    /// A tier written in Python (`kind = "python"`, `"fsspec"` or a plugin's kind).
    Python(PythonSpec),
}

/// What a tier is, beyond its name and kind (`TierSpec::capabilities`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities<'a> {
    /// Its link shares the network with the training job's communication (the scheduler's
    /// traffic gate applies); else it is local.
    pub network: bool,
    /// It keeps steps beyond this host's memory: part of the job's fingerprint, a target of
    /// `every`'s persists.
    pub persists: bool,
    /// A step on it is committed by a commit record once every rank wrote it, which it lists
    /// and keeps (false: per rank, by acknowledgements; no other job's steps to find there).
    pub commit_records: bool,
    /// Raw chunks laid out as in shared memory: a restore from it pre-faults the next save's
    /// segments.
    pub memory_layout: bool,
    /// It joins the job's cluster at open (addresses and a secret through the coordinator).
    pub cluster: bool,
    /// It may fail and fall behind (degraded) without failing a save; the memory tier, which
    /// every save copies into, may not.
    pub degradable: bool,
    /// A directory on this host: where a saving rank takes its writer lease.
    pub directory: Option<&'a str>,
}

/// A part a tier plays for the Store, found from its capabilities (`Capabilities::plays`),
/// not from its kind's name or its place in the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The tier every save copies into first, its segments in this host's shared memory:
    /// it holds the memory layout and may not run degraded. A policy has exactly one.
    Memory,
    /// The tier that joins the job's cluster (the Store's `Cluster` handle). At most one.
    Cluster,
}

impl Capabilities<'_> {
    /// Whether a tier with these capabilities plays `role`.
    pub fn plays(&self, role: Role) -> bool {
        match role {
            Role::Memory => self.memory_layout && !self.degradable,
            Role::Cluster => self.cluster,
        }
    }
}

/// A tier the core opens through `tier::external` (in practice: the Python bindings).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PythonSpec {
    /// The kind as the policy names it: "python", "fsspec", or a plugin's (entry point group
    /// `tiercel.tiers`).
    pub kind: String,
    /// `factory = "module:callable"` (kind "python" only).
    pub factory: Option<String>,
    /// `url`, handed to the factory as the keyword `url` (required for "fsspec").
    pub url: Option<String>,
    /// `[tier.options]` as a JSON object: the factory's other keywords.
    pub options: String,
    /// `concurrency`: calls into the tier's object in flight at once.
    pub concurrency: usize,
    /// Where the tier stands in the policy (`tiercel.toml:12: tier[1] ("archive")`), so that
    /// a failure to open it (a module that does not import) names the file and line.
    pub at: String,
}

/// Calls into a Python tier at once, unless `concurrency` says otherwise.
pub const DEFAULT_PYTHON_CONCURRENCY: usize = 4;

/// An object-store tier: its bucket and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectSpec {
    /// `s3://bucket/prefix` or `gs://bucket/prefix`, normalized (no trailing slash).
    pub url: String,
    pub options: ObjectOptions,
}

impl TierSpec {
    pub fn kind(&self) -> TierKind {
        match self {
            TierSpec::Memory { .. } => TierKind::Memory,
            TierSpec::Fs { .. } => TierKind::Fs,
            TierSpec::S3(_) => TierKind::S3,
            TierSpec::Gcs(_) => TierKind::Gcs,
            TierSpec::Peer(_) => TierKind::Peer,
            TierSpec::Python(_) => TierKind::Python,
        }
    }

    /// Where the tier lives, as messages and `tiercel ls` show it: the memory root, the fs
    /// directory, the bucket URL, the peer tier's listen address, or a Python tier's url (else
    /// its factory, else its kind).
    pub fn location(&self) -> &str {
        match self {
            TierSpec::Memory { root } => root,
            TierSpec::Fs { path } => path,
            TierSpec::S3(o) | TierSpec::Gcs(o) => &o.url,
            TierSpec::Peer(p) => &p.listen,
            TierSpec::Python(p) => p.url.as_deref().or(p.factory.as_deref()).unwrap_or(&p.kind),
        }
    }

    /// What the tier is, as the Store and the Python side ask it: the one place besides
    /// `tier::open` that tells kinds apart. A new kind answers here and nowhere else.
    pub fn capabilities(&self) -> Capabilities<'_> {
        let base = Capabilities {
            network: false,
            persists: true,
            commit_records: true,
            memory_layout: false,
            cluster: false,
            degradable: true,
            directory: None,
        };
        match self {
            TierSpec::Memory { root } => {
                Capabilities { persists: false, memory_layout: true, degradable: false, directory: Some(root), ..base }
            }
            TierSpec::Fs { path } => Capabilities { directory: Some(path), ..base },
            TierSpec::S3(_) | TierSpec::Gcs(_) => Capabilities { network: true, ..base },
            TierSpec::Peer(_) => {
                Capabilities { network: true, persists: false, commit_records: false, memory_layout: true, cluster: true, ..base }
            }
            // A Python tier is taken to be remote unless its url names a local directory.
            TierSpec::Python(p) => Capabilities { network: !p.url.as_deref().is_some_and(|u| u.starts_with("file://")), ..base },
        }
    }

    /// The kind as the policy names it (a plugin's own name for a Python tier).
    pub fn kind_name(&self) -> &str {
        match self {
            TierSpec::Python(p) => &p.kind,
            other => other.kind().as_str(),
        }
    }
}

impl TierConfig {
    pub fn kind(&self) -> TierKind {
        self.spec.kind()
    }

    pub fn location(&self) -> &str {
        self.spec.location()
    }

    pub fn kind_name(&self) -> &str {
        self.spec.kind_name()
    }

    pub fn capabilities(&self) -> Capabilities<'_> {
        self.spec.capabilities()
    }
}

/// Default part size of an object-store tier's multipart uploads.
pub const DEFAULT_PART_SIZE: u64 = 16 << 20;
/// S3 refuses smaller parts (but the last); GCS's XML multipart API has the same rule.
pub(super) const MIN_PART_SIZE: u64 = 5 << 20;
pub(super) const MAX_PART_SIZE: u64 = 5 << 30;
/// Default number of parts of one object uploaded at once.
pub const DEFAULT_CONCURRENCY: usize = 4;
pub(super) const MAX_CONCURRENCY: usize = 64;
/// Default `ramp_period`: GCS's "at most double the request rate every 20 minutes".
pub const DEFAULT_RAMP_PERIOD: u64 = 20 * 60;
/// Default `throttle_timeout`: ten minutes.
pub const DEFAULT_THROTTLE_TIMEOUT: u64 = 10 * 60;
/// A request refused longer than this is sent again with a signature S3 no longer accepts
/// (a SigV4 signature is valid for 15 minutes after its time).
pub(super) const MAX_THROTTLE_TIMEOUT: u64 = 14 * 60;

/// How an s3 or gcs tier reaches its bucket. What is `None` here comes from the environment
/// and the SDK config files, as the AWS and Google SDKs read them (see `crate::object`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectOptions {
    /// `endpoint`: the server's base URL (`http://127.0.0.1:9000`), for S3-compatible servers
    /// and emulators.
    pub endpoint: Option<String>,
    /// `region` (s3 only).
    pub region: Option<String>,
    /// `allow_http`: permit plain-HTTP endpoints (implied by an `http://` endpoint).
    pub allow_http: Option<bool>,
    /// `part_size`: bytes per multipart part; objects up to this size go in one PUT.
    pub part_size: u64,
    /// `concurrency`: parts of one object in flight at once.
    pub concurrency: usize,
    /// `timeout`: seconds one HTTP request may take before it is retried.
    pub timeout: Option<u64>,
    /// `retries`: how often a failed request is retried (backoff from 0.1 s up to 15 s).
    pub retries: Option<usize>,
    /// `ramp_period`: seconds the tier's request rate takes to double again after the server
    /// said "slow down" (GCS asks for at most 2x per 20 minutes).
    pub ramp_period: u64,
    /// `throttle_timeout`: seconds one request may keep being refused as "slow down" before
    /// it fails.
    pub throttle_timeout: u64,
}

impl Default for ObjectOptions {
    fn default() -> Self {
        ObjectOptions {
            endpoint: None,
            region: None,
            allow_http: None,
            part_size: DEFAULT_PART_SIZE,
            concurrency: DEFAULT_CONCURRENCY,
            timeout: None,
            retries: None,
            ramp_period: DEFAULT_RAMP_PERIOD,
            throttle_timeout: DEFAULT_THROTTLE_TIMEOUT,
        }
    }
}

/// The keys of a `kind = "peer"` tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerConfig {
    /// `listen`: the address this process serves its host's replicas on ("ip:port"; port 0
    /// picks a free one).
    pub listen: String,
    /// m: copies of each host's data, its own included (GEMINI's m), so m-1 peers.
    pub replicas: usize,
    /// "mixed" (groups of m, a ring for the remainder), "group" or "ring".
    pub placement: String,
    /// The shared secret peers authenticate with; else $TIERCEL_PEER_SECRET, else one is
    /// handed out through the coordinator.
    pub secret: Option<String>,
}

pub const DEFAULT_PEER_LISTEN: &str = "0.0.0.0:0";
pub const DEFAULT_REPLICAS: usize = 2;

/// The shortest shared secret accepted (bytes): an empty or guessable key would let anyone
/// who reaches the port read and forge replicas.
pub const MIN_SECRET_LEN: usize = 16;

/// Refuses an empty or short shared secret; `source` says where it came from (policy key,
/// environment variable, coordinator) so the message tells what to fix.
pub fn check_secret(secret: &[u8], source: &str) -> Result<()> {
    if secret.len() < MIN_SECRET_LEN {
        return Err(Error::config(format!(
            "the peer secret from {source} is {} bytes; at least {MIN_SECRET_LEN} are required (an empty or short \
             secret lets anyone who reaches the peer port read and forge replicas): set a long random value, \
             e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`, or leave it unset so rank 0 makes one",
            secret.len()
        )));
    }
    Ok(())
}

/// Where the names of kinds that installed packages register come from: the Python bindings
/// register a function (it reads the entry points of group `tiercel.tiers`); without one
/// there are none. A hook, so that the policy asks no layer above its own.
static PLUGIN_KINDS: std::sync::OnceLock<fn() -> Vec<String>> = std::sync::OnceLock::new();

/// Registers where plugin kind names come from; false if that was registered already.
pub fn register_plugin_kinds(kinds: fn() -> Vec<String>) -> bool {
    PLUGIN_KINDS.set(kinds).is_ok()
}

/// The kinds installed packages register (none where no source is registered).
pub fn plugin_kinds() -> Vec<String> {
    PLUGIN_KINDS.get().map(|f| f()).unwrap_or_default()
}
