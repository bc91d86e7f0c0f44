//! The policy's schema and its error messages, through `Policy::from_toml` and `from_json`.

use super::check::{closest, edit_distance, fs_path, STORE_KEYS, TIER_KEYS};
use super::*;
use crate::codec::{Codec, Compression};

/// The example policy of docs/config.md (also the fuzzer's seed, with a peer tier added).
pub(crate) const EXAMPLE: &str = r#"[[tier]]
name = "ram"
kind = "memory"
root = "/dev/shm/tiercel/run1"
capacity = "8GiB"
keep = 2

[[tier]]
name = "disk"
kind = "fs"
url = "/mnt/ckpt/run1"
every = 10
keep = 3
compression = "zstd:3"
bandwidth = "2GB/s"

[restore]
order = ["ram", "disk"]
"#;

const MINIMAL: &str = "[[tier]]\nname = \"ram\"\nkind = \"memory\"\nroot = \"/dev/shm/t\"\n";

fn toml_err(text: &str) -> String {
    let e = Policy::from_toml(text, "tiercel.toml").expect_err("policy should be rejected");
    assert_eq!(e.kind, crate::error::ErrorKind::Config);
    e.message
}

fn json_err(text: &str) -> String {
    Policy::from_json(text, "<dict>").expect_err("policy should be rejected").message
}

/// `MINIMAL` plus a second (fs) tier with `extra` lines; its lines start at 5.
fn with_disk(extra: &str) -> String {
    format!("{MINIMAL}[[tier]]\nname = \"disk\"\nkind = \"fs\"\nurl = \"/mnt/c\"\n{extra}")
}

/// Asserts that `msg` starts with `tiercel.toml:<line>: ` and mentions each of `parts`.
fn assert_at(msg: &str, line: usize, parts: &[&str]) {
    let prefix = format!("tiercel.toml:{line}: ");
    assert!(msg.starts_with(&prefix), "expected prefix {prefix:?} in {msg:?}");
    for part in parts {
        assert!(msg.contains(part), "expected {part:?} in {msg:?}");
    }
}

#[test]
fn example_parses() {
    let p = Policy::from_toml(EXAMPLE, "tiercel.toml").unwrap();
    assert_eq!(p.source, "tiercel.toml");
    assert_eq!(p.tiers.len(), 2);
    let ram = p.memory_tier();
    assert_eq!((ram.name.as_str(), ram.kind(), ram.location()), ("ram", TierKind::Memory, "/dev/shm/tiercel/run1"));
    assert_eq!(ram.spec, TierSpec::Memory { root: "/dev/shm/tiercel/run1".into() });
    assert_eq!(ram.capacity, Some(8 << 30));
    assert_eq!(ram.keep, Some(2));
    assert_eq!(ram.every, 1);
    assert_eq!(ram.compression, Compression::none());
    assert_eq!(ram.bandwidth, None);
    assert_eq!(ram.line, 1);
    let disk = p.tier("disk").unwrap();
    assert_eq!(disk.spec, TierSpec::Fs { path: "/mnt/ckpt/run1".into() });
    assert_eq!((disk.every, disk.keep), (10, Some(3)));
    assert_eq!(disk.compression, Compression { codec: Codec::Zstd { level: 3 }, bytegroup: false });
    assert_eq!(disk.bandwidth, Some(2_000_000_000));
    assert_eq!(disk.capacity, None);
    assert_eq!(disk.line, 8);
    assert!(p.tier("tape").is_none());
    assert_eq!(p.restore_order, ["ram", "disk"]);
    assert_eq!((p.chunk_size, p.io_threads), (DEFAULT_CHUNK_SIZE, 2));
    assert!((1..=8).contains(&p.threads));
}

#[test]
fn defaults() {
    let p = Policy::from_toml(&with_disk(""), "p.toml").unwrap();
    let (ram, disk) = (&p.tiers[0], &p.tiers[1]);
    assert_eq!((ram.every, ram.keep, ram.compression), (1, Some(2), Compression::none()));
    assert_eq!((disk.every, disk.keep), (1, None));
    assert_eq!(disk.compression.to_string(), "zstd:3");
    assert_eq!((disk.bandwidth, disk.capacity), (None, None));
    assert_eq!(p.restore_order, ["ram", "disk"]);
    assert_eq!(p.chunk_size, 4 << 20);
    assert_eq!(p.io_threads, 2);
    let cores = std::thread::available_parallelism().unwrap().get();
    assert_eq!(p.threads, cores.min(8));
}

#[test]
fn store_settings_and_file_urls() {
    let text = with_disk("[store]\nchunk_size = \"1MiB\"\nthreads = 3\nio_threads = 5\n").replace("/mnt/c", "file:///mnt/c");
    let p = Policy::from_toml(&text, "p.toml").unwrap();
    assert_eq!((p.chunk_size, p.threads, p.io_threads), (1 << 20, 3, 5));
    assert_eq!(p.tiers[1].location(), "/mnt/c");
    assert_eq!(fs_path("file://localhost/x/y").unwrap(), "/x/y");
    assert_eq!(fs_path("relative/dir").unwrap(), "relative/dir");
    let p = Policy::from_toml(&format!("{MINIMAL}[store]\nchunk_size = 65536\n"), "p.toml").unwrap();
    assert_eq!(p.chunk_size, 65536);
}

#[test]
fn pickle_mode_defaults_to_warn_and_names_its_values() {
    assert_eq!(Policy::from_toml(MINIMAL, "p.toml").unwrap().pickle, PickleMode::Warn);
    for mode in PickleMode::NAMES {
        let p = Policy::from_toml(&format!("{MINIMAL}[store]\npickle = \"{mode}\"\n"), "p.toml").unwrap();
        assert_eq!(p.pickle.as_str(), mode);
    }
    let msg = toml_err(&format!("{MINIMAL}[store]\npickle = \"never\"\n"));
    assert_at(&msg, 6, &["store.pickle", "expected \"warn\" (the default), \"error\" or \"allow\", got \"never\""]);
}

#[test]
fn load_reads_a_file_and_names_a_missing_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiercel.toml");
    std::fs::write(&path, EXAMPLE).unwrap();
    let p = Policy::load(&path).unwrap();
    assert_eq!(p.source, path.display().to_string());
    let missing = dir.path().join("nope.toml");
    let e = Policy::load(&missing).unwrap_err();
    assert_eq!(e.kind, crate::error::ErrorKind::Config);
    assert!(e.message.contains(&missing.display().to_string()), "{}", e.message);
}

#[test]
fn json_matches_toml() {
    let json = r#"{
        "tier": [
            {"name": "ram", "kind": "memory", "root": "/dev/shm/tiercel/run1", "capacity": "8GiB", "keep": 2},
            {"name": "disk", "kind": "fs", "url": "/mnt/ckpt/run1", "every": 10, "keep": 3,
             "compression": "zstd:3", "bandwidth": "2GB/s"}
        ],
        "restore": {"order": ["ram", "disk"]}
    }"#;
    let from_json = Policy::from_json(json, "<dict>").unwrap();
    let from_toml = Policy::from_toml(EXAMPLE, "<dict>").unwrap();
    assert_eq!(from_json.tiers.iter().map(|t| t.line).collect::<Vec<_>>(), [0, 0]);
    // Equal but for the lines, which only TOML has.
    let unlined = |p: &Policy| {
        let mut p = p.clone();
        p.tiers.iter_mut().for_each(|t| t.line = 0);
        format!("{p:?}")
    };
    assert_eq!(unlined(&from_json), unlined(&from_toml));
    // Integers stand for bytes in both forms.
    let p = Policy::from_json(
        r#"{"tier":[{"name":"m","kind":"memory","root":"/r","capacity":4096}],"store":{"chunk_size":1048576}}"#,
        "<dict>",
    )
    .unwrap();
    assert_eq!((p.tiers[0].capacity, p.chunk_size), (Some(4096), 1 << 20));
}

#[test]
fn json_errors_have_paths_without_lines() {
    let base = r#"{"name":"ram","kind":"memory","root":"/r"}"#;
    let msg = json_err(&format!(r#"{{"tier":[{base},{{"name":"disk","kind":"fs","url":"/d","keep":-1}}]}}"#));
    assert_eq!(msg, "<dict>: tier[1].keep: expected a positive integer, got -1");
    let msg = json_err(&format!(r#"{{"tier":[{base}],"stor":{{}}}}"#));
    assert!(msg.starts_with("<dict>: stor: unknown key `stor`") && msg.contains("did you mean `store`?"), "{msg}");
    let msg = json_err(&format!(r#"{{"tier":[{base}],"store":{{"threads":null}}}}"#));
    assert_eq!(msg, "<dict>: store.threads: expected a positive integer, got null");
    assert!(json_err("[1, 2]").starts_with("<dict>: top level: expected a table"));
    assert!(json_err("{\"tier\": [").starts_with("<dict>: invalid JSON"));
}

#[test]
fn syntax_error_names_its_line() {
    let msg = toml_err("[[tier]]\nname = \"ram\"\nkind = memory\n");
    assert_at(&msg, 3, &["invalid TOML"]);
    assert!(!msg.contains('\n'), "{msg:?}");
    assert_at(&toml_err("[[tier]]\nname = \"a\"\nname = \"b\"\n"), 3, &["invalid TOML"]);
    assert_at(&toml_err("[[tier]]\nx = [1,\n\n"), 2, &["invalid TOML"]);
}

#[test]
fn unknown_keys_are_named_with_suggestions() {
    let msg = toml_err(&with_disk("evry = 10\n"));
    assert_at(&msg, 9, &["tier[1] (\"disk\").evry", "unknown key `evry`", "did you mean `every`?"]);
    let msg = toml_err(&format!("{MINIMAL}chunk_size = 4096\n"));
    assert_at(&msg, 5, &["tier[0] (\"ram\").chunk_size", "belongs in [store]"]);
    let msg = toml_err(&format!("{MINIMAL}colour = 1\n"));
    assert_at(&msg, 5, &["unknown key `colour`", "known keys: name, kind"]);
    let msg = toml_err(&format!("version = 1\n{MINIMAL}"));
    assert_at(&msg, 1, &["version: unknown key `version`"]);
    let msg = toml_err(&format!("{MINIMAL}[restore]\nordr = [\"ram\"]\n"));
    assert_at(&msg, 6, &["restore.ordr", "did you mean `order`?"]);
    let msg = toml_err(&format!("{MINIMAL}[store]\nthreads = 2\nio_thread = 1\n"));
    assert_at(&msg, 7, &["store.io_thread", "did you mean `io_threads`?"]);
    // An implicit table (toml gives it no position) is placed at its first entry, the header.
    let msg = toml_err(&format!("{MINIMAL}\n[extra.sub]\nk = 1\n"));
    assert_at(&msg, 6, &["extra: unknown key `extra`"]);
}

#[test]
fn wrong_types_and_values() {
    let cases: &[(&str, &str, &str)] = &[
        ("keep = -1", "tier[1] (\"disk\").keep: expected a positive integer, got -1", ""),
        ("keep = 0", ".keep: expected a positive integer, got 0", ""),
        ("every = \"10\"", ".every: expected a positive integer, got \"10\"", ""),
        ("every = 1.5", ".every: expected a positive integer, got 1.5", ""),
        ("compression = \"lz4\"", ".compression: expected \"none\"", "\"lz4\""),
        ("compression = \"zstd:25\"", ".compression: zstd level must be", "25"),
        ("compression = 3", ".compression: expected a non-empty string, got 3", ""),
        ("bandwidth = \"fast\"", ".bandwidth: \"fast\" is not a bandwidth", "2GB/s"),
        ("bandwidth = \"10Gb/s\"", ".bandwidth:", "means bits"),
        ("bandwidth = 0", ".bandwidth: expected a bandwidth such as \"2GB/s\" or a positive integer, got 0", ""),
        ("capacity = \"0GB\"", ".capacity: expected a positive amount", "\"0GB\""),
        ("capacity = true", ".capacity: expected", "got true"),
        ("capacity = 1979-05-27", ".capacity: expected", "date-time 1979-05-27"),
        ("url = \"x\"", "invalid TOML", ""), // a duplicate key is a TOML error
    ];
    for (line, part1, part2) in cases {
        let msg = toml_err(&with_disk(&format!("{line}\n")));
        assert_at(&msg, 9, &[part1, part2]);
    }
}

#[test]
fn names_and_kinds() {
    let msg = toml_err("[[tier]]\nkind = \"memory\"\nroot = \"/r\"\n");
    assert_at(&msg, 1, &["tier[0]: missing `name`"]);
    let msg = toml_err("[[tier]]\nname = \"a b\"\nkind = \"memory\"\nroot = \"/r\"\n");
    assert_at(&msg, 2, &["tier[0].name: expected a name of letters, digits"]);
    let msg = toml_err("[[tier]]\nname = \"\"\nkind = \"memory\"\nroot = \"/r\"\n");
    assert_at(&msg, 2, &["tier[0].name: expected a non-empty string"]);
    let msg = toml_err(&with_disk("").replace("\"disk\"", "\"ram\""));
    assert_at(&msg, 6, &["tier[1].name: duplicate tier name \"ram\", already used by tier[0]"]);
    let msg = toml_err(&with_disk("").replace("\"fs\"", "\"tape\""));
    assert_at(&msg, 7, &["tier[1] (\"disk\").kind: unknown kind \"tape\"; known kinds: \"memory\", \"fs\"", "\"s3\", \"gcs\""]);
    let msg = toml_err("[[tier]]\nname = \"ram\"\nroot = \"/r\"\n");
    assert_at(&msg, 1, &["tier[0] (\"ram\"): missing `kind`", "\"memory\", \"fs\""]);
}

#[test]
fn memory_tier_rules() {
    let msg = toml_err("[[tier]]\nname = \"disk\"\nkind = \"fs\"\nurl = \"/d\"\n");
    assert_at(&msg, 3, &["tier[0] (\"disk\").kind", "first tier must be kind \"memory\""]);
    let msg = toml_err(&format!("{MINIMAL}[[tier]]\nname = \"ram2\"\nkind = \"memory\"\nroot = \"/r2\"\n"));
    assert_at(&msg, 7, &["tier[1] (\"ram2\").kind", "only one memory tier"]);
    let msg = toml_err(&format!("{MINIMAL}url = \"/x\"\n"));
    assert_at(&msg, 5, &["tier[0] (\"ram\").url", "not valid for kind \"memory\"; use `root`"]);
    let msg = toml_err("[[tier]]\nname = \"ram\"\nkind = \"memory\"\n");
    assert_at(&msg, 1, &["tier[0] (\"ram\"): missing `root`"]);
    let msg = toml_err(&with_disk("root = \"/x\"\n"));
    assert_at(&msg, 9, &["tier[1] (\"disk\").root", "use `url`"]);
    let msg = toml_err(&with_disk("").replace("url = \"/mnt/c\"\n", ""));
    assert_at(&msg, 5, &["tier[1] (\"disk\"): missing `url`"]);
    let msg = toml_err(&with_disk("").replace("/mnt/c", "s3://bucket/x"));
    assert_at(&msg, 8, &["tier[1] (\"disk\").url", "path or file:// URL"]);
    let msg = toml_err(&with_disk("").replace("/mnt/c", "file://host/x"));
    assert_at(&msg, 8, &["tier[1] (\"disk\").url", "local file:// URL"]);
}

#[test]
fn tiers_are_required() {
    assert_eq!(toml_err(""), "tiercel.toml: no tiers: add at least one [[tier]] table (the first of kind \"memory\")");
    assert_at(&toml_err("tier = []\n"), 1, &["tier: expected a non-empty list of [[tier]] tables, got a list"]);
    assert_at(&toml_err("tier = 3\n"), 1, &["tier: expected a non-empty list"]);
    assert_at(&toml_err("[tier]\nname = \"x\"\n"), 1, &["tier: expected a non-empty list", "got a table"]);
}

#[test]
fn restore_order_rules() {
    let p = Policy::from_toml(&with_disk("[restore]\norder = [\"disk\", \"ram\"]\n"), "p.toml").unwrap();
    assert_eq!(p.restore_order, ["disk", "ram"]);
    let p = Policy::from_toml(&format!("restore.order = [\"ram\"]\n{MINIMAL}"), "p.toml").unwrap();
    assert_eq!(p.restore_order, ["ram"]);
    let msg = toml_err(&with_disk("[restore]\norder = [\n  \"ram\",\n  \"tape\",\n]\n"));
    assert_at(&msg, 12, &["restore.order[1]: unknown tier \"tape\"; the tiers are \"ram\", \"disk\""]);
    let msg = toml_err(&with_disk("[restore]\norder = [\"ram\", \"ram\"]\n"));
    assert_at(&msg, 10, &["restore.order[1]: tier \"ram\" is listed twice"]);
    let msg = toml_err(&with_disk("[restore]\norder = []\n"));
    assert_at(&msg, 10, &["restore.order: expected a non-empty list of tier names"]);
    let msg = toml_err(&with_disk("[restore]\norder = \"ram\"\n"));
    assert_at(&msg, 10, &["restore.order: expected a non-empty list", "got \"ram\""]);
    let msg = toml_err(&with_disk("[restore]\norder = [1]\n"));
    assert_at(&msg, 10, &["restore.order[0]: expected a non-empty string, got 1"]);
}

#[test]
fn store_rules() {
    for (value, part) in [
        ("chunk_size = \"1000\"", "store.chunk_size: expected a multiple of 4096 bytes between 64KiB and 1GiB, got \"1000\""),
        ("chunk_size = \"32KiB\"", "between 64KiB and 1GiB"),
        ("chunk_size = \"2GiB\"", "between 64KiB and 1GiB"),
        ("chunk_size = \"4MB\"", "multiple of 4096"),
        ("threads = 0", "store.threads: expected a positive integer, got 0"),
        ("io_threads = \"2\"", "store.io_threads: expected a positive integer, got \"2\""),
        // Repro (issue 14.14): io_threads = 100000 was a Rust panic; threads = 100000 exhausted
        // the machine's threads.
        ("io_threads = 100000", "store.io_threads: expected at most 256 (got 100000)"),
        ("threads = 100000", "store.threads: expected at most 1024 (got 100000)"),
    ] {
        let msg = toml_err(&format!("{MINIMAL}\n[store]\n{value}\n"));
        assert_at(&msg, 7, &[part]);
    }
}

#[test]
fn traffic_settings_and_rules() {
    use crate::policy::TrafficMode;
    let p = Policy::from_toml(MINIMAL, "p.toml").unwrap();
    assert_eq!((p.traffic.mode, p.traffic.mu, p.traffic.floor, p.traffic.warmup), (TrafficMode::Signals, 0.8, None, 20));
    let p = Policy::from_toml(&format!("{MINIMAL}\n[traffic]\nmode = \"learned\"\nmu = 0.5\nfloor = \"10MB/s\"\nwarmup = 5\n"), "p.toml")
        .unwrap();
    assert_eq!((p.traffic.mode, p.traffic.mu, p.traffic.floor, p.traffic.warmup), (TrafficMode::Learned, 0.5, Some(10_000_000), 5));
    let p = Policy::from_json(
        r#"{"tier": [{"name": "ram", "kind": "memory", "root": "/dev/shm/t"}], "traffic": {"mode": "off", "mu": 1, "floor": 0}}"#,
        "<dict>",
    )
    .unwrap();
    assert_eq!((p.traffic.mode, p.traffic.mu, p.traffic.floor), (TrafficMode::Off, 1.0, None));
    for (value, part) in [
        ("mode = \"smart\"", "traffic.mode: expected \"off\", \"signals\" (the default) or \"learned\", got \"smart\""),
        ("mu = 0", "traffic.mu: expected a share of each idle span above 0 and at most 1"),
        ("mu = 1.5", "traffic.mu: expected a share"),
        ("floor = \"fast\"", "traffic.floor: \"fast\" is not a bandwidth"),
        ("floor = -1", "traffic.floor: expected a bandwidth such as \"10MB/s\" (0: pause)"),
        ("warmup = 0", "traffic.warmup: expected a positive integer, got 0"),
        ("mood = 1", "traffic"),
    ] {
        let msg = toml_err(&format!("{MINIMAL}\n[traffic]\n{value}\n"));
        assert_at(&msg, 7, &[part]);
    }
    // A traffic key in the wrong table is pointed to [traffic].
    let msg = toml_err(&format!("{MINIMAL}\n[store]\nmu = 0.5\n"));
    assert!(msg.contains("[traffic]"), "{msg}");
}

/// Repro (issue 14.14): memory `root = "/"` was accepted (`/.lock`, `/.pool` and step
/// directories in `/`), and so was an fs `url` equal to the memory root.
#[test]
fn roots_that_would_mix_tiers_are_refused() {
    for root in ["/", "/.", "//"] {
        let msg = toml_err(&MINIMAL.replace("/dev/shm/t", root));
        assert_at(&msg, 4, &["tier[0] (\"ram\").root", "cannot be a memory tier's root"]);
    }
    for url in ["/dev/shm/t", "/dev/shm/t/", "file:///dev/shm/t", "/dev/shm/t/disk"] {
        let msg = toml_err(&with_disk("").replace("/mnt/c", url));
        assert_at(&msg, 8, &["tier[1] (\"disk\").url", "lies in the memory tier 'ram' root \"/dev/shm/t\""]);
    }
    assert!(Policy::from_toml(&with_disk("").replace("/mnt/c", "/dev/shm/t2"), "x").is_ok());
}

#[test]
fn bandwidths() {
    assert_eq!(parse_bandwidth("2GB/s"), Ok(2_000_000_000));
    assert_eq!(parse_bandwidth("100MiB/s"), Ok(100 << 20));
    assert_eq!(parse_bandwidth("2GB"), Ok(2_000_000_000));
    assert_eq!(parse_bandwidth("1.25 GB/s"), Ok(1_250_000_000));
    assert_eq!(parse_bandwidth("1000"), Ok(1000));
    let e = parse_bandwidth("10Gb/s").unwrap_err();
    assert!(e.contains("is not a bandwidth") && e.contains("means bits"), "{e}");
    assert!(parse_bandwidth("2GB/h").is_err());
    let p = Policy::from_toml(&with_disk("bandwidth = 1000000\n"), "p.toml").unwrap();
    assert_eq!(p.tiers[1].bandwidth, Some(1_000_000));
}

/// `MINIMAL` plus an object-store tier "bucket" of `kind` at `url`, with `extra` lines
/// (which start at line 9).
fn with_bucket(kind: &str, url: &str, extra: &str) -> String {
    format!("{MINIMAL}[[tier]]\nname = \"bucket\"\nkind = \"{kind}\"\nurl = \"{url}\"\n{extra}")
}

#[test]
fn object_store_tiers() {
    let p = Policy::from_toml(&with_bucket("s3", "s3://ckpt/run1/", ""), "p.toml").unwrap();
    let t = &p.tiers[1];
    assert_eq!(t.spec, TierSpec::S3(ObjectSpec { url: "s3://ckpt/run1".into(), options: ObjectOptions::default() }));
    assert_eq!((t.keep, t.compression.to_string()), (None, "zstd:3".to_string()));
    let extra = "endpoint = \"http://127.0.0.1:9000/\"\nregion = \"eu-west-1\"\nallow_http = true\n\
                 part_size = \"5MiB\"\nconcurrency = 8\ntimeout = 20\nretries = 0\n";
    let p = Policy::from_toml(&with_bucket("s3", "s3://ckpt", extra), "p.toml").unwrap();
    let TierSpec::S3(ObjectSpec { url, options: o }) = p.tiers[1].spec.clone() else { panic!("{:?}", p.tiers[1]) };
    assert_eq!(url, "s3://ckpt");
    assert_eq!(o.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
    assert_eq!((o.region.as_deref(), o.allow_http), (Some("eu-west-1"), Some(true)));
    assert_eq!((o.part_size, o.concurrency, o.timeout, o.retries), (5 << 20, 8, Some(20), Some(0)));
    let p = Policy::from_toml(&with_bucket("gcs", "gs://my_bucket//a//b", ""), "p.toml").unwrap();
    assert_eq!((p.tiers[1].kind().as_str(), p.tiers[1].location()), ("gcs", "gs://my_bucket/a/b"));
    let json = r#"{"tier":[{"name":"ram","kind":"memory","root":"/r"},
        {"name":"b","kind":"s3","url":"s3://ckpt/x","part_size":8388608,"allow_http":false}]}"#;
    let TierSpec::S3(ObjectSpec { options: o, .. }) = Policy::from_json(json, "<dict>").unwrap().tiers[1].spec.clone() else { panic!() };
    assert_eq!((o.part_size, o.allow_http), (8 << 20, Some(false)));

    for (kind, url, extra, line, parts) in [
        ("s3", "gs://ckpt/x", "", 8, &["tier[1] (\"bucket\").url", "expected an s3:// URL for kind \"s3\""][..]),
        ("gcs", "s3://ckpt/x", "", 8, &["expected a gs:// URL", "gs://bucket/checkpoints/run1"]),
        ("s3", "/mnt/ckpt", "", 8, &["expected an s3:// URL"]),
        ("s3", "s3://", "", 8, &["expected a bucket name"]),
        ("s3", "s3://Bad_Bucket/x", "", 8, &["expected a bucket name", "\"s3://Bad_Bucket/x\""]),
        ("s3", "s3://ab/x", "", 8, &["expected a bucket name"]),
        ("s3", "s3://ckpt/a/../b", "", 8, &["invalid segment \"..\""]),
        (
            "s3",
            "s3://ckpt",
            "endpoint = \"127.0.0.1:9000\"\n",
            9,
            &[".endpoint: expected an http:// or https:// URL", "got \"127.0.0.1:9000\""],
        ),
        ("s3", "s3://ckpt", "endpoint = \"http://\"\n", 9, &[".endpoint: expected an http://"]),
        ("gcs", "gs://ckpt", "region = \"us\"\n", 9, &[".region: `region` is not valid for kind \"gcs\""]),
        ("s3", "s3://ckpt", "allow_http = \"yes\"\n", 9, &[".allow_http: expected true or false, got \"yes\""]),
        ("s3", "s3://ckpt", "part_size = \"1MiB\"\n", 9, &[".part_size: expected a size between 5MiB", "got \"1MiB\""]),
        ("s3", "s3://ckpt", "part_size = \"6GiB\"\n", 9, &[".part_size: expected a size between 5MiB"]),
        ("s3", "s3://ckpt", "part_size = \"big\"\n", 9, &[".part_size: \"big\" is not a size"]),
        ("s3", "s3://ckpt", "concurrency = 0\n", 9, &[".concurrency: expected a positive integer, got 0"]),
        ("s3", "s3://ckpt", "concurrency = 65\n", 9, &[".concurrency: expected a positive integer up to 64"]),
        ("s3", "s3://ckpt", "timeout = \"30s\"\n", 9, &[".timeout: expected a positive integer, got \"30s\""]),
        ("s3", "s3://ckpt", "retries = -1\n", 9, &[".retries: expected an integer from 0 to 100, got -1"]),
        ("s3", "s3://ckpt", "part_sise = 1\n", 9, &["unknown key `part_sise`", "did you mean `part_size`?"]),
        ("s3", "s3://ckpt", "root = \"/x\"\n", 9, &[".root: `root` is not valid for kind \"s3\"; use `url`"]),
    ] {
        let msg = toml_err(&with_bucket(kind, url, extra));
        assert_at(&msg, line, parts);
    }
    let msg = toml_err(&format!("{MINIMAL}[[tier]]\nname = \"bucket\"\nkind = \"s3\"\n"));
    assert_at(&msg, 5, &["tier[1] (\"bucket\"): missing `url` (the bucket and prefix, e.g. \"s3://bucket/checkpoints/run1\")"]);
    // The object-store keys belong to object-store tiers only.
    let msg = toml_err(&with_disk("part_size = \"8MiB\"\n"));
    assert_at(&msg, 9, &["tier[1] (\"disk\").part_size: `part_size` is not valid for kind \"fs\"", "\"s3\" and \"gcs\""]);
    let msg = toml_err(&format!("{MINIMAL}endpoint = \"http://x\"\n"));
    assert_at(&msg, 5, &["tier[0] (\"ram\").endpoint: `endpoint` is not valid for kind \"memory\""]);
}

#[test]
fn suggestions() {
    assert_eq!(closest("evry", TIER_KEYS), Some("every"));
    assert_eq!(closest("Name", TIER_KEYS), Some("name"));
    assert_eq!(closest("bandwith", TIER_KEYS), Some("bandwidth"));
    assert_eq!(closest("colour", TIER_KEYS), None);
    assert_eq!(closest("id", TIER_KEYS), None);
    assert_eq!(closest("chunk", STORE_KEYS), Some("chunk_size"));
    assert_eq!(edit_distance("kitten", "sitting"), 3);
}

#[test]
fn peer_tier_spec() {
    let p =
        Policy::from_toml(&format!("{MINIMAL}[[tier]]\nname = \"peer\"\nkind = \"peer\"\nreplicas = 3\ncapacity = \"1GiB\"\n"), "p.toml")
            .unwrap();
    let t = &p.tiers[1];
    let want = PeerConfig { listen: DEFAULT_PEER_LISTEN.into(), replicas: 3, placement: "mixed".into(), secret: None };
    assert_eq!(t.spec, TierSpec::Peer(want));
    assert_eq!(
        (t.kind(), t.location(), t.keep, t.compression, t.capacity),
        (TierKind::Peer, "0.0.0.0:0", Some(2), Compression::none(), None)
    );
    for (extra, line, part) in [
        ("compression = \"zstd\"\n", 8, ".compression: a peer tier stores raw chunks"),
        ("url = \"/x\"\n", 8, ".url: `url` is not valid for kind \"peer\""),
        ("listen = \"nowhere\"\n", 8, ".listen: expected an address"),
        ("replicas = 1\n", 8, ".replicas: a peer tier needs replicas >= 2"),
        ("placement = \"star\"\n", 8, ".placement: expected \"mixed\", \"group\" or \"ring\""),
    ] {
        let msg = toml_err(&format!("{MINIMAL}[[tier]]\nname = \"peer\"\nkind = \"peer\"\n{extra}"));
        assert_at(&msg, line, &[part]);
    }
    let msg = toml_err(&with_disk("replicas = 2\n"));
    assert_at(&msg, 9, &["tier[1] (\"disk\").replicas: `replicas` is only valid for kind \"peer\""]);
}

#[test]
fn short_secrets_are_refused() {
    assert!(check_secret(b"", "TIERCEL_PEER_SECRET").unwrap_err().message.contains("TIERCEL_PEER_SECRET"));
    assert!(check_secret(&[b'x'; MIN_SECRET_LEN - 1], "policy").is_err());
    assert!(check_secret(&[b'x'; MIN_SECRET_LEN], "policy").is_ok());
}

/// The Store's roles are found from capabilities: the peer tier holds the memory layout too,
/// but may run degraded, so the one memory tier is still the only one in `Role::Memory`.
#[test]
fn roles_are_found_from_capabilities() {
    let p = Policy::from_toml(
        &format!("{MINIMAL}[[tier]]\nname = \"disk\"\nkind = \"fs\"\nurl = \"/d\"\n\n[[tier]]\nname = \"peer\"\nkind = \"peer\"\n"),
        "p.toml",
    )
    .unwrap();
    let playing = |role| p.tiers.iter().filter(|t| t.capabilities().plays(role)).map(|t| t.name.as_str()).collect::<Vec<_>>();
    assert_eq!(playing(Role::Memory), ["ram"]);
    assert_eq!(playing(Role::Cluster), ["peer"]);
    assert_eq!(p.tier_in(Role::Memory).map(|(i, t)| (i, t.name.as_str())), Some((0, "ram")));
    assert_eq!(p.tier_in(Role::Cluster).map(|(i, t)| (i, t.name.as_str())), Some((2, "peer")));
    assert_eq!(p.memory_tier().name, "ram");
    assert!(Policy::from_toml(MINIMAL, "p.toml").unwrap().tier_in(Role::Cluster).is_none());
}

#[test]
fn preemption_section() {
    use std::time::Duration;
    assert_eq!(Policy::from_toml(MINIMAL, "t").unwrap().preemption, None);
    let p = Policy::from_toml(&format!("{MINIMAL}[preemption]\n"), "t").unwrap();
    assert_eq!(p.preemption, Some(PreemptionConfig::default()));
    let text = format!("{MINIMAL}[preemption]\ngrace = \"2m\"\nsignals = [\"USR1\", \"SIGTERM\", \"SIGUSR1\"]\nexit = false\n");
    let p = Policy::from_toml(&text, "t").unwrap().preemption.unwrap();
    assert_eq!(p, PreemptionConfig { grace: Duration::from_secs(120), signals: vec!["SIGUSR1".into(), "SIGTERM".into()], exit: false });
    let json = r#"{"tier": [{"name": "ram", "kind": "memory", "root": "/dev/shm/t"}], "preemption": {"grace": 20}}"#;
    assert_eq!(Policy::from_json(json, "<dict>").unwrap().preemption.unwrap().grace, Duration::from_secs(20));
}

#[test]
fn preemption_errors_name_file_and_line() {
    let at = |extra: &str| toml_err(&format!("{MINIMAL}[preemption]\n{extra}"));
    assert_at(&at("grace = \"30 parsecs\"\n"), 6, &["preemption.grace", "is not a duration", "\"30s\""]);
    assert_at(&at("grace = -3\n"), 6, &["preemption.grace", "a duration"]);
    assert_at(&at("exit = true\nsignals = [\"SIGTERM\", \"SIGBOGUS\"]\n"), 7, &["preemption.signals[1]", "SIGBOGUS", "SIGUSR1"]);
    assert_at(&at("signals = [\"SIGKILL\"]\n"), 6, &["cannot be caught"]);
    assert_at(&at("signals = []\n"), 6, &["at least one signal"]);
    assert_at(&at("exit = \"yes\"\n"), 6, &["preemption.exit", "true"]);
    assert_at(&at("grase = \"30s\"\n"), 6, &["did you mean `grace`"]);
    assert!(json_err(r#"{"tier": [{"name": "ram", "kind": "memory", "root": "/dev/shm/t"}], "preemption": {"signals": ["TERM", 3]}}"#)
        .starts_with("<dict>: preemption.signals[1]: expected a non-empty string"));
}
