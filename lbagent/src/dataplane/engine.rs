//! The engine as the realizers use it: one program instance per zone (loaded
//! on first use, kept for the life of the agent), attachments, the tables,
//! and each zone's rule entries read once per pass.

use std::{collections::HashMap, path::PathBuf};

use anyhow::Result;

use super::{
    attach::{self, AttachMode, Direction, Hook},
    loader::{CtSizes, GuardProgram, ZoneProgram},
    pins,
    sync::{self, DnatEntry, SnatEntry},
    tables::{DnatSpec, SnatSpec, Tables},
};
use crate::outcome::Changes;

const LOOPBACK: &str = "lo";

pub struct Engine {
    pub bpffs: PathBuf,
    pub mode: AttachMode,
    /// The conntrack tables' sizes.
    pub ct_sizes: CtSizes,
    /// The host's default share of the conntrack tables per zone
    /// (`agent.conntrack_limits`).
    pub ct_limits: crate::state::model::ConntrackLimits,
    programs: HashMap<u16, ZoneProgram>,
    /// The proxy guard, loaded on first use, shared by every load balancer.
    guard: Option<GuardProgram>,
    /// Every zone's rule entries, read from the maps at the first sync of a
    /// pass and kept equal to what the syncs write; `None` = read again.
    rules: Option<ZoneRules>,
    /// Set while an upgrade's migration is under way (until its first
    /// complete pass): every zone's ACLs are flushed by once its programs
    /// are attached (`flush_refused_after_attach`), also after a crash in
    /// the middle of that pass.
    pub migrating: bool,
    /// Zones whose flows the ACLs they hold now must be flushed by once
    /// their programs are attached: written afresh (the maps held none of
    /// the zone's rules: an upgrade, a new object) or written during a
    /// migration. Kept current by every sync until then.
    flush_after_attach: HashMap<u16, sync::RuleAcls>,
}

/// DNAT and SNAT entries of the maps, by zone.
#[derive(Default)]
struct ZoneRules {
    dnat: HashMap<u16, Vec<DnatEntry>>,
    snat: HashMap<u16, Vec<SnatEntry>>,
}

impl ZoneRules {
    fn read(t: &Tables) -> Result<Self> {
        let mut r = ZoneRules::default();
        for e in t.dnat_rules()? {
            r.dnat.entry(e.0.zone).or_default().push(e);
        }
        for e in t.snat_rules()? {
            r.snat.entry(e.1.zone).or_default().push(e);
        }
        Ok(r)
    }
}

impl Engine {
    pub fn new(bpffs: PathBuf, mode: AttachMode) -> Self {
        Engine {
            bpffs,
            mode,
            ct_sizes: CtSizes::default(),
            ct_limits: Default::default(),
            programs: HashMap::new(),
            guard: None,
            rules: None,
            migrating: false,
            flush_after_attach: HashMap::new(),
        }
    }

    /// Starts a pass: the next sync reads the maps again (one read for all
    /// zones), so a repair pass also repairs entries changed behind our back.
    pub fn begin_pass(&mut self) {
        self.rules = None;
    }

    /// Repairs a pin directory deleted under the running agent. The loaded
    /// programs still hold the maps (every flow, every rule); the next load
    /// would otherwise create fresh, empty maps that the running programs
    /// never see — rules and flows split between two sets of maps. So the
    /// maps are re-pinned from a loaded program (by their kernel names,
    /// `pin_name_of`); the links the deletion detached are re-attached by the
    /// repair pass with the same programs. Returns the re-pinned maps.
    pub fn repair_pins(&mut self) -> Result<Vec<String>> {
        let dir = pins::versioned_dir(&self.bpffs);
        if dir.join(lbagent_common::MAP_CT.name).exists() || (self.programs.is_empty() && self.guard.is_none()) {
            return Ok(vec![]);
        }
        pins::ensure_bpffs(&self.bpffs)?;
        pins::check_meta(&self.bpffs)?;
        pins::ensure_versioned_dir(&self.bpffs)?;
        let mut ids = Vec::new();
        if let Some(prog) = self.programs.values_mut().next() {
            for direction in Direction::BOTH {
                ids.extend(prog.program_for(direction).info()?.map_ids()?.unwrap_or_default());
            }
        }
        if let Some(guard) = &mut self.guard {
            ids.extend(guard.program().info()?.map_ids()?.unwrap_or_default());
        }
        ids.sort_unstable();
        ids.dedup();
        let mut repinned = Vec::new();
        for id in ids {
            let map = aya::maps::MapData::from_id(id)?;
            let info = map.info()?;
            let Some(name) = info.name_as_str().and_then(lbagent_common::pin_name_of) else { continue };
            if !dir.join(name).exists() {
                map.pin(dir.join(name))?;
                repinned.push(name.to_string());
            }
        }
        if !dir.join(lbagent_common::MAP_META.name).exists() {
            // No program uses `meta` (a layout marker only): a new one.
            ZoneProgram::load_sized(&self.bpffs, 0, self.ct_sizes)?;
        }
        repinned.sort();
        Ok(repinned)
    }

    fn zone_rules(&mut self, t: &Tables) -> Result<&mut ZoneRules> {
        if self.rules.is_none() {
            self.rules = Some(ZoneRules::read(t)?);
        }
        Ok(self.rules.as_mut().unwrap())
    }

    /// Makes `zone`'s DNAT and SNAT entries equal `dnats` and `snats`,
    /// writing only what differs; `snats: None` leaves SNAT alone.
    pub fn sync_zone(
        &mut self,
        zone: u16,
        dnats: &[DnatSpec],
        snats: Option<&[SnatSpec]>,
        changes: &mut Changes,
    ) -> Result<()> {
        let t = self.tables()?;
        let was_pending = self.migrating || self.flush_after_attach.contains_key(&zone);
        let rules = self.zone_rules(&t)?;
        let have_dnat = rules.dnat.remove(&zone).unwrap_or_default();
        let have_snat = rules.snat.remove(&zone).unwrap_or_default();
        // Decided before anything is written: a sync that fails half-way
        // leaves rules in the maps, and the next pass would not tell.
        let pending = was_pending || have_dnat.is_empty();
        let acls = if pending { sync::rule_acls(dnats) } else { sync::RuleAcls::new() };
        let result = sync::dnat(&t, &have_dnat, dnats, changes).and_then(|()| match snats {
            Some(snats) => sync::snat(&t, &have_snat, snats, changes),
            None => Ok(()),
        });
        match result {
            Ok(()) => {
                rules.dnat.insert(zone, dnats.iter().map(sync::dnat_entry).collect());
                let snat_now = match snats {
                    Some(snats) => snats.iter().map(sync::snat_entry).collect(),
                    None => have_snat,
                };
                rules.snat.insert(zone, snat_now);
            }
            // Half written: read the maps again next time.
            Err(_) => self.rules = None,
        }
        if acls.is_empty() {
            self.flush_after_attach.remove(&zone);
        } else {
            self.flush_after_attach.insert(zone, acls);
        }
        result
    }

    /// Removes every rule of `zone` and flushes its flows; returns the flow count.
    pub fn clear_zone(&mut self, zone: u16) -> Result<usize> {
        self.sync_zone(zone, &[], Some(&[]), &mut Changes::new())?;
        let t = self.tables()?;
        t.sync_qos(zone, &super::qos::QosZone::default())?;
        t.clear_egress_mtu(zone)?;
        t.clear_zone_ct(zone)?;
        t.flush_conntrack(|k, _| k.zone == zone)
    }

    /// Writes zone `zone`'s share of the conntrack tables: the object's own
    /// limits (`own`), else the host's, else half of `ct` for established
    /// flows (one zone never fills it; a refused promotion only keeps the
    /// flow in `ct_new`) and no limit on new ones (a new-flow limit drops
    /// flows, which only an operator who sized it should ask for). Returns
    /// whether they changed.
    pub fn set_zone_ct_limits(&self, zone: u16, own: &crate::state::model::ConntrackLimits) -> Result<bool> {
        // Flows are two entries each.
        let default = lbagent_common::ZoneCtLimits { established: self.ct_sizes.established / 4, new: 0 };
        self.tables()?.set_zone_ct_limits(zone, own.resolve(&self.ct_limits, default))
    }

    pub fn tables(&self) -> Result<Tables> {
        if !pins::versioned_dir(&self.bpffs).join(lbagent_common::MAP_CT.name).exists() {
            ZoneProgram::load_sized(&self.bpffs, 0, self.ct_sizes)?;
        }
        Tables::open(&self.bpffs)
    }

    /// Attaches (or replaces in place) zone `zone`'s programs at ingress and
    /// egress of `ifname` in `netns`.
    pub fn attach(&mut self, zone: u16, netns: &str, ifname: &str) -> Result<()> {
        self.attach_on(zone, netns, ifname, &Direction::BOTH)
    }

    /// Attaches the egress program to the namespace's `lo`: ICMP errors the
    /// namespace addresses to its own SNAT address are sent out from there.
    pub fn attach_loopback(&mut self, zone: u16, netns: &str) -> Result<()> {
        self.attach_on(zone, netns, LOOPBACK, &[Direction::Egress])
    }

    fn attach_on(&mut self, zone: u16, netns: &str, ifname: &str, directions: &[Direction]) -> Result<()> {
        if !self.programs.contains_key(&zone) {
            self.programs.insert(zone, ZoneProgram::load_sized(&self.bpffs, zone, self.ct_sizes)?);
        }
        let prog = self.programs.get_mut(&zone).unwrap();
        for &direction in directions {
            let hook = Hook { netns: Some(netns), ifname, direction };
            attach::attach(prog.program_for(direction), &self.bpffs, &hook, self.mode)?;
        }
        Ok(())
    }

    /// Attaches (or replaces in place) the proxy guard at egress of the
    /// host's link `ifname`, after letting haproxy's workers (`uid`) through.
    pub fn attach_proxy_guard(&mut self, ifname: &str, uid: Option<u32>) -> Result<()> {
        // The guard's maps are pinned by the first load of the guard.
        if self.guard.is_none() {
            self.guard = Some(GuardProgram::load(&self.bpffs, self.ct_sizes)?);
        }
        self.tables()?.set_proxy_guard(uid)?;
        let hook = Hook { netns: None, ifname, direction: Direction::Egress };
        attach::attach(self.guard.as_mut().unwrap().program(), &self.bpffs, &hook, self.mode)?;
        Ok(())
    }

    /// Removes the proxy guard from the host's link `ifname` (absent is fine).
    pub fn detach_proxy_guard(&self, ifname: &str) -> Result<()> {
        attach::detach(&self.bpffs, &Hook { netns: None, ifname, direction: Direction::Egress })
    }

    /// Once `zone`'s programs are attached after a sync that wrote its ACLs
    /// afresh or during a migration: flushes the flows the zone's ACLs
    /// refuse. Until the attach, the previous programs still ran the zone
    /// with the old ACL and opened flows, which the new programs adopt.
    /// Returns the flows flushed, `None` when no sync left ACLs to flush by.
    pub fn flush_refused_after_attach(&mut self, zone: u16) -> Result<Option<usize>> {
        let Some(acls) = self.flush_after_attach.get(&zone) else { return Ok(None) };
        let n = sync::flush_refused(&self.tables()?, zone, acls)?;
        self.flush_after_attach.remove(&zone);
        Ok(Some(n))
    }

    /// Detaches from interfaces of a namespace about to go (and its `lo`)
    /// and forgets the zone.
    pub fn release(&mut self, zone: u16, netns: &str, ifnames: &[&str]) {
        self.flush_after_attach.remove(&zone);
        for ifname in ifnames.iter().chain(&[LOOPBACK]) {
            for direction in Direction::BOTH {
                let _ = attach::detach(&self.bpffs, &Hook { netns: Some(netns), ifname, direction });
            }
        }
        self.programs.remove(&zone);
        if let Err(e) = pins::remove_zone_programs(&self.bpffs, zone) {
            tracing::warn!("zone {zone}: removing its pinned programs: {e:#}");
        }
    }
}
