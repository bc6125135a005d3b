//! Crash points for tests. A debug build started with
//! `LBAGENT_CRASH_AT=<point>` kills itself with SIGKILL when it reaches
//! that point, as a `kill -9` at the worst moment would: no destructor, no
//! persisting, no cleanup. Release builds (the package) compile every point
//! out.
//!
//! Points: `zone-attached` (an object's rules are written and its programs
//! attached, its ensure not finished).
//!
//! Pauses, the same way: `LBAGENT_PAUSE_AT=<point>:<ms>` makes a debug
//! build sleep there, as a host with hundreds of objects takes that long.
//! Points: `repair-step` (before each object a repair pass re-ensures),
//! `gc-pass` (the start of a conntrack garbage collection pass, on its
//! thread). A pause is logged when it starts.

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

/// Sleeps here for the milliseconds the environment names for this point
/// (debug builds).
pub fn pause(name: &str) {
    #[cfg(debug_assertions)]
    {
        static WANT: std::sync::OnceLock<Option<(String, u64)>> = std::sync::OnceLock::new();
        let want = WANT.get_or_init(|| {
            let v = std::env::var("LBAGENT_PAUSE_AT").ok()?;
            let (point, ms) = v.split_once(':')?;
            Some((point.to_string(), ms.parse().ok()?))
        });
        if let Some((point, ms)) = want
            && point == name
        {
            tracing::warn!("pause point {name}: sleeping {ms} ms");
            std::thread::sleep(std::time::Duration::from_millis(*ms));
        }
    }
    #[cfg(not(debug_assertions))]
    let _ = name;
}
