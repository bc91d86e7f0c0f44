//! Deterministic crash points for tests: `TIERCEL_FAILPOINT=name[:count]` makes the process
//! abort (as kill -9 would end it: no unwinding, no destructors, no flush) the `count`-th time
//! (default 1) execution reaches `hit(name)`. Unset, `hit` costs one relaxed atomic load.
//!
//! Points: `commit` (a tier's data and manifests are written, its COMMIT record is not),
//! `commit_counted` (on the counted commit of `store::commit`: this rank's add completed the
//! count of a step's ranks, the COMMIT record is not written yet),
//! `evict` (the memory tier removed a step's COMMIT record, not yet its data), `persist`
//! (a slower tier's data object is written, its manifest is not), `replicate` (before each
//! data frame of a replica push), `upload` (an object store's multipart upload is started,
//! its marker under `.uploads/` not yet written), `relay_send` (before a rank passes a chunk
//! on to another replica), `relay_recv` (after a rank received one). `relay_corrupt` does not
//! abort: the count-th chunk passed on has one bit flipped after its checksum was taken (`fires`).
//! `persist_late:N` does not abort either: the N-th save of the process (in save order) hands
//! its persists to the scheduler only after the next save has handed over its own, as when two
//! background flushes finish in the other order (`armed_at`); with no later save, once a
//! flush finds nothing else to run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

static ARMED: OnceLock<Option<(String, u64)>> = OnceLock::new();
static HITS: AtomicU64 = AtomicU64::new(0);

fn parse(v: &str) -> Option<(String, u64)> {
    let (name, count) = match v.split_once(':') {
        Some((n, c)) => (n, c.parse().ok()?),
        None => (v, 1),
    };
    (!name.is_empty() && count > 0).then(|| (name.to_string(), count))
}

/// Aborts the process here when `name` is the armed failpoint and this is its count-th hit.
pub fn hit(name: &str) {
    if fires(name) {
        eprintln!("tiercel: failpoint '{name}' reached: aborting");
        std::process::abort();
    }
}

/// Whether `name` is the armed failpoint and this is its count-th hit (for points that do
/// something other than abort).
pub fn fires(name: &str) -> bool {
    let armed = ARMED.get_or_init(|| std::env::var("TIERCEL_FAILPOINT").ok().and_then(|v| parse(&v)));
    matches!(armed, Some((want, count)) if want == name && HITS.fetch_add(1, Ordering::SeqCst) + 1 == *count)
}

/// Whether `name` is the armed failpoint and `n` its count (for points that name one event
/// by its number, such as the n-th save, whatever order the threads reach them in).
pub fn armed_at(name: &str, n: u64) -> bool {
    let armed = ARMED.get_or_init(|| std::env::var("TIERCEL_FAILPOINT").ok().and_then(|v| parse(&v)));
    matches!(armed, Some((want, count)) if want == name && *count == n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_name_and_count() {
        assert_eq!(parse("commit"), Some(("commit".into(), 1)));
        assert_eq!(parse("persist:3"), Some(("persist".into(), 3)));
        assert_eq!(parse("persist:x"), None);
        assert_eq!(parse(":2"), None);
        assert_eq!(parse("evict:0"), None);
    }
}
