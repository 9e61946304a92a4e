//! How a request's seed becomes each prompt's and each sample's: shared by cotrain's engine loop
//! and the vLLM engine loop, so that both engines draw a sample from the same seed.

/// The seed of prompt `index` of a request with `seed`: the seed itself for the first prompt, a
/// SplitMix64 mix of both for the others. Sample `j` of that prompt then uses the engine's
/// stream `(prompt_seed, j)`; nothing depends on other requests in the batch.
pub fn prompt_seed(seed: u64, index: usize) -> u64 {
    if index == 0 {
        return seed;
    }
    let mut z = seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_prompt_keeps_the_seed_and_others_differ() {
        assert_eq!(prompt_seed(42, 0), 42);
        let seeds: std::collections::HashSet<u64> = (0..100).map(|i| prompt_seed(42, i)).collect();
        assert_eq!(seeds.len(), 100);
        assert_ne!(prompt_seed(42, 1), prompt_seed(43, 1));
    }
}
