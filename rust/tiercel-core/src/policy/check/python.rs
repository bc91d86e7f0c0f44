//! The keys of a tier built outside the core (`tier::external`): `kind = "python"` with a
//! `factory`, `kind = "fsspec"` with a `url`, or a kind an installed plugin registers (entry
//! point group `tiercel.tiers`), each with `[tier.options]` for its factory.

use super::super::source::Value;
use super::super::tier::{PythonSpec, TierKind, DEFAULT_PYTHON_CONCURRENCY};
use super::{Checker, TierTable, OBJECT_KEYS};
use crate::error::Result;

/// Keys only Python tiers take.
pub(super) const PYTHON_KEYS: &[&str] = &["factory", "options"];
/// The most calls into one Python tier in flight at once.
const MAX_PYTHON_CONCURRENCY: usize = 64;

/// Whether `name` is a kind of Python tier: "python", "fsspec", or one a plugin registers.
pub(super) fn is_python_kind(name: &str) -> bool {
    name == "python" || name == "fsspec" || super::super::tier::plugin_kinds().iter().any(|k| k == name)
}

/// Every kind a policy may name, quoted, for "unknown kind" messages.
pub(super) fn known_kinds() -> String {
    let mut names: Vec<String> = TierKind::ALL.iter().map(|k| k.as_str().to_string()).collect();
    names.push("fsspec".into());
    names.extend(super::super::tier::plugin_kinds());
    names.iter().map(|n| format!("{n:?}")).collect::<Vec<_>>().join(", ")
}

/// `module:callable`, each side dotted identifiers (`mypkg.tiers:make`, `mypkg:Tier.open`).
fn valid_factory(s: &str) -> bool {
    let dotted = |p: &str| {
        !p.is_empty()
            && p.split('.').all(|id| {
                let mut c = id.chars();
                c.next().is_some_and(|f| f.is_alphabetic() || f == '_') && c.all(|ch| ch.is_alphanumeric() || ch == '_')
            })
    };
    matches!(s.split_once(':'), Some((m, f)) if dotted(m) && dotted(f))
}

impl Checker<'_> {
    pub(super) fn python_tier(&self, t: &TierTable, kind: &str) -> Result<PythonSpec> {
        if let Some((n, p)) = t.optional("root") {
            return Err(self.at(n, &p, format!("`root` is not valid for kind {kind:?}; use `url`, or a key of [tier.options]")));
        }
        if let Some((key, n)) = t.entries.iter().find(|(k, _)| OBJECT_KEYS.contains(&k.as_str()) && k != "concurrency") {
            return Err(self.at(
                n,
                &t.key_path(key),
                format!("`{key}` is not valid for kind {kind:?}; a Python tier takes its settings in [tier.options]"),
            ));
        }
        let factory = match (kind, t.optional("factory")) {
            ("python", None) => {
                return Err(t.missing(self, "factory", "the tier's constructor, \"module:callable\" such as \"mypkg.tiers:make\""))
            }
            ("python", Some((n, p))) => {
                let f = self.string(n, &p)?.trim();
                if !valid_factory(f) {
                    return Err(self.expected(n, &p, "\"module:callable\" such as \"mypkg.tiers:make\""));
                }
                Some(f.to_string())
            }
            (_, Some((n, p))) => {
                return Err(self.at(n, &p, format!("`factory` is only valid for kind \"python\"; a {kind:?} tier is built by its own")))
            }
            (_, None) => None,
        };
        let url = match t.optional("url") {
            Some((n, p)) => {
                let u = self.string(n, &p)?.trim();
                if kind == "fsspec" && !u.split_once("://").is_some_and(|(proto, rest)| !proto.is_empty() && !rest.is_empty()) {
                    return Err(self.expected(
                        n,
                        &p,
                        "an fsspec URL \"<protocol>://...\" such as \"file:///mnt/ckpt\" or \"memory://ckpt\"",
                    ));
                }
                Some(u.to_string())
            }
            None if kind == "fsspec" => {
                return Err(t.missing(self, "url", "the filesystem and path, \"<protocol>://...\" such as \"file:///mnt/ckpt\""))
            }
            None => None,
        };
        let options = match t.optional("options") {
            Some((n, p)) => match &n.value {
                Value::Table(_) => n.to_json(),
                _ => return Err(self.expected(n, &p, "a table ([tier.options]) of keywords for the tier's factory")),
            },
            None => serde_json::Value::Object(Default::default()),
        };
        if let (Some(_), Some(n)) = (&url, options.get("url")) {
            let node = t.get("options").unwrap_or(t.node);
            return Err(self.at(node, &t.key_path("options.url"), format!("`url` is given twice (also {n} in [tier.options]); keep one")));
        }
        let concurrency = match t.optional("concurrency") {
            Some((n, p)) => {
                let c = self.count(n, &p)?;
                if c > MAX_PYTHON_CONCURRENCY {
                    return Err(self.expected(n, &p, &format!("a positive integer up to {MAX_PYTHON_CONCURRENCY}")));
                }
                c
            }
            None => DEFAULT_PYTHON_CONCURRENCY,
        };
        let at = match self.line(t.node) {
            Some(line) => format!("{}:{line}: {}", self.source, t.path),
            None => format!("{}: {}", self.source, t.path),
        };
        Ok(PythonSpec { kind: kind.to_string(), factory, url, options: options.to_string(), concurrency, at })
    }
}

#[cfg(test)]
mod tests {
    use crate::policy::{Policy, TierKind, TierSpec};

    const RAM: &str = "[[tier]]\nname = \"ram\"\nkind = \"memory\"\nroot = \"/dev/shm/t\"\n\n";

    fn parse(tier: &str) -> crate::error::Result<Policy> {
        Policy::from_toml(&format!("{RAM}[[tier]]\nname = \"archive\"\n{tier}"), "p.toml")
    }

    fn err(tier: &str) -> String {
        parse(tier).unwrap_err().message
    }

    #[test]
    fn a_python_tier_keeps_its_factory_options_and_place() {
        let p =
            parse("kind = \"python\"\nfactory = \"mypkg.tiers:make\"\nconcurrency = 8\n[tier.options]\nroot = \"/x\"\nn = 3\n").unwrap();
        let t = &p.tiers[1];
        assert_eq!((t.kind(), t.kind_name(), t.location(), t.keep), (TierKind::Python, "python", "mypkg.tiers:make", None));
        let TierSpec::Python(s) = &t.spec else { panic!("{:?}", t.spec) };
        assert_eq!(serde_json::from_str::<serde_json::Value>(&s.options).unwrap(), serde_json::json!({"root": "/x", "n": 3}));
        assert_eq!((s.concurrency, s.at.as_str()), (8, "p.toml:6: tier[1] (\"archive\")"));
        let f = parse("kind = \"fsspec\"\nurl = \"memory://ckpt\"\n").unwrap();
        assert_eq!((f.tiers[1].kind_name(), f.tiers[1].location()), ("fsspec", "memory://ckpt"));
    }

    #[test]
    fn mistakes_name_the_line_and_key() {
        assert!(err("kind = \"python\"\nfactory = \"mypkg.tiers\"\n")
            .starts_with("p.toml:9: tier[1] (\"archive\").factory: expected \"module:callable\""));
        assert!(err("kind = \"python\"\n").contains("p.toml:6: tier[1] (\"archive\"): missing `factory`"));
        assert!(err("kind = \"fsspec\"\nurl = \"/plain/path\"\n").contains("p.toml:9: tier[1] (\"archive\").url: expected an fsspec URL"));
        assert!(err("kind = \"fsspec\"\nurl = \"file:///a\"\nfactory = \"a:b\"\n").contains("`factory` is only valid for kind \"python\""));
        assert!(err("kind = \"fs\"\nurl = \"/a\"\n[tier.options]\nx = 1\n").contains("`options` is only valid for Python tiers"));
        assert!(err("kind = \"fsspec\"\nurl = \"file:///a\"\nregion = \"x\"\n").contains("`region` is not valid for kind \"fsspec\""));
        assert!(err("kind = \"fsspec\"\nurl = \"file:///a\"\n[tier.options]\nurl = \"file:///b\"\n").contains("`url` is given twice"));
        let unknown = err("kind = \"hdfs\"\n");
        assert!(
            unknown.contains("unknown kind \"hdfs\"; known kinds: \"memory\", \"fs\", \"peer\", \"s3\", \"gcs\", \"python\", \"fsspec\""),
            "{unknown}"
        );
    }

    #[test]
    fn every_kind_answers_what_it_is() {
        let p = Policy::from_toml(
            &format!(
                "{RAM}[[tier]]\nname = \"peer\"\nkind = \"peer\"\n\n[[tier]]\nname = \"disk\"\nkind = \"fs\"\nurl = \"/d\"\n\n\
                 [[tier]]\nname = \"s3\"\nkind = \"s3\"\nurl = \"s3://bkt/p\"\n\n[[tier]]\nname = \"local\"\nkind = \"fsspec\"\nurl = \"file:///l\"\n\n\
                 [[tier]]\nname = \"far\"\nkind = \"fsspec\"\nurl = \"memory://m\"\n"
            ),
            "p.toml",
        )
        .unwrap();
        // (network, persists, commit records, memory layout, cluster, degradable, directory)
        let caps: Vec<_> = p
            .tiers
            .iter()
            .map(|t| {
                let c = t.capabilities();
                (c.network, c.persists, c.commit_records, c.memory_layout, c.cluster, c.degradable, c.directory)
            })
            .collect();
        assert_eq!(
            caps,
            [
                (false, false, true, true, false, false, Some("/dev/shm/t")),
                (true, false, false, true, true, true, None),
                (false, true, true, false, false, true, Some("/d")),
                (true, true, true, false, false, true, None),
                (false, true, true, false, false, true, None),
                (true, true, true, false, false, true, None),
            ]
        );
    }

    #[test]
    fn without_the_python_package_a_python_tier_says_where_to_open_it() {
        // The core alone (no bindings registered): opening names the policy's place.
        let p = parse("kind = \"python\"\nfactory = \"m:f\"\n").unwrap();
        let e = crate::tier::open::open_tier(&p.tiers[1]).err().expect("no builder is registered in the core's tests");
        assert!(e.message.contains("p.toml:6: tier[1] (\"archive\").kind") && e.message.contains("tiercel.Store"), "{e}");
    }
}
