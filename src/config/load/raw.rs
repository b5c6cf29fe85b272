//! The TOML shape of the configuration: raw structs whose serde field names are the one list of
//! accepted keys, and the value types that parse durations, byte sizes and CPU lists as they are
//! read. Every field is optional; the loader fills defaults and validates.

#![allow(unused_imports)]
use super::*;

// Raw structs: the TOML shape. Their serde field names are the one list of accepted keys.

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawConfig {
    pub(super) delivery: RawDelivery,
    pub(super) publish: RawPublish,
    pub(super) server: RawServer,
    pub(super) storage: RawStorage,
    pub(super) cluster: RawCluster,
    pub(super) auth: RawAuth,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawDelivery {
    pub(super) dispatch_poll_interval: Option<DurationValue>,
    pub(super) in_flight_timeout: Option<DurationValue>,
    pub(super) delete_batch_interval: Option<DurationValue>,
    pub(super) delete_batch_max_keys: Option<u64>,
    pub(super) delete_batches_in_flight: Option<u64>,
    pub(super) delete_backlog_max_keys: Option<u64>,
    pub(super) ttl_sweep_interval: Option<DurationValue>,
    pub(super) consumer_queue_size: Option<u64>,
    pub(super) time_bucket: Option<DurationValue>,
    pub(super) group_retention: Option<DurationValue>,
    pub(super) max_unacked_per_consumer: Option<u64>,
    pub(super) retry_queue_size: Option<u64>,
    pub(super) scan_batch_size: Option<u64>,
    pub(super) max_groups_per_topic: Option<u64>,
    pub(super) max_groups_per_shard: Option<u64>,
    pub(super) max_consumers_per_group: Option<u64>,
    pub(super) max_counted_topics: Option<u64>,
    pub(super) max_group_metrics: Option<u64>,
    pub(super) max_deliveries: Option<u64>,
    pub(super) dead_letter_topic: Option<String>,
    pub(super) redelivery_backoff: Option<String>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawPublish {
    pub(super) max_message_bytes: Option<ByteSizeValue>,
    pub(super) max_batch_messages: Option<u64>,
    pub(super) min_ack_level: Option<String>,
    pub(super) max_bytes_in_flight: Option<ByteSizeValue>,
    pub(super) dedup_window: Option<DurationValue>,
    pub(super) dedup_max_producers: Option<u64>,
    pub(super) dedup_max_entries: Option<u64>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawServer {
    pub(super) data_dir: Option<String>,
    pub(super) cpus: Option<CpuText>,
    pub(super) listen: Option<String>,
    pub(super) metrics_listen: Option<String>,
    pub(super) shard_port_base: Option<u64>,
    pub(super) numa: Option<String>,
    pub(super) max_connections: Option<u64>,
    pub(super) idle_timeout: Option<DurationValue>,
    pub(super) frame_timeout: Option<DurationValue>,
    pub(super) deliver_timeout: Option<DurationValue>,
    pub(super) max_calls_in_flight: Option<u64>,
    pub(super) max_subscriptions_per_connection: Option<u64>,
    pub(super) max_send_buffer_bytes: Option<ByteSizeValue>,
    pub(super) max_node_send_buffer_bytes: Option<ByteSizeValue>,
    pub(super) send_stall_timeout: Option<DurationValue>,
    pub(super) idle_poll: Option<DurationValue>,
    // `[server.tls]` keys: the loader flattens `server.tls.certFile` into `server.tlsCertFile`
    // (so that the environment variable is `PINQ_SERVER_TLS_CERT_FILE`).
    pub(super) tls_cert_file: Option<String>,
    pub(super) tls_key_file: Option<String>,
    pub(super) tls_client_ca_file: Option<String>,
}

/// `[[auth.tokens]]`: the tokens a client may present in `hello`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawAuth {
    pub(super) tokens: Option<Vec<RawToken>>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawToken {
    pub(super) name: String,
    pub(super) sha256: String,
    pub(super) publish: Vec<String>,
    pub(super) consume: Vec<String>,
    pub(super) admin: bool,
}

/// The `[server]` keys that bound one client's connection, taken out of [`RawServer`].
pub(super) struct RawClientLimits {
    pub(super) max_connections: Option<u64>,
    pub(super) idle_timeout: Option<DurationValue>,
    pub(super) frame_timeout: Option<DurationValue>,
    pub(super) deliver_timeout: Option<DurationValue>,
    pub(super) max_calls_in_flight: Option<u64>,
    pub(super) max_subscriptions_per_connection: Option<u64>,
    pub(super) max_send_buffer_bytes: Option<ByteSizeValue>,
    pub(super) max_node_send_buffer_bytes: Option<ByteSizeValue>,
    pub(super) send_stall_timeout: Option<DurationValue>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawStorage {
    pub(super) engine: Option<String>,
    pub(super) memtable_bytes: Option<ByteSizeValue>,
    pub(super) wal_segment_bytes: Option<ByteSizeValue>,
    pub(super) wal_max_bytes: Option<ByteSizeValue>,
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawCluster {
    pub(super) node_id: Option<u64>,
    pub(super) raft_listen: Option<String>,
    pub(super) peers: Option<PeersValue>,
    pub(super) join: Option<String>,
    pub(super) advertise: Option<String>,
    pub(super) tick_interval: Option<DurationValue>,
    pub(super) heartbeat_ticks: Option<u64>,
    pub(super) election_ticks: Option<u64>,
    pub(super) log_retain_entries: Option<u64>,
    pub(super) outbound_queue_messages: Option<u64>,
    pub(super) max_frame_bytes: Option<ByteSizeValue>,
    // `[cluster.tls]` keys, flattened like `[server.tls]` (`PINQ_CLUSTER_TLS_CERT_FILE`).
    pub(super) tls_cert_file: Option<String>,
    pub(super) tls_key_file: Option<String>,
    pub(super) tls_ca_file: Option<String>,
}

/// The section names (`delivery`, …).
pub(super) fn sections() -> &'static [&'static str] {
    field_names::<RawConfig>()
}

/// The keys a section accepts, camelCase as in TOML.
pub(super) fn section_keys(section: &str) -> Option<&'static [&'static str]> {
    match section {
        "delivery" => Some(field_names::<RawDelivery>()),
        "publish" => Some(field_names::<RawPublish>()),
        "server" => Some(field_names::<RawServer>()),
        "storage" => Some(field_names::<RawStorage>()),
        "cluster" => Some(field_names::<RawCluster>()),
        "auth" => Some(field_names::<RawAuth>()),
        _ => None,
    }
}

/// The schema's own spelling of `section.key`, if it is a key.
pub(super) fn known_key(section: &str, key: &str) -> Option<(&'static str, &'static str)> {
    let section = *sections().iter().find(|known| **known == section)?;
    let key = *section_keys(section)?.iter().find(|known| **known == key)?;
    Some((section, key))
}

/// Every key as `(section, key)`, in schema order.
#[cfg(test)]
pub(super) fn all_keys() -> Vec<(&'static str, &'static str)> {
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
pub(super) fn field_names<T: for<'de> Deserialize<'de>>() -> &'static [&'static str] {
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
pub(super) struct DurationValue(pub(super) Duration);

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
pub(super) struct ByteSizeValue(pub(super) u64);

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
pub(super) struct CpuText(pub(super) String);

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

/// `cluster.peers` as written: in TOML an array of `"ID=IP:PORT"` strings; from `--peers` or
/// `PINQ_CLUSTER_PEERS` one string of them separated by commas. Each member is kept as text here
/// and parsed during conversion, so an error can say which member is wrong.
#[derive(Clone, Debug)]
pub(super) struct PeersValue(pub(super) Vec<String>);

impl<'de> Deserialize<'de> for PeersValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<PeersValue, D::Error> {
        struct PeersVisitor;

        impl<'de> Visitor<'de> for PeersVisitor {
            type Value = PeersValue;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "an array of \"ID=IP:PORT\" strings such as [\"1=127.0.0.1:7101\", \"2=127.0.0.1:7102\"], or one string \"1=127.0.0.1:7101,2=127.0.0.1:7102\"",
                )
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<PeersValue, E> {
                Ok(PeersValue(
                    text.split(',')
                        .map(|member| member.trim().to_owned())
                        .filter(|member| !member.is_empty())
                        .collect(),
                ))
            }

            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<PeersValue, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = seq.next_element::<String>()? {
                    members.push(member.trim().to_owned());
                }
                Ok(PeersValue(members))
            }
        }

        deserializer.deserialize_any(PeersVisitor)
    }
}
