//! SplitMix64 (Steele, Lea and Flood, 2014): the one mixer the crate uses where it needs well-spread
//! bits without a cryptographic hash — owner tokens in the worker, and the seeded draws of the
//! placement tests and `examples/store_io.rs`, which must repeat from run to run.

/// One SplitMix64 step: `z` advanced by the golden-ratio increment, then mixed.
pub fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seeded SplitMix64 sequence: the same seed draws the same values on every run.
pub struct SeededRng(pub u64);

impl SeededRng {
    pub fn next_u64(&mut self) -> u64 {
        let drawn = splitmix64(self.0);
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        drawn
    }

    /// A value in `0..n` (`n` > 0); the modulo bias is irrelevant for test draws.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_is_splitmix64s_published_one() {
        // The reference sequence for seed 1234567 (from the SplitMix64 paper's C code).
        let mut rng = SeededRng(1234567);
        let drawn: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        assert_eq!(drawn, [6457827717110365317, 3203168211198807973, 9817491932198370423]);
    }
}
