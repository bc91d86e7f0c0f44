//! PyO3 bindings of tiercel-core as `tiercel._core`: conversions, GIL release and the one
//! mapping of core errors to Python exceptions (`errors`). No logic of its own lives here.
//! `store` binds the Store, `kinds` and `pytier` the tiers written in Python, `traffic` its training-communication signals, `step` a step being written or read, `buffer` the memory handed
//! to Python, `metrics` the core's metrics.

mod buffer;
mod counter;
mod errors;
mod kinds;
mod metrics;
mod pytier;
mod step;
mod store;
mod traffic;

use std::time::Duration;

use pyo3::prelude::*;

use buffer::Buffer;
use errors::{invalid, TcResult};
use step::{SaveHandle, StepReader, StepWriter};
use store::Store;
use traffic::Traffic;

fn json<T: serde::Serialize + ?Sized>(v: &T) -> String {
    serde_json::to_string(v).expect("serializes")
}

fn parse_json(s: &str, what: &str) -> TcResult<serde_json::Value> {
    Ok(serde_json::from_str(s).map_err(|e| invalid(format!("{what} is not valid JSON: {e}")))?)
}

fn seconds(s: f64) -> TcResult<Duration> {
    Ok(Duration::try_from_secs_f64(s).map_err(|_| invalid(format!("tmp_age must be a non-negative number of seconds, got {s}")))?)
}

/// Prints the core's log records at or above the level in $TIERCEL_LOG (default: warn) to
/// stderr, so background failures are seen even when nobody waits on a handle.
struct StderrLog;

impl log::Log for StderrLog {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::max_level()
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            eprintln!("tiercel {}: {}", r.level().as_str().to_lowercase(), r.args());
        }
    }
    fn flush(&self) {}
}

static LOGGER: StderrLog = StderrLog;

/// The name of `step`'s directory (key prefix) on a tier: `step-` and 12 digits.
#[pyfunction]
fn step_dir_name(step: u64) -> String {
    tiercel_core::format::step_dir(step)
}

/// GEMINI placement of `hosts` hosts with `replicas` copies each ("group", "ring" or "mixed"):
/// (groups, then the ring part if any; holders per host, the host itself first; the exact
/// probability that no host loses every copy when `failures` hosts fail at once; GEMINI's
/// closed form for group placement, when `replicas` divides `hosts`).
#[pyfunction]
#[pyo3(signature = (hosts, replicas, strategy, failures=None))]
#[allow(clippy::type_complexity)]
fn placement(
    hosts: usize,
    replicas: usize,
    strategy: &str,
    failures: Option<usize>,
) -> TcResult<(Vec<Vec<usize>>, Vec<Vec<usize>>, Option<f64>, Option<f64>)> {
    use tiercel_core::placement as pl;
    let p = pl::Placement::new(hosts, replicas, pl::Strategy::parse(strategy)?)?;
    let holders = (0..hosts).map(|h| p.holders(h)).collect();
    let exact = failures.map(|k| p.survival_probability(k)).transpose()?;
    let closed = failures.filter(|_| hosts.is_multiple_of(replicas)).map(|k| pl::gemini_closed_form(hosts, replicas, k));
    Ok((p.groups(), holders, exact, closed))
}

/// The CRC32C and XXH3-128 (32 hex digits) of `data`, computed as a save computes them for
/// each chunk (`checksum::crc32c_and_hash`), without the GIL: bench/bytes.py times the
/// hashing that dedup adds to a save through this, on one core.
#[pyfunction]
fn crc32c_and_hash(py: Python<'_>, data: pyo3::buffer::PyBuffer<u8>) -> TcResult<(u32, String)> {
    if !data.is_c_contiguous() {
        return Err(invalid("crc32c_and_hash needs a contiguous buffer").into());
    }
    // SAFETY: `data` holds the buffer (and its exporter's memory) until this returns.
    let bytes = unsafe { std::slice::from_raw_parts(data.buf_ptr() as *const u8, data.len_bytes()) };
    Ok(py.allow_threads(|| tiercel_core::checksum::crc32c_and_hash(bytes)))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let level = match std::env::var("TIERCEL_LOG").unwrap_or_default().to_lowercase().as_str() {
        "off" => log::LevelFilter::Off,
        "error" => log::LevelFilter::Error,
        "info" => log::LevelFilter::Info,
        "debug" => log::LevelFilter::Debug,
        _ => log::LevelFilter::Warn,
    };
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(level);
    }
    // The exception classes are Python's (tiercel.errors); these are the same objects.
    let classes = errors::module(m.py())?;
    m.add("TiercelError", classes.getattr("TiercelError")?)?;
    for (_, name) in errors::CLASSES {
        m.add(name, classes.getattr(name)?)?;
    }
    m.add_class::<Store>()?;
    m.add_class::<StepWriter>()?;
    m.add_class::<SaveHandle>()?;
    m.add_class::<StepReader>()?;
    m.add_class::<Buffer>()?;
    m.add_class::<Traffic>()?;
    m.add("FORMAT_VERSION", tiercel_core::format::FORMAT_VERSION)?;
    metrics::add(m)?;
    m.add_function(wrap_pyfunction!(placement, m)?)?;
    m.add_function(wrap_pyfunction!(step_dir_name, m)?)?;
    m.add_function(wrap_pyfunction!(crc32c_and_hash, m)?)?;
    m.add_function(wrap_pyfunction!(kinds::conformance_cases, m)?)?;
    m.add_function(wrap_pyfunction!(kinds::run_conformance_case, m)?)?;
    m.add_function(wrap_pyfunction!(pytier::exiting, m)?)?;
    // Tiers of kind "python", "fsspec" or a plugin's are built through tiercel.tiers.
    tiercel_core::tier::external::register(Box::new(kinds::PythonKinds));
    tiercel_core::policy::register_plugin_kinds(kinds::plugin_kinds);
    Ok(())
}
