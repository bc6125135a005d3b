//! `lbagent maps [NAME] [--json]`: decode the pinned maps.

use std::path::Path;

use anyhow::{Result, bail};
use lbagent_common::*;
use serde_json::{Map as JsonMap, Value, json};

use super::{format as fmt, map_rows::VIEWS};
use crate::dataplane::{migrate::FROM_VERSION, pins, tables::Tables};

pub fn run(bpffs: &Path, name: Option<&str>, as_json: bool) -> Result<()> {
    if let Some(n) = name
        && map_info(n).is_none()
    {
        let all: Vec<&str> = ALL_MAPS.iter().map(|m| m.name).collect();
        bail!("unknown map {n:?}; maps are: {}", all.join(", "));
    }
    // `meta` alone needs no compatible pins: it says which layout they are.
    let tables = if name == Some(MAP_META.name) { None } else { Some(Tables::open(bpffs)?) };
    let mut out = JsonMap::new();
    for map in ALL_MAPS.iter().map(|m| m.name).filter(|m| name.is_none_or(|n| n == *m)) {
        let (text, value) = match &tables {
            _ if map == MAP_META.name => meta(bpffs),
            Some(tables) => render(tables, map)?,
            None => unreachable!("the tables are open for every map but meta"),
        };
        if as_json {
            out.insert(map.to_string(), value);
        } else {
            println!("== {map} ==");
            print!("{text}");
        }
    }
    if as_json {
        println!("{}", serde_json::to_string_pretty(&Value::Object(out))?);
    }
    Ok(())
}

/// One map as text lines and as JSON.
pub fn render(t: &Tables, map: &str) -> Result<(String, Value)> {
    let Some((_, view)) = VIEWS.iter().find(|(name, _)| *name == map) else {
        bail!("`{map}` is not shown from the tables (`meta`: see `maps::meta`)");
    };
    let shown = view(t, fmt::monotonic_ns())?;
    Ok((shown.text, shown.json))
}

/// `maps meta`: the layout each version directory's pinned `meta` map
/// records, the newest of them (the pinned layout) and whether it is this
/// build's ([`LAYOUT_VERSION`]), with what this build does with it.
pub fn meta(bpffs: &Path) -> (String, Value) {
    let mut dirs = pins::version_dirs(bpffs);
    dirs.sort();
    let mut text = String::new();
    let mut listed = Vec::new();
    let mut pinned: Option<u32> = None;
    for (v, dir) in &dirs {
        let (recorded, state, what) = match pins::meta_version(bpffs, *v) {
            Ok(None) => (None, "no meta", "no meta map".to_string()),
            Err(e) => (None, "unreadable", format!("meta unreadable: {e:#}")),
            Ok(Some(0)) => (Some(0), "unrecorded", "layout not recorded yet".to_string()),
            Ok(Some(r)) if r == *v => (Some(r), "live", format!("records layout {r}: live")),
            Ok(Some(r)) if r > *v => {
                (Some(r), "marker", format!("records layout {r}: a marker (its maps were migrated to layout {r})"))
            }
            Ok(Some(r)) => (Some(r), "inconsistent", format!("records layout {r}, older than its directory")),
        };
        if let Some(r) = recorded.filter(|r| *r != 0) {
            pinned = pinned.max(Some(r));
        }
        text += &format!("{}: {what}\n", dir.display());
        listed.push(json!({"version": v, "path": dir.display().to_string(), "recorded": recorded, "state": state}));
    }
    let here = LAYOUT_VERSION;
    text += &match pinned {
        None => format!("nothing pinned under {} (this lbagent: layout {here})\n", bpffs.display()),
        Some(p) if p == here => format!("pinned layout {p}, the same as this lbagent's\n"),
        Some(p) => {
            let consequence = if p > here {
                "this lbagent refuses to start on these pins (a downgrade)".to_string()
            } else if p == FROM_VERSION {
                "this lbagent migrates them when it starts".to_string()
            } else {
                format!("this lbagent refuses them (it migrates only layout {FROM_VERSION})")
            };
            format!("pinned layout {p}, NOT this lbagent's layout {here}: {consequence}\n")
        }
    };
    let value = json!({"layout_version": pinned, "binary_layout_version": here, "same": pinned == Some(here),
                       "directories": listed});
    (text, value)
}
