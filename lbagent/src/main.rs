/// jemalloc, not glibc's allocator. At 100 000 rules, after an apply, glibc's
/// arenas held 197 MB of RSS for ~70 MB in use: they cannot return a page
/// that one small long-lived allocation shares with a parse's freed ones
/// (`malloc_trim` freed 4 MB). jemalloc groups allocations by size class and
/// purges freed pages as it goes: 85 MB with the same document and tables
/// (measured 2026-12-06, with its background purge threads; they are off:
/// the agent's threads are its own, which the daemon's tests count).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options, read before `main`: one arena (the agent allocates
/// from one thread at a time, mostly; an arena per thread kept each one's
/// freed pages), and freed pages returned to the kernel after a second
/// instead of ten. The restart at 100 000 rules (50 zones, 2026-12-07): 84
/// MB of RSS with the defaults, 73 MB with these. `_RJEM_MALLOC_CONF` in
/// the environment still overrides them.
// SAFETY: jemalloc reads this symbol as its `const char *malloc_conf`: a
// reference to a static, NUL-terminated byte string has that layout, and
// nothing writes it.
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static MALLOC_CONF: &[u8; 47] = b"narenas:1,dirty_decay_ms:1000,muzzy_decay_ms:0\0";

fn main() {
    if let Err(e) = lbagent::cli::main() {
        eprintln!("lbagent: {e:#}");
        std::process::exit(1);
    }
}
