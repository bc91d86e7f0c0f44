//! The gate every HTTP request of one object-store tier passes: it counts the request by kind
//! (`RequestCounters`, shown by `store.metrics()`), paces it to the tier's `Throttle`, and meets
//! a "slow down" answer (503, 429) itself: the tier's rate is lowered, and the request waits a
//! backoff and goes again, for up to `throttle_timeout`. Only then does the answer reach
//! `object_store`, as an error it does not retry, that says how often and for how long the
//! server refused. Other failures (resets, timeouts, other 5xx) pass through to `object_store`'s
//! own retries, as before.
//!
//! It sits below `object_store`'s retry layer as its HTTP client (`with_http_connector`), so
//! that every request of the tier, retries included, passes it once per send.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;
use object_store::client::{HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse, HttpService, ReqwestConnector};
use object_store::ClientOptions;
use parking_lot::Mutex;

use super::throttle::{Throttle, ThrottleConfig};
use crate::requests::{RequestCounters, RequestKind};

/// What one tier's requests share: its throttle and its counters.
#[derive(Debug)]
pub(super) struct Gate {
    tier: String,
    throttle: Mutex<Throttle>,
    pub(super) counters: Arc<RequestCounters>,
    /// The throttle's clock starts here.
    epoch: Instant,
    /// Jitter for backoffs (xorshift; seeded from the OS).
    seed: AtomicU64,
}

impl Gate {
    pub(super) fn new(tier: &str, cfg: ThrottleConfig) -> Arc<Gate> {
        let mut b = [0u8; 8];
        let _ = getrandom::fill(&mut b);
        Arc::new(Gate {
            tier: tier.to_string(),
            throttle: Mutex::new(Throttle::new(cfg)),
            counters: Arc::new(RequestCounters::default()),
            epoch: Instant::now(),
            seed: AtomicU64::new(u64::from_le_bytes(b) | 1),
        })
    }

    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    /// A number in 0..1 for the jitter.
    fn jitter(&self) -> f64 {
        let mut x = self.seed.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.seed.store(x, Ordering::Relaxed);
        (x >> 11) as f64 / (1u64 << 53) as f64
    }

    async fn wait(&self, secs: f64) {
        if secs > 0.0 {
            let d = Duration::from_secs_f64(secs);
            self.counters.waited(d);
            tokio::time::sleep(d).await;
        }
    }
}

/// What kind of request `req` is, by method and query (S3's and GCS's XML API).
pub(super) fn kind_of(method: &http::Method, query: &str) -> RequestKind {
    let has = |k: &str| query.split('&').any(|p| p == k || p.starts_with(&format!("{k}=")));
    match *method {
        http::Method::HEAD => RequestKind::Head,
        http::Method::DELETE => RequestKind::Delete,
        http::Method::PUT if has("partNumber") || has("uploadId") => RequestKind::Part,
        http::Method::PUT => RequestKind::Put,
        http::Method::POST if has("delete") => RequestKind::Delete,
        http::Method::POST => RequestKind::Multipart,
        http::Method::GET if has("list-type") || has("uploads") || has("prefix") || has("delimiter") => RequestKind::List,
        _ => RequestKind::Get,
    }
}

/// A second copy of a request, to send it again (its body is shared bytes).
fn copy(req: &HttpRequest) -> HttpRequest {
    let mut b = http::Request::builder().method(req.method().clone()).uri(req.uri().clone()).version(req.version());
    if let Some(h) = b.headers_mut() {
        *h = req.headers().clone();
    }
    b.body(req.body().clone()).expect("a copy of a valid request")
}

fn throttling(status: StatusCode) -> bool {
    status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS
}

/// `Retry-After` in seconds, where the server sends one (GCS may).
fn retry_after(resp: &HttpResponse) -> Option<f64> {
    resp.headers().get(http::header::RETRY_AFTER)?.to_str().ok()?.trim().parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0)
}

/// The error a request ends with when the server kept refusing it for `throttle_timeout`.
#[derive(Debug)]
struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

#[derive(Debug)]
struct GatedService {
    inner: HttpClient,
    gate: Arc<Gate>,
}

impl GatedService {
    async fn send(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let g = &self.gate;
        let kind = kind_of(req.method(), req.uri().query().unwrap_or(""));
        let started = Instant::now();
        let give_up_after = g.throttle.lock().config().give_up_after;
        let mut refusals = 0u32;
        loop {
            let pace = g.throttle.lock().admit(g.now());
            g.wait(pace).await;
            g.counters.sent(kind);
            log::debug!("tier '{}': {kind:?} {}", g.tier, req.uri().path());
            let resp = self.inner.execute(copy(&req)).await?;
            let status = resp.status();
            if !throttling(status) {
                let limit = {
                    let mut th = g.throttle.lock();
                    th.succeeded(g.now());
                    th.limit()
                };
                g.counters.set_limit(limit);
                return Ok(resp);
            }
            refusals += 1;
            g.counters.throttled();
            let limit = {
                let mut th = g.throttle.lock();
                th.throttled(g.now());
                th.limit()
            };
            g.counters.set_limit(limit);
            let backoff = Throttle::backoff(refusals, g.jitter()).max(retry_after(&resp).unwrap_or(0.0));
            let elapsed = started.elapsed();
            if elapsed + Duration::from_secs_f64(backoff) > give_up_after {
                let body = resp.into_body().bytes().await.map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
                let code = body.split("<Code>").nth(1).and_then(|r| r.split("</Code>").next()).unwrap_or("");
                return Err(HttpError::new(
                    HttpErrorKind::Unknown,
                    Refused(format!(
                        "the server refused this request as too many ({status}{}) {refusals} times over {:.0} s, \
                         throttle_timeout = {} s, while tier '{}' was held to {}: the bucket (or its prefix) gets more \
                         requests than it serves; lower the tier's `concurrency`, save less often to it (`every`), or \
                         raise `throttle_timeout`",
                        if code.is_empty() { String::new() } else { format!(" {code}") },
                        elapsed.as_secs_f64(),
                        give_up_after.as_secs(),
                        g.tier,
                        limit.map_or("no request limit".to_string(), |l| format!("{l:.1} requests/s")),
                    )),
                ));
            }
            log::debug!("tier '{}': {status} for a {kind:?} request; retry {refusals} in {backoff:.2} s", g.tier);
            g.wait(backoff).await;
        }
    }
}

#[async_trait::async_trait]
impl HttpService for GatedService {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        self.send(req).await
    }
}

/// The HTTP client of a tier: `object_store`'s own (reqwest), behind the tier's gate.
#[derive(Debug)]
pub(super) struct GatedConnector(pub(super) Arc<Gate>);

impl HttpConnector for GatedConnector {
    fn connect(&self, options: &ClientOptions) -> object_store::Result<HttpClient> {
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(GatedService { inner, gate: self.0.clone() }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_told_apart_by_method_and_query() {
        use http::Method as M;
        let cases = [
            (M::GET, "", RequestKind::Get),
            (M::GET, "list-type=2&prefix=a%2F&delimiter=%2F", RequestKind::List),
            (M::GET, "uploads&prefix=x", RequestKind::List),
            (M::HEAD, "", RequestKind::Head),
            (M::PUT, "", RequestKind::Put),
            (M::PUT, "partNumber=3&uploadId=abc", RequestKind::Part),
            (M::POST, "uploads", RequestKind::Multipart),
            (M::POST, "uploadId=abc", RequestKind::Multipart),
            (M::POST, "delete", RequestKind::Delete),
            (M::DELETE, "uploadId=abc", RequestKind::Delete),
            (M::DELETE, "", RequestKind::Delete),
        ];
        for (m, q, want) in cases {
            assert_eq!(kind_of(&m, q), want, "{m} ?{q}");
        }
    }
}
