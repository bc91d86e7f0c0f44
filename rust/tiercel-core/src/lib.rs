//! tiercel-core: the byte-moving core of tiercel, a tiered checkpoint store for distributed
//! training. Pure Rust; the Python bindings live in tiercel-py and hold no logic of their own.
//!
//! The modules form layers, listed below from the ground up: a module imports only from the
//! layers below its own or from its own layer, never round a circle. docs/architecture.md
//! draws the map; tests/layers.rs fails on an import that breaks it.

// The ground: what everything uses.
pub mod checksum;
pub mod error;
pub mod failpoint;

// Shared vocabulary: the format, codecs, the gc rule, leases, shared memory, placement,
// named byte objects.
pub mod blobs;
pub mod codec;
pub mod format;
pub mod gc;
pub mod lease;
pub mod placement;
pub mod requests;
pub mod shm;

// Configuration: the policy.
pub mod policy;

// The runtime: the scheduler of background bytes, the peer transport.
pub mod scheduler;
pub mod transport;

// Storage: the tiers, and the object stores they open.
pub mod object;
pub mod tier;

// The Store, and the conformance suites every tier and `Blobs` backend passes.
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use error::{Error, ErrorKind, Fields, Result};

#[cfg(test)]
mod fuzz_tests;
