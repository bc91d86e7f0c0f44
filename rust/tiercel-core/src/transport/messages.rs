//! The requests of the peer protocol and their replies, as JSON in REQUEST and RESPONSE
//! frames. The first request on every connection is IDENT (who is calling, whom it meant to
//! reach); a PUT is followed by DATA frames and END; a READ is answered by one DATA frame.

use serde::{Deserialize, Serialize};

use crate::format::Manifest;

/// Who is at one end of a connection: the job, the host (failure domain) and the rank.
/// Exchanged right after authentication, so a connection that reached the wrong host, the
/// caller's own host or another job's server is refused before any data moves (a shared
/// secret alone cannot tell these apart: every process of a job knows it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ident {
    pub job: String,
    pub host: String,
    pub rank: u32,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The caller's identity and the host it meant to reach; answered with the server's.
    Ident { me: Ident, to_host: String },
    /// Take a replica of `rank`'s `step`: its manifest, then its chunks.
    Put { step: u64, rank: u32, manifest: Manifest },
    /// The steps of `rank` held here.
    List { rank: u32 },
    /// The manifest of `rank`'s replica of `step`.
    Manifest { step: u64, rank: u32 },
    /// `len` bytes at `offset` of one of the replica's objects.
    Read { step: u64, rank: u32, object: String, offset: u64, len: u64, crc32c: u32 },
}

#[derive(Debug, Serialize, Deserialize, Default)]
pub struct Reply {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manifest: Option<Manifest>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ident: Option<Ident>,
}
