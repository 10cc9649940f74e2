//! The expert-cache replacement policy: decayed heat (LRFU) with heat-gated admission.
//!
//! ```text
//! heat_e(t) = heat_e(t_e) · 2^(−(t − t_e) / H)      t: access clock (one tick per request)
//! on access:  heat_e ← heat_e(t) + 1,  t_e ← t      (kept for every expert, cached or not)
//! miss on a full cache: admit e only if heat_e(t) before this access > min_{r cached} heat_r(t),
//!                       evicting that coldest r; otherwise e passes through uncached
//! ```
//!
//! Heat is a histogram over all experts, not only cached ones, so an expert's frequency
//! survives its eviction. The admission test makes the cache scan resistant: a decode sweep
//! larger than the cache (plain LRU retains 0%, docs/PERFORMANCE.md "Expert cache policy") keeps a stable hot
//! set instead of flushing it, and on skewed routing the frequently routed experts stay.
//!
//! [`HeatCache`] (optionally seeded with prior heats, [`HeatCache::with_prior`]),
//! [`PinnedCache`] (a sticky pinned tier in front of a heat cache) and [`LruCache`] replay key
//! traces for the hit-rate comparison; [`zipf_routes`] makes a skewed synthetic routing trace
//! and [`zipf_routes_sampled`] another session of the same routing distribution.

use std::collections::HashMap;

/// A decayed access count.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Heat {
    value: f64,
    at: u64,
}

impl Heat {
    /// First access at `now`.
    pub fn new(now: u64) -> Heat {
        Heat {
            value: 1.0,
            at: now,
        }
    }

    /// A heat of 0 (an entry brought in speculatively, never used yet).
    pub fn cold(now: u64) -> Heat {
        Heat {
            value: 0.0,
            at: now,
        }
    }

    /// A heat of `value` at `now` (a prior from a persisted histogram).
    pub fn with_value(value: f64, now: u64) -> Heat {
        Heat { value, at: now }
    }

    /// The heat at `now` with half-life `half_life` ticks.
    pub fn at(&self, now: u64, half_life: f64) -> f64 {
        let dt = now.saturating_sub(self.at) as f64;
        self.value * (-dt / half_life).exp2()
    }

    /// Record one access at `now`.
    pub fn touch(&mut self, now: u64, half_life: f64) {
        self.value = self.at(now, half_life) + 1.0;
        self.at = now;
    }
}

/// Default half-life in ticks for a cache of `capacity` entries.
pub fn default_half_life(capacity: usize) -> f64 {
    (4 * capacity.max(1)) as f64
}

/// Something that replays an access trace: `access` returns whether it was a hit.
pub trait KeyCache {
    /// One access of `key`; true on a hit.
    fn access(&mut self, key: u64) -> bool;
}

/// Key-only decayed-heat cache (the policy of [`crate::StreamingExperts`]).
pub struct HeatCache {
    capacity: usize,
    half_life: f64,
    now: u64,
    heat: HashMap<u64, Heat>,
    resident: std::collections::HashSet<u64>,
}

impl HeatCache {
    /// A cache of `capacity` keys with the default half-life.
    pub fn new(capacity: usize) -> HeatCache {
        HeatCache {
            capacity,
            half_life: default_half_life(capacity),
            now: 0,
            heat: HashMap::new(),
            resident: Default::default(),
        }
    }
}

impl HeatCache {
    /// A cache of `capacity` keys whose heat histogram starts at `prior` (key, heat) instead
    /// of zero: a persisted histogram seeds admission and eviction from the first request.
    pub fn with_prior(capacity: usize, prior: impl IntoIterator<Item = (u64, f64)>) -> HeatCache {
        let mut c = HeatCache::new(capacity);
        for (k, h) in prior {
            if h > 0.0 {
                c.heat.insert(k, Heat::with_value(h, 0));
            }
        }
        c
    }
}

/// A pinned tier of up to `pin` keys chosen ahead of time (persisted-heat candidates, hottest
/// first) in front of a [`HeatCache`] for the rest of the capacity. A candidate becomes
/// resident at its first access (a miss: sticky, never speculative) and is never evicted.
pub struct PinnedCache {
    candidates: std::collections::HashSet<u64>,
    pinned: std::collections::HashSet<u64>,
    rest: HeatCache,
}

impl PinnedCache {
    /// `capacity` keys in all, of which the first `pin` of `candidates` may be pinned (at most
    /// as many as there are candidates; the rest of the capacity is the heat cache's).
    pub fn new(
        capacity: usize,
        pin: usize,
        candidates: &[u64],
        rest_prior: Vec<(u64, f64)>,
    ) -> PinnedCache {
        // Slots no candidate can fill stay with the heat cache.
        let pin = pin.min(capacity).min(candidates.len());
        PinnedCache {
            candidates: candidates.iter().copied().take(pin).collect(),
            pinned: Default::default(),
            rest: HeatCache::with_prior(capacity - pin, rest_prior),
        }
    }
}

impl KeyCache for PinnedCache {
    fn access(&mut self, key: u64) -> bool {
        if self.pinned.contains(&key) {
            return true;
        }
        if self.candidates.contains(&key) {
            self.pinned.insert(key);
            return false;
        }
        self.rest.access(key)
    }
}

impl KeyCache for HeatCache {
    fn access(&mut self, key: u64) -> bool {
        self.now += 1;
        let (now, hl) = (self.now, self.half_life);
        let before = self.heat.get(&key).map_or(0.0, |h| h.at(now, hl));
        self.heat
            .entry(key)
            .and_modify(|h| h.touch(now, hl))
            .or_insert_with(|| Heat::new(now));
        if self.resident.contains(&key) {
            return true;
        }
        if self.resident.len() < self.capacity {
            self.resident.insert(key);
            return false;
        }
        let heat = &self.heat;
        let victim = self
            .resident
            .iter()
            .map(|k| (heat.get(k).map_or(0.0, |h| h.at(now, hl)), *k))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        if let Some((vh, vk)) = victim
            && before > vh
        {
            self.resident.remove(&vk);
            self.resident.insert(key);
        }
        false
    }
}

/// Key-only least-recently-used cache (the baseline).
pub struct LruCache {
    capacity: usize,
    now: u64,
    entries: HashMap<u64, u64>,
}

impl LruCache {
    /// A cache of `capacity` keys.
    pub fn new(capacity: usize) -> LruCache {
        LruCache {
            capacity,
            now: 0,
            entries: HashMap::new(),
        }
    }
}

impl KeyCache for LruCache {
    fn access(&mut self, key: u64) -> bool {
        self.now += 1;
        if let Some(t) = self.entries.get_mut(&key) {
            *t = self.now;
            return true;
        }
        if self.capacity == 0 {
            return false;
        }
        if self.entries.len() >= self.capacity
            && let Some(victim) = self
                .entries
                .iter()
                .min_by_key(|(k, t)| (**t, **k))
                .map(|(&k, _)| k)
        {
            self.entries.remove(&victim);
        }
        self.entries.insert(key, self.now);
        false
    }
}

/// Hit rate of `cache` over `trace`.
pub fn hit_rate(cache: &mut dyn KeyCache, trace: &[u64]) -> f64 {
    let hits = trace.iter().filter(|&&k| cache.access(k)).count();
    hits as f64 / trace.len().max(1) as f64
}

/// A skewed routing trace: `tokens` tokens through `layers` MoE layers, each picking `k`
/// distinct of `experts` experts with probability ∝ 1/(rank+1)^`s` (a per-layer random
/// ranking). Keys are `layer · experts + expert`, in decode order (token-major, layer, then
/// ascending expert id as the MoE requests them).
pub fn zipf_routes(
    layers: usize,
    experts: usize,
    k: usize,
    tokens: usize,
    s: f64,
    seed: u64,
) -> Vec<u64> {
    zipf_routes_sampled(layers, experts, k, tokens, s, seed, seed)
}

fn splitmix(seed: u64) -> impl FnMut() -> f64 {
    let mut rng = seed ^ 0x9e37_79b9_7f4a_7c15;
    move || {
        rng = rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// [`zipf_routes`] with the per-layer expert ranking drawn from `rank_seed` and the routes
/// sampled from `sample_seed`: the same routing distribution in another session (equal seeds
/// give exactly [`zipf_routes`]).
pub fn zipf_routes_sampled(
    layers: usize,
    experts: usize,
    k: usize,
    tokens: usize,
    s: f64,
    rank_seed: u64,
    sample_seed: u64,
) -> Vec<u64> {
    let mut next = splitmix(rank_seed);
    let ranks: Vec<Vec<usize>> = (0..layers)
        .map(|_| {
            let mut p: Vec<usize> = (0..experts).collect();
            for i in (1..experts).rev() {
                let j = (next() * (i + 1) as f64) as usize;
                p.swap(i, j.min(i));
            }
            p
        })
        .collect();
    let weight: Vec<f64> = (0..experts)
        .map(|r| 1.0 / ((r + 1) as f64).powf(s))
        .collect();
    let mut other = splitmix(sample_seed);
    let mut next = move || {
        if sample_seed == rank_seed {
            next()
        } else {
            other()
        }
    };
    let mut out = Vec::with_capacity(layers * k * tokens);
    for _ in 0..tokens {
        for (l, rank) in ranks.iter().enumerate() {
            let mut picked: Vec<usize> = Vec::with_capacity(k);
            while picked.len() < k.min(experts) {
                let total: f64 = (0..experts)
                    .filter(|r| !picked.contains(&rank[*r]))
                    .map(|r| weight[r])
                    .sum();
                let mut u = next() * total;
                let mut chosen = None;
                for (r, &w) in weight.iter().enumerate() {
                    if picked.contains(&rank[r]) {
                        continue;
                    }
                    chosen = Some(rank[r]);
                    if u < w {
                        break;
                    }
                    u -= w;
                }
                if let Some(e) = chosen {
                    picked.push(e);
                }
            }
            picked.sort_unstable();
            out.extend(picked.into_iter().map(|e| (l * experts + e) as u64));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heat_decays_and_accumulates() {
        let mut h = Heat::new(0);
        assert_eq!(h.at(10, 10.0), 0.5);
        h.touch(10, 10.0);
        assert_eq!(h.at(10, 10.0), 1.5);
        assert_eq!(Heat::cold(3).at(100, 4.0), 0.0);
    }

    #[test]
    fn heat_beats_lru_on_skewed_routing() {
        // 8 layers × 64 experts, top-4, Zipf s = 1: the per-token working set (32) is
        // larger than a 16-expert cache, where LRU retains little and heat keeps the hot set.
        let trace = zipf_routes(8, 64, 4, 600, 1.0, 11);
        for cap in [16usize, 64, 128] {
            let heat = hit_rate(&mut HeatCache::new(cap), &trace);
            let lru = hit_rate(&mut LruCache::new(cap), &trace);
            eprintln!("capacity {cap}: heat {heat:.3} lru {lru:.3}");
            assert!(
                heat > lru + 0.02,
                "capacity {cap}: heat {heat} vs lru {lru}"
            );
        }
    }

    #[test]
    fn persisted_heat_and_pinning_help_a_new_session() {
        use crate::heat::{HeatDims, HeatTable};
        let (layers, experts, k) = (8usize, 64usize, 4usize);
        let dims = HeatDims {
            layers,
            experts,
            top_k: k,
        };
        // Learn from one session, replay another of the same distribution.
        let old = zipf_routes_sampled(layers, experts, k, 600, 1.0, 11, 99);
        let mut table = HeatTable::empty(dims);
        for pass in old.chunks(layers * k) {
            let sets: Vec<(usize, Vec<usize>)> = (0..layers)
                .map(|l| {
                    let u = pass
                        .iter()
                        .filter(|&&key| key as usize / experts == l)
                        .map(|&key| key as usize % experts)
                        .collect();
                    (l + 1, u)
                })
                .collect();
            table.record_pass(sets.iter().map(|(l, u)| (*l, u.as_slice())));
        }
        let key = |(l, e): (usize, usize)| ((l - 1) * experts + e) as u64;
        let cands: Vec<u64> = table.pin_candidates().into_iter().map(key).collect();
        assert!(!cands.is_empty());
        let new = zipf_routes_sampled(layers, experts, k, 40, 1.0, 11, 7);
        assert_ne!(new, zipf_routes(layers, experts, k, 40, 1.0, 11));
        let cap = 16;
        let cold = hit_rate(&mut HeatCache::new(cap), &new);
        let prior: Vec<(u64, f64)> = (1..=layers)
            .flat_map(|l| (0..experts).map(move |e| (l, e)))
            .map(|(l, e)| (key((l, e)), table.get(l, e) / table.mass * 8.0))
            .collect();
        let seeded = hit_rate(&mut HeatCache::with_prior(cap, prior.clone()), &new);
        let pinned = hit_rate(&mut PinnedCache::new(cap, cap / 2, &cands, prior), &new);
        eprintln!("cold {cold:.3} seeded {seeded:.3} pinned {pinned:.3}");
        assert!(seeded > cold, "seeded {seeded} vs cold {cold}");
        assert!(pinned > cold, "pinned {pinned} vs cold {cold}");
    }

    #[test]
    fn lru_retains_nothing_on_a_cyclic_scan_larger_than_it() {
        let trace: Vec<u64> = (0..50).flat_map(|_| 0..20u64).collect();
        assert_eq!(hit_rate(&mut LruCache::new(10), &trace), 0.0);
        assert!(hit_rate(&mut HeatCache::new(10), &trace) > 0.3);
    }
}
