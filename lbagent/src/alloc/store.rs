//! Persistence of agent-owned facts in the state directory: one JSON file per
//! kind, written atomically (temp file, fsync, rename), so a crash leaves
//! either the old or the new content.

use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};
use serde::{Serialize, de::DeserializeOwned};

pub struct JsonFile {
    path: PathBuf,
}

impl JsonFile {
    pub fn new(dir: &Path, name: &str) -> Self {
        JsonFile { path: dir.join(name) }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored value, or the default when the file does not exist yet.
    pub fn load<T: DeserializeOwned + Default>(&self) -> Result<T> {
        match fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes).with_context(|| format!("reading {}", self.path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(T::default()),
            Err(e) => Err(e).with_context(|| format!("reading {}", self.path.display())),
        }
    }

    pub fn save<T: Serialize>(&self, value: &T) -> Result<()> {
        let dir = self.path.parent().unwrap_or(Path::new("."));
        crate::files::ensure_private_dir(dir)?;
        let tmp = self.path.with_extension("json.tmp");
        crate::files::write_private(&tmp, &serde_json::to_vec_pretty(value)?, true)?;
        fs::rename(&tmp, &self.path).with_context(|| format!("replacing {}", self.path.display()))?;
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    pub fn remove(&self) -> Result<()> {
        match fs::remove_file(&self.path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alloc::Allocations;

    #[test]
    fn roundtrip_and_default() {
        let dir = std::env::temp_dir().join(format!("lbagent-store-{}", std::process::id()));
        let f = JsonFile::new(&dir, "alloc.json");
        assert_eq!(f.load::<Allocations>().unwrap(), Allocations::default());
        let mut a = Allocations::default();
        a.zone("lb/x").unwrap();
        a.lb_addresses("x", &Default::default()).unwrap();
        a.lb_ports("x", &["b"]).unwrap();
        f.save(&a).unwrap();
        assert_eq!(f.load::<Allocations>().unwrap(), a);
        assert!(!dir.join("alloc.json.tmp").exists());
        std::fs::remove_dir_all(dir).unwrap();
    }
}
