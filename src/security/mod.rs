//! Security of the client port: TLS ([`tls`] loads and checks the files, [`stream`] is the one
//! stream type connections run over) and tokens with permissions per topic prefix ([`auth`], a
//! pure model). [`Security`] is what the server builds once at start-up from the configuration
//! and shares with every shard.

pub mod auth;
pub mod client;
pub mod stream;
pub mod tls;

use std::sync::Arc;

use crate::config::SecurityConfig;

/// The server's TLS acceptor and tokens, built once from the configuration.
#[derive(Clone, Default)]
pub struct Security {
    pub tls: Option<futures_rustls::TlsAcceptor>,
    pub tokens: Arc<auth::Tokens>,
}

impl Security {
    /// Reads and checks every TLS file (errors name the file) and prepares the tokens.
    pub fn from_config(config: &SecurityConfig) -> Result<Security, tls::TlsError> {
        let tls = match &config.tls {
            None => None,
            Some(files) => Some(futures_rustls::TlsAcceptor::from(tls::server_config(
                files,
                tls::unix_now_s(),
            )?)),
        };
        Ok(Security {
            tls,
            tokens: Arc::new(auth::Tokens::new(&config.tokens)),
        })
    }
}
