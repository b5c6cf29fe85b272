//! What a client brings to a secured broker: the TLS configuration it connects with (the CA it
//! trusts, the name it expects, its own certificate) and the token it presents in `hello`.
//! Built once from files (`--tls-ca`, `--token-file`, `PINQ_TOKEN`), then shared by every
//! connection of a client; a token never appears in `Debug` output.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::ServerName;

use super::tls::{self, ClientTlsFiles, TlsError};

/// A token's secret bytes. `Debug` prints only its length.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Vec<u8>);

impl Token {
    /// A token from its text; surrounding white space (a file's newline) is not part of it.
    pub fn new(secret: &str) -> Option<Token> {
        let secret = secret.trim();
        (!secret.is_empty()).then(|| Token(secret.as_bytes().to_vec()))
    }

    /// Reads a token file (its first line, trimmed).
    pub fn from_file(path: &Path) -> std::io::Result<Token> {
        let text = std::fs::read_to_string(path)?;
        Token::new(text.lines().next().unwrap_or("")).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("token file {} is empty", path.display()),
            )
        })
    }

    pub fn secret(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Token({} bytes)", self.0.len())
    }
}

/// A client's TLS settings: the rustls configuration and the name to check the broker's
/// certificate against (`None`: the host part of the address connected to).
#[derive(Clone, Debug)]
pub struct ClientTls {
    pub config: Arc<rustls::ClientConfig>,
    pub server_name: Option<String>,
}

impl PartialEq for ClientTls {
    fn eq(&self, other: &ClientTls) -> bool {
        Arc::ptr_eq(&self.config, &other.config) && self.server_name == other.server_name
    }
}

impl Eq for ClientTls {}

impl ClientTls {
    /// Reads the CA and client certificate files (errors name the file).
    pub fn from_files(
        files: &ClientTlsFiles,
        server_name: Option<String>,
    ) -> Result<ClientTls, TlsError> {
        Ok(ClientTls {
            config: tls::client_config(files)?,
            server_name,
        })
    }

    /// The name the broker's certificate must carry when connecting to `addr` (`host:port`).
    pub fn name_for(&self, addr: &str) -> Result<ServerName<'static>, String> {
        let host = match &self.server_name {
            Some(name) => name.as_str(),
            None => host_of(addr),
        };
        ServerName::try_from(host.to_owned())
            .map_err(|e| format!("{host:?} is not a TLS server name ({e}): use --tls-server-name"))
    }
}

/// `host` of `host:port`, `[v6]:port` or a bare host.
pub fn host_of(addr: &str) -> &str {
    if let Some(rest) = addr.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') && port.parse::<u16>().is_ok() => host,
        _ => addr,
    }
}

/// TLS and token of a client's connections; the default is plain TCP with no token.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientSecurity {
    pub tls: Option<ClientTls>,
    pub token: Option<Token>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_of_an_address_is_its_name() {
        assert_eq!(host_of("broker.example:7400"), "broker.example");
        assert_eq!(host_of("127.0.0.1:7400"), "127.0.0.1");
        assert_eq!(host_of("[::1]:7400"), "::1");
        assert_eq!(host_of("broker"), "broker");
    }

    #[test]
    fn a_token_is_trimmed_and_never_printed() {
        let token = Token::new("  s3cret\n").unwrap();
        assert_eq!(token.secret(), b"s3cret");
        assert_eq!(format!("{token:?}"), "Token(6 bytes)");
        assert!(Token::new(" \n").is_none());
    }
}
