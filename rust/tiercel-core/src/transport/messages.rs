//! The requests of the peer protocol and their replies, as JSON in REQUEST and RESPONSE
//! frames. The first request on every connection is IDENT (who is calling, whom it meant to
//! reach); a PUT is answered with the chunks the holder lacks, then followed by DATA frames
//! (of those chunks) and END; a READ is answered by one DATA frame.

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
    /// Take a replica of `rank`'s `step`: its manifest, then its chunks. With `reuse`, the
    /// holder first fills every chunk it holds already (by `ChunkMeta::hash`, from a replica
    /// of `rank` it keeps, checked against the chunk's CRC32C) and answers with the chunks it
    /// lacks (`Reply::lacking`): only those follow. Without it (or from a holder that does not
    /// answer `lacking`), every chunk follows.
    Put {
        step: u64,
        rank: u32,
        manifest: Manifest,
        #[serde(default)]
        reuse: bool,
    },
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
    /// The answer to a PUT with `reuse`: the chunks the holder lacks, by index in manifest
    /// order (items, then each item's chunks); the sender sends these and no others.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lacking: Option<Vec<u64>>,
}
