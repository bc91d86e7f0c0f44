//! Chunk codecs: zstd, optionally after regrouping the bytes of floating-point values by
//! significance ("bytegroup"). Exponent and high mantissa bytes of neighbouring weights are
//! alike, the low mantissa bytes are near random; grouping them lets zstd find the former.
//!
//! Codec names as stored in manifests: "raw", "zstd", "bytegroupN+zstd" (N = bytes per value).

use crate::error::{Error, Result};
use crate::policy::{Codec, Compression};

pub const RAW: &str = "raw";

/// Encodes one chunk. `value_size` is the item's element size when its dtype is a float (the
/// only case where bytegroup helps). A chunk that does not shrink is stored raw, so a reader
/// never pays for decompressing incompressible data.
pub fn encode(raw: Vec<u8>, c: Compression, value_size: Option<usize>) -> (String, Vec<u8>) {
    let Codec::Zstd { level } = c.codec else {
        return (RAW.into(), raw);
    };
    let group = match value_size {
        Some(n) if c.bytegroup && n > 1 && raw.len().is_multiple_of(n) => Some(n),
        _ => None,
    };
    let grouped;
    let input = match group {
        Some(n) => {
            grouped = bytegroup(&raw, n);
            &grouped[..]
        }
        None => &raw[..],
    };
    match zstd::bulk::compress(input, level) {
        Ok(z) if z.len() < raw.len() => {
            let name = match group {
                Some(n) => format!("bytegroup{n}+zstd"),
                None => "zstd".into(),
            };
            (name, z)
        }
        _ => (RAW.into(), raw),
    }
}

/// Decodes a stored chunk into `dst` (exactly the raw length). Any mismatch is an integrity
/// error; the caller adds tier/step/rank/item to the message.
pub fn decode(codec: &str, stored: &[u8], dst: &mut [u8]) -> Result<()> {
    if codec == RAW {
        if stored.len() != dst.len() {
            return Err(Error::integrity(format!("raw chunk has {} bytes, expected {}", stored.len(), dst.len())));
        }
        dst.copy_from_slice(stored);
        return Ok(());
    }
    let group = match codec {
        "zstd" => None,
        other => {
            let n = other
                .strip_prefix("bytegroup")
                .and_then(|r| r.strip_suffix("+zstd"))
                .and_then(|n| n.parse::<usize>().ok())
                .filter(|n| *n > 1 && dst.len().is_multiple_of(*n))
                .ok_or_else(|| Error::integrity(format!("unknown codec '{other}'")))?;
            Some(n)
        }
    };
    let bad = |e: String| Error::integrity(format!("{codec} chunk does not decode: {e}"));
    match group {
        None => {
            let n = zstd::bulk::decompress_to_buffer(stored, dst).map_err(|e| bad(e.to_string()))?;
            if n != dst.len() {
                return Err(bad(format!("{n} bytes, expected {}", dst.len())));
            }
        }
        Some(g) => {
            let tmp = zstd::bulk::decompress(stored, dst.len()).map_err(|e| bad(e.to_string()))?;
            if tmp.len() != dst.len() {
                return Err(bad(format!("{} bytes, expected {}", tmp.len(), dst.len())));
            }
            unbytegroup(&tmp, g, dst);
        }
    }
    Ok(())
}

/// [a0 a1 a2 a3 b0 b1 b2 b3 ...] -> [a0 b0 ... a1 b1 ... a2 b2 ... a3 b3 ...]
fn bytegroup(raw: &[u8], n: usize) -> Vec<u8> {
    let count = raw.len() / n;
    let mut out = vec![0u8; raw.len()];
    for (i, value) in raw.chunks_exact(n).enumerate() {
        for (b, byte) in value.iter().enumerate() {
            out[b * count + i] = *byte;
        }
    }
    out
}

fn unbytegroup(grouped: &[u8], n: usize, dst: &mut [u8]) {
    let count = grouped.len() / n;
    for (i, value) in dst.chunks_exact_mut(n).enumerate() {
        for (b, byte) in value.iter_mut().enumerate() {
            *byte = grouped[b * count + i];
        }
    }
}

/// Element size when bytegroup applies to this dtype (floating-point and complex types).
pub fn float_value_size(dtype: &str) -> Option<usize> {
    match dtype {
        "float16" | "bfloat16" => Some(2),
        "float32" | "complex64" => Some(4),
        "float64" | "complex128" => Some(8),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn z(level: i32, bytegroup: bool) -> Compression {
        Compression { codec: Codec::Zstd { level }, bytegroup }
    }

    #[test]
    fn round_trips() {
        let floats: Vec<u8> = (0..4096).flat_map(|i| (i as f32 * 0.001).sin().to_le_bytes()).collect();
        for c in [Compression::none(), z(3, false), z(3, true), z(-1, true)] {
            let (name, stored) = encode(floats.clone(), c, Some(4));
            let mut back = vec![0u8; floats.len()];
            decode(&name, &stored, &mut back).unwrap();
            assert_eq!(back, floats, "codec {name}");
        }
        let (name, _) = encode(floats.clone(), z(3, true), Some(4));
        assert_eq!(name, "bytegroup4+zstd");
    }

    #[test]
    fn incompressible_is_stored_raw() {
        let mut x = 0x12345678u32;
        let noise: Vec<u8> = (0..65536)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                x as u8
            })
            .collect();
        assert_eq!(encode(noise, z(3, false), None).0, RAW);
    }

    #[test]
    fn corrupt_input_is_an_integrity_error() {
        let data = vec![7u8; 10000];
        let (name, mut stored) = encode(data.clone(), z(3, false), None);
        let mid = stored.len() / 2;
        stored[mid] ^= 0xff;
        stored.truncate(stored.len() - 1);
        let mut back = vec![0u8; data.len()];
        let e = decode(&name, &stored, &mut back).unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Integrity);
        assert!(decode("lz9", &stored, &mut back).unwrap_err().message.contains("unknown codec"));
    }
}
