/// jemalloc, not glibc's allocator. At 100 000 rules, after an apply, glibc's
/// arenas held 197 MB of RSS for ~70 MB in use: they cannot return a page
/// that one small long-lived allocation shares with a parse's freed ones
/// (`malloc_trim` freed 4 MB). jemalloc groups allocations by size class and
/// purges freed pages as it goes: 85 MB with the same document and tables
/// (measured 2026-12-06, with its background purge threads; they are off:
/// the agent's threads are its own, which the daemon's tests count).
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    if let Err(e) = lbagent::cli::main() {
        eprintln!("lbagent: {e:#}");
        std::process::exit(1);
    }
}
