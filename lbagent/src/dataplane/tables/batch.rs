//! Whole hash maps read in batches (`BPF_MAP_LOOKUP_BATCH`, Linux 5.6):
//! one syscall per few thousand entries instead of two per entry (the next
//! key, then its value). The kernel copies one hash bucket at a time under
//! that bucket's lock, so each bucket is read whole; an entry written or
//! deleted meanwhile in a bucket already read is seen as it was (as with a
//! walk by key, which can also restart a bucket when the key under it is
//! deleted). aya does not offer the command, so it is issued here.

use std::{
    io,
    mem::size_of,
    os::fd::{AsFd, AsRawFd},
};

use aya::maps::MapData;

/// `BPF_MAP_LOOKUP_BATCH` (`enum bpf_cmd`).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// Entries asked for per call (doubled when one bucket holds more).
const CHUNK: usize = 4096;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Every entry of hash or LRU hash map `map` (not a per-CPU one). An error
/// the kernel gives for the command itself (`EINVAL` on a kernel without
/// batches) is returned for the caller to read entry by entry instead.
pub fn dump<K: aya::Pod, V: aya::Pod>(map: &MapData) -> io::Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    each_chunk(map, |keys: &[K], values: &[V]| out.extend(keys.iter().copied().zip(values.iter().copied())))?;
    Ok(out)
}

/// Hands every entry of hash or LRU hash map `map` (not a per-CPU one) to
/// `visit`, one batch at a time (keys and their values, same length), so a
/// whole pass over a million entries holds a few thousand at once. `visit`
/// may delete entries: the position is a bucket number, so the next batch
/// starts after the buckets already read, and an entry deleted ahead of
/// it is simply not returned. `EINVAL` for the command itself (a kernel
/// without batches) is returned before anything is visited, for the caller
/// to read entry by entry instead; a later error is returned as
/// `io::ErrorKind::Other`, so that no caller visits an entry twice.
pub fn each_chunk<K: aya::Pod, V: aya::Pod>(map: &MapData, mut visit: impl FnMut(&[K], &[V])) -> io::Result<()> {
    let mut chunk = CHUNK;
    // SAFETY: `aya::Pod` types are plain data for which every bit pattern,
    // zero included, is a valid value.
    let mut keys: Vec<K> = vec![unsafe { std::mem::zeroed() }; chunk];
    // SAFETY: as above.
    let mut values: Vec<V> = vec![unsafe { std::mem::zeroed() }; chunk];
    // A hash map's position is a bucket number (`u32`).
    let mut position: Option<u32> = None;
    let mut next: u32 = 0;
    let mut visited = false;
    loop {
        let mut attr = BatchAttr {
            in_batch: position.as_ref().map_or(0, |p| p as *const u32 as u64),
            out_batch: &mut next as *mut u32 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: chunk as u32,
            map_fd: map.fd().as_fd().as_raw_fd() as u32,
            ..Default::default()
        };
        // SAFETY: `attr` is a valid `bpf_attr` prefix of the size passed;
        // the kernel writes at most `count` keys and values into buffers of
        // `chunk` elements of the map's key and value sizes (the caller's
        // `K` and `V`), and one `u32` into `next`.
        let rc = unsafe {
            libc::syscall(libc::SYS_bpf, BPF_MAP_LOOKUP_BATCH, &mut attr as *mut BatchAttr, size_of::<BatchAttr>())
        };
        let error = (rc < 0).then(io::Error::last_os_error);
        // The kernel writes `count` on success, at the end (`ENOENT`) and
        // when a bucket does not fit (`ENOSPC`); after any other error it
        // is still what was asked for, and nothing was copied.
        let copied = error.as_ref().is_none_or(|e| matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ENOSPC)));
        let n = if copied { (attr.count as usize).min(chunk) } else { 0 };
        if n > 0 {
            visit(&keys[..n], &values[..n]);
            visited = true;
        }
        match error.and_then(|e| e.raw_os_error().map(|c| (c, e))) {
            None => position = Some(next),
            // The end of the map (the last entries, if any, came with it).
            Some((libc::ENOENT, _)) => return Ok(()),
            // A bucket holds more entries than the buffers: larger ones.
            Some((libc::ENOSPC, _)) if n == 0 => {
                chunk *= 2;
                // SAFETY: as above.
                keys.resize(chunk, unsafe { std::mem::zeroed() });
                // SAFETY: as above.
                values.resize(chunk, unsafe { std::mem::zeroed() });
            }
            Some((_, e)) if visited => return Err(io::Error::other(e)),
            Some((_, e)) => return Err(e),
        }
    }
}
