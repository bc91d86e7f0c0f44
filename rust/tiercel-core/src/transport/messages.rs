//! The requests of the peer protocol and their replies, as JSON in REQUEST and RESPONSE
//! frames. A PUT is followed by DATA frames and END; a READ is answered by one DATA frame.

use serde::{Deserialize, Serialize};

use crate::format::Manifest;

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
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
}
