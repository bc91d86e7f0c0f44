//! The keys of an object-store tier (s3, gcs): its URL, endpoint and region, part size,
//! concurrency, timeouts, retries, ramp_period and throttle_timeout.

use super::super::source::Value;
use super::super::tier::{ObjectOptions, TierKind, MAX_CONCURRENCY, MAX_PART_SIZE, MAX_THROTTLE_TIMEOUT, MIN_PART_SIZE};
use super::super::units::parse_size;
use super::{Checker, TierTable};
use crate::error::Result;

impl Checker<'_> {
    /// The object-store keys of an s3 or gcs tier.
    pub(super) fn object_options(&self, kind: TierKind, t: &TierTable) -> Result<ObjectOptions> {
        let optional = |key: &str| t.optional(key);
        let mut o = ObjectOptions::default();
        if let Some((n, p)) = optional("endpoint") {
            let e = self.string(n, &p)?.trim().trim_end_matches('/');
            let rest = e.strip_prefix("http://").or_else(|| e.strip_prefix("https://"));
            if !rest.is_some_and(|r| !r.is_empty() && !r.contains(char::is_whitespace)) {
                return Err(self.expected(n, &p, "an http:// or https:// URL such as \"http://127.0.0.1:9000\""));
            }
            o.endpoint = Some(e.to_string());
        }
        if let Some((n, p)) = optional("region") {
            if kind != TierKind::S3 {
                return Err(self.at(n, &p, format!("`region` is not valid for kind {:?}; it applies to \"s3\" tiers", kind.as_str())));
            }
            o.region = Some(self.string(n, &p)?.trim().to_string());
        }
        if let Some((n, p)) = optional("allow_http") {
            match n.value {
                Value::Bool(b) => o.allow_http = Some(b),
                _ => return Err(self.expected(n, &p, "true or false")),
            }
        }
        if let Some((n, p)) = optional("part_size") {
            let size = self.bytes(n, &p, parse_size, "a size such as \"16MiB\"")?;
            if !(MIN_PART_SIZE..=MAX_PART_SIZE).contains(&size) {
                return Err(self.at(
                    n,
                    &p,
                    format!("expected a size between 5MiB (the smallest part S3 accepts) and 5GiB, got {}", n.describe()),
                ));
            }
            o.part_size = size;
        }
        if let Some((n, p)) = optional("concurrency") {
            let c = self.count(n, &p)?;
            if c > MAX_CONCURRENCY {
                return Err(self.expected(n, &p, &format!("a positive integer up to {MAX_CONCURRENCY}")));
            }
            o.concurrency = c;
        }
        if let Some((n, p)) = optional("timeout") {
            o.timeout = Some(self.positive_int(n, &p)?);
        }
        if let Some((n, p)) = optional("retries") {
            match n.value {
                Value::Int(r) if (0..=100).contains(&r) => o.retries = Some(r as usize),
                _ => return Err(self.expected(n, &p, "an integer from 0 to 100")),
            }
        }
        if let Some((n, p)) = optional("ramp_period") {
            o.ramp_period = self.positive_int(n, &p)?;
        }
        if let Some((n, p)) = optional("throttle_timeout") {
            let t = self.positive_int(n, &p)?;
            if t > MAX_THROTTLE_TIMEOUT {
                return Err(self.at(
                    n,
                    &p,
                    format!(
                        "expected seconds up to {MAX_THROTTLE_TIMEOUT} (a request is sent again with its first signature, \
                         which S3 accepts for 15 minutes), got {}",
                        n.describe()
                    ),
                ));
            }
            o.throttle_timeout = t;
        }
        Ok(o)
    }
}

/// The `s3://bucket/prefix` or `gs://bucket/prefix` URL of an object-store tier, normalized
/// (no trailing slash, no empty segments).
pub(super) fn object_url(kind: TierKind, url: &str) -> std::result::Result<String, String> {
    let scheme = match kind {
        TierKind::Gcs => "gs",
        _ => "s3",
    };
    let example = format!("{scheme}://bucket/checkpoints/run1");
    let Some(rest) = url.trim().strip_prefix(&format!("{scheme}://")) else {
        let article = if scheme == "s3" { "an" } else { "a" };
        return Err(format!("expected {article} {scheme}:// URL for kind {:?} such as {example:?}, got {url:?}", kind.as_str()));
    };
    let mut parts = rest.split('/').filter(|p| !p.is_empty());
    let bucket = parts.next().unwrap_or("");
    // What S3 and GCS both accept (GCS also takes `_` and longer dotted names).
    let valid_bucket = (3..=222).contains(&bucket.len())
        && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-._".contains(&b))
        && bucket.as_bytes()[0].is_ascii_alphanumeric()
        && bucket.as_bytes()[bucket.len() - 1].is_ascii_alphanumeric();
    if !valid_bucket {
        return Err(format!(
            "expected a bucket name of lowercase letters, digits, `-` and `.` (3 or more) after {scheme}://, got {url:?} (e.g. {example:?})"
        ));
    }
    let prefix: Vec<&str> = parts.collect();
    if let Some(bad) = prefix.iter().find(|p| **p == "." || **p == ".." || p.contains(char::is_control)) {
        return Err(format!("the prefix of {url:?} has an invalid segment {bad:?}"));
    }
    Ok(if prefix.is_empty() { format!("{scheme}://{bucket}") } else { format!("{scheme}://{bucket}/{}", prefix.join("/")) })
}
