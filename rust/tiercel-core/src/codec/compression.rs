//! How a tier stores chunks, as a policy names it (`"none"`, `"zstd:3"`, `"bytegroup+zstd"`):
//! the codec's settings, which the policy reads and the codec applies.

use std::fmt;

/// zstd's level when a policy (or a compression string) says `zstd` without one.
pub const DEFAULT_ZSTD_LEVEL: i32 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    None,
    Zstd { level: i32 },
}

/// How a tier stores chunks. `bytegroup` means: for floating-point items, regroup the bytes
/// of each value by significance before zstd (exponent bytes compress far better together);
/// it only has an effect together with a codec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compression {
    pub codec: Codec,
    pub bytegroup: bool,
}

impl Compression {
    pub fn none() -> Self {
        Compression { codec: Codec::None, bytegroup: false }
    }

    pub(crate) fn zstd(level: i32) -> Self {
        Compression { codec: Codec::Zstd { level }, bytegroup: false }
    }

    /// Parses `none` | `off` | `zstd` (level 3) | `zstd:N` | `bytegroup+zstd` |
    /// `bytegroup+zstd:N`, where N is 1..=19 or a fast level -7..=-1.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        const EXPECTED: &str = "expected \"none\", \"zstd\", \"zstd:N\" (N in 1..=19, or -7..=-1 \
                                for fast levels) or \"bytegroup+zstd[:N]\"";
        let s = s.trim();
        if s == "none" || s == "off" {
            return Ok(Self::none());
        }
        let (bytegroup, codec) = match s.strip_prefix("bytegroup+") {
            Some(rest) => (true, rest),
            None => (false, s),
        };
        let level = match codec.strip_prefix("zstd") {
            Some("") => DEFAULT_ZSTD_LEVEL,
            Some(level) => match level.strip_prefix(':').and_then(|n| n.parse::<i32>().ok()) {
                Some(n) if (1..=19).contains(&n) || (-7..=-1).contains(&n) => n,
                Some(n) => return Err(format!("zstd level must be in 1..=19 or -7..=-1, got {n}")),
                None => return Err(format!("{EXPECTED}, got {s:?}")),
            },
            None => return Err(format!("{EXPECTED}, got {s:?}")),
        };
        Ok(Compression { bytegroup, ..Self::zstd(level) })
    }
}

/// The canonical spelling, which [`Compression::parse`] reads back (`to_string()` comes with it).
impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.codec {
            Codec::None => f.write_str("none"),
            Codec::Zstd { level } => {
                let prefix = if self.bytegroup { "bytegroup+" } else { "" };
                write!(f, "{prefix}zstd:{level}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compression_strings() {
        let zstd = |level, bytegroup| Compression { codec: Codec::Zstd { level }, bytegroup };
        assert_eq!(Compression::parse("none"), Ok(Compression::none()));
        assert_eq!(Compression::parse("off"), Ok(Compression::none()));
        assert_eq!(Compression::parse("zstd"), Ok(zstd(3, false)));
        assert_eq!(Compression::parse("zstd:19"), Ok(zstd(19, false)));
        assert_eq!(Compression::parse("zstd:-7"), Ok(zstd(-7, false)));
        assert_eq!(Compression::parse("bytegroup+zstd"), Ok(zstd(3, true)));
        assert_eq!(Compression::parse("bytegroup+zstd:1"), Ok(zstd(1, true)));
        for bad in ["zstd:0", "zstd:20", "zstd:-8", "zstd:", "zstd:x", "zstd3", "lz4", "bytegroup", "bytegroup+none", ""] {
            assert!(Compression::parse(bad).is_err(), "{bad:?} accepted");
        }
        for c in [Compression::none(), zstd(3, false), zstd(-2, false), zstd(9, true)] {
            assert_eq!(Compression::parse(&c.to_string()), Ok(c));
        }
        assert_eq!(zstd(9, true).to_string(), "bytegroup+zstd:9");
    }
}
