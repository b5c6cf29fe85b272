//! Loading the configuration: defaults < TOML file < `PINQ_` environment variables < flags.
//!
//! Every source becomes TOML values under their dotted key (`delivery.inFlightTimeout`), each
//! remembering where it came from, so an error names both the key and the file, variable or flag
//! that set it. Keys are checked against the raw structs as each source is added (an unknown key
//! is refused with its full dotted name); the merged values are then deserialized into those raw
//! structs (`deny_unknown_fields`, every field optional), converted into the typed [`Config`] and
//! validated. Nothing here reads the process environment on its own: the caller passes variables
//! in ([`env_from_process`] collects the real ones), so tests never touch the process's.
//!
//! Environment variables are `PINQ_<SECTION>_<KEY>`, the TOML key in SCREAMING_SNAKE_CASE:
//! `delivery.inFlightTimeout` is `PINQ_DELIVERY_IN_FLIGHT_TIMEOUT`. Any variable that starts
//! with `PINQ_DELIVERY_`, `PINQ_PUBLISH_`, `PINQ_SERVER_`, `PINQ_STORAGE_` or `PINQ_CLUSTER_`
//! must name a key; other `PINQ_` variables are not configuration and are ignored here. A value
//! that is an integer is read as one; anything else is a string, parsed like the same string in
//! TOML (`PINQ_CLUSTER_PEERS` takes the `--peers` form, `1=IP:PORT,2=IP:PORT`).
//!
//! Runs once at start-up, never on a hot path.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::{self, Deserialize, Deserializer, Visitor};

use crate::security::auth::{parse_sha256_hex, TokenSpec, TOKENS_MAX};
use crate::security::tls::TlsFiles;

use super::{
    format_byte_size, online_cpus, parse_byte_size, AckLevel, ClientLimits, Config, CpuList,
    DeliveryConfig, NumaMode, PublishConfig, SecurityConfig, ServerConfig, StorageConfig,
    StorageEngine,
};

mod cluster;
mod env;
mod raw;
mod render;
#[cfg(test)]
mod tests;

use env::*;
pub use env::{env_from_process, env_var_name};
use raw::*;

/// Prefix of every configuration environment variable.
pub const ENV_PREFIX: &str = "PINQ_";

// Upper bounds of the keys. Each is far above any sensible setting and exists to catch a typo
// (a missing unit, an extra zero) before it becomes a broker that never redelivers or a queue
// that eats the machine's memory.
const DISPATCH_POLL_INTERVAL_MAX: Duration = Duration::from_secs(60);
/// `server.idlePoll` at most: a spin this long after every burst already costs a core at any
/// rate above a few hundred requests a second.
const IDLE_POLL_MAX: Duration = Duration::from_millis(10);
const IN_FLIGHT_TIMEOUT_MAX: Duration = Duration::from_secs(24 * 3600);
const DELETE_BATCH_INTERVAL_MAX: Duration = Duration::from_secs(60);
const TTL_SWEEP_INTERVAL_MAX: Duration = Duration::from_secs(7 * 24 * 3600);
const TIME_BUCKET_MAX: Duration = Duration::from_secs(3600);
const GROUP_RETENTION_MAX: Duration = Duration::from_secs(365 * 24 * 3600);
const DELETE_BATCH_KEYS_LIMIT: usize = 1_000_000;
const DELETE_BATCHES_IN_FLIGHT_LIMIT: usize = 64;
const DELETE_BACKLOG_KEYS_LIMIT: usize = 1 << 24;
const CONSUMER_QUEUE_LEN_LIMIT: usize = 1 << 20;
const UNACKED_PER_CONSUMER_LIMIT: usize = 1 << 24;
const RETRY_LEN_LIMIT: usize = 1 << 24;
const SCAN_BATCH_LEN_LIMIT: usize = 1 << 16;
const GROUPS_PER_TOPIC_LIMIT: usize = 1 << 20;
const GROUPS_PER_SHARD_LIMIT: usize = 1 << 24;
const CONSUMERS_PER_GROUP_LIMIT: usize = 1 << 20;
/// Upper bound of `delivery.maxCountedTopics` (a counted topic costs up to a few KiB).
const COUNTED_TOPICS_LIMIT: usize = 1 << 20;
/// Upper bound of `delivery.maxGroupMetrics` (each is a dozen time series per scrape).
const GROUP_METRICS_LIMIT: usize = 1 << 16;
const MESSAGE_BYTES_LIMIT: u64 = 64 << 20;
const BATCH_LEN_LIMIT: usize = 1_000_000;
const DEDUP_WINDOW_LIMIT: Duration = Duration::from_secs(7 * 24 * 3600);
const DEDUP_PRODUCERS_LIMIT: usize = 1 << 20;
const DEDUP_ENTRIES_LIMIT: usize = 1 << 26;
const BYTES_IN_FLIGHT_MIN: u64 = 64 << 10;
const BYTES_IN_FLIGHT_LIMIT: u64 = 64 << 30;
const CONNECTIONS_LIMIT: usize = 1_000_000;
const IDLE_TIMEOUT_MAX: Duration = Duration::from_secs(7 * 24 * 3600);
const FRAME_TIMEOUT_MAX: Duration = Duration::from_secs(3600);
const CALLS_IN_FLIGHT_LIMIT: usize = 1 << 20;
const SUBSCRIPTIONS_PER_CONNECTION_LIMIT: usize = 1 << 20;
const SEND_BUFFER_BYTES_MIN: u64 = 64 << 10;
const SEND_BUFFER_BYTES_LIMIT: u64 = 64 << 30;
const MEMTABLE_BYTES_MIN: u64 = 64 << 10;
const MEMTABLE_BYTES_LIMIT: u64 = 64 << 30;
const WAL_SEGMENT_BYTES_MIN: u64 = 64 << 10;
const WAL_SEGMENT_BYTES_LIMIT: u64 = 16 << 30;
const WAL_MAX_BYTES_MIN: u64 = 1 << 20;
const WAL_MAX_BYTES_LIMIT: u64 = 1 << 40;
/// `storage.walMaxBytes` when unset: this, or four memtables if that is more.
const WAL_MAX_BYTES_DEFAULT: u64 = 256 << 20;
/// WAL segments are written with O_DIRECT, whose writes are whole blocks of this size.
const WAL_SEGMENT_ALIGNMENT_BYTES: u64 = 4096;

/// Where a configuration value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The embedded default.
    Default,
    /// A TOML config file.
    File(PathBuf),
    /// An environment variable, by name.
    Env(String),
    /// A command-line flag, as spelled (`--listen`).
    Flag(&'static str),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Default => f.write_str("default value"),
            Origin::File(path) => write!(f, "in {}", path.display()),
            Origin::Env(name) => write!(f, "from environment variable {name}"),
            Origin::Flag(flag) => write!(f, "from flag {flag}"),
        }
    }
}

/// Why the configuration was refused. Every variant about a value names its dotted key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {}: {io_error}", path.display())]
    Read {
        path: PathBuf,
        io_error: std::io::Error,
    },
    #[error("config file {} is not valid TOML: {message}", path.display())]
    Syntax { path: PathBuf, message: String },
    #[error("unknown key \"{key}\" {origin}{hint}")]
    UnknownKey {
        key: String,
        origin: Origin,
        /// A suggestion such as ` (did you mean "delivery.inFlightTimeout"?)`, or empty.
        hint: String,
    },
    #[error("{key}: {reason} ({origin})")]
    Invalid {
        key: String,
        reason: String,
        origin: Origin,
    },
    #[error("environment variable {name} is not valid UTF-8")]
    EnvNotUnicode { name: String },
}

impl ConfigError {
    /// The dotted key the error is about, if it is about one.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::UnknownKey { key, .. } | ConfigError::Invalid { key, .. } => Some(key),
            ConfigError::Read { .. }
            | ConfigError::Syntax { .. }
            | ConfigError::EnvNotUnicode { .. } => None,
        }
    }
}

/// `[server.tls]` and `[cluster.tls]` as flat keys (`server.tlsCertFile`, `cluster.tlsCaFile`,
/// …); other entries pass through. An unknown key inside one is refused with its dotted name
/// (`server.tls.certfile`).
fn flatten_tls(
    section: &str,
    entries: toml::Table,
    origin: &Origin,
) -> Result<Vec<(String, toml::Value)>, ConfigError> {
    let mut out = Vec::with_capacity(entries.len());
    for (key, value) in entries {
        let takes = match section {
            "server" => "certFile, keyFile, clientCaFile",
            "cluster" => "certFile, keyFile, caFile",
            _ => "",
        };
        match (key.as_str(), value) {
            ("tls", toml::Value::Table(tls)) if !takes.is_empty() => {
                for (inner, value) in tls {
                    let mut chars = inner.chars();
                    let flat = match chars.next() {
                        Some(first) => {
                            format!("tls{}{}", first.to_ascii_uppercase(), chars.as_str())
                        }
                        None => "tls".to_owned(),
                    };
                    if known_key(section, &flat).is_none() {
                        return Err(ConfigError::UnknownKey {
                            key: format!("{section}.tls.{inner}"),
                            origin: origin.clone(),
                            hint: format!(" ({section}.tls takes {takes})"),
                        });
                    }
                    out.push((flat, value));
                }
            }
            (_, value) => out.push((key, value)),
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// The loader.

#[derive(Clone, Debug)]
struct Setting {
    value: toml::Value,
    origin: Origin,
}

/// Collects configuration sources in increasing precedence, then builds a validated [`Config`].
///
/// ```
/// # use pinq::config::{ConfigLoader, Origin};
/// let mut loader = ConfigLoader::new();
/// loader.add_toml("[delivery]\ninFlightTimeout = \"10s\"\n", "pinq.toml".as_ref())?;
/// loader.add_env([("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "2s")])?;
/// let config = loader.build()?;
/// assert_eq!(config.delivery.in_flight_timeout_ms, 2_000);
/// # Ok::<(), pinq::config::ConfigError>(())
/// ```
#[derive(Clone, Debug)]
pub struct ConfigLoader {
    settings: BTreeMap<(&'static str, &'static str), Setting>,
    /// CPUs `server.cpus` may name; `"all"` means all of them.
    online_cpus: Vec<usize>,
}

impl Default for ConfigLoader {
    fn default() -> ConfigLoader {
        ConfigLoader::new()
    }
}

impl ConfigLoader {
    /// A loader holding only the defaults, checking CPUs against this host's.
    pub fn new() -> ConfigLoader {
        ConfigLoader::with_online_cpus(online_cpus())
    }

    /// A loader that takes `online` as the host's CPUs (tests, `pinq doctor` on fixtures).
    pub fn with_online_cpus(online: Vec<usize>) -> ConfigLoader {
        ConfigLoader {
            settings: BTreeMap::new(),
            online_cpus: online,
        }
    }

    /// Reads a TOML file and layers it over what is there.
    pub fn add_file(&mut self, path: &Path) -> Result<(), ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|io_error| ConfigError::Read {
            path: path.to_owned(),
            io_error,
        })?;
        self.add_toml(&text, path)
    }

    /// Layers TOML text, named `path` in errors.
    pub fn add_toml(&mut self, text: &str, path: &Path) -> Result<(), ConfigError> {
        let origin = Origin::File(path.to_owned());
        let table: toml::Table = toml::from_str(text).map_err(|err| ConfigError::Syntax {
            path: path.to_owned(),
            message: err.to_string().trim_end().to_owned(),
        })?;
        for (section_name, value) in table {
            let Some(section) = sections()
                .iter()
                .copied()
                .find(|known| *known == section_name)
            else {
                return Err(ConfigError::UnknownKey {
                    hint: file_hint(sections().iter().map(|s| s.to_string()), &section_name),
                    key: section_name,
                    origin,
                });
            };
            let toml::Value::Table(entries) = value else {
                return Err(ConfigError::Invalid {
                    key: section.to_owned(),
                    reason: format!("must be a table: put its keys under a [{section}] header"),
                    origin,
                });
            };
            for (key_name, value) in flatten_tls(section, entries, &origin)? {
                let Some((section, key)) = known_key(section, &key_name) else {
                    let candidates = section_keys(section)
                        .unwrap_or(&[])
                        .iter()
                        .map(|key| format!("{section}.{key}"));
                    let dotted = format!("{section}.{key_name}");
                    return Err(ConfigError::UnknownKey {
                        hint: file_hint(candidates, &dotted),
                        key: dotted,
                        origin,
                    });
                };
                self.settings.insert(
                    (section, key),
                    Setting {
                        value,
                        origin: origin.clone(),
                    },
                );
            }
        }
        Ok(())
    }

    /// Layers environment variables (see the module docs for the naming scheme). Variables that
    /// are not configuration are skipped; one that looks like configuration but names no key is
    /// an error.
    pub fn add_env<I, K, V>(&mut self, vars: I) -> Result<(), ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut vars: Vec<(String, String)> = vars
            .into_iter()
            .map(|(name, value)| (name.as_ref().to_owned(), value.as_ref().to_owned()))
            .collect();
        // Sorted so that, of several bad variables, the same one is reported every time.
        vars.sort();
        for (name, value) in vars {
            let Some((section, key_part)) = env_section(&name) else {
                continue;
            };
            let keys = section_keys(section).unwrap_or(&[]);
            let Some(&key) = keys.iter().find(|key| env_key_part(key) == key_part) else {
                let hint = keys
                    .iter()
                    .find(|key| normalized(key) == normalized(key_part))
                    .map(|key| format!(" (did you mean {}?)", env_var_name(section, key)))
                    .unwrap_or_default();
                return Err(ConfigError::UnknownKey {
                    key: format!("{section}.{key_part}"),
                    origin: Origin::Env(name),
                    hint,
                });
            };
            self.settings.insert(
                (section, key),
                Setting {
                    value: env_value(&value),
                    origin: Origin::Env(name),
                },
            );
        }
        Ok(())
    }

    /// Sets one dotted key (`server.listen`); used for command-line flags.
    pub fn set(
        &mut self,
        dotted_key: &str,
        value: toml::Value,
        origin: Origin,
    ) -> Result<(), ConfigError> {
        let Some((section, key)) = dotted_key
            .split_once('.')
            .and_then(|(section, key)| known_key(section, key))
        else {
            return Err(ConfigError::UnknownKey {
                key: dotted_key.to_owned(),
                origin,
                hint: String::new(),
            });
        };
        self.settings
            .insert((section, key), Setting { value, origin });
        Ok(())
    }

    /// Converts and validates everything layered so far.
    pub fn build(&self) -> Result<Config, ConfigError> {
        let raw = self.raw()?;
        let delivery = self.delivery(raw.delivery)?;
        let publish = self.publish(raw.publish)?;
        let tls = self.tls(&raw.server)?;
        let server = self.server(raw.server)?;
        let storage = self.storage(raw.storage)?;
        let cluster = self.cluster(raw.cluster, &server, &publish)?;
        let config = Config {
            delivery,
            publish,
            server,
            storage,
            cluster,
            security: SecurityConfig {
                tls,
                tokens: self.tokens(raw.auth)?,
            },
        };
        self.check_across_keys(&config)?;
        Ok(config)
    }

    /// Deserializes the merged values. On failure, finds the key at fault by deserializing each
    /// setting alone, so the error can name it.
    fn raw(&self) -> Result<RawConfig, ConfigError> {
        let whole = match RawConfig::deserialize(nest(self.settings.iter())) {
            Ok(raw) => return Ok(raw),
            Err(err) => err,
        };
        for entry in &self.settings {
            if let Err(err) = RawConfig::deserialize(nest(std::iter::once(entry))) {
                let (&(section, key), setting) = entry;
                return Err(ConfigError::Invalid {
                    key: format!("{section}.{key}"),
                    reason: err.message().to_owned(),
                    origin: setting.origin.clone(),
                });
            }
        }
        Err(ConfigError::Invalid {
            key: "config".to_owned(),
            reason: whole.message().to_owned(),
            origin: Origin::Default,
        })
    }

    fn origin(&self, dotted_key: &str) -> Origin {
        dotted_key
            .split_once('.')
            .and_then(|(section, key)| self.settings.get(&(section, key)))
            .map_or(Origin::Default, |setting| setting.origin.clone())
    }

    fn invalid(&self, dotted_key: &str, reason: impl Into<String>) -> ConfigError {
        debug_assert!(
            dotted_key
                .split_once('.')
                .and_then(|(section, key)| known_key(section, key))
                .is_some(),
            "{dotted_key} is not a key"
        );
        ConfigError::Invalid {
            key: dotted_key.to_owned(),
            reason: reason.into(),
            origin: self.origin(dotted_key),
        }
    }

    /// A positive whole number of milliseconds up to `max`.
    fn millis(
        &self,
        key: &str,
        value: Option<DurationValue>,
        default_ms: u64,
        max: Duration,
    ) -> Result<u64, ConfigError> {
        let Some(DurationValue(duration)) = value else {
            return Ok(default_ms);
        };
        if duration.is_zero() {
            return Err(self.invalid(key, "must be greater than zero"));
        }
        if duration.subsec_nanos() % 1_000_000 != 0 {
            return Err(self.invalid(
                key,
                format!(
                    "must be a whole number of milliseconds, found {}",
                    humantime::format_duration(duration)
                ),
            ));
        }
        if duration > max {
            return Err(self.invalid(
                key,
                format!(
                    "must be at most {}, found {}",
                    humantime::format_duration(max),
                    humantime::format_duration(duration)
                ),
            ));
        }
        Ok(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX))
    }

    /// A positive count up to `max`.
    fn count(
        &self,
        key: &str,
        value: Option<u64>,
        default: usize,
        max: usize,
    ) -> Result<usize, ConfigError> {
        let Some(count) = value else {
            return Ok(default);
        };
        if count == 0 {
            return Err(self.invalid(key, "must be greater than zero"));
        }
        match usize::try_from(count) {
            Ok(count) if count <= max => Ok(count),
            _ => Err(self.invalid(key, format!("must be at most {max}, found {count}"))),
        }
    }

    /// A positive byte size within `min..=max`.
    fn bytes(
        &self,
        key: &str,
        value: Option<ByteSizeValue>,
        default: u64,
        (min, max): (u64, u64),
    ) -> Result<u64, ConfigError> {
        let Some(ByteSizeValue(bytes)) = value else {
            return Ok(default);
        };
        if bytes == 0 {
            return Err(self.invalid(key, "must be greater than zero"));
        }
        if bytes < min {
            return Err(self.invalid(
                key,
                format!(
                    "must be at least {} ({min} bytes), found {bytes} bytes",
                    format_byte_size(min)
                ),
            ));
        }
        if bytes > max {
            return Err(self.invalid(
                key,
                format!(
                    "must be at most {} ({max} bytes), found {bytes} bytes",
                    format_byte_size(max)
                ),
            ));
        }
        Ok(bytes)
    }

    fn delivery(&self, raw: RawDelivery) -> Result<DeliveryConfig, ConfigError> {
        let d = DeliveryConfig::default();
        Ok(DeliveryConfig {
            dispatch_poll_interval_ms: self.millis(
                "delivery.dispatchPollInterval",
                raw.dispatch_poll_interval,
                d.dispatch_poll_interval_ms,
                DISPATCH_POLL_INTERVAL_MAX,
            )?,
            in_flight_timeout_ms: self.millis(
                "delivery.inFlightTimeout",
                raw.in_flight_timeout,
                d.in_flight_timeout_ms,
                IN_FLIGHT_TIMEOUT_MAX,
            )?,
            delete_batch_interval_ms: self.millis(
                "delivery.deleteBatchInterval",
                raw.delete_batch_interval,
                d.delete_batch_interval_ms,
                DELETE_BATCH_INTERVAL_MAX,
            )?,
            delete_batch_keys_max: self.count(
                "delivery.deleteBatchMaxKeys",
                raw.delete_batch_max_keys,
                d.delete_batch_keys_max,
                DELETE_BATCH_KEYS_LIMIT,
            )?,
            delete_batches_in_flight_max: self.count(
                "delivery.deleteBatchesInFlight",
                raw.delete_batches_in_flight,
                d.delete_batches_in_flight_max,
                DELETE_BATCHES_IN_FLIGHT_LIMIT,
            )?,
            delete_backlog_keys_max: self.count(
                "delivery.deleteBacklogMaxKeys",
                raw.delete_backlog_max_keys,
                d.delete_backlog_keys_max,
                DELETE_BACKLOG_KEYS_LIMIT,
            )?,
            ttl_sweep_interval_ms: self.millis(
                "delivery.ttlSweepInterval",
                raw.ttl_sweep_interval,
                d.ttl_sweep_interval_ms,
                TTL_SWEEP_INTERVAL_MAX,
            )?,
            consumer_queue_len_max: self.count(
                "delivery.consumerQueueSize",
                raw.consumer_queue_size,
                d.consumer_queue_len_max,
                CONSUMER_QUEUE_LEN_LIMIT,
            )?,
            time_bucket_ms: self.millis(
                "delivery.timeBucket",
                raw.time_bucket,
                d.time_bucket_ms,
                TIME_BUCKET_MAX,
            )?,
            group_retention_ms: self.millis(
                "delivery.groupRetention",
                raw.group_retention,
                d.group_retention_ms,
                GROUP_RETENTION_MAX,
            )?,
            unacked_per_consumer_max: self.count(
                "delivery.maxUnackedPerConsumer",
                raw.max_unacked_per_consumer,
                d.unacked_per_consumer_max,
                UNACKED_PER_CONSUMER_LIMIT,
            )?,
            retry_len_max: self.count(
                "delivery.retryQueueSize",
                raw.retry_queue_size,
                d.retry_len_max,
                RETRY_LEN_LIMIT,
            )?,
            scan_batch_len_max: self.count(
                "delivery.scanBatchSize",
                raw.scan_batch_size,
                d.scan_batch_len_max,
                SCAN_BATCH_LEN_LIMIT,
            )?,
            groups_per_topic_max: self.count(
                "delivery.maxGroupsPerTopic",
                raw.max_groups_per_topic,
                d.groups_per_topic_max,
                GROUPS_PER_TOPIC_LIMIT,
            )?,
            groups_per_shard_max: self.count(
                "delivery.maxGroupsPerShard",
                raw.max_groups_per_shard,
                d.groups_per_shard_max,
                GROUPS_PER_SHARD_LIMIT,
            )?,
            consumers_per_group_max: self.count(
                "delivery.maxConsumersPerGroup",
                raw.max_consumers_per_group,
                d.consumers_per_group_max,
                CONSUMERS_PER_GROUP_LIMIT,
            )?,
            counted_topics_max: self.count(
                "delivery.maxCountedTopics",
                raw.max_counted_topics,
                d.counted_topics_max,
                COUNTED_TOPICS_LIMIT,
            )?,
            group_metrics_max: self.count(
                "delivery.maxGroupMetrics",
                raw.max_group_metrics,
                d.group_metrics_max,
                GROUP_METRICS_LIMIT,
            )?,
            max_deliveries: match raw.max_deliveries {
                None => d.max_deliveries,
                Some(n) => u32::try_from(n).map_err(|_| {
                    self.invalid(
                        "delivery.maxDeliveries",
                        format!("must be at most {}, found {n}", u32::MAX),
                    )
                })?,
            },
            dead_letter_topic: match raw.dead_letter_topic {
                None => d.dead_letter_topic,
                Some(text) => {
                    crate::key::validate_topic(&text.replace("{topic}", "t"))
                        .map_err(|e| self.invalid("delivery.deadLetterTopic", e.to_string()))?;
                    text
                }
            },
            redelivery_backoff: match raw.redelivery_backoff.as_deref().map(str::trim) {
                None | Some("" | "none") => None,
                Some(text) => Some(
                    crate::pipeline::policy::Backoff::parse(text)
                        .map_err(|e| self.invalid("delivery.redeliveryBackoff", e.to_string()))?,
                ),
            },
        })
    }

    fn publish(&self, raw: RawPublish) -> Result<PublishConfig, ConfigError> {
        let d = PublishConfig::default();
        let message_bytes_max = self.bytes(
            "publish.maxMessageBytes",
            raw.max_message_bytes,
            d.message_bytes_max as u64,
            (1, MESSAGE_BYTES_LIMIT),
        )?;
        let ack_level_min = match raw.min_ack_level {
            None => d.ack_level_min,
            Some(text) => AckLevel::parse(&text).ok_or_else(|| {
                self.invalid(
                    "publish.minAckLevel",
                    format!("must be \"none\", \"leader\" or \"durable\", found \"{text}\""),
                )
            })?,
        };
        let bytes_in_flight_max = self.bytes(
            "publish.maxBytesInFlight",
            raw.max_bytes_in_flight,
            d.bytes_in_flight_max as u64,
            (BYTES_IN_FLIGHT_MIN, BYTES_IN_FLIGHT_LIMIT),
        )?;
        Ok(PublishConfig {
            // Bounded by MESSAGE_BYTES_LIMIT above, so it fits.
            message_bytes_max: usize::try_from(message_bytes_max).unwrap_or(usize::MAX),
            bytes_in_flight_max: usize::try_from(bytes_in_flight_max).map_err(|_| {
                self.invalid(
                    "publish.maxBytesInFlight",
                    "does not fit in this host's memory",
                )
            })?,
            batch_len_max: self.count(
                "publish.maxBatchMessages",
                raw.max_batch_messages,
                d.batch_len_max,
                BATCH_LEN_LIMIT,
            )?,
            ack_level_min,
            dedup_window_ms: self.millis(
                "publish.dedupWindow",
                raw.dedup_window,
                d.dedup_window_ms,
                DEDUP_WINDOW_LIMIT,
            )?,
            dedup_producers_max: self.count(
                "publish.dedupMaxProducers",
                raw.dedup_max_producers,
                d.dedup_producers_max,
                DEDUP_PRODUCERS_LIMIT,
            )?,
            dedup_entries_max: self.count(
                "publish.dedupMaxEntries",
                raw.dedup_max_entries,
                d.dedup_entries_max,
                DEDUP_ENTRIES_LIMIT,
            )?,
        })
    }

    fn server(&self, raw: RawServer) -> Result<ServerConfig, ConfigError> {
        let raw_limits = RawClientLimits {
            max_connections: raw.max_connections,
            idle_timeout: raw.idle_timeout,
            frame_timeout: raw.frame_timeout,
            deliver_timeout: raw.deliver_timeout,
            max_calls_in_flight: raw.max_calls_in_flight,
            max_subscriptions_per_connection: raw.max_subscriptions_per_connection,
            max_send_buffer_bytes: raw.max_send_buffer_bytes,
            max_node_send_buffer_bytes: raw.max_node_send_buffer_bytes,
            send_stall_timeout: raw.send_stall_timeout,
        };
        let d = ServerConfig {
            cpus: CpuList::all_of(&self.online_cpus),
            ..ServerConfig::default()
        };
        let data_dir = match raw.data_dir {
            None => d.data_dir,
            Some(text) if text.trim().is_empty() => {
                return Err(self.invalid("server.dataDir", "must not be empty"))
            }
            Some(text) => PathBuf::from(text),
        };
        let cpus = match raw.cpus {
            None => d.cpus,
            Some(CpuText(text)) => CpuList::resolve(&text, &self.online_cpus)
                .map_err(|err| self.invalid("server.cpus", err.to_string()))?,
        };
        let listen = match raw.listen {
            None => d.listen,
            Some(text) => self.address("server.listen", &text)?,
        };
        let metrics_listen = match raw.metrics_listen {
            None => d.metrics_listen,
            Some(text) => self.address("server.metricsListen", &text)?,
        };
        let shard_port_base = match raw.shard_port_base {
            None => None,
            Some(base) => Some(u16::try_from(base).map_err(|_| {
                self.invalid(
                    "server.shardPortBase",
                    format!("must be a port number up to 65535, found {base}"),
                )
            })?),
        };
        let numa = match raw.numa.as_deref().map(str::trim) {
            None => d.numa,
            Some("off") => NumaMode::Off,
            Some("auto") => NumaMode::Auto,
            Some(other) => {
                return Err(self.invalid(
                    "server.numa",
                    format!("must be \"auto\" or \"off\", found \"{other}\""),
                ))
            }
        };
        Ok(ServerConfig {
            data_dir,
            cpus,
            listen,
            metrics_listen,
            shard_port_base,
            numa,
            client: self.client_limits(&raw_limits)?,
            idle_poll_us: self.idle_poll(raw.idle_poll)?,
        })
    }

    /// `[server.tls]`: both files or neither; a client CA only with them. The files are read
    /// and checked when the server starts (`crate::security::tls`), not here.
    fn tls(&self, raw: &RawServer) -> Result<Option<TlsFiles>, ConfigError> {
        let path = |value: &Option<String>| {
            value
                .as_deref()
                .map(str::trim)
                .filter(|text| !text.is_empty())
                .map(PathBuf::from)
        };
        let cert_file = path(&raw.tls_cert_file);
        let key_file = path(&raw.tls_key_file);
        let client_ca_file = path(&raw.tls_client_ca_file);
        match (cert_file, key_file) {
            (None, None) if client_ca_file.is_some() => Err(self.invalid(
                "server.tlsClientCaFile",
                "needs server.tls.certFile and keyFile (client certificates are checked over TLS)",
            )),
            (None, None) => Ok(None),
            (Some(_), None) => Err(self.invalid(
                "server.tlsCertFile",
                "needs server.tls.keyFile, the certificate's private key",
            )),
            (None, Some(_)) => Err(self.invalid(
                "server.tlsKeyFile",
                "needs server.tls.certFile, the certificate of this key",
            )),
            (Some(cert_file), Some(key_file)) => Ok(Some(TlsFiles {
                cert_file,
                key_file,
                client_ca_file,
            })),
        }
    }

    /// `[[auth.tokens]]`: every entry named (uniquely), with a 64-digit hex SHA-256.
    fn tokens(&self, raw: RawAuth) -> Result<Vec<TokenSpec>, ConfigError> {
        let raw = raw.tokens.unwrap_or_default();
        if raw.len() > TOKENS_MAX {
            return Err(self.invalid(
                "auth.tokens",
                format!("at most {TOKENS_MAX} tokens, found {}", raw.len()),
            ));
        }
        let mut specs: Vec<TokenSpec> = Vec::with_capacity(raw.len());
        for (i, token) in raw.into_iter().enumerate() {
            let name = token.name.trim().to_owned();
            if name.is_empty() {
                return Err(self.invalid("auth.tokens", format!("entry {i} has no name")));
            }
            if specs.iter().any(|s| s.name == name) {
                return Err(self.invalid(
                    "auth.tokens",
                    format!("two entries are named {name:?}: names must be unique"),
                ));
            }
            let Some(sha256) = parse_sha256_hex(&token.sha256) else {
                return Err(self.invalid(
                    "auth.tokens",
                    format!(
                        "token {name:?}: sha256 must be the 64 hex digits of the token's SHA-256 (printf %s TOKEN | sha256sum)"
                    ),
                ));
            };
            specs.push(TokenSpec {
                name,
                sha256,
                publish: token.publish,
                consume: token.consume,
                admin: token.admin,
            });
        }
        Ok(specs)
    }

    fn client_limits(&self, raw: &RawClientLimits) -> Result<ClientLimits, ConfigError> {
        let d = ClientLimits::default();
        Ok(ClientLimits {
            connections_max: self.count(
                "server.maxConnections",
                raw.max_connections,
                d.connections_max,
                CONNECTIONS_LIMIT,
            )?,
            idle_timeout_ms: self.millis(
                "server.idleTimeout",
                raw.idle_timeout,
                d.idle_timeout_ms,
                IDLE_TIMEOUT_MAX,
            )?,
            frame_timeout_ms: self.millis(
                "server.frameTimeout",
                raw.frame_timeout,
                d.frame_timeout_ms,
                FRAME_TIMEOUT_MAX,
            )?,
            deliver_timeout_ms: self.millis(
                "server.deliverTimeout",
                raw.deliver_timeout,
                d.deliver_timeout_ms,
                FRAME_TIMEOUT_MAX,
            )?,
            calls_in_flight_max: self.count(
                "server.maxCallsInFlight",
                raw.max_calls_in_flight,
                d.calls_in_flight_max,
                CALLS_IN_FLIGHT_LIMIT,
            )?,
            subscriptions_max: self.count(
                "server.maxSubscriptionsPerConnection",
                raw.max_subscriptions_per_connection,
                d.subscriptions_max,
                SUBSCRIPTIONS_PER_CONNECTION_LIMIT,
            )?,
            send_buffer_bytes_max: self.bytes(
                "server.maxSendBufferBytes",
                raw.max_send_buffer_bytes,
                d.send_buffer_bytes_max as u64,
                (SEND_BUFFER_BYTES_MIN, SEND_BUFFER_BYTES_LIMIT),
            )? as usize,
            node_send_buffer_bytes_max: self.bytes(
                "server.maxNodeSendBufferBytes",
                raw.max_node_send_buffer_bytes,
                d.node_send_buffer_bytes_max as u64,
                (SEND_BUFFER_BYTES_MIN, SEND_BUFFER_BYTES_LIMIT),
            )? as usize,
            send_stall_timeout_ms: self.millis(
                "server.sendStallTimeout",
                raw.send_stall_timeout,
                d.send_stall_timeout_ms,
                IDLE_TIMEOUT_MAX,
            )?,
        })
    }

    /// `server.idlePoll`: 0 (off) or a whole number of microseconds up to [`IDLE_POLL_MAX`].
    fn idle_poll(&self, value: Option<DurationValue>) -> Result<u64, ConfigError> {
        let key = "server.idlePoll";
        let Some(DurationValue(duration)) = value else {
            return Ok(ServerConfig::default().idle_poll_us);
        };
        if duration.subsec_nanos() % 1_000 != 0 {
            return Err(self.invalid(
                key,
                format!(
                    "must be a whole number of microseconds, found {}",
                    humantime::format_duration(duration)
                ),
            ));
        }
        if duration > IDLE_POLL_MAX {
            return Err(self.invalid(
                key,
                format!(
                    "must be at most {} (a spin longer than that burns a core for little), found {}",
                    humantime::format_duration(IDLE_POLL_MAX),
                    humantime::format_duration(duration)
                ),
            ));
        }
        Ok(duration.as_micros() as u64)
    }

    fn address(&self, key: &str, text: &str) -> Result<SocketAddr, ConfigError> {
        text.trim().parse().map_err(|_| {
            self.invalid(
                key,
                format!(
                    "\"{text}\" is not an IP:port address: write e.g. \"127.0.0.1:7400\" or \"[::1]:7400\""
                ),
            )
        })
    }

    fn storage(&self, raw: RawStorage) -> Result<StorageConfig, ConfigError> {
        let d = StorageConfig::default();
        let engine = match raw.engine.as_deref() {
            None => d.engine,
            Some("lsm") => StorageEngine::Lsm,
            Some("memory") => StorageEngine::Memory,
            Some(other) => {
                return Err(self.invalid(
                    "storage.engine",
                    format!("must be \"lsm\" or \"memory\", found \"{other}\""),
                ))
            }
        };
        let memtable_bytes_max = self.bytes(
            "storage.memtableBytes",
            raw.memtable_bytes,
            d.memtable_bytes_max as u64,
            (MEMTABLE_BYTES_MIN, MEMTABLE_BYTES_LIMIT),
        )?;
        let wal_segment_bytes_max = self.bytes(
            "storage.walSegmentBytes",
            raw.wal_segment_bytes,
            d.wal_segment_bytes_max,
            (WAL_SEGMENT_BYTES_MIN, WAL_SEGMENT_BYTES_LIMIT),
        )?;
        if wal_segment_bytes_max % WAL_SEGMENT_ALIGNMENT_BYTES != 0 {
            return Err(self.invalid(
                "storage.walSegmentBytes",
                format!(
                    "must be a multiple of {WAL_SEGMENT_ALIGNMENT_BYTES} bytes (segments are written with O_DIRECT), found {wal_segment_bytes_max}"
                ),
            ));
        }
        let wal_bytes_max = match raw.wal_max_bytes {
            None => WAL_MAX_BYTES_DEFAULT.max(4 * memtable_bytes_max),
            set => self.bytes(
                "storage.walMaxBytes",
                set,
                WAL_MAX_BYTES_DEFAULT,
                (WAL_MAX_BYTES_MIN, WAL_MAX_BYTES_LIMIT),
            )?,
        };
        Ok(StorageConfig {
            engine,
            // Bounded by MEMTABLE_BYTES_LIMIT above; only a 32-bit host could fail this.
            memtable_bytes_max: usize::try_from(memtable_bytes_max).map_err(|_| {
                self.invalid(
                    "storage.memtableBytes",
                    "does not fit in this host's memory",
                )
            })?,
            wal_segment_bytes_max,
            wal_bytes_max,
            recover_truncated_wal: false,
        })
    }

    /// Rules that involve two keys. The error names the key the operator set, so the message
    /// points at the line to change.
    fn check_across_keys(&self, config: &Config) -> Result<(), ConfigError> {
        let set_by_operator = |key: &str| self.origin(key) != Origin::Default;

        let delivery = &config.delivery;
        if delivery.delete_backlog_keys_max < delivery.delete_batch_keys_max {
            let blamed = if set_by_operator("delivery.deleteBacklogMaxKeys") {
                "delivery.deleteBacklogMaxKeys"
            } else {
                "delivery.deleteBatchMaxKeys"
            };
            return Err(self.invalid(
                blamed,
                format!(
                    "delivery.deleteBacklogMaxKeys ({}) must be at least delivery.deleteBatchMaxKeys ({}): dispatch pauses at the backlog bound, so a smaller bound never lets a full batch form and every delete would wait for deleteBatchInterval",
                    delivery.delete_backlog_keys_max, delivery.delete_batch_keys_max
                ),
            ));
        }

        if config.storage.engine == StorageEngine::Lsm {
            let message = config.publish.message_bytes_max as u64;
            for (key, limit) in [
                (
                    "storage.walSegmentBytes",
                    config.storage.wal_segment_bytes_max,
                ),
                (
                    "storage.memtableBytes",
                    config.storage.memtable_bytes_max as u64,
                ),
            ] {
                if message >= limit {
                    let blamed = if set_by_operator(key) {
                        key
                    } else {
                        "publish.maxMessageBytes"
                    };
                    return Err(self.invalid(
                        blamed,
                        format!(
                            "publish.maxMessageBytes ({message} bytes) must be smaller than {key} ({limit} bytes): a message must fit in one"
                        ),
                    ));
                }
            }
        }

        let publish = &config.publish;
        if publish.bytes_in_flight_max < publish.message_bytes_max {
            let blamed = if set_by_operator("publish.maxBytesInFlight") {
                "publish.maxBytesInFlight"
            } else {
                "publish.maxMessageBytes"
            };
            return Err(self.invalid(
                blamed,
                format!(
                    "publish.maxBytesInFlight ({} bytes) must be at least publish.maxMessageBytes ({} bytes): a publish of one message must fit in a shard's budget",
                    publish.bytes_in_flight_max, publish.message_bytes_max
                ),
            ));
        }

        let server = &config.server;
        let may_collide = |a: SocketAddr, b: SocketAddr| {
            a.port() != 0
                && a.port() == b.port()
                && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
        };
        if may_collide(server.listen, server.metrics_listen) {
            return Err(self.invalid(
                "server.metricsListen",
                format!(
                    "{} uses the same port as server.listen ({})",
                    server.metrics_listen, server.listen
                ),
            ));
        }

        let shards = server.cpus.len() as u64;
        let base = match server.shard_port_base {
            Some(0) => None,
            Some(base) => Some(u64::from(base)),
            None if server.listen.port() == 0 => None,
            None => Some(u64::from(server.listen.port()) + 1),
        };
        if let Some(first) = base {
            let last = first + shards.saturating_sub(1);
            let key = if server.shard_port_base.is_some() {
                "server.shardPortBase"
            } else {
                "server.listen"
            };
            if last > u64::from(u16::MAX) {
                return Err(self.invalid(
                    key,
                    format!(
                        "the per-shard ports {first}-{last} of {shards} shards go past 65535: set server.shardPortBase lower"
                    ),
                ));
            }
            let ports = first..=last;
            if ports.contains(&u64::from(server.listen.port())) {
                return Err(self.invalid(
                    "server.shardPortBase",
                    format!(
                        "the per-shard ports {first}-{last} include the client port of server.listen ({})",
                        server.listen
                    ),
                ));
            }
            let shard_ip = SocketAddr::new(server.listen.ip(), server.metrics_listen.port());
            if ports.contains(&u64::from(server.metrics_listen.port()))
                && may_collide(shard_ip, server.metrics_listen)
            {
                let key = if set_by_operator("server.metricsListen") {
                    "server.metricsListen"
                } else {
                    key
                };
                return Err(self.invalid(
                    key,
                    format!(
                        "the per-shard ports {first}-{last} include the metrics port of server.metricsListen ({})",
                        server.metrics_listen
                    ),
                ));
            }
        }
        Ok(())
    }
}
