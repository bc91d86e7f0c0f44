//! The keys of a peer tier (`kind = "peer"`): where it listens, how many copies it keeps,
//! how it places them, and the secret its connections prove.

use super::super::tier::{check_secret, PeerConfig, DEFAULT_PEER_LISTEN, DEFAULT_REPLICAS};
use super::{Checker, TierTable};
use crate::error::Result;

impl Checker<'_> {
    /// The keys of a peer tier.
    pub(super) fn peer(&self, t: &TierTable) -> Result<PeerConfig> {
        for key in ["root", "url"] {
            if let Some(n) = t.get(key) {
                return Err(self.at(
                    n,
                    &t.key_path(key),
                    format!(
                        "`{key}` is not valid for kind \"peer\": peer copies live under the memory tier's root; \
                         set `listen` for the address to serve them on"
                    ),
                ));
            }
        }
        let listen = match t.optional("listen") {
            Some((n, p)) => {
                let v = self.string(n, &p)?;
                if v.parse::<std::net::SocketAddr>().is_err() {
                    return Err(self.at(n, &p, format!("expected an address such as \"0.0.0.0:7070\", got {v:?}")));
                }
                v.to_string()
            }
            None => DEFAULT_PEER_LISTEN.to_string(),
        };
        let replicas = match t.optional("replicas") {
            Some((n, p)) => {
                let r = self.positive_int(n, &p)? as usize;
                if r < 2 {
                    return Err(self.at(n, &p, "a peer tier needs replicas >= 2 (this host's copy and at least one peer's)"));
                }
                r
            }
            None => DEFAULT_REPLICAS,
        };
        let placement = match t.optional("placement") {
            Some((n, p)) => {
                let v = self.string(n, &p)?;
                if !["mixed", "group", "ring"].contains(&v) {
                    return Err(self.at(n, &p, format!("expected \"mixed\", \"group\" or \"ring\", got {v:?}")));
                }
                v.to_string()
            }
            None => "mixed".to_string(),
        };
        let secret = match t.optional("secret") {
            Some((n, p)) => {
                let v = self.string(n, &p)?;
                check_secret(v.as_bytes(), "the policy's `secret`").map_err(|e| self.at(n, &p, e.message))?;
                Some(v.to_string())
            }
            None => None,
        };
        if let Some((n, p)) = t.optional("compression") {
            return Err(self.at(n, &p, "a peer tier stores raw chunks in memory; `compression` is not valid"));
        }
        Ok(PeerConfig { listen, replicas, placement, secret })
    }
}
