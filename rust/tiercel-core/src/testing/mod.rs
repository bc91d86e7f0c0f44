//! The conformance suites (feature `testing`): what every tier kind and every `Blobs` backend
//! must do, written once against the traits and run against each implementation, as arrow's
//! object_store does with its integration suite. A new kind, in this crate or outside it,
//! passes the same tests by handing its constructor to `tiers::cases` / `blobs::cases`.
//!
//! `subjects` builds the implementations under test (a memory tier, an fs tier per codec, an
//! object-store tier on a test server, a two-host peer tier on loopback); `tiers` and `blobs`
//! are the suites. The crate's own runner is `tests/conformance.rs`. `sim` is the scale
//! simulator (tiercel's commit and retention code for N ranks on a simulated object store).

pub mod blobs;
pub mod sim;
pub mod subjects;
pub mod tiers;

use std::any::Any;

/// Keeps an implementation's storage alive for one test and removes it afterwards (a temp
/// dir, a bucket prefix, peer servers).
pub type Guard = Box<dyn Any>;

/// One test of a suite, for the implementation type `S` it exercises.
pub struct Case<S> {
    pub name: &'static str,
    pub run: fn(&S),
    /// Why the test does not apply to an implementation with these rules (None: it does).
    pub skip: fn(&Rules) -> Option<&'static str>,
}

/// What an implementation promises beyond the common contract, so that a suite leaves out,
/// with a reason, the tests that assume otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// A step becomes visible per rank, once that rank's part is complete (the peer tier),
    /// rather than once every rank's is and a commit record is written.
    pub per_rank_commit: bool,
    /// `delete_step` removes a step (a peer tier's copies go by their holders' retention).
    pub deletes: bool,
}

impl Default for Rules {
    fn default() -> Self {
        Rules { per_rank_commit: false, deletes: true }
    }
}

/// Applies to every implementation.
pub fn always(_: &Rules) -> Option<&'static str> {
    None
}

/// Deterministic bytes: xorshift noise (incompressible).
pub fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Smooth float32 values (compressible, and more so after bytegroup).
pub fn floats(count: usize, seed: u64) -> Vec<u8> {
    (0..count).flat_map(|i| ((i as f32 + seed as f32) * 0.001).sin().to_le_bytes()).collect()
}
