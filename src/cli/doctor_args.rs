//! `pinq doctor` flags. The checks themselves live in `crate::ops::doctor`.

use std::path::PathBuf;

use clap::Args;

/// Flags of `pinq doctor`.
#[derive(Clone, Debug, Args)]
pub struct DoctorArgs {
    /// Data directory to check (O_DIRECT, file system); its nearest existing parent if it does
    /// not exist yet.
    #[arg(long, value_name = "DIR", default_value = "./data")]
    pub data_dir: PathBuf,

    /// CPUs the shards would run on, as `pinq serve --cpus` takes them.
    #[arg(long, value_name = "LIST", default_value = "all")]
    pub cpus: String,

    /// The server certificate (server.tls.certFile) whose expiry to check: a warning within 14
    /// days, an error once expired.
    #[arg(long, value_name = "FILE", env = "PINQ_SERVER_TLS_CERT_FILE")]
    pub tls_cert: Option<PathBuf>,
}
