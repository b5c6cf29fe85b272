//! Tests of the configuration loader: defaults, every source, precedence, and every refusal.

use super::render::{format_ms, format_us};
use super::*;
use crate::config::ClusterConfig;

const EXAMPLE: &str = include_str!("../../../pinq.example.toml");

/// A valid three-node `[cluster]` section for node 1; tests append keys to it.
const CLUSTER: &str = "[cluster]\nnodeId = 1\nraftListen = \"127.0.0.1:7101\"\n\
    peers = [\"1=127.0.0.1:7101\", \"2=127.0.0.1:7102\", \"3=127.0.0.1:7103\"]\n";

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
        // `[server.tls]` keys are flattened by the loader; `[[auth.tokens]]` is a list of tables.
        let (header, key) = match (section, key) {
            ("server", "tlsCertFile") => ("server.tls", "certFile"),
            ("server", "tlsKeyFile") => ("server.tls", "keyFile"),
            ("server", "tlsClientCaFile") => ("server.tls", "clientCaFile"),
            ("cluster", "tlsCertFile") => ("cluster.tls", "certFile"),
            ("cluster", "tlsKeyFile") => ("cluster.tls", "keyFile"),
            ("cluster", "tlsCaFile") => ("cluster.tls", "caFile"),
            ("auth", "tokens") => ("auth.tokens", "sha256"),
            other => other,
        };
        let section_start = EXAMPLE
            .find(&format!("[{header}]"))
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
    assert_eq!(
        sections(),
        &["delivery", "publish", "server", "storage", "cluster", "auth"]
    );
    for section in sections() {
        assert!(section_keys(section).is_some(), "{section}");
    }
    let delivery = section_keys("delivery").unwrap();
    assert_eq!(delivery.len(), 21);
    assert!(delivery.contains(&"maxGroupsPerTopic"));
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
            "numa",
            "maxConnections",
            "idleTimeout",
            "frameTimeout",
            "deliverTimeout",
            "maxCallsInFlight",
            "maxSubscriptionsPerConnection",
            "maxSendBufferBytes",
            "maxNodeSendBufferBytes",
            "sendStallTimeout",
            "idlePoll",
            "tlsCertFile",
            "tlsKeyFile",
            "tlsClientCaFile"
        ]
    );
    assert_eq!(
        section_keys("cluster").unwrap(),
        &[
            "nodeId",
            "raftListen",
            "peers",
            "join",
            "advertise",
            "tickInterval",
            "heartbeatTicks",
            "electionTicks",
            "logRetainEntries",
            "outboundQueueMessages",
            "maxFrameBytes",
            "tlsCertFile",
            "tlsKeyFile",
            "tlsCaFile"
        ]
    );
    assert_eq!(all_keys().len(), 21 + 7 + 19 + 4 + 14 + 1);
}

#[test]
fn a_publish_budget_smaller_than_one_message_is_refused_naming_the_key() {
    let err =
        error_from_toml("[publish]\nmaxBytesInFlight = \"512KiB\"\nmaxMessageBytes = \"1MiB\"\n");
    assert_names_key(&err, "publish.maxBytesInFlight");
    assert!(
        err.to_string()
            .contains("must be at least publish.maxMessageBytes"),
        "{err}"
    );
    let err = error_from_toml("[server]\nmaxConnections = 2000000\n");
    assert_names_key(&err, "server.maxConnections");
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
        ("delivery", "maxGroupsPerTopic", "0"),
        ("delivery", "maxGroupsPerShard", "0"),
        ("delivery", "maxConsumersPerGroup", "0"),
        ("delivery", "maxCountedTopics", "0"),
        ("delivery", "maxGroupMetrics", "0"),
        ("publish", "maxMessageBytes", "0"),
        ("publish", "maxBatchMessages", "0"),
        ("publish", "maxBytesInFlight", "0"),
        ("publish", "dedupWindow", "\"0s\""),
        ("publish", "dedupMaxProducers", "0"),
        ("publish", "dedupMaxEntries", "0"),
        ("server", "maxConnections", "0"),
        ("server", "idleTimeout", "\"0s\""),
        ("server", "frameTimeout", "\"0ms\""),
        ("server", "deliverTimeout", "\"0ms\""),
        ("server", "maxCallsInFlight", "0"),
        ("server", "maxSubscriptionsPerConnection", "0"),
        ("server", "maxSendBufferBytes", "0"),
        ("server", "maxNodeSendBufferBytes", "0"),
        ("server", "sendStallTimeout", "\"0s\""),
        ("storage", "memtableBytes", "\"0MiB\""),
        ("storage", "walSegmentBytes", "0"),
        ("storage", "walMaxBytes", "0"),
        ("cluster", "tickInterval", "\"0ms\""),
        ("cluster", "heartbeatTicks", "0"),
        ("cluster", "electionTicks", "0"),
        ("cluster", "logRetainEntries", "0"),
        ("cluster", "outboundQueueMessages", "0"),
        ("cluster", "maxFrameBytes", "0"),
    ];
    for (section, key, zero) in zeros {
        let header = if section == "cluster" {
            CLUSTER.to_owned()
        } else {
            format!("[{section}]\n")
        };
        let err = error_from_toml(&format!("{header}{key} = {zero}\n"));
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
            // 0 = unlimited; a topic name; "none".
            "delivery.maxDeliveries",
            "delivery.deadLetterTopic",
            "delivery.redeliveryBackoff",
            "publish.minAckLevel",
            "server.dataDir",
            "server.cpus",
            "server.listen",
            "server.metricsListen",
            "server.shardPortBase",
            "server.numa",
            // 0 = no idle poll (sleep at once), the default.
            "server.idlePoll",
            "storage.engine",
            "cluster.raftListen",
            "cluster.peers",
            "cluster.join",
            "cluster.advertise",
            "server.tlsCertFile",
            "server.tlsKeyFile",
            "server.tlsClientCaFile",
            "cluster.tlsCertFile",
            "cluster.tlsKeyFile",
            "cluster.tlsCaFile",
            "auth.tokens",
        ];
        // cluster.nodeId = 0 has its own message (Raft's "no node"): tested below.
        assert!(
            zero_keys.contains(&dotted)
                || exempt.contains(&dotted.as_str())
                || dotted == "cluster.nodeId",
            "{dotted} is neither checked at zero nor exempt"
        );
    }
}

#[test]
fn unknown_key_is_rejected_naming_the_full_dotted_key_and_the_file() {
    let err = error_from_toml("[delivery]\ninFlightTimeout = \"5s\"\nfoo = 1\n");
    assert_names_key(&err, "delivery.foo");
    assert_eq!(err.to_string(), "unknown key \"delivery.foo\" in test.toml");

    let err = error_from_toml("[server]\nlisten = \"127.0.0.1:1\"\n[server.tls]\ncert = \"x\"\n");
    assert_names_key(&err, "server.tls.cert");

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
            "[delivery]\nmaxGroupsPerTopic = 2000000\n",
            "delivery.maxGroupsPerTopic",
        ),
        (
            "[delivery]\nmaxGroupsPerShard = 20000000\n",
            "delivery.maxGroupsPerShard",
        ),
        (
            "[delivery]\nmaxConsumersPerGroup = 2000000\n",
            "delivery.maxConsumersPerGroup",
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
    let config = from_toml("[delivery]\ntimeBucket = \"10s\"\ninFlightTimeout = \"1s\"\n").unwrap();
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
        ("PINQ_DELIVERY_MAX_GROUPS_PER_TOPIC", "3"),
        ("PINQ_DELIVERY_MAX_GROUPS_PER_SHARD", "7"),
        ("PINQ_DELIVERY_MAX_CONSUMERS_PER_GROUP", "5"),
        ("PINQ_DELIVERY_MAX_COUNTED_TOPICS", "4096"),
        ("PINQ_DELIVERY_MAX_GROUP_METRICS", "256"),
        ("PINQ_DELIVERY_MAX_DELIVERIES", "4"),
        ("PINQ_DELIVERY_DEAD_LETTER_TOPIC", "dead.{topic}"),
        ("PINQ_DELIVERY_REDELIVERY_BACKOFF", "100ms:10s"),
        ("PINQ_PUBLISH_MAX_MESSAGE_BYTES", "64KiB"),
        ("PINQ_PUBLISH_MAX_BATCH_MESSAGES", "500"),
        ("PINQ_PUBLISH_MIN_ACK_LEVEL", "durable"),
        ("PINQ_PUBLISH_MAX_BYTES_IN_FLIGHT", "8MiB"),
        ("PINQ_PUBLISH_DEDUP_WINDOW", "30s"),
        ("PINQ_PUBLISH_DEDUP_MAX_PRODUCERS", "9"),
        ("PINQ_PUBLISH_DEDUP_MAX_ENTRIES", "99"),
        ("PINQ_SERVER_DATA_DIR", "/var/lib/pinq"),
        ("PINQ_SERVER_CPUS", "1"),
        ("PINQ_SERVER_LISTEN", "0.0.0.0:7500"),
        ("PINQ_SERVER_METRICS_LISTEN", "127.0.0.1:9500"),
        ("PINQ_SERVER_SHARD_PORT_BASE", "8000"),
        ("PINQ_SERVER_NUMA", "auto"),
        ("PINQ_SERVER_MAX_CONNECTIONS", "100"),
        ("PINQ_SERVER_IDLE_TIMEOUT", "30s"),
        ("PINQ_SERVER_FRAME_TIMEOUT", "2s"),
        ("PINQ_SERVER_DELIVER_TIMEOUT", "7s"),
        ("PINQ_SERVER_MAX_CALLS_IN_FLIGHT", "64"),
        ("PINQ_SERVER_MAX_SUBSCRIPTIONS_PER_CONNECTION", "8"),
        ("PINQ_SERVER_MAX_SEND_BUFFER_BYTES", "4MiB"),
        ("PINQ_SERVER_MAX_NODE_SEND_BUFFER_BYTES", "64MiB"),
        ("PINQ_SERVER_SEND_STALL_TIMEOUT", "10s"),
        ("PINQ_SERVER_IDLE_POLL", "50us"),
        ("PINQ_STORAGE_ENGINE", "memory"),
        ("PINQ_STORAGE_MEMTABLE_BYTES", "1048576"),
        ("PINQ_STORAGE_WAL_SEGMENT_BYTES", "8MiB"),
        ("PINQ_STORAGE_WAL_MAX_BYTES", "32MiB"),
        ("PINQ_CLUSTER_NODE_ID", "2"),
        ("PINQ_CLUSTER_RAFT_LISTEN", "0.0.0.0:7102"),
        ("PINQ_CLUSTER_PEERS", "1=10.0.0.1:7101, 2=10.0.0.2:7102"),
        ("PINQ_CLUSTER_ADVERTISE", "10.0.0.2:7500"),
        ("PINQ_CLUSTER_TICK_INTERVAL", "20ms"),
        ("PINQ_CLUSTER_HEARTBEAT_TICKS", "3"),
        ("PINQ_CLUSTER_ELECTION_TICKS", "30"),
        ("PINQ_CLUSTER_LOG_RETAIN_ENTRIES", "5000"),
        ("PINQ_CLUSTER_OUTBOUND_QUEUE_MESSAGES", "128"),
        ("PINQ_CLUSTER_MAX_FRAME_BYTES", "8MiB"),
        ("PINQ_SERVER_TLS_CERT_FILE", "/etc/pinq/server.pem"),
        ("PINQ_SERVER_TLS_KEY_FILE", "/etc/pinq/server.key"),
        ("PINQ_SERVER_TLS_CLIENT_CA_FILE", "/etc/pinq/ca.pem"),
        ("PINQ_CLUSTER_TLS_CERT_FILE", "/etc/pinq/node2.pem"),
        ("PINQ_CLUSTER_TLS_KEY_FILE", "/etc/pinq/node2.key"),
        ("PINQ_CLUSTER_TLS_CA_FILE", "/etc/pinq/cluster-ca.pem"),
    ];
    // `[[auth.tokens]]` is a list of tables: only a config file sets it. `cluster.join`
    // excludes `cluster.peers`: `a_joining_node_takes_join_instead_of_peers` sets it.
    let keys: Vec<_> = all_keys()
        .into_iter()
        .filter(|&key| key != ("auth", "tokens") && key != ("cluster", "join"))
        .collect();
    assert_eq!(values.len(), keys.len());
    for (section, key) in keys {
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
            groups_per_topic_max: 3,
            groups_per_shard_max: 7,
            consumers_per_group_max: 5,
            counted_topics_max: 4096,
            group_metrics_max: 256,
            max_deliveries: 4,
            dead_letter_topic: "dead.{topic}".into(),
            redelivery_backoff: crate::pipeline::policy::Backoff::new(100, 10_000).ok(),
        },
        publish: PublishConfig {
            message_bytes_max: 64 << 10,
            batch_len_max: 500,
            ack_level_min: AckLevel::Durable,
            bytes_in_flight_max: 8 << 20,
            dedup_window_ms: 30_000,
            dedup_producers_max: 9,
            dedup_entries_max: 99,
        },
        server: ServerConfig {
            data_dir: PathBuf::from("/var/lib/pinq"),
            cpus: CpuList::parse("1").unwrap(),
            listen: "0.0.0.0:7500".parse().unwrap(),
            metrics_listen: "127.0.0.1:9500".parse().unwrap(),
            shard_port_base: Some(8000),
            numa: NumaMode::Auto,
            client: ClientLimits {
                connections_max: 100,
                idle_timeout_ms: 30_000,
                frame_timeout_ms: 2_000,
                deliver_timeout_ms: 7_000,
                calls_in_flight_max: 64,
                subscriptions_max: 8,
                send_buffer_bytes_max: 4 << 20,
                node_send_buffer_bytes_max: 64 << 20,
                send_stall_timeout_ms: 10_000,
            },
            idle_poll_us: 50,
        },
        storage: StorageConfig {
            engine: StorageEngine::Memory,
            memtable_bytes_max: 1 << 20,
            wal_segment_bytes_max: 8 << 20,
            wal_bytes_max: 32 << 20,
            recover_truncated_wal: false,
        },
        cluster: Some(ClusterConfig {
            node_id: 2,
            join: None,
            raft_listen: "0.0.0.0:7102".parse().unwrap(),
            peers: [
                (1, "10.0.0.1:7101".parse().unwrap()),
                (2, "10.0.0.2:7102".parse().unwrap()),
            ]
            .into_iter()
            .collect(),
            advertise: "10.0.0.2:7500".parse().unwrap(),
            tick_interval: Duration::from_millis(20),
            heartbeat_ticks: 3,
            election_ticks: 30,
            log_retain_entries: 5000,
            outbound_queue_messages: 128,
            max_frame_bytes: 8 << 20,
            tls: Some(crate::security::node::NodeTlsFiles {
                cert_file: PathBuf::from("/etc/pinq/node2.pem"),
                key_file: PathBuf::from("/etc/pinq/node2.key"),
                ca_file: PathBuf::from("/etc/pinq/cluster-ca.pem"),
            }),
        }),
        security: SecurityConfig {
            tls: Some(crate::security::tls::TlsFiles {
                cert_file: PathBuf::from("/etc/pinq/server.pem"),
                key_file: PathBuf::from("/etc/pinq/server.key"),
                client_ca_file: Some(PathBuf::from("/etc/pinq/ca.pem")),
            }),
            tokens: Vec::new(),
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
         [server]\ndataDir = \"/tmp/pinq \\\"x\\\"\"\ncpus = \"1-2\"\nshardPortBase = 9000\nnuma = \"auto\"\nidlePoll = \"150us\"\n\
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
fn idle_poll_is_off_by_default_and_takes_microseconds_up_to_its_bound() {
    assert_eq!(from_toml("").unwrap().server.idle_poll_us, 0);
    let parsed = |value: &str| {
        from_toml(&format!("[server]\nidlePoll = {value}\n"))
            .unwrap()
            .server
            .idle_poll_us
    };
    assert_eq!(parsed("\"200us\""), 200);
    assert_eq!(parsed("\"2ms\""), 2_000);
    assert_eq!(parsed("0"), 0);
    assert_eq!(parsed("\"10ms\""), 10_000);
    for bad in ["\"11ms\"", "\"1500ns\"", "\"fast\"", "200"] {
        let err = error_from_toml(&format!("[server]\nidlePoll = {bad}\n"));
        assert_names_key(&err, "server.idlePoll");
    }
    let mut loader = test_loader();
    loader
        .add_env([("PINQ_SERVER_IDLE_POLL", "100us")])
        .unwrap();
    assert_eq!(loader.build().unwrap().server.idle_poll_us, 100);
    assert_eq!(format_us(0), "0us");
    assert_eq!(format_us(200), "200us");
    assert_eq!(format_us(3_000), "3ms");
}

#[test]
fn durations_render_in_their_largest_exact_unit() {
    assert_eq!(format_ms(50), "50ms");
    assert_eq!(format_ms(5_000), "5s");
    assert_eq!(format_ms(60_000), "60s");
    assert_eq!(format_ms(86_400_000), "24h");
    assert_eq!(format_ms(1_500), "1500ms");
}

// ---------------------------------------------------------------------------------------------
// [cluster]

fn cluster_from_toml(text: &str) -> Result<ClusterConfig, ConfigError> {
    match from_toml(text)?.cluster {
        Some(cluster) => Ok(cluster),
        None => panic!("no cluster from:\n{text}"),
    }
}

#[test]
fn no_cluster_keys_leave_the_node_standalone() {
    assert_eq!(from_toml("").unwrap().cluster, None);
    assert_eq!(from_toml("[cluster]\n").unwrap().cluster, None);
    assert_eq!(Config::default().cluster, None);
}

#[test]
fn a_cluster_gets_the_documented_defaults() {
    let cluster = cluster_from_toml(CLUSTER).unwrap();
    assert_eq!(cluster.node_id, 1);
    assert_eq!(cluster.raft_listen.to_string(), "127.0.0.1:7101");
    let peers: Vec<String> = cluster
        .peers
        .iter()
        .map(|(id, addr)| format!("{id}={addr}"))
        .collect();
    assert_eq!(
        peers,
        ["1=127.0.0.1:7101", "2=127.0.0.1:7102", "3=127.0.0.1:7103"]
    );
    // Defaults to server.listen.
    assert_eq!(cluster.advertise.to_string(), "127.0.0.1:7400");
    assert_eq!(cluster.tick_interval, Duration::from_millis(50));
    assert_eq!(cluster.heartbeat_ticks, 2);
    assert_eq!(cluster.election_ticks, 10);
    // A new leader within about a second: raft campaigns after 10..20 ticks of 50 ms.
    assert_eq!(cluster.election_timeout(), Duration::from_millis(500));
    assert_eq!(cluster.log_retain_entries, 100_000);
    assert_eq!(cluster.outbound_queue_messages, 4096);
    assert_eq!(cluster.max_frame_bytes, 64 << 20);
    assert_eq!(cluster.entry_bytes_max(), (64 << 20) - (64 << 10));
}

#[test]
fn the_example_file_shows_every_cluster_key_with_its_default() {
    // The [cluster] keys are commented out in the example (setting nodeId would make a node a
    // cluster member); uncommented, they must give exactly the defaults of a cluster.
    let start = EXAMPLE.find("[cluster]").unwrap();
    let section: String = EXAMPLE[start..]
        .lines()
        .map(|line| {
            // `join` is the alternative to `peers` (the two exclude each other): left out.
            line.strip_prefix("# ")
                .filter(|rest| {
                    (rest.contains(" = ") && !rest.starts_with("join = "))
                        || *rest == "[cluster.tls]"
                })
                .unwrap_or(line)
        })
        .filter(|line| !line.starts_with('#'))
        .map(|line| format!("{line}\n"))
        .collect();
    let cluster = cluster_from_toml(&section).unwrap();
    let defaults = cluster_from_toml(CLUSTER).unwrap();
    assert_eq!(cluster.tick_interval, defaults.tick_interval);
    assert_eq!(cluster.heartbeat_ticks, defaults.heartbeat_ticks);
    assert_eq!(cluster.election_ticks, defaults.election_ticks);
    assert_eq!(cluster.log_retain_entries, defaults.log_retain_entries);
    assert_eq!(
        cluster.outbound_queue_messages,
        defaults.outbound_queue_messages
    );
    assert_eq!(cluster.max_frame_bytes, defaults.max_frame_bytes);
    assert_eq!(cluster.peers, defaults.peers);
    let tls = cluster.tls.expect("the example shows [cluster.tls]");
    assert_eq!(tls.ca_file, PathBuf::from("/etc/pinq/cluster-ca.pem"));
}

#[test]
fn a_cluster_key_without_node_id_is_refused_naming_node_id() {
    for text in [
        "[cluster]\nraftListen = \"127.0.0.1:7101\"\n",
        "[cluster]\npeers = [\"1=127.0.0.1:7101\"]\n",
        "[cluster]\nelectionTicks = 20\n",
    ] {
        let err = error_from_toml(text);
        assert_names_key(&err, "cluster.nodeId");
        assert!(
            err.to_string().contains("must be set when cluster."),
            "{err}"
        );
    }
}

#[test]
fn node_id_without_raft_listen_or_peers_names_the_missing_key() {
    let err = error_from_toml("[cluster]\nnodeId = 1\npeers = [\"1=127.0.0.1:7101\"]\n");
    assert_names_key(&err, "cluster.raftListen");
    let err = error_from_toml("[cluster]\nnodeId = 1\nraftListen = \"127.0.0.1:7101\"\n");
    assert_names_key(&err, "cluster.peers");
    assert!(
        err.to_string()
            .contains("must be set when cluster.nodeId is (in test.toml)"),
        "{err}"
    );
}

#[test]
fn node_id_zero_or_negative_is_refused() {
    let err = error_from_toml(&CLUSTER.replace("nodeId = 1", "nodeId = 0"));
    assert_names_key(&err, "cluster.nodeId");
    assert!(err.to_string().contains("greater than zero"), "{err}");
    let err = error_from_toml(&CLUSTER.replace("nodeId = 1", "nodeId = -1"));
    assert_names_key(&err, "cluster.nodeId");
    let err = error_from_toml(&CLUSTER.replace("nodeId = 1", "nodeId = \"one\""));
    assert_names_key(&err, "cluster.nodeId");
}

#[test]
fn peers_must_list_this_node_at_raft_listen() {
    let err = error_from_toml(&CLUSTER.replace("nodeId = 1", "nodeId = 4"));
    assert_names_key(&err, "cluster.peers");
    assert!(
        err.to_string()
            .contains("does not list this node (cluster.nodeId = 4), only 1, 2, 3"),
        "{err}"
    );

    let err = error_from_toml(&CLUSTER.replace(
        "raftListen = \"127.0.0.1:7101\"",
        "raftListen = \"127.0.0.1:7999\"",
    ));
    assert_names_key(&err, "cluster.raftListen");
    assert!(err.to_string().contains("1=127.0.0.1:7101"), "{err}");

    // A wildcard on the member's port is fine.
    let cluster = cluster_from_toml(&CLUSTER.replace(
        "raftListen = \"127.0.0.1:7101\"",
        "raftListen = \"0.0.0.0:7101\"",
    ))
    .unwrap();
    assert_eq!(cluster.raft_listen.to_string(), "0.0.0.0:7101");
}

#[test]
fn duplicate_ids_or_addresses_in_peers_are_refused() {
    let err = error_from_toml(&CLUSTER.replace("3=127.0.0.1:7103", "2=127.0.0.1:7103"));
    assert_names_key(&err, "cluster.peers");
    assert!(
        err.to_string().contains("node id 2 is listed twice"),
        "{err}"
    );
    let err = error_from_toml(&CLUSTER.replace("3=127.0.0.1:7103", "3=127.0.0.1:7102"));
    assert_names_key(&err, "cluster.peers");
    assert!(
        err.to_string()
            .contains("nodes 2 and 3 have the same address 127.0.0.1:7102"),
        "{err}"
    );
}

#[test]
fn malformed_or_undialable_peers_are_refused_naming_the_member() {
    for (member, says) in [
        ("3:127.0.0.1:7103", "\"3:127.0.0.1:7103\" is not ID=IP:PORT"),
        ("3=localhost:7103", "\"3=localhost:7103\" is not ID=IP:PORT"),
        ("x=127.0.0.1:7103", "is not ID=IP:PORT"),
        ("0=127.0.0.1:7103", "node ids must be greater than zero"),
        ("3=0.0.0.0:7103", "not an address a peer can connect to"),
        ("3=127.0.0.1:0", "not an address a peer can connect to"),
    ] {
        let err = error_from_toml(&CLUSTER.replace("3=127.0.0.1:7103", member));
        assert_names_key(&err, "cluster.peers");
        assert!(err.to_string().contains(says), "{member}: {err}");
    }
    let err =
        error_from_toml("[cluster]\nnodeId = 1\nraftListen = \"127.0.0.1:7101\"\npeers = []\n");
    assert_names_key(&err, "cluster.peers");
    assert!(err.to_string().contains("at least one member"), "{err}");
    let err =
        error_from_toml("[cluster]\nnodeId = 1\nraftListen = \"127.0.0.1:7101\"\npeers = [1]\n");
    assert_names_key(&err, "cluster.peers");
}

#[test]
fn peers_may_be_one_comma_separated_string() {
    let mut loader = test_loader();
    loader
        .add_env([
            ("PINQ_CLUSTER_NODE_ID", "1"),
            ("PINQ_CLUSTER_RAFT_LISTEN", "127.0.0.1:7101"),
            (
                "PINQ_CLUSTER_PEERS",
                "1=127.0.0.1:7101,2=127.0.0.1:7102,3=[::1]:7103",
            ),
        ])
        .unwrap();
    let cluster = loader.build().unwrap().cluster.unwrap();
    assert_eq!(cluster.peers.len(), 3);
    assert_eq!(cluster.peers[&3].to_string(), "[::1]:7103");
    // A single member is a cluster of one.
    let one = cluster_from_toml(
        "[cluster]\nnodeId = 5\nraftListen = \"127.0.0.1:7105\"\npeers = \"5=127.0.0.1:7105\"\n",
    )
    .unwrap();
    assert_eq!(one.peers.keys().copied().collect::<Vec<_>>(), [5]);
}

#[test]
fn a_wildcard_client_address_needs_advertise() {
    let text = format!("[server]\nlisten = \"0.0.0.0:7400\"\n{CLUSTER}");
    let err = error_from_toml(&text);
    assert_names_key(&err, "cluster.advertise");
    assert!(err.to_string().contains("0.0.0.0:7400"), "{err}");
    let cluster = cluster_from_toml(&format!("{text}advertise = \"10.1.2.3:7400\"\n")).unwrap();
    assert_eq!(cluster.advertise.to_string(), "10.1.2.3:7400");
    let err = error_from_toml(&format!("{text}advertise = \"0.0.0.0:7400\"\n"));
    assert_names_key(&err, "cluster.advertise");
    let err = error_from_toml(&format!("[server]\nlisten = \"127.0.0.1:0\"\n{CLUSTER}"));
    assert_names_key(&err, "cluster.advertise");
}

#[test]
fn election_ticks_must_exceed_heartbeat_ticks() {
    let err = error_from_toml(&format!("{CLUSTER}heartbeatTicks = 3\nelectionTicks = 3\n"));
    assert_names_key(&err, "cluster.electionTicks");
    assert!(
        err.to_string()
            .contains("must be greater than cluster.heartbeatTicks (3)"),
        "{err}"
    );
    let err = error_from_toml(&format!("{CLUSTER}heartbeatTicks = 10\n"));
    assert_names_key(&err, "cluster.heartbeatTicks");
    let cluster = cluster_from_toml(&format!(
        "{CLUSTER}heartbeatTicks = 1\nelectionTicks = 2\ntickInterval = \"100ms\"\n"
    ))
    .unwrap();
    assert_eq!(cluster.election_timeout(), Duration::from_millis(200));
}

#[test]
fn out_of_range_cluster_values_are_rejected_naming_the_key() {
    for (line, key) in [
        ("tickInterval = \"1min\"", "cluster.tickInterval"),
        ("tickInterval = \"1500us\"", "cluster.tickInterval"),
        ("heartbeatTicks = 5000", "cluster.heartbeatTicks"),
        ("electionTicks = 20000", "cluster.electionTicks"),
        ("logRetainEntries = 1000000000", "cluster.logRetainEntries"),
        (
            "outboundQueueMessages = 2000000",
            "cluster.outboundQueueMessages",
        ),
        ("maxFrameBytes = \"2GiB\"", "cluster.maxFrameBytes"),
        ("maxFrameBytes = \"64KiB\"", "cluster.maxFrameBytes"),
        ("advertise = \"nowhere\"", "cluster.advertise"),
        ("bogus = 1", "cluster.bogus"),
    ] {
        let err = error_from_toml(&format!("{CLUSTER}{line}\n"));
        assert_names_key(&err, key);
    }
    let err = error_from_toml(
        &CLUSTER.replace("raftListen = \"127.0.0.1:7101\"", "raftListen = \"7101\""),
    );
    assert_names_key(&err, "cluster.raftListen");
}

#[test]
fn a_frame_must_hold_the_largest_message() {
    let err = error_from_toml(&format!(
        "[publish]\nmaxMessageBytes = \"2MiB\"\n{CLUSTER}maxFrameBytes = \"2MiB\"\n"
    ));
    assert_names_key(&err, "cluster.maxFrameBytes");
    assert!(
        err.to_string()
            .contains("publish.maxMessageBytes (2097152 bytes) + 65536 bytes"),
        "{err}"
    );
    let err = error_from_toml(&format!(
        "[publish]\nmaxMessageBytes = \"64MiB\"\n[storage]\nengine = \"memory\"\n{CLUSTER}"
    ));
    assert_names_key(&err, "publish.maxMessageBytes");
    cluster_from_toml(&format!(
        "[publish]\nmaxMessageBytes = \"1MiB\"\n{CLUSTER}maxFrameBytes = \"2MiB\"\n"
    ))
    .unwrap();
}

#[test]
fn raft_listen_must_not_share_a_port_with_the_other_listeners() {
    let three = |port: u16| {
        format!(
            "[cluster]\nnodeId = 1\nraftListen = \"127.0.0.1:{port}\"\npeers = [\"1=127.0.0.1:{port}\", \"2=127.0.0.1:7102\"]\n"
        )
    };
    for port in [7400, 9400, 7401] {
        let err = error_from_toml(&format!("[server]\ncpus = \"0-1\"\n{}", three(port)));
        assert_names_key(&err, "cluster.raftListen");
    }
}

#[test]
fn a_cluster_config_renders_back_to_itself() {
    let text = format!(
        "[server]\nlisten = \"0.0.0.0:7400\"\n{CLUSTER}advertise = \"10.0.0.1:7400\"\ntickInterval = \"20ms\"\nmaxFrameBytes = \"16MiB\"\n"
    );
    let config = from_toml(&text).unwrap();
    let rendered = config.to_toml();
    assert!(rendered.contains("[cluster]"), "{rendered}");
    let again = from_toml(&rendered).unwrap_or_else(|err| panic!("{err}\nin:\n{rendered}"));
    assert_eq!(again, config, "{rendered}");
    assert!(!from_toml("").unwrap().to_toml().contains("[cluster]"));
}

const TOKEN_HASH: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

#[test]
fn tls_and_tokens_load_and_render_back_to_themselves() {
    let text = format!(
        "[server.tls]\ncertFile = \"/etc/pinq/server.pem\"\nkeyFile = \"/etc/pinq/server.key\"\n\
         clientCaFile = \"/etc/pinq/ca.pem\"\n\n[[auth.tokens]]\nname = \"billing\"\n\
         sha256 = \"{TOKEN_HASH}\"\npublish = [\"orders\", \"billing.\"]\nconsume = [\"orders\"]\n\n\
         [[auth.tokens]]\nname = \"ops\"\nsha256 = \"{}\"\nadmin = true\n",
        TOKEN_HASH.to_uppercase()
    );
    let config = from_toml(&text).unwrap();
    let tls = config.security.tls.clone().expect("tls");
    assert_eq!(tls.cert_file, PathBuf::from("/etc/pinq/server.pem"));
    assert_eq!(tls.client_ca_file, Some(PathBuf::from("/etc/pinq/ca.pem")));
    let tokens = &config.security.tokens;
    assert_eq!(tokens.len(), 2);
    assert_eq!(tokens[0].publish, ["orders", "billing."]);
    assert!(!tokens[0].admin && tokens[1].admin);
    assert_eq!(tokens[0].sha256, tokens[1].sha256);
    let rendered = config.to_toml();
    let again = from_toml(&rendered).unwrap_or_else(|err| panic!("{err}\nin:\n{rendered}"));
    assert_eq!(again, config, "{rendered}");
    assert!(from_toml("").unwrap().security == SecurityConfig::default());
}

#[test]
fn tls_files_come_from_the_environment_too() {
    let mut loader = test_loader();
    loader
        .add_env([
            ("PINQ_SERVER_TLS_CERT_FILE", "/c.pem"),
            ("PINQ_SERVER_TLS_KEY_FILE", "/k.pem"),
        ])
        .unwrap();
    let tls = loader.build().unwrap().security.tls.expect("tls");
    assert_eq!(tls.key_file, PathBuf::from("/k.pem"));
    assert_eq!(tls.client_ca_file, None);
}

#[test]
fn bad_tls_and_token_settings_are_refused_by_key() {
    let err = error_from_toml("[server.tls]\ncertfile = \"x\"\n");
    assert_names_key(&err, "server.tls.certfile");
    let err = error_from_toml("[server.tls]\ncertFile = \"x\"\n");
    assert!(err.to_string().contains("keyFile"), "{err}");
    let err = error_from_toml("[server.tls]\nclientCaFile = \"x\"\n");
    assert!(err.to_string().contains("certFile"), "{err}");
    let err = error_from_toml("[[auth.tokens]]\nname = \"a\"\nsha256 = \"abc\"\n");
    assert_names_key(&err, "auth.tokens");
    assert!(err.to_string().contains("64 hex digits"), "{err}");
    let twice = format!(
        "[[auth.tokens]]\nname = \"a\"\nsha256 = \"{TOKEN_HASH}\"\n[[auth.tokens]]\nname = \"a\"\nsha256 = \"{TOKEN_HASH}\"\n"
    );
    assert!(error_from_toml(&twice).to_string().contains("unique"));
    let err = error_from_toml("[[auth.tokens]]\nname = \"a\"\nsha256 = \"x\"\nsecret = \"s\"\n");
    assert_names_key(&err, "auth.tokens");
}

const CLUSTER_TLS: &str = "\n[cluster.tls]\ncertFile = \"/etc/pinq/node1.pem\"\n\
    keyFile = \"/etc/pinq/node1.key\"\ncaFile = \"/etc/pinq/cluster-ca.pem\"\n";

#[test]
fn cluster_tls_loads_flattened_and_renders_back_to_itself() {
    let config = from_toml(&format!("{CLUSTER}{CLUSTER_TLS}")).unwrap();
    let cluster = config.cluster.clone().expect("cluster");
    let tls = cluster.tls.expect("cluster.tls");
    assert_eq!(tls.cert_file, PathBuf::from("/etc/pinq/node1.pem"));
    assert_eq!(tls.key_file, PathBuf::from("/etc/pinq/node1.key"));
    assert_eq!(tls.ca_file, PathBuf::from("/etc/pinq/cluster-ca.pem"));
    let rendered = config.to_toml();
    assert!(rendered.contains("[cluster.tls]"), "{rendered}");
    let again = from_toml(&rendered).unwrap_or_else(|err| panic!("{err}\nin:\n{rendered}"));
    assert_eq!(again, config, "{rendered}");
    assert_eq!(from_toml(CLUSTER).unwrap().cluster.unwrap().tls, None);
}

#[test]
fn cluster_tls_needs_all_three_files_and_names_the_missing_ones() {
    let err = error_from_toml(&format!("{CLUSTER}[cluster.tls]\ncertFile = \"/n.pem\"\n"));
    assert_names_key(&err, "cluster.tlsCertFile");
    let message = err.to_string();
    assert!(
        message.contains("cluster.tls.keyFile and cluster.tls.caFile"),
        "{message}"
    );
    let err = error_from_toml(&format!(
        "{CLUSTER}[cluster.tls]\ncaFile = \"/ca.pem\"\nkeyFile = \"/n.key\"\n"
    ));
    assert_names_key(&err, "cluster.tlsKeyFile");
    assert!(
        err.to_string().contains("needs cluster.tls.certFile too"),
        "{err}"
    );
    let err = error_from_toml(&format!(
        "{CLUSTER}[cluster.tls]\nclientCaFile = \"/ca.pem\"\n"
    ));
    assert_names_key(&err, "cluster.tls.clientCaFile");
    assert!(
        err.to_string().contains("certFile, keyFile, caFile"),
        "{err}"
    );
    // Without a node id, node TLS is refused like every other cluster key.
    let err = error_from_toml(CLUSTER_TLS);
    assert_names_key(&err, "cluster.nodeId");
    assert!(err.to_string().contains("cluster.tlsCertFile"), "{err}");
}

#[test]
fn a_joining_node_takes_join_instead_of_peers() {
    let mut loader = test_loader();
    loader
        .add_env([
            ("PINQ_CLUSTER_NODE_ID", "4"),
            ("PINQ_CLUSTER_RAFT_LISTEN", "127.0.0.1:7104"),
            ("PINQ_CLUSTER_JOIN", "127.0.0.1:7400"),
            ("PINQ_CLUSTER_ADVERTISE", "127.0.0.1:7440"),
        ])
        .unwrap();
    let cluster = loader.build().unwrap().cluster.unwrap();
    assert_eq!(cluster.join.as_deref(), Some("127.0.0.1:7400"));
    // Its peers are itself only: the members come from the node it joins.
    assert_eq!(
        cluster.peers.into_iter().collect::<Vec<_>>(),
        [(4, "127.0.0.1:7104".parse().unwrap())]
    );
    let err = error_from_toml(
        "[cluster]\nnodeId = 4\nraftListen = \"127.0.0.1:7104\"\njoin = \"127.0.0.1:7400\"\npeers = [\"4=127.0.0.1:7104\"]\n",
    );
    assert_names_key(&err, "cluster.join");
    let err = error_from_toml(
        "[cluster]\nnodeId = 4\nraftListen = \"0.0.0.0:7104\"\njoin = \"127.0.0.1:7400\"\n",
    );
    assert_names_key(&err, "cluster.raftListen");
    let err = error_from_toml(
        "[cluster]\nnodeId = 4\nraftListen = \"127.0.0.1:7104\"\njoin = \"nowhere\"\n",
    );
    assert_names_key(&err, "cluster.join");
}
