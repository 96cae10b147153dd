//! Helpers shared by the kernel test binaries (each `tests/*.rs` that says `mod common;`).

// Each binary uses its own subset of these.
#![allow(dead_code)]

use tumble_kernels::PackedWeight;

/// A small xorshift generator: the same inputs on every run and machine.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn f(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| self.f()).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// A random product of `m` rows, `n` outputs, `k` inputs: W (n × k, also packed) and A (m × k).
    pub fn problem(&mut self, m: usize, n: usize, k: usize) -> (Vec<f32>, Vec<f32>, PackedWeight) {
        let w = self.vec(n * k);
        let a = self.vec(m * k);
        let pw = PackedWeight::pack(&w, n, k).unwrap();
        (w, a, pw)
    }
}
