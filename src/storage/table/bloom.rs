//! Bloom filter of a table's keys. Pure.
//!
//! Answers "may this table hold key K?" from memory: the memtable's annihilation asks it on
//! every delete that meets its put, compaction asks it before dropping a tombstone, and gets use
//! it to skip tables. A false positive only costs a tombstone or a block read; a false negative
//! would lose a delete, so the filter is checksummed and the hash is fixed (XXH3-64 with a fixed
//! seed, persisted implicitly in every table: never change it).
//!
//! ```text
//! bloom block = probes u8 | bitmap bytes | crc32c u32
//! ```

use super::{checked_body, seal, TableError};

/// Seed of the key hash. Persisted through every table's bitmap: never change it.
const BLOOM_SEED: u64 = 0x626c_6f6f_6d5f_7071; // "bloom_pq"

/// Hash of a key as the filter sees it.
pub fn key_hash(key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, BLOOM_SEED)
}

/// A decoded (or freshly built) filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bloom {
    probes: u8,
    bits: Vec<u8>,
}

impl Bloom {
    /// Builds a filter over `hashes` with about `bits_per_key` bits each.
    pub fn build(hashes: &[u64], bits_per_key: usize) -> Bloom {
        let bits_per_key = bits_per_key.clamp(1, 64);
        let nbits = (hashes.len() * bits_per_key).max(64);
        let nbytes = nbits.div_ceil(8);
        let nbits = nbytes * 8;
        // ln 2 * bits per key probes minimise false positives.
        let probes = ((bits_per_key as f64 * 0.69) as u8).clamp(1, 30);
        let mut bits = vec![0u8; nbytes];
        for &h in hashes {
            for bit in probe_bits(h, probes, nbits) {
                bits[bit / 8] |= 1 << (bit % 8);
            }
        }
        Bloom { probes, bits }
    }

    /// False when `key` is certainly absent.
    pub fn may_contain(&self, key: &[u8]) -> bool {
        self.may_contain_hash(key_hash(key))
    }

    pub fn may_contain_hash(&self, hash: u64) -> bool {
        let nbits = self.bits.len() * 8;
        if nbits == 0 {
            return true;
        }
        probe_bits(hash, self.probes, nbits).all(|bit| self.bits[bit / 8] & (1 << (bit % 8)) != 0)
    }

    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.push(self.probes);
        out.extend_from_slice(&self.bits);
        seal(out, start);
    }

    pub fn decode(bytes: &[u8]) -> Result<Bloom, TableError> {
        let body = checked_body(bytes, "bloom block")?;
        let Some((&probes, bits)) = body.split_first() else {
            return Err(TableError::TooShort {
                what: "bloom block",
                len: bytes.len(),
            });
        };
        if probes == 0 || probes > 30 {
            return Err(TableError::Malformed {
                what: "bloom block",
                detail: "probe count out of range",
            });
        }
        Ok(Bloom {
            probes,
            bits: bits.to_vec(),
        })
    }

    /// Bytes of the bitmap.
    pub fn bytes(&self) -> usize {
        self.bits.len()
    }
}

/// Double hashing (Kirsch–Mitzenmacher): probe i is `h1 + i·h2`.
fn probe_bits(hash: u64, probes: u8, nbits: usize) -> impl Iterator<Item = usize> {
    let h1 = hash as u32;
    let h2 = ((hash >> 32) as u32) | 1;
    (0..probes as u32).map(move |i| (h1.wrapping_add(i.wrapping_mul(h2)) as usize) % nbits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_false_negatives_and_few_false_positives() {
        let keys: Vec<[u8; 24]> = (0..10_000u64)
            .map(|i| {
                let mut k = [0u8; 24];
                k[16..].copy_from_slice(&i.to_be_bytes());
                k
            })
            .collect();
        let hashes: Vec<u64> = keys.iter().map(|k| key_hash(k)).collect();
        let bloom = Bloom::build(&hashes, 10);
        assert!(keys.iter().all(|k| bloom.may_contain(k)));
        let false_positives = (10_000..20_000u64)
            .filter(|i| {
                let mut k = [0u8; 24];
                k[16..].copy_from_slice(&i.to_be_bytes());
                bloom.may_contain(&k)
            })
            .count();
        assert!(
            false_positives < 300,
            "{false_positives} false positives in 10k"
        );
    }

    #[test]
    fn round_trips_and_refuses_damage() {
        let bloom = Bloom::build(&[1, 2, 3], 10);
        let mut out = Vec::new();
        bloom.encode(&mut out);
        assert_eq!(Bloom::decode(&out), Ok(bloom));
        for i in 0..out.len() {
            let mut bad = out.clone();
            bad[i] ^= 0x80;
            assert!(Bloom::decode(&bad).is_err(), "flip at {i}");
        }
        assert!(Bloom::decode(&[]).is_err());
    }

    #[test]
    fn empty_filter_answers_no() {
        let bloom = Bloom::build(&[], 10);
        assert!(!bloom.may_contain(b"anything"));
    }
}
