//! The multipart uploads an S3 server itself holds under a prefix (ListMultipartUploads,
//! `GET /?uploads&prefix=`), which `object_store` has no call for. A writer killed between
//! starting an upload and writing its marker under `.uploads/` leaves an upload that only
//! this listing finds; it costs storage until aborted. One small SigV4-signed request per
//! page (`object_store`'s own signer and HTTP client, with the tier's credentials, region,
//! endpoint and client settings), the XML answer read for `Key`, `UploadId`, `Initiated`.
//!
//! GCS has no equivalent here: its JSON API (and the fake server the tests use) has no
//! multipart uploads; object_store writes a large GCS object through the XML API's
//! multipart upload, and a GCS upload killed before its marker is found by GCS's own
//! lifecycle rule (`AbortIncompleteMultipartUpload`) only, not by `gc` (docs/reliability.md).

use std::sync::Arc;

use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey, AwsAuthorizer};
use object_store::client::{HttpClient, HttpConnector, HttpRequestBody, ReqwestConnector};
use object_store::{ClientConfigKey, ClientOptions};

use crate::error::{Error, Result};

/// One multipart upload the server lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerUpload {
    pub key: String,
    pub upload_id: String,
    /// When it was started, in seconds since the epoch (None when the server did not say).
    pub initiated: Option<u64>,
}

/// Lists an S3 bucket's multipart uploads.
pub struct S3Uploads {
    s3: Arc<AmazonS3>,
    client: HttpClient,
    /// `https://<bucket>.s3.<region>.amazonaws.com`, or `<endpoint>/<bucket>` (path style),
    /// or the endpoint itself when it names the bucket (virtual-hosted style).
    bucket_url: String,
    region: String,
}

impl S3Uploads {
    /// From the same settings the tier's client was built with; `bucket` from the tier's URL.
    pub fn new(b: &AmazonS3Builder, s3: Arc<AmazonS3>, bucket: &str) -> Result<S3Uploads> {
        let get = |k: AmazonS3ConfigKey| b.get_config_value(&k).filter(|v| !v.is_empty());
        let region = get(AmazonS3ConfigKey::Region).unwrap_or_else(|| "us-east-1".into());
        let virtual_hosted = get(AmazonS3ConfigKey::VirtualHostedStyleRequest).is_some_and(|v| v == "true");
        let bucket_url = match get(AmazonS3ConfigKey::Endpoint) {
            Some(e) if virtual_hosted => e.trim_end_matches('/').to_string(),
            Some(e) => format!("{}/{bucket}", e.trim_end_matches('/')),
            None => format!("https://{bucket}.s3.{region}.amazonaws.com"),
        };
        let mut options = ClientOptions::new();
        for key in [ClientConfigKey::AllowHttp, ClientConfigKey::Timeout, ClientConfigKey::ConnectTimeout] {
            if let Some(v) = b.get_config_value(&AmazonS3ConfigKey::Client(key)) {
                options = options.with_config(key, v);
            }
        }
        let client = ReqwestConnector::default()
            .connect(&options)
            .map_err(|e| Error::config(format!("cannot set up a client to list the uploads of {bucket_url}: {e}")))?;
        Ok(S3Uploads { s3, client, bucket_url, region })
    }

    /// Every multipart upload under `prefix`, page by page.
    pub async fn list(&self, prefix: &str) -> Result<Vec<ServerUpload>> {
        let mut out = vec![];
        let mut markers: Option<(String, String)> = None;
        loop {
            let mut url = format!("{}/?uploads&prefix={}", self.bucket_url, encode(prefix));
            if let Some((key, id)) = &markers {
                url.push_str(&format!("&key-marker={}&upload-id-marker={}", encode(key), encode(id)));
            }
            let page = self.get(&url).await?;
            out.extend(uploads_of(&page));
            if tag(&page, "IsTruncated").as_deref() != Some("true") {
                return Ok(out);
            }
            let next = (tag(&page, "NextKeyMarker"), tag(&page, "NextUploadIdMarker"));
            match next {
                (Some(k), Some(i)) if Some((&k, &i)) != markers.as_ref().map(|(a, b)| (a, b)) => markers = Some((k, i)),
                _ => return Ok(out), // a server that says "truncated" without where to go on
            }
        }
    }

    async fn get(&self, url: &str) -> Result<String> {
        let fail = |what: String| Error::unavailable(format!("listing the multipart uploads of {}: {what}", self.bucket_url));
        let credential = self.s3.credentials().get_credential().await.map_err(|e| fail(format!("no credentials: {e}")))?;
        let mut req = http::Request::builder()
            .method("GET")
            .uri(url)
            .body(HttpRequestBody::empty())
            .map_err(|e| fail(format!("bad request URL {url}: {e}")))?;
        AwsAuthorizer::new(&credential, "s3", &self.region).try_authorize(&mut req, None).map_err(|e| fail(format!("signing: {e}")))?;
        let resp = self.client.execute(req).await.map_err(|e| fail(e.to_string()))?;
        let status = resp.status();
        let body = resp.into_body().bytes().await.map_err(|e| fail(e.to_string()))?;
        let text = String::from_utf8_lossy(&body).into_owned();
        if !status.is_success() {
            return Err(fail(format!("HTTP {status}: {}", text.chars().take(300).collect::<String>())));
        }
        Ok(text)
    }
}

/// The `<Upload>` entries of one ListMultipartUploads page.
fn uploads_of(xml: &str) -> Vec<ServerUpload> {
    xml.split("<Upload>")
        .skip(1)
        .filter_map(|u| {
            let u = u.split("</Upload>").next()?;
            Some(ServerUpload {
                key: tag(u, "Key")?,
                upload_id: tag(u, "UploadId")?,
                initiated: tag(u, "Initiated").and_then(|t| unix_time(&t)),
            })
        })
        .collect()
}

/// The unescaped text of the first `<name>...</name>` in `xml`.
fn tag(xml: &str, name: &str) -> Option<String> {
    let start = xml.find(&format!("<{name}>"))? + name.len() + 2;
    let len = xml[start..].find(&format!("</{name}>"))?;
    Some(unescape(&xml[start..start + len]))
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&apos;", "'").replace("&amp;", "&")
}

/// Percent-encodes a query value (RFC 3986 unreserved characters stay), as SigV4 wants it.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Seconds since the epoch of an ISO 8601 UTC time ("2026-12-01T08:12:48.000Z").
fn unix_time(t: &str) -> Option<u64> {
    let num = |r: std::ops::Range<usize>| t.get(r)?.parse::<i64>().ok();
    let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hh, mm, ss) = (num(11..13)?, num(14..16)?, num(17..19)?);
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u64::try_from(days * 86_400 + hh * 3600 + mm * 60 + ss).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_listing_page() {
        let xml = r#"<?xml version="1.0" encoding="UTF-8"?><ListMultipartUploadsResult><Bucket>b</Bucket>
            <IsTruncated>true</IsTruncated><NextKeyMarker>p/a&amp;b</NextKeyMarker><NextUploadIdMarker>2</NextUploadIdMarker>
            <Upload><Key>p/step-000000000001/rank-00000.data</Key><UploadId>abc</UploadId>
            <Initiated>2026-12-01T08:12:48.000Z</Initiated></Upload>
            <Upload><Key>p/a&amp;b</Key><UploadId>2</UploadId></Upload></ListMultipartUploadsResult>"#;
        let ups = uploads_of(xml);
        assert_eq!(ups.len(), 2);
        assert_eq!(ups[0].key, "p/step-000000000001/rank-00000.data");
        assert_eq!(ups[0].initiated, Some(1_796_112_768));
        assert_eq!((ups[1].key.as_str(), ups[1].upload_id.as_str(), ups[1].initiated), ("p/a&b", "2", None));
        assert_eq!(tag(xml, "IsTruncated").as_deref(), Some("true"));
        assert_eq!(tag(xml, "NextKeyMarker").as_deref(), Some("p/a&b"));
        assert_eq!(unix_time("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(unix_time("2000-03-01T00:00:01Z"), Some(951_868_801));
        assert_eq!(unix_time("garbage"), None);
        assert_eq!(encode("a b/c~"), "a%20b%2Fc~");
    }
}
