//! bytegroup's byte transposes: `group` turns values [a0 a1 a2 a3][b0 b1 b2 b3]... into the
//! planes [a0 b0 ...][a1 b1 ...][a2 b2 ...][a3 b3 ...], `ungroup` turns them back. The
//! layout is the one format.md describes; only the speed differs from the obvious loop.
//!
//! Values are moved in blocks of `BLOCK`: a block's bytes are gathered into one small
//! array per plane (constant sizes and indices, so no bounds checks and the compiler turns
//! the gathers into vector shuffles), then each plane's run is copied out in one piece. A
//! byte-at-a-time loop over the whole chunk instead writes to `n` places far apart for every
//! value and ran at about a quarter of zstd's speed. For the common sizes (2, 4, 8 bytes)
//! the same code is also compiled for AVX2 and picked at run time where the CPU has it.

/// Values per block: 32 values are 64..256 bytes in, `n` runs of 32 bytes out.
const BLOCK: usize = 32;

/// Calls the AVX2 build of a kernel where the CPU has AVX2, the baseline build otherwise.
macro_rules! dispatch {
    ($f:ident :: <$n:literal> ($a:expr, $b:expr)) => {{
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                #[target_feature(enable = "avx2")]
                unsafe fn wide(a: &[u8], b: &mut [u8]) {
                    $f::<$n>(a, b)
                }
                // SAFETY: the CPU has AVX2 (checked just above); the kernel is safe code.
                return unsafe { wide($a, $b) };
            }
        }
        $f::<$n>($a, $b)
    }};
}

/// Writes the planes of `raw` (values of `n` bytes) into `out` (the same length).
pub fn group(raw: &[u8], n: usize, out: &mut [u8]) {
    assert!(n > 0 && raw.len().is_multiple_of(n) && out.len() == raw.len(), "bytegroup: bad lengths");
    match n {
        2 => dispatch!(group_n::<2>(raw, out)),
        4 => dispatch!(group_n::<4>(raw, out)),
        8 => dispatch!(group_n::<8>(raw, out)),
        _ => group_any(raw, n, out),
    }
}

/// Writes the values whose planes are `planes` (values of `n` bytes) into `out`.
pub fn ungroup(planes: &[u8], n: usize, out: &mut [u8]) {
    assert!(n > 0 && planes.len().is_multiple_of(n) && out.len() == planes.len(), "bytegroup: bad lengths");
    match n {
        2 => dispatch!(ungroup_n::<2>(planes, out)),
        4 => dispatch!(ungroup_n::<4>(planes, out)),
        8 => dispatch!(ungroup_n::<8>(planes, out)),
        _ => ungroup_any(planes, n, out),
    }
}

#[inline(always)]
fn group_n<const N: usize>(raw: &[u8], out: &mut [u8]) {
    let count = raw.len() / N;
    let (values, _) = raw.as_chunks::<N>();
    let mut blocks = values.chunks_exact(BLOCK);
    let mut at = 0;
    for block in &mut blocks {
        let block: &[[u8; N]; BLOCK] = block.try_into().expect("exact block");
        let mut planes = [[0u8; BLOCK]; N];
        for (i, value) in block.iter().enumerate() {
            for (b, byte) in value.iter().enumerate() {
                planes[b][i] = *byte;
            }
        }
        for (b, plane) in planes.iter().enumerate() {
            out[b * count + at..][..BLOCK].copy_from_slice(plane);
        }
        at += BLOCK;
    }
    for (i, value) in blocks.remainder().iter().enumerate() {
        for (b, byte) in value.iter().enumerate() {
            out[b * count + at + i] = *byte;
        }
    }
}

#[inline(always)]
fn ungroup_n<const N: usize>(planes: &[u8], out: &mut [u8]) {
    let count = planes.len() / N;
    let (values, _) = out.as_chunks_mut::<N>();
    let mut blocks = values.chunks_exact_mut(BLOCK);
    let mut at = 0;
    for block in &mut blocks {
        let block: &mut [[u8; N]; BLOCK] = block.try_into().expect("exact block");
        let mut runs = [[0u8; BLOCK]; N];
        for (b, run) in runs.iter_mut().enumerate() {
            run.copy_from_slice(&planes[b * count + at..][..BLOCK]);
        }
        for (i, value) in block.iter_mut().enumerate() {
            for (b, byte) in value.iter_mut().enumerate() {
                *byte = runs[b][i];
            }
        }
        at += BLOCK;
    }
    for (i, value) in blocks.into_remainder().iter_mut().enumerate() {
        for (b, byte) in value.iter_mut().enumerate() {
            *byte = planes[b * count + at + i];
        }
    }
}

/// Any other value size (no dtype tiercel knows has one; kept for completeness).
fn group_any(raw: &[u8], n: usize, out: &mut [u8]) {
    let count = raw.len() / n;
    for (i, value) in raw.chunks_exact(n).enumerate() {
        for (b, byte) in value.iter().enumerate() {
            out[b * count + i] = *byte;
        }
    }
}

fn ungroup_any(planes: &[u8], n: usize, out: &mut [u8]) {
    let count = planes.len() / n;
    for (i, value) in out.chunks_exact_mut(n).enumerate() {
        for (b, byte) in value.iter_mut().enumerate() {
            *byte = planes[b * count + i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(len: usize) -> Vec<u8> {
        (0..len as u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect()
    }

    /// Every fast kernel against the plain loop, for lengths with and without a partial
    /// block, and back again.
    #[test]
    fn matches_the_plain_loop_and_inverts() {
        for n in [2usize, 3, 4, 8] {
            for values in [0usize, 1, 31, 32, 33, 64, 1000, 4099] {
                let raw = bytes(values * n);
                let mut want = vec![0u8; raw.len()];
                group_any(&raw, n, &mut want);
                let mut got = vec![0u8; raw.len()];
                group(&raw, n, &mut got);
                assert_eq!(got, want, "group n={n} values={values}");
                let mut back = vec![0u8; raw.len()];
                ungroup(&got, n, &mut back);
                assert_eq!(back, raw, "ungroup n={n} values={values}");
            }
        }
    }

    /// Encode speed guard, run by hand: `cargo test --release -p tiercel-core transpose_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn transpose_speed() {
        let raw = bytes(4 << 20);
        let mut out = vec![0u8; raw.len()];
        for n in [2usize, 4, 8] {
            let t0 = std::time::Instant::now();
            for _ in 0..20 {
                group(&raw, n, &mut out);
            }
            let g = 20.0 * raw.len() as f64 / t0.elapsed().as_secs_f64() / 1e9;
            let t0 = std::time::Instant::now();
            let mut back = vec![0u8; raw.len()];
            for _ in 0..20 {
                ungroup(&out, n, &mut back);
            }
            let u = 20.0 * raw.len() as f64 / t0.elapsed().as_secs_f64() / 1e9;
            println!("n={n}: group {g:.2} GB/s, ungroup {u:.2} GB/s");
        }
    }
}
