//! What every metadata object (manifest, commit record) is guarded by: the CRC32C seal that
//! ends it, and the nesting-depth limit it is read with.

use crate::error::{Error, Result};

/// What ends every metadata object (manifest, commit record) this tiercel writes:
/// `,"checksum":"crc32c:XXXXXXXX"}`, XXXXXXXX being the CRC32C (8 lowercase hex digits) of
/// every byte before it. A field old readers ignore, so the format stays version 1; it is
/// checked on the stored bytes, so no re-serialization has to agree with the writer's.
const SEAL_PREFIX: &[u8] = b",\"checksum\":\"crc32c:";
const SEAL_LEN: usize = SEAL_PREFIX.len() + 8 + 2;

/// Appends the checksum field to a serialized JSON object.
pub(super) fn seal(mut json: Vec<u8>) -> Vec<u8> {
    assert_eq!(json.pop(), Some(b'}'), "metadata serializes to a JSON object");
    let crc = crate::checksum::crc32c(&json);
    json.extend_from_slice(SEAL_PREFIX);
    json.extend_from_slice(format!("{crc:08x}\"}}").as_bytes());
    json
}

/// Verifies a metadata object's checksum field and returns the bytes to parse. An object
/// without the field (written before checksums existed) is taken as is; one whose field
/// does not match its bytes is an integrity error, and the reader falls back to the next
/// tier's copy.
pub fn unseal<'a>(bytes: &'a [u8], where_: &str) -> Result<&'a [u8]> {
    let Some(cut) = bytes.len().checked_sub(SEAL_LEN) else { return Ok(bytes) };
    let (body, tail) = bytes.split_at(cut);
    let Some(hex) = tail.strip_prefix(SEAL_PREFIX).and_then(|t| t.strip_suffix(b"\"}")) else {
        let has = |pat: &[u8]| tail.windows(pat.len()).any(|w| w == pat);
        if has(b"checksum") || has(b"crc32c:") {
            // The field is there, but not exactly as the writer puts it: a damaged object,
            // not one written before checksums existed.
            return Err(Error::integrity(format!("{where_}: its checksum field is damaged; the metadata cannot be trusted")));
        }
        return Ok(bytes);
    };
    let want = std::str::from_utf8(hex).ok().filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
    let want = want.and_then(|h| u32::from_str_radix(h, 16).ok());
    let got = crate::checksum::crc32c(body);
    match want {
        // The field is valid JSON: the object parses with it in place.
        Some(w) if w == got => Ok(bytes),
        Some(w) => Err(Error::integrity(format!(
            "{where_}: metadata checksum mismatch (stored crc32c {w:08x}, computed {got:08x}); the object is damaged"
        ))),
        None => Err(Error::integrity(format!("{where_}: its checksum field is damaged; the metadata cannot be trusted"))),
    }
}

/// The deepest nesting of JSON arrays and objects a manifest may have: serde_json refuses
/// more than 128 levels, so a tree deeper than this could be saved but never read back.
/// The core refuses such trees at save (`check_tree_depth`) and reads with the same limit.
pub const MAX_TREE_DEPTH: usize = 100;

/// How deep `v` nests arrays and objects (a scalar is 0).
pub fn json_depth(v: &serde_json::Value) -> usize {
    // Iterative: a hostile value must not overflow the stack here either.
    let mut max = 0;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, d)) = stack.pop() {
        match v {
            serde_json::Value::Array(a) => {
                max = max.max(d);
                stack.extend(a.iter().map(|x| (x, d + 1)));
            }
            serde_json::Value::Object(o) => {
                max = max.max(d);
                stack.extend(o.values().map(|x| (x, d + 1)));
            }
            _ => {}
        }
    }
    max
}

/// Refuses metadata whose bytes nest deeper than a manifest holding a tree of
/// `MAX_TREE_DEPTH` levels can (brackets outside strings counted), with a clear error rather
/// than the parser's.
pub(super) fn check_depth(bytes: &[u8], where_: &str) -> Result<()> {
    // manifest object > trees list > [name, tree] pair > the tree.
    const OUTER: usize = 3;
    let (mut depth, mut max, mut in_str, mut esc) = (0usize, 0usize, false, false);
    for &b in bytes {
        if in_str {
            match (esc, b) {
                (true, _) => esc = false,
                (false, b'\\') => esc = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_str = true,
            b'[' | b'{' => {
                depth += 1;
                max = max.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    if max > MAX_TREE_DEPTH + OUTER {
        return Err(Error::integrity(format!(
            "{where_}: nests {} levels deep; tiercel reads trees of at most {MAX_TREE_DEPTH} levels",
            max - OUTER
        )));
    }
    Ok(())
}
