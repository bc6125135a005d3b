//! External programs the agent runs (haproxy, ovs-vsctl), always by absolute
//! path: a root daemon never looks them up in `$PATH`, which whoever starts
//! it controls. Each is searched in the system directories below, in order;
//! `LBAGENT_TOOL_DIRS` (colon-separated absolute directories) replaces the
//! list for installations elsewhere.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

pub const HAPROXY: &str = "haproxy";
pub const OVS_VSCTL: &str = "ovs-vsctl";

const SYSTEM_DIRS: &[&str] = &["/usr/sbin", "/usr/bin", "/sbin", "/bin", "/usr/local/sbin", "/usr/local/bin"];

fn dirs() -> Vec<PathBuf> {
    match std::env::var("LBAGENT_TOOL_DIRS") {
        Ok(v) if !v.is_empty() => v.split(':').map(PathBuf::from).filter(|p| p.is_absolute()).collect(),
        _ => SYSTEM_DIRS.iter().map(PathBuf::from).collect(),
    }
}

/// Absolute path of tool `name`.
pub fn path(name: &str) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    for d in dirs() {
        let p = d.join(name);
        if let Ok(m) = std::fs::metadata(&p)
            && m.is_file()
            && m.permissions().mode() & 0o111 != 0
        {
            return Ok(p);
        }
    }
    bail!(
        "{name} not found in {} (is it installed?)",
        dirs().iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
    )
}

/// `std::process::Command` for tool `name` by absolute path.
pub fn command(name: &str) -> Result<std::process::Command> {
    Ok(std::process::Command::new(path(name)?))
}

/// Whether `exe` (a `/proc/<pid>/exe` target) is tool `name`. A process
/// whose binary was replaced on disk since it started (a package upgrade
/// renames the new file over the old) reads `<path> (deleted)`: it still
/// runs the tool that was at that path.
pub fn is(exe: &Path, name: &str) -> bool {
    let Some(tool) = path(name).ok().and_then(|p| p.canonicalize().ok()) else { return false };
    let exe = exe.as_os_str().as_encoded_bytes();
    let exe = exe.strip_suffix(DELETED).unwrap_or(exe);
    exe == tool.as_os_str().as_encoded_bytes()
}

/// What the kernel appends to `/proc/<pid>/exe` once the file is gone.
const DELETED: &[u8] = b" (deleted)";
