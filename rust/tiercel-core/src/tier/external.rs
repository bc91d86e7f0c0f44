//! Tiers of kinds the core does not build itself: a tier written in Python (`kind =
//! "python"`), an fsspec filesystem (`kind = "fsspec"`), a kind an installed package
//! registers. The Python bindings register the one `ExternalKinds` at import; `open` hands it
//! a tier's settings and gets a `Blobs` back, which `tier::open` makes a tier like any other
//! (`BlobTier`): checksums, compression, commits, retention and gc are the core's.

use std::sync::{Arc, OnceLock};

use crate::blobs::Blobs;
use crate::error::{Error, Result};
use crate::policy::PythonSpec;

/// Builds the tiers of kinds outside the core. (Which kind names are such tiers is the
/// policy's question: `policy::register_plugin_kinds`.)
pub trait ExternalKinds: Send + Sync {
    /// Opens tier `name`; errors name where it stands in the policy (`spec.at`).
    fn open(&self, name: &str, spec: &PythonSpec) -> Result<Arc<dyn Blobs>>;
}

static REGISTERED: OnceLock<Box<dyn ExternalKinds>> = OnceLock::new();

/// Registers the builder of external kinds; false if one was registered already.
pub fn register(kinds: Box<dyn ExternalKinds>) -> bool {
    REGISTERED.set(kinds).is_ok()
}

/// Opens a tier of an external kind through the registered builder.
pub fn open(name: &str, spec: &PythonSpec) -> Result<Arc<dyn Blobs>> {
    match REGISTERED.get() {
        Some(k) => k.open(name, spec),
        None => Err(Error::config(format!(
            "{}.kind: a tier of kind {:?} is built by tiercel's Python package: open the store from Python (tiercel.Store)",
            spec.at, spec.kind
        ))
        .with_tier(name)),
    }
}
