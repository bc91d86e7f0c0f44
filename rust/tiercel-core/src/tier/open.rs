//! From a policy's tiers to `Tier`s: the one place that knows which kind is built how.

use std::sync::Arc;
use std::time::Duration;

use super::blob::BlobTier;
use super::memory::MemoryTier;
use super::peer::{PeerOptions, PeerTier};
use super::Tier;
use crate::blobs::FsBlobs;
use crate::error::{Error, Result};
use crate::object::ObjectBlobs;
use crate::placement::Strategy;
use crate::policy::{PeerConfig, Policy, Role, TierConfig, TierSpec};

/// How long a peer waits for a connection, a request or its answer.
const PEER_TIMEOUT: Duration = Duration::from_secs(30);

/// The tiers of one policy, opened for one rank, in policy order.
pub struct Tiers {
    /// Every tier, in policy order.
    pub all: Vec<Arc<dyn Tier>>,
    /// The tier that plays `Role::Memory`, typed: a save writes into its segments directly.
    pub memory: Arc<MemoryTier>,
    /// Its place in `all` (policy validation puts it first).
    pub memory_at: usize,
    /// The peer tier, if any, which needs to learn where the other ranks are.
    pub peer: Option<Arc<PeerTier>>,
    /// The object-store tiers' clients, in policy order: their buckets are checked by
    /// `Store::check_open` (on one rank of a job with a coordinator, on every rank of one
    /// without), not here.
    pub buckets: Vec<Arc<ObjectBlobs>>,
}

/// Opens every tier of `policy` for `rank`, sending no request. A peer tier keeps the
/// replicas it holds for other hosts under the memory tier's root.
pub fn open_tiers(policy: &Policy, rank: u32) -> Result<Tiers> {
    let Some((memory_at, mem_cfg)) = policy.tier_in(Role::Memory) else {
        return Err(Error::config(format!("{}: the first tier must be kind \"memory\"", policy.source)));
    };
    let TierSpec::Memory { root } = &mem_cfg.spec else {
        return Err(Error::config(format!("{}: tier '{}' must be kind \"memory\"", policy.source, mem_cfg.name)));
    };
    // Opened first: a peer tier keeps its replicas under the memory tier's root.
    let memory = MemoryTier::open(&mem_cfg.name, root.as_ref(), mem_cfg.capacity).map_err(|e| opening(mem_cfg, e))?;
    let mut all: Vec<Arc<dyn Tier>> = Vec::with_capacity(policy.tiers.len());
    let mut peer = None;
    let mut buckets = vec![];
    for (i, cfg) in policy.tiers.iter().enumerate() {
        all.push(match &cfg.spec {
            _ if i == memory_at => memory.clone(),
            TierSpec::Peer(p) => {
                let t = open_peer(cfg, p, rank, &memory)?;
                peer = Some(t.clone());
                t
            }
            _ => {
                let (tier, bucket) = open_unchecked(cfg)?;
                buckets.extend(bucket);
                tier
            }
        });
    }
    Ok(Tiers { all, memory, memory_at, peer, buckets })
}

/// Opens one tier that needs nothing but its own settings (every kind but peer, which needs
/// the rank and the memory tier: see `open_tiers`).
/// An object store's bucket is checked (`ObjectBlobs::check_bucket`).
pub fn open_tier(cfg: &TierConfig) -> Result<Arc<dyn Tier>> {
    let (tier, bucket) = open_unchecked(cfg)?;
    if let Some(b) = bucket {
        b.check_bucket()?;
    }
    Ok(tier)
}

/// A tier, and its object store's client to check the bucket with (object stores only).
type Unchecked = (Arc<dyn Tier>, Option<Arc<ObjectBlobs>>);

/// `open_tier` without the bucket check, which needs a request.
fn open_unchecked(cfg: &TierConfig) -> Result<Unchecked> {
    let at = |e: Error| opening(cfg, e);
    Ok((
        match &cfg.spec {
            TierSpec::Memory { root } => MemoryTier::open(&cfg.name, root.as_ref(), cfg.capacity).map_err(at)?,
            TierSpec::Fs { path } => {
                let blobs = FsBlobs::new(&cfg.name, path.as_ref()).map_err(at)?;
                Arc::new(BlobTier::with_dedup(&cfg.name, Arc::new(blobs), cfg.compression, cfg.dedup))
            }
            spec @ (TierSpec::S3(_) | TierSpec::Gcs(_)) => {
                let blobs = Arc::new(ObjectBlobs::open(&cfg.name, spec).map_err(at)?);
                let tier = Arc::new(BlobTier::with_dedup(&cfg.name, blobs.clone(), cfg.compression, cfg.dedup));
                return Ok((tier, Some(blobs)));
            }
            TierSpec::Python(spec) => {
                let blobs = super::external::open(&cfg.name, spec).map_err(at)?;
                Arc::new(BlobTier::with_dedup(&cfg.name, blobs, cfg.compression, cfg.dedup))
            }
            TierSpec::Peer(_) => {
                return Err(Error::invalid(format!("tier '{}': a peer tier is opened by its Store (it needs the rank)", cfg.name)))
            }
        },
        None,
    ))
}

fn opening(cfg: &TierConfig, e: Error) -> Error {
    e.context(format!("opening tier '{}' ({})", cfg.name, cfg.location()))
}

/// The peer tier's progress deadline: $TIERCEL_PEER_TIMEOUT (seconds), else 30 s.
fn peer_timeout() -> Result<Duration> {
    match std::env::var("TIERCEL_PEER_TIMEOUT") {
        Err(_) => Ok(PEER_TIMEOUT),
        Ok(v) => match v.trim().parse::<f64>() {
            Ok(s) if s.is_finite() && (0.1..=3600.0).contains(&s) => Ok(Duration::from_secs_f64(s)),
            _ => Err(Error::config(format!("$TIERCEL_PEER_TIMEOUT = {v:?}: expected seconds between 0.1 and 3600"))),
        },
    }
}

/// Opens a peer tier for `rank`: its replica store lives under the memory tier's root.
fn open_peer(cfg: &TierConfig, p: &PeerConfig, rank: u32, memory: &Arc<MemoryTier>) -> Result<Arc<PeerTier>> {
    // An empty or short secret is refused wherever it comes from (the policy checks its own
    // key when it is parsed; the environment is checked here).
    let secret = match (&p.secret, std::env::var_os("TIERCEL_PEER_SECRET")) {
        (Some(s), _) => Some(s.clone().into_bytes()),
        (None, Some(v)) => {
            let v = v.into_encoded_bytes();
            crate::policy::check_secret(&v, "$TIERCEL_PEER_SECRET").map_err(|e| opening(cfg, e))?;
            Some(v)
        }
        (None, None) => None,
    };
    let opts = PeerOptions {
        listen: p.listen.clone(),
        replicas: p.replicas,
        strategy: Strategy::parse(&p.placement)?,
        keep: cfg.keep.unwrap_or(2),
        secret,
        timeout: peer_timeout().map_err(|e| opening(cfg, e))?,
        limits: Default::default(),
    };
    let peer = PeerTier::open(&cfg.name, rank, memory.root(), opts).map_err(|e| e.context(format!("opening tier '{}'", cfg.name)))?;
    peer.serve_own(memory.clone());
    Ok(peer)
}
