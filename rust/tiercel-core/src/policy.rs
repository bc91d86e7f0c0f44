//! The policy: which tiers a store writes to, fastest first, and how (`every`, `keep`,
//! compression, bandwidth, capacity); the restore order; and store-wide settings.
//!
//! A policy comes from a TOML file or from a JSON object (a Python dict). Both are first read
//! into one tree of [`Node`]s that remember where each value stood in the source, and then
//! checked by one validator, so both forms accept the same schema and give the same errors.
//! Every error names the source, the 1-based line (TOML only), the key path and what is
//! expected, e.g. `tiercel.toml:12: tier[1] ("disk").keep: expected a positive integer, got -1`.

use std::fmt;
use std::path::Path;

use serde::de::{Deserialize, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::error::{Error, Result};

/// Default chunk size: the unit of I/O, checksum and compression.
pub const DEFAULT_CHUNK_SIZE: u64 = 4 << 20;
const MIN_CHUNK_SIZE: u64 = 64 << 10;
const MAX_CHUNK_SIZE: u64 = 1 << 30;
/// Chunks are page-aligned so that they can be mapped and copied without splitting pages.
const CHUNK_ALIGN: u64 = 4096;
const DEFAULT_MEMORY_KEEP: usize = 2;
const DEFAULT_ZSTD_LEVEL: i32 = 3;
const DEFAULT_IO_THREADS: usize = 2;
/// More copy threads than this rarely helps a memory-bound copy and starves the trainer.
const MAX_DEFAULT_THREADS: usize = 8;

// ---------------------------------------------------------------------------------------------
// Public types
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierKind {
    Memory,
    Fs,
    /// Replicas in the memory of m-1 peer hosts (GEMINI).
    Peer,
    /// An S3-compatible object store: `url = "s3://bucket/prefix"`.
    S3,
    /// Google Cloud Storage: `url = "gs://bucket/prefix"`.
    Gcs,
}

impl TierKind {
    /// Every kind a policy may name, in the order error messages list them.
    const ALL: &'static [TierKind] = &[TierKind::Memory, TierKind::Fs, TierKind::Peer, TierKind::S3, TierKind::Gcs];

    pub fn as_str(&self) -> &'static str {
        match self {
            TierKind::Memory => "memory",
            TierKind::Fs => "fs",
            TierKind::Peer => "peer",
            TierKind::S3 => "s3",
            TierKind::Gcs => "gcs",
        }
    }

    /// An object store (s3, gcs): a bucket reached over HTTP.
    pub fn is_object_store(&self) -> bool {
        matches!(self, TierKind::S3 | TierKind::Gcs)
    }

    fn from_name(name: &str) -> Option<TierKind> {
        Self::ALL.iter().find(|k| k.as_str() == name).cloned()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    None,
    Zstd { level: i32 },
}

/// How a tier stores chunks. `bytegroup` means: for floating-point items, regroup the bytes
/// of each value by significance before zstd (exponent bytes compress far better together);
/// it only has an effect together with a codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compression {
    pub codec: Codec,
    pub bytegroup: bool,
}

impl Compression {
    pub fn none() -> Self {
        Compression { codec: Codec::None, bytegroup: false }
    }

    fn zstd(level: i32) -> Self {
        Compression { codec: Codec::Zstd { level }, bytegroup: false }
    }

    /// Parses `none` | `off` | `zstd` (level 3) | `zstd:N` | `bytegroup+zstd` |
    /// `bytegroup+zstd:N`, where N is 1..=19 or a fast level -7..=-1.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        const EXPECTED: &str = "expected \"none\", \"zstd\", \"zstd:N\" (N in 1..=19, or -7..=-1 \
                                for fast levels) or \"bytegroup+zstd[:N]\"";
        let s = s.trim();
        if s == "none" || s == "off" {
            return Ok(Self::none());
        }
        let (bytegroup, codec) = match s.strip_prefix("bytegroup+") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let level = match codec.strip_prefix("zstd") {
            Some("") => DEFAULT_ZSTD_LEVEL,
            Some(level) => match level.strip_prefix(':').and_then(|n| n.parse::<i32>().ok()) {
                Some(n) if (1..=19).contains(&n) || (-7..=-1).contains(&n) => n,
                Some(n) => return Err(format!("zstd level must be in 1..=19 or -7..=-1, got {n}")),
                None => return Err(format!("{EXPECTED}, got {s:?}")),
            },
            None => return Err(format!("{EXPECTED}, got {s:?}")),
        };
        Ok(Compression { bytegroup, ..Self::zstd(level) })
    }
}

/// The canonical spelling, which [`Compression::parse`] reads back (`to_string()` comes with it).
impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.codec {
            Codec::None => f.write_str("none"),
            Codec::Zstd { level } => {
                let prefix = if self.bytegroup { "bytegroup+" } else { "" };
                write!(f, "{prefix}zstd:{level}")
            }
        }
    }
}

#[derive(Debug, Clone)]
pub struct TierConfig {
    pub name: String,
    pub kind: TierKind,
    /// memory: the `root` directory; fs: `url` as a plain path (a file:// URL becomes its path);
    /// s3, gcs: `url` as `s3://bucket/prefix` or `gs://bucket/prefix` (no trailing slash).
    pub location: String,
    /// Keep a copy of every Nth step on this tier (`step % every == 0`).
    pub every: u64,
    /// How many steps to retain; `None` keeps all.
    pub keep: Option<usize>,
    pub compression: Compression,
    /// Bytes per second.
    pub bandwidth: Option<u64>,
    /// Bytes.
    pub capacity: Option<u64>,
    /// 1-based line where this `[[tier]]` table starts (0 when not from TOML).
    pub line: usize,
    /// Peer tier only: how it replicates.
    pub peer: Option<PeerConfig>,
    /// s3 and gcs tiers only: how they reach their bucket.
    pub object: Option<ObjectOptions>,
}

/// Default part size of an object-store tier's multipart uploads.
pub const DEFAULT_PART_SIZE: u64 = 16 << 20;
/// S3 refuses smaller parts (but the last); GCS's XML multipart API has the same rule.
const MIN_PART_SIZE: u64 = 5 << 20;
const MAX_PART_SIZE: u64 = 5 << 30;
/// Default number of parts of one object uploaded at once.
pub const DEFAULT_CONCURRENCY: usize = 4;
const MAX_CONCURRENCY: usize = 64;

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
        }
    }
}

/// The keys of a `kind = "peer"` tier; its `location` is the `listen` address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerConfig {
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

#[derive(Debug, Clone)]
pub struct Policy {
    /// The file path, or a label such as `<dict>`.
    pub source: String,
    /// In file order, fastest first; the first is the (only) memory tier.
    pub tiers: Vec<TierConfig>,
    pub restore_order: Vec<String>,
    pub chunk_size: u64,
    /// Copy threads for the blocking part of a save.
    pub threads: usize,
    /// Background scheduler workers.
    pub io_threads: usize,
}

impl Policy {
    /// Reads and validates a TOML policy file.
    pub fn load(path: &Path) -> Result<Policy> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::config(format!("cannot read policy file {}: {e}", path.display())))?;
        Self::from_toml(&text, &path.display().to_string())
    }

    pub fn from_toml(text: &str, source: &str) -> Result<Policy> {
        let root: Node = toml::from_str(text).map_err(|e| {
            // An error at the end of input (an unclosed array) is placed on the last line that
            // has text, not on the empty line after the final newline.
            let at = e.span().map(|s| line_of(text, s.start.min(text.trim_end().len())));
            let line = at.map_or(String::new(), |l| format!("{l}:"));
            // toml's messages may span lines ("invalid array\nexpected `]`"): keep it one line.
            let message = e.message().trim().replace('\n', "; ");
            // Quote the line, so the key is named even when toml's message does not.
            let quoted = at.and_then(|l| text.lines().nth(l - 1)).map(|l| format!(" (line: `{}`)", l.trim())).unwrap_or_default();
            Error::config(format!("{source}:{line} invalid TOML: {message}{quoted}"))
        })?;
        Checker { source, text: Some(text) }.policy(&root)
    }

    /// The same schema as a JSON object: `{"tier": [{...}], "restore": {"order": [...]},
    /// "store": {...}}`.
    pub fn from_json(text: &str, source: &str) -> Result<Policy> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::config(format!("{source}: invalid JSON: {e}")))?;
        Checker { source, text: None }.policy(&Node::from(value))
    }

    pub fn tier(&self, name: &str) -> Option<&TierConfig> {
        self.tiers.iter().find(|t| t.name == name)
    }

    /// The first tier, which validation guarantees is the one memory tier.
    pub fn memory_tier(&self) -> &TierConfig {
        &self.tiers[0]
    }
}

/// Parses a byte size: `"8GiB"`, `"512 MiB"`, `"1.5GB"`, `"4096"`. KB/MB/GB/TB are decimal
/// (1000^n), KiB/MiB/GiB/TiB binary (1024^n).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    parse_bytes(s).map_err(|why| format!("{s:?} is not a size ({why}); write e.g. \"8GiB\", \"1.5GB\" or 4096 (bytes)"))
}

/// Parses bytes per second: `"2GB/s"`, `"100MiB/s"`; `"2GB"` and a plain integer also work.
pub fn parse_bandwidth(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    parse_bytes(t.strip_suffix("/s").unwrap_or(t))
        .map_err(|why| format!("{s:?} is not a bandwidth ({why}); write e.g. \"2GB/s\" or \"100MiB/s\""))
}

/// A number with an optional unit, exactly in bytes. Returns why not, for the caller to wrap.
fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = (&s[..split], s[split..].trim_start());
    // Decimal arithmetic in integers, so that "1.5GiB" is exact and "1.5B" is refused.
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let digits = format!("{whole}{fraction}");
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err("not a non-negative number".into());
    }
    let multiplier = unit_multiplier(unit)?;
    let too_large = || "too large".to_string();
    let mantissa: u128 = digits.parse().map_err(|_| too_large())?;
    let scale = 10u128.checked_pow(fraction.len() as u32).ok_or_else(too_large)?;
    let total = mantissa.checked_mul(multiplier.into()).ok_or_else(too_large)?;
    if total % scale != 0 {
        return Err("not a whole number of bytes".into());
    }
    u64::try_from(total / scale).map_err(|_| too_large())
}

fn unit_multiplier(unit: &str) -> std::result::Result<u64, String> {
    if unit.is_empty() || unit == "B" {
        return Ok(1);
    }
    let unknown = || format!("unknown unit `{unit}`: use B, KB, MB, GB, TB or KiB, MiB, GiB, TiB");
    let mut chars = unit.chars();
    let power = match chars.next().map(|c| c.to_ascii_uppercase()) {
        Some('K') => 1,
        Some('M') => 2,
        Some('G') => 3,
        Some('T') => 4,
        _ => return Err(unknown()),
    };
    match chars.as_str() {
        "B" => Ok(1000u64.pow(power)),
        "iB" | "ib" | "IB" | "Ib" => Ok(1024u64.pow(power)),
        // Network speeds are often quoted in bits (10Gb/s = 1.25GB/s): refuse rather than guess.
        "b" => Err(format!("`{unit}` means bits; write `{}B` for bytes", &unit[..1])),
        _ => Err(unknown()),
    }
}

// ---------------------------------------------------------------------------------------------
// The source tree: TOML or JSON values with their positions
// ---------------------------------------------------------------------------------------------

/// A value from the source, with the byte offset where it starts (TOML only; toml has no
/// position for implicit tables such as `a` in `[a.b]`).
#[derive(Debug)]
struct Node {
    pos: Option<usize>,
    value: Value,
}

#[derive(Debug)]
enum Value {
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
    Datetime(String),
    Null,
    List(Vec<Node>),
    /// Entries in source order.
    Table(Vec<(String, Node)>),
}

impl Node {
    fn bare(value: Value) -> Node {
        Node { pos: None, value }
    }

    /// Where this node, or failing that the first of its children, starts.
    fn first_pos(&self) -> Option<usize> {
        self.pos.or_else(|| match &self.value {
            Value::List(items) => items.iter().find_map(Node::first_pos),
            Value::Table(entries) => entries.iter().find_map(|(_, n)| n.first_pos()),
            _ => None,
        })
    }

    /// The value as an error message quotes it after "got".
    fn describe(&self) -> String {
        match &self.value {
            Value::Str(s) => format!("{s:?}"),
            Value::Int(n) => n.to_string(),
            Value::Float(x) => x.to_string(),
            Value::Bool(b) => b.to_string(),
            Value::Datetime(d) => format!("the date-time {d}"),
            Value::Null => "null".into(),
            Value::List(_) => "a list".into(),
            Value::Table(_) => "a table".into(),
        }
    }
}

impl From<serde_json::Value> for Node {
    fn from(v: serde_json::Value) -> Node {
        use serde_json::Value as J;
        Node::bare(match v {
            J::Null => Value::Null,
            J::Bool(b) => Value::Bool(b),
            // An integer beyond i64 is no valid setting; as a float it is reported as such.
            J::Number(n) => n.as_i64().map_or_else(|| Value::Float(n.as_f64().unwrap_or(f64::NAN)), Value::Int),
            J::String(s) => Value::Str(s),
            J::Array(items) => Value::List(items.into_iter().map(Node::from).collect()),
            J::Object(map) => Value::Table(map.into_iter().map(|(k, v)| (k, Node::from(v))).collect()),
        })
    }
}

// toml 0.8 hands out positions through serde_spanned's protocol: a struct with these magic
// names, answered with a map of start, end and value. We speak it directly rather than use
// `toml::Spanned<T>`, because toml answers an implicit table without a position with its plain
// entries, which `Spanned` rejects; `NodeVisitor` takes either answer.
const SPANNED_NAME: &str = "$__serde_spanned_private_Spanned";
const SPANNED_START: &str = "$__serde_spanned_private_start";
const SPANNED_FIELDS: &[&str] = &[SPANNED_START, "$__serde_spanned_private_end", "$__serde_spanned_private_value"];
/// toml presents a date-time as a map with this single key.
const TOML_DATETIME: &str = "$__toml_private_datetime";

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Node, D::Error> {
        d.deserialize_struct(SPANNED_NAME, SPANNED_FIELDS, NodeVisitor)
    }
}

/// Reads the value inside a span answer without asking for a span again (which would recurse).
struct Unspanned;

impl<'de> DeserializeSeed<'de> for Unspanned {
    type Value = Node;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Node, D::Error> {
        d.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a TOML value")
    }
    fn visit_bool<E>(self, b: bool) -> std::result::Result<Node, E> {
        Ok(Node::bare(Value::Bool(b)))
    }
    fn visit_i64<E>(self, n: i64) -> std::result::Result<Node, E> {
        Ok(Node::bare(Value::Int(n)))
    }
    fn visit_u64<E>(self, n: u64) -> std::result::Result<Node, E> {
        Ok(Node::bare(i64::try_from(n).map_or(Value::Float(n as f64), Value::Int)))
    }
    fn visit_f64<E>(self, x: f64) -> std::result::Result<Node, E> {
        Ok(Node::bare(Value::Float(x)))
    }
    fn visit_str<E>(self, s: &str) -> std::result::Result<Node, E> {
        Ok(Node::bare(Value::Str(s.to_string())))
    }
    fn visit_unit<E>(self) -> std::result::Result<Node, E> {
        Ok(Node::bare(Value::Null))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Node>()? {
            items.push(item);
        }
        Ok(Node::bare(Value::List(items)))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                SPANNED_START => {
                    // The span answer: start, end, then the value itself.
                    let start: usize = map.next_value()?;
                    map.next_key::<String>()?;
                    map.next_value::<usize>()?;
                    map.next_key::<String>()?;
                    let node = map.next_value_seed(Unspanned)?;
                    return Ok(Node { pos: Some(start), ..node });
                }
                TOML_DATETIME => return Ok(Node::bare(Value::Datetime(map.next_value()?))),
                _ => entries.push((key, map.next_value::<Node>()?)),
            }
        }
        Ok(Node::bare(Value::Table(entries)))
    }
}

// ---------------------------------------------------------------------------------------------
// Validation
// ---------------------------------------------------------------------------------------------

const TOP_KEYS: &[&str] = &["tier", "restore", "store"];
const TIER_KEYS: &[&str] = &[
    "name",
    "kind",
    "root",
    "url",
    "every",
    "keep",
    "compression",
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
];
/// Keys that only object-store tiers (s3, gcs) take.
const OBJECT_KEYS: &[&str] = &["endpoint", "region", "allow_http", "part_size", "concurrency", "timeout", "retries"];
/// Keys that only a peer tier takes.
const PEER_KEYS: &[&str] = &["replicas", "placement", "listen", "secret"];
const RESTORE_KEYS: &[&str] = &["order"];
const STORE_KEYS: &[&str] = &["chunk_size", "threads", "io_threads"];
/// Where each key belongs, to point a key written in the wrong table to the right one.
const SECTIONS: &[(&str, &[&str])] =
    &[("the top level", TOP_KEYS), ("[[tier]]", TIER_KEYS), ("[restore]", RESTORE_KEYS), ("[store]", STORE_KEYS)];

/// 1-based line of a byte offset.
fn line_of(text: &str, pos: usize) -> usize {
    let end = pos.min(text.len());
    text.as_bytes()[..end].iter().filter(|&&b| b == b'\n').count() + 1
}

/// Builds a `Policy` from a source tree and phrases its errors.
struct Checker<'a> {
    source: &'a str,
    /// The TOML text, to turn positions into lines; `None` for JSON.
    text: Option<&'a str>,
}

impl Checker<'_> {
    /// The 1-based line where `node` starts (TOML only).
    fn line(&self, node: &Node) -> Option<usize> {
        Some(line_of(self.text?, node.first_pos()?))
    }

    /// An error about `node`, found under key path `path`.
    fn at(&self, node: &Node, path: &str, msg: impl fmt::Display) -> Error {
        match self.line(node) {
            Some(line) => Error::config(format!("{}:{line}: {path}: {msg}", self.source)),
            None => Error::config(format!("{}: {path}: {msg}", self.source)),
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

    fn policy(&self, root: &Node) -> Result<Policy> {
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
        let mut policy = Policy {
            source: self.source.to_string(),
            restore_order: restore_order.unwrap_or_else(|| tiers.iter().map(|t| t.name.clone()).collect()),
            tiers,
            chunk_size: DEFAULT_CHUNK_SIZE,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_DEFAULT_THREADS),
            io_threads: DEFAULT_IO_THREADS,
        };
        if let Some(node) = get("store") {
            self.store(node, &mut policy)?;
        }
        Ok(policy)
    }

    /// Tier `i`; `earlier` are the tiers before it, for the uniqueness and memory-tier rules.
    fn tier(&self, i: usize, node: &Node, earlier: &[TierConfig]) -> Result<TierConfig> {
        let bare_path = format!("tier[{i}]");
        let entries = self.table(node, &bare_path)?;
        let get = |key: &str| entries.iter().find(|(k, _)| k == key).map(|(_, n)| n);
        let missing = |path: &str, key: &str, what: &str| self.at(node, path, format!("missing `{key}` ({what})"));

        let name_path = format!("{bare_path}.name");
        let Some(name_node) = get("name") else {
            // A misspelt `name` is the likelier story, and its message the more helpful one.
            self.check_keys(entries, &bare_path, TIER_KEYS)?;
            return Err(missing(&bare_path, "name", "a unique name such as \"ram\""));
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
        let key_path = |key: &str| format!("{path}.{key}");
        self.check_keys(entries, &path, TIER_KEYS)?;

        let known_kinds = TierKind::ALL.iter().map(|k| format!("{:?}", k.as_str())).collect::<Vec<_>>().join(", ");
        let kind_node = get("kind").ok_or_else(|| missing(&path, "kind", &format!("one of {known_kinds}")))?;
        let kind_name = self.string(kind_node, &key_path("kind"))?;
        let kind = TierKind::from_name(kind_name)
            .ok_or_else(|| self.at(kind_node, &key_path("kind"), format!("unknown kind {kind_name:?}; known kinds: {known_kinds}")))?;
        // The blocking part of a save copies into shared memory, so that tier comes first, once.
        match (i, &kind) {
            (0, TierKind::Memory) => {}
            (0, _) => {
                return Err(self.at(
                    kind_node,
                    &key_path("kind"),
                    format!("the first tier must be kind \"memory\" (a save copies into shared memory first), got {kind_name:?}"),
                ))
            }
            (_, TierKind::Memory) => {
                return Err(self.at(
                    kind_node,
                    &key_path("kind"),
                    format!("only one memory tier is allowed, and tier[0] ({:?}) is one", earlier[0].name),
                ))
            }
            _ => {}
        }

        if kind != TierKind::Peer {
            if let Some(key) = PEER_KEYS.iter().find(|k| get(k).is_some()) {
                return Err(self.at(get(key).unwrap(), &key_path(key), format!("`{key}` is only valid for kind \"peer\"")));
            }
        }
        if kind == TierKind::Peer {
            for key in ["root", "url"] {
                if let Some(n) = get(key) {
                    return Err(self.at(
                        n,
                        &key_path(key),
                        format!(
                            "`{key}` is not valid for kind \"peer\": peer copies live under the memory tier's root; \
                         set `listen` for the address to serve them on"
                        ),
                    ));
                }
            }
            let listen = match get("listen") {
                Some(n) => {
                    let v = self.string(n, &key_path("listen"))?;
                    if v.parse::<std::net::SocketAddr>().is_err() {
                        return Err(self.at(n, &key_path("listen"), format!("expected an address such as \"0.0.0.0:7070\", got {v:?}")));
                    }
                    v.to_string()
                }
                None => DEFAULT_PEER_LISTEN.to_string(),
            };
            let replicas = match get("replicas") {
                Some(n) => {
                    let r = self.positive_int(n, &key_path("replicas"))? as usize;
                    if r < 2 {
                        return Err(self.at(
                            n,
                            &key_path("replicas"),
                            "a peer tier needs replicas >= 2 (this host's copy and at least one peer's)".to_string(),
                        ));
                    }
                    r
                }
                None => DEFAULT_REPLICAS,
            };
            let placement = match get("placement") {
                Some(n) => {
                    let v = self.string(n, &key_path("placement"))?;
                    if !["mixed", "group", "ring"].contains(&v) {
                        return Err(self.at(n, &key_path("placement"), format!("expected \"mixed\", \"group\" or \"ring\", got {v:?}")));
                    }
                    v.to_string()
                }
                None => "mixed".to_string(),
            };
            let secret = get("secret").map(|n| self.string(n, &key_path("secret")).map(String::from)).transpose()?;
            let optional = |key: &str| get(key).map(|n| (n, key_path(key)));
            if let Some((n, p)) = optional("compression") {
                return Err(self.at(n, &p, "a peer tier stores raw chunks in memory; `compression` is not valid".to_string()));
            }
            return Ok(TierConfig {
                every: optional("every").map_or(Ok(1), |(n, p)| self.positive_int(n, &p))?,
                keep: optional("keep").map_or(Ok(Some(DEFAULT_MEMORY_KEEP)), |(n, p)| self.count(n, &p).map(Some))?,
                compression: Compression::none(),
                bandwidth: optional("bandwidth")
                    .map(|(n, p)| self.bytes(n, &p, parse_bandwidth, "a bandwidth such as \"2GB/s\""))
                    .transpose()?,
                capacity: None,
                name: name.to_string(),
                kind,
                location: listen,
                line: self.line(node).unwrap_or(0),
                peer: Some(PeerConfig { replicas, placement, secret }),
                object: None,
            });
        }

        // Each kind takes its location under one key; the other key is a mistake.
        let (location_key, other_key) = match kind {
            TierKind::Memory => ("root", "url"),
            TierKind::Fs | TierKind::S3 | TierKind::Gcs => ("url", "root"),
            TierKind::Peer => unreachable!("handled above"),
        };
        if let Some(other) = get(other_key) {
            return Err(self.at(
                other,
                &key_path(other_key),
                format!("`{other_key}` is not valid for kind {kind_name:?}; use `{location_key}`"),
            ));
        }
        let location_node = get(location_key).ok_or_else(|| {
            let what = match kind {
                TierKind::Memory => "the shared-memory directory, e.g. \"/dev/shm/tiercel\"",
                TierKind::Fs => "a directory path or file:// URL",
                TierKind::S3 => "the bucket and prefix, e.g. \"s3://bucket/checkpoints/run1\"",
                TierKind::Gcs => "the bucket and prefix, e.g. \"gs://bucket/checkpoints/run1\"",
                TierKind::Peer => unreachable!(),
            };
            missing(&path, location_key, what)
        })?;
        let location = self.string(location_node, &key_path(location_key))?;
        let location = match kind {
            TierKind::Memory => location.to_string(),
            TierKind::Fs => fs_path(location).map_err(|m| self.at(location_node, &key_path("url"), m))?,
            TierKind::S3 | TierKind::Gcs => object_url(&kind, location).map_err(|m| self.at(location_node, &key_path("url"), m))?,
            TierKind::Peer => unreachable!(),
        };

        let (default_keep, default_compression) = match kind {
            TierKind::Memory => (Some(DEFAULT_MEMORY_KEEP), Compression::none()),
            TierKind::Fs | TierKind::S3 | TierKind::Gcs => (None, Compression::zstd(DEFAULT_ZSTD_LEVEL)),
            TierKind::Peer => unreachable!(),
        };
        let optional = |key: &str| get(key).map(|n| (n, key_path(key)));
        let object = if kind.is_object_store() {
            Some(self.object_options(&kind, &optional)?)
        } else {
            if let Some((key, node)) = entries.iter().find(|(k, _)| OBJECT_KEYS.contains(&k.as_str())) {
                return Err(self.at(
                    node,
                    &key_path(key),
                    format!("`{key}` is not valid for kind {kind_name:?}; it applies to \"s3\" and \"gcs\" tiers"),
                ));
            }
            None
        };
        Ok(TierConfig {
            every: optional("every").map_or(Ok(1), |(n, p)| self.positive_int(n, &p))?,
            keep: optional("keep").map_or(Ok(default_keep), |(n, p)| self.count(n, &p).map(Some))?,
            compression: match optional("compression") {
                Some((n, p)) => Compression::parse(self.string(n, &p)?).map_err(|m| self.at(n, &p, m))?,
                None => default_compression,
            },
            bandwidth: optional("bandwidth")
                .map(|(n, p)| self.bytes(n, &p, parse_bandwidth, "a bandwidth such as \"2GB/s\""))
                .transpose()?,
            capacity: optional("capacity").map(|(n, p)| self.bytes(n, &p, parse_size, "a size such as \"64GiB\"")).transpose()?,
            name: name.to_string(),
            kind,
            location,
            line: self.line(node).unwrap_or(0),
            peer: None,
            object,
        })
    }

    /// The object-store keys of an s3 or gcs tier.
    fn object_options<'n>(&self, kind: &TierKind, optional: &dyn Fn(&str) -> Option<(&'n Node, String)>) -> Result<ObjectOptions> {
        let mut o = ObjectOptions::default();
        if let Some((n, p)) = optional("endpoint") {
            let e = self.string(n, &p)?.trim().trim_end_matches('/');
            let rest = e.strip_prefix("http://").or_else(|| e.strip_prefix("https://"));
            if !rest.is_some_and(|r| !r.is_empty() && !r.contains(char::is_whitespace)) {
                return Err(self.expected(n, &p, "an http:// or https:// URL such as \"http://127.0.0.1:9000\""));
            }
            o.endpoint = Some(e.to_string());
        }
        if let Some((n, p)) = optional("region") {
            if *kind != TierKind::S3 {
                return Err(self.at(n, &p, format!("`region` is not valid for kind {:?}; it applies to \"s3\" tiers", kind.as_str())));
            }
            o.region = Some(self.string(n, &p)?.trim().to_string());
        }
        if let Some((n, p)) = optional("allow_http") {
            match n.value {
                Value::Bool(b) => o.allow_http = Some(b),
                _ => return Err(self.expected(n, &p, "true or false")),
            }
        }
        if let Some((n, p)) = optional("part_size") {
            let size = self.bytes(n, &p, parse_size, "a size such as \"16MiB\"")?;
            if !(MIN_PART_SIZE..=MAX_PART_SIZE).contains(&size) {
                return Err(self.at(
                    n,
                    &p,
                    format!("expected a size between 5MiB (the smallest part S3 accepts) and 5GiB, got {}", n.describe()),
                ));
            }
            o.part_size = size;
        }
        if let Some((n, p)) = optional("concurrency") {
            let c = self.count(n, &p)?;
            if c > MAX_CONCURRENCY {
                return Err(self.expected(n, &p, &format!("a positive integer up to {MAX_CONCURRENCY}")));
            }
            o.concurrency = c;
        }
        if let Some((n, p)) = optional("timeout") {
            o.timeout = Some(self.positive_int(n, &p)?);
        }
        if let Some((n, p)) = optional("retries") {
            match n.value {
                Value::Int(r) if (0..=100).contains(&r) => o.retries = Some(r as usize),
                _ => return Err(self.expected(n, &p, "an integer from 0 to 100")),
            }
        }
        Ok(o)
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
                "threads" => policy.threads = self.count(value, &path)?,
                "io_threads" => policy.io_threads = self.count(value, &path)?,
                _ => unreachable!("check_keys admits only STORE_KEYS"),
            }
        }
        Ok(())
    }
}

/// The directory an fs tier's `url` names: a plain path, or a local `file://` URL.
fn fs_path(url: &str) -> std::result::Result<String, String> {
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

/// The `s3://bucket/prefix` or `gs://bucket/prefix` URL of an object-store tier, normalized
/// (no trailing slash, no empty segments).
fn object_url(kind: &TierKind, url: &str) -> std::result::Result<String, String> {
    let scheme = match kind {
        TierKind::Gcs => "gs",
        _ => "s3",
    };
    let example = format!("{scheme}://bucket/checkpoints/run1");
    let Some(rest) = url.trim().strip_prefix(&format!("{scheme}://")) else {
        let article = if scheme == "s3" { "an" } else { "a" };
        return Err(format!("expected {article} {scheme}:// URL for kind {:?} such as {example:?}, got {url:?}", kind.as_str()));
    };
    let mut parts = rest.split('/').filter(|p| !p.is_empty());
    let bucket = parts.next().unwrap_or("");
    // What S3 and GCS both accept (GCS also takes `_` and longer dotted names).
    let valid_bucket = (3..=222).contains(&bucket.len())
        && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._".contains(&b))
        && bucket.as_bytes()[0].is_ascii_alphanumeric()
        && bucket.as_bytes()[bucket.len() - 1].is_ascii_alphanumeric();
    if !valid_bucket {
        return Err(format!(
            "expected a bucket name of lowercase letters, digits, `-` and `.` (3 or more) after {scheme}://, got {url:?} (e.g. {example:?})"
        ));
    }
    let prefix: Vec<&str> = parts.collect();
    if let Some(bad) = prefix.iter().find(|p| **p == "." || **p == ".." || p.contains(char::is_control)) {
        return Err(format!("the prefix of {url:?} has an invalid segment {bad:?}"));
    }
    Ok(if prefix.is_empty() { format!("{scheme}://{bucket}") } else { format!("{scheme}://{bucket}/{}", prefix.join("/")) })
}

/// The known key closest to `key` by edit distance, if close enough to be a likely typo, or
/// one that `key` abbreviates.
fn closest<'k>(key: &str, known: &[&'k str]) -> Option<&'k str> {
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
fn edit_distance(a: &str, b: &str) -> usize {
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

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"[[tier]]
name = "ram"
kind = "memory"
root = "/dev/shm/tiercel/run1"
capacity = "8GiB"
keep = 2

[[tier]]
name = "disk"
kind = "fs"
url = "/mnt/ckpt/run1"
every = 10
keep = 3
compression = "zstd:3"
bandwidth = "2GB/s"

[restore]
order = ["ram", "disk"]
"#;

    const MINIMAL: &str = "[[tier]]\nname = \"ram\"\nkind = \"memory\"\nroot = \"/dev/shm/t\"\n";

    fn toml_err(text: &str) -> String {
        let e = Policy::from_toml(text, "tiercel.toml").expect_err("policy should be rejected");
        assert_eq!(e.kind, crate::error::ErrorKind::Config);
        e.message
    }

    fn json_err(text: &str) -> String {
        Policy::from_json(text, "<dict>").expect_err("policy should be rejected").message
    }

    /// `MINIMAL` plus a second (fs) tier with `extra` lines; its lines start at 5.
    fn with_disk(extra: &str) -> String {
        format!("{MINIMAL}[[tier]]\nname = \"disk\"\nkind = \"fs\"\nurl = \"/mnt/c\"\n{extra}")
    }

    /// Asserts that `msg` starts with `tiercel.toml:<line>: ` and mentions each of `parts`.
    fn assert_at(msg: &str, line: usize, parts: &[&str]) {
        let prefix = format!("tiercel.toml:{line}: ");
        assert!(msg.starts_with(&prefix), "expected prefix {prefix:?} in {msg:?}");
        for part in parts {
            assert!(msg.contains(part), "expected {part:?} in {msg:?}");
        }
    }

    #[test]
    fn example_parses() {
        let p = Policy::from_toml(EXAMPLE, "tiercel.toml").unwrap();
        assert_eq!(p.source, "tiercel.toml");
        assert_eq!(p.tiers.len(), 2);
        let ram = p.memory_tier();
        assert_eq!((ram.name.as_str(), &ram.kind, ram.location.as_str()), ("ram", &TierKind::Memory, "/dev/shm/tiercel/run1"));
        assert_eq!(ram.capacity, Some(8 << 30));
        assert_eq!(ram.keep, Some(2));
        assert_eq!(ram.every, 1);
        assert_eq!(ram.compression, Compression::none());
        assert_eq!(ram.bandwidth, None);
        assert_eq!(ram.line, 1);
        let disk = p.tier("disk").unwrap();
        assert_eq!((disk.kind.as_str(), disk.location.as_str()), ("fs", "/mnt/ckpt/run1"));
        assert_eq!((disk.every, disk.keep), (10, Some(3)));
        assert_eq!(disk.compression, Compression { codec: Codec::Zstd { level: 3 }, bytegroup: false });
        assert_eq!(disk.bandwidth, Some(2_000_000_000));
        assert_eq!(disk.capacity, None);
        assert_eq!(disk.line, 8);
        assert!(p.tier("tape").is_none());
        assert_eq!(p.restore_order, ["ram", "disk"]);
        assert_eq!((p.chunk_size, p.io_threads), (DEFAULT_CHUNK_SIZE, 2));
        assert!((1..=8).contains(&p.threads));
    }

    #[test]
    fn defaults() {
        let p = Policy::from_toml(&with_disk(""), "p.toml").unwrap();
        let (ram, disk) = (&p.tiers[0], &p.tiers[1]);
        assert_eq!((ram.every, ram.keep, ram.compression), (1, Some(2), Compression::none()));
        assert_eq!((disk.every, disk.keep), (1, None));
        assert_eq!(disk.compression.to_string(), "zstd:3");
        assert_eq!((disk.bandwidth, disk.capacity), (None, None));
        assert_eq!(p.restore_order, ["ram", "disk"]);
        assert_eq!(p.chunk_size, 4 << 20);
        assert_eq!(p.io_threads, 2);
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(p.threads, cores.min(8));
    }

    #[test]
    fn store_settings_and_file_urls() {
        let text = with_disk("[store]\nchunk_size = \"1MiB\"\nthreads = 3\nio_threads = 5\n").replace("/mnt/c", "file:///mnt/c");
        let p = Policy::from_toml(&text, "p.toml").unwrap();
        assert_eq!((p.chunk_size, p.threads, p.io_threads), (1 << 20, 3, 5));
        assert_eq!(p.tiers[1].location, "/mnt/c");
        assert_eq!(fs_path("file://localhost/x/y").unwrap(), "/x/y");
        assert_eq!(fs_path("relative/dir").unwrap(), "relative/dir");
        let p = Policy::from_toml(&format!("{MINIMAL}[store]\nchunk_size = 65536\n"), "p.toml").unwrap();
        assert_eq!(p.chunk_size, 65536);
    }

    #[test]
    fn load_reads_a_file_and_names_a_missing_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiercel.toml");
        std::fs::write(&path, EXAMPLE).unwrap();
        let p = Policy::load(&path).unwrap();
        assert_eq!(p.source, path.display().to_string());
        let missing = dir.path().join("nope.toml");
        let e = Policy::load(&missing).unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Config);
        assert!(e.message.contains(&missing.display().to_string()), "{}", e.message);
    }

    #[test]
    fn json_matches_toml() {
        let json = r#"{
            "tier": [
                {"name": "ram", "kind": "memory", "root": "/dev/shm/tiercel/run1", "capacity": "8GiB", "keep": 2},
                {"name": "disk", "kind": "fs", "url": "/mnt/ckpt/run1", "every": 10, "keep": 3,
                 "compression": "zstd:3", "bandwidth": "2GB/s"}
            ],
            "restore": {"order": ["ram", "disk"]}
        }"#;
        let from_json = Policy::from_json(json, "<dict>").unwrap();
        let from_toml = Policy::from_toml(EXAMPLE, "<dict>").unwrap();
        assert_eq!(from_json.tiers.iter().map(|t| t.line).collect::<Vec<_>>(), [0, 0]);
        // Equal but for the lines, which only TOML has.
        let unlined = |p: &Policy| {
            let mut p = p.clone();
            p.tiers.iter_mut().for_each(|t| t.line = 0);
            format!("{p:?}")
        };
        assert_eq!(unlined(&from_json), unlined(&from_toml));
        // Integers stand for bytes in both forms.
        let p = Policy::from_json(
            r#"{"tier":[{"name":"m","kind":"memory","root":"/r","capacity":4096}],"store":{"chunk_size":1048576}}"#,
            "<dict>",
        )
        .unwrap();
        assert_eq!((p.tiers[0].capacity, p.chunk_size), (Some(4096), 1 << 20));
    }

    #[test]
    fn json_errors_have_paths_without_lines() {
        let base = r#"{"name":"ram","kind":"memory","root":"/r"}"#;
        let msg = json_err(&format!(r#"{{"tier":[{base},{{"name":"disk","kind":"fs","url":"/d","keep":-1}}]}}"#));
        assert_eq!(msg, "<dict>: tier[1].keep: expected a positive integer, got -1");
        let msg = json_err(&format!(r#"{{"tier":[{base}],"stor":{{}}}}"#));
        assert!(msg.starts_with("<dict>: stor: unknown key `stor`") && msg.contains("did you mean `store`?"), "{msg}");
        let msg = json_err(&format!(r#"{{"tier":[{base}],"store":{{"threads":null}}}}"#));
        assert_eq!(msg, "<dict>: store.threads: expected a positive integer, got null");
        assert!(json_err("[1, 2]").starts_with("<dict>: top level: expected a table"));
        assert!(json_err("{\"tier\": [").starts_with("<dict>: invalid JSON"));
    }

    #[test]
    fn syntax_error_names_its_line() {
        let msg = toml_err("[[tier]]\nname = \"ram\"\nkind = memory\n");
        assert_at(&msg, 3, &["invalid TOML"]);
        assert!(!msg.contains('\n'), "{msg:?}");
        assert_at(&toml_err("[[tier]]\nname = \"a\"\nname = \"b\"\n"), 3, &["invalid TOML"]);
        assert_at(&toml_err("[[tier]]\nx = [1,\n\n"), 2, &["invalid TOML"]);
    }

    #[test]
    fn unknown_keys_are_named_with_suggestions() {
        let msg = toml_err(&with_disk("evry = 10\n"));
        assert_at(&msg, 9, &["tier[1] (\"disk\").evry", "unknown key `evry`", "did you mean `every`?"]);
        let msg = toml_err(&format!("{MINIMAL}chunk_size = 4096\n"));
        assert_at(&msg, 5, &["tier[0] (\"ram\").chunk_size", "belongs in [store]"]);
        let msg = toml_err(&format!("{MINIMAL}colour = 1\n"));
        assert_at(&msg, 5, &["unknown key `colour`", "known keys: name, kind"]);
        let msg = toml_err(&format!("version = 1\n{MINIMAL}"));
        assert_at(&msg, 1, &["version: unknown key `version`"]);
        let msg = toml_err(&format!("{MINIMAL}[restore]\nordr = [\"ram\"]\n"));
        assert_at(&msg, 6, &["restore.ordr", "did you mean `order`?"]);
        let msg = toml_err(&format!("{MINIMAL}[store]\nthreads = 2\nio_thread = 1\n"));
        assert_at(&msg, 7, &["store.io_thread", "did you mean `io_threads`?"]);
        // An implicit table (toml gives it no position) is placed at its first entry, the header.
        let msg = toml_err(&format!("{MINIMAL}\n[extra.sub]\nk = 1\n"));
        assert_at(&msg, 6, &["extra: unknown key `extra`"]);
    }

    #[test]
    fn wrong_types_and_values() {
        let cases: &[(&str, &str, &str)] = &[
            ("keep = -1", "tier[1] (\"disk\").keep: expected a positive integer, got -1", ""),
            ("keep = 0", ".keep: expected a positive integer, got 0", ""),
            ("every = \"10\"", ".every: expected a positive integer, got \"10\"", ""),
            ("every = 1.5", ".every: expected a positive integer, got 1.5", ""),
            ("compression = \"lz4\"", ".compression: expected \"none\"", "\"lz4\""),
            ("compression = \"zstd:25\"", ".compression: zstd level must be", "25"),
            ("compression = 3", ".compression: expected a non-empty string, got 3", ""),
            ("bandwidth = \"fast\"", ".bandwidth: \"fast\" is not a bandwidth", "2GB/s"),
            ("bandwidth = \"10Gb/s\"", ".bandwidth:", "means bits"),
            ("bandwidth = 0", ".bandwidth: expected a bandwidth such as \"2GB/s\" or a positive integer, got 0", ""),
            ("capacity = \"0GB\"", ".capacity: expected a positive amount", "\"0GB\""),
            ("capacity = true", ".capacity: expected", "got true"),
            ("capacity = 1979-05-27", ".capacity: expected", "date-time 1979-05-27"),
            ("url = \"x\"", "invalid TOML", ""), // a duplicate key is a TOML error
        ];
        for (line, part1, part2) in cases {
            let msg = toml_err(&with_disk(&format!("{line}\n")));
            assert_at(&msg, 9, &[part1, part2]);
        }
    }

    #[test]
    fn names_and_kinds() {
        let msg = toml_err("[[tier]]\nkind = \"memory\"\nroot = \"/r\"\n");
        assert_at(&msg, 1, &["tier[0]: missing `name`"]);
        let msg = toml_err("[[tier]]\nname = \"a b\"\nkind = \"memory\"\nroot = \"/r\"\n");
        assert_at(&msg, 2, &["tier[0].name: expected a name of letters, digits"]);
        let msg = toml_err("[[tier]]\nname = \"\"\nkind = \"memory\"\nroot = \"/r\"\n");
        assert_at(&msg, 2, &["tier[0].name: expected a non-empty string"]);
        let msg = toml_err(&with_disk("").replace("\"disk\"", "\"ram\""));
        assert_at(&msg, 6, &["tier[1].name: duplicate tier name \"ram\", already used by tier[0]"]);
        let msg = toml_err(&with_disk("").replace("\"fs\"", "\"tape\""));
        assert_at(&msg, 7, &["tier[1] (\"disk\").kind: unknown kind \"tape\"; known kinds: \"memory\", \"fs\"", "\"s3\", \"gcs\""]);
        let msg = toml_err("[[tier]]\nname = \"ram\"\nroot = \"/r\"\n");
        assert_at(&msg, 1, &["tier[0] (\"ram\"): missing `kind`", "\"memory\", \"fs\""]);
    }

    #[test]
    fn memory_tier_rules() {
        let msg = toml_err("[[tier]]\nname = \"disk\"\nkind = \"fs\"\nurl = \"/d\"\n");
        assert_at(&msg, 3, &["tier[0] (\"disk\").kind", "first tier must be kind \"memory\""]);
        let msg = toml_err(&format!("{MINIMAL}[[tier]]\nname = \"ram2\"\nkind = \"memory\"\nroot = \"/r2\"\n"));
        assert_at(&msg, 7, &["tier[1] (\"ram2\").kind", "only one memory tier"]);
        let msg = toml_err(&format!("{MINIMAL}url = \"/x\"\n"));
        assert_at(&msg, 5, &["tier[0] (\"ram\").url", "not valid for kind \"memory\"; use `root`"]);
        let msg = toml_err("[[tier]]\nname = \"ram\"\nkind = \"memory\"\n");
        assert_at(&msg, 1, &["tier[0] (\"ram\"): missing `root`"]);
        let msg = toml_err(&with_disk("root = \"/x\"\n"));
        assert_at(&msg, 9, &["tier[1] (\"disk\").root", "use `url`"]);
        let msg = toml_err(&with_disk("").replace("url = \"/mnt/c\"\n", ""));
        assert_at(&msg, 5, &["tier[1] (\"disk\"): missing `url`"]);
        let msg = toml_err(&with_disk("").replace("/mnt/c", "s3://bucket/x"));
        assert_at(&msg, 8, &["tier[1] (\"disk\").url", "path or file:// URL"]);
        let msg = toml_err(&with_disk("").replace("/mnt/c", "file://host/x"));
        assert_at(&msg, 8, &["tier[1] (\"disk\").url", "local file:// URL"]);
    }

    #[test]
    fn tiers_are_required() {
        assert_eq!(toml_err(""), "tiercel.toml: no tiers: add at least one [[tier]] table (the first of kind \"memory\")");
        assert_at(&toml_err("tier = []\n"), 1, &["tier: expected a non-empty list of [[tier]] tables, got a list"]);
        assert_at(&toml_err("tier = 3\n"), 1, &["tier: expected a non-empty list"]);
        assert_at(&toml_err("[tier]\nname = \"x\"\n"), 1, &["tier: expected a non-empty list", "got a table"]);
    }

    #[test]
    fn restore_order_rules() {
        let p = Policy::from_toml(&with_disk("[restore]\norder = [\"disk\", \"ram\"]\n"), "p.toml").unwrap();
        assert_eq!(p.restore_order, ["disk", "ram"]);
        let p = Policy::from_toml(&format!("restore.order = [\"ram\"]\n{MINIMAL}"), "p.toml").unwrap();
        assert_eq!(p.restore_order, ["ram"]);
        let msg = toml_err(&with_disk("[restore]\norder = [\n  \"ram\",\n  \"tape\",\n]\n"));
        assert_at(&msg, 12, &["restore.order[1]: unknown tier \"tape\"; the tiers are \"ram\", \"disk\""]);
        let msg = toml_err(&with_disk("[restore]\norder = [\"ram\", \"ram\"]\n"));
        assert_at(&msg, 10, &["restore.order[1]: tier \"ram\" is listed twice"]);
        let msg = toml_err(&with_disk("[restore]\norder = []\n"));
        assert_at(&msg, 10, &["restore.order: expected a non-empty list of tier names"]);
        let msg = toml_err(&with_disk("[restore]\norder = \"ram\"\n"));
        assert_at(&msg, 10, &["restore.order: expected a non-empty list", "got \"ram\""]);
        let msg = toml_err(&with_disk("[restore]\norder = [1]\n"));
        assert_at(&msg, 10, &["restore.order[0]: expected a non-empty string, got 1"]);
    }

    #[test]
    fn store_rules() {
        for (value, part) in [
            ("chunk_size = \"1000\"", "store.chunk_size: expected a multiple of 4096 bytes between 64KiB and 1GiB, got \"1000\""),
            ("chunk_size = \"32KiB\"", "between 64KiB and 1GiB"),
            ("chunk_size = \"2GiB\"", "between 64KiB and 1GiB"),
            ("chunk_size = \"4MB\"", "multiple of 4096"),
            ("threads = 0", "store.threads: expected a positive integer, got 0"),
            ("io_threads = \"2\"", "store.io_threads: expected a positive integer, got \"2\""),
        ] {
            let msg = toml_err(&format!("{MINIMAL}\n[store]\n{value}\n"));
            assert_at(&msg, 7, &[part]);
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size(" 10B "), Ok(10));
        assert_eq!(parse_size("1KB"), Ok(1000));
        assert_eq!(parse_size("1kB"), Ok(1000));
        assert_eq!(parse_size("1KiB"), Ok(1024));
        assert_eq!(parse_size("2MB"), Ok(2_000_000));
        assert_eq!(parse_size("2TiB"), Ok(2 << 40));
        assert_eq!(parse_size("64gib"), Ok(64 << 30));
        assert_eq!(parse_size("0.5KiB"), Ok(512));
        assert_eq!(parse_size("0"), Ok(0));
        for bad in ["", "abc", "-1GB", "1.5", "1.2.3GB", "8 XB", "8K", "8Gb", "1e9", "99999999999999999999GB"] {
            let e = parse_size(bad).expect_err(bad);
            assert!(e.contains("is not a size") && e.contains("8GiB"), "{bad}: {e}");
        }
        assert!(parse_size("8Gb").unwrap_err().contains("means bits; write `GB`"));
        assert!(parse_size("0.1B").unwrap_err().contains("whole number of bytes"));
    }

    #[test]
    fn bandwidths() {
        assert_eq!(parse_bandwidth("2GB/s"), Ok(2_000_000_000));
        assert_eq!(parse_bandwidth("100MiB/s"), Ok(100 << 20));
        assert_eq!(parse_bandwidth("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_bandwidth("1.25 GB/s"), Ok(1_250_000_000));
        assert_eq!(parse_bandwidth("1000"), Ok(1000));
        let e = parse_bandwidth("10Gb/s").unwrap_err();
        assert!(e.contains("is not a bandwidth") && e.contains("means bits"), "{e}");
        assert!(parse_bandwidth("2GB/h").is_err());
        let p = Policy::from_toml(&with_disk("bandwidth = 1000000\n"), "p.toml").unwrap();
        assert_eq!(p.tiers[1].bandwidth, Some(1_000_000));
    }

    #[test]
    fn compression_strings() {
        let zstd = |level, bytegroup| Compression { codec: Codec::Zstd { level }, bytegroup };
        assert_eq!(Compression::parse("none"), Ok(Compression::none()));
        assert_eq!(Compression::parse("off"), Ok(Compression::none()));
        assert_eq!(Compression::parse("zstd"), Ok(zstd(3, false)));
        assert_eq!(Compression::parse("zstd:19"), Ok(zstd(19, false)));
        assert_eq!(Compression::parse("zstd:-7"), Ok(zstd(-7, false)));
        assert_eq!(Compression::parse("bytegroup+zstd"), Ok(zstd(3, true)));
        assert_eq!(Compression::parse("bytegroup+zstd:1"), Ok(zstd(1, true)));
        for bad in ["zstd:0", "zstd:20", "zstd:-8", "zstd:", "zstd:x", "zstd3", "lz4", "bytegroup", "bytegroup+none", ""] {
            assert!(Compression::parse(bad).is_err(), "{bad:?} accepted");
        }
        for c in [Compression::none(), zstd(3, false), zstd(-2, false), zstd(9, true)] {
            assert_eq!(Compression::parse(&c.to_string()), Ok(c));
        }
        assert_eq!(zstd(9, true).to_string(), "bytegroup+zstd:9");
    }

    /// `MINIMAL` plus an object-store tier "bucket" of `kind` at `url`, with `extra` lines
    /// (which start at line 9).
    fn with_bucket(kind: &str, url: &str, extra: &str) -> String {
        format!("{MINIMAL}[[tier]]\nname = \"bucket\"\nkind = \"{kind}\"\nurl = \"{url}\"\n{extra}")
    }

    #[test]
    fn object_store_tiers() {
        let p = Policy::from_toml(&with_bucket("s3", "s3://ckpt/run1/", ""), "p.toml").unwrap();
        let t = &p.tiers[1];
        assert_eq!((t.kind.as_str(), t.location.as_str()), ("s3", "s3://ckpt/run1"));
        assert_eq!(t.object, Some(ObjectOptions::default()));
        assert_eq!((t.keep, t.compression.to_string()), (None, "zstd:3".to_string()));
        assert_eq!(p.tiers[0].object, None);
        let extra = "endpoint = \"http://127.0.0.1:9000/\"\nregion = \"eu-west-1\"\nallow_http = true\n\
                     part_size = \"5MiB\"\nconcurrency = 8\ntimeout = 20\nretries = 0\n";
        let p = Policy::from_toml(&with_bucket("s3", "s3://ckpt", extra), "p.toml").unwrap();
        let o = p.tiers[1].object.clone().unwrap();
        assert_eq!(p.tiers[1].location, "s3://ckpt");
        assert_eq!(o.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!((o.region.as_deref(), o.allow_http), (Some("eu-west-1"), Some(true)));
        assert_eq!((o.part_size, o.concurrency, o.timeout, o.retries), (5 << 20, 8, Some(20), Some(0)));
        let p = Policy::from_toml(&with_bucket("gcs", "gs://my_bucket//a//b", ""), "p.toml").unwrap();
        assert_eq!((p.tiers[1].kind.as_str(), p.tiers[1].location.as_str()), ("gcs", "gs://my_bucket/a/b"));
        let json = r#"{"tier":[{"name":"ram","kind":"memory","root":"/r"},
            {"name":"b","kind":"s3","url":"s3://ckpt/x","part_size":8388608,"allow_http":false}]}"#;
        let o = Policy::from_json(json, "<dict>").unwrap().tiers[1].object.clone().unwrap();
        assert_eq!((o.part_size, o.allow_http), (8 << 20, Some(false)));

        for (kind, url, extra, line, parts) in [
            ("s3", "gs://ckpt/x", "", 8, &["tier[1] (\"bucket\").url", "expected an s3:// URL for kind \"s3\""][..]),
            ("gcs", "s3://ckpt/x", "", 8, &["expected a gs:// URL", "gs://bucket/checkpoints/run1"]),
            ("s3", "/mnt/ckpt", "", 8, &["expected an s3:// URL"]),
            ("s3", "s3://", "", 8, &["expected a bucket name"]),
            ("s3", "s3://Bad_Bucket/x", "", 8, &["expected a bucket name", "\"s3://Bad_Bucket/x\""]),
            ("s3", "s3://ab/x", "", 8, &["expected a bucket name"]),
            ("s3", "s3://ckpt/a/../b", "", 8, &["invalid segment \"..\""]),
            (
                "s3",
                "s3://ckpt",
                "endpoint = \"127.0.0.1:9000\"\n",
                9,
                &[".endpoint: expected an http:// or https:// URL", "got \"127.0.0.1:9000\""],
            ),
            ("s3", "s3://ckpt", "endpoint = \"http://\"\n", 9, &[".endpoint: expected an http://"]),
            ("gcs", "gs://ckpt", "region = \"us\"\n", 9, &[".region: `region` is not valid for kind \"gcs\""]),
            ("s3", "s3://ckpt", "allow_http = \"yes\"\n", 9, &[".allow_http: expected true or false, got \"yes\""]),
            ("s3", "s3://ckpt", "part_size = \"1MiB\"\n", 9, &[".part_size: expected a size between 5MiB", "got \"1MiB\""]),
            ("s3", "s3://ckpt", "part_size = \"6GiB\"\n", 9, &[".part_size: expected a size between 5MiB"]),
            ("s3", "s3://ckpt", "part_size = \"big\"\n", 9, &[".part_size: \"big\" is not a size"]),
            ("s3", "s3://ckpt", "concurrency = 0\n", 9, &[".concurrency: expected a positive integer, got 0"]),
            ("s3", "s3://ckpt", "concurrency = 65\n", 9, &[".concurrency: expected a positive integer up to 64"]),
            ("s3", "s3://ckpt", "timeout = \"30s\"\n", 9, &[".timeout: expected a positive integer, got \"30s\""]),
            ("s3", "s3://ckpt", "retries = -1\n", 9, &[".retries: expected an integer from 0 to 100, got -1"]),
            ("s3", "s3://ckpt", "part_sise = 1\n", 9, &["unknown key `part_sise`", "did you mean `part_size`?"]),
            ("s3", "s3://ckpt", "root = \"/x\"\n", 9, &[".root: `root` is not valid for kind \"s3\"; use `url`"]),
        ] {
            let msg = toml_err(&with_bucket(kind, url, extra));
            assert_at(&msg, line, parts);
        }
        let msg = toml_err(&format!("{MINIMAL}[[tier]]\nname = \"bucket\"\nkind = \"s3\"\n"));
        assert_at(&msg, 5, &["tier[1] (\"bucket\"): missing `url` (the bucket and prefix, e.g. \"s3://bucket/checkpoints/run1\")"]);
        // The object-store keys belong to object-store tiers only.
        let msg = toml_err(&with_disk("part_size = \"8MiB\"\n"));
        assert_at(&msg, 9, &["tier[1] (\"disk\").part_size: `part_size` is not valid for kind \"fs\"", "\"s3\" and \"gcs\""]);
        let msg = toml_err(&format!("{MINIMAL}endpoint = \"http://x\"\n"));
        assert_at(&msg, 5, &["tier[0] (\"ram\").endpoint: `endpoint` is not valid for kind \"memory\""]);
    }

    #[test]
    fn suggestions() {
        assert_eq!(closest("evry", TIER_KEYS), Some("every"));
        assert_eq!(closest("Name", TIER_KEYS), Some("name"));
        assert_eq!(closest("bandwith", TIER_KEYS), Some("bandwidth"));
        assert_eq!(closest("colour", TIER_KEYS), None);
        assert_eq!(closest("id", TIER_KEYS), None);
        assert_eq!(closest("chunk", STORE_KEYS), Some("chunk_size"));
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
