//! Units in a policy: byte sizes (`"8GiB"`), bandwidths (`"2GB/s"`) and durations (`"30s"`), each parsed exactly
//! or refused with what to write instead. Compression strings (`"bytegroup+zstd:3"`) are the
//! codec's own (`codec::Compression::parse`).

/// A byte count for messages, in binary units: "512 B", "6.0 MiB".
pub fn format_size(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut i = 0;
    while x >= 1024.0 && i < U.len() - 1 {
        x /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{x:.1} {}", U[i])
    }
}

/// Parses a byte size: `"8GiB"`, `"512 MiB"`, `"1.5GB"`, `"4096"`. KB/MB/GB/TB are decimal
/// (1000^n), KiB/MiB/GiB/TiB binary (1024^n).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    parse_bytes(s).map_err(|why| format!("{s:?} is not a size ({why}); write e.g. \"8GiB\", \"1.5GB\" or 4096 (bytes)"))
}

/// Parses bytes per second: `"2GB/s"`, `"100MiB/s"`; `"2GB"` and a plain integer also work.
pub fn parse_bandwidth(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    parse_bytes(t.strip_suffix("/s").unwrap_or(t))
        .map_err(|why| format!("{s:?} is not a bandwidth ({why}); write e.g. \"2GB/s\" or \"100MiB/s\""))
}

/// Parses a duration: a number and a unit, `"30s"`, `"1.5s"`, `"500ms"`, `"2m"`, `"1h"`.
pub fn parse_duration(s: &str) -> std::result::Result<std::time::Duration, String> {
    let t = s.trim();
    let bad = |why: &str| format!("{s:?} is not a duration ({why}); write e.g. \"30s\", \"500ms\" or \"2m\"");
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = (&t[..split], t[split..].trim_start());
    let n: f64 = number.parse().map_err(|_| bad("not a non-negative number"))?;
    let scale = match unit {
        "ms" => 1e-3,
        "s" => 1.0,
        "m" | "min" => 60.0,
        "h" => 3600.0,
        "" => return Err(bad("no unit")),
        _ => return Err(bad(&format!("unknown unit `{unit}`: use ms, s, m or h"))),
    };
    std::time::Duration::try_from_secs_f64(n * scale).map_err(|_| bad("too large"))
}

/// A number with an optional unit, exactly in bytes. Returns why not, for the caller to wrap.
fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = (&s[..split], s[split..].trim_start());
    // Decimal arithmetic in integers, so that "1.5GiB" is exact and "1.5B" is refused.
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let digits = format!("{whole}{fraction}");
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err("not a non-negative number".into());
    }
    let multiplier = unit_multiplier(unit)?;
    let too_large = || "too large".to_string();
    let mantissa: u128 = digits.parse().map_err(|_| too_large())?;
    let scale = 10u128.checked_pow(fraction.len() as u32).ok_or_else(too_large)?;
    let total = mantissa.checked_mul(multiplier.into()).ok_or_else(too_large)?;
    if total % scale != 0 {
        return Err("not a whole number of bytes".into());
    }
    u64::try_from(total / scale).map_err(|_| too_large())
}

fn unit_multiplier(unit: &str) -> std::result::Result<u64, String> {
    if unit.is_empty() || unit == "B" {
        return Ok(1);
    }
    let unknown = || format!("unknown unit `{unit}`: use B, KB, MB, GB, TB or KiB, MiB, GiB, TiB");
    let mut chars = unit.chars();
    let power = match chars.next().map(|c| c.to_ascii_uppercase()) {
        Some('K') => 1,
        Some('M') => 2,
        Some('G') => 3,
        Some('T') => 4,
        _ => return Err(unknown()),
    };
    match chars.as_str() {
        "B" => Ok(1000u64.pow(power)),
        "iB" | "ib" | "IB" | "Ib" => Ok(1024u64.pow(power)),
        // Network speeds are often quoted in bits (10Gb/s = 1.25GB/s): refuse rather than guess.
        "b" => Err(format!("`{unit}` means bits; write `{}B` for bytes", &unit[..1])),
        _ => Err(unknown()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5GB"), Ok(1_500_000_000));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size(" 10B "), Ok(10));
        assert_eq!(parse_size("1KB"), Ok(1000));
        assert_eq!(parse_size("1kB"), Ok(1000));
        assert_eq!(parse_size("1KiB"), Ok(1024));
        assert_eq!(parse_size("2MB"), Ok(2_000_000));
        assert_eq!(parse_size("2TiB"), Ok(2 << 40));
        assert_eq!(parse_size("64gib"), Ok(64 << 30));
        assert_eq!(parse_size("0.5KiB"), Ok(512));
        assert_eq!(parse_size("0"), Ok(0));
        for bad in ["", "abc", "-1GB", "1.5", "1.2.3GB", "8 XB", "8K", "8Gb", "1e9", "99999999999999999999GB"] {
            let e = parse_size(bad).expect_err(bad);
            assert!(e.contains("is not a size") && e.contains("8GiB"), "{bad}: {e}");
        }
        assert!(parse_size("8Gb").unwrap_err().contains("means bits; write `GB`"));
        assert!(parse_size("0.1B").unwrap_err().contains("whole number of bytes"));
    }

    #[test]
    fn durations() {
        use std::time::Duration;
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration(" 1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        for bad in ["", "30", "-1s", "1.2.3s", "3 days", "s", "1e400s"] {
            let e = parse_duration(bad).expect_err(bad);
            assert!(e.contains("is not a duration") && e.contains("\"30s\""), "{bad}: {e}");
        }
    }
}
