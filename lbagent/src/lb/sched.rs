//! Scheduler tables for direct-mode listeners (pure): every scheduler but
//! the default hash fills one table of `SCHED_TABLE_SIZE` backend slots that
//! the program indexes (`lbagent-ebpf/src/sched.rs`):
//!
//! - `sch` / `tch`: a **consistent table**, Maglev's lookup structure (a
//!   prime-sized table the program indexes with `hash % size`, by source
//!   address for `sch`, by 5-tuple for `tch`), filled by **rendezvous
//!   hashing**: each slot goes to the backend whose (slot, id) score,
//!   scaled by its weight, is highest. Adding a backend moves exactly the
//!   slots it wins (its share, ≈ 1/N), removing one moves only its own;
//!   Maglev's permutation walk (`maglev`, kept for comparison) moves up to
//!   2.2/N at 100 backends. Like Maglev, the table depends only on the set
//!   of backends, so every agent builds the same one.
//! - `rr` / `wrr`: a **weighted round-robin** sequence (stride scheduling:
//!   each turn goes to the backend that is most due), which the program
//!   walks with a per-CPU position: new flows go to the backends in turn, in
//!   proportion to their weights (`rr`: all weights 1), interleaved rather
//!   than in bursts.
//!
//! The table size is prime (Maglev needs every skip to be coprime with it,
//! and a prime keeps `hash % size` even) and far above the backend count, so
//! each backend's share is its weight's to within a few tenths of a point.

use std::net::Ipv4Addr;

use lbagent_common::SCHED_TABLE_SIZE;

/// One backend as the tables see it: a stable id (for its Maglev
/// permutation), its target and its weight (0 takes no slots).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member<'a> {
    pub id: &'a str,
    pub target: (Ipv4Addr, u16),
    pub weight: u32,
}

/// A table: `SCHED_TABLE_SIZE` targets (empty when no member has weight).
pub type Table = Vec<(Ipv4Addr, u16)>;

fn fnv1a(salt: u64, s: &str) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ salt;
    for b in s.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // splitmix64 finaliser: FNV's low bits alone are weak.
    mix64(h)
}

/// The consistent table of `members`: slot `s` goes to the backend with the
/// highest rendezvous score `ln(u(s, id)) / weight`, where `u` is a uniform
/// hash of the slot and the backend's id. A pure function of the set of
/// (id, target, weight): every agent builds the same table.
pub fn consistent(members: &[Member]) -> Table {
    consistent_sized(members, SCHED_TABLE_SIZE as usize)
}

fn mix64(mut h: u64) -> u64 {
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

fn consistent_sized(members: &[Member], m: usize) -> Table {
    let live: Vec<&Member> = members.iter().filter(|b| b.weight > 0).collect();
    if live.is_empty() {
        return Vec::new();
    }
    let id_hashes: Vec<u64> = live.iter().map(|b| fnv1a(0x5bd1_e995, b.id)).collect();
    // Within one weight the highest hash wins (ln is monotone), so only
    // each weight's winner needs its score computed: a few logarithms per
    // slot however many backends.
    let mut by_weight: std::collections::BTreeMap<u32, Vec<usize>> = Default::default();
    for (i, b) in live.iter().enumerate() {
        by_weight.entry(b.weight).or_default().push(i);
    }
    let hash = |i: usize, s: usize| mix64(id_hashes[i] ^ (s as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    (0..m)
        .map(|s| {
            let mut best: Option<(f64, usize)> = None;
            for (w, class) in &by_weight {
                let Some((h, i)) = class.iter().map(|&i| (hash(i, s), i)).max() else { continue };
                // u in (0, 1]; ln(u) / w is highest for the backend that wins.
                let score = (((h >> 11) + 1) as f64 / (1u64 << 53) as f64).ln() / *w as f64;
                if best.is_none_or(|(b, _)| score > b) {
                    best = Some((score, i));
                }
            }
            live[best.map_or(0, |(_, i)| i)].target
        })
        .collect()
}

/// The Maglev table of `members` (Eisenbud et al.): each backend walks its
/// permutation of the slots and claims the next free one in turn (weighted
/// turns). Kept for comparison (`cargo xtask bench`): its walk moves more
/// than the joining or leaving backend's share as backends grow (1.5/N at
/// 50, 2.2/N at 100 with 16 381 slots), which `consistent` does not.
pub fn maglev(members: &[Member]) -> Table {
    maglev_sized(members, SCHED_TABLE_SIZE as usize)
}

fn maglev_sized(members: &[Member], m: usize) -> Table {
    let live: Vec<&Member> = members.iter().filter(|b| b.weight > 0).collect();
    if live.is_empty() {
        return Vec::new();
    }
    let max_w = live.iter().map(|b| b.weight).max().unwrap_or(1) as u64;
    let perm: Vec<(usize, usize)> = live
        .iter()
        .map(|b| {
            let offset = (fnv1a(0x5bd1_e995, b.id) % m as u64) as usize;
            let skip = (fnv1a(0x1b87_3593, b.id) % (m as u64 - 1) + 1) as usize;
            (offset, skip)
        })
        .collect();
    let mut next = vec![0usize; live.len()];
    // Weighted turns: a backend claims a slot whenever its credit (weight /
    // largest weight per round) reaches one.
    let mut credit = vec![0u64; live.len()];
    let mut slot: Vec<Option<usize>> = vec![None; m];
    let mut filled = 0;
    'fill: loop {
        for i in 0..live.len() {
            credit[i] += live[i].weight as u64;
            if credit[i] < max_w {
                continue;
            }
            credit[i] -= max_w;
            let (offset, skip) = perm[i];
            let mut c = (offset + next[i] * skip) % m;
            while slot[c].is_some() {
                next[i] += 1;
                c = (offset + next[i] * skip) % m;
            }
            slot[c] = Some(i);
            next[i] += 1;
            filled += 1;
            if filled == m {
                break 'fill;
            }
        }
    }
    slot.into_iter().map(|i| live[i.unwrap_or(0)].target).collect()
}

/// The round-robin sequence of `members`, weighted and interleaved (stride
/// scheduling): the next turn goes to the backend whose `(turns + 1) /
/// weight` is lowest (ties to the first listed), so any run of Σweights
/// turns gives each backend exactly its weight. O(size · log N).
pub fn round_robin(members: &[Member]) -> Table {
    let live: Vec<&Member> = members.iter().filter(|b| b.weight > 0).collect();
    if live.is_empty() {
        return Vec::new();
    }
    let mut heap: std::collections::BinaryHeap<Turn> =
        live.iter().enumerate().map(|(i, b)| Turn { next: 1, weight: b.weight as u64, index: i }).collect();
    (0..SCHED_TABLE_SIZE)
        .map(|_| {
            let mut t = heap.pop().expect("one live member at least");
            let target = live[t.index].target;
            t.next += 1;
            heap.push(t);
            target
        })
        .collect()
}

/// A backend's place in the round-robin: its next turn is due at
/// `next / weight` (a max-heap, so the order is reversed: earliest first).
#[derive(PartialEq, Eq)]
struct Turn {
    next: u64,
    weight: u64,
    index: usize,
}

impl Ord for Turn {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // self.next / self.weight vs other.next / other.weight, exactly.
        (other.next * self.weight).cmp(&(self.next * other.weight)).then(other.index.cmp(&self.index))
    }
}

impl PartialOrd for Turn {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn members(n: usize, weight: impl Fn(usize) -> u32) -> (Vec<String>, Vec<u32>) {
        ((0..n).map(|i| format!("backend-{i}")).collect(), (0..n).map(weight).collect())
    }

    fn as_members<'a>(ids: &'a [String], weights: &[u32]) -> Vec<Member<'a>> {
        ids.iter()
            .zip(weights)
            .enumerate()
            .map(|(i, (id, w))| Member {
                id,
                target: (Ipv4Addr::new(10, 0, (i / 250) as u8, (i % 250) as u8 + 1), 80),
                weight: *w,
            })
            .collect()
    }

    fn counts(t: &Table) -> HashMap<(Ipv4Addr, u16), usize> {
        let mut c = HashMap::new();
        for x in t {
            *c.entry(*x).or_default() += 1;
        }
        c
    }

    /// Fraction of slots whose backend differs (a key hashing to a slot moves
    /// exactly when its slot changes).
    fn moved(a: &Table, b: &Table) -> f64 {
        a.iter().zip(b).filter(|(x, y)| x != y).count() as f64 / a.len() as f64
    }

    #[test]
    fn table_size_is_prime() {
        let m = SCHED_TABLE_SIZE as u64;
        assert!((2..).take_while(|d| d * d <= m).all(|d| !m.is_multiple_of(d)), "{m} is prime");
    }

    #[test]
    fn one_nth_of_the_keys_move_when_a_backend_joins_or_leaves() {
        for n in [2usize, 3, 4, 10, 25, 50, 100] {
            let (ids, w) = members(n + 1, |_| 1);
            let small = consistent(&as_members(&ids[..n], &w[..n]));
            let big = consistent(&as_members(&ids, &w));
            let add = moved(&small, &big);
            // Adding one to n: ideal 1/(n+1) of the keys move (to the new one).
            let ideal = 1.0 / (n + 1) as f64;
            assert!(add <= 1.2 * ideal, "n={n}: adding moved {add:.4}, ideal {ideal:.4}");
            // Removing one of n+1: same tables the other way round.
            let remove = moved(&big, &small);
            assert!(remove <= 1.2 * ideal, "n={n}: removing moved {remove:.4}");
            // Removing a backend in the middle: only its keys move (ideal 1/(n+1)).
            let mut fewer = as_members(&ids, &w);
            fewer.remove(n / 2);
            let mid = moved(&big, &consistent(&fewer));
            assert!(mid <= 1.2 * ideal, "n={n}: removing the middle one moved {mid:.4}");
        }
    }

    #[test]
    fn weights_are_honoured_within_two_points() {
        for weights in [vec![1, 2, 3], vec![1, 1, 1, 1], vec![5, 100, 256, 17], vec![1, 200], vec![3; 100]] {
            let ids: Vec<String> = (0..weights.len()).map(|i| format!("b{i}")).collect();
            let t = consistent(&as_members(&ids, &weights));
            assert_eq!(t.len(), SCHED_TABLE_SIZE as usize);
            let c = counts(&t);
            let total: u32 = weights.iter().sum();
            for (m, w) in as_members(&ids, &weights).iter().zip(&weights) {
                let want = *w as f64 / total as f64;
                let got = c.get(&m.target).copied().unwrap_or(0) as f64 / t.len() as f64;
                assert!((got - want).abs() <= 0.02, "{weights:?}: {} got {got:.4}, want {want:.4}", m.id);
                // And within 4 standard deviations of a fair draw of the slots.
                let sd = (want * (1.0 - want) / t.len() as f64).sqrt();
                assert!(
                    (got - want).abs() <= 4.0 * sd,
                    "{weights:?}: {} got {got:.4}, want {want:.4} (sd {sd:.4})",
                    m.id
                );
            }
        }
    }

    #[test]
    fn the_table_does_not_depend_on_member_order_and_skips_weight_zero() {
        let (ids, w) = members(5, |i| i as u32 % 3);
        let m = as_members(&ids, &w);
        let mut rev = m.clone();
        rev.reverse();
        assert_eq!(consistent(&m), consistent(&rev));
        assert!(!counts(&consistent(&m)).contains_key(&m[0].target), "weight 0 takes no slot");
        assert!(consistent(&[]).is_empty());
    }

    #[test]
    fn maglev_for_comparison_honours_weights_but_moves_more() {
        let (ids, w) = members(51, |_| 1);
        let a = maglev(&as_members(&ids[..50], &w[..50]));
        let b = maglev(&as_members(&ids, &w));
        assert!(moved(&a, &b) > 1.3 / 51.0, "the permutation walk cascades: {}", moved(&a, &b));
        let weights = [1, 2, 3];
        let ids: Vec<String> = (0..3).map(|i| format!("b{i}")).collect();
        let c = counts(&maglev(&as_members(&ids, &weights)));
        let t = SCHED_TABLE_SIZE as usize;
        for (m, w) in as_members(&ids, &weights).iter().zip(weights) {
            assert!((c[&m.target] as f64 / t as f64 - w as f64 / 6.0).abs() < 0.001, "exact weights");
        }
    }

    #[test]
    fn round_robin_interleaves_in_proportion_to_weights() {
        let (ids, w) = members(3, |i| i as u32 + 1);
        let m = as_members(&ids, &w);
        let t = round_robin(&m);
        // Every window of 6 picks holds the weights exactly: 1, 2, 3.
        for start in [0usize, 6, 600, 6000] {
            let c = counts(&t[start..start + 6].to_vec());
            assert_eq!((c[&m[0].target], c[&m[1].target], c[&m[2].target]), (1, 2, 3));
        }
        // Never the same backend three times in a row with these weights.
        assert!(t.windows(3).all(|x| !(x[0] == x[1] && x[1] == x[2])));
        let (ids, w) = members(4, |_| 1);
        let rr = round_robin(&as_members(&ids, &w));
        assert_eq!(&rr[..4], &rr[4..8], "plain round robin: in turn");
        assert_eq!(counts(&rr[..4].to_vec()).len(), 4);
    }
}
