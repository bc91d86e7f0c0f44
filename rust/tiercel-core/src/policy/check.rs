//! The validator: builds a `Policy` from a source tree and phrases every error as
//! `source:line: key.path: message`, with a suggestion where one is likely.

use std::fmt;

use super::source::{line_of, Node, Value};
use super::tier::*;
use super::units::{parse_bandwidth, parse_size};
use super::{
    PickleMode, Policy, ReplicatedMode, ReplicatedRestore, CHUNK_ALIGN, DEFAULT_CHUNK_SIZE, DEFAULT_IO_THREADS, DEFAULT_MEMORY_KEEP,
    MAX_CHUNK_SIZE, MAX_DEFAULT_THREADS, MIN_CHUNK_SIZE,
};
use crate::codec::{Compression, DEFAULT_ZSTD_LEVEL};
use crate::error::{Error, Result};
use object::object_url;

mod object;
mod peer;
mod preemption;
mod python;
mod traffic;

const TOP_KEYS: &[&str] = &["tier", "restore", "store", "traffic", "preemption"];
pub(super) const TIER_KEYS: &[&str] = &[
    "name",
    "kind",
    "root",
    "url",
    "every",
    "keep",
    "compression",
    "dedup",
    "bandwidth",
    "capacity",
    "replicas",
    "placement",
    "listen",
    "secret",
    "endpoint",
    "region",
    "allow_http",
    "part_size",
    "concurrency",
    "timeout",
    "retries",
    "ramp_period",
    "throttle_timeout",
    "factory",
    "options",
];
/// Keys that only object-store tiers (s3, gcs) take.
pub(super) const OBJECT_KEYS: &[&str] =
    &["endpoint", "region", "allow_http", "part_size", "concurrency", "timeout", "retries", "ramp_period", "throttle_timeout"];
/// Keys that only a peer tier takes.
const PEER_KEYS: &[&str] = &["replicas", "placement", "listen", "secret"];
const RESTORE_KEYS: &[&str] = &["order", "resume_from", "replicated", "relay_window", "relay_timeout"];
/// Upper bounds of `[store] threads` (copy threads) and `io_threads` (background workers).
const MAX_THREADS: usize = 1024;
const MAX_IO_THREADS: usize = 256;

pub(super) const STORE_KEYS: &[&str] = &["chunk_size", "threads", "io_threads", "run", "other_jobs", "pickle"];
/// Where each key belongs, to point a key written in the wrong table to the right one.
const SECTIONS: &[(&str, &[&str])] = &[
    ("the top level", TOP_KEYS),
    ("[[tier]]", TIER_KEYS),
    ("[restore]", RESTORE_KEYS),
    ("[store]", STORE_KEYS),
    ("[traffic]", traffic::TRAFFIC_KEYS),
    ("[preemption]", preemption::PREEMPTION_KEYS),
];

/// One `[[tier]]` table being read: its entries and the key path its errors name.
struct TierTable<'n> {
    node: &'n Node,
    entries: &'n [(String, Node)],
    path: String,
}

impl<'n> TierTable<'n> {
    fn get(&self, key: &str) -> Option<&'n Node> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, n)| n)
    }

    fn key_path(&self, key: &str) -> String {
        format!("{}.{key}", self.path)
    }

    /// The node of `key` and its key path, if the table has it.
    fn optional(&self, key: &str) -> Option<(&'n Node, String)> {
        self.get(key).map(|n| (n, self.key_path(key)))
    }

    fn missing(&self, c: &Checker, key: &str, what: &str) -> Error {
        c.at(self.node, &self.path, format!("missing `{key}` ({what})"))
    }
}

/// Builds a `Policy` from a source tree and phrases its errors.
pub(super) struct Checker<'a> {
    pub(super) source: &'a str,
    /// The TOML text, to turn positions into lines; `None` for JSON.
    pub(super) text: Option<&'a str>,
}

impl Checker<'_> {
    /// The 1-based line where `node` starts (TOML only).
    fn line(&self, node: &Node) -> Option<usize> {
        Some(line_of(self.text?, node.first_pos()?))
    }

    /// An error about `node`, found under key path `path`.
    fn at(&self, node: &Node, path: &str, msg: impl fmt::Display) -> Error {
        let e = match self.line(node) {
            Some(line) => Error::config(format!("{}:{line}: {path}: {msg}", self.source)),
            None => Error::config(format!("{}: {path}: {msg}", self.source)),
        };
        // A TOML policy is a file (its path is the source); a JSON one is a label.
        if self.text.is_some() {
            e.with_path(self.source)
        } else {
            e
        }
    }

    fn expected(&self, node: &Node, path: &str, what: &str) -> Error {
        self.at(node, path, format!("expected {what}, got {}", node.describe()))
    }

    fn table<'n>(&self, node: &'n Node, path: &str) -> Result<&'n [(String, Node)]> {
        match &node.value {
            Value::Table(entries) => Ok(entries),
            _ => Err(self.expected(node, path, "a table")),
        }
    }

    /// Rejects keys of `entries` that are not in `known`, suggesting what was probably meant.
    fn check_keys(&self, entries: &[(String, Node)], path: &str, known: &[&str]) -> Result<()> {
        let Some((key, node)) = entries.iter().find(|(k, _)| !known.contains(&k.as_str())) else {
            return Ok(());
        };
        let hint = if let Some(close) = closest(key, known) {
            format!("did you mean `{close}`?")
        } else if let Some((section, _)) = SECTIONS.iter().find(|(_, keys)| keys.contains(&key.as_str())) {
            format!("`{key}` belongs in {section}")
        } else {
            format!("known keys: {}", known.join(", "))
        };
        let at = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
        Err(self.at(node, &at, format!("unknown key `{key}`; {hint}")))
    }

    fn string<'n>(&self, node: &'n Node, path: &str) -> Result<&'n str> {
        match &node.value {
            Value::Str(s) if !s.trim().is_empty() => Ok(s),
            _ => Err(self.expected(node, path, "a non-empty string")),
        }
    }

    fn positive_int(&self, node: &Node, path: &str) -> Result<u64> {
        match node.value {
            Value::Int(n) if n > 0 => Ok(n as u64),
            _ => Err(self.expected(node, path, "a positive integer")),
        }
    }

    fn count(&self, node: &Node, path: &str) -> Result<usize> {
        let n = self.positive_int(node, path)?;
        usize::try_from(n).map_err(|_| self.expected(node, path, "a smaller integer"))
    }

    /// A run id: 1 to 128 printable characters.
    fn run_id(&self, node: &Node, path: &str) -> Result<String> {
        let s = self.string(node, path)?;
        if s.is_empty() || s.len() > 128 || s.chars().any(|c| c.is_control()) {
            return Err(self.expected(node, path, "a run id of 1 to 128 printable characters"));
        }
        Ok(s.to_string())
    }

    /// A count from 1 to `max` (threads: more would exhaust the host, not speed anything up).
    fn bounded(&self, node: &Node, path: &str, max: usize) -> Result<usize> {
        let n = self.count(node, path)?;
        if n > max {
            return Err(self.expected(node, path, &format!("at most {max} (got {n})")));
        }
        Ok(n)
    }

    /// A positive number of bytes: an integer, or a string read by `parse`, which reads `what`.
    fn bytes(&self, node: &Node, path: &str, parse: fn(&str) -> std::result::Result<u64, String>, what: &str) -> Result<u64> {
        let n = match &node.value {
            Value::Str(s) => parse(s).map_err(|m| self.at(node, path, m))?,
            Value::Int(n) if *n > 0 => *n as u64,
            _ => return Err(self.expected(node, path, &format!("{what} or a positive integer"))),
        };
        if n == 0 {
            return Err(self.expected(node, path, "a positive amount"));
        }
        Ok(n)
    }

    pub(super) fn policy(&self, root: &Node) -> Result<Policy> {
        let entries = self.table(root, "top level")?;
        self.check_keys(entries, "", TOP_KEYS)?;
        let get = |key: &str| entries.iter().find(|(k, _)| k == key).map(|(_, n)| n);

        let tier_nodes = match get("tier") {
            Some(node) => match &node.value {
                Value::List(items) if !items.is_empty() => items,
                _ => return Err(self.expected(node, "tier", "a non-empty list of [[tier]] tables")),
            },
            None => {
                return Err(Error::config(format!(
                    "{}: no tiers: add at least one [[tier]] table (the first of kind \"memory\")",
                    self.source
                )))
            }
        };
        let mut tiers: Vec<TierConfig> = Vec::with_capacity(tier_nodes.len());
        for (i, node) in tier_nodes.iter().enumerate() {
            let tier = self.tier(i, node, &tiers)?;
            tiers.push(tier);
        }

        let restore_order = match get("restore") {
            Some(node) => self.restore_order(node, &tiers)?,
            None => None,
        };
        let resume_from = match get("restore").and_then(|n| self.table(n, "restore").ok()?.iter().find(|(k, _)| k == "resume_from")) {
            Some((_, n)) => Some(self.run_id(n, "restore.resume_from")?),
            None => None,
        };
        let mut policy = Policy {
            source: self.source.to_string(),
            restore_order: restore_order.unwrap_or_else(|| tiers.iter().map(|t| t.name.clone()).collect()),
            tiers,
            chunk_size: DEFAULT_CHUNK_SIZE,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_DEFAULT_THREADS),
            io_threads: DEFAULT_IO_THREADS,
            run: None,
            refuse_other_jobs: false,
            resume_from,
            pickle: PickleMode::default(),
            traffic: Default::default(),
            replicated: ReplicatedRestore::default(),
            preemption: None,
        };
        if let Some(node) = get("restore") {
            self.replicated_restore(node, &mut policy.replicated)?;
        }
        if let Some(node) = get("store") {
            self.store(node, &mut policy)?;
        }
        if let Some(node) = get("traffic") {
            policy.traffic = self.traffic(node)?;
        }
        if let Some(node) = get("preemption") {
            policy.preemption = Some(self.preemption(node)?);
        }
        Ok(policy)
    }

    /// Tier `i`; `earlier` are the tiers before it, for the uniqueness and memory-tier rules.
    fn tier(&self, i: usize, node: &Node, earlier: &[TierConfig]) -> Result<TierConfig> {
        let bare_path = format!("tier[{i}]");
        let entries = self.table(node, &bare_path)?;
        let get = |key: &str| entries.iter().find(|(k, _)| k == key).map(|(_, n)| n);

        let name_path = format!("{bare_path}.name");
        let Some(name_node) = get("name") else {
            // A misspelt `name` is the likelier story, and its message the more helpful one.
            self.check_keys(entries, &bare_path, TIER_KEYS)?;
            return Err(self.at(node, &bare_path, "missing `name` (a unique name such as \"ram\")"));
        };
        let name = self.string(name_node, &name_path)?;
        if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
            return Err(self.expected(name_node, &name_path, "a name of letters, digits, `_` and `-`"));
        }
        if let Some(j) = earlier.iter().position(|t| t.name == name) {
            return Err(self.at(name_node, &name_path, format!("duplicate tier name {name:?}, already used by tier[{j}]")));
        }
        // In a file the name helps find the table; in JSON the index is the whole address.
        let path = if self.text.is_some() { format!("{bare_path} ({name:?})") } else { bare_path.clone() };
        self.check_keys(entries, &path, TIER_KEYS)?;
        let t = TierTable { node, entries, path };

        let kind_node = t.get("kind").ok_or_else(|| t.missing(self, "kind", &format!("one of {}", python::known_kinds())))?;
        let kind_name = self.string(kind_node, &t.key_path("kind"))?;
        let kind = match TierKind::from_name(kind_name) {
            Some(k) => k,
            None if python::is_python_kind(kind_name) => TierKind::Python,
            None => {
                return Err(self.at(
                    kind_node,
                    &t.key_path("kind"),
                    format!(
                    "unknown kind {kind_name:?}; known kinds: {} (a package adds kinds through the entry point group \"tiercel.tiers\")",
                    python::known_kinds()
                ),
                ))
            }
        };
        // The blocking part of a save copies into shared memory, so that tier comes first, once.
        match (i, kind) {
            (0, TierKind::Memory) => {}
            (0, _) => {
                return Err(self.at(
                    kind_node,
                    &t.key_path("kind"),
                    format!("the first tier must be kind \"memory\" (a save copies into shared memory first), got {kind_name:?}"),
                ))
            }
            (_, TierKind::Memory) => {
                return Err(self.at(
                    kind_node,
                    &t.key_path("kind"),
                    format!("only one memory tier is allowed, and tier[0] ({:?}) is one", earlier[0].name),
                ))
            }
            _ => {}
        }
        if kind != TierKind::Peer {
            if let Some(key) = PEER_KEYS.iter().find(|k| t.get(k).is_some()) {
                return Err(self.at(t.get(key).unwrap(), &t.key_path(key), format!("`{key}` is only valid for kind \"peer\"")));
            }
        }

        if kind != TierKind::Python {
            if let Some(key) = python::PYTHON_KEYS.iter().find(|k| t.get(k).is_some()) {
                return Err(self.at(
                    t.get(key).unwrap(),
                    &t.key_path(key),
                    format!("`{key}` is only valid for Python tiers (kind \"python\", \"fsspec\" or a plugin's)"),
                ));
            }
        }

        let spec = match kind {
            TierKind::Python => TierSpec::Python(self.python_tier(&t, kind_name)?),
            TierKind::Peer => TierSpec::Peer(self.peer(&t)?),
            TierKind::Memory => {
                let (n, root) = self.location(&t, kind_name, "the shared-memory directory, e.g. \"/dev/shm/tiercel\"")?;
                // The tier writes `.lock`, `.pool/` and step directories into its root.
                if std::path::Path::new(root)
                    .components()
                    .all(|c| matches!(c, std::path::Component::RootDir | std::path::Component::CurDir))
                {
                    return Err(self.at(
                        n,
                        &t.key_path("root"),
                        format!("{root:?} cannot be a memory tier's root: give it a directory of its own, e.g. \"/dev/shm/tiercel\""),
                    ));
                }
                TierSpec::Memory { root: root.into() }
            }
            TierKind::Fs => {
                let (n, url) = self.location(&t, kind_name, "a directory path or file:// URL")?;
                let path = fs_path(url).map_err(|m| self.at(n, &t.key_path("url"), m))?;
                for e in earlier {
                    if let TierSpec::Memory { root } = &e.spec {
                        if std::path::Path::new(&path).starts_with(root) {
                            return Err(self.at(n, &t.key_path("url"), format!(
                                "{url:?} lies in the memory tier '{}' root {root:?}: the two tiers would see each other's steps; give the fs tier a directory of its own",
                                e.name
                            )));
                        }
                    }
                }
                TierSpec::Fs { path }
            }
            TierKind::S3 | TierKind::Gcs => {
                let scheme = if kind == TierKind::S3 { "s3" } else { "gs" };
                let what = format!("the bucket and prefix, e.g. \"{scheme}://bucket/checkpoints/run1\"");
                let (n, url) = self.location(&t, kind_name, &what)?;
                let url = object_url(kind, url).map_err(|m| self.at(n, &t.key_path("url"), m))?;
                let spec = ObjectSpec { url, options: self.object_options(kind, &t)? };
                if kind == TierKind::S3 {
                    TierSpec::S3(spec)
                } else {
                    TierSpec::Gcs(spec)
                }
            }
        };
        if matches!(kind, TierKind::Memory | TierKind::Fs) {
            if let Some((key, node)) = entries.iter().find(|(k, _)| OBJECT_KEYS.contains(&k.as_str())) {
                return Err(self.at(
                    node,
                    &t.key_path(key),
                    format!("`{key}` is not valid for kind {kind_name:?}; it applies to \"s3\" and \"gcs\" tiers"),
                ));
            }
        }

        // Memory and peer tiers keep the newest few steps and store chunks raw; the others
        // keep everything and compress.
        let (default_keep, default_compression) = match kind {
            TierKind::Memory | TierKind::Peer => (Some(DEFAULT_MEMORY_KEEP), Compression::none()),
            TierKind::Fs | TierKind::S3 | TierKind::Gcs | TierKind::Python => (None, Compression::zstd(DEFAULT_ZSTD_LEVEL)),
        };
        // Blob tiers refer to chunks their previous save stores (docs/config.md, `dedup`): on
        // by default where the core writes the objects itself, off for Python tiers.
        let dedup = match (kind, t.optional("dedup")) {
            (TierKind::Memory | TierKind::Peer, Some((n, p))) => {
                return Err(self.at(
                    n,
                    &p,
                    format!("`dedup` is not valid for kind {kind_name:?}; it applies to fs, s3, gcs and Python tiers"),
                ))
            }
            (_, Some((n, p))) => match n.value {
                Value::Bool(b) => b,
                _ => return Err(self.expected(n, &p, "true or false")),
            },
            (TierKind::Fs | TierKind::S3 | TierKind::Gcs, None) => true,
            _ => false,
        };
        Ok(TierConfig {
            dedup,
            every: t.optional("every").map_or(Ok(1), |(n, p)| self.positive_int(n, &p))?,
            keep: t.optional("keep").map_or(Ok(default_keep), |(n, p)| self.count(n, &p).map(Some))?,
            // A peer tier refuses `compression` (see `peer`).
            compression: match t.optional("compression") {
                Some((n, p)) => Compression::parse(self.string(n, &p)?).map_err(|m| self.at(n, &p, m))?,
                None => default_compression,
            },
            bandwidth: t
                .optional("bandwidth")
                .map(|(n, p)| self.bytes(n, &p, parse_bandwidth, "a bandwidth such as \"2GB/s\""))
                .transpose()?,
            // Only the memory tier enforces a capacity; a peer tier's replicas count against its.
            capacity: match kind {
                TierKind::Peer => None,
                _ => t.optional("capacity").map(|(n, p)| self.bytes(n, &p, parse_size, "a size such as \"64GiB\"")).transpose()?,
            },
            name: name.to_string(),
            spec,
            line: self.line(node).unwrap_or(0),
        })
    }

    /// The location of a memory (`root`), fs, s3 or gcs (`url`) tier: its node and text. The
    /// other of the two keys is a mistake.
    fn location<'n>(&self, t: &TierTable<'n>, kind_name: &str, what: &str) -> Result<(&'n Node, &'n str)> {
        let (key, other) = if kind_name == "memory" { ("root", "url") } else { ("url", "root") };
        if let Some(n) = t.get(other) {
            return Err(self.at(n, &t.key_path(other), format!("`{other}` is not valid for kind {kind_name:?}; use `{key}`")));
        }
        let n = t.get(key).ok_or_else(|| t.missing(self, key, what))?;
        Ok((n, self.string(n, &t.key_path(key))?))
    }

    /// `[restore] order`, if given.
    fn restore_order(&self, node: &Node, tiers: &[TierConfig]) -> Result<Option<Vec<String>>> {
        let entries = self.table(node, "restore")?;
        self.check_keys(entries, "restore", RESTORE_KEYS)?;
        let Some((_, order)) = entries.iter().find(|(k, _)| k == "order") else {
            return Ok(None);
        };
        let items = match &order.value {
            Value::List(items) if !items.is_empty() => items,
            _ => return Err(self.expected(order, "restore.order", "a non-empty list of tier names")),
        };
        let mut names: Vec<String> = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let path = format!("restore.order[{i}]");
            let name = self.string(item, &path)?;
            if tiers.iter().all(|t| t.name != name) {
                let known = tiers.iter().map(|t| format!("{:?}", t.name)).collect::<Vec<_>>().join(", ");
                return Err(self.at(item, &path, format!("unknown tier {name:?}; the tiers are {known}")));
            }
            if names.iter().any(|n| n == name) {
                return Err(self.at(item, &path, format!("tier {name:?} is listed twice")));
            }
            names.push(name.to_string());
        }
        Ok(Some(names))
    }

    /// `[restore] replicated`, `relay_window`, `relay_timeout` (the keys were checked by
    /// `restore_order`).
    fn replicated_restore(&self, node: &Node, out: &mut ReplicatedRestore) -> Result<()> {
        for (key, value) in self.table(node, "restore")? {
            let path = format!("restore.{key}");
            match key.as_str() {
                "replicated" => {
                    let s = self.string(value, &path)?;
                    out.mode = ReplicatedMode::parse(s).ok_or_else(|| {
                        self.expected(value, &path, &format!("one of {}", ReplicatedMode::NAMES.map(|n| format!("\"{n}\"")).join(", ")))
                    })?;
                }
                "relay_window" => out.window = self.bytes(value, &path, parse_size, "a size such as \"64MiB\"")?,
                "relay_timeout" => out.timeout = std::time::Duration::from_secs(self.positive_int(value, &path)? as u64),
                _ => {}
            }
        }
        Ok(())
    }

    /// `[store]` settings, over the defaults already in `policy`.
    fn store(&self, node: &Node, policy: &mut Policy) -> Result<()> {
        let entries = self.table(node, "store")?;
        self.check_keys(entries, "store", STORE_KEYS)?;
        for (key, value) in entries {
            let path = format!("store.{key}");
            match key.as_str() {
                "chunk_size" => {
                    let size = self.bytes(value, &path, parse_size, "a size such as \"4MiB\"")?;
                    if size % CHUNK_ALIGN != 0 || !(MIN_CHUNK_SIZE..=MAX_CHUNK_SIZE).contains(&size) {
                        return Err(self.expected(value, &path, "a multiple of 4096 bytes between 64KiB and 1GiB"));
                    }
                    policy.chunk_size = size;
                }
                "threads" => policy.threads = self.bounded(value, &path, MAX_THREADS)?,
                "io_threads" => policy.io_threads = self.bounded(value, &path, MAX_IO_THREADS)?,
                "run" => policy.run = Some(self.run_id(value, &path)?),
                "other_jobs" => match self.string(value, &path)? {
                    "ignore" => policy.refuse_other_jobs = false,
                    "refuse" => policy.refuse_other_jobs = true,
                    _ => return Err(self.expected(value, &path, "\"ignore\" or \"refuse\"")),
                },
                "pickle" => {
                    let s = self.string(value, &path)?;
                    policy.pickle = PickleMode::parse(s)
                        .ok_or_else(|| self.expected(value, &path, "\"warn\" (the default), \"error\" or \"allow\""))?;
                }
                _ => unreachable!("check_keys admits only STORE_KEYS"),
            }
        }
        Ok(())
    }
}

/// The directory an fs tier's `url` names: a plain path, or a local `file://` URL.
pub(super) fn fs_path(url: &str) -> std::result::Result<String, String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Ok(url.to_string());
    };
    if scheme != "file" {
        return Err(format!("expected a path or file:// URL for kind \"fs\", got {url:?}"));
    }
    // file:///abs/path and file://localhost/abs/path name a local path; file://host/... does not.
    let path = rest.strip_prefix("localhost").unwrap_or(rest);
    if !path.starts_with('/') {
        return Err(format!("expected a local file:// URL such as \"file:///mnt/ckpt\", got {url:?}"));
    }
    Ok(path.to_string())
}

/// The known key closest to `key` by edit distance, if close enough to be a likely typo, or
/// one that `key` abbreviates.
pub(super) fn closest<'k>(key: &str, known: &[&'k str]) -> Option<&'k str> {
    let key = key.to_lowercase();
    let limit = (key.chars().count() / 3).max(2);
    known
        .iter()
        .map(|k| (edit_distance(&key, k), *k))
        .filter(|&(d, k)| (d <= limit && d < key.chars().count()) || (key.len() >= 3 && k.starts_with(&key)))
        .min_by_key(|&(d, _)| d)
        .map(|(_, k)| k)
}

/// Levenshtein distance.
pub(super) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            cur.push((prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}
