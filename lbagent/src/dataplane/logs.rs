//! eBPF-side logs (aya-log). Every program instance has its own ring buffer;
//! when logs are on, each instance's buffer is registered here and a thread
//! drains them into the `log` facade (bridged to `tracing`: target
//! `lbagent_ebpf`). The level is a constant of each program (`AYA_LOG_LEVEL`):
//! `off` compiles to a branch that skips every log statement.

use std::{
    str::FromStr,
    sync::{
        Mutex, Once,
        atomic::{AtomicU8, Ordering},
    },
    time::Duration,
};

use anyhow::{Result, bail};
use aya::Ebpf;
use aya_log::EbpfLogger;

/// 0 = off, else an `aya_log::Level` (1 error … 5 trace).
static LEVEL: AtomicU8 = AtomicU8::new(0);
static LOGGERS: Mutex<Vec<EbpfLogger<&'static dyn log::Log>>> = Mutex::new(Vec::new());
static DRAIN: Once = Once::new();

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EbpfLogLevel(pub u8);

impl FromStr for EbpfLogLevel {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(EbpfLogLevel(match s {
            "off" => 0,
            "error" => 1,
            "warn" => 2,
            "info" => 3,
            "debug" => 4,
            "trace" => 5,
            _ => bail!("eBPF log level {s:?}: expected off, error, warn, info, debug or trace"),
        }))
    }
}

/// Sets the level for programs loaded from now on.
pub fn set_level(level: EbpfLogLevel) {
    LEVEL.store(level.0, Ordering::Relaxed);
}

pub fn level() -> u8 {
    LEVEL.load(Ordering::Relaxed)
}

/// Takes the log ring buffer of a freshly loaded object and drains it in
/// the background (no-op when logs are off).
pub fn attach(ebpf: &mut Ebpf) {
    if level() == 0 {
        return;
    }
    match EbpfLogger::init(ebpf) {
        Ok(logger) => LOGGERS.lock().unwrap().push(logger),
        Err(e) => tracing::warn!("eBPF logs unavailable: {e}"),
    }
    DRAIN.call_once(|| {
        std::thread::spawn(|| {
            loop {
                std::thread::sleep(Duration::from_millis(100));
                for l in LOGGERS.lock().unwrap().iter_mut() {
                    l.flush();
                }
            }
        });
    });
}
