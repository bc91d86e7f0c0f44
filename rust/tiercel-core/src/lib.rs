//! tiercel-core: the byte-moving core of tiercel, a tiered checkpoint store for distributed
//! training. Pure Rust; the Python bindings live in tiercel-py and hold no logic of their own.

pub mod blobs;
pub mod checksum;
pub mod codec;
pub mod error;
pub mod failpoint;
pub mod format;
pub mod object;
pub mod placement;
pub mod policy;
pub mod replica;
pub mod scheduler;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tier;
pub mod transport;

pub use error::{Error, ErrorKind, Fields, Result};

#[cfg(test)]
mod fuzz_tests;
