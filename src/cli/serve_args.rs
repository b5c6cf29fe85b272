//! `pinq serve` flags, and how they become the configuration.
//!
//! Each flag sets one config key and goes through the same validation as the file and the
//! environment, so `--listen nonsense` fails with `server.listen: … (from flag --listen)`. Flags
//! carry no clap defaults on purpose: a default there would always win over the file and the
//! environment. The defaults live in `crate::config` only.

use std::path::{Path, PathBuf};

use clap::Args;

use crate::config::{Config, ConfigError, ConfigLoader, Origin};

/// Flags of `pinq serve`.
#[derive(Clone, Debug, Default, Args)]
pub struct ServeArgs {
    /// TOML config file (every key is shown in pinq.example.toml); keys it leaves out keep their
    /// defaults.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Data directory, server.dataDir [default: ./data].
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,

    /// Client address every shard accepts on, server.listen [default: 127.0.0.1:7400].
    #[arg(long, value_name = "ADDR")]
    pub listen: Option<String>,

    /// Prometheus /metrics and /healthz address, server.metricsListen [default: 127.0.0.1:9400].
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<String>,

    /// Serve TLS with this PEM certificate chain, server.tls.certFile [default: plain TCP].
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<String>,

    /// The private key of --tls-cert (PEM), server.tls.keyFile.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<String>,

    /// Require client certificates signed by this CA (PEM), server.tls.clientCaFile.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_client_ca: Option<String>,

    /// CPUs to run one pinned shard on each, as a list like 0-3,8 or "all", server.cpus
    /// [default: all].
    #[arg(long, value_name = "LIST")]
    pub cpus: Option<String>,

    /// NUMA placement, server.numa [default: off]: "auto" keeps only the CPUs of one node (the
    /// NIC's, else the one with most of --cpus) and logs which.
    #[arg(long, value_name = "MODE", value_parser = ["auto", "off"])]
    pub numa: Option<String>,

    /// Storage engine, storage.engine [default: lsm].
    #[arg(long, value_name = "ENGINE", value_parser = ["lsm", "memory"])]
    pub storage: Option<String>,

    /// This node's Raft id, a positive integer, cluster.nodeId [default: unset, standalone].
    /// Setting it makes the node a cluster member: --raft-listen and --peers are then required.
    #[arg(long, value_name = "N")]
    pub node_id: Option<u64>,

    /// Address this node accepts its peers' Raft connections on, cluster.raftListen.
    #[arg(long, value_name = "ADDR")]
    pub raft_listen: Option<String>,

    /// Every member's Raft address, this node included, cluster.peers:
    /// 1=IP:PORT,2=IP:PORT,3=IP:PORT.
    #[arg(long, value_name = "ID=ADDR,...")]
    pub peers: Option<String>,

    /// Join a running cluster instead of starting a new one, cluster.join: any member's client
    /// address (HOST:PORT). The node serves nothing until `pinq cluster add-node` adds it.
    #[arg(long, value_name = "ADDR", conflicts_with = "peers")]
    pub join: Option<String>,

    /// Client address this node tells its peers and clients, cluster.advertise
    /// [default: --listen].
    #[arg(long, value_name = "ADDR")]
    pub advertise: Option<String>,

    /// Start even if a WAL segment is shorter than it was written (a truncated file): cut the
    /// log there and drop every record after it, logging how many. Without it such a start is
    /// refused. For this start only; there is no config key.
    #[arg(long)]
    pub recover_truncated_wal: bool,
}

impl ServeArgs {
    /// Builds the configuration: defaults < `--config` file < `env` (the `PINQ_` variables) <
    /// these flags.
    pub fn load_config<I, K, V>(&self, env: I) -> Result<Config, ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut loader = ConfigLoader::new();
        self.layer_onto(&mut loader, env)?;
        let mut config = loader.build()?;
        config.storage.recover_truncated_wal = self.recover_truncated_wal;
        Ok(config)
    }

    /// Adds the file, the environment and the flags to `loader`, in that order.
    pub fn layer_onto<I, K, V>(&self, loader: &mut ConfigLoader, env: I) -> Result<(), ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        if let Some(path) = &self.config {
            loader.add_file(path)?;
        }
        loader.add_env(env)?;
        if let Some(dir) = &self.data_dir {
            loader.set(
                "server.dataDir",
                path_value(dir, "server.dataDir", "--data-dir")?,
                Origin::Flag("--data-dir"),
            )?;
        }
        let text_flags = [
            ("server.listen", "--listen", &self.listen),
            (
                "server.metricsListen",
                "--metrics-listen",
                &self.metrics_listen,
            ),
            ("server.cpus", "--cpus", &self.cpus),
            ("storage.engine", "--storage", &self.storage),
            ("server.numa", "--numa", &self.numa),
            ("cluster.raftListen", "--raft-listen", &self.raft_listen),
            ("cluster.peers", "--peers", &self.peers),
            ("cluster.join", "--join", &self.join),
            ("cluster.advertise", "--advertise", &self.advertise),
            ("server.tlsCertFile", "--tls-cert", &self.tls_cert),
            ("server.tlsKeyFile", "--tls-key", &self.tls_key),
            (
                "server.tlsClientCaFile",
                "--tls-client-ca",
                &self.tls_client_ca,
            ),
        ];
        for (key, flag, value) in text_flags {
            if let Some(value) = value {
                loader.set(key, toml::Value::String(value.clone()), Origin::Flag(flag))?;
            }
        }
        if let Some(node_id) = self.node_id {
            let value = i64::try_from(node_id).map_err(|_| ConfigError::Invalid {
                key: "cluster.nodeId".to_owned(),
                reason: format!("must be at most {}, found {node_id}", i64::MAX),
                origin: Origin::Flag("--node-id"),
            })?;
            loader.set(
                "cluster.nodeId",
                toml::Value::Integer(value),
                Origin::Flag("--node-id"),
            )?;
        }
        Ok(())
    }
}

/// A path as a TOML string; the config holds UTF-8 paths only.
fn path_value(path: &Path, key: &str, flag: &'static str) -> Result<toml::Value, ConfigError> {
    match path.to_str() {
        Some(text) => Ok(toml::Value::String(text.to_owned())),
        None => Err(ConfigError::Invalid {
            key: key.to_owned(),
            reason: format!("{} is not valid UTF-8", path.display()),
            origin: Origin::Flag(flag),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Command};
    use crate::config::StorageEngine;
    use clap::Parser;

    fn serve_args(argv: &[&str]) -> ServeArgs {
        let mut full = vec!["pinq", "serve"];
        full.extend_from_slice(argv);
        match Cli::try_parse_from(full) {
            Ok(Cli {
                command: Command::Serve(args),
            }) => args,
            Ok(other) => panic!("parsed as another subcommand: {other:?}"),
            Err(err) => panic!("{err}"),
        }
    }

    fn build(args: &ServeArgs, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let mut loader = ConfigLoader::with_online_cpus(vec![0, 1, 2, 3]);
        args.layer_onto(&mut loader, env.iter().copied())?;
        loader.build()
    }

    #[test]
    fn serve_accepts_every_flag_in_its_documented_form() {
        let args = serve_args(&[
            "--config",
            "/etc/pinq.toml",
            "--data-dir",
            "/var/lib/pinq",
            "--listen",
            "0.0.0.0:7400",
            "--metrics-listen",
            "127.0.0.1:9401",
            "--cpus",
            "0-3,8",
            "--storage",
            "memory",
        ]);
        assert_eq!(args.config, Some(PathBuf::from("/etc/pinq.toml")));
        assert_eq!(args.data_dir, Some(PathBuf::from("/var/lib/pinq")));
        assert_eq!(args.listen.as_deref(), Some("0.0.0.0:7400"));
        assert_eq!(args.metrics_listen.as_deref(), Some("127.0.0.1:9401"));
        assert_eq!(args.cpus.as_deref(), Some("0-3,8"));
        assert_eq!(args.storage.as_deref(), Some("memory"));
    }

    #[test]
    fn serve_without_flags_sets_nothing() {
        let args = serve_args(&[]);
        assert_eq!(format!("{args:?}"), format!("{:?}", ServeArgs::default()));
        let config = build(&args, &[]).unwrap();
        assert_eq!(config.server.listen.to_string(), "127.0.0.1:7400");
    }

    #[test]
    fn an_unknown_storage_engine_is_a_usage_error() {
        let err = Cli::try_parse_from(["pinq", "serve", "--storage", "rocksdb"]).unwrap_err();
        assert_eq!(err.exit_code(), 2);
    }

    #[test]
    fn flags_override_environment() {
        let args = serve_args(&[
            "--listen",
            "127.0.0.1:3000",
            "--storage",
            "memory",
            "--cpus",
            "1-2",
            "--data-dir",
            "/tmp/flag",
        ]);
        let env = [
            ("PINQ_SERVER_LISTEN", "127.0.0.1:2000"),
            ("PINQ_STORAGE_ENGINE", "lsm"),
            ("PINQ_SERVER_CPUS", "0"),
            ("PINQ_SERVER_DATA_DIR", "/tmp/env"),
            ("PINQ_SERVER_METRICS_LISTEN", "127.0.0.1:9999"),
        ];
        let config = build(&args, &env).unwrap();
        assert_eq!(config.server.listen.port(), 3000);
        assert_eq!(config.storage.engine, StorageEngine::Memory);
        assert_eq!(config.server.cpus.cpus(), &[1, 2]);
        assert_eq!(config.server.data_dir, PathBuf::from("/tmp/flag"));
        // Not set by a flag: the environment's value stands.
        assert_eq!(config.server.metrics_listen.port(), 9999);
    }

    #[test]
    fn a_bad_flag_value_names_its_key_and_flag() {
        let args = serve_args(&["--listen", "nowhere"]);
        let err = build(&args, &[]).unwrap_err();
        assert_eq!(err.key(), Some("server.listen"));
        assert!(err.to_string().ends_with("(from flag --listen)"), "{err}");

        let args = serve_args(&["--cpus", "3-1"]);
        let err = build(&args, &[]).unwrap_err();
        assert_eq!(err.key(), Some("server.cpus"));
    }

    #[test]
    fn cluster_flags_set_the_cluster_section() {
        let args = serve_args(&[
            "--node-id",
            "2",
            "--raft-listen",
            "127.0.0.1:7102",
            "--peers",
            "1=127.0.0.1:7101,2=127.0.0.1:7102,3=127.0.0.1:7103",
            "--listen",
            "127.0.0.1:7500",
            "--advertise",
            "10.0.0.2:7500",
        ]);
        let config = build(&args, &[]).unwrap();
        let cluster = config.cluster.unwrap();
        assert_eq!(cluster.node_id, 2);
        assert_eq!(cluster.raft_listen.to_string(), "127.0.0.1:7102");
        assert_eq!(cluster.peers.len(), 3);
        assert_eq!(cluster.peers[&3].to_string(), "127.0.0.1:7103");
        assert_eq!(cluster.advertise.to_string(), "10.0.0.2:7500");
    }

    #[test]
    fn a_node_id_flag_without_peers_names_the_missing_key() {
        let args = serve_args(&["--node-id", "1", "--raft-listen", "127.0.0.1:7101"]);
        let err = build(&args, &[]).unwrap_err();
        assert_eq!(err.key(), Some("cluster.peers"), "{err}");
        assert!(err.to_string().contains("from flag --node-id"), "{err}");
        let args = serve_args(&["--node-id", "0"]);
        let err = build(&args, &[]).unwrap_err();
        assert_eq!(err.key(), Some("cluster.nodeId"), "{err}");
        assert!(err.to_string().ends_with("(from flag --node-id)"), "{err}");
    }

    #[test]
    fn the_config_file_sits_below_environment_and_flags() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pinq.toml");
        std::fs::write(
            &path,
            "[delivery]\ninFlightTimeout = \"9s\"\nconsumerQueueSize = 7\n\
             [server]\nlisten = \"127.0.0.1:1000\"\n",
        )
        .unwrap();
        let args = serve_args(&[
            "--config",
            path.to_str().unwrap(),
            "--listen",
            "127.0.0.1:3000",
        ]);
        let config = build(&args, &[("PINQ_DELIVERY_IN_FLIGHT_TIMEOUT", "2s")]).unwrap();
        assert_eq!(config.delivery.in_flight_timeout_ms, 2_000);
        assert_eq!(config.delivery.consumer_queue_len_max, 7);
        assert_eq!(config.server.listen.port(), 3000);
    }
}
