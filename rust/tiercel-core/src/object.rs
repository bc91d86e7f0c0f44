//! Object stores (S3 and S3-compatible servers, Google Cloud Storage) as `Blobs`, on the
//! `object_store` crate, driven from one small shared tokio runtime.
//!
//! - `put` is one PUT; `put_if_absent` a PUT with `If-None-Match: *` (S3) or
//!   `x-goog-if-generation-match: 0` (GCS); a store that says it cannot do that gets a HEAD
//!   then a PUT instead (logged once).
//! - `create` streams: bytes gather into a part-sized buffer; an object no larger than one
//!   part goes up in a single PUT, a larger one as a multipart upload with up to
//!   `concurrency` parts in flight, so a writer holds at most `(concurrency + 1) * part_size`
//!   bytes. On an error or `abort` the upload is aborted. Each multipart upload is recorded by a
//!   small marker object under `.uploads/` while it runs; a writer killed before it could abort
//!   leaves its marker, and `sweep` (run by retention and `tiercel gc`) aborts such uploads.
//! - `get_range` is one ranged GET whose body is copied straight into the destination.
//! - Requests are retried with exponential backoff on 5xx answers, connection resets and
//!   timeouts (`object_store`'s retry layer; bodies of GETs resume where they broke off).
//!
//! Where the settings come from, last wins: the SDKs' config files (`~/.aws/config` and
//! `~/.aws/credentials` for `$AWS_PROFILE`; Google's application-default credentials file),
//! then the environment (`AWS_*`, `GOOGLE_*`, `STORAGE_EMULATOR_HOST`), then the policy
//! (`endpoint`, `region`, `allow_http`, `timeout`). No message ever carries a credential.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::gcp::{GcpCredential, GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as ObjPath;
use object_store::{
    ClientConfigKey, GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, RetryConfig, StaticCredentialProvider,
};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

use crate::blobs::{BlobWriter, Blobs};
use crate::error::{Error, ErrorKind, Result};
use crate::policy::{ObjectOptions, TierConfig, TierKind};

/// Where multipart-upload markers live, under the tier's prefix. Not a step directory, so
/// the step layout ignores it.
pub const UPLOADS_DIR: &str = ".uploads";
/// A marker whose writer cannot be checked (another host) counts as abandoned after this.
pub const STALE_UPLOAD_AGE: Duration = Duration::from_secs(24 * 3600);

// ---------------------------------------------------------------------------------------------
// The runtime
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Settings: environment, config files, policy
// ---------------------------------------------------------------------------------------------

/// The environment as the SDKs see it, captured once (tests pass their own).
#[derive(Debug, Clone, Default)]
pub struct Env {
    pub vars: HashMap<String, String>,
    pub home: Option<PathBuf>,
}

impl Env {
    pub fn process() -> Env {
        Env { vars: std::env::vars().collect(), home: std::env::var_os("HOME").map(PathBuf::from) }
    }

    fn get(&self, k: &str) -> Option<&str> {
        self.vars.get(k).map(|s| s.as_str()).filter(|s| !s.is_empty())
    }
}

/// Sections of an INI file (`~/.aws/credentials`, `~/.aws/config`): name -> key -> value.
fn parse_ini(text: &str) -> HashMap<String, HashMap<String, String>> {
    let mut out: HashMap<String, HashMap<String, String>> = HashMap::new();
    let mut section: Option<String> = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.split_whitespace().collect::<Vec<_>>().join(" ");
            out.entry(name.clone()).or_default();
            section = Some(name);
            continue;
        }
        // Continuation lines (nested `s3 =` blocks) start with whitespace in the file; they
        // hold settings tiercel does not read.
        if let (Some(s), Some((k, v))) = (&section, line.split_once('=')) {
            let v = v.trim();
            let v = v.split(" #").next().unwrap_or(v).trim();
            out.entry(s.clone()).or_default().insert(k.trim().to_ascii_lowercase(), v.to_string());
        }
    }
    out
}

/// The settings of one AWS profile, from the credentials file first, then the config file.
#[derive(Debug, Default)]
struct AwsProfile {
    access_key_id: Option<String>,
    secret_access_key: Option<String>,
    session_token: Option<String>,
    region: Option<String>,
    endpoint_url: Option<String>,
    /// Ways to get credentials that tiercel does not implement (sso, credential_process...).
    unsupported: Vec<String>,
}

fn aws_profile(env: &Env) -> Result<Option<AwsProfile>> {
    let explicit = env.get("AWS_PROFILE").or_else(|| env.get("AWS_DEFAULT_PROFILE"));
    let name = explicit.unwrap_or("default");
    let file = |var: &str, default: &str| -> Option<PathBuf> {
        env.get(var).map(PathBuf::from).or_else(|| env.home.as_ref().map(|h| h.join(".aws").join(default)))
    };
    let read = |p: Option<PathBuf>| -> Result<(Option<String>, HashMap<String, HashMap<String, String>>)> {
        let Some(p) = p else { return Ok((None, HashMap::new())) };
        match std::fs::read_to_string(&p) {
            Ok(t) => Ok((Some(p.display().to_string()), parse_ini(&t))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok((None, HashMap::new())),
            Err(e) => Err(Error::config(format!("cannot read AWS settings file {}: {e}", p.display()))),
        }
    };
    let (creds_path, creds) = read(file("AWS_SHARED_CREDENTIALS_FILE", "credentials"))?;
    let (config_path, config) = read(file("AWS_CONFIG_FILE", "config"))?;
    let in_creds = creds.get(name);
    let config_name = if name == "default" { "default".to_string() } else { format!("profile {name}") };
    let in_config = config.get(&config_name).or_else(|| if name == "default" { config.get("profile default") } else { None });
    if in_creds.is_none() && in_config.is_none() {
        if explicit.is_some() {
            let files: Vec<String> = [creds_path, config_path].into_iter().flatten().collect();
            return Err(Error::config(format!(
                "AWS profile '{name}' (from $AWS_PROFILE) is in neither ~/.aws/credentials nor ~/.aws/config{}",
                if files.is_empty() { " (neither file exists)".to_string() } else { format!(" (read: {})", files.join(", ")) }
            )));
        }
        return Ok(None);
    }
    let get = |k: &str| in_creds.and_then(|s| s.get(k)).or_else(|| in_config.and_then(|s| s.get(k))).cloned();
    let unsupported = ["sso_session", "sso_start_url", "credential_process", "role_arn", "web_identity_token_file"]
        .iter()
        .filter(|k| get(k).is_some())
        .map(|k| k.to_string())
        .collect();
    Ok(Some(AwsProfile {
        access_key_id: get("aws_access_key_id"),
        secret_access_key: get("aws_secret_access_key"),
        session_token: get("aws_session_token"),
        region: in_config.and_then(|s| s.get("region")).cloned(),
        endpoint_url: in_config.and_then(|s| s.get("endpoint_url")).cloned(),
        unsupported,
    }))
}

/// Values that must never appear in a message.
#[derive(Debug, Default, Clone)]
struct Secrets(Vec<String>);

impl Secrets {
    fn add(&mut self, v: Option<String>) {
        if let Some(v) = v.filter(|v| v.len() >= 4) {
            self.0.push(v);
        }
    }
}

/// Removes credentials from an error text: known secret values, and the parts of S3 error
/// bodies that echo a request's signature material.
fn sanitize(text: &str, secrets: &Secrets) -> String {
    let mut s = text.to_string();
    for v in &secrets.0 {
        s = s.replace(v.as_str(), "***");
    }
    for tag in ["AWSAccessKeyId", "StringToSign", "StringToSignBytes", "CanonicalRequest", "CanonicalRequestBytes", "SignatureProvided"] {
        let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
        while let Some(a) = s.find(&open) {
            let Some(b) = s[a..].find(&close) else { break };
            s.replace_range(a..a + b + close.len(), "");
        }
    }
    s
}

fn is_http(url: &str) -> bool {
    url.trim().to_ascii_lowercase().starts_with("http://")
}

fn duration_secs(s: u64) -> String {
    format!("{s}s")
}

/// Seconds one request may take unless the policy or the environment says: object_store's
/// 30, or more for parts so large that 30 s would ask for more than 1 MiB/s per connection.
fn default_timeout(part_size: u64) -> u64 {
    (part_size >> 20).max(30)
}

/// The S3 client builder for `url` with settings from files, environment and policy.
fn s3_builder(url: &str, o: &ObjectOptions, env: &Env) -> Result<(AmazonS3Builder, Secrets)> {
    let mut b = AmazonS3Builder::new();
    let mut secrets = Secrets::default();
    let mut set_by_env = std::collections::HashSet::new();
    // The files first, so that the environment overrides them (as in the AWS SDKs).
    let profile = aws_profile(env)?;
    let env_has_keys = env.get("AWS_ACCESS_KEY_ID").is_some() || env.get("AWS_SECRET_ACCESS_KEY").is_some();
    if let Some(p) = &profile {
        if !env_has_keys {
            if let (Some(id), Some(secret)) = (&p.access_key_id, &p.secret_access_key) {
                b = b.with_config(AmazonS3ConfigKey::AccessKeyId, id).with_config(AmazonS3ConfigKey::SecretAccessKey, secret);
                secrets.add(Some(secret.clone()));
                if let Some(t) = &p.session_token {
                    b = b.with_config(AmazonS3ConfigKey::Token, t);
                    secrets.add(Some(t.clone()));
                }
            } else if !p.unsupported.is_empty() {
                log::warn!(
                    "AWS profile settings {:?} are not read by tiercel; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY \
                     (e.g. from `aws configure export-credentials`) or use instance/web-identity credentials",
                    p.unsupported
                );
            }
        }
        if let Some(r) = &p.region {
            b = b.with_config(AmazonS3ConfigKey::Region, r);
        }
        if let Some(e) = &p.endpoint_url {
            b = b.with_config(AmazonS3ConfigKey::Endpoint, e);
        }
    }
    let mut vars: Vec<(&String, &String)> = env.vars.iter().filter(|(k, _)| k.starts_with("AWS_")).collect();
    // AWS_ENDPOINT_URL_S3 is more specific than AWS_ENDPOINT_URL; AWS_REGION beats AWS_DEFAULT_REGION.
    vars.sort_by_key(|(k, _)| (k.as_str() == "AWS_ENDPOINT_URL_S3" || k.as_str() == "AWS_REGION", k.as_str()));
    for (k, v) in vars {
        if v.is_empty() {
            continue;
        }
        let key = match k.as_str() {
            "AWS_ENDPOINT_URL_S3" => AmazonS3ConfigKey::Endpoint,
            "AWS_DEFAULT_REGION" => AmazonS3ConfigKey::Region,
            _ => match k.to_ascii_lowercase().parse::<AmazonS3ConfigKey>() {
                Ok(key) => key,
                Err(_) => continue,
            },
        };
        if matches!(key, AmazonS3ConfigKey::SecretAccessKey | AmazonS3ConfigKey::Token) {
            secrets.add(Some(v.clone()));
        }
        set_by_env.insert(key.as_ref().to_string());
        b = b.with_config(key, v);
    }
    // The policy has the last word.
    if let Some(e) = &o.endpoint {
        b = b.with_config(AmazonS3ConfigKey::Endpoint, e);
    }
    if let Some(r) = &o.region {
        b = b.with_config(AmazonS3ConfigKey::Region, r);
    }
    let allow_http_key = AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp);
    match o.allow_http {
        Some(a) => b = b.with_config(allow_http_key, a.to_string()),
        // An http:// endpoint says plainly what it wants, as it does to the AWS SDKs.
        None if !set_by_env.contains(allow_http_key.as_ref()) => {
            if b.get_config_value(&AmazonS3ConfigKey::Endpoint).is_some_and(|e| is_http(&e)) {
                b = b.with_config(allow_http_key, "true");
            }
        }
        None => {}
    }
    match o.timeout {
        Some(t) => b = b.with_config(AmazonS3ConfigKey::Client(ClientConfigKey::Timeout), duration_secs(t)),
        None if env.get("AWS_TIMEOUT").is_none() => {
            b = b.with_config(AmazonS3ConfigKey::Client(ClientConfigKey::Timeout), duration_secs(default_timeout(o.part_size)))
        }
        None => {}
    }
    if let Some(r) = o.retries {
        b = b.with_retry(RetryConfig { max_retries: r, ..Default::default() });
    }
    // A custom endpoint and no credentials anywhere: requests go unsigned, rather than to the
    // cloud's instance-metadata address (object_store's last resort), which only a VM in AWS
    // has. A server that wants signatures then answers 403, and the message says what to set.
    let has_credentials = b.get_config_value(&AmazonS3ConfigKey::AccessKeyId).is_some()
        || b.get_config_value(&AmazonS3ConfigKey::WebIdentityTokenFile).is_some()
        || b.get_config_value(&AmazonS3ConfigKey::ContainerCredentialsRelativeUri).is_some()
        || b.get_config_value(&AmazonS3ConfigKey::ContainerCredentialsFullUri).is_some();
    if !has_credentials && b.get_config_value(&AmazonS3ConfigKey::Endpoint).is_some() {
        b = b.with_config(AmazonS3ConfigKey::SkipSignature, "true");
    }
    Ok((b.with_url(url), secrets))
}

/// The GCS client builder for `url` with settings from files, environment and policy.
fn gcs_builder(url: &str, o: &ObjectOptions, env: &Env) -> Result<(GoogleCloudStorageBuilder, Secrets)> {
    let mut b = GoogleCloudStorageBuilder::new();
    let mut secrets = Secrets::default();
    if let Some(p) = env.get("SERVICE_ACCOUNT") {
        b = b.with_config(GoogleConfigKey::ServiceAccount, p);
    }
    for (k, v) in env.vars.iter().filter(|(k, v)| k.starts_with("GOOGLE_") && !v.is_empty()) {
        if let Ok(key) = k.to_ascii_lowercase().parse::<GoogleConfigKey>() {
            if matches!(key, GoogleConfigKey::ServiceAccountKey | GoogleConfigKey::BearerToken) {
                secrets.add(Some(v.clone()));
            }
            b = b.with_config(key, v);
        }
    }
    let has_credentials = [
        GoogleConfigKey::ServiceAccount,
        GoogleConfigKey::ServiceAccountKey,
        GoogleConfigKey::ApplicationCredentials,
        GoogleConfigKey::BearerToken,
    ]
    .iter()
    .any(|k| b.get_config_value(k).is_some())
        || env.home.as_ref().is_some_and(|h| h.join(".config/gcloud/application_default_credentials.json").exists());
    // The Google SDKs' emulator switch: its host, anonymous requests.
    let emulator = env.get("STORAGE_EMULATOR_HOST").map(|h| {
        let h = h.trim_end_matches('/');
        if h.contains("://") {
            h.to_string()
        } else {
            format!("http://{h}")
        }
    });
    let base = o.endpoint.clone().or(emulator.clone());
    if let Some(base) = &base {
        b = b.with_config(GoogleConfigKey::BaseUrl, base);
        // A custom endpoint without credentials is an emulator or a proxy that needs none:
        // requests go without a token. (object_store signs some requests even with
        // skip_signature, so an empty static token also keeps it from asking the cloud's
        // metadata server for one.)
        if emulator.is_some() && o.endpoint.is_none() || !has_credentials {
            b = b
                .with_config(GoogleConfigKey::SkipSignature, "true")
                .with_credentials(Arc::new(StaticCredentialProvider::new(GcpCredential { bearer: String::new() })));
        }
    }
    let allow_http_key = GoogleConfigKey::Client(ClientConfigKey::AllowHttp);
    match o.allow_http {
        Some(a) => b = b.with_config(allow_http_key, a.to_string()),
        None if base.as_deref().is_some_and(is_http) && env.get("GOOGLE_ALLOW_HTTP").is_none() => b = b.with_config(allow_http_key, "true"),
        None => {}
    }
    match o.timeout {
        Some(t) => b = b.with_config(GoogleConfigKey::Client(ClientConfigKey::Timeout), duration_secs(t)),
        None if env.get("GOOGLE_TIMEOUT").is_none() => {
            b = b.with_config(GoogleConfigKey::Client(ClientConfigKey::Timeout), duration_secs(default_timeout(o.part_size)))
        }
        None => {}
    }
    if let Some(r) = o.retries {
        b = b.with_retry(RetryConfig { max_retries: r, ..Default::default() });
    }
    Ok((b.with_url(url), secrets))
}

// ---------------------------------------------------------------------------------------------
// ObjectBlobs
// ---------------------------------------------------------------------------------------------

struct Inner {
    tier: String,
    /// `s3://bucket/prefix`: what messages show.
    url: String,
    root: ObjPath,
    store: Arc<dyn ObjectStore>,
    multipart: Arc<dyn MultipartStore>,
    part_size: usize,
    concurrency: usize,
    secrets: Secrets,
    /// Set once the store has said it cannot create-if-absent.
    no_conditional_put: AtomicBool,
    /// This process, as upload markers name it: host (and pid namespace) and pid.
    host: String,
}

/// An s3 or gcs bucket prefix as `Blobs`.
pub struct ObjectBlobs {
    inner: Arc<Inner>,
}

fn host_id() -> String {
    let mut buf = [0u8; 256];
    let host = if unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) } == 0 {
        let n = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..n]).into_owned()
    } else {
        "unknown".into()
    };
    // Two containers may share a host name but not a pid namespace.
    let ns = std::fs::read_link("/proc/self/ns/pid").map(|p| p.display().to_string()).unwrap_or_default();
    format!("{host}/{ns}")
}

fn pid_alive(pid: u32) -> bool {
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// What a marker under `.uploads/` records about one running multipart upload.
#[derive(serde::Serialize, serde::Deserialize)]
struct UploadMarker {
    key: String,
    upload_id: String,
    host: String,
    pid: u32,
    started: u64,
}

impl ObjectBlobs {
    /// Opens the tier `cfg` (kind s3 or gcs) with settings from the process environment.
    pub fn open(cfg: &TierConfig) -> Result<ObjectBlobs> {
        Self::open_with(cfg, &Env::process())
    }

    pub fn open_with(cfg: &TierConfig, env: &Env) -> Result<ObjectBlobs> {
        let opts = cfg.object.clone().unwrap_or_default();
        let url = cfg.location.clone();
        let fail = |e: object_store::Error, secrets: &Secrets| {
            Error::config(format!("tier '{}': cannot set up a client for {url}: {}", cfg.name, sanitize(&e.to_string(), secrets)))
        };
        let (store, multipart, secrets): (Arc<dyn ObjectStore>, Arc<dyn MultipartStore>, Secrets) = match cfg.kind {
            TierKind::S3 => {
                let (b, secrets) = s3_builder(&url, &opts, env).map_err(|e| e.context(format!("tier '{}'", cfg.name)))?;
                let s = Arc::new(b.build().map_err(|e| fail(e, &secrets))?);
                (s.clone(), s, secrets)
            }
            TierKind::Gcs => {
                let (b, secrets) = gcs_builder(&url, &opts, env).map_err(|e| e.context(format!("tier '{}'", cfg.name)))?;
                let s = Arc::new(b.build().map_err(|e| fail(e, &secrets))?);
                (s.clone(), s, secrets)
            }
            _ => return Err(Error::invalid(format!("tier '{}' of kind {} is no object store", cfg.name, cfg.kind.as_str()))),
        };
        let prefix = url.splitn(4, '/').nth(3).unwrap_or("").to_string();
        Ok(ObjectBlobs {
            inner: Arc::new(Inner {
                tier: cfg.name.clone(),
                url,
                root: ObjPath::from(prefix),
                store,
                multipart,
                part_size: opts.part_size as usize,
                concurrency: opts.concurrency.max(1),
                secrets,
                no_conditional_put: AtomicBool::new(false),
                host: host_id(),
            }),
        })
    }

    /// The multipart uploads recorded under `.uploads/` (running, or left by a killed
    /// writer): (marker key, object key, upload id).
    pub fn uploads(&self) -> Result<Vec<(String, String, String)>> {
        let mut out = vec![];
        for name in self.list(UPLOADS_DIR)? {
            let key = format!("{UPLOADS_DIR}/{name}");
            if let Ok(m) = serde_json::from_slice::<UploadMarker>(&self.get(&key)?) {
                out.push((key, m.key, m.upload_id));
            }
        }
        Ok(out)
    }
}

impl Inner {
    fn path(&self, key: &str) -> ObjPath {
        let key = key.trim_matches('/');
        if key.is_empty() {
            self.root.clone()
        } else if self.root.as_ref().is_empty() {
            ObjPath::from(key)
        } else {
            ObjPath::from(format!("{}/{key}", self.root))
        }
    }

    fn describe(&self, key: &str) -> String {
        format!("{}/{}", self.url, key.trim_matches('/'))
    }

    /// A tiercel error for a failed `op` on `key`.
    fn err(&self, op: &str, key: &str, e: object_store::Error) -> Error {
        let what = self.describe(key);
        let text = sanitize(&e.to_string(), &self.secrets);
        match e {
            object_store::Error::NotFound { .. } => Error::not_found(format!("tier '{}': {what}: not found", self.tier)),
            object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => Error::unavailable(format!(
                "tier '{}': {op} {what}: {text} (check the credentials: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or \
                 the $AWS_PROFILE profile for s3; GOOGLE_APPLICATION_CREDENTIALS for gcs)",
                self.tier
            )),
            _ => Error::unavailable(format!("tier '{}': {op} {what}: {text}", self.tier)),
        }
    }

    async fn put(&self, key: &str, payload: PutPayload) -> Result<()> {
        self.store.put(&self.path(key), payload).await.map(|_| ()).map_err(|e| self.err("PUT", key, e))
    }

    async fn get(&self, key: &str) -> Result<Bytes> {
        let r = self.store.get(&self.path(key)).await.map_err(|e| self.err("GET", key, e))?;
        r.bytes().await.map_err(|e| self.err("GET", key, e))
    }

    async fn head_size(&self, key: &str) -> Result<Option<u64>> {
        match self.store.head(&self.path(key)).await {
            Ok(m) => Ok(Some(m.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.err("HEAD", key, e)),
        }
    }

    async fn get_range(&self, key: &str, offset: u64, dst: &mut [u8]) -> Result<()> {
        let want = offset..offset + dst.len() as u64;
        let short = |have: Option<u64>| {
            Error::integrity(format!(
                "tier '{}': {} is shorter than its manifest says (needs bytes {}..{}, has {})",
                self.tier,
                self.describe(key),
                want.start,
                want.end,
                have.map_or("none".to_string(), |h| format!("{h}"))
            ))
        };
        if dst.is_empty() {
            return match self.head_size(key).await? {
                Some(n) if n >= offset => Ok(()),
                Some(n) => Err(short(Some(n))),
                None => Err(Error::not_found(format!("tier '{}': {}: not found", self.tier, self.describe(key)))),
            };
        }
        let res = self.store.get_opts(&self.path(key), GetOptions::new().with_range(Some(want.clone()))).await;
        let r = match res {
            Ok(r) => r,
            Err(e @ object_store::Error::NotFound { .. }) => return Err(self.err("GET", key, e)),
            Err(e) => {
                // A range past the end is refused (416); say that the object is short.
                if let Ok(Some(n)) = self.head_size(key).await {
                    if n < want.end {
                        return Err(short(Some(n)));
                    }
                }
                return Err(self.err("GET", key, e));
            }
        };
        if r.range != want {
            let size = r.meta.size;
            return Err(short(Some(size)));
        }
        // The one copy: from the HTTP body into the caller's buffer.
        let mut pos = 0usize;
        let mut stream = r.into_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| self.err("GET", key, e))?;
            let end = pos + chunk.len();
            if end > dst.len() {
                return Err(Error::integrity(format!(
                    "tier '{}': {}: the server sent more bytes than the range {}..{} asked for",
                    self.tier,
                    self.describe(key),
                    want.start,
                    want.end
                )));
            }
            dst[pos..end].copy_from_slice(&chunk);
            pos = end;
        }
        if pos != dst.len() {
            return Err(short(Some(offset + pos as u64)));
        }
        Ok(())
    }

    async fn put_if_absent(&self, key: &str, data: &[u8]) -> Result<bool> {
        let path = self.path(key);
        let bytes = Bytes::copy_from_slice(data);
        let mut attempt = 0;
        loop {
            attempt += 1;
            if self.no_conditional_put.load(Ordering::Relaxed) {
                if self.head_size(key).await?.is_some() {
                    return Ok(false);
                }
                self.put(key, bytes.clone().into()).await?;
                return Ok(true);
            }
            let opts = PutOptions { mode: PutMode::Create, ..Default::default() };
            match self.store.put_opts(&path, bytes.clone().into(), opts).await {
                Ok(_) => return Ok(true),
                Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }) => return Ok(false),
                Err(e)
                    if matches!(e, object_store::Error::NotImplemented { .. } | object_store::Error::NotSupported { .. })
                        || e.to_string().contains("status code: 501") =>
                {
                    if !self.no_conditional_put.swap(true, Ordering::Relaxed) {
                        log::warn!(
                            "tier '{}': {} cannot create an object only if it is absent ({}); using HEAD then PUT, \
                             which two writers racing for the same key can both pass",
                            self.tier,
                            self.url,
                            sanitize(&e.to_string(), &self.secrets)
                        );
                    }
                }
                // A create that is not idempotent is not retried by the client on a reset or
                // timeout: the object may or may not be there. Look, then try again.
                Err(e) if attempt < 4 => {
                    log::warn!(
                        "tier '{}': create-if-absent of {} failed, checking: {}",
                        self.tier,
                        self.describe(key),
                        sanitize(&e.to_string(), &self.secrets)
                    );
                    match self.get(key).await {
                        Ok(have) => return Ok(have.as_ref() == data),
                        Err(g) if g.kind == ErrorKind::NotFound => {}
                        Err(_) => tokio::time::sleep(Duration::from_millis(200 << attempt)).await,
                    }
                }
                Err(e) => return Err(self.err("PUT (create if absent)", key, e)),
            }
        }
    }

    async fn list(&self, prefix: &str) -> Result<Vec<String>> {
        let path = self.path(prefix);
        let at = if path.as_ref().is_empty() { None } else { Some(&path) };
        let r = self.store.list_with_delimiter(at).await.map_err(|e| self.err("LIST", prefix, e))?;
        let mut names: Vec<String> = r
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename().map(String::from))
            .chain(r.objects.iter().filter_map(|m| m.location.filename().map(String::from)))
            .collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    async fn delete(&self, key: &str) -> Result<()> {
        match self.store.delete(&self.path(key)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err("DELETE", key, e)),
        }
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<()> {
        let path = self.path(prefix);
        if path.as_ref().is_empty() {
            return Err(Error::invalid(format!("tier '{}': refusing to delete everything under {}", self.tier, self.url)));
        }
        let locations = self.store.list(Some(&path)).map_ok(|m| m.location).boxed();
        let mut deleted = self.store.delete_stream(locations);
        while let Some(r) = deleted.next().await {
            match r {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.err("DELETE", prefix, e)),
            }
        }
        Ok(())
    }

    /// Aborts the multipart uploads that killed writers left (see the module docs).
    async fn sweep(&self) -> Result<Vec<String>> {
        let dir = self.path(UPLOADS_DIR);
        let markers: Vec<object_store::ObjectMeta> =
            self.store.list(Some(&dir)).try_collect().await.map_err(|e| self.err("LIST", UPLOADS_DIR, e))?;
        let now = unix_now();
        let mut done = vec![];
        for meta in markers {
            let Some(name) = meta.location.filename().map(String::from) else { continue };
            let marker_key = format!("{UPLOADS_DIR}/{name}");
            let age = now.saturating_sub(meta.last_modified.timestamp().max(0) as u64);
            // By the listed location itself: a name is not always a valid key again.
            let got = match self.store.get(&meta.location).await {
                Ok(r) => r.bytes().await,
                Err(e) => Err(e),
            };
            let bytes = match got {
                Ok(b) => b,
                Err(object_store::Error::NotFound { .. }) => continue, // finished meanwhile
                Err(e) => return Err(self.err("GET", &marker_key, e)),
            };
            let marker: Option<UploadMarker> = serde_json::from_slice(&bytes).ok();
            let stale = match &marker {
                Some(m) if m.host == self.host && m.pid == std::process::id() => !active_uploads().lock().contains(&m.upload_id),
                Some(m) if m.host == self.host => !pid_alive(m.pid) || age > STALE_UPLOAD_AGE.as_secs(),
                _ => age > STALE_UPLOAD_AGE.as_secs(),
            };
            if !stale {
                continue;
            }
            if let Some(m) = &marker {
                match self.multipart.abort_multipart(&self.path(&m.key), &m.upload_id).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => {
                        log::warn!(
                            "tier '{}': cannot abort the abandoned upload of {}: {}",
                            self.tier,
                            self.describe(&m.key),
                            sanitize(&e.to_string(), &self.secrets)
                        );
                        continue;
                    }
                }
                let who = if m.host != self.host {
                    format!("pid {} on {}", m.pid, m.host)
                } else if m.pid == std::process::id() {
                    "this process (its abort had failed)".to_string()
                } else {
                    format!("pid {} (gone)", m.pid)
                };
                done.push(format!("aborted the abandoned multipart upload of {} by {who}", self.describe(&m.key)));
            } else {
                done.push(format!("removed the unreadable upload marker {}", self.describe(&marker_key)));
            }
            match self.store.delete(&meta.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(self.err("DELETE", &marker_key, e)),
            }
        }
        Ok(done)
    }
}

impl Blobs for ObjectBlobs {
    fn describe(&self, key: &str) -> String {
        self.inner.describe(key)
    }

    fn put(&self, key: &str, data: &[u8]) -> Result<()> {
        block_on(self.inner.put(key, Bytes::copy_from_slice(data).into()))
    }

    fn put_if_absent(&self, key: &str, data: &[u8]) -> Result<bool> {
        block_on(self.inner.put_if_absent(key, data))
    }

    fn create(&self, key: &str) -> Result<Box<dyn BlobWriter>> {
        Ok(Box::new(ObjectWriter {
            inner: self.inner.clone(),
            key: key.trim_matches('/').to_string(),
            buf: Vec::new(),
            upload: None,
            total: 0,
            closed: false,
        }))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        block_on(self.inner.get(key)).map(|b| b.to_vec())
    }

    fn get_range(&self, key: &str, offset: u64, dst: &mut [u8]) -> Result<()> {
        block_on(self.inner.get_range(key, offset, dst))
    }

    fn exists(&self, key: &str) -> Result<bool> {
        block_on(self.inner.head_size(key)).map(|s| s.is_some())
    }

    fn list(&self, prefix: &str) -> Result<Vec<String>> {
        block_on(self.inner.list(prefix))
    }

    fn delete(&self, key: &str) -> Result<()> {
        block_on(self.inner.delete(key))
    }

    fn delete_prefix(&self, prefix: &str) -> Result<()> {
        block_on(self.inner.delete_prefix(prefix))
    }

    fn sweep(&self) -> Result<Vec<String>> {
        block_on(self.inner.sweep())
    }
}

// ---------------------------------------------------------------------------------------------
// The streaming writer
// ---------------------------------------------------------------------------------------------

static MARKER_SEQ: AtomicU64 = AtomicU64::new(0);

/// Upload ids this process is writing right now: its own markers of other ids are uploads it
/// could not abort (the server was gone), which `sweep` may abort now.
fn active_uploads() -> &'static parking_lot::Mutex<std::collections::HashSet<String>> {
    static ACTIVE: OnceLock<parking_lot::Mutex<std::collections::HashSet<String>>> = OnceLock::new();
    ACTIVE.get_or_init(Default::default)
}

struct Upload {
    id: String,
    marker: String,
    started: SystemTime,
    /// Parts sent, in order, each still running or done.
    parts: Vec<Option<PartId>>,
    running: std::collections::VecDeque<(usize, JoinHandle<object_store::Result<PartId>>)>,
}

struct ObjectWriter {
    inner: Arc<Inner>,
    key: String,
    buf: Vec<u8>,
    upload: Option<Upload>,
    total: u64,
    closed: bool,
}

impl ObjectWriter {
    fn path(&self) -> ObjPath {
        self.inner.path(&self.key)
    }

    /// Starts the multipart upload and records it in a marker.
    fn begin(&mut self) -> Result<()> {
        let i = &self.inner;
        let path = self.path();
        let id = block_on(i.multipart.create_multipart(&path)).map_err(|e| i.err("POST (start multipart upload)", &self.key, e))?;
        active_uploads().lock().insert(id.clone());
        // Letters, digits, `.`, `-` only: a key that no store escapes.
        let marker = format!(
            "{UPLOADS_DIR}/{}.{}.{}.json",
            self.key.replace('/', "--"),
            std::process::id(),
            MARKER_SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let m = UploadMarker {
            key: self.key.clone(),
            upload_id: id.clone(),
            host: i.host.clone(),
            pid: std::process::id(),
            started: unix_now(),
        };
        if let Err(e) = block_on(i.put(&marker, serde_json::to_vec(&m).unwrap().into())) {
            let _ = block_on(i.multipart.abort_multipart(&path, &id));
            active_uploads().lock().remove(&id);
            return Err(e);
        }
        self.upload = Some(Upload { id, marker, started: SystemTime::now(), parts: vec![], running: Default::default() });
        Ok(())
    }

    /// Waits for the oldest running part.
    fn wait_one(&mut self) -> Result<()> {
        let i = self.inner.clone();
        let up = self.upload.as_mut().expect("upload");
        let Some((idx, handle)) = up.running.pop_front() else { return Ok(()) };
        let part = block_on(handle)
            .map_err(|e| Error::unavailable(format!("tier '{}': {}: part {idx} was lost: {e}", i.tier, i.describe(&self.key))))?
            .map_err(|e| i.err(&format!("PUT (part {})", idx + 1), &self.key, e))?;
        up.parts[idx] = Some(part);
        Ok(())
    }

    /// Sends the buffer as the next part, once fewer than `concurrency` parts are running.
    fn send_part(&mut self) -> Result<()> {
        if self.upload.is_none() {
            self.begin()?;
        }
        while self.upload.as_ref().unwrap().running.len() >= self.inner.concurrency {
            self.wait_one()?;
        }
        let data = std::mem::take(&mut self.buf);
        let up = self.upload.as_mut().unwrap();
        let idx = up.parts.len();
        up.parts.push(None);
        let (mp, path, id) = (self.inner.multipart.clone(), self.inner.path(&self.key), up.id.clone());
        let handle = runtime().spawn(async move { mp.put_part(&path, &id, idx, PutPayload::from(data)).await });
        up.running.push_back((idx, handle));
        Ok(())
    }

    fn cleanup(&mut self) {
        self.closed = true;
        self.buf = Vec::new();
        let Some(up) = self.upload.take() else { return };
        for (_, h) in &up.running {
            h.abort();
        }
        let (i, path, key) = (self.inner.clone(), self.path(), self.key.clone());
        let fut = async move {
            for (_, h) in up.running {
                let _ = h.await;
            }
            let res = i.multipart.abort_multipart(&path, &up.id).await;
            active_uploads().lock().remove(&up.id);
            match res {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {
                    let _ = i.delete(&up.marker).await;
                }
                // The marker stays, so that a later sweep aborts the upload.
                Err(e) => log::warn!(
                    "tier '{}': cannot abort the multipart upload of {}: {}",
                    i.tier,
                    i.describe(&key),
                    sanitize(&e.to_string(), &i.secrets)
                ),
            }
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            runtime().spawn(fut);
        } else {
            block_on(fut);
        }
    }

    fn complete(&mut self) -> Result<()> {
        if self.upload.is_none() {
            // Small enough for one PUT.
            let data = std::mem::take(&mut self.buf);
            return block_on(self.inner.put(&self.key, PutPayload::from(data)));
        }
        if !self.buf.is_empty() {
            self.send_part()?;
        }
        while !self.upload.as_ref().unwrap().running.is_empty() {
            self.wait_one()?;
        }
        let i = self.inner.clone();
        let up = self.upload.as_ref().unwrap();
        let parts: Vec<PartId> = up.parts.iter().map(|p| p.clone().expect("every part finished")).collect();
        let path = self.path();
        let res = block_on(i.multipart.complete_multipart(&path, &up.id, parts));
        if let Err(e) = res {
            // The answer to a completion that succeeded may have been lost, and its retry
            // then finds no upload: the object tells.
            let landed = block_on(i.store.head(&path))
                .is_ok_and(|m| m.size == self.total && SystemTime::from(m.last_modified) + Duration::from_secs(300) >= up.started);
            if !landed {
                return Err(i.err("POST (complete multipart upload)", &self.key, e));
            }
        }
        let up = self.upload.take().unwrap();
        active_uploads().lock().remove(&up.id);
        if let Err(e) = block_on(i.delete(&up.marker)) {
            log::warn!("tier '{}': upload marker {} stays: {e}", i.tier, up.marker);
        }
        Ok(())
    }
}

impl BlobWriter for ObjectWriter {
    fn write(&mut self, mut data: &[u8]) -> Result<()> {
        let part = self.inner.part_size;
        self.total += data.len() as u64;
        while !data.is_empty() {
            if self.buf.capacity() == 0 {
                self.buf.reserve_exact(part);
            }
            let take = (part - self.buf.len()).min(data.len());
            self.buf.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.buf.len() == part {
                if let Err(e) = self.send_part() {
                    self.cleanup();
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    fn finish(mut self: Box<Self>) -> Result<()> {
        let res = self.complete();
        if res.is_err() {
            self.cleanup();
        }
        self.closed = true;
        res
    }

    fn abort(mut self: Box<Self>) {
        self.cleanup();
    }
}

impl Drop for ObjectWriter {
    fn drop(&mut self) {
        if !self.closed {
            self.cleanup();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)], home: Option<&std::path::Path>) -> Env {
        Env { vars: vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(), home: home.map(PathBuf::from) }
    }

    fn s3(vars: &[(&str, &str)], home: Option<&std::path::Path>, o: &ObjectOptions) -> AmazonS3Builder {
        s3_builder("s3://bkt/pre", o, &env(vars, home)).unwrap().0
    }

    fn v(b: &AmazonS3Builder, k: AmazonS3ConfigKey) -> Option<String> {
        b.get_config_value(&k)
    }

    #[test]
    fn ini_files() {
        let t = "# c\n[default]\naws_access_key_id = AKIA1\naws_secret_access_key=sec1 # note\n\n[profile  dev]\nregion = eu-west-3\ns3 =\n  addressing_style = path\n";
        let ini = parse_ini(t);
        assert_eq!(ini["default"]["aws_access_key_id"], "AKIA1");
        assert_eq!(ini["default"]["aws_secret_access_key"], "sec1");
        assert_eq!(ini["profile dev"]["region"], "eu-west-3");
    }

    #[test]
    fn aws_settings_come_from_files_then_env_then_policy() {
        let home = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(home.path().join(".aws")).unwrap();
        std::fs::write(
            home.path().join(".aws/credentials"),
            "[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = FILESECRET\n[dev]\naws_access_key_id = DEVKEY\naws_secret_access_key = DEVSECRET\naws_session_token = DEVTOKEN\n",
        )
        .unwrap();
        std::fs::write(
            home.path().join(".aws/config"),
            "[default]\nregion = eu-central-1\n[profile dev]\nregion = ap-south-1\nendpoint_url = http://127.0.0.1:9999\n",
        )
        .unwrap();
        let h = Some(home.path());
        let none = ObjectOptions::default();
        // Files only.
        let b = s3(&[], h, &none);
        assert_eq!(v(&b, AmazonS3ConfigKey::AccessKeyId).as_deref(), Some("FILEKEY"));
        assert_eq!(v(&b, AmazonS3ConfigKey::Region).as_deref(), Some("eu-central-1"));
        assert_eq!(v(&b, AmazonS3ConfigKey::Endpoint), None);
        // A named profile: its credentials, region and endpoint (http: allowed).
        let b = s3(&[("AWS_PROFILE", "dev")], h, &none);
        assert_eq!(v(&b, AmazonS3ConfigKey::AccessKeyId).as_deref(), Some("DEVKEY"));
        assert_eq!(v(&b, AmazonS3ConfigKey::Token).as_deref(), Some("DEVTOKEN"));
        assert_eq!(v(&b, AmazonS3ConfigKey::Region).as_deref(), Some("ap-south-1"));
        assert_eq!(v(&b, AmazonS3ConfigKey::Endpoint).as_deref(), Some("http://127.0.0.1:9999"));
        assert_eq!(v(&b, AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp)).as_deref(), Some("true"));
        // The environment beats the files.
        let b = s3(
            &[
                ("AWS_ACCESS_KEY_ID", "ENVKEY"),
                ("AWS_SECRET_ACCESS_KEY", "ENVSECRET"),
                ("AWS_DEFAULT_REGION", "us-west-1"),
                ("AWS_REGION", "us-west-2"),
                ("AWS_ENDPOINT_URL", "https://minio.local"),
            ],
            h,
            &none,
        );
        assert_eq!(v(&b, AmazonS3ConfigKey::AccessKeyId).as_deref(), Some("ENVKEY"));
        assert_eq!(v(&b, AmazonS3ConfigKey::SecretAccessKey).as_deref(), Some("ENVSECRET"));
        assert_eq!(v(&b, AmazonS3ConfigKey::Region).as_deref(), Some("us-west-2"));
        assert_eq!(v(&b, AmazonS3ConfigKey::Endpoint).as_deref(), Some("https://minio.local"));
        // AWS_ALLOW_HTTP as object_store reads it, and an explicit "false" is kept.
        let b = s3(&[("AWS_ENDPOINT", "http://127.0.0.1:1"), ("AWS_ALLOW_HTTP", "false")], h, &none);
        assert_eq!(v(&b, AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp)).as_deref(), Some("false"));
        // The policy beats both.
        let pol = ObjectOptions {
            endpoint: Some("http://10.0.0.1:9000".into()),
            region: Some("r1".into()),
            allow_http: Some(true),
            timeout: Some(7),
            ..Default::default()
        };
        let b = s3(&[("AWS_ENDPOINT_URL", "https://x"), ("AWS_REGION", "r0")], h, &pol);
        assert_eq!(v(&b, AmazonS3ConfigKey::Endpoint).as_deref(), Some("http://10.0.0.1:9000"));
        assert_eq!(v(&b, AmazonS3ConfigKey::Region).as_deref(), Some("r1"));
        assert_eq!(v(&b, AmazonS3ConfigKey::Client(ClientConfigKey::Timeout)).as_deref(), Some("7s"));
        // Without one, 30 s, or more for large parts; AWS_TIMEOUT as object_store reads it.
        let big = ObjectOptions { part_size: 512 << 20, ..Default::default() };
        assert_eq!(v(&s3(&[], h, &none), AmazonS3ConfigKey::Client(ClientConfigKey::Timeout)).as_deref(), Some("30s"));
        assert_eq!(v(&s3(&[], h, &big), AmazonS3ConfigKey::Client(ClientConfigKey::Timeout)).as_deref(), Some("512s"));
        assert_eq!(v(&s3(&[("AWS_TIMEOUT", "5s")], h, &big), AmazonS3ConfigKey::Client(ClientConfigKey::Timeout)).as_deref(), Some("5s"));
        // A profile that is nowhere is an error, as in the SDKs.
        let e = s3_builder("s3://bkt", &none, &env(&[("AWS_PROFILE", "nope")], h)).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Config);
        assert!(e.message.contains("AWS profile 'nope'"), "{}", e.message);
        // No files and no environment: nothing set, no error; requests to AWS itself may then
        // use the instance's role.
        let b = s3(&[], None, &none);
        assert_eq!(v(&b, AmazonS3ConfigKey::AccessKeyId), None);
        assert_ne!(v(&b, AmazonS3ConfigKey::SkipSignature).as_deref(), Some("true"));
        // A custom endpoint and no credentials: unsigned, never the metadata address.
        let b = s3(&[("AWS_ENDPOINT_URL", "http://127.0.0.1:1")], None, &none);
        assert_eq!(v(&b, AmazonS3ConfigKey::SkipSignature).as_deref(), Some("true"));
    }

    #[test]
    fn gcs_settings() {
        let none = ObjectOptions::default();
        let g = |vars: &[(&str, &str)], o: &ObjectOptions| gcs_builder("gs://bkt/p", o, &env(vars, None)).unwrap().0;
        let b = g(&[("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")], &none);
        assert_eq!(b.get_config_value(&GoogleConfigKey::BaseUrl).as_deref(), Some("http://127.0.0.1:4443"));
        assert_eq!(b.get_config_value(&GoogleConfigKey::SkipSignature).as_deref(), Some("true"));
        assert_eq!(b.get_config_value(&GoogleConfigKey::Client(ClientConfigKey::AllowHttp)).as_deref(), Some("true"));
        let pol = ObjectOptions { endpoint: Some("https://gcs.example".into()), ..Default::default() };
        let b = g(&[("GOOGLE_APPLICATION_CREDENTIALS", "/etc/sa.json")], &pol);
        assert_eq!(b.get_config_value(&GoogleConfigKey::BaseUrl).as_deref(), Some("https://gcs.example"));
        assert_eq!(b.get_config_value(&GoogleConfigKey::ApplicationCredentials).as_deref(), Some("/etc/sa.json"));
        assert_ne!(b.get_config_value(&GoogleConfigKey::SkipSignature).as_deref(), Some("true"));
        let b = g(&[], &none);
        assert_eq!(b.get_config_value(&GoogleConfigKey::BaseUrl), None);
    }

    #[test]
    fn messages_carry_no_credentials() {
        let mut s = Secrets::default();
        s.add(Some("wJalrXUtnFEMI/K7MDENG".into()));
        let body = "Server returned non-2xx status code: 403 Forbidden: <Error><Code>SignatureDoesNotMatch</Code>\
                    <AWSAccessKeyId>AKIAEXAMPLE</AWSAccessKeyId><StringToSign>AWS4-HMAC-SHA256\n...</StringToSign>\
                    <SignatureProvided>abc</SignatureProvided><CanonicalRequest>PUT /x</CanonicalRequest></Error> key wJalrXUtnFEMI/K7MDENG";
        let clean = sanitize(body, &s);
        for bad in ["AKIAEXAMPLE", "AWS4-HMAC", "abc<", "PUT /x", "wJalrXUtnFEMI"] {
            assert!(!clean.contains(bad), "{bad} in {clean}");
        }
        assert!(clean.contains("SignatureDoesNotMatch"));
    }
}
