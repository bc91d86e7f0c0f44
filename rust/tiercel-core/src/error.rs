//! The one error type of tiercel-core. The Python bindings map each kind once to a class of
//! the `tiercel.TiercelError` hierarchy, so every message must already name what a user needs
//! to act on: tier, step, rank, item, file and line.

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

#[derive(Debug, Clone)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into() }
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
        Error::new(kind, format!("tier '{tier}': {}: {e}{hint}", what.display()))
    }
    /// Prefix the message with more context ("step 4, rank 1: ...").
    pub fn context(mut self, ctx: impl fmt::Display) -> Self {
        self.message = format!("{ctx}: {}", self.message);
        self
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}
