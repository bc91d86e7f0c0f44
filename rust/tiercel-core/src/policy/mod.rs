//! The policy: which tiers a store writes to, fastest first, and how (`every`, `keep`,
//! compression, bandwidth, capacity); the restore order; and store-wide settings.
//!
//! A policy comes from a TOML file or from a JSON object (a Python dict). Both are first read
//! into one tree of nodes that remember where each value stood in the source (`source`), and
//! then checked by one validator (`check`), so both forms accept the same schema and give the
//! same errors. Every error names the source, the 1-based line (TOML only), the key path and
//! what is expected, e.g. `tiercel.toml:12: tier[1] ("disk").keep: expected a positive
//! integer, got -1`. `tier` holds one tier's settings (a `TierSpec` per kind), `traffic` the
//! `[traffic]` section, `preemption` the `[preemption]` section, `units` sizes, bandwidths and
//! durations.

mod check;
mod preemption;
mod source;
mod tier;
mod traffic;
mod units;

use std::path::Path;

pub use preemption::{signal_name, PreemptionConfig, DEFAULT_GRACE, SIGNALS};
pub use tier::{
    check_secret, plugin_kinds, register_plugin_kinds, Capabilities, ObjectOptions, ObjectSpec, PeerConfig, PythonSpec, Role, TierConfig,
    TierKind, TierSpec, DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE, DEFAULT_PEER_LISTEN, DEFAULT_PYTHON_CONCURRENCY, DEFAULT_REPLICAS,
    MIN_SECRET_LEN,
};
pub use traffic::{TrafficConfig, TrafficMode, DEFAULT_MU, DEFAULT_WARMUP};
pub use units::{format_size, parse_bandwidth, parse_size};

use crate::error::{Error, Result};
use check::Checker;
use source::{line_of, Node};

/// Default chunk size: the unit of I/O, checksum and compression.
pub const DEFAULT_CHUNK_SIZE: u64 = 4 << 20;
const MIN_CHUNK_SIZE: u64 = 64 << 10;
const MAX_CHUNK_SIZE: u64 = 1 << 30;
/// Chunks are page-aligned so that they can be mapped and copied without splitting pages.
const CHUNK_ALIGN: u64 = 4096;
const DEFAULT_MEMORY_KEEP: usize = 2;
const DEFAULT_IO_THREADS: usize = 2;
/// More copy threads than this rarely helps a memory-bound copy and starves the trainer.
const MAX_DEFAULT_THREADS: usize = 8;

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
    /// `[store] run`: this job's run id (else taken from the environment, see `store::job`).
    pub run: Option<String>,
    /// `[store] other_jobs = "refuse"`: a store refuses to open on tiers holding another
    /// job's committed steps (default: it ignores them, and says so once).
    pub refuse_other_jobs: bool,
    /// `[restore] resume_from`: the run id of another job whose steps this job may restore
    /// (and then saves on from).
    pub resume_from: Option<String>,
    /// What happens to values that can only be stored by pickling them (`[store] pickle`).
    pub pickle: PickleMode,
    /// `[traffic]`: how checkpoint traffic makes way for the training job's own.
    pub traffic: TrafficConfig,
    /// `[restore] replicated`, `relay_window`, `relay_timeout`: how replicas of a replica
    /// group read replicated items from a slow tier.
    pub replicated: ReplicatedRestore,
    /// `[preemption]`: the signal handler `Store.open` installs and the flush it runs; None
    /// without the section (no handler: a library does not take a process's signals unasked).
    pub preemption: Option<PreemptionConfig>,
}

/// `[restore] replicated`: how the ranks of a replica group restore their replicated items
/// from a persistent tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplicatedMode {
    /// Every rank reads every byte itself. The default: a restore stays a call of one rank;
    /// the other modes make `restore()` collective over the ranks (as `latest_step()` is).
    #[default]
    All,
    /// One rank reads; the others receive over the network, rank to rank in a chain.
    Single,
    /// Each of R ranks reads 1/R of the chunks; they exchange the rest.
    Striped,
    /// `striped` when the group has several ranks and the step comes from a persistent tier,
    /// unless measured transfers between the ranks were slower than reads from the tier.
    Auto,
}

impl ReplicatedMode {
    pub const NAMES: [&'static str; 4] = ["single", "striped", "all", "auto"];

    pub fn parse(s: &str) -> Option<ReplicatedMode> {
        Some(match s {
            "single" => ReplicatedMode::Single,
            "striped" => ReplicatedMode::Striped,
            "all" => ReplicatedMode::All,
            "auto" => ReplicatedMode::Auto,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            ReplicatedMode::Single => "single",
            ReplicatedMode::Striped => "striped",
            ReplicatedMode::All => "all",
            ReplicatedMode::Auto => "auto",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplicatedRestore {
    pub mode: ReplicatedMode,
    /// Bytes a rank keeps for the others beyond what it restores itself: chunks are passed on
    /// in windows of this size, at most two windows held at once.
    pub window: u64,
    /// The deadline of every wait on another rank (a chunk from it, a window taken by it).
    pub timeout: std::time::Duration,
}

impl Default for ReplicatedRestore {
    fn default() -> Self {
        ReplicatedRestore { mode: ReplicatedMode::All, window: 64 << 20, timeout: std::time::Duration::from_secs(30) }
    }
}

/// `[store] pickle`: values no leaf handler claims are pickled; unpickling runs code chosen by
/// whoever wrote the checkpoint. The store writes and reads pickles as this says (the rule
/// itself is applied in Python, where pickles are made and loaded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PickleMode {
    /// Refuse to unpickle on restore, and so refuse at save a value only pickle stores (a
    /// step that could not be restored); only an adapter whose reader trusts its own pickles
    /// (DeepSpeed's objects) pickles, with a warning naming the value.
    #[default]
    Warn,
    /// Refuse to pickle (the save fails naming the value) and to unpickle.
    Error,
    /// Pickle and unpickle silently: for checkpoints the job trusts.
    Allow,
}

impl PickleMode {
    pub const NAMES: [&'static str; 3] = ["warn", "error", "allow"];

    pub fn as_str(self) -> &'static str {
        match self {
            PickleMode::Warn => "warn",
            PickleMode::Error => "error",
            PickleMode::Allow => "allow",
        }
    }

    pub fn parse(s: &str) -> Option<PickleMode> {
        match s {
            "warn" => Some(PickleMode::Warn),
            "error" => Some(PickleMode::Error),
            "allow" => Some(PickleMode::Allow),
            _ => None,
        }
    }
}

impl Policy {
    /// Reads and validates a TOML policy file.
    pub fn load(path: &Path) -> Result<Policy> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::config(format!("cannot read policy file {}: {e}", path.display())).with_path(path.display().to_string()))?;
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
            Error::config(format!("{source}:{line} invalid TOML: {message}{quoted}")).with_path(source)
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

    /// The tier that plays `role`, with its place in policy order, if one does.
    pub fn tier_in(&self, role: Role) -> Option<(usize, &TierConfig)> {
        self.tiers.iter().enumerate().find(|(_, t)| t.capabilities().plays(role))
    }

    /// The one memory tier (`Role::Memory`), which validation guarantees (first, once).
    pub fn memory_tier(&self) -> &TierConfig {
        self.tier_in(Role::Memory).map(|(_, t)| t).expect("a validated policy has one memory tier")
    }
}

#[cfg(test)]
pub(crate) mod tests;
