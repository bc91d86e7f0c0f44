//! Object stores (S3 and S3-compatible servers, Google Cloud Storage) as `Blobs`, on the
//! `object_store` crate, driven from one small shared tokio runtime. `settings` reads
//! credentials and options, `inner` holds what every request needs and makes the requests,
//! `bucket` is the `Blobs` implementation, `writer` the streaming multipart writer, `gate` and
//! `throttle` what every request passes (counts, pace, slow-down answers), `uploads`
//! the markers of running uploads and the removal of abandoned ones, `server_uploads` S3's own
//! list of the uploads under a prefix (what a writer killed before its marker leaves).
//!
//! - `put` is one PUT; `put_if_absent` a PUT with `If-None-Match: *` (S3) or
//!   `x-goog-if-generation-match: 0` (GCS); a store that says it cannot do that gets a HEAD
//!   then a PUT instead (logged once).
//! - `create` streams: bytes gather into a part-sized buffer; an object no larger than one
//!   part goes up in a single PUT, a larger one as a multipart upload with up to
//!   `concurrency` parts in flight, so a writer holds at most `(concurrency + 1) * part_size`
//!   bytes. On an error or `abort` the upload is aborted. Each multipart upload is recorded by a
//!   small marker object under `.uploads/` while it runs; a writer killed before it could abort
//!   leaves its marker, and gc (the retention run after a persist, `tiercel gc`) aborts such
//!   uploads.
//! - `get_range` is one ranged GET whose body is copied straight into the destination.
//! - Requests are retried with exponential backoff on 5xx answers, connection resets and
//!   timeouts (`object_store`'s retry layer; bodies of GETs resume where they broke off).
//! - Every HTTP request passes the tier's `gate` (the client `object_store` sends through): it
//!   is counted by kind for `store.metrics()`, paced to the tier's `throttle`, and a "slow
//!   down" answer (503, 429) lowers the tier's rate and is retried there, after a backoff,
//!   for up to `throttle_timeout`; the rate ramps up again while answers succeed.
//! - Parts grow with the upload (`writer::part_len`) so that an object fits in 10,000 parts.
//!
//! Where the settings come from, last wins: the SDKs' config files (`~/.aws/config` and
//! `~/.aws/credentials` for `$AWS_PROFILE`; Google's application-default credentials file),
//! then the environment (`AWS_*`, `GOOGLE_*`, `STORAGE_EMULATOR_HOST`), then the policy
//! (`endpoint`, `region`, `allow_http`, `timeout`). No message ever carries a credential.

mod bucket;
mod gate;
mod inner;
mod server_uploads;
mod settings;
mod throttle;
mod uploads;
mod writer;

use std::future::Future;
use std::sync::OnceLock;

use tokio::runtime::Runtime;

pub use bucket::ObjectBlobs;
pub use settings::Env;
pub use uploads::{host_id, STALE_UPLOAD_AGE, UPLOADS_DIR};

/// One multi-thread runtime for every object-store tier of the process: its two workers
/// drive the sockets and run uploaded parts; callers block on their own requests.
fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tiercel-object")
            .enable_all()
            .build()
            .expect("cannot start the object-store runtime")
    })
}

/// Runs `f` to completion from a synchronous caller (a scheduler or rayon thread).
fn block_on<F: Future>(f: F) -> F::Output {
    runtime().block_on(f)
}
