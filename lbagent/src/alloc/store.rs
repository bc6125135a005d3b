//! Persistence of agent-owned facts in the state directory: one JSON file per
//! kind, written atomically (temp file, fsync, rename), so a crash leaves
//! either the old or the new content.

use std::{
    fs,
    path::{Path, PathBuf},
    sync::Mutex,
};

use anyhow::{Context, Result};
use serde::{Serialize, de::DeserializeOwned};

use crate::files::{Digest, Hasher, HashingReader};

pub struct JsonFile {
    path: PathBuf,
    /// The digest of the bytes last read or written: a save of the same
    /// content writes nothing (a repair pass persists after every object's
    /// step; at hundreds of objects, rewriting and syncing unchanged files
    /// was most of its cost). A digest, not the bytes: at 100 000 rules the
    /// applied record is ~23 MB of JSON.
    last: Mutex<Option<Digest>>,
}

impl JsonFile {
    pub fn new(dir: &Path, name: &str) -> Self {
        JsonFile { path: dir.join(name), last: Mutex::new(None) }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored value, or the default when the file does not exist yet.
    /// Read as it streams from the file (never whole), digested on the way.
    pub fn load<T: DeserializeOwned + Default>(&self) -> Result<T> {
        match fs::File::open(&self.path) {
            Ok(f) => {
                // Digested as the buffer fills (serde_json reads a byte at
                // a time from it).
                let mut r = std::io::BufReader::with_capacity(64 * 1024, HashingReader::new(f));
                let value =
                    serde_json::from_reader(&mut r).with_context(|| format!("reading {}", self.path.display()))?;
                // serde_json read up to the end, checking that only
                // whitespace follows: the digest is the whole file's.
                *self.last.lock().unwrap() = Some(r.into_inner().finish());
                Ok(value)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(T::default()),
            Err(e) => Err(e).with_context(|| format!("reading {}", self.path.display())),
        }
    }

    /// Writes `value` unless the file holds it already (as this handle
    /// last read or wrote it, and as the file still is). The value is
    /// serialized into its digest first, then, when it changed, into the
    /// file: never into memory whole (the applied record is ~23 MB of JSON
    /// at 100 000 rules).
    pub fn save<T: Serialize>(&self, value: &T) -> Result<()> {
        let mut hasher = std::io::BufWriter::with_capacity(64 * 1024, Hasher::new());
        serde_json::to_writer_pretty(&mut hasher, value)?;
        let sum = hasher.into_inner().map_err(|e| e.into_error())?.finish();
        let mut last = self.last.lock().unwrap();
        // The same content as last time, and the file still holds it (not
        // deleted or replaced by someone else): nothing to write.
        if *last == Some(sum) && crate::files::digest_file(&self.path).ok() == Some(sum) {
            return Ok(());
        }
        let dir = self.path.parent().unwrap_or(Path::new("."));
        crate::files::ensure_private_dir(dir)?;
        let tmp = self.path.with_extension("json.tmp");
        crate::files::write_private_with(&tmp, true, |w| Ok(serde_json::to_writer_pretty(w, value)?))?;
        fs::rename(&tmp, &self.path).with_context(|| format!("replacing {}", self.path.display()))?;
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
        *last = Some(sum);
        Ok(())
    }

    pub fn remove(&self) -> Result<()> {
        *self.last.lock().unwrap() = None;
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

    #[test]
    fn unchanged_content_is_not_rewritten() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("lbagent-store-same-{}", std::process::id()));
        let f = JsonFile::new(&dir, "alloc.json");
        let mut a = Allocations::default();
        a.zone("lb/x").unwrap();
        f.save(&a).unwrap();
        let inode = || std::fs::metadata(f.path()).unwrap().ino();
        let first = inode();
        f.save(&a).unwrap();
        assert_eq!(inode(), first, "the same content is not written again");
        // Read by a new handle (a restart): still nothing to write.
        let g = JsonFile::new(&dir, "alloc.json");
        assert_eq!(g.load::<Allocations>().unwrap(), a);
        g.save(&a).unwrap();
        assert_eq!(inode(), first);
        a.zone("lb/y").unwrap();
        g.save(&a).unwrap();
        assert_ne!(inode(), first, "a change is written (atomically: a new file)");
        // A deleted file is written again even when the content is the same.
        std::fs::remove_file(g.path()).unwrap();
        g.save(&a).unwrap();
        assert_eq!(g.load::<Allocations>().unwrap(), a);
        // So is one that someone replaced with other content.
        std::fs::write(g.path(), b"{}").unwrap();
        g.save(&a).unwrap();
        assert_eq!(g.load::<Allocations>().unwrap(), a);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
