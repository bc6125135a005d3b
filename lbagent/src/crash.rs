//! Crash points for tests. A debug build started with
//! `LBAGENT_CRASH_AT=<point>` kills itself with SIGKILL when it reaches
//! that point, as a `kill -9` at the worst moment would: no destructor, no
//! persisting, no cleanup. Release builds (the package) compile every point
//! out.
//!
//! Points: `zone-attached` (an object's rules are written and its programs
//! attached, its ensure not finished).

/// Dies here when this is the point the environment names (debug builds).
pub fn point(name: &str) {
    #[cfg(debug_assertions)]
    {
        static WANT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        if WANT.get_or_init(|| std::env::var("LBAGENT_CRASH_AT").ok()).as_deref() == Some(name) {
            tracing::warn!("crash point {name}: killing this process");
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = name;
}
