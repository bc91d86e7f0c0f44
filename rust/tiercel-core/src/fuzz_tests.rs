//! Fuzzing on stable Rust: each target runs a seeded mutation loop for a fixed time
//! (`TIERCEL_FUZZ_SECS`, default 2 s; `make chaos` runs them longer), in every `cargo test`.
//! A target must return Ok or a tiercel error on any input: never panic, never hang, never
//! accept what breaks its own invariants. (cargo-fuzz needs a nightly toolchain; this needs
//! nothing, and a failure prints the seed and iteration to replay.)

use std::time::{Duration, Instant};

use crate::error::ErrorKind;
use crate::format::{self, ChunkMeta, CommitRecord, ItemMeta, Manifest, ObjectMeta};
use crate::policy::Policy;
use crate::transport::{decode_data_header, decode_header, HEADER_LEN};

/// xorshift64*: small, seedable, good enough to drive mutations.
pub struct Rng(u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn budget() -> Duration {
    let secs = std::env::var("TIERCEL_FUZZ_SECS").ok().and_then(|v| v.parse::<f64>().ok()).unwrap_or(2.0);
    Duration::from_secs_f64(secs.clamp(0.01, 86_400.0))
}

/// Runs `f(rng, iteration)` until the time budget is spent; returns the iterations run.
fn fuzz_for(name: &str, seed: u64, mut f: impl FnMut(&mut Rng, u64)) -> u64 {
    let (t0, budget) = (Instant::now(), budget());
    let mut rng = Rng(seed | 1);
    let mut i = 0u64;
    while t0.elapsed() < budget {
        f(&mut rng, i);
        i += 1;
    }
    eprintln!("fuzz {name}: {i} inputs in {:.1} s (seed {seed})", t0.elapsed().as_secs_f64());
    i
}

/// One random edit of `input`: bit flips, byte overwrites, an insertion or deletion of a
/// run of bytes, a truncation, or splicing in a "dangerous" token.
pub fn mutate(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    const TOKENS: &[&[u8]] = &[
        b"-1",
        b"18446744073709551616",
        b"1e308",
        b"null",
        b"[]",
        b"{}",
        b"\"\"",
        b"[[[[[[[[",
        b"\xff\xfe",
        b"\\u0000",
        b"NaN",
        b"0x10",
        b"=",
        b"\"",
        b"[[tier]]",
        b"9999999999999999999999",
    ];
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        match rng.below(6) {
            0 if !v.is_empty() => {
                let bit = rng.below(v.len() * 8);
                v[bit / 8] ^= 1 << (bit % 8);
            }
            1 if !v.is_empty() => {
                let at = rng.below(v.len());
                v[at] = rng.next() as u8;
            }
            2 => {
                let at = rng.below(v.len() + 1);
                let tok = TOKENS[rng.below(TOKENS.len())];
                v.splice(at..at, tok.iter().copied());
            }
            3 if !v.is_empty() => {
                let at = rng.below(v.len());
                let n = rng.below(16).min(v.len() - at);
                v.drain(at..at + n);
            }
            4 => v.truncate(rng.below(v.len() + 1)),
            _ => {
                // Duplicate a slice elsewhere (repeated keys, nested structures).
                if !v.is_empty() {
                    let a = rng.below(v.len());
                    let b = (a + rng.below(64)).min(v.len());
                    let piece = v[a..b].to_vec();
                    let at = rng.below(v.len() + 1);
                    v.splice(at..at, piece);
                }
            }
        }
    }
    v
}

fn sample_manifest() -> Manifest {
    let mut m = Manifest::new(7, 1, 2, "ram", 1024);
    let mut pos = 0;
    for (i, n) in [3000u64, 10, 0].into_iter().enumerate() {
        let chunks = format::chunk_ranges(n, 1024)
            .map(|(off, len)| ChunkMeta {
                offset: off,
                len,
                crc32c: 0x1234_5678 ^ off as u32,
                object: 0,
                stored_offset: pos + off,
                stored_len: len,
                codec: "raw".into(),
                hash: None,
            })
            .collect();
        m.items.push(ItemMeta {
            name: format!("model/{i}"),
            kind: "array".into(),
            dtype: "float32".into(),
            shape: vec![n / 4],
            nbytes: n,
            meta: serde_json::json!({"tree": {"k": [1, 2, {"x": null}]}}),
            shard: None,
            replica: None,
            chunks,
        });
        pos = format::align_up(pos + n, 64);
    }
    m.objects.push(ObjectMeta { name: format::part_name(1, 0), len: pos, key: None });
    m
}

/// A manifest that parses must still be self-consistent: every chunk inside its object.
#[test]
fn fuzz_manifest_parser() {
    let good = sample_manifest().to_json();
    Manifest::from_json(&good, "seed").expect("the seed manifest parses");
    let n = fuzz_for("manifest", 0x6d61_6e69, |rng, _| {
        let input = mutate(rng, &good);
        match Manifest::from_json(&input, "fuzz") {
            Ok(m) => {
                for it in &m.items {
                    for c in &it.chunks {
                        let obj = m.objects.get(c.object as usize).expect("a parsed manifest's chunk names an object");
                        assert!(c.stored_offset.checked_add(c.stored_len).is_some_and(|e| e <= obj.len), "chunk outside its object");
                    }
                }
            }
            Err(e) => assert_eq!(e.kind, ErrorKind::Integrity, "{}", e.message),
        }
    });
    assert!(n > 0);
}

#[test]
fn fuzz_commit_record_parser() {
    let good = serde_json::to_vec(&CommitRecord::new(12, 4, "disk")).unwrap();
    fuzz_for("commit record", 0x636f_6d6d, |rng, _| {
        if let Err(e) = CommitRecord::from_json(&mutate(rng, &good), "fuzz") {
            assert_eq!(e.kind, ErrorKind::Integrity, "{}", e.message);
        }
    });
}

/// The policy parser on mutated TOML and JSON: a policy or a Config error, never a panic.
#[test]
fn fuzz_policy_parser() {
    // The policy tests' example with a peer tier and store settings added (array-of-tables
    // entries may follow other tables in TOML).
    let seed = format!(
        "{}\n[[tier]]\nname = \"peer\"\nkind = \"peer\"\nlisten = \"0.0.0.0:0\"\nreplicas = 2\n\
         secret = \"0123456789abcdef0123\"\n\n[store]\nchunk_size = \"64MiB\"\nthreads = 4\n",
        crate::policy::tests::EXAMPLE
    );
    let toml = seed.as_bytes();
    Policy::from_toml(std::str::from_utf8(toml).unwrap(), "seed").expect("the seed policy parses");
    fuzz_for("policy", 0x706f_6c69, |rng, i| {
        let input = mutate(rng, toml);
        let Ok(text) = std::str::from_utf8(&input) else { return };
        let r = if i % 2 == 0 { Policy::from_toml(text, "fuzz.toml") } else { Policy::from_json(text, "<fuzz>") };
        if let Err(e) = r {
            assert_eq!(e.kind, ErrorKind::Config, "{}", e.message);
        }
    });
}

/// Frame and data headers from random and mutated bytes (the wire's first line of defence).
#[test]
fn fuzz_frame_decoder() {
    let valid = crate::transport::encode_header(crate::transport::Kind::Request, 100);
    fuzz_for("frame", 0x6672_616d, |rng, i| {
        let bytes: Vec<u8> = if i % 2 == 0 { (0..HEADER_LEN).map(|_| rng.next() as u8).collect() } else { mutate(rng, &valid) };
        if bytes.len() >= HEADER_LEN {
            let h: [u8; HEADER_LEN] = bytes[..HEADER_LEN].try_into().unwrap();
            if let Ok(hd) = decode_header(&h) {
                assert!(hd.len <= hd.kind.max_len());
            }
            let _ = decode_data_header(&h);
        }
    });
}
