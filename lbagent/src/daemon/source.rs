//! Where the daemon's desired state comes from.
//!
//! A [`Source`] yields whole documents, each with a revision label: the
//! daemon validates every document the same way and keeps the last good one
//! running whatever the source (a refused document changes nothing). The
//! state file is the first source: polled every second, a change applied
//! once it has stayed the same for a whole poll interval, re-read on SIGHUP
//! (once it stays the same for a poll interval too). etcd is the other (`fleet::source`, docs/operations.md, *Fleet mode*),
//! which also reports the daemon's status back through [`Feedback`].

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use tokio::sync::{Notify, mpsc::UnboundedSender};

use crate::{
    files::{Digest, digest, digest_file},
    state::{self, Accepted, Problems},
};

/// One document from a source.
pub struct Update {
    /// Why it was read ("start", "state file changed", "SIGHUP" …).
    pub why: &'static str,
    /// The source's label for this document (the file's content hash).
    pub revision: String,
    /// The accepted document (typed), or every problem with its path.
    pub state: Result<Accepted, Problems>,
    /// Called by the daemon once it takes the document (valid and allowed
    /// by the mass-removal guard): the etcd source caches it then.
    pub on_accept: Option<Box<dyn FnOnce() + Send>>,
}

/// The daemon's status, shared with its source: `changed` is notified after
/// every apply or refusal (a source that reports status back reads it then;
/// a source may also set `source_problem` and `alive_problem` in it). `stop` turns true when
/// the daemon stops: a source that holds something (etcd's alive lease)
/// releases it then.
#[derive(Clone)]
pub struct Feedback {
    pub status: std::sync::Arc<std::sync::Mutex<super::status::Status>>,
    pub changed: std::sync::Arc<Notify>,
    pub stop: tokio::sync::watch::Receiver<bool>,
}

/// A source of desired state, run as its own task: it sends an [`Update`]
/// at start, on every change, and when `refresh` is notified (SIGHUP).
pub trait Source: Send + 'static {
    /// What the source is, for logs and status (`file /etc/lbagent/state.yaml`).
    fn describe(&self) -> String;

    /// Runs until the receiver is gone.
    fn run(
        self: Box<Self>,
        updates: UnboundedSender<Update>,
        refresh: std::sync::Arc<Notify>,
        feedback: Feedback,
    ) -> tokio::task::JoinHandle<()>;
}

/// The state file.
pub struct FileSource {
    pub path: PathBuf,
    /// How often the file is looked at (a change is applied after it has
    /// been stable for one interval).
    pub poll: Duration,
    /// The last document read: the next one shares its unchanged specs.
    earlier: state::Earlier,
}

impl FileSource {
    pub fn new(path: PathBuf) -> Self {
        FileSource { path, poll: Duration::from_secs(1), earlier: state::Earlier::default() }
    }

    fn read(&self, why: &'static str) -> Update {
        Update {
            why,
            revision: revision(fingerprint(&self.path).as_ref()),
            state: self.earlier.accept_file(&self.path),
            on_accept: None,
        }
    }
}

impl Source for FileSource {
    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }

    fn run(
        self: Box<Self>,
        updates: UnboundedSender<Update>,
        refresh: std::sync::Arc<Notify>,
        feedback: Feedback,
    ) -> tokio::task::JoinHandle<()> {
        // Nothing to release: the source ends as soon as the daemon stops.
        let mut stop = feedback.stop;
        tokio::spawn(async move {
            let mut seen = fingerprint(&self.path);
            if updates.send(self.read("start")).is_err() {
                return;
            }
            let mut pending: Option<Option<Digest>> = None;
            let mut poll = tokio::time::interval(self.poll);
            // Ticks stay a full interval apart even after a slow read (no
            // burst of missed ticks): the stability window depends on it.
            poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let update = tokio::select! {
                    _ = stop.changed() => return,
                    _ = poll.tick() => {
                        // A changed file is read once it has stayed the same for
                        // a whole poll interval: an editor's truncate-and-rewrite
                        // is never applied half-written (a valid prefix such as
                        // `version: 1` alone would tear every object down).
                        let now = fingerprint(&self.path);
                        if now == seen {
                            pending = None;
                            continue;
                        } else if pending.as_ref() == Some(&now) {
                            seen = now;
                            pending = None;
                            self.read("state file changed")
                        } else {
                            pending = Some(now);
                            continue;
                        }
                    }
                    _ = refresh.notified() => {
                        // SIGHUP reads at once, but only a file that stays
                        // the same across one poll interval: a signal sent
                        // in the middle of a write waits for the write.
                        let now = fingerprint(&self.path);
                        tokio::select! {
                            _ = stop.changed() => return,
                            _ = tokio::time::sleep(self.poll) => {}
                        }
                        if fingerprint(&self.path) != now {
                            pending = Some(now);
                            continue;
                        }
                        pending = None;
                        seen = now;
                        self.read("SIGHUP")
                    }
                };
                if updates.send(update).is_err() {
                    return;
                }
            }
        })
    }
}

/// Content fingerprint of the state file (`None` when unreadable): its
/// digest, read in pieces (the file is looked at every poll interval, and
/// may be tens of MB). Only a regular file within the size cap is read (a
/// FIFO would block the loop); anything else changes the fingerprint, and
/// loading refuses it.
fn fingerprint(path: &Path) -> Option<Digest> {
    let meta = std::fs::metadata(path).ok()?;
    if !meta.is_file() || meta.len() > crate::state::load::MAX_STATE_FILE_BYTES {
        return Some(digest(format!("not loadable: {:?} {}", meta.file_type(), meta.len()).as_bytes()));
    }
    digest_file(path).ok()
}

/// A file revision: the first 16 hex digits of its content's SHA-256, or
/// `unreadable`.
fn revision(content: Option<&Digest>) -> String {
    match content {
        Some(d) => d[..8].iter().map(|b| format!("{b:02x}")).collect(),
        None => "unreadable".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revisions_follow_the_content() {
        let rev = |s: &[u8]| revision(Some(&digest(s)));
        assert_eq!(rev(b"version: 1\n"), rev(b"version: 1\n"));
        assert_ne!(rev(b"version: 1\n"), rev(b"version: 1\n\n"));
        assert_eq!(revision(None), "unreadable");
        assert_eq!(rev(b""), "e3b0c44298fc1c14", "SHA-256 of nothing");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_file_source_sends_start_stable_changes_and_refreshes() {
        let dir = std::env::temp_dir().join(format!("lbagent-source-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("state.yaml");
        std::fs::write(&path, "version: 1\n").unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let refresh = std::sync::Arc::new(Notify::new());
        let source = FileSource { poll: Duration::from_millis(20), ..FileSource::new(path.clone()) };
        let (_stop, stop) = tokio::sync::watch::channel(false);
        let feedback = Feedback { status: Default::default(), changed: Default::default(), stop };
        let task = Box::new(source).run(tx, refresh.clone(), feedback);
        let first = rx.recv().await.unwrap();
        assert_eq!(first.why, "start");
        assert!(first.state.is_ok());
        // A change is sent once it has been stable for a poll interval.
        std::fs::write(&path, "version: 2\n").unwrap();
        let changed = rx.recv().await.unwrap();
        assert_eq!(changed.why, "state file changed");
        assert!(changed.state.is_err(), "version 2 is refused");
        assert_ne!(changed.revision, first.revision);
        // A refresh re-reads at once, even unchanged.
        refresh.notify_one();
        let again = rx.recv().await.unwrap();
        assert_eq!((again.why, again.revision), ("SIGHUP", changed.revision));
        drop(rx);
        refresh.notify_one();
        task.await.unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
