//! Chunk codecs: zstd, optionally after regrouping the bytes of floating-point values by
//! significance ("bytegroup"). Exponent and high mantissa bytes of neighbouring weights are
//! alike, the low mantissa bytes are near random; grouping them lets zstd find the former.
//!
//! Codec names as stored in manifests: "raw", "zstd", "bytegroupN+zstd" (N = bytes per value).
//! `compression` is how a tier asks for them (a policy's `compression` string).

mod compression;
mod transpose;

use std::cell::RefCell;

pub use compression::{Codec, Compression, DEFAULT_ZSTD_LEVEL};

use crate::error::{Error, Result};

pub const RAW: &str = "raw";

/// Per-thread state reused from chunk to chunk: zstd's contexts (creating one allocates and
/// clears several MiB of tables: per 4 MiB chunk that was a noticeable share of the time)
/// and the buffer a chunk's byte planes pass through.
#[derive(Default)]
struct Scratch {
    /// By (level, bytegroup): byte planes are compressed with parameters of their own.
    compressor: Option<((i32, bool), zstd::bulk::Compressor<'static>)>,
    decompressor: Option<zstd::bulk::Decompressor<'static>>,
    planes: Vec<u8>,
}

/// zstd's parameters for byte planes at the fast levels (1-3), over its defaults for the
/// level: a 16 KiB hash table (stays in the L1 cache), a 128 KiB window and matches of 7
/// bytes or more. A plane of exponent or mantissa bytes gains from entropy coding and long
/// runs, hardly from short matches far back. Measured on one core, 4 MiB float32 chunks
/// (`codec_speed`): level 1 encodes ~20% faster and level 3 ~40% faster, each at a slightly
/// better ratio. Higher levels keep zstd's own choice: whoever picks them wants the ratio.
///
/// Level 1 (and the negative levels, which ask for more speed still) goes further: zstd's
/// fastest match finder, which skips ahead faster the longer it finds nothing
/// (`TargetLength` 16), with the literals still Huffman-coded (zstd turns that off for such
/// settings unless told). On an exponent plane, whose bytes rarely repeat in
/// runs, the match search was most of the time: measured on one core, the exponent plane of
/// a 4 MiB bfloat16 chunk (weights ~N(0, 0.05)) encodes at 0.9-1.0 GB/s instead of 0.4, at a
/// ratio of 2.90 instead of 2.83, and decodes twice as fast. A plane that is 90% zeros keeps
/// a ratio of 6.8 instead of 7.3; level 3 keeps the search for such data.
fn plane_parameters(level: i32) -> &'static [zstd::zstd_safe::CParameter] {
    use zstd::zstd_safe::CParameter::{HashLog, LiteralCompressionMode, MinMatch, Strategy, TargetLength, WindowLog};
    use zstd::zstd_safe::{ParamSwitch, Strategy as S};
    const FAST: [zstd::zstd_safe::CParameter; 3] = [HashLog(12), WindowLog(17), MinMatch(7)];
    const FASTEST: [zstd::zstd_safe::CParameter; 6] =
        [HashLog(12), WindowLog(17), MinMatch(7), Strategy(S::ZSTD_fast), TargetLength(16), LiteralCompressionMode(ParamSwitch::Enable)];
    match level {
        ..=1 => &FASTEST,
        2..=3 => &FAST,
        _ => &[],
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `buf` at exactly `len` bytes (its old contents are overwritten by the caller, so only
/// growth clears memory).
fn sized(buf: &mut Vec<u8>, len: usize) -> &mut [u8] {
    buf.resize(len, 0);
    &mut buf[..]
}

/// Encodes one chunk: `Some((codec name, stored bytes))`, or None when the chunk is to be
/// stored raw (the caller writes the bytes it already has). `value_size` is the item's
/// element size when its dtype is a float (the only case where bytegroup helps). A chunk
/// that does not shrink is stored raw, so a reader never pays for decompressing
/// incompressible data.
pub fn encode(raw: &[u8], c: Compression, value_size: Option<usize>) -> Option<(String, Vec<u8>)> {
    let Codec::Zstd { level } = c.codec else {
        return None;
    };
    let group = match value_size {
        Some(n) if c.bytegroup && n > 1 && raw.len().is_multiple_of(n) => Some(n),
        _ => None,
    };
    SCRATCH.with_borrow_mut(|s| {
        let Scratch { compressor, planes, .. } = s;
        let key = (level, group.is_some());
        if compressor.as_ref().is_none_or(|(k, _)| *k != key) {
            let mut zc = zstd::bulk::Compressor::new(level).ok()?;
            for p in if key.1 { plane_parameters(level) } else { &[] } {
                zc.set_parameter(*p).ok()?;
            }
            *compressor = Some((key, zc));
        }
        let input: &[u8] = match group {
            Some(n) => {
                let planes = sized(planes, raw.len());
                transpose::group(raw, n, planes);
                planes
            }
            None => raw,
        };
        // Room for less than the raw length only: output that would not fit is output that
        // would not shrink, and zstd gives up on it early instead of finishing it.
        let mut z = Vec::with_capacity(raw.len().saturating_sub(1));
        let (_, zc) = compressor.as_mut().expect("set above");
        zc.compress_to_buffer(input, &mut z).ok()?;
        let name = match group {
            Some(n) => format!("bytegroup{n}+zstd"),
            None => "zstd".into(),
        };
        Some((name, z))
    })
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
    SCRATCH.with_borrow_mut(|s| {
        let Scratch { decompressor, planes, .. } = s;
        if decompressor.is_none() {
            *decompressor = Some(zstd::bulk::Decompressor::new().map_err(|e| bad(e.to_string()))?);
        }
        let dz = decompressor.as_mut().expect("set above");
        let len = dst.len();
        let out = match group {
            Some(_) => sized(planes, len),
            None => &mut *dst,
        };
        let n = dz.decompress_to_buffer(stored, out).map_err(|e| bad(e.to_string()))?;
        if n != len {
            return Err(bad(format!("{n} bytes, expected {len}")));
        }
        if let Some(g) = group {
            transpose::ungroup(&planes[..len], g, dst);
        }
        Ok(())
    })
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

    /// Encodes like a blob tier does: a chunk that is not encoded is stored raw.
    fn stored(raw: &[u8], c: Compression, value_size: Option<usize>) -> (String, Vec<u8>) {
        encode(raw, c, value_size).unwrap_or_else(|| (RAW.into(), raw.to_vec()))
    }

    #[test]
    fn round_trips() {
        let floats: Vec<u8> = (0..4096).flat_map(|i| (i as f32 * 0.001).sin().to_le_bytes()).collect();
        for c in [Compression::none(), z(3, false), z(3, true), z(-1, true), z(9, true), z(3, true)] {
            let (name, stored) = stored(&floats, c, Some(4));
            let mut back = vec![0u8; floats.len()];
            decode(&name, &stored, &mut back).unwrap();
            assert_eq!(back, floats, "codec {name}");
        }
        assert_eq!(stored(&floats, z(3, true), Some(4)).0, "bytegroup4+zstd");
        assert_eq!(stored(&floats, Compression::none(), Some(4)).0, RAW);
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
        assert!(encode(&noise, z(3, false), None).is_none());
        assert!(encode(&noise, z(3, true), Some(4)).is_none());
    }

    #[test]
    fn corrupt_input_is_an_integrity_error() {
        let data = vec![7u8; 10000];
        let (name, mut stored) = stored(&data, z(3, false), None);
        let mid = stored.len() / 2;
        stored[mid] ^= 0xff;
        stored.truncate(stored.len() - 1);
        let mut back = vec![0u8; data.len()];
        let e = decode(&name, &stored, &mut back).unwrap_err();
        assert_eq!(e.kind, crate::error::ErrorKind::Integrity);
        assert!(decode("lz9", &stored, &mut back).unwrap_err().message.contains("unknown codec"));
        // A bytegroup chunk that decodes to the wrong length is refused too.
        let floats: Vec<u8> = (0..4096).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let (name, stored) = stored_of(&floats);
        let mut short = vec![0u8; floats.len() - 4];
        assert_eq!(decode(&name, &stored, &mut short).unwrap_err().kind, crate::error::ErrorKind::Integrity);
    }

    fn stored_of(floats: &[u8]) -> (String, Vec<u8>) {
        stored(floats, z(3, true), Some(4))
    }

    /// The data the legacy fixtures hold: 4099 values (a partial block at the end) of a
    /// smooth signal with noise in the low bits, as 2-, 4- and 8-byte floats.
    fn legacy_data(n: usize) -> Vec<u8> {
        (0..4099u32)
            .flat_map(|i| {
                let v = ((i as f64) * 0.013).sin() * 0.02 + ((i.wrapping_mul(2654435761) >> 7) as f64) * 1e-12;
                match n {
                    2 => ((v as f32).to_bits() >> 16).to_le_bytes()[..2].to_vec(),
                    4 => (v as f32).to_le_bytes().to_vec(),
                    _ => v.to_le_bytes().to_vec(),
                }
            })
            .collect()
    }

    /// Chunks written by the first release's byte-at-a-time bytegroup (the fixtures in
    /// `testdata/`, encoded at zstd level 3 before the blocked transpose replaced it) still
    /// decode bit for bit, and today's encoder produces the same byte planes.
    #[test]
    fn legacy_bytegroup_chunks_still_decode() {
        let fixtures: [(usize, &[u8]); 3] = [
            (2, include_bytes!("testdata/bytegroup2-legacy.zst")),
            (4, include_bytes!("testdata/bytegroup4-legacy.zst")),
            (8, include_bytes!("testdata/bytegroup8-legacy.zst")),
        ];
        for (n, old) in fixtures {
            let raw = legacy_data(n);
            let mut back = vec![0u8; raw.len()];
            decode(&format!("bytegroup{n}+zstd"), old, &mut back).unwrap();
            assert_eq!(back, raw, "legacy bytegroup{n}+zstd chunk");
            let (name, new) = stored(&raw, z(3, true), Some(n));
            assert_eq!(name, format!("bytegroup{n}+zstd"));
            let planes = |b: &[u8]| zstd::bulk::decompress(b, raw.len()).unwrap();
            assert_eq!(planes(&new), planes(old), "bytegroup{n}: the stored layout changed");
        }
    }

    /// Encode and decode speed on one core, run by hand on a quiet machine:
    /// `cargo test --release -p tiercel-core --lib codec_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn codec_speed() {
        // Normal-ish float32 weights (sum of uniforms), 4 MiB like a default chunk.
        let mut x = 0x9e3779b9u32;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as f32 / u32::MAX as f32
        };
        let values: Vec<f32> = (0..1 << 20).map(|_| (next() + next() + next() - 1.5) * 0.05).collect();
        let f32_raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        // bfloat16: the high half of each float32, two values per float (4 MiB too).
        let bf16_raw: Vec<u8> = values.iter().chain(&values).flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect();
        let codecs = [("zstd:1", z(1, false)), ("zstd:3", z(3, false)), ("bytegroup+zstd:1", z(1, true)), ("bytegroup+zstd:3", z(3, true))];
        for ((dtype, raw, size), (label, c)) in
            [("float32", &f32_raw, 4), ("bfloat16", &bf16_raw, 2)].into_iter().flat_map(|d| codecs.iter().map(move |c| (d, *c)))
        {
            let rounds = 10;
            let t0 = std::time::Instant::now();
            let mut last = None;
            for _ in 0..rounds {
                last = Some(stored(raw, c, Some(size)));
            }
            let enc = t0.elapsed().as_secs_f64();
            let (name, st) = last.unwrap();
            let mut back = vec![0u8; raw.len()];
            let t0 = std::time::Instant::now();
            for _ in 0..rounds {
                decode(&name, &st, &mut back).unwrap();
            }
            let dec = t0.elapsed().as_secs_f64();
            let gb = (rounds * raw.len()) as f64 / 1e9;
            println!(
                "{dtype} {label}: ratio {:.3}, encode {:.2} GB/s, decode {:.2} GB/s",
                raw.len() as f64 / st.len() as f64,
                gb / enc,
                gb / dec
            );
        }
    }
}
