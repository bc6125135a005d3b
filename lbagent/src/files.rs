//! Files and directories the agent owns (state dir, haproxy's dir, the API
//! socket's dir): created private (0700 / 0600), written without following
//! symlinks, and refused when someone else could write them — whoever can
//! write the agent's directories can steer a root process.

use std::{
    fs,
    io::Write,
    os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt},
    path::Path,
};

use anyhow::{Context, Result, bail};

/// Checks that `dir` is a real directory (not a symlink) of this agent's
/// user or root that no other user can write.
pub fn check_private_dir(dir: &Path) -> Result<()> {
    let m = fs::symlink_metadata(dir).with_context(|| format!("{}", dir.display()))?;
    let me = nix::unistd::geteuid().as_raw();
    if !m.is_dir() {
        bail!("{} is not a directory", dir.display());
    }
    if m.uid() != me && m.uid() != 0 {
        bail!("{} is owned by uid {}, not by this agent (uid {me}) or root", dir.display(), m.uid());
    }
    if m.mode() & 0o022 != 0 {
        bail!("{} is writable by other users (mode {:o}); use a private directory", dir.display(), m.mode() & 0o7777);
    }
    Ok(())
}

/// Creates `dir` (mode 0700, parents as needed) unless it exists, then
/// checks it with `check_private_dir`.
pub fn ensure_private_dir(dir: &Path) -> Result<()> {
    if !dir.exists() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("creating {}", dir.display()))?;
    }
    check_private_dir(dir)
}

/// Writes `bytes` to a new file `path` with mode 0600, not following a
/// symlink planted there (a leftover file of that name is replaced).
pub fn write_private(path: &Path, bytes: &[u8], sync: bool) -> Result<()> {
    write_private_with(path, sync, |w| Ok(w.write_all(bytes)?))
}

/// [`write_private`] of what `write` writes, through a buffer (a large
/// record is never held whole).
pub fn write_private_with(path: &Path, sync: bool, write: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("removing {}", path.display()));
        }
        _ => {}
    }
    let f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    let mut w = std::io::BufWriter::with_capacity(64 * 1024, f);
    write(&mut w)?;
    let f = w.into_inner().map_err(|e| e.into_error()).with_context(|| format!("writing {}", path.display()))?;
    if sync {
        f.sync_all()?;
    }
    Ok(())
}

/// An exclusive advisory lock (flock) on a file or directory, held until
/// dropped (or the process dies: a kill -9 frees it).
pub struct Lock {
    _f: nix::fcntl::Flock<fs::File>,
}

/// Takes the lock on `path` (a directory, or a file created 0600) without
/// waiting; `what` names it in the error when another process holds it.
pub fn lock(path: &Path, what: &str) -> Result<Lock> {
    let f = if path.is_dir() {
        fs::File::open(path)
    } else {
        fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
    }
    .with_context(|| format!("opening {}", path.display()))?;
    match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(f) => Ok(Lock { _f: f }),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            bail!("another lbagent is using {what} {} (one agent per state dir and bpffs)", path.display())
        }
        Err((_, e)) => Err(e).with_context(|| format!("locking {}", path.display())),
    }
}

/// SHA-256 of some content: what the agent keeps of a file to know whether
/// it changed, instead of the file itself (the state file and the applied
/// record reach tens of MB at 100 000 rules).
pub type Digest = [u8; 32];

/// The digest of `bytes`.
pub fn digest(bytes: &[u8]) -> Digest {
    let mut h = Hasher::new();
    h.update(bytes);
    h.finish()
}

/// A SHA-256 digest of what is written into it (a serializer's output,
/// never held whole) or fed to it.
pub struct Hasher(ring::digest::Context);

impl Hasher {
    pub fn new() -> Self {
        Hasher(ring::digest::Context::new(&ring::digest::SHA256))
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub fn finish(self) -> Digest {
        self.0.finish().as_ref().try_into().expect("SHA-256 is 32 bytes")
    }
}

impl Default for Hasher {
    fn default() -> Self {
        Self::new()
    }
}

impl Write for Hasher {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Reads from `inner` and digests what it read.
pub struct HashingReader<R> {
    inner: R,
    hasher: Hasher,
}

impl<R> HashingReader<R> {
    pub fn new(inner: R) -> Self {
        HashingReader { inner, hasher: Hasher::new() }
    }

    /// The digest of everything read so far.
    pub fn finish(self) -> Digest {
        self.hasher.finish()
    }
}

impl<R: std::io::Read> std::io::Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// The digest of the file at `path`, read in pieces (never whole).
pub fn digest_file(path: &Path) -> std::io::Result<Digest> {
    let mut r = HashingReader::new(fs::File::open(path)?);
    std::io::copy(&mut r, &mut std::io::sink())?;
    Ok(r.finish())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn private_files_replace_planted_symlinks_and_dirs_must_be_private() {
        let dir = std::env::temp_dir().join(format!("lbagent-files-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        ensure_private_dir(&dir.join("sd")).unwrap();
        assert_eq!(fs::metadata(dir.join("sd")).unwrap().permissions().mode() & 0o777, 0o700);
        let victim = dir.join("victim");
        fs::write(&victim, "keep").unwrap();
        let planted = dir.join("sd/state.json.tmp");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        write_private(&planted, b"new", false).unwrap();
        assert_eq!(fs::read_to_string(&victim).unwrap(), "keep", "the symlink was followed");
        assert_eq!(fs::symlink_metadata(&planted).unwrap().permissions().mode() & 0o777, 0o600);
        let open = dir.join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).unwrap();
        assert!(check_private_dir(&open).unwrap_err().to_string().contains("writable by other users"));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_digest_is_its_content_digest() {
        let path = std::env::temp_dir().join(format!("lbagent-digest-{}", std::process::id()));
        // Several read pieces, the last one short.
        let content: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &content).unwrap();
        assert_eq!(digest_file(&path).unwrap(), digest(&content));
        std::fs::write(&path, b"").unwrap();
        assert_eq!(digest_file(&path).unwrap(), digest(b""));
        assert_ne!(digest(b"a"), digest(b"b"));
        std::fs::remove_file(&path).unwrap();
        assert!(digest_file(&path).is_err());
    }
}
