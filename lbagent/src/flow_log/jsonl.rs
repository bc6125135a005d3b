//! JSON Lines: one object per record, to a file rotated by size or to
//! standard output (journald takes each line as an entry).

use std::{
    fs::{self, File, OpenOptions},
    io::{self, Write},
    path::{Path, PathBuf},
};

use serde::Serialize;

use super::record::{Event, FlowRecord, rfc3339};
use crate::state::flow_log::JsonlSpec;

/// A record as one JSON line. Field names are the format (docs/flow-logs.md).
#[derive(Serialize)]
struct Line<'a> {
    time: String,
    event: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'static str>,
    object: Option<&'a str>,
    zone: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    dnat_rule: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    snat_rule: Option<&'a str>,
    proto: String,
    src: String,
    sport: u16,
    dst: String,
    dport: u16,
    xlate_src: String,
    xlate_sport: u16,
    xlate_dst: String,
    xlate_dport: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    start: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    duration_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    packets: Option<[u64; 2]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    bytes: Option<[u64; 2]>,
}

/// The JSON line of `r` (without its newline).
pub fn line(r: &FlowRecord) -> String {
    let end = match r.event {
        Event::Start => None,
        Event::End(why) => Some(why),
    };
    let l = Line {
        time: rfc3339(r.time),
        event: if end.is_some() { "end" } else { "start" },
        reason: end.map(lbagent_common::flow_end_name),
        object: r.object.as_deref(),
        zone: r.zone,
        dnat_rule: r.dnat_rule.as_deref(),
        snat_rule: r.snat_rule.as_deref(),
        proto: crate::proto::proto_name(r.proto),
        src: r.orig.src.to_string(),
        sport: r.orig.sport,
        dst: r.orig.dst.to_string(),
        dport: r.orig.dport,
        xlate_src: r.xlate.src.to_string(),
        xlate_sport: r.xlate.sport,
        xlate_dst: r.xlate.dst.to_string(),
        xlate_dport: r.xlate.dport,
        start: end.map(|_| rfc3339(r.start)),
        duration_ms: end.map(|_| r.duration().as_millis() as u64),
        packets: end.map(|_| r.packets),
        bytes: end.map(|_| r.bytes),
    };
    serde_json::to_string(&l).expect("a record serializes")
}

/// Where lines go.
pub struct Writer {
    spec: JsonlSpec,
    /// The agent's flow-log directory (`--flow-log-dir`).
    dir: PathBuf,
    file: Option<(File, u64)>,
}

impl Writer {
    pub fn new(spec: JsonlSpec, dir: PathBuf) -> Self {
        Writer { spec, dir, file: None }
    }

    /// Writes `lines` (each with its newline); rotates the file first when
    /// they would take it past its size.
    pub fn write(&mut self, lines: &str) -> io::Result<()> {
        match &self.spec {
            JsonlSpec::Stdout => {
                let mut out = io::stdout().lock();
                out.write_all(lines.as_bytes())?;
                out.flush()
            }
            JsonlSpec::File { name, max_bytes, keep } => {
                let (path, max_bytes, keep) = (self.dir.join(name), *max_bytes, *keep);
                if self.file.as_ref().is_some_and(|(_, size)| *size > 0 && size + lines.len() as u64 > max_bytes) {
                    self.file = None;
                    // A rotation that fails leaves the file to grow: the
                    // records are kept.
                    if let Err(e) = rotate(&path, keep) {
                        tracing::warn!("flow logs: rotating {}: {e}", path.display());
                    }
                }
                let (file, size) = match &mut self.file {
                    Some(f) => f,
                    None => self.file.insert(open(&self.dir, &path)?),
                };
                if let Err(e) = file.write_all(lines.as_bytes()) {
                    // Opened again for the next batch (a partial line stays
                    // behind: the file is appended to, never rewritten).
                    self.file = None;
                    return Err(e);
                }
                *size += lines.len() as u64;
                Ok(())
            }
        }
    }
}

/// Opens `path` in `dir` for appending (the directory created 0750 if
/// missing; the file 0640), with its size. A symlink is refused (at the
/// file: `O_NOFOLLOW`), as is anything but a regular file.
fn open(dir: &Path, path: &Path) -> io::Result<(File, u64)> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    fs::DirBuilder::new().recursive(true).mode(0o750).create(dir)?;
    // O_NONBLOCK: a FIFO under the name would block the open (refused
    // below; a regular file ignores the flag).
    let mut file = OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .mode(0o640)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::other(format!("{} is not a regular file", path.display())));
    }
    // A partial line a failed write left (a full disk) ends here: the
    // next line starts on its own.
    let mut size = meta.len();
    if size > 0 {
        use std::os::unix::fs::FileExt;
        let mut last = [0u8; 1];
        file.read_exact_at(&mut last, size - 1)?;
        if last[0] != b'\n' {
            file.write_all(b"\n")?;
            size += 1;
        }
    }
    Ok((file, size))
}

/// `path` → `path.1` → … → `path.<keep>` (the oldest goes). Only regular
/// files move or go: a symlink or a directory under a rotated name stays
/// (and is not written through).
fn rotate(path: &Path, keep: u32) -> io::Result<()> {
    let numbered = |n: u32| -> PathBuf {
        let mut p = path.as_os_str().to_owned();
        p.push(format!(".{n}"));
        PathBuf::from(p)
    };
    let regular = |p: &Path| fs::symlink_metadata(p).is_ok_and(|m| m.is_file());
    if regular(&numbered(keep)) {
        fs::remove_file(numbered(keep))?;
    }
    for n in (1..keep).rev() {
        if regular(&numbered(n)) && !fs::exists(numbered(n + 1))? {
            fs::rename(numbered(n), numbered(n + 1))?;
        }
    }
    if regular(path) && !fs::exists(numbered(1))? {
        fs::rename(path, numbered(1))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::{
        net::Ipv4Addr,
        sync::Arc,
        time::{Duration, UNIX_EPOCH},
    };

    use lbagent_common::*;

    use super::*;
    use crate::flow_log::record::Endpoints;

    fn record(event: Event) -> FlowRecord {
        let t = UNIX_EPOCH + Duration::from_millis(1_796_661_005_123);
        let ep = |a: [u8; 4], p| Endpoints {
            src: Ipv4Addr::from(a).into(),
            sport: p,
            dst: Ipv4Addr::new(198, 51, 100, 7).into(),
            dport: 443,
        };
        FlowRecord {
            event,
            time: t + Duration::from_millis(1500),
            start: t,
            zone: 3,
            object: Some("natgw/gw1".into()),
            dnat_rule: None,
            snat_rule: Some(Arc::from("natgw/gw1/snat/10.0.0.0/24")),
            proto: PROTO_TCP,
            orig: ep([10, 0, 0, 5], 40_000),
            xlate: ep([203, 0, 113, 20], 40_123),
            packets: [3, 2],
            bytes: [180, 120],
        }
    }

    #[test]
    fn records_are_json_objects_with_their_fields() {
        let end: serde_json::Value = serde_json::from_str(&line(&record(Event::End(FLOW_END_RST)))).unwrap();
        assert_eq!(end["event"], "end");
        assert_eq!(end["reason"], "rst");
        assert_eq!(end["time"], "2026-12-07T16:30:06.623Z");
        assert_eq!(end["start"], "2026-12-07T16:30:05.123Z");
        assert_eq!(end["duration_ms"], 1500);
        assert_eq!(end["xlate_src"], "203.0.113.20");
        assert_eq!(end["xlate_sport"], 40_123);
        assert_eq!(end["proto"], "tcp");
        assert_eq!(end["bytes"], serde_json::json!([180, 120]));
        assert_eq!(end["snat_rule"], "natgw/gw1/snat/10.0.0.0/24");
        let start: serde_json::Value = serde_json::from_str(&line(&record(Event::Start))).unwrap();
        assert_eq!(start["event"], "start");
        assert!(start.get("reason").is_none() && start.get("bytes").is_none() && start.get("dnat_rule").is_none());
    }

    #[test]
    fn the_file_rotates_by_size_and_keeps_its_count() {
        let dir = std::env::temp_dir().join(format!("lbagent-jsonl-{}", std::process::id()));
        let mut w = Writer::new(JsonlSpec::File { name: "flows.jsonl".into(), max_bytes: 100, keep: 2 }, dir.clone());
        let line = format!("{}\n", "x".repeat(59));
        for _ in 0..7 {
            w.write(&line).unwrap();
        }
        // 60-byte lines, 100 bytes a file: one line per file, two kept.
        let read = |p: &str| fs::read_to_string(dir.join(p)).unwrap_or_default();
        assert_eq!(read("flows.jsonl"), line);
        assert_eq!(read("flows.jsonl.1"), line);
        assert_eq!(read("flows.jsonl.2"), line);
        assert!(!dir.join("flows.jsonl.3").exists());
        // A partial line (a write that failed half way) ends before the next.
        fs::write(dir.join("flows.jsonl"), "{\"partial").unwrap();
        let mut w = Writer::new(JsonlSpec::File { name: "flows.jsonl".into(), max_bytes: 1000, keep: 2 }, dir.clone());
        w.write(&line).unwrap();
        assert_eq!(read("flows.jsonl"), format!("{{\"partial\n{line}"));
        // A symlink planted under the file's name is not written through.
        fs::remove_file(dir.join("flows.jsonl")).unwrap();
        std::os::unix::fs::symlink(dir.join("target"), dir.join("flows.jsonl")).unwrap();
        let mut w = Writer::new(JsonlSpec::File { name: "flows.jsonl".into(), max_bytes: 100, keep: 2 }, dir.clone());
        assert!(w.write(&line).is_err());
        assert!(!dir.join("target").exists());
        fs::remove_dir_all(&dir).unwrap();
    }
}
