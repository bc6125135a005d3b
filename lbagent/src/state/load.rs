//! Reading a state file: YAML or JSON by extension, then validation.

use std::path::Path;

pub use super::problem::{Problem, Problems};
use super::{
    decimal,
    model::StateFile,
    spec::Desired,
    validate::{desired_after, warnings},
    yaml,
};
use serde::Deserialize;

fn one(path: impl Into<String>, message: impl Into<String>) -> Problems {
    Problems(vec![Problem { path: path.into(), message: message.into() }])
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Yaml,
    Json,
}

impl Format {
    pub fn of(path: &Path) -> Option<Format> {
        match path.extension()?.to_str()? {
            "yaml" | "yml" => Some(Format::Yaml),
            "json" => Some(Format::Json),
            _ => None,
        }
    }
}

/// Parses (no validation). Errors carry the field path where serde stopped.
/// A YAML document is read in one streaming pass (`yaml.rs`: its aliases
/// may expand to `nodes::max_nodes`), with its numbers checked as written
/// (`decimal::reading_yaml`).
pub fn parse(text: &str, format: Format) -> Result<StateFile, Problems> {
    let res = match format {
        Format::Yaml => decimal::reading_yaml(|| {
            let mut track = serde_path_to_error::Track::new();
            yaml::read(text, |de| StateFile::deserialize(serde_path_to_error::Deserializer::new(de, &mut track)))
                .map_err(|e| (track.path().to_string(), yaml::message(text, &e)))
        }),
        Format::Json => {
            let mut de = serde_json::Deserializer::from_str(text);
            serde_path_to_error::deserialize(&mut de).map_err(|e| (e.path().to_string(), e.into_inner().to_string()))
        }
    };
    res.map_err(problem)
}

/// A parse error as a problem: the field path where serde stopped, and
/// the message.
fn problem((path, msg): (String, String)) -> Problems {
    let path = if path == "." { String::new() } else { path };
    // A message that names the path too (as serde_yaml's did) says it once.
    let msg = msg.strip_prefix(&format!("{path}: ")).map(str::to_string).unwrap_or(msg);
    one(path, msg)
}

/// Parses and validates text: the document as written.
pub fn load_str(text: &str, format: Format) -> Result<StateFile, Problems> {
    accept_str(text, format).map(|a| a.state)
}

/// A document the agent accepts: its typed state, and what validation
/// accepted but warns about.
#[derive(Clone, Debug)]
pub struct Accepted {
    /// The document as written.
    pub state: StateFile,
    pub desired: Desired,
    pub warnings: Vec<Problem>,
}

impl Accepted {
    /// Validates a parsed document by converting it; objects equal to
    /// those of `earlier` share their specs.
    fn of(state: StateFile, earlier: Option<&Desired>) -> Result<Accepted, Problems> {
        let desired = desired_after(&state, earlier)?;
        Ok(Accepted { warnings: warnings(&state), state, desired })
    }
}

/// The objects of the last document a source accepted: the next
/// document's unchanged objects share their specs with it
/// ([`super::validate::desired_after`]) instead of being held twice while it is
/// checked. Kept by a desired-state source across its reads.
#[derive(Default)]
pub struct Earlier(std::sync::Mutex<Option<Desired>>);

impl Earlier {
    /// [`accept_file`], sharing the unchanged objects' specs.
    pub fn accept_file(&self, path: &Path) -> Result<Accepted, Problems> {
        let state = read_file(path)?;
        self.accept(state)
    }

    /// [`accept_str`], sharing the unchanged objects' specs.
    pub fn accept_str(&self, text: &str, format: Format) -> Result<Accepted, Problems> {
        let state = parse(text, format)?;
        self.accept(state)
    }

    fn accept(&self, state: StateFile) -> Result<Accepted, Problems> {
        let mut earlier = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let accepted = Accepted::of(state, earlier.as_ref())?;
        *earlier = Some(accepted.desired.clone());
        Ok(accepted)
    }
}

/// Parses, validates and converts text.
pub fn accept_str(text: &str, format: Format) -> Result<Accepted, Problems> {
    Accepted::of(parse(text, format)?, None)
}

/// Reads, parses, validates and converts a state file (what the daemon and
/// `lbagent validate` accept).
pub fn accept_file(path: &Path) -> Result<Accepted, Problems> {
    Accepted::of(read_file(path)?, None)
}

/// Largest state file read (a document for thousands of objects is a few MB).
pub const MAX_STATE_FILE_BYTES: u64 = 16 << 20;

/// Reads, parses and validates a state file: the document as written.
pub fn load_file(path: &Path) -> Result<StateFile, Problems> {
    accept_file(path).map(|a| a.state)
}

/// Reads and parses a state file. Only a regular file (a symlink to one is
/// fine) of at most `MAX_STATE_FILE_BYTES` is read: a FIFO would block the
/// agent, a device or a huge file would exhaust it. The file is parsed as
/// it is read, never held whole (at 100 000 rules it is 7.3 MB, read while
/// the running document's specs are held); its text is read again only to
/// quote the line a YAML error points at.
fn read_file(path: &Path) -> Result<StateFile, Problems> {
    use std::io::Read;
    let format = Format::of(path)
        .ok_or_else(|| one("", format!("{}: unknown extension (use .yaml, .yml or .json)", path.display())))?;
    let at = |e: String| one("", format!("{}: {e}", path.display()));
    let len = check_file(path).map_err(at)?;
    let file = std::fs::File::open(path).map_err(|e| at(e.to_string()))?;
    // The cap holds even if the file grows between the check and the read.
    let mut reader = Counted { inner: std::io::BufReader::new(file.take(MAX_STATE_FILE_BYTES + 1)), read: 0 };
    let res = match format {
        Format::Yaml => decimal::reading_yaml(|| {
            let mut track = serde_path_to_error::Track::new();
            skip_utf8_bom(&mut reader.inner).map_err(|e| (String::new(), format!("{}: {e}", path.display())))?;
            yaml::read_from(&mut reader, len, |de| {
                StateFile::deserialize(serde_path_to_error::Deserializer::new(de, &mut track))
            })
            .map_err(|e| {
                // The text again, to quote the line; not when the file
                // changed since (its lines would not be the ones parsed).
                let msg = match read_capped(path) {
                    Ok(text) if text.len() as u64 == len => yaml::message(&text, &e),
                    _ => e.to_string(),
                };
                (track.path().to_string(), msg)
            })
        }),
        Format::Json => {
            let mut de = serde_json::Deserializer::from_reader(&mut reader);
            serde_path_to_error::deserialize(&mut de).map_err(|e| (e.path().to_string(), e.into_inner().to_string()))
        }
    };
    if reader.read > MAX_STATE_FILE_BYTES {
        return Err(at(format!("more than the {MAX_STATE_FILE_BYTES} bytes a state file may have")));
    }
    res.map_err(problem)
}

/// A YAML file's byte-order mark: UTF-8's is skipped (as the parser skips
/// it in text), UTF-16's refused. Without one, the parser reads the bytes
/// as UTF-8 and refuses any that are not; with one, it would decode (and
/// mend) them instead.
fn skip_utf8_bom(r: &mut impl std::io::BufRead) -> Result<(), String> {
    let head = r.fill_buf().map_err(|e| e.to_string())?;
    if head.starts_with(&[0xFF, 0xFE]) || head.starts_with(&[0xFE, 0xFF]) {
        return Err("UTF-16 (a state file is UTF-8)".into());
    }
    if head.starts_with(&[0xEF, 0xBB, 0xBF]) {
        r.consume(3);
    }
    Ok(())
}

/// Counts the bytes read through it.
struct Counted<R> {
    inner: R,
    read: u64,
}

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        Ok(n)
    }
}

/// The size of the regular file at `path`, within the cap.
fn check_file(path: &Path) -> Result<u64, String> {
    let meta = std::fs::metadata(path).map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_STATE_FILE_BYTES {
        return Err(format!("{} bytes, more than the {MAX_STATE_FILE_BYTES} a state file may have", meta.len()));
    }
    Ok(meta.len())
}

fn read_capped(path: &Path) -> Result<String, String> {
    use std::io::Read;
    check_file(path)?;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_STATE_FILE_BYTES + 1).read_to_string(&mut text))
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_STATE_FILE_BYTES {
        return Err(format!("more than the {MAX_STATE_FILE_BYTES} bytes a state file may have"));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// "Billion laughs" on typed fields: 1 000 load balancers that are one
    /// aliased load balancer of 100 aliased listeners with 100 prefixes
    /// each, ten million prefixes if expanded.
    fn bomb() -> String {
        let cidrs = ["10.0.0.0/8"; 100].join(", ");
        let listeners = ["*l"; 99].join(", ");
        let lbs = ["*lb"; 999].join(", ");
        format!(
            "version: 1\nload_balancers: [&lb {{id: abcdefghijklmn, network: {{ip: 10.0.0.5, mac: \"02:00:00:00:00:05\", \
             prefix_len: 24, gateway: 10.0.0.1}}, listeners: [&l {{id: l, type: tcp, port: 80, backend_group: g, acl: \
             {{action: allow, cidrs: [{cidrs}]}}}}, {listeners}], backend_groups: [{{id: g, backends: [{{id: b, \
             address: 10.0.0.9, port: 80}}]}}]}}, {lbs}]\n"
        )
    }

    #[test]
    fn an_alias_bomb_is_refused_quickly_where_its_budget_runs_out() {
        let started = std::time::Instant::now();
        let err = load_str(&bomb(), Format::Yaml).unwrap_err().to_string();
        assert!(started.elapsed() < std::time::Duration::from_secs(2), "took {:?}", started.elapsed());
        assert!(err.contains("load_balancers[") && err.contains("through YAML aliases"), "{err}");
    }

    #[test]
    fn a_parse_error_names_its_path_once() {
        let doc = "version: 1\nqos_policies:\n  - name: p\n    binding: eip\n    rules:\n      - {name: r, direction: ingress, rate_mbps: 1, priority: 1}\n";
        let p = &parse(doc, Format::Yaml).unwrap_err().0[0];
        assert_eq!(p.path, "qos_policies[0].rules[0]");
        assert!(p.message.starts_with("missing field `burst_mb`"), "{}", p.message);
        let json = r#"{"version": 1, "qos_policies": [{"name": "p", "binding": "eip", "rules": [{"name": "r"}]}]}"#;
        let p = &parse(json, Format::Json).unwrap_err().0[0];
        assert_eq!(p.path, "qos_policies[0].rules[0]");
        assert!(!p.message.contains("qos_policies[0]"), "{}", p.message);
    }

    #[test]
    fn only_regular_files_of_bounded_size_are_read() {
        let dir = std::env::temp_dir().join(format!("lbagent-load-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo.yaml");
        let _ = std::fs::remove_file(&fifo);
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let err = load_file(&fifo).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{err}");
        let big = dir.join("big.yaml");
        std::fs::write(&big, vec![b'#'; (MAX_STATE_FILE_BYTES + 1) as usize]).unwrap();
        let err = load_file(&big).unwrap_err().to_string();
        assert!(err.contains("more than the"), "{err}");
        // Streamed, a file is still UTF-8 only, and a torn one quotes its line.
        let bad = dir.join("bad.yaml");
        std::fs::write(&bad, b"version: 1\nload_balancers:\n  - id: \xff\xfe\n").unwrap();
        assert!(load_file(&bad).is_err());
        std::fs::write(&bad, "version: 1\nload_balancers:\n  - id: [lb\n").unwrap();
        let from_file = load_file(&bad).unwrap_err().to_string();
        let from_text = load_str("version: 1\nload_balancers:\n  - id: [lb\n", Format::Yaml).unwrap_err().to_string();
        assert_eq!(from_file, from_text);
        assert!(from_file.contains("near `- id: [lb`"), "{from_file}");
        // Byte-order marks: UTF-8's read as in text, UTF-16's refused, and
        // invalid bytes after a mark refused as without one.
        let doc = "version: 1\n";
        std::fs::write(&bad, [&[0xEF, 0xBB, 0xBF][..], doc.as_bytes()].concat()).unwrap();
        let from_text = load_str(&format!("\u{feff}{doc}"), Format::Yaml).map_err(|e| e.to_string());
        assert_eq!(load_file(&bad).map_err(|e| e.to_string()), from_text);
        std::fs::write(&bad, [&[0xEF, 0xBB, 0xBF][..], b"version: 1\nx: \xff\n"].concat()).unwrap();
        assert!(load_file(&bad).is_err());
        let utf16: Vec<u8> = [0xFF, 0xFE].into_iter().chain(doc.encode_utf16().flat_map(u16::to_le_bytes)).collect();
        std::fs::write(&bad, utf16).unwrap();
        let err = load_file(&bad).unwrap_err().to_string();
        assert!(err.contains("UTF-16"), "{err}");
        let err = load_file(Path::new("/dev/null.yaml")).unwrap_err().to_string();
        assert!(err.contains("/dev/null.yaml"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[cfg(test)]
mod earlier_tests {
    use std::sync::Arc;

    use super::*;

    fn two_gateways(port: u16) -> String {
        let gw = |name: &str, n: u8, port: u16| {
            format!(
                "  - name: {name}\n    lan: {{ip: 10.0.{n}.254, prefix_len: 24, mac: \"02:00:0a:00:{n:02x}:fe\", \
                 gateway: 10.0.{n}.1}}\n    external: {{bridge: bre, prefix_len: 16, gateway: 100.64.0.1}}\n    \
                 eips: [{{name: e, ip: 100.64.1.{n}}}]\n    dnats: [{{eip: e, protocol: tcp, external_port: 2222, \
                 internal_ip: 10.0.{n}.9, internal_port: {port}}}]\n"
            )
        };
        format!(
            "version: 1\nagent: {{integration_bridge: br-int}}\nnat_gateways:\n{}{}",
            gw("a", 1, port),
            gw("b", 2, 22)
        )
    }

    #[test]
    fn a_new_document_shares_the_specs_of_the_objects_it_did_not_change() {
        let earlier = Earlier::default();
        let first = earlier.accept_str(&two_gateways(22), Format::Yaml).unwrap().desired;
        let next = earlier.accept_str(&two_gateways(23), Format::Yaml).unwrap().desired;
        assert!(Arc::ptr_eq(&first.gws["b"], &next.gws["b"]), "the unchanged gateway is shared");
        assert!(!Arc::ptr_eq(&first.gws["a"], &next.gws["a"]), "the changed one is new");
        assert_ne!(first.gws["a"], next.gws["a"]);
        // The same as a document read without an earlier one.
        assert_eq!(next, accept_str(&two_gateways(23), Format::Yaml).unwrap().desired);
        // A refused document leaves the earlier one in place.
        assert!(earlier.accept_str("version: 2\n", Format::Yaml).is_err());
        let again = earlier.accept_str(&two_gateways(23), Format::Yaml).unwrap().desired;
        assert!(Arc::ptr_eq(&next.gws["a"], &again.gws["a"]));
    }
}
