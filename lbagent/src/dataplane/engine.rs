//! The engine as the realizers use it: one program instance per zone (loaded
//! on first use, kept for the life of the agent), attachments, and the tables.

use std::{collections::HashMap, path::PathBuf};

use anyhow::Result;

use super::{
    attach::{self, AttachMode, Hook},
    loader::ZoneProgram,
    pins,
    tables::Tables,
};

pub struct Engine {
    pub bpffs: PathBuf,
    pub mode: AttachMode,
    /// Conntrack size (entries, two per flow); `None` = the built-in size.
    pub ct_max: Option<u32>,
    programs: HashMap<u16, ZoneProgram>,
}

impl Engine {
    pub fn new(bpffs: PathBuf, mode: AttachMode) -> Self {
        Engine { bpffs, mode, ct_max: None, programs: HashMap::new() }
    }

    pub fn tables(&self) -> Result<Tables> {
        if !pins::versioned_dir(&self.bpffs).join(lbagent_common::MAP_CT).exists() {
            ZoneProgram::load_sized(&self.bpffs, 0, self.ct_max)?;
        }
        Tables::open(&self.bpffs)
    }

    /// Attaches (or replaces in place) zone `zone`'s program at ingress of
    /// `ifname` in `netns`.
    pub fn attach(&mut self, zone: u16, netns: &str, ifname: &str) -> Result<()> {
        if !self.programs.contains_key(&zone) {
            self.programs.insert(zone, ZoneProgram::load_sized(&self.bpffs, zone, self.ct_max)?);
        }
        let prog = self.programs.get_mut(&zone).unwrap();
        attach::attach(prog.program(), &self.bpffs, &Hook { netns: Some(netns), ifname }, self.mode)?;
        Ok(())
    }

    /// Detaches from interfaces of a namespace about to go and forgets the zone.
    pub fn release(&mut self, zone: u16, netns: &str, ifnames: &[&str]) {
        for ifname in ifnames {
            let _ = attach::detach(&self.bpffs, &Hook { netns: Some(netns), ifname });
        }
        self.programs.remove(&zone);
    }
}
