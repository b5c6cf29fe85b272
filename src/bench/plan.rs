//! The workload of a bench run as plain data: what each producer sends, when, to which topic,
//! with which delay, and which deliveries a consumer nacks. Also the payload layout every bench
//! message carries.
//!
//! Pure: no clock, no I/O, no global randomness. Times are nanoseconds since the run's origin,
//! handed in by the driver; "random" choices (delay, nack) are a seeded hash of the message's
//! identity, so a consumer on another thread decides exactly as the producer's plan says and a
//! run replays the same choices.

use std::time::Duration;

/// Bytes of the bench header at the start of every payload.
pub const HEADER_BYTES: usize = 32;
/// Marks a payload as a bench message ("PQBN").
const MAGIC: u32 = 0x4e42_5150;

/// A delay and how often it is chosen, from `--delay-mix` ("0:90,1s:10").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DelayMix {
    /// (delay in ms, weight); weights are positive.
    choices: Vec<(u64, u32)>,
    total_weight: u64,
}

impl DelayMix {
    /// Every message due at once.
    pub fn immediate() -> DelayMix {
        DelayMix {
            choices: vec![(0, 1)],
            total_weight: 1,
        }
    }

    /// Parses `DELAY:WEIGHT[,DELAY:WEIGHT...]`; a delay is `0` or a duration like `1s`, `250ms`.
    pub fn parse(text: &str) -> Result<DelayMix, String> {
        let mut choices = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((delay, weight)) = part.rsplit_once(':') else {
                return Err(format!("{part:?}: expected DELAY:WEIGHT, e.g. 1s:10"));
            };
            let delay_ms = match delay.trim() {
                "0" => 0,
                d => humantime::parse_duration(d)
                    .map_err(|e| format!("{d:?} is not a duration like 500ms or 2s: {e}"))?
                    .as_millis()
                    .min(u128::from(u32::MAX)) as u64,
            };
            let weight: u32 = weight
                .trim()
                .parse()
                .map_err(|e| format!("{weight:?} is not a whole weight: {e}"))?;
            if weight == 0 {
                return Err(format!("{part:?}: a weight must be positive"));
            }
            choices.push((delay_ms, weight));
        }
        if choices.is_empty() {
            return Err("the delay mix is empty".to_owned());
        }
        let total_weight = choices.iter().map(|&(_, w)| u64::from(w)).sum();
        Ok(DelayMix {
            choices,
            total_weight,
        })
    }

    /// The delay of message `seq` of `producer`.
    pub fn delay_ms(&self, seed: u64, producer: u32, seq: u64) -> u64 {
        if self.choices.len() == 1 {
            return self.choices[0].0;
        }
        let mut pick = mix(seed ^ 0xde1a, producer, seq) % self.total_weight;
        for &(delay_ms, weight) in &self.choices {
            if pick < u64::from(weight) {
                return delay_ms;
            }
            pick -= u64::from(weight);
        }
        // Unreachable: `pick` is below the sum of the weights.
        self.choices[self.choices.len() - 1].0
    }

    /// The longest delay of the mix.
    pub fn delay_ms_max(&self) -> u64 {
        self.choices.iter().map(|&(d, _)| d).max().unwrap_or(0)
    }
}

/// The workload of a run, validated.
#[derive(Clone, Debug)]
pub struct Plan {
    pub producers: u32,
    /// Members of each consumer group.
    pub consumers_per_group: u32,
    pub groups: u32,
    /// Universal (fan-out) consumers; each gets every message.
    pub universal: u32,
    pub topics: u32,
    /// Payload bytes, header included.
    pub payload_bytes: usize,
    pub delays: DelayMix,
    /// Fraction of first deliveries a consumer nacks (redelivered at once).
    pub nack_ratio: f64,
    /// Messages per second over all producers; `None` = as fast as the broker takes them.
    pub rate_per_sec: Option<u64>,
    pub warmup: Duration,
    pub duration: Duration,
    /// Messages per publish batch (the most, at a fixed rate).
    pub batch_len_max: usize,
    /// Publish batches in flight per producer.
    pub publish_window: usize,
    /// Seeds the delay and nack choices.
    pub seed: u64,
    /// Prefix of the topic names, unique per run so runs against one broker do not mix.
    pub topic_prefix: String,
}

/// Why a plan was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("--size {size} is below the {min}-byte bench header every message carries")]
    SizeTooSmall { size: usize, min: usize },
    #[error("--{what} must be at least 1")]
    Zero { what: &'static str },
    #[error("--nack-ratio {0} must be in [0, 1)")]
    NackRatio(f64),
    #[error("no consumer: set --consumers with --groups, or --universal")]
    NoConsumer,
}

impl Plan {
    /// Checks the plan's numbers; returns it unchanged when they make sense.
    pub fn validate(self) -> Result<Plan, PlanError> {
        if self.payload_bytes < HEADER_BYTES {
            return Err(PlanError::SizeTooSmall {
                size: self.payload_bytes,
                min: HEADER_BYTES,
            });
        }
        for (value, what) in [
            (self.producers as u64, "producers"),
            (self.topics as u64, "topics"),
            (self.batch_len_max as u64, "batch"),
            (self.publish_window as u64, "window"),
        ] {
            if value == 0 {
                return Err(PlanError::Zero { what });
            }
        }
        if self.rate_per_sec == Some(0) {
            return Err(PlanError::Zero { what: "rate" });
        }
        if !(0.0..1.0).contains(&self.nack_ratio) {
            return Err(PlanError::NackRatio(self.nack_ratio));
        }
        if self.receivers() == 0 {
            return Err(PlanError::NoConsumer);
        }
        Ok(self)
    }

    /// Copies of each message that must be delivered: one per group, one per universal consumer.
    pub fn receivers(&self) -> u32 {
        let groups = if self.consumers_per_group == 0 {
            0
        } else {
            self.groups
        };
        groups + self.universal
    }

    /// Consumer tasks in all.
    pub fn consumer_count(&self) -> u32 {
        self.consumers_per_group * self.groups + self.universal
    }

    /// The name of topic `index`.
    pub fn topic(&self, index: u32) -> String {
        format!("{}-{index}", self.topic_prefix)
    }

    /// The topic message `seq` of `producer` goes to: round robin, offset per producer.
    pub fn topic_of(&self, producer: u32, seq: u64) -> u32 {
        ((seq + u64::from(producer)) % u64::from(self.topics)) as u32
    }

    /// The name of group `index`.
    pub fn group(&self, index: u32) -> String {
        format!("bench-group-{index}")
    }

    /// End of the warm-up, ns since the origin, for a run that starts at `start_ns`.
    pub fn measure_start_ns(&self, start_ns: u64) -> u64 {
        start_ns + self.warmup.as_nanos() as u64
    }

    /// End of sending, ns since the origin.
    pub fn send_end_ns(&self, start_ns: u64) -> u64 {
        self.measure_start_ns(start_ns) + self.duration.as_nanos() as u64
    }

    /// At a fixed rate, when message `seq` of `producer` is due to be sent (ns since the
    /// origin). Producers are offset from each other so their messages interleave evenly.
    /// `None` at max rate.
    pub fn intended_send_ns(&self, start_ns: u64, producer: u32, seq: u64) -> Option<u64> {
        let rate = self.rate_per_sec?;
        // Message i of the whole run is due at i / rate; producer p sends i = seq·P + p.
        let index = u128::from(seq) * u128::from(self.producers) + u128::from(producer);
        let offset = index * 1_000_000_000 / u128::from(rate);
        Some(start_ns.saturating_add(offset.min(u128::from(u64::MAX)) as u64))
    }

    /// Whether a consumer nacks the first delivery of this message.
    pub fn nacks(&self, producer: u32, seq: u64) -> bool {
        if self.nack_ratio <= 0.0 {
            return false;
        }
        let threshold = (self.nack_ratio * u64::MAX as f64) as u64;
        mix(self.seed ^ 0x0ac4, producer, seq) < threshold
    }
}

/// What a bench payload says about its message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    pub producer: u32,
    pub seq: u64,
    /// When it was (meant to be) sent, ns since the origin: the intended time at a fixed rate,
    /// so latency includes the wait of a producer that fell behind (coordinated omission).
    pub sent_ns: u64,
    pub delay_ms: u64,
}

impl Stamp {
    /// When the message became due: latency is measured from here.
    pub fn due_ns(&self) -> u64 {
        self.sent_ns
            .saturating_add(self.delay_ms.saturating_mul(1_000_000))
    }

    /// Writes the header into the start of `payload` (at least [`HEADER_BYTES`] long); the
    /// rest of the payload is left as it is.
    pub fn write(&self, payload: &mut [u8]) {
        assert!(payload.len() >= HEADER_BYTES, "bench payload too short");
        payload[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        payload[4..8].copy_from_slice(&self.producer.to_le_bytes());
        payload[8..16].copy_from_slice(&self.seq.to_le_bytes());
        payload[16..24].copy_from_slice(&self.sent_ns.to_le_bytes());
        payload[24..32].copy_from_slice(&self.delay_ms.to_le_bytes());
    }

    /// Reads the header; `None` when the payload is not a bench message.
    pub fn read(payload: &[u8]) -> Option<Stamp> {
        let field = |range: std::ops::Range<usize>| payload.get(range);
        let u32_at = |at: usize| {
            field(at..at + 4)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_le_bytes)
        };
        let u64_at = |at: usize| {
            field(at..at + 8)
                .and_then(|b| b.try_into().ok())
                .map(u64::from_le_bytes)
        };
        if u32_at(0)? != MAGIC {
            return None;
        }
        Some(Stamp {
            producer: u32_at(4)?,
            seq: u64_at(8)?,
            sent_ns: u64_at(16)?,
            delay_ms: u64_at(24)?,
        })
    }
}

/// splitmix64 of a message's identity: a well-spread 64-bit hash, the same on every thread.
fn mix(seed: u64, producer: u32, seq: u64) -> u64 {
    let mut z = seed
        .wrapping_add(u64::from(producer).wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_add(seq.wrapping_mul(0xbf58_476d_1ce4_e5b9));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn plan() -> Plan {
        Plan {
            producers: 2,
            consumers_per_group: 2,
            groups: 1,
            universal: 0,
            topics: 1,
            payload_bytes: 100,
            delays: DelayMix::immediate(),
            nack_ratio: 0.0,
            rate_per_sec: None,
            warmup: Duration::from_secs(1),
            duration: Duration::from_secs(5),
            batch_len_max: 128,
            publish_window: 4,
            seed: 7,
            topic_prefix: "t".to_owned(),
        }
    }

    #[test]
    fn stamp_round_trips_through_a_payload() {
        let stamp = Stamp {
            producer: 3,
            seq: 1 << 40,
            sent_ns: 123_456_789,
            delay_ms: 1000,
        };
        let mut payload = vec![0xaa; 100];
        stamp.write(&mut payload);
        assert_eq!(Stamp::read(&payload), Some(stamp));
        assert_eq!(stamp.due_ns(), 123_456_789 + 1_000_000_000);
    }

    #[test]
    fn foreign_or_short_payload_is_not_a_stamp() {
        assert_eq!(Stamp::read(b"hello"), None);
        assert_eq!(Stamp::read(&[0u8; 64]), None);
    }

    #[test]
    fn delay_mix_parses_and_follows_its_weights() {
        let mix = DelayMix::parse("0:90, 1s:10").expect("valid mix");
        assert_eq!(mix.delay_ms_max(), 1000);
        let delayed = (0..100_000)
            .filter(|&seq| mix.delay_ms(1, 0, seq) == 1000)
            .count();
        // 10 % of 100,000 within a generous margin for a hash.
        assert!((9_000..11_000).contains(&delayed), "{delayed} delayed");
        assert_eq!(mix.delay_ms(1, 0, 42), mix.delay_ms(1, 0, 42));
    }

    #[test]
    fn delay_mix_rejects_malformed_parts() {
        assert!(DelayMix::parse("").is_err());
        assert!(DelayMix::parse("1s").is_err());
        assert!(DelayMix::parse("1s:0").is_err());
        assert!(DelayMix::parse("soon:1").is_err());
        assert!(DelayMix::parse("1s:-1").is_err());
    }

    #[test]
    fn fixed_rate_spaces_messages_evenly_across_producers() {
        let mut p = plan();
        p.rate_per_sec = Some(10_000);
        // 10,000/s: one message every 100 µs over the run, alternating producers.
        assert_eq!(p.intended_send_ns(5, 0, 0), Some(5));
        assert_eq!(p.intended_send_ns(5, 1, 0), Some(5 + 100_000));
        assert_eq!(p.intended_send_ns(5, 0, 1), Some(5 + 200_000));
        assert_eq!(plan().intended_send_ns(5, 0, 1), None);
    }

    #[test]
    fn nack_choice_follows_the_ratio_and_is_repeatable() {
        let mut p = plan();
        assert!(!p.nacks(0, 1));
        p.nack_ratio = 0.25;
        let nacked = (0..100_000).filter(|&seq| p.nacks(1, seq)).count();
        assert!((23_000..27_000).contains(&nacked), "{nacked} nacked");
        assert_eq!(p.nacks(1, 99), p.nacks(1, 99));
    }

    #[test]
    fn plan_validation_names_the_bad_value() {
        let mut p = plan();
        p.payload_bytes = 8;
        assert_eq!(
            p.validate().err(),
            Some(PlanError::SizeTooSmall { size: 8, min: 32 })
        );
        let mut p = plan();
        p.consumers_per_group = 0;
        assert_eq!(p.validate().err(), Some(PlanError::NoConsumer));
        let mut p = plan();
        p.nack_ratio = 1.0;
        assert_eq!(p.validate().err(), Some(PlanError::NackRatio(1.0)));
        assert!(plan().validate().is_ok());
    }

    #[test]
    fn receivers_count_groups_and_universal_consumers() {
        let mut p = plan();
        p.groups = 2;
        p.universal = 3;
        assert_eq!(p.receivers(), 5);
        assert_eq!(p.consumer_count(), 7);
        assert_eq!(p.topic_of(1, 0), 0);
    }
}
