//! Security of the client port and of the Raft port: TLS ([`tls`] loads and checks the files,
//! [`stream`] is the one stream type connections run over, [`node`] is mutual TLS between
//! cluster nodes and their identity rule) and tokens with permissions per topic prefix
//! ([`auth`], a pure model). [`Security`] is what the server builds once at start-up from the
//! configuration and shares with every shard.

pub mod auth;
pub mod client;
pub mod node;
pub mod stream;
pub mod tls;

use std::sync::Arc;

use crate::config::Config;

/// The server's TLS acceptor, tokens and node TLS, built once from the configuration.
#[derive(Clone, Default)]
pub struct Security {
    pub tls: Option<futures_rustls::TlsAcceptor>,
    pub tokens: Arc<auth::Tokens>,
    /// `[cluster.tls]`, for the Raft transport.
    pub node: Option<Arc<node::NodeTls>>,
}

impl Security {
    /// Reads and checks every TLS file, `[server.tls]` and `[cluster.tls]` (errors name the
    /// file), and prepares the tokens.
    pub fn from_config(config: &Config) -> Result<Security, tls::TlsError> {
        let now_s = tls::unix_now_s();
        let tls = match &config.security.tls {
            None => None,
            Some(files) => Some(futures_rustls::TlsAcceptor::from(tls::server_config(
                files, now_s,
            )?)),
        };
        let node = match &config.cluster {
            Some(cluster) => match &cluster.tls {
                Some(files) => {
                    let (node, own) =
                        node::NodeTls::from_files(files, cluster.node_id, &cluster.peers, now_s)
                            .map_err(|e| tls::TlsError::Cluster(Box::new(e)))?;
                    if let Some(problem) = own {
                        tracing::warn!(
                            "cluster.tls.certFile {} does not name this node, its peers will refuse it: {problem}",
                            files.cert_file.display()
                        );
                    }
                    Some(Arc::new(node))
                }
                None => None,
            },
            None => None,
        };
        Ok(Security {
            tls,
            tokens: Arc::new(auth::Tokens::new(&config.security.tokens)),
            node,
        })
    }
}
