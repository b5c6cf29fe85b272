//! The flags every client command takes to reach a secured broker: TLS (`--tls-ca`,
//! `--tls-server-name`, `--tls-cert`/`--tls-key`) and the token (`--token-file`, or the
//! environment variable `PINQ_TOKEN`; never a flag, which would show in the process list).
//! One struct, flattened into `pinq publish`, `consume`, `stats`, `topology`,
//! `cluster status` and `bench`.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use crate::client::{ClientOptions, RouterOptions};
use crate::security::client::{ClientSecurity, ClientTls, Token};
use crate::security::tls::ClientTlsFiles;

/// The environment variable a token may come from.
pub const TOKEN_ENV: &str = "PINQ_TOKEN";

#[derive(Clone, Debug, Default, Args)]
pub struct ConnectArgs {
    /// Speak TLS and trust this CA (PEM) for the broker's certificate.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// Speak TLS trusting the system's root certificates (implied by every other --tls-* flag).
    #[arg(long)]
    pub tls: bool,
    /// The name the broker's certificate must carry (default: the host of --server).
    #[arg(long, value_name = "NAME")]
    pub tls_server_name: Option<String>,
    /// A client certificate (PEM) for a broker that requires one (with --tls-key).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// A file whose first line is the token to present (else the variable PINQ_TOKEN).
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
}

impl ConnectArgs {
    fn wants_tls(&self) -> bool {
        self.tls
            || self.tls_ca.is_some()
            || self.tls_server_name.is_some()
            || self.tls_cert.is_some()
    }

    /// Reads the files named (errors name the file) and the token.
    pub fn security(&self) -> anyhow::Result<ClientSecurity> {
        let tls = if self.wants_tls() {
            let files = ClientTlsFiles {
                ca_file: self.tls_ca.clone(),
                cert_file: self.tls_cert.clone(),
                key_file: self.tls_key.clone(),
            };
            Some(ClientTls::from_files(&files, self.tls_server_name.clone())?)
        } else {
            None
        };
        let token = match &self.token_file {
            Some(path) => Some(
                Token::from_file(path)
                    .with_context(|| format!("reading --token-file {}", path.display()))?,
            ),
            None => std::env::var(TOKEN_ENV).ok().and_then(|t| Token::new(&t)),
        };
        Ok(ClientSecurity { tls, token })
    }

    /// Client options with these settings.
    pub fn client_options(&self) -> anyhow::Result<ClientOptions> {
        Ok(ClientOptions {
            security: self.security()?,
            ..ClientOptions::default()
        })
    }

    /// Router options with these settings.
    pub fn router_options(&self) -> anyhow::Result<RouterOptions> {
        let mut options = RouterOptions::default();
        options.client.security = self.security()?;
        Ok(options)
    }
}
