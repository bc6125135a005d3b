//! The skeleton both products share: an object (a load balancer or a NAT
//! gateway) is one *zone*: a namespace whose interfaces carry the engine's
//! programs, a zone id, and rule ids under the object's key prefix. `lb` and
//! `natgw` differ in their plumbing and their rules, not in how a zone is
//! attached, how its unused rule ids are released, or how it is cleared.

use anyhow::{Context, Result};

use crate::outcome::Changes;
use crate::{alloc::Allocations, dataplane::engine::Engine};

/// Where one object's programs run.
pub struct Site {
    /// `lb/<id>` or `natgw/<name>` (`naming`).
    pub zone_key: String,
    /// Prefix of the object's rule keys (`naming`).
    pub rule_prefix: String,
    pub netns: String,
    /// Interfaces inside the namespace that carry the programs (the
    /// loopback's egress is attached too).
    pub ifaces: Vec<String>,
}

/// Attaches the zone's programs to every interface of the site, after
/// writing the fast path's MTUs from the namespace's links and routes (each
/// pass: an MTU changed by hand is taken up by the next repair pass); then,
/// after the first apply over a previous layout, flushes the flows its
/// programs opened, up to the switch, that the zone's ACLs refuse.
pub fn attach(engine: &mut Engine, zone: u16, site: &Site, changes: &mut Changes) -> Result<()> {
    // Never holds the attach back: without current entries the fast path
    // leaves packets to the stack (no entry) or to the FIB's own check.
    if let Err(e) = sync_egress_mtu(engine, zone, &site.netns) {
        tracing::warn!("zone {zone} ({}): fast-path MTUs not written: {e:#}", site.netns);
    }
    for ifname in &site.ifaces {
        engine.attach(zone, &site.netns, ifname)?;
    }
    engine.attach_loopback(zone, &site.netns)?;
    crate::crash::point("zone-attached");
    if let Some(n) = engine.flush_refused_after_attach(zone)? {
        changes.push(format!("ACL: flushed {n} flows the previous programs opened before the switch"));
    }
    Ok(())
}

/// Writes zone `zone`'s `egress_mtu` entries from namespace `netns`.
pub fn sync_egress_mtu(engine: &Engine, zone: u16, netns: &str) -> Result<()> {
    let mtus = crate::netns::run_in(Some(netns), || crate::plumbing::nl::Nl::new()?.egress_mtus())
        .context("reading the namespace's link and route MTUs")?;
    if engine.tables()?.sync_egress_mtu(zone, &mtus)? {
        tracing::info!("zone {zone} ({netns}): fast-path MTUs by interface {mtus:?}");
    }
    Ok(())
}

/// After the rules were synced: releases the rule ids of the object that
/// `in_use` no longer holds, and their statistics (ids are reused).
pub fn release_unused_rules(
    engine: &mut Engine,
    alloc: &mut Allocations,
    site: &Site,
    in_use: &std::collections::BTreeSet<String>,
    changes: &mut Changes,
) -> Result<()> {
    let released = alloc.release_rules(&site.rule_prefix, in_use);
    if !released.is_empty() {
        engine.tables()?.forget_rule_stats(&released)?;
        changes.push(format!("released {} rule ids", released.len()));
    }
    Ok(())
}

/// Detaches the zone's programs and clears its rules, QoS entries and flows
/// (when the object ever got a zone). Its plumbing is the caller's.
pub fn clear(engine: &mut Engine, alloc: &Allocations, site: &Site, changes: &mut Changes) -> Result<()> {
    if let Some(zone) = alloc.zones.get(&site.zone_key).copied() {
        let ifaces: Vec<&str> = site.ifaces.iter().map(String::as_str).collect();
        engine.release(zone, &site.netns, &ifaces);
        let n = engine.clear_zone(zone)?;
        changes.push(format!("removed rules, flushed {n} flows"));
    }
    Ok(())
}

/// Releases every rule id of the object (and their statistics), then its
/// zone id: the last step of removing it.
pub fn release(engine: &mut Engine, alloc: &mut Allocations, site: &Site, changes: &mut Changes) -> Result<()> {
    let released = alloc.release_rules(&site.rule_prefix, &Default::default());
    engine.tables()?.forget_rule_stats(&released)?;
    if let Some(z) = alloc.release_zone(&site.zone_key) {
        changes.push(format!("released zone {z}"));
    }
    Ok(())
}
