//! The suite every `Blobs` backend passes (a filesystem directory, an s3 or gcs prefix):
//! atomic puts, create-if-absent, streaming writes that appear only when finished, exact
//! ranged reads, listing and deletion, and what each failure is.

use super::subjects::BlobsSubject;
use super::{always, noise, Case};
use crate::error::ErrorKind;
use crate::requests::RequestKind;

fn put_get_round_trip(s: &BlobsSubject) {
    let b = &*s.blobs;
    for (key, data) in [("a", noise(0, 1)), ("dir/b", noise(1, 2)), ("dir/sub/c.json", noise(70_000, 3))] {
        b.put(key, &data).unwrap();
        assert_eq!(b.get(key).unwrap(), data, "{key}");
        assert!(b.exists(key).unwrap(), "{key}");
        assert!(b.describe(key).ends_with(key), "{} does not name {key}", b.describe(key));
    }
    // put replaces, whole.
    b.put("a", b"second").unwrap();
    assert_eq!(b.get("a").unwrap(), b"second");
}

fn missing_objects_are_not_found(s: &BlobsSubject) {
    let b = &*s.blobs;
    assert!(!b.exists("nope").unwrap());
    let e = b.get("nope").unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    assert!(e.message.contains(&b.describe("nope")), "message lacks where: {e}");
    assert_eq!(e.fields.path.as_deref(), Some(b.describe("nope").as_str()));
    assert_eq!(b.get_range("nope", 0, &mut [0u8; 4]).unwrap_err().kind, ErrorKind::NotFound);
    // Deleting what is not there is no error.
    b.delete("nope").unwrap();
    b.delete_prefix("nodir").unwrap();
}

fn put_if_absent_creates_once(s: &BlobsSubject) {
    let b = &*s.blobs;
    assert!(b.put_if_absent("step/COMMIT", b"first").unwrap());
    assert!(!b.put_if_absent("step/COMMIT", b"second").unwrap());
    assert_eq!(b.get("step/COMMIT").unwrap(), b"first");
}

fn ranged_reads_are_exact(s: &BlobsSubject) {
    let b = &*s.blobs;
    let data = noise(100_000, 4);
    b.put("obj", &data).unwrap();
    for (off, len) in [(0usize, 1usize), (0, 100_000), (4095, 4097), (99_999, 1), (50_000, 0)] {
        let mut dst = vec![0u8; len];
        b.get_range("obj", off as u64, &mut dst).unwrap();
        assert!(dst == data[off..off + len], "range {off}+{len}");
    }
    // Past the end: the object is shorter than asked, an integrity problem (its manifest
    // said otherwise), naming the object.
    for (off, len) in [(99_990usize, 20usize), (200_000, 8)] {
        let e = b.get_range("obj", off as u64, &mut vec![0u8; len]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Integrity, "range {off}+{len}: {e}");
        assert!(e.message.contains("shorter"), "{e}");
    }
}

fn streamed_objects_appear_when_finished(s: &BlobsSubject) {
    let b = &*s.blobs;
    // Larger than an object store's part (5 MiB in the test subjects): a multipart upload.
    let data = noise(11 << 20, 5);
    let mut w = b.create("big/rank-00000.data").unwrap();
    for piece in data.chunks(1_000_003) {
        w.write(piece).unwrap();
    }
    assert!(!b.exists("big/rank-00000.data").unwrap(), "visible before finish");
    w.finish().unwrap();
    assert!(b.get("big/rank-00000.data").unwrap() == data);
    // A small one goes whole.
    let mut w = b.create("small").unwrap();
    w.write(b"hello ").unwrap();
    w.write(b"world").unwrap();
    w.finish().unwrap();
    assert_eq!(b.get("small").unwrap(), b"hello world");
}

fn aborted_objects_never_appear(s: &BlobsSubject) {
    let b = &*s.blobs;
    b.put("x/old", b"old").unwrap();
    for (key, size) in [("x/old", 10usize), ("x/new", 11 << 20)] {
        let mut w = b.create(key).unwrap();
        w.write(&noise(size, 6)).unwrap();
        w.abort();
    }
    assert_eq!(b.get("x/old").unwrap(), b"old", "an aborted write replaced the object");
    assert!(!b.exists("x/new").unwrap());
    assert_eq!(b.list("x").unwrap(), vec!["old".to_string()], "an aborted write left something");
    // Nothing a writer left is there to collect either.
    assert!(b.leftovers(Some(std::time::Duration::ZERO)).unwrap().is_empty());
}

fn list_and_delete(s: &BlobsSubject) {
    let b = &*s.blobs;
    for key in ["step-2/b", "step-2/a", "step-10/a", "top"] {
        b.put(key, key.as_bytes()).unwrap();
    }
    assert_eq!(b.list("").unwrap(), vec!["step-10", "step-2", "top"], "sorted, directories by name");
    assert_eq!(b.list("step-2").unwrap(), vec!["a", "b"]);
    assert!(b.list("empty").unwrap().is_empty());
    b.delete("step-2/a").unwrap();
    assert_eq!(b.list("step-2").unwrap(), vec!["b"]);
    b.delete_prefix("step-2").unwrap();
    assert!(b.list("step-2").unwrap().is_empty());
    assert_eq!(b.list("").unwrap(), vec!["step-10", "top"], "delete_prefix took a neighbour");
    assert_eq!(b.get("step-10/a").unwrap(), b"step-10/a");
}

/// `delete_names` removes exactly the names it is given, more than one bulk request's worth
/// (1,000 on S3) and spread over directories, with missing names among them; on S3 it does
/// so in one DeleteObjects per 1,000 names and lists nothing (the tier's request counters).
fn delete_names_removes_those_names(s: &BlobsSubject) {
    let b = &*s.blobs;
    let names: Vec<String> = (0..1001).map(|i| format!("del/{:02x}/obj-{i:04}", i % 7)).collect();
    for n in &names {
        b.put(n, b"x").unwrap();
    }
    let kept = ["del/00/kept", "del/kept", "kept"];
    for k in kept {
        b.put(k, k.as_bytes()).unwrap();
    }
    let mut doomed = names.clone();
    doomed.extend(["del/00/never-there".to_string(), "nowhere/at-all".to_string()]);
    let before = b.requests().map(|r| (r.count(RequestKind::Delete), r.count(RequestKind::List)));
    b.delete_names(&doomed).unwrap();
    if let (Some(r), Some((deletes, lists))) = (b.requests(), before) {
        let (deletes, lists) = (r.count(RequestKind::Delete) - deletes, r.count(RequestKind::List) - lists);
        assert_eq!(lists, 0, "delete_names listed");
        if b.describe("").starts_with("s3://") {
            assert_eq!(deletes, 2, "1,003 names: two DeleteObjects");
        }
    }
    for k in kept {
        assert_eq!(b.get(k).unwrap(), k.as_bytes(), "{k} was deleted");
    }
    for n in names.iter().step_by(97) {
        assert!(!b.exists(n).unwrap(), "{n} is still there");
    }
    // (A filesystem keeps the emptied directories; their listings are empty.)
    for d in 1..7 {
        assert!(b.list(&format!("del/{d:02x}")).unwrap().is_empty(), "del/{d:02x} is not empty");
    }
    assert_eq!(b.list("del/00").unwrap(), vec!["kept"]);
    // Nothing to delete is no request and no error; deleting again neither.
    b.delete_names(&[]).unwrap();
    b.delete_names(&doomed[..3]).unwrap();
}

/// Every test of the suite, for one backend.
pub fn cases() -> Vec<Case<BlobsSubject>> {
    vec![
        Case { name: "put_get_round_trip", run: put_get_round_trip, skip: always },
        Case { name: "missing_objects_are_not_found", run: missing_objects_are_not_found, skip: always },
        Case { name: "put_if_absent_creates_once", run: put_if_absent_creates_once, skip: always },
        Case { name: "ranged_reads_are_exact", run: ranged_reads_are_exact, skip: always },
        Case { name: "streamed_objects_appear_when_finished", run: streamed_objects_appear_when_finished, skip: always },
        Case { name: "aborted_objects_never_appear", run: aborted_objects_never_appear, skip: always },
        Case { name: "list_and_delete", run: list_and_delete, skip: always },
        Case { name: "delete_names_removes_those_names", run: delete_names_removes_those_names, skip: always },
    ]
}
