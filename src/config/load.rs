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
//! with `PINQ_DELIVERY_`, `PINQ_PUBLISH_`, `PINQ_SERVER_` or `PINQ_STORAGE_` must name a key;
//! other `PINQ_` variables are not configuration and are ignored here. A value that is an integer
//! is read as one; anything else is a string, parsed like the same string in TOML.
//!
//! Runs once at start-up, never on a hot path.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::{self, Deserialize, Deserializer, Visitor};

use super::{
    format_byte_size, online_cpus, parse_byte_size, AckLevel, Config, CpuList, DeliveryConfig,
    NumaMode, PublishConfig, ServerConfig, StorageConfig, StorageEngine,
};

/// Prefix of every configuration environment variable.
pub const ENV_PREFIX: &str = "PINQ_";

// Upper bounds of the keys. Each is far above any sensible setting and exists to catch a typo
// (a missing unit, an extra zero) before it becomes a broker that never redelivers or a queue
// that eats the machine's memory.
const DISPATCH_POLL_INTERVAL_MAX: Duration = Duration::from_secs(60);
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
const MESSAGE_BYTES_LIMIT: u64 = 64 << 20;
const BATCH_LEN_LIMIT: usize = 1_000_000;
const MEMTABLE_BYTES_MIN: u64 = 64 << 10;
const MEMTABLE_BYTES_LIMIT: u64 = 64 << 30;
const WAL_SEGMENT_BYTES_MIN: u64 = 64 << 10;
const WAL_SEGMENT_BYTES_LIMIT: u64 = 16 << 30;
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

// ---------------------------------------------------------------------------------------------
// Raw structs: the TOML shape. Their serde field names are the one list of accepted keys.

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct RawConfig {
    delivery: RawDelivery,
    publish: RawPublish,
    server: RawServer,
    storage: RawStorage,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct RawDelivery {
    dispatch_poll_interval: Option<DurationValue>,
    in_flight_timeout: Option<DurationValue>,
    delete_batch_interval: Option<DurationValue>,
    delete_batch_max_keys: Option<u64>,
    delete_batches_in_flight: Option<u64>,
    delete_backlog_max_keys: Option<u64>,
    ttl_sweep_interval: Option<DurationValue>,
    consumer_queue_size: Option<u64>,
    time_bucket: Option<DurationValue>,
    group_retention: Option<DurationValue>,
    max_unacked_per_consumer: Option<u64>,
    retry_queue_size: Option<u64>,
    scan_batch_size: Option<u64>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct RawPublish {
    max_message_bytes: Option<ByteSizeValue>,
    max_batch_messages: Option<u64>,
    min_ack_level: Option<String>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct RawServer {
    data_dir: Option<String>,
    cpus: Option<CpuText>,
    listen: Option<String>,
    metrics_listen: Option<String>,
    shard_port_base: Option<u64>,
    numa: Option<String>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
struct RawStorage {
    engine: Option<String>,
    memtable_bytes: Option<ByteSizeValue>,
    wal_segment_bytes: Option<ByteSizeValue>,
}

/// The section names (`delivery`, …).
fn sections() -> &'static [&'static str] {
    field_names::<RawConfig>()
}

/// The keys a section accepts, camelCase as in TOML.
fn section_keys(section: &str) -> Option<&'static [&'static str]> {
    match section {
        "delivery" => Some(field_names::<RawDelivery>()),
        "publish" => Some(field_names::<RawPublish>()),
        "server" => Some(field_names::<RawServer>()),
        "storage" => Some(field_names::<RawStorage>()),
        _ => None,
    }
}

/// The schema's own spelling of `section.key`, if it is a key.
fn known_key(section: &str, key: &str) -> Option<(&'static str, &'static str)> {
    let section = *sections().iter().find(|known| **known == section)?;
    let key = *section_keys(section)?.iter().find(|known| **known == key)?;
    Some((section, key))
}

/// Every key as `(section, key)`, in schema order.
#[cfg(test)]
fn all_keys() -> Vec<(&'static str, &'static str)> {
    sections()
        .iter()
        .flat_map(|section| {
            section_keys(section)
                .unwrap_or(&[])
                .iter()
                .map(move |key| (*section, *key))
        })
        .collect()
}

/// The field names serde's derive passes to `deserialize_struct`, captured by a deserializer that
/// records them and stops. This keeps the raw structs as the only list of key names: the key
/// check below and `deny_unknown_fields` can never disagree.
fn field_names<T: for<'de> Deserialize<'de>>() -> &'static [&'static str] {
    struct FieldNames(&'static [&'static str]);

    impl<'de> Deserializer<'de> for &mut FieldNames {
        type Error = de::value::Error;

        fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("only struct field names are read"))
        }

        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _visitor: V,
        ) -> Result<V::Value, Self::Error> {
            self.0 = fields;
            Err(de::Error::custom("field names recorded"))
        }

        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
            option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
            ignored_any
        }
    }

    let mut names = FieldNames(&[]);
    // The error is the expected way out: the names were recorded before it.
    let _ = T::deserialize(&mut names);
    names.0
}

/// A duration written with a unit (`"50ms"`, `"5s"`, `"24h"`, humantime syntax). A bare `0` is
/// accepted so that it is refused later as zero, with the same message as `"0s"`.
#[derive(Clone, Copy, Debug)]
struct DurationValue(Duration);

impl<'de> Deserialize<'de> for DurationValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<DurationValue, D::Error> {
        struct DurationVisitor;

        impl Visitor<'_> for DurationVisitor {
            type Value = DurationValue;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration with a unit such as \"50ms\", \"5s\" or \"24h\"")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<DurationValue, E> {
                humantime::parse_duration(text.trim())
                    .map(DurationValue)
                    .map_err(|err| {
                        E::custom(format!(
                            "\"{text}\" is not a duration ({err}): write e.g. \"50ms\", \"5s\" or \"24h\""
                        ))
                    })
            }

            fn visit_i64<E: de::Error>(self, number: i64) -> Result<DurationValue, E> {
                if number == 0 {
                    Ok(DurationValue(Duration::ZERO))
                } else {
                    Err(E::custom(format!(
                        "{number} has no unit: write e.g. \"{number}ms\" or \"{number}s\""
                    )))
                }
            }

            fn visit_u64<E: de::Error>(self, number: u64) -> Result<DurationValue, E> {
                self.visit_i64(i64::try_from(number).unwrap_or(i64::MAX))
            }
        }

        deserializer.deserialize_any(DurationVisitor)
    }
}

/// A byte size: an integer number of bytes or a string such as `"64MiB"` (see `bytes.rs`).
#[derive(Clone, Copy, Debug)]
struct ByteSizeValue(u64);

impl<'de> Deserialize<'de> for ByteSizeValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<ByteSizeValue, D::Error> {
        struct ByteSizeVisitor;

        impl Visitor<'_> for ByteSizeVisitor {
            type Value = ByteSizeValue;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number of bytes or a size such as \"64MiB\"")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<ByteSizeValue, E> {
                parse_byte_size(text).map(ByteSizeValue).map_err(E::custom)
            }

            fn visit_i64<E: de::Error>(self, number: i64) -> Result<ByteSizeValue, E> {
                u64::try_from(number)
                    .map(ByteSizeValue)
                    .map_err(|_| E::custom(format!("{number} is negative")))
            }

            fn visit_u64<E: de::Error>(self, number: u64) -> Result<ByteSizeValue, E> {
                Ok(ByteSizeValue(number))
            }
        }

        deserializer.deserialize_any(ByteSizeVisitor)
    }
}

/// A CPU list as text (`"0-3,8"`, `"all"`); a bare integer means that one CPU. Resolved against
/// the online CPUs during conversion.
#[derive(Clone, Debug)]
struct CpuText(String);

impl<'de> Deserialize<'de> for CpuText {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<CpuText, D::Error> {
        struct CpuTextVisitor;

        impl Visitor<'_> for CpuTextVisitor {
            type Value = CpuText;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a CPU list such as \"0-3,8\" or \"all\"")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<CpuText, E> {
                Ok(CpuText(text.to_owned()))
            }

            fn visit_i64<E: de::Error>(self, number: i64) -> Result<CpuText, E> {
                Ok(CpuText(number.to_string()))
            }

            fn visit_u64<E: de::Error>(self, number: u64) -> Result<CpuText, E> {
                Ok(CpuText(number.to_string()))
            }
        }

        deserializer.deserialize_any(CpuTextVisitor)
    }
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
            for (key_name, value) in entries {
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
        let server = self.server(raw.server)?;
        let storage = self.storage(raw.storage)?;
        let config = Config {
            delivery,
            publish,
            server,
            storage,
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
        Ok(PublishConfig {
            // Bounded by MESSAGE_BYTES_LIMIT above, so it fits.
            message_bytes_max: usize::try_from(message_bytes_max).unwrap_or(usize::MAX),
            batch_len_max: self.count(
                "publish.maxBatchMessages",
                raw.max_batch_messages,
                d.batch_len_max,
                BATCH_LEN_LIMIT,
            )?,
            ack_level_min,
        })
    }

    fn server(&self, raw: RawServer) -> Result<ServerConfig, ConfigError> {
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
        })
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

/// `PINQ_SECTION_REST` → (`section`, `REST`) when SECTION is a config section.
fn env_section(name: &str) -> Option<(&'static str, &str)> {
    let rest = name.strip_prefix(ENV_PREFIX)?;
    let (section, key_part) = rest.split_once('_')?;
    let section = sections()
        .iter()
        .copied()
        .find(|known| known.eq_ignore_ascii_case(section))?;
    Some((section, key_part))
}

/// `inFlightTimeout` → `IN_FLIGHT_TIMEOUT`.
fn env_key_part(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 4);
    for c in key.chars() {
        if c.is_ascii_uppercase() {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// The environment variable that sets `section.key`.
pub fn env_var_name(section: &str, key: &str) -> String {
    format!(
        "{ENV_PREFIX}{}_{}",
        section.to_ascii_uppercase(),
        env_key_part(key)
    )
}

/// An environment value as a TOML value: integers as integers, everything else as a string.
fn env_value(text: &str) -> toml::Value {
    match text.trim().parse::<i64>() {
        Ok(number) => toml::Value::Integer(number),
        Err(_) => toml::Value::String(text.to_owned()),
    }
}

fn normalized(name: &str) -> String {
    name.chars()
        .filter(|c| *c != '_' && *c != '-')
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// ` (did you mean "x"?)` when a known name differs from `found` only in case or separators.
fn file_hint(candidates: impl Iterator<Item = String>, found: &str) -> String {
    let wanted = normalized(found);
    candidates
        .into_iter()
        .find(|candidate| normalized(candidate) == wanted)
        .map(|candidate| format!(" (did you mean \"{candidate}\"?)"))
        .unwrap_or_default()
}

/// Builds `{ section = { key = value } }` out of settings.
fn nest<'a>(
    settings: impl Iterator<Item = (&'a (&'static str, &'static str), &'a Setting)>,
) -> toml::Value {
    let mut root = toml::Table::new();
    for ((section, key), setting) in settings {
        let entry = root
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(table) = entry {
            table.insert(key.to_string(), setting.value.clone());
        }
    }
    toml::Value::Table(root)
}

/// The `PINQ_…` configuration variables of this process, for [`ConfigLoader::add_env`].
pub fn env_from_process() -> Result<Vec<(String, String)>, ConfigError> {
    let mut vars = Vec::new();
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str() else {
            continue;
        };
        if env_section(name).is_none() {
            continue;
        }
        let value = value
            .into_string()
            .map_err(|_| ConfigError::EnvNotUnicode {
                name: name.to_owned(),
            })?;
        vars.push((name.to_owned(), value));
    }
    Ok(vars)
}

impl Config {
    /// The configuration as TOML that [`ConfigLoader`] reads back to the same value (for logs
    /// and for `pinq serve` operators who want to see what is in effect).
    pub fn to_toml(&self) -> String {
        let d = &self.delivery;
        let p = &self.publish;
        let s = &self.server;
        let st = &self.storage;
        let text = |value: &str| toml::Value::String(value.to_owned()).to_string();
        let duration = |ms: u64| text(&format_ms(ms));
        let bytes = |n: u64| text(&format_byte_size(n));
        let shard_port_base = match s.shard_port_base {
            Some(base) => format!("shardPortBase = {base}\n"),
            None => "# shardPortBase unset: client port + 1 + shard index\n".to_owned(),
        };
        format!(
            "[delivery]\n\
             dispatchPollInterval = {}\n\
             inFlightTimeout = {}\n\
             deleteBatchInterval = {}\n\
             deleteBatchMaxKeys = {}\n\
             deleteBatchesInFlight = {}\n\
             deleteBacklogMaxKeys = {}\n\
             ttlSweepInterval = {}\n\
             consumerQueueSize = {}\n\
             timeBucket = {}\n\
             groupRetention = {}\n\
             maxUnackedPerConsumer = {}\n\
             retryQueueSize = {}\n\
             scanBatchSize = {}\n\
             \n[publish]\n\
             maxMessageBytes = {}\n\
             maxBatchMessages = {}\n\
             minAckLevel = {}\n\
             \n[server]\n\
             dataDir = {}\n\
             cpus = {}\n\
             listen = {}\n\
             metricsListen = {}\n\
             {shard_port_base}\
             numa = {}\n\
             \n[storage]\n\
             engine = {}\n\
             memtableBytes = {}\n\
             walSegmentBytes = {}\n",
            duration(d.dispatch_poll_interval_ms),
            duration(d.in_flight_timeout_ms),
            duration(d.delete_batch_interval_ms),
            d.delete_batch_keys_max,
            d.delete_batches_in_flight_max,
            d.delete_backlog_keys_max,
            duration(d.ttl_sweep_interval_ms),
            d.consumer_queue_len_max,
            duration(d.time_bucket_ms),
            duration(d.group_retention_ms),
            d.unacked_per_consumer_max,
            d.retry_len_max,
            d.scan_batch_len_max,
            bytes(p.message_bytes_max as u64),
            p.batch_len_max,
            text(p.ack_level_min.as_str()),
            text(&s.data_dir.to_string_lossy()),
            text(s.cpus.text()),
            text(&s.listen.to_string()),
            text(&s.metrics_listen.to_string()),
            text(s.numa.as_str()),
            text(st.engine.as_str()),
            bytes(st.memtable_bytes_max as u64),
            bytes(st.wal_segment_bytes_max),
        )
    }
}

/// Milliseconds in the largest unit that divides them: `"24h"`, `"5s"`, `"50ms"`.
fn format_ms(ms: u64) -> String {
    if ms != 0 && ms % 3_600_000 == 0 {
        format!("{}h", ms / 3_600_000)
    } else if ms != 0 && ms % 1000 == 0 {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../../pinq.example.toml");

    fn test_loader() -> ConfigLoader {
        ConfigLoader::with_online_cpus(vec![0, 1, 2, 3])
    }

    fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let mut loader = test_loader();
        loader.add_toml(text, Path::new("test.toml"))?;
        loader.build()
    }

    fn error_from_toml(text: &str) -> ConfigError {
        match from_toml(text) {
            Ok(config) => panic!("accepted:\n{text}\nas {config:?}"),
            Err(err) => err,
        }
    }

    fn assert_names_key(err: &ConfigError, key: &str) {
        assert_eq!(err.key(), Some(key), "{err}");
        let message = err.to_string();
        assert!(
            message.contains(key),
            "message does not name {key}: {message}"
        );
    }

    #[test]
    fn example_file_parses_to_exactly_the_defaults() {
        let mut loader = ConfigLoader::new();
        loader
            .add_toml(EXAMPLE, Path::new("pinq.example.toml"))
            .unwrap();
        assert_eq!(loader.build().unwrap(), Config::default());
    }

    #[test]
    fn example_file_mentions_every_key() {
        for (section, key) in all_keys() {
            let section_start = EXAMPLE
                .find(&format!("[{section}]"))
                .unwrap_or_else(|| panic!("no [{section}] in pinq.example.toml"));
            let rest = &EXAMPLE[section_start..];
            let section_end = rest[1..].find("\n[").map_or(rest.len(), |end| end + 1);
            let mentioned = rest[..section_end].lines().any(|line| {
                let line = line.trim_start_matches(['#', ' ']);
                line.starts_with(&format!("{key} ="))
            });
            assert!(mentioned, "pinq.example.toml does not show {section}.{key}");
        }
    }

    #[test]
    fn no_sources_give_the_defaults() {
        let config = ConfigLoader::new().build().unwrap();
        assert_eq!(config, Config::default());
        assert_eq!(config.server.data_dir, PathBuf::from("./data"));
        assert_eq!(config.server.listen.to_string(), "127.0.0.1:7400");
        assert_eq!(config.server.metrics_listen.to_string(), "127.0.0.1:9400");
        assert_eq!(config.server.cpus.cpus(), online_cpus().as_slice());
        assert_eq!(config.storage.engine, StorageEngine::Lsm);
        assert_eq!(config.storage.memtable_bytes_max, 64 << 20);
        assert_eq!(config.storage.wal_segment_bytes_max, 64 << 20);
    }

    #[test]
    fn section_keys_are_read_from_the_raw_structs() {
        assert_eq!(sections(), &["delivery", "publish", "server", "storage"]);
        for section in sections() {
            assert!(section_keys(section).is_some(), "{section}");
        }
        let delivery = section_keys("delivery").unwrap();
        assert_eq!(delivery.len(), 13);
        assert!(delivery.contains(&"inFlightTimeout"));
        assert!(delivery.contains(&"ttlSweepInterval"));
        assert!(delivery.contains(&"maxUnackedPerConsumer"));
        assert_eq!(
            section_keys("server").unwrap(),
            &[
                "dataDir",
                "cpus",
                "listen",
                "metricsListen",
                "shardPortBase",
                "numa"
            ]
        );
        assert_eq!(all_keys().len(), 13 + 3 + 6 + 3);
    }

    #[test]
    fn zero_is_rejected_for_every_key_where_it_makes_no_sense_naming_the_key() {
        let zeros = [
            ("delivery", "dispatchPollInterval", "\"0s\""),
            ("delivery", "inFlightTimeout", "\"0ms\""),
            ("delivery", "deleteBatchInterval", "0"),
            ("delivery", "deleteBatchMaxKeys", "0"),
            ("delivery", "deleteBatchesInFlight", "0"),
            ("delivery", "deleteBacklogMaxKeys", "0"),
            ("delivery", "ttlSweepInterval", "\"0s\""),
            ("delivery", "consumerQueueSize", "0"),
            ("delivery", "timeBucket", "\"0ms\""),
            ("delivery", "groupRetention", "\"0h\""),
            ("delivery", "maxUnackedPerConsumer", "0"),
            ("delivery", "retryQueueSize", "0"),
            ("delivery", "scanBatchSize", "0"),
            ("publish", "maxMessageBytes", "0"),
            ("publish", "maxBatchMessages", "0"),
            ("storage", "memtableBytes", "\"0MiB\""),
            ("storage", "walSegmentBytes", "0"),
        ];
        for (section, key, zero) in zeros {
            let err = error_from_toml(&format!("[{section}]\n{key} = {zero}\n"));
            let dotted = format!("{section}.{key}");
            assert_names_key(&err, &dotted);
            assert_eq!(
                err.to_string(),
                format!("{dotted}: must be greater than zero (in test.toml)")
            );
        }
        // Every key whose zero is meaningless is in the list above; the rest are not numbers
        // (minAckLevel, dataDir, cpus, listen, metricsListen, engine) or zero means "ephemeral"
        // (shardPortBase).
        let zero_keys: Vec<String> = zeros.iter().map(|(s, k, _)| format!("{s}.{k}")).collect();
        for (section, key) in all_keys() {
            let dotted = format!("{section}.{key}");
            let exempt = [
                "publish.minAckLevel",
                "server.dataDir",
                "server.cpus",
                "server.listen",
                "server.metricsListen",
                "server.shardPortBase",
                "server.numa",
                "storage.engine",
            ];
            assert!(
                zero_keys.contains(&dotted) || exempt.contains(&dotted.as_str()),
                "{dotted} is neither checked at zero nor exempt"
            );
        }
    }

    #[test]
    fn unknown_key_is_rejected_naming_the_full_dotted_key_and_the_file() {
        let err = error_from_toml("[delivery]\ninFlightTimeout = \"5s\"\nfoo = 1\n");
        assert_names_key(&err, "delivery.foo");
        assert_eq!(err.to_string(), "unknown key \"delivery.foo\" in test.toml");

        let err =
            error_from_toml("[server]\nlisten = \"127.0.0.1:1\"\n[server.tls]\ncert = \"x\"\n");
        assert_names_key(&err, "server.tls");

        let err = error_from_toml("delivery.bar = 1\n");
        assert_names_key(&err, "delivery.bar");
    }

    #[test]
    fn unknown_section_is_rejected_naming_it() {
        let err = error_from_toml("[raft]\nelectionTimeout = \"1s\"\n");
        assert_names_key(&err, "raft");
        let err = error_from_toml("verbose = true\n");
        assert_names_key(&err, "verbose");
    }

    #[test]
    fn a_key_spelled_differently_gets_a_suggestion() {
        let err = error_from_toml("[delivery]\nin_flight_timeout = \"5s\"\n");
        assert_eq!(
            err.to_string(),
            "unknown key \"delivery.in_flight_timeout\" in test.toml (did you mean \"delivery.inFlightTimeout\"?)"
        );
    }

    #[test]
    fn a_section_that_is_not_a_table_is_rejected_naming_it() {
        let err = error_from_toml("delivery = 5\n");
        assert_names_key(&err, "delivery");
    }

    #[test]
    fn a_value_of_the_wrong_type_names_its_key() {
        let cases = [
            (
                "[delivery]\ndeleteBatchMaxKeys = \"lots\"\n",
                "delivery.deleteBatchMaxKeys",
            ),
            (
                "[delivery]\nconsumerQueueSize = -1\n",
                "delivery.consumerQueueSize",
            ),
            (
                "[delivery]\ninFlightTimeout = 5\n",
                "delivery.inFlightTimeout",
            ),
            (
                "[delivery]\ninFlightTimeout = \"5 parsecs\"\n",
                "delivery.inFlightTimeout",
            ),
            (
                "[publish]\nmaxMessageBytes = \"1MB\"\n",
                "publish.maxMessageBytes",
            ),
            ("[publish]\nminAckLevel = 2\n", "publish.minAckLevel"),
            ("[server]\nlisten = 7400\n", "server.listen"),
            ("[server]\ncpus = [0, 1]\n", "server.cpus"),
            ("[storage]\nmemtableBytes = true\n", "storage.memtableBytes"),
        ];
        for (text, key) in cases {
            let err = error_from_toml(text);
            assert_names_key(&err, key);
            assert!(err.to_string().starts_with(&format!("{key}: ")), "{err}");
        }
    }

    #[test]
    fn out_of_range_values_are_rejected_naming_the_key() {
        let cases = [
            (
                "[publish]\nmaxMessageBytes = \"65MiB\"\n",
                "publish.maxMessageBytes",
            ),
            ("[delivery]\ntimeBucket = \"2h\"\n", "delivery.timeBucket"),
            (
                "[delivery]\ninFlightTimeout = \"1500us\"\n",
                "delivery.inFlightTimeout",
            ),
            (
                "[delivery]\ninFlightTimeout = \"2days\"\n",
                "delivery.inFlightTimeout",
            ),
            (
                "[delivery]\ndispatchPollInterval = \"5min\"\n",
                "delivery.dispatchPollInterval",
            ),
            (
                "[delivery]\nconsumerQueueSize = 100000000\n",
                "delivery.consumerQueueSize",
            ),
            (
                "[delivery]\nscanBatchSize = 1000000\n",
                "delivery.scanBatchSize",
            ),
            (
                "[delivery]\ndeleteBatchesInFlight = 65\n",
                "delivery.deleteBatchesInFlight",
            ),
            (
                "[delivery]\ndeleteBacklogMaxKeys = 100000000\n",
                "delivery.deleteBacklogMaxKeys",
            ),
            (
                "[publish]\nmaxBatchMessages = 2000000\n",
                "publish.maxBatchMessages",
            ),
            (
                "[storage]\nwalSegmentBytes = 1000000\n",
                "storage.walSegmentBytes",
            ),
            (
                "[storage]\nmemtableBytes = \"4KiB\"\n",
                "storage.memtableBytes",
            ),
            ("[storage]\nengine = \"rocksdb\"\n", "storage.engine"),
            (
                "[publish]\nminAckLevel = \"quorum\"\n",
                "publish.minAckLevel",
            ),
            ("[server]\nlisten = \"localhost:7400\"\n", "server.listen"),
            (
                "[server]\nmetricsListen = \"9400\"\n",
                "server.metricsListen",
            ),
            ("[server]\ndataDir = \"\"\n", "server.dataDir"),
            ("[server]\ncpus = \"3-1\"\n", "server.cpus"),
            ("[server]\ncpus = \"0-7\"\n", "server.cpus"),
            ("[server]\nshardPortBase = 70000\n", "server.shardPortBase"),
            ("[server]\nnuma = \"node0\"\n", "server.numa"),
        ];
        for (text, key) in cases {
            let err = error_from_toml(text);
            assert_names_key(&err, key);
        }
    }

    #[test]
    fn a_delete_backlog_smaller_than_a_delete_batch_is_rejected_naming_the_key_that_was_set() {
        let err = error_from_toml("[delivery]\ndeleteBacklogMaxKeys = 1000\n");
        assert_names_key(&err, "delivery.deleteBacklogMaxKeys");
        assert!(
            err.to_string()
                .contains("must be at least delivery.deleteBatchMaxKeys (65536)"),
            "{err}"
        );
        let err = error_from_toml("[delivery]\ndeleteBatchMaxKeys = 500000\n");
        assert_names_key(&err, "delivery.deleteBatchMaxKeys");
        let config = from_toml(
            "[delivery]\ndeleteBatchMaxKeys = 100\ndeleteBacklogMaxKeys = 100\ndeleteBatchesInFlight = 1\n",
        )
        .unwrap();
        assert_eq!(config.delivery.delete_backlog_keys_max, 100);
        assert_eq!(config.delivery.delete_batches_in_flight_max, 1);
    }

    #[test]
    fn a_time_bucket_wider_than_the_in_flight_timeout_is_accepted() {
        let config =
            from_toml("[delivery]\ntimeBucket = \"10s\"\ninFlightTimeout = \"1s\"\n").unwrap();
        assert_eq!(config.delivery.time_bucket_ms, 10_000);
        assert_eq!(config.delivery.in_flight_timeout_ms, 1_000);
    }

    #[test]
    fn durations_and_sizes_accept_their_documented_forms() {
        let config = from_toml(
            "[delivery]\ninFlightTimeout = \"1m 30s\"\ngroupRetention = \"7days\"\n\
             [publish]\nmaxMessageBytes = 4096\n[storage]\nmemtableBytes = \"128 MiB\"\n",
        )
        .unwrap();
        assert_eq!(config.delivery.in_flight_timeout_ms, 90_000);
        assert_eq!(config.delivery.group_retention_ms, 7 * 24 * 3600 * 1000);
        assert_eq!(config.publish.message_bytes_max, 4096);
        assert_eq!(config.storage.memtable_bytes_max, 128 << 20);
    }

    #[test]
    fn a_message_that_cannot_fit_a_wal_segment_is_rejected_naming_the_key_that_was_set() {
        let err = error_from_toml(
            "[storage]\nwalSegmentBytes = \"512KiB\"\n[publish]\nmaxMessageBytes = \"1MiB\"\n",
        );
        assert_names_key(&err, "storage.walSegmentBytes");
        let err = error_from_toml("[publish]\nmaxMessageBytes = \"64MiB\"\n");
        assert_names_key(&err, "publish.maxMessageBytes");
        let config =
            from_toml("[publish]\nmaxMessageBytes = \"64MiB\"\n[storage]\nengine = \"memory\"\n")
                .unwrap();
        assert_eq!(config.publish.message_bytes_max, 64 << 20);
    }

    #[test]
    fn environment_overrides_file() {
        let mut loader = test_loader();
        loader
            .add_toml(
                "[delivery]\ninFlightTimeout = \"10s\"\nconsumerQueueSize = 10\n",
                Path::new("test.toml"),
            )
            .unwrap();
        loader
            .add_env([("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "2s")])
            .unwrap();
        let config = loader.build().unwrap();
        assert_eq!(config.delivery.in_flight_timeout_ms, 2_000);
        assert_eq!(config.delivery.consumer_queue_len_max, 10);
    }

    #[test]
    fn flags_override_environment() {
        let mut loader = test_loader();
        loader
            .add_toml(
                "[server]\nlisten = \"127.0.0.1:1000\"\n",
                Path::new("test.toml"),
            )
            .unwrap();
        loader
            .add_env([
                ("PINQ_SERVER_LISTEN", "127.0.0.1:2000"),
                ("PINQ_STORAGE_ENGINE", "memory"),
            ])
            .unwrap();
        loader
            .set(
                "server.listen",
                toml::Value::String("127.0.0.1:3000".to_owned()),
                Origin::Flag("--listen"),
            )
            .unwrap();
        let config = loader.build().unwrap();
        assert_eq!(config.server.listen.port(), 3000);
        assert_eq!(config.storage.engine, StorageEngine::Memory);
    }

    #[test]
    fn every_key_can_be_set_from_its_environment_variable() {
        let values = [
            ("PINQ_DELIVERY_DISPATCH_POLL_INTERVAL", "10ms"),
            ("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "2s"),
            ("PINQ_DELIVERY_DELETE_BATCH_INTERVAL", "100ms"),
            ("PINQ_DELIVERY_DELETE_BATCH_MAX_KEYS", "2048"),
            ("PINQ_DELIVERY_DELETE_BATCHES_IN_FLIGHT", "2"),
            ("PINQ_DELIVERY_DELETE_BACKLOG_MAX_KEYS", "8192"),
            ("PINQ_DELIVERY_TTL_SWEEP_INTERVAL", "30s"),
            ("PINQ_DELIVERY_CONSUMER_QUEUE_SIZE", "64"),
            ("PINQ_DELIVERY_TIME_BUCKET", "10ms"),
            ("PINQ_DELIVERY_GROUP_RETENTION", "1h"),
            ("PINQ_DELIVERY_MAX_UNACKED_PER_CONSUMER", "100"),
            ("PINQ_DELIVERY_RETRY_QUEUE_SIZE", "1000"),
            ("PINQ_DELIVERY_SCAN_BATCH_SIZE", "32"),
            ("PINQ_PUBLISH_MAX_MESSAGE_BYTES", "64KiB"),
            ("PINQ_PUBLISH_MAX_BATCH_MESSAGES", "500"),
            ("PINQ_PUBLISH_MIN_ACK_LEVEL", "durable"),
            ("PINQ_SERVER_DATA_DIR", "/var/lib/pinq"),
            ("PINQ_SERVER_CPUS", "1"),
            ("PINQ_SERVER_LISTEN", "0.0.0.0:7500"),
            ("PINQ_SERVER_METRICS_LISTEN", "127.0.0.1:9500"),
            ("PINQ_SERVER_SHARD_PORT_BASE", "8000"),
            ("PINQ_SERVER_NUMA", "auto"),
            ("PINQ_STORAGE_ENGINE", "memory"),
            ("PINQ_STORAGE_MEMTABLE_BYTES", "1048576"),
            ("PINQ_STORAGE_WAL_SEGMENT_BYTES", "8MiB"),
        ];
        assert_eq!(values.len(), all_keys().len());
        for (section, key) in all_keys() {
            let name = env_var_name(section, key);
            assert!(
                values.iter().any(|(var, _)| *var == name),
                "{name} untested"
            );
        }
        let mut loader = test_loader();
        loader.add_env(values).unwrap();
        let config = loader.build().unwrap();
        let expected = Config {
            delivery: DeliveryConfig {
                dispatch_poll_interval_ms: 10,
                in_flight_timeout_ms: 2_000,
                delete_batch_interval_ms: 100,
                delete_batch_keys_max: 2048,
                delete_batches_in_flight_max: 2,
                delete_backlog_keys_max: 8192,
                ttl_sweep_interval_ms: 30_000,
                consumer_queue_len_max: 64,
                time_bucket_ms: 10,
                group_retention_ms: 3_600_000,
                unacked_per_consumer_max: 100,
                retry_len_max: 1000,
                scan_batch_len_max: 32,
            },
            publish: PublishConfig {
                message_bytes_max: 64 << 10,
                batch_len_max: 500,
                ack_level_min: AckLevel::Durable,
            },
            server: ServerConfig {
                data_dir: PathBuf::from("/var/lib/pinq"),
                cpus: CpuList::parse("1").unwrap(),
                listen: "0.0.0.0:7500".parse().unwrap(),
                metrics_listen: "127.0.0.1:9500".parse().unwrap(),
                shard_port_base: Some(8000),
                numa: NumaMode::Auto,
            },
            storage: StorageConfig {
                engine: StorageEngine::Memory,
                memtable_bytes_max: 1 << 20,
                wal_segment_bytes_max: 8 << 20,
            },
        };
        assert_eq!(config, expected);
    }

    #[test]
    fn unknown_config_variable_is_rejected_and_other_pinq_variables_are_ignored() {
        let mut loader = test_loader();
        let err = loader
            .add_env([("PINQ_DELIVERY_INFLIGHTTIMEOUT", "2s")])
            .unwrap_err();
        assert_names_key(&err, "delivery.INFLIGHTTIMEOUT");
        assert_eq!(
            err.to_string(),
            "unknown key \"delivery.INFLIGHTTIMEOUT\" from environment variable \
             PINQ_DELIVERY_INFLIGHTTIMEOUT (did you mean PINQ_DELIVERY_IN_FLIGHT_TIMEOUT?)"
        );

        let mut loader = test_loader();
        loader
            .add_env([
                ("PINQ_LOG", "debug"),
                ("HOME", "/root"),
                ("PINQ_TOPIC", "x"),
            ])
            .unwrap();
        assert_eq!(loader.build().unwrap().delivery, DeliveryConfig::default());
    }

    #[test]
    fn a_bad_environment_value_names_the_key_and_the_variable() {
        let mut loader = test_loader();
        loader
            .add_env([("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "0")])
            .unwrap();
        let err = loader.build().unwrap_err();
        assert_names_key(&err, "delivery.inFlightTimeout");
        assert_eq!(
            err.to_string(),
            "delivery.inFlightTimeout: must be greater than zero \
             (from environment variable PINQ_DELIVERY_IN_FLIGHT_TIMEOUT)"
        );
    }

    #[test]
    fn setting_an_unknown_key_is_refused() {
        let err = test_loader()
            .set(
                "server.port",
                toml::Value::Integer(1),
                Origin::Flag("--port"),
            )
            .unwrap_err();
        assert_names_key(&err, "server.port");
    }

    #[test]
    fn cpus_are_resolved_against_the_online_cpus() {
        let mut loader = ConfigLoader::with_online_cpus(vec![0, 1]);
        loader.add_env([("PINQ_SERVER_CPUS", "all")]).unwrap();
        assert_eq!(loader.build().unwrap().server.cpus.cpus(), &[0, 1]);

        let mut loader = ConfigLoader::with_online_cpus(vec![0, 1]);
        loader.add_env([("PINQ_SERVER_CPUS", "0-3,8")]).unwrap();
        let err = loader.build().unwrap_err();
        assert_names_key(&err, "server.cpus");
        assert!(err.to_string().contains("CPU 2 is not online"), "{err}");

        let config = from_toml("[server]\ncpus = \"0-2\"\n").unwrap();
        assert_eq!(config.server.cpus.cpus(), &[0, 1, 2]);
        assert_eq!(config.server.cpus.text(), "0-2");
    }

    #[test]
    fn shard_ports_default_to_the_client_port_plus_one() {
        let config = from_toml("[server]\ncpus = \"0-3\"\n").unwrap();
        let ports: Vec<u16> = (0..4)
            .map(|i| config.server.shard_listen(i).port())
            .collect();
        assert_eq!(ports, [7401, 7402, 7403, 7404]);

        let config = from_toml("[server]\ncpus = \"0,1\"\nshardPortBase = 8000\n").unwrap();
        assert_eq!(config.server.shard_listen(1).to_string(), "127.0.0.1:8001");
    }

    #[test]
    fn an_ephemeral_client_port_gives_ephemeral_shard_ports() {
        let config = from_toml("[server]\nlisten = \"127.0.0.1:0\"\ncpus = \"0,1\"\n").unwrap();
        assert_eq!(config.server.shard_listen(0).port(), 0);
        assert_eq!(config.server.shard_listen(1).port(), 0);
        let config = from_toml("[server]\nshardPortBase = 0\ncpus = \"0,1\"\n").unwrap();
        assert_eq!(config.server.shard_listen(1).port(), 0);
    }

    #[test]
    fn colliding_ports_are_rejected_naming_the_key() {
        let err = error_from_toml("[server]\nmetricsListen = \"127.0.0.1:7400\"\n");
        assert_names_key(&err, "server.metricsListen");
        let err = error_from_toml("[server]\nmetricsListen = \"0.0.0.0:7401\"\ncpus = \"0-1\"\n");
        assert_names_key(&err, "server.metricsListen");
        let err = error_from_toml("[server]\nshardPortBase = 7399\ncpus = \"0-3\"\n");
        assert_names_key(&err, "server.shardPortBase");
        let err = error_from_toml("[server]\nlisten = \"127.0.0.1:65535\"\n");
        assert_names_key(&err, "server.listen");
        // Same port on different addresses is fine.
        from_toml("[server]\nlisten = \"127.0.0.1:7400\"\nmetricsListen = \"127.0.0.2:7400\"\n")
            .unwrap();
    }

    #[test]
    fn a_missing_file_and_bad_toml_name_the_file() {
        let mut loader = test_loader();
        let err = loader
            .add_file(Path::new("/nonexistent/pinq.toml"))
            .unwrap_err();
        assert!(err.to_string().contains("/nonexistent/pinq.toml"), "{err}");
        let err = loader
            .add_toml("[delivery\n", Path::new("broken.toml"))
            .unwrap_err();
        assert!(matches!(err, ConfigError::Syntax { .. }));
        assert!(err.to_string().contains("broken.toml"), "{err}");
    }

    #[test]
    fn the_effective_config_renders_back_to_itself() {
        for text in [
            "",
            "[delivery]\ninFlightTimeout = \"90s\"\ntimeBucket = \"1500ms\"\ngroupRetention = \"2h\"\n\
             [publish]\nmaxMessageBytes = 1000\nminAckLevel = \"durable\"\n\
             [server]\ndataDir = \"/tmp/pinq \\\"x\\\"\"\ncpus = \"1-2\"\nshardPortBase = 9000\nnuma = \"auto\"\n\
             [storage]\nengine = \"memory\"\nwalSegmentBytes = \"1GiB\"\n",
        ] {
            let config = from_toml(text).unwrap();
            let rendered = config.to_toml();
            let again = from_toml(&rendered)
                .unwrap_or_else(|err| panic!("{err}\nin:\n{rendered}"));
            assert_eq!(again, config, "{rendered}");
        }
    }

    #[test]
    fn durations_render_in_their_largest_exact_unit() {
        assert_eq!(format_ms(50), "50ms");
        assert_eq!(format_ms(5_000), "5s");
        assert_eq!(format_ms(60_000), "60s");
        assert_eq!(format_ms(86_400_000), "24h");
        assert_eq!(format_ms(1_500), "1500ms");
    }
}
