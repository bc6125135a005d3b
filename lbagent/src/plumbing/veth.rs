//! Veth pairs with one end inside a namespace, the other in the host.

use anyhow::Result;

use super::nl::Nl;
use crate::netns;

/// Ensures the pair `host`/`inside` with `inside` in namespace `ns`. A missing
/// inside end is repaired by recreating the pair (a leftover host end is
/// deleted first). When `inside` may clash with a host link name (`eth0`),
/// the pair is created with `tmp` as the peer name and renamed inside.
pub fn ensure_pair(ns: &str, host: &str, inside: &str, tmp: Option<&str>, changes: &mut Vec<String>) -> Result<()> {
    if netns::run_in(Some(ns), || Ok(Nl::new()?.index(inside)?.is_some()))? {
        return Ok(());
    }
    let peer = tmp.unwrap_or(inside);
    let ns_file = netns::open(ns)?;
    netns::run_in(None, || {
        let nl = Nl::new()?;
        nl.delete(host)?;
        nl.ensure_veth(host, peer)?;
        nl.move_to(peer, &ns_file)
    })?;
    if peer != inside {
        netns::run_in(Some(ns), || {
            let nl = Nl::new()?;
            nl.rename(nl.must_index(peer)?, inside)
        })?;
    }
    changes.push(format!("created veth {host} <-> {ns}/{inside}"));
    Ok(())
}

/// Deletes host-namespace links (absent ones are fine).
pub fn delete_host_links(names: &[&str], changes: &mut Vec<String>) -> Result<()> {
    let deleted = netns::run_in(None, || {
        let nl = Nl::new()?;
        let mut d = Vec::new();
        for name in names {
            if nl.delete(name)? {
                d.push(format!("deleted {name}"));
            }
        }
        Ok(d)
    })?;
    changes.extend(deleted);
    Ok(())
}
