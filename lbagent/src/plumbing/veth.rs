//! Veth pairs with one end inside a namespace, the other in the host.
//!
//! Host-side links live in a namespace the agent shares with everything
//! else on the machine, so the agent proves ownership before deleting one:
//! it writes an alias (`naming::link_owner_alias`) on every host end it
//! creates, and deletes a host link only when that alias is the caller's.

use anyhow::{Result, bail};

use super::nl::Nl;
use crate::netns;
use crate::outcome::Changes;

/// Ensures the pair `host`/`inside` with `inside` in namespace `ns`, the
/// host end carrying alias `owner`. A missing inside end is repaired by
/// recreating the pair; a leftover host end is deleted first only if it is
/// `owner`'s (a foreign link of that name is an error, never deleted). When
/// `inside` may clash with a host link name (`eth0`), the pair is created
/// with `tmp` as the peer name and renamed inside.
pub fn ensure_pair(
    ns: &str,
    host: &str,
    inside: &str,
    tmp: Option<&str>,
    owner: &str,
    changes: &mut Changes,
) -> Result<()> {
    if netns::run_in(Some(ns), || Ok(Nl::new()?.index(inside)?.is_some()))? {
        // Pairs made before links carried aliases are adopted: the inside
        // end in the object's own namespace shows the pair is ours.
        return netns::run_in(None, || {
            let nl = Nl::new()?;
            if let Some(i) = nl.index(host)?
                && nl.alias(i)?.is_empty()
            {
                nl.set_alias(i, owner)?;
            }
            Ok(())
        });
    }
    let peer = tmp.unwrap_or(inside);
    let ns_file = netns::open(ns)?;
    netns::run_in(None, || {
        let nl = Nl::new()?;
        delete_owned(&nl, host, owner)?;
        if tmp.is_some() {
            delete_owned(&nl, peer, owner)?;
        }
        nl.ensure_veth(host, peer)?;
        nl.set_alias(nl.must_index(host)?, owner)?;
        nl.set_alias(nl.must_index(peer)?, owner)?;
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

/// Deletes host link `name` if it exists and carries alias `owner`; a link
/// of that name owned by anyone else is an error. Returns whether deleted.
fn delete_owned(nl: &Nl, name: &str, owner: &str) -> Result<bool> {
    let Some(i) = nl.index(name)? else { return Ok(false) };
    let alias = nl.alias(i)?;
    if alias != owner {
        bail!(
            "link {name} exists in the host namespace and is not this object's (alias {alias:?}, expected \
             {owner:?}); refusing to delete it: rename or remove it"
        );
    }
    nl.delete(name)
}

/// Deletes `owner`'s host-namespace links (absent ones are fine; a link of
/// one of these names that is not `owner`'s is left alone and reported).
pub fn delete_host_links(names: &[&str], owner: &str, changes: &mut Changes) -> Result<()> {
    let deleted = netns::run_in(None, || {
        let nl = Nl::new()?;
        let mut d = Vec::new();
        for name in names {
            match delete_owned(&nl, name, owner) {
                Ok(true) => d.push(format!("deleted {name}")),
                Ok(false) => {}
                Err(e) => d.push(format!("left {name} alone: {e:#}")),
            }
        }
        Ok(d)
    })?;
    changes.extend(deleted);
    Ok(())
}
