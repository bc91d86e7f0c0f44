//! The core's modules stand in layers (docs/architecture.md, "rust/tiercel-core/src"): a
//! module imports only from its own layer or the layers below, and no two modules import each
//! other, directly or round a circle. This test reads every source file's `crate::` paths (test
//! code left out) and fails naming the file, the line and the import that breaks the rule.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, from the ground up. A new top-level module must be placed here.
const LAYERS: &[&[&str]] = &[
    &["error", "checksum", "failpoint"],
    &["format", "codec", "gc", "lease", "shm", "blobs", "requests", "placement"],
    &["policy"],
    &["scheduler", "transport"],
    &["object", "tier"],
    &["store", "testing"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file belongs to: `tier/peer/mod.rs` -> `tier`, `gc.rs` -> `gc`.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
    first.trim_end_matches(".rs").to_string()
}

/// The top-level modules a line names as `crate::<module>`, outside a `//` comment.
fn imports(line: &str) -> Vec<String> {
    let code = line.split("//").next().unwrap_or("");
    code.match_indices("crate::")
        .filter(|(i, _)| *i == 0 || !code.as_bytes()[i - 1].is_ascii_alphanumeric() && code.as_bytes()[i - 1] != b'_')
        .map(|(i, m)| code[i + m.len()..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>())
        .filter(|m| !m.is_empty())
        .collect()
}

#[test]
fn no_import_runs_up_or_round_a_circle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    sources(&src, &mut files);
    files.sort();
    let mut broken = vec![];
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let name = file.file_name().unwrap().to_string_lossy();
        let from = module_of(&src, file);
        if name == "lib.rs" || name.ends_with("tests.rs") {
            continue; // the module list; test code may reach anything
        }
        let Some(own) = layer_of(&from) else {
            broken.push(format!("{}: module `{from}` is on no layer: add it to LAYERS", file.display()));
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        // A file's inline tests (`#[cfg(test)] mod tests { ... }`) come last and are left out.
        let code = text.split("#[cfg(test)]\nmod tests {").next().unwrap();
        for (n, line) in code.lines().enumerate() {
            for to in imports(line) {
                if to == from || matches!(to.as_str(), "Error" | "ErrorKind" | "Fields" | "Result") {
                    continue; // within the module, or lib.rs's re-exports of `error`
                }
                match layer_of(&to) {
                    Some(l) if l <= own => {
                        edges.entry(from.clone()).or_default().insert(to);
                    }
                    Some(_) => broken.push(format!("{}:{}: `{from}` imports `crate::{to}`, a layer above its own", file.display(), n + 1)),
                    None => broken.push(format!("{}:{}: `crate::{to}` is on no layer", file.display(), n + 1)),
                }
            }
        }
    }
    // Within a layer, imports must not run round a circle either.
    for start in edges.keys() {
        let mut path = vec![start.clone()];
        if let Some(circle) = circle_from(&edges, &mut path) {
            broken.push(format!("modules import each other in a circle: {}", circle.join(" -> ")));
            break;
        }
    }
    assert!(broken.is_empty(), "the core's layers are broken:\n{}", broken.join("\n"));
}

/// A circle back to `path[0]` through `edges`, depth first.
fn circle_from(edges: &BTreeMap<String, BTreeSet<String>>, path: &mut Vec<String>) -> Option<Vec<String>> {
    let last = path.last().unwrap().clone();
    for next in edges.get(&last).into_iter().flatten() {
        if *next == path[0] {
            let mut c = path.clone();
            c.push(next.clone());
            return Some(c);
        }
        if !path.contains(next) {
            path.push(next.clone());
            if let Some(c) = circle_from(edges, path) {
                return Some(c);
            }
            path.pop();
        }
    }
    None
}

#[test]
fn imports_are_read_from_code_not_comments() {
    assert_eq!(imports("use crate::gc::{self, Removal};"), vec!["gc"]);
    assert_eq!(imports("    let x = crate::tier::replica::share(m); // see crate::store"), vec!["tier"]);
    assert_eq!(imports("/// (`crate::store`)"), Vec::<String>::new());
    assert_eq!(imports("use mycrate::store;"), Vec::<String>::new());
    assert_eq!(imports("pub(in crate::policy) const X: u8 = 0;"), vec!["policy"]);
}
