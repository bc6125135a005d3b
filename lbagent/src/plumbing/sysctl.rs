//! Per-namespace sysctls. `/proc/sys/net` resolves to the namespace of the
//! thread that opens it, so call these inside `netns::run_in`.

use anyhow::{Context, Result};

pub fn set(key: &str, value: &str) -> Result<()> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    if std::fs::read_to_string(&path).map(|v| v.trim() == value).unwrap_or(false) {
        return Ok(());
    }
    std::fs::write(&path, value).with_context(|| format!("sysctl {key}={value}"))
}

/// Forwarding on; the engine SNATs before routing, so sources that are this
/// namespace's own addresses must be accepted on `ifaces`.
pub fn router(ifaces: &[&str]) -> Result<()> {
    set("net.ipv4.ip_forward", "1")?;
    set("net.ipv4.conf.all.rp_filter", "0")?;
    for i in ifaces {
        set(&format!("net.ipv4.conf.{i}.rp_filter"), "0")?;
        set(&format!("net.ipv4.conf.{i}.accept_local"), "1")?;
    }
    Ok(())
}
