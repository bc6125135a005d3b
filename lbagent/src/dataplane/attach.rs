//! Attaching the zone's programs at clsact ingress (the NAT engine) and
//! egress (ICMP errors the namespace generates) of an interface in a namespace.
//!
//! Attachments outlive the agent: netlink filters stay on the qdisc, tcx links
//! are pinned under `<bpffs>/v<N>/links/`. Re-attaching replaces the program
//! in place (netlink: same priority/handle; tcx: `bpf_link_update`), so a
//! restart or upgrade never leaves an interface without its program.

use std::{fmt, path::Path, str::FromStr};

use anyhow::{Context, Result, bail};
use aya::{
    programs::{
        LinkOrder, SchedClassifier, TcAttachType,
        links::{FdLink, Link, PinnedLink},
        tc::{self, NlOptions, SchedClassifierLink, TcAttach, TcHandle},
    },
    util::KernelVersion,
};

use super::pins;
use crate::netns;

/// Priority and handle of lbagent's netlink filters.
const NL_PRIORITY: u16 = 1;
const NL_HANDLE: TcHandle = TcHandle::new(0, 0x1b);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AttachMode {
    /// tcx on kernels >= 6.6, netlink clsact below.
    #[default]
    Auto,
    Netlink,
    Tcx,
}

impl AttachMode {
    pub fn resolve(self) -> AttachMode {
        match self {
            AttachMode::Auto if KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0)) => {
                AttachMode::Tcx
            }
            AttachMode::Auto => AttachMode::Netlink,
            m => m,
        }
    }
}

impl FromStr for AttachMode {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(AttachMode::Auto),
            "netlink" => Ok(AttachMode::Netlink),
            "tcx" => Ok(AttachMode::Tcx),
            _ => bail!("attach mode {s:?}: expected auto, netlink or tcx"),
        }
    }
}

impl fmt::Display for AttachMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttachMode::Auto => "auto",
            AttachMode::Netlink => "netlink",
            AttachMode::Tcx => "tcx",
        })
    }
}

/// Which side of an interface a program runs on, and which program it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Ingress,
    Egress,
}

impl Direction {
    pub const BOTH: [Direction; 2] = [Direction::Ingress, Direction::Egress];

    /// The program of the object that runs on this side.
    pub fn program(self) -> &'static str {
        match self {
            Direction::Ingress => super::PROGRAM,
            Direction::Egress => super::PROGRAM_EGRESS,
        }
    }

    fn attach_type(self) -> TcAttachType {
        match self {
            Direction::Ingress => TcAttachType::Ingress,
            Direction::Egress => TcAttachType::Egress,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// One side of an interface (in a namespace, or the host's when `netns` is `None`).
#[derive(Clone, Debug)]
pub struct Hook<'a> {
    pub netns: Option<&'a str>,
    pub ifname: &'a str,
    pub direction: Direction,
}

impl Hook<'_> {
    /// File name of this hook's pinned tcx link.
    pub fn link_pin_name(&self) -> String {
        // bpffs refuses names with dots.
        format!("{}_{}_{}", self.netns.unwrap_or("host"), self.ifname, self.direction.name())
    }
}

/// Attaches (or replaces in place) `prog` at `hook`.
pub fn attach(prog: &mut SchedClassifier, bpffs: &Path, hook: &Hook<'_>, mode: AttachMode) -> Result<AttachMode> {
    let mode = mode.resolve();
    let pin = pins::links_dir(bpffs).join(hook.link_pin_name());
    let ctx = || format!("attaching to {} ({mode})", hook.ifname);
    // The attach must happen inside the namespace; the pin (a bpffs write)
    // is done from the agent's own thread.
    let new_link = netns::run_in(hook.netns, || {
        let ifindex = netns::ifindex(hook.ifname)?;
        match mode {
            AttachMode::Tcx => attach_tcx(prog, ifindex, hook.direction, &pin),
            _ => attach_netlink(prog, ifindex, hook.direction).map(|()| None),
        }
    })
    .with_context(ctx)?;
    if let Some(link) = new_link {
        pins::ensure_links_dir(bpffs).with_context(ctx)?;
        link.pin(&pin).with_context(|| format!("pinning tcx link at {}", pin.display())).with_context(ctx)?;
    }
    Ok(mode)
}

fn attach_netlink(prog: &mut SchedClassifier, ifindex: u32, dir: Direction) -> Result<()> {
    match tc::qdisc_add_clsact(ifindex) {
        Ok(()) | Err(tc::TcError::AlreadyAttached) => {}
        Err(tc::TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
        Err(e) => return Err(e).context("adding clsact qdisc"),
    }
    let parent = TcHandle::from(dir.attach_type());
    let existing = SchedClassifierLink::attached(ifindex, parent, NL_PRIORITY, NL_HANDLE, None)?;
    let id = match prog.attach_to_link(existing) {
        Ok(id) => id,
        Err(_) => prog.attach(
            ifindex,
            TcAttach::Netlink {
                parent,
                options: NlOptions { priority: NL_PRIORITY, handle: NL_HANDLE, classid: None },
            },
        )?,
    };
    // The filter belongs to the kernel now; dropping the link would delete it.
    std::mem::forget(prog.take_link(id)?);
    Ok(())
}

/// Replaces the program of an existing pinned link, or creates a link and
/// returns it for pinning.
fn attach_tcx(prog: &mut SchedClassifier, ifindex: u32, dir: Direction, pin: &Path) -> Result<Option<FdLink>> {
    if pin.exists() {
        let link: FdLink = PinnedLink::from_pin(pin)?.into();
        match prog.attach_to_link(SchedClassifierLink::try_from(link)?) {
            Ok(id) => {
                drop(prog.take_link(id)?); // closes our fd; the pin keeps the link
                return Ok(None);
            }
            // The interface went away under the link (ENOLINK): start over.
            Err(_) => std::fs::remove_file(pin).with_context(|| format!("removing severed link {}", pin.display()))?,
        }
    }
    let id = prog.attach(ifindex, TcAttach::Tcx { attach_type: dir.attach_type(), order: LinkOrder::default() })?;
    Ok(Some(prog.take_link(id)?.try_into()?))
}

/// Removes lbagent's program from `hook` (both attach kinds; absent is fine).
pub fn detach(bpffs: &Path, hook: &Hook<'_>) -> Result<()> {
    let pin = pins::links_dir(bpffs).join(hook.link_pin_name());
    if pin.exists() {
        let link = PinnedLink::from_pin(&pin)?;
        drop(link.unpin()?); // last reference: the link detaches
    }
    netns::run_in(hook.netns, || {
        let Ok(ifindex) = netns::ifindex(hook.ifname) else { return Ok(()) };
        let parent = TcHandle::from(hook.direction.attach_type());
        let link = SchedClassifierLink::attached(ifindex, parent, NL_PRIORITY, NL_HANDLE, None)?;
        let _ = link.detach();
        Ok(())
    })
}
