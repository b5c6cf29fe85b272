//! TLS set-up: reading and checking the certificate, key and CA files, and building rustls'
//! server and client configurations (with the `ring` provider; no OpenSSL).
//!
//! Everything here runs once, at start-up or when a client connects for the first time, never
//! per message. Every error names the file it is about: a missing file, a file with no PEM
//! certificate or key, a key that does not belong to the certificate, a certificate outside its
//! validity period. The validity check takes `now` as a parameter (Unix seconds) so that tests
//! and `pinq doctor` can ask about any moment.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};

/// The files of `[server.tls]` (paths as configured).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// `server.tls.certFile`: the PEM chain, the server's certificate first.
    pub cert_file: PathBuf,
    /// `server.tls.keyFile`: the PEM private key of that certificate.
    pub key_file: PathBuf,
    /// `server.tls.clientCaFile`: when set, clients must present a certificate signed by it.
    pub client_ca_file: Option<PathBuf>,
}

/// Why a TLS file or configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS file {}: {what}", path.display())]
    File { path: PathBuf, what: String },
    #[error("TLS key file {} does not belong to the certificate in {}", key.display(), cert.display())]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("TLS configuration: {0}")]
    Config(String),
    /// A `[cluster.tls]` file (the node-to-node port).
    #[error("[cluster.tls] {0}")]
    Cluster(Box<TlsError>),
}

fn file_error(path: &Path, what: impl Into<String>) -> TlsError {
    TlsError::File {
        path: path.to_owned(),
        what: what.into(),
    }
}

/// The crypto provider every configuration uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|e| file_error(path, format!("cannot read it: {e}")))
}

/// Every certificate of a PEM file (at least one).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, format!("not a valid PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(file_error(path, "holds no PEM CERTIFICATE block"));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read(path)?;
    PrivateKeyDer::from_pem_slice(&bytes)
        .map_err(|e| file_error(path, format!("holds no usable PEM private key: {e}")))
}

/// A certificate's validity period, in Unix seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    pub not_before_s: i64,
    pub not_after_s: i64,
}

/// The validity period of one DER certificate.
pub fn validity(path: &Path, cert: &CertificateDer<'_>) -> Result<Validity, TlsError> {
    use x509_parser::prelude::FromDer;
    let (_, parsed) = x509_parser::certificate::X509Certificate::from_der(cert.as_ref())
        .map_err(|e| file_error(path, format!("a certificate cannot be parsed: {e}")))?;
    let v = parsed.validity();
    Ok(Validity {
        not_before_s: v.not_before.timestamp(),
        not_after_s: v.not_after.timestamp(),
    })
}

/// The end of validity (Unix seconds) of the server certificate of `files` (the first of its
/// chain), for the metric operators alert on before it passes.
pub fn server_not_after_s(files: &TlsFiles) -> Result<i64, TlsError> {
    let certs = load_certs(&files.cert_file)?;
    let first = certs
        .first()
        .ok_or_else(|| file_error(&files.cert_file, "holds no PEM CERTIFICATE block"))?;
    Ok(validity(&files.cert_file, first)?.not_after_s)
}

/// Refuses a certificate outside its validity period at `now_s`.
pub(crate) fn check_valid_now(
    path: &Path,
    cert: &CertificateDer<'_>,
    now_s: i64,
) -> Result<(), TlsError> {
    let v = validity(path, cert)?;
    if now_s > v.not_after_s {
        return Err(file_error(
            path,
            format!(
                "the certificate expired {} ago",
                humantime::format_duration(std::time::Duration::from_secs(
                    (now_s - v.not_after_s) as u64
                ))
            ),
        ));
    }
    if now_s < v.not_before_s {
        return Err(file_error(path, "the certificate is not valid yet"));
    }
    Ok(())
}

/// Seconds since the Unix epoch by the system clock.
pub fn unix_now_s() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Roots made of every certificate in a PEM file.
pub(crate) fn roots_from(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots
            .add(cert)
            .map_err(|e| file_error(path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(roots)
}

/// The server's configuration from `[server.tls]`, every file checked (`now_s`: the moment
/// certificates must be valid at).
pub fn server_config(files: &TlsFiles, now_s: i64) -> Result<Arc<ServerConfig>, TlsError> {
    let certs = load_certs(&files.cert_file)?;
    check_valid_now(&files.cert_file, &certs[0], now_s)?;
    let key = load_key(&files.key_file)?;
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match &files.client_ca_file {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let roots = roots_from(ca)?;
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(|e| file_error(ca, format!("cannot verify clients with it: {e}")))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(certs, key)
        .map_err(|e| single_cert_error(e, &files.cert_file, &files.key_file))?;
    Ok(Arc::new(config))
}

/// rustls' refusal of a certificate and key pair, naming the files.
pub(crate) fn single_cert_error(error: rustls::Error, cert: &Path, key: &Path) -> TlsError {
    match error {
        rustls::Error::InconsistentKeys(_) => TlsError::KeyMismatch {
            cert: cert.to_owned(),
            key: key.to_owned(),
        },
        other => file_error(key, other.to_string()),
    }
}

/// What a client needs to speak TLS to a broker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientTlsFiles {
    /// The CA to trust; `None`: the system's roots.
    pub ca_file: Option<PathBuf>,
    /// A client certificate and its key, for a broker that requires one.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// A client configuration: trusts `ca_file` (or the system roots), presents the client
/// certificate when both of its files are given.
pub fn client_config(files: &ClientTlsFiles) -> Result<Arc<ClientConfig>, TlsError> {
    let roots = match &files.ca_file {
        Some(ca) => roots_from(ca)?,
        None => {
            let mut roots = RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                return Err(TlsError::Config(
                    "no system root certificate found: give the broker's CA with --tls-ca".into(),
                ));
            }
            roots
        }
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots);
    let config = match (&files.cert_file, &files.key_file) {
        (None, None) => builder.with_no_client_auth(),
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(|e| single_cert_error(e, cert, key))?,
        _ => {
            return Err(TlsError::Config(
                "a client certificate needs both --tls-cert and --tls-key".into(),
            ))
        }
    };
    Ok(Arc::new(config))
}
