//! Where an object-store tier's settings come from, last wins: the SDKs' config files, the
//! environment, the policy. Credentials are remembered as `Secrets`, so that no message ever
//! shows one.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::gcp::{GcpCredential, GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::{ClientConfigKey, RetryConfig, StaticCredentialProvider};

use super::gate::{Gate, GatedConnector};
use super::throttle::ThrottleConfig;
use crate::error::{Error, Result};
use crate::policy::ObjectOptions;

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
type Ini = HashMap<String, HashMap<String, String>>;

fn parse_ini(text: &str) -> Ini {
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
    let read = |p: Option<PathBuf>| -> Result<(Option<String>, Ini)> {
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
pub(super) struct Secrets(Vec<String>);

impl Secrets {
    fn add(&mut self, v: Option<String>) {
        if let Some(v) = v.filter(|v| v.len() >= 4) {
            self.0.push(v);
        }
    }
}

/// Removes credentials from an error text: known secret values, and the parts of S3 error
/// bodies that echo a request's signature material.
pub(super) fn sanitize(text: &str, secrets: &Secrets) -> String {
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

/// The throttle settings of a tier's options.
pub(super) fn throttle_config(o: &ObjectOptions) -> ThrottleConfig {
    ThrottleConfig {
        ramp_period: std::time::Duration::from_secs(o.ramp_period),
        give_up_after: std::time::Duration::from_secs(o.throttle_timeout),
    }
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
/// Where an s3 tier looked for credentials and found none, when the client's last resort is
/// the instance-metadata service: on a machine that is no cloud VM, that service's answer (a
/// 403, a timeout) would otherwise be the whole message.
#[derive(Debug, Clone)]
pub(super) struct NoCredentials {
    pub looked_in: String,
    /// The metadata service's base URL, as it appears in the client's errors.
    pub metadata: String,
}

impl NoCredentials {
    /// The message for a failed request whose error text is `text`, if the failure was the
    /// last-resort credential lookup.
    pub fn explain(&self, tier: &str, text: &str) -> Option<String> {
        text.contains(&self.metadata).then(|| {
            format!(
                "no credentials found for tier '{tier}' (looked in: {}; then the instance metadata service at {}, which \
                 failed: {text}): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile in ~/.aws/credentials",
                self.looked_in, self.metadata
            )
        })
    }
}

pub(super) fn s3_builder(
    url: &str,
    o: &ObjectOptions,
    env: &Env,
    gate: &Arc<Gate>,
) -> Result<(AmazonS3Builder, Secrets, Option<NoCredentials>)> {
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
        None if !set_by_env.contains(allow_http_key.as_ref())
            && b.get_config_value(&AmazonS3ConfigKey::Endpoint).is_some_and(|e| is_http(&e)) =>
        {
            b = b.with_config(allow_http_key, "true");
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
    b = b.with_http_connector(GatedConnector(gate.clone()));
    // A custom endpoint and no credentials anywhere: requests go unsigned, rather than to the
    // cloud's instance-metadata address (object_store's last resort), which only a VM in AWS
    // has. A server that wants signatures then answers 403, and the message says what to set.
    let has_credentials = b.get_config_value(&AmazonS3ConfigKey::AccessKeyId).is_some()
        || b.get_config_value(&AmazonS3ConfigKey::WebIdentityTokenFile).is_some()
        || b.get_config_value(&AmazonS3ConfigKey::ContainerCredentialsRelativeUri).is_some()
        || b.get_config_value(&AmazonS3ConfigKey::ContainerCredentialsFullUri).is_some();
    let custom_endpoint = b.get_config_value(&AmazonS3ConfigKey::Endpoint).is_some();
    if !has_credentials && custom_endpoint {
        b = b.with_config(AmazonS3ConfigKey::SkipSignature, "true");
    }
    let no_credentials = (!has_credentials && !custom_endpoint).then(|| {
        let profile = env.get("AWS_PROFILE").or_else(|| env.get("AWS_DEFAULT_PROFILE")).unwrap_or("default");
        let creds = env.get("AWS_SHARED_CREDENTIALS_FILE").unwrap_or("~/.aws/credentials");
        let config = env.get("AWS_CONFIG_FILE").unwrap_or("~/.aws/config");
        NoCredentials {
            looked_in: format!(
                "env AWS_ACCESS_KEY_ID, AWS_WEB_IDENTITY_TOKEN_FILE, AWS_CONTAINER_CREDENTIALS_*; {creds} and {config} \
                 (profile '{profile}'); the policy"
            ),
            metadata: b
                .get_config_value(&AmazonS3ConfigKey::MetadataEndpoint)
                .unwrap_or_else(|| "http://169.254.169.254".to_string())
                .trim_end_matches('/')
                .to_string(),
        }
    });
    Ok((b.with_url(url), secrets, no_credentials))
}

/// The GCS client builder for `url` with settings from files, environment and policy.
pub(super) fn gcs_builder(url: &str, o: &ObjectOptions, env: &Env, gate: &Arc<Gate>) -> Result<(GoogleCloudStorageBuilder, Secrets)> {
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
    Ok((b.with_http_connector(GatedConnector(gate.clone())).with_url(url), secrets))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn env(vars: &[(&str, &str)], home: Option<&std::path::Path>) -> Env {
        Env { vars: vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(), home: home.map(PathBuf::from) }
    }

    fn s3(vars: &[(&str, &str)], home: Option<&std::path::Path>, o: &ObjectOptions) -> AmazonS3Builder {
        s3_builder("s3://bkt/pre", o, &env(vars, home), &Gate::new("t", throttle_config(o))).unwrap().0
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
        let e = s3_builder("s3://bkt", &none, &env(&[("AWS_PROFILE", "nope")], h), &Gate::new("t", throttle_config(&none))).unwrap_err();
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
        let g = |vars: &[(&str, &str)], o: &ObjectOptions| {
            gcs_builder("gs://bkt/p", o, &env(vars, None), &Gate::new("t", throttle_config(o))).unwrap().0
        };
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
