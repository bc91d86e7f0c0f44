//! The one error type of tiercel-core. The Python bindings map each kind once to a class of
//! the `tiercel.TiercelError` hierarchy, and each context field to an attribute of the
//! exception. The message is whole on its own (context included): it names what a user
//! needs to act on (tier, step, rank, item, file and line); the fields carry the same facts
//! for programs, so that nothing has to parse the message back.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// A policy file or value is wrong (file, line and key are in the message).
    Config,
    /// Stored bytes do not match their checksum, or a manifest/chunk cannot be decoded.
    Integrity,
    /// The step (or item, or rank) exists on no tier that was asked.
    NotFound,
    /// A tier cannot be read or written right now (I/O error, permission, server down).
    TierUnavailable,
    /// A step does not fit into a tier's capacity even after evicting what may be evicted.
    Capacity,
    /// The caller passed something tiercel cannot store or a call out of order.
    InvalidArgument,
}

impl ErrorKind {
    /// Every kind, in the order of their codes.
    pub const ALL: [ErrorKind; 6] = [
        ErrorKind::Config,
        ErrorKind::Integrity,
        ErrorKind::NotFound,
        ErrorKind::TierUnavailable,
        ErrorKind::Capacity,
        ErrorKind::InvalidArgument,
    ];

    /// The kind's number on the wire (the peer protocol's ERROR frames): 1 to 6.
    pub fn code(self) -> u8 {
        match self {
            ErrorKind::Config => 1,
            ErrorKind::Integrity => 2,
            ErrorKind::NotFound => 3,
            ErrorKind::TierUnavailable => 4,
            ErrorKind::Capacity => 5,
            ErrorKind::InvalidArgument => 6,
        }
    }

    pub fn from_code(code: u8) -> Option<ErrorKind> {
        Self::ALL.into_iter().find(|k| k.code() == code)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    /// The whole message, context included: what `Display` prints and a user reads.
    pub message: String,
    /// The tier the error is about, where known.
    pub tier: Option<String>,
    pub step: Option<u64>,
    pub rank: Option<u32>,
    /// The item's name.
    pub item: Option<String>,
    /// The chunk's index in its item.
    pub chunk: Option<u64>,
    /// The file, object key or URL (a policy file for configuration errors).
    pub path: Option<String>,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into(), tier: None, step: None, rank: None, item: None, chunk: None, path: None }
    }
    pub fn config(m: impl Into<String>) -> Self {
        Self::new(ErrorKind::Config, m)
    }
    pub fn integrity(m: impl Into<String>) -> Self {
        Self::new(ErrorKind::Integrity, m)
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, m)
    }
    pub fn unavailable(m: impl Into<String>) -> Self {
        Self::new(ErrorKind::TierUnavailable, m)
    }
    pub fn capacity(m: impl Into<String>) -> Self {
        Self::new(ErrorKind::Capacity, m)
    }
    pub fn invalid(m: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, m)
    }
    /// An I/O error on `what` (a path or key) of tier `tier`.
    pub fn io(tier: &str, what: &std::path::Path, e: std::io::Error) -> Self {
        let hint = match e.raw_os_error() {
            Some(libc::ENOSPC) => " (no space left: free space or lower `keep`/`capacity`)",
            Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => " (permission denied or read-only: check the tier's root/url)",
            _ => "",
        };
        let kind = if e.kind() == std::io::ErrorKind::NotFound { ErrorKind::NotFound } else { ErrorKind::TierUnavailable };
        Error::new(kind, format!("tier '{tier}': {}: {e}{hint}", what.display())).with_tier(tier).with_path(what.display().to_string())
    }
    /// The same error under another kind (e.g. a missing data object of a committed step is
    /// lost data: an integrity error).
    pub fn with_kind(mut self, kind: ErrorKind) -> Self {
        self.kind = kind;
        self
    }
    /// Prefix the message with more context ("step 4, rank 1: ..."). Fields are set apart.
    pub fn context(mut self, ctx: impl fmt::Display) -> Self {
        self.message = format!("{ctx}: {}", self.message);
        self
    }

    // The builders set a field only while it is unknown: the innermost context, where the
    // error arose, is the most precise.

    pub fn with_tier(mut self, tier: impl Into<String>) -> Self {
        self.tier.get_or_insert_with(|| tier.into());
        self
    }
    pub fn with_step(mut self, step: u64) -> Self {
        self.step.get_or_insert(step);
        self
    }
    pub fn with_rank(mut self, rank: u32) -> Self {
        self.rank.get_or_insert(rank);
        self
    }
    pub fn with_item(mut self, item: impl Into<String>) -> Self {
        self.item.get_or_insert_with(|| item.into());
        self
    }
    pub fn with_chunk(mut self, chunk: u64) -> Self {
        self.chunk.get_or_insert(chunk);
        self
    }
    pub fn with_path(mut self, path: impl Into<String>) -> Self {
        self.path.get_or_insert_with(|| path.into());
        self
    }
    /// Every field at once (each set only while unknown).
    pub fn with_fields(
        mut self,
        tier: Option<String>,
        step: Option<u64>,
        rank: Option<u32>,
        item: Option<String>,
        chunk: Option<u64>,
        path: Option<String>,
    ) -> Self {
        self.tier = self.tier.or(tier);
        self.step = self.step.or(step);
        self.rank = self.rank.or(rank);
        self.item = self.item.or(item);
        self.chunk = self.chunk.or(chunk);
        self.path = self.path.or(path);
        self
    }
    /// Step and rank at once, as most of the save and restore paths know them.
    pub fn at(self, step: u64, rank: u32) -> Self {
        self.with_step(step).with_rank(rank)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_fields_keep_the_innermost() {
        for k in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_code(k.code()), Some(k));
        }
        assert_eq!(ErrorKind::from_code(0), None);
        let e = Error::io("disk", std::path::Path::new("/x/y"), std::io::Error::from_raw_os_error(libc::ENOSPC))
            .with_tier("other")
            .at(4, 1)
            .with_step(9)
            .context("persisting step 4");
        assert_eq!(e.kind, ErrorKind::TierUnavailable);
        assert_eq!((e.tier.as_deref(), e.path.as_deref(), e.step, e.rank), (Some("disk"), Some("/x/y"), Some(4), Some(1)));
        assert!(e.to_string().starts_with("persisting step 4: tier 'disk': /x/y: ") && e.message.contains("no space left"), "{e}");
    }
}
