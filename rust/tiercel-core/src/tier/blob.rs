//! A tier over any `Blobs` store (a filesystem directory today; object stores next): each
//! rank's step is one data object of encoded chunks plus its manifest.

use std::sync::Arc;

use crate::blobs::Blobs;
use crate::error::Result;
use crate::format::{self, ChunkMeta, Manifest};
use crate::policy::Compression;
use crate::scheduler::Link;
use crate::tier::{encode_rank, ChunkSource, Tier};

pub struct BlobTier {
    name: String,
    kind: &'static str,
    blobs: Arc<dyn Blobs>,
    compression: Compression,
}

impl BlobTier {
    pub fn new(name: &str, kind: &'static str, blobs: Arc<dyn Blobs>, compression: Compression) -> BlobTier {
        BlobTier { name: name.into(), kind, blobs, compression }
    }
}

impl Tier for BlobTier {
    fn name(&self) -> &str {
        &self.name
    }

    fn kind(&self) -> &'static str {
        self.kind
    }

    fn blobs(&self) -> &dyn Blobs {
        &*self.blobs
    }

    fn write_rank(&self, logical: &Manifest, src: &dyn ChunkSource, link: &Link) -> Result<Manifest> {
        let dir = format::step_dir(logical.step);
        let object = format::data_name(logical.rank);
        // Writing a step again: uncommit it and drop this rank's old manifest first, so no
        // reader mixes old and new data and no stale manifest counts towards a commit.
        self.blobs.delete(&format!("{dir}/{}", format::COMMIT_NAME))?;
        self.blobs.delete(&format!("{dir}/{}", format::manifest_name(logical.rank)))?;
        let mut w = self.blobs.create(&format!("{dir}/{object}"))?;
        let res = encode_rank(&self.name, logical, src, self.compression, &object, link, &mut |b| w.write(b));
        let manifest = match res {
            Ok(m) => m,
            Err(e) => {
                w.abort();
                return Err(e);
            }
        };
        w.finish()?;
        self.blobs.put(&format!("{dir}/{}", format::manifest_name(logical.rank)), &manifest.to_json())?;
        Ok(manifest)
    }

    fn read_stored(&self, m: &Manifest, c: &ChunkMeta, dst: &mut [u8]) -> Result<()> {
        let key = format!("{}/{}", format::step_dir(m.step), m.objects[c.object as usize].name);
        self.blobs.get_range(&key, c.stored_offset, dst)
    }
}
