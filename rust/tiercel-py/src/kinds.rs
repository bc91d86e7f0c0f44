//! The kinds of tier built in Python (`tier::external`): registered with the core when
//! `tiercel._core` is imported; the factory, the entry points and fsspec are
//! `tiercel.tiers`'s business, the calls into the returned object `pytier`'s. Also the
//! core's conformance suites, run against such an object for `tiercel.testing.check_tier`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use pyo3::prelude::*;

use tiercel_core::blobs::Blobs;
use tiercel_core::error::{Error, Result};
use tiercel_core::policy::PythonSpec;
use tiercel_core::testing::subjects::{self, BlobsSubject, TierSubject};
use tiercel_core::testing::{blobs, tiers, Case, Rules};
use tiercel_core::tier::blob::BlobTier;
use tiercel_core::tier::external::ExternalKinds;

use crate::errors::TcResult;
use crate::pytier::PyBlobs;

/// The Python module that builds tiers from policies.
const TIERS_MODULE: &str = "tiercel.tiers";

pub struct PythonKinds;

/// A Python exception while opening a tier: a `tiercel.errors.ConfigError` says it all (the
/// module phrases it with the policy's file and line); anything else is prefixed with where.
fn open_error(py: Python<'_>, at: &str, e: PyErr) -> Error {
    let is_config = crate::errors::module(py).and_then(|m| m.getattr("ConfigError")).is_ok_and(|c| e.is_instance(py, &c));
    let text = e.value(py).str().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    if is_config {
        Error::config(text)
    } else {
        let kind = e.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
        Error::config(format!("{at}: the tier could not be built: {kind}: {text}"))
    }
}

/// The kinds installed packages register (entry point group `tiercel.tiers`), for the policy.
pub fn plugin_kinds() -> Vec<String> {
    Python::with_gil(|py| {
        py.import(TIERS_MODULE).and_then(|m| m.call_method0("plugin_kinds")).and_then(|k| k.extract::<Vec<String>>()).unwrap_or_else(|e| {
            log::warn!("cannot list the tier kinds installed packages register: {e}");
            vec![]
        })
    })
}

impl ExternalKinds for PythonKinds {
    fn open(&self, name: &str, spec: &PythonSpec) -> Result<Arc<dyn Blobs>> {
        Python::with_gil(|py| {
            let opened = py.import(TIERS_MODULE).and_then(|m| {
                let args = (&spec.at, name, &spec.kind, spec.factory.as_deref(), spec.url.as_deref(), &spec.options);
                m.call_method1("open_tier", args)?.extract::<(Py<PyAny>, String)>()
            });
            let (obj, location) = opened.map_err(|e| open_error(py, &spec.at, e).with_tier(name))?;
            Ok(Arc::new(PyBlobs::new(py, name, &location, obj, "", spec.concurrency)) as Arc<dyn Blobs>)
        })
    }
}

/// The names of the core's conformance cases: ("blobs" | "tier", name).
#[pyfunction]
pub fn conformance_cases() -> Vec<(&'static str, &'static str)> {
    let b = blobs::cases().into_iter().map(|c| ("blobs", c.name));
    let t = tiers::cases().into_iter().filter(|c| (c.skip)(&Rules::default()).is_none()).map(|c| ("tier", c.name));
    b.chain(t).collect()
}

thread_local! {
    /// Set while this thread runs a conformance case: its panic (the case's failed assertion)
    /// is kept here, where it was raised, instead of printed.
    static CASE_PANIC: std::cell::RefCell<Option<Option<String>>> = const { std::cell::RefCell::new(None) };
}

/// Keeps the panics of conformance cases (see `CASE_PANIC`); every other panic goes to the
/// hook that was there before.
fn quiet_case_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let kept = CASE_PANIC.with(|c| match &mut *c.borrow_mut() {
                Some(slot) => {
                    let at = info.location().map(|l| format!(" (at {}:{})", l.file(), l.line())).unwrap_or_default();
                    let msg = info
                        .payload()
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_else(|| "the case panicked".into());
                    *slot = Some(format!("{msg}{at}"));
                    true
                }
                None => false,
            });
            if !kept {
                before(info)
            }
        }));
    });
}

fn run_case<S>(cases: Vec<Case<S>>, name: &str, subject: S) -> Option<String> {
    let case = cases.into_iter().find(|c| c.name == name)?;
    quiet_case_panics();
    CASE_PANIC.with(|c| *c.borrow_mut() = Some(None));
    let outcome = catch_unwind(AssertUnwindSafe(|| (case.run)(&subject)));
    let message = CASE_PANIC.with(|c| c.borrow_mut().take().flatten());
    drop(subject);
    outcome.err().map(|_| message.unwrap_or_else(|| "the case panicked".into()))
}

/// Runs one case of the core's suites against `obj` (a tier's object, every key under
/// `base`): None when it passes, else what failed. The GIL is released while the case runs
/// (its calls into `obj` take it, one at a time).
#[pyfunction]
#[pyo3(signature = (suite, name, obj, tier, location, base, concurrency=4))]
#[allow(clippy::too_many_arguments)]
pub fn run_conformance_case(
    py: Python<'_>,
    suite: &str,
    name: &str,
    obj: Py<PyAny>,
    tier: &str,
    location: &str,
    base: &str,
    concurrency: usize,
) -> TcResult<Option<String>> {
    let blobs: Arc<dyn Blobs> = Arc::new(PyBlobs::new(py, tier, location, obj, base, concurrency));
    let known = conformance_cases().iter().any(|(s, n)| *s == suite && *n == name);
    if !known {
        return Err(crate::errors::invalid(format!("no conformance case {suite}/{name}")).into());
    }
    Ok(py.allow_threads(|| match suite {
        "blobs" => run_case(blobs::cases(), name, BlobsSubject { blobs, guard: Box::new(()) }),
        _ => {
            let tier = Arc::new(BlobTier::new(tier, blobs.clone(), subjects::zstd3()));
            run_case(tiers::cases(), name, TierSubject { tier, storage: blobs, rules: Rules::default(), rank1: None, guard: Box::new(()) })
        }
    }))
}
