//! Event keys and the key space of a shard's store.
//!
//! An event key is 24 bytes, big-endian: `topic_hash u64 | due_bucket u64 | event_id u64`, so the
//! store's byte order is the order (topic, due time, publish order) that the dispatcher scans in.
//! The topic hash has its top bit cleared: every event key starts with a byte below `0x80`, and
//! every metadata key starts with [`META_PREFIX`] (`0xFF`) and is not 24 bytes long, so a metadata
//! key can never parse as an event key nor fall inside a topic's scan range.
//!
//! The topic hash is XXH3-64 with a seed fixed forever: it is persisted in every key and picks the
//! owning shard, so it must never change. In-memory maps use `ahash`, which is never persisted.
//! Two topics may share a hash; the stored message carries its topic name and readers check it.

use std::fmt;

/// Seed of the persisted topic hash. Changing it orphans every stored message: never change it.
pub const TOPIC_HASH_SEED: u64 = 0x7069_6e71_5f74_6f70; // "pinq_top"

/// Mask that clears the top bit of a topic hash, keeping event keys below the metadata range.
const TOPIC_HASH_MASK: u64 = 0x7FFF_FFFF_FFFF_FFFF;

/// First byte of every metadata key.
pub const META_PREFIX: u8 = 0xFF;

/// Length of an event key in bytes.
pub const EVENT_KEY_LEN: usize = 24;

/// Longest topic name accepted, in bytes.
pub const TOPIC_LEN_MAX: usize = 255;

/// A key as the store sees it: event keys and metadata keys alike, inline up to 24 bytes.
pub type Key = smallvec::SmallVec<[u8; EVENT_KEY_LEN]>;

/// The persisted 63-bit hash of a topic name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TopicHash(pub u64);

impl TopicHash {
    /// Hashes a topic name with the fixed seed.
    pub fn of(topic: &str) -> TopicHash {
        TopicHash(
            xxhash_rust::xxh3::xxh3_64_with_seed(topic.as_bytes(), TOPIC_HASH_SEED)
                & TOPIC_HASH_MASK,
        )
    }

    /// The shard that owns this topic among `shard_count` shards.
    pub fn shard(self, shard_count: usize) -> usize {
        debug_assert!(shard_count > 0);
        (self.0 % shard_count.max(1) as u64) as usize
    }
}

/// Checks a topic name: 1..=255 bytes of UTF-8 (the `&str` type already guarantees UTF-8).
pub fn validate_topic(topic: &str) -> Result<(), KeyError> {
    if topic.is_empty() {
        return Err(KeyError::EmptyTopic);
    }
    if topic.len() > TOPIC_LEN_MAX {
        return Err(KeyError::TopicTooLong { len: topic.len() });
    }
    Ok(())
}

/// Errors from parsing keys and topic names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("topic name is empty")]
    EmptyTopic,
    #[error("topic name is {len} bytes, the limit is {TOPIC_LEN_MAX}")]
    TopicTooLong { len: usize },
    #[error("delivery tag is {len} bytes, expected {EVENT_KEY_LEN}")]
    WrongLength { len: usize },
    #[error("bytes are not an event key (first byte {first:#04x} is in the metadata range)")]
    NotAnEventKey { first: u8 },
}

/// The bucket a message becomes due in.
pub fn due_bucket(enqueued_at_ms: u64, delay_ms: u64, time_bucket_ms: u64) -> u64 {
    enqueued_at_ms.saturating_add(delay_ms) / time_bucket_ms.max(1)
}

/// First bucket that is not yet fully due at `now_ms`: a scan of `[topic start, bound)` sees only
/// messages whose whole bucket has begun, so nothing is delivered early (at most one bucket late).
pub fn due_bucket_bound(now_ms: u64, time_bucket_ms: u64) -> u64 {
    now_ms.saturating_add(1) / time_bucket_ms.max(1)
}

/// The 24-byte key of one stored message, also its delivery tag.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EventKey([u8; EVENT_KEY_LEN]);

impl EventKey {
    pub fn new(topic: TopicHash, due_bucket: u64, event_id: u64) -> EventKey {
        debug_assert_eq!(
            topic.0 & !TOPIC_HASH_MASK,
            0,
            "topic hash must have its top bit clear"
        );
        let mut bytes = [0u8; EVENT_KEY_LEN];
        bytes[0..8].copy_from_slice(&topic.0.to_be_bytes());
        bytes[8..16].copy_from_slice(&due_bucket.to_be_bytes());
        bytes[16..24].copy_from_slice(&event_id.to_be_bytes());
        EventKey(bytes)
    }

    /// Parses bytes as an event key; metadata keys and wrong lengths are refused.
    pub fn parse(bytes: &[u8]) -> Result<EventKey, KeyError> {
        let array: [u8; EVENT_KEY_LEN] = bytes
            .try_into()
            .map_err(|_| KeyError::WrongLength { len: bytes.len() })?;
        if array[0] & 0x80 != 0 {
            return Err(KeyError::NotAnEventKey { first: array[0] });
        }
        Ok(EventKey(array))
    }

    pub fn topic_hash(&self) -> TopicHash {
        TopicHash(u64::from_be_bytes(field(&self.0, 0)))
    }

    pub fn due_bucket(&self) -> u64 {
        u64::from_be_bytes(field(&self.0, 8))
    }

    pub fn event_id(&self) -> u64 {
        u64::from_be_bytes(field(&self.0, 16))
    }

    pub fn as_bytes(&self) -> &[u8; EVENT_KEY_LEN] {
        &self.0
    }

    pub fn to_key(&self) -> Key {
        Key::from_buf(self.0)
    }

    /// The smallest key of a topic's range.
    pub fn topic_start(topic: TopicHash) -> EventKey {
        EventKey::new(topic, 0, 0)
    }

    /// The exclusive upper bound of the keys of `topic` due at `now_ms`.
    pub fn due_upper_bound(topic: TopicHash, now_ms: u64, time_bucket_ms: u64) -> EventKey {
        EventKey::new(topic, due_bucket_bound(now_ms, time_bucket_ms), 0)
    }

    /// The key right after this one in byte order (used to resume a scan past a key).
    pub fn successor(&self) -> Key {
        let mut key = self.to_key();
        key.push(0);
        key
    }
}

/// The exclusive end of a topic's whole key range.
pub fn topic_end(topic: TopicHash) -> Key {
    // Top bit is clear, so `topic + 1` cannot overflow into the metadata range's first byte
    // except for the very last topic hash, whose end is the start of the metadata range.
    let mut key = Key::new();
    key.extend_from_slice(&(topic.0 + 1).to_be_bytes());
    key
}

fn field(bytes: &[u8; EVENT_KEY_LEN], at: usize) -> [u8; 8] {
    let mut out = [0u8; 8];
    out.copy_from_slice(&bytes[at..at + 8]);
    out
}

impl fmt::Debug for EventKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "EventKey({:016x}/{}/{})",
            self.topic_hash().0,
            self.due_bucket(),
            self.event_id()
        )
    }
}

/// Start of the whole event key range (inclusive).
pub const EVENT_RANGE_START: &[u8] = &[];
/// End of the whole event key range (exclusive): the first metadata-range byte.
pub const EVENT_RANGE_END: &[u8] = &[0x80];

/// Metadata keys: `0xFF | kind`, never 24 bytes long.
pub mod meta {
    use super::{Key, META_PREFIX};

    /// The highest event id assigned by this shard, as a big-endian u64 value.
    pub const EVENT_ID_HIGH_WATER: u8 = 0x01;

    pub fn key(kind: u8) -> Key {
        let mut key = Key::new();
        key.push(META_PREFIX);
        key.push(kind);
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_layout_is_topic_due_id_big_endian() {
        let key = EventKey::new(
            TopicHash(0x0102_0304_0506_0708),
            0x1112_1314_1516_1718,
            0x2122_2324_2526_2728,
        );
        assert_eq!(
            key.as_bytes(),
            &[
                1, 2, 3, 4, 5, 6, 7, 8, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x21, 0x22,
                0x23, 0x24, 0x25, 0x26, 0x27, 0x28
            ]
        );
        assert_eq!(key.topic_hash(), TopicHash(0x0102_0304_0506_0708));
        assert_eq!(key.due_bucket(), 0x1112_1314_1516_1718);
        assert_eq!(key.event_id(), 0x2122_2324_2526_2728);
        assert_eq!(EventKey::parse(key.as_bytes()), Ok(key));
    }

    #[test]
    fn byte_order_equals_topic_due_id_order() {
        let mut rng = fastrand::Rng::with_seed(7);
        let mut keys: Vec<(u64, u64, u64)> = (0..2000)
            .map(|_| {
                (
                    rng.u64(0..4) << 61 | rng.u64(0..3),
                    rng.u64(0..1 << 40),
                    rng.u64(..),
                )
            })
            .collect();
        keys.extend([
            (0, 0, 0),
            (TOPIC_HASH_MASK, u64::MAX, u64::MAX),
            (1, 255, 256),
            (1, 256, 255),
        ]);
        let mut by_tuple = keys.clone();
        by_tuple.sort();
        let mut by_bytes: Vec<EventKey> = keys
            .iter()
            .map(|&(t, d, i)| EventKey::new(TopicHash(t), d, i))
            .collect();
        by_bytes.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        let decoded: Vec<(u64, u64, u64)> = by_bytes
            .iter()
            .map(|k| (k.topic_hash().0, k.due_bucket(), k.event_id()))
            .collect();
        assert_eq!(decoded, by_tuple);
    }

    #[test]
    fn due_bounds_select_exactly_the_due_keys_of_one_topic() {
        let bucket_ms = 10;
        let topic = TopicHash::of("orders");
        let other = TopicHash(topic.0 + 1);
        let now_ms = 1_005;
        let mut all: Vec<Key> = Vec::new();
        for t in [TopicHash(topic.0 - 1), topic, other] {
            for due_ms in [0u64, 990, 999, 1_000, 1_005, 1_009, 1_010, 5_000] {
                all.push(EventKey::new(t, due_ms / bucket_ms, due_ms).to_key());
            }
        }
        all.sort();
        let start = EventKey::topic_start(topic).to_key();
        let end = EventKey::due_upper_bound(topic, now_ms, bucket_ms).to_key();
        let selected: Vec<u64> = all
            .iter()
            .filter(|k| **k >= start && **k < end)
            .map(|k| EventKey::parse(k).map(|e| e.event_id()).unwrap_or(u64::MAX))
            .collect();
        // Bucket 100 (1000..=1009 ms) has not fully begun at 1005 ms: never early.
        assert_eq!(selected, vec![0, 990, 999]);
        let whole: Vec<&Key> = all
            .iter()
            .filter(|k| **k >= start && **k < topic_end(topic))
            .collect();
        assert_eq!(whole.len(), 8);
        assert!(whole
            .iter()
            .all(|k| EventKey::parse(k).map(|e| e.topic_hash()) == Ok(topic)));
    }

    #[test]
    fn metadata_keys_never_parse_as_event_keys_and_sort_after_all_events() {
        let meta = meta::key(meta::EVENT_ID_HIGH_WATER);
        assert!(EventKey::parse(&meta).is_err());
        let mut padded = meta.clone();
        padded.resize(EVENT_KEY_LEN, 0);
        assert_eq!(
            EventKey::parse(&padded),
            Err(KeyError::NotAnEventKey { first: META_PREFIX })
        );
        let last = EventKey::new(TopicHash(TOPIC_HASH_MASK), u64::MAX, u64::MAX);
        assert!(last.as_bytes().as_slice() < EVENT_RANGE_END);
        assert!(meta.as_slice() >= EVENT_RANGE_END);
        assert!(topic_end(TopicHash(TOPIC_HASH_MASK)).as_slice() <= meta.as_slice());
    }

    #[test]
    fn topic_hash_is_stable_and_top_bit_clear() {
        // Persisted in keys: this value must never change.
        let hash = TopicHash::of("orders");
        assert_eq!(hash, TopicHash(0x4c29_66df_0ec9_d65a));
        assert_eq!(hash.0 >> 63, 0);
        assert_eq!(
            hash.0,
            xxhash_rust::xxh3::xxh3_64_with_seed(b"orders", TOPIC_HASH_SEED) & TOPIC_HASH_MASK
        );
        assert!(hash.shard(2) < 2);
    }

    #[test]
    fn topic_names_are_checked() {
        assert_eq!(validate_topic(""), Err(KeyError::EmptyTopic));
        assert!(validate_topic(&"x".repeat(255)).is_ok());
        assert_eq!(
            validate_topic(&"x".repeat(256)),
            Err(KeyError::TopicTooLong { len: 256 })
        );
        assert_eq!(
            EventKey::parse(&[0; 23]),
            Err(KeyError::WrongLength { len: 23 })
        );
    }
}
