//! Mutual TLS between cluster nodes (`[cluster.tls]`): the files read and checked once at
//! start-up, the rustls configurations of the Raft port, and the node identity rule.
//!
//! **Identity.** A node's certificate must name the member it claims to be: a subjectAltName IP
//! address equal to the IP of that node's entry in `cluster.peers`, or a subjectAltName DNS name
//! `pinq-node-{id}` ([`node_dns_name`]). Where several nodes share one IP (one host, NAT), only
//! the DNS form tells them apart. The rule is [`check_identity`], pure, and both sides run it:
//! the dialing side inside its certificate verifier (the chain against `caFile`, then the identity
//! of the node it dialed), the accepting side once the peer's `Hello` says which node it is
//! (rustls has already checked the client certificate's chain against `caFile`).
//!
//! Nothing here runs per message: [`NodeTls::from_files`] at start-up, a verifier per
//! handshake. The transport (`crate::cluster::transport`) is the only caller past start-up.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::tls::{self, TlsError, TlsFiles};

/// The files of `[cluster.tls]` (paths as configured); all three or none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeTlsFiles {
    /// `cluster.tls.certFile`: this node's PEM chain, its certificate first. The certificate
    /// serves both sides of a connection (server to the nodes that dial it, client to the ones
    /// it dials), so it needs no extendedKeyUsage or both `serverAuth` and `clientAuth`.
    pub cert_file: PathBuf,
    /// `cluster.tls.keyFile`: its private key.
    pub key_file: PathBuf,
    /// `cluster.tls.caFile`: the CA every member's certificate must be signed by.
    pub ca_file: PathBuf,
}

/// Who a peer must be: its node id and the IP of its configured Raft address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeIdentity {
    pub node_id: u64,
    pub ip: IpAddr,
}

/// The DNS subjectAltName that names node `node_id` whatever its address.
pub fn node_dns_name(node_id: u64) -> String {
    format!("pinq-node-{node_id}")
}

/// A certificate that does not name the node it was presented for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("the certificate of node {node_id} cannot be parsed: {what}")]
    Unparsable { node_id: u64, what: String },
    #[error(
        "the certificate presented for node {} names {}, not IP {} (its address in cluster.peers) nor DNS {}",
        .identity.node_id, names_text(.presented), .identity.ip, node_dns_name(.identity.node_id)
    )]
    NotThisNode {
        identity: NodeIdentity,
        /// The subjectAltNames the certificate carries, as `DNS:name` and `IP:address`.
        presented: Vec<String>,
    },
    #[error("node {node_id} presented no certificate")]
    NoCertificate { node_id: u64 },
}

fn names_text(names: &[String]) -> String {
    if names.is_empty() {
        "no subjectAltName".to_owned()
    } else {
        names.join(", ")
    }
}

/// Whether `cert` (DER, the end-entity certificate) names `identity` (see the module docs).
/// Checks names only: the chain is rustls' to verify.
pub fn check_identity(
    cert: &CertificateDer<'_>,
    identity: &NodeIdentity,
) -> Result<(), IdentityError> {
    use x509_parser::extensions::GeneralName;
    use x509_parser::prelude::FromDer;
    let unparsable = |what: String| IdentityError::Unparsable {
        node_id: identity.node_id,
        what,
    };
    let (_, parsed) = x509_parser::certificate::X509Certificate::from_der(cert.as_ref())
        .map_err(|e| unparsable(e.to_string()))?;
    let san = parsed
        .subject_alternative_name()
        .map_err(|e| unparsable(e.to_string()))?;
    let dns = node_dns_name(identity.node_id);
    let mut presented = Vec::new();
    for name in san.iter().flat_map(|ext| ext.value.general_names.iter()) {
        match name {
            GeneralName::DNSName(name) => {
                if name.eq_ignore_ascii_case(&dns) {
                    return Ok(());
                }
                presented.push(format!("DNS:{name}"));
            }
            GeneralName::IPAddress(octets) => {
                let ip = ip_from_octets(octets);
                if ip.is_some_and(|ip| same_ip(ip, identity.ip)) {
                    return Ok(());
                }
                presented.push(ip.map_or_else(|| "IP:?".to_owned(), |ip| format!("IP:{ip}")));
            }
            _ => {}
        }
    }
    Err(IdentityError::NotThisNode {
        identity: *identity,
        presented,
    })
}

fn ip_from_octets(octets: &[u8]) -> Option<IpAddr> {
    match octets.len() {
        4 => <[u8; 4]>::try_from(octets).ok().map(IpAddr::from),
        16 => <[u8; 16]>::try_from(octets).ok().map(IpAddr::from),
        _ => None,
    }
}

/// Equal IPs, an IPv4 address and its IPv4-mapped IPv6 form included.
fn same_ip(a: IpAddr, b: IpAddr) -> bool {
    a.to_canonical() == b.to_canonical()
}

/// The Raft port's TLS, built once from `[cluster.tls]`: the acceptor (a client certificate
/// signed by `caFile` required) and, per peer this node dials, a client configuration whose
/// verifier checks that peer's identity.
pub struct NodeTls {
    acceptor: futures_rustls::TlsAcceptor,
    dialers: BTreeMap<u64, Arc<ClientConfig>>,
    identities: BTreeMap<u64, NodeIdentity>,
}

impl fmt::Debug for NodeTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeTls")
            .field("identities", &self.identities)
            .finish_non_exhaustive()
    }
}

impl NodeTls {
    /// Reads and checks the three files (errors name the file: missing, no PEM, a key that does
    /// not belong to the certificate, a certificate outside its validity period at `now_s`) and
    /// builds the configurations for node `node_id` of `peers`. Returns, beside it, the reason
    /// this node's own certificate does not name it, if it does not: its peers will refuse it,
    /// which the caller should log.
    pub fn from_files(
        files: &NodeTlsFiles,
        node_id: u64,
        peers: &BTreeMap<u64, SocketAddr>,
        now_s: i64,
    ) -> Result<(NodeTls, Option<IdentityError>), TlsError> {
        let server = tls::server_config(
            &TlsFiles {
                cert_file: files.cert_file.clone(),
                key_file: files.key_file.clone(),
                client_ca_file: Some(files.ca_file.clone()),
            },
            now_s,
        )?;
        let ca = tls::load_certs(&files.ca_file)?;
        tls::check_valid_now(&files.ca_file, &ca[0], now_s)?;
        let roots = Arc::new(tls::roots_from(&files.ca_file)?);
        let certs = tls::load_certs(&files.cert_file)?;
        let identities: BTreeMap<u64, NodeIdentity> = peers
            .iter()
            .map(|(&id, addr)| {
                (
                    id,
                    NodeIdentity {
                        node_id: id,
                        ip: addr.ip(),
                    },
                )
            })
            .collect();
        let own = identities
            .get(&node_id)
            .and_then(|identity| check_identity(&certs[0], identity).err());
        let mut dialers = BTreeMap::new();
        for (&id, identity) in identities.iter().filter(|(id, _)| **id != node_id) {
            dialers.insert(id, client_config(files, &roots, *identity)?);
        }
        let tls = NodeTls {
            acceptor: futures_rustls::TlsAcceptor::from(server),
            dialers,
            identities,
        };
        Ok((tls, own))
    }

    /// The accepting side's TLS.
    pub fn acceptor(&self) -> &futures_rustls::TlsAcceptor {
        &self.acceptor
    }

    /// The configuration to dial `peer` with and the name to give rustls (its IP; the verifier
    /// applies the identity rule, see the module docs). `None` for a node not in `peers`.
    pub fn dialer(&self, peer: u64) -> Option<(&Arc<ClientConfig>, ServerName<'static>)> {
        let config = self.dialers.get(&peer)?;
        let ip = self.identities.get(&peer)?.ip;
        Some((config, ServerName::IpAddress(ip.into())))
    }

    /// The accepting side's check, once the peer's `Hello` said it is `peer`: its certificate
    /// (already verified against `caFile` by rustls) must name that member.
    pub fn check_peer(
        &self,
        peer: u64,
        cert: Option<&CertificateDer<'_>>,
    ) -> Result<(), IdentityError> {
        let cert = cert.ok_or(IdentityError::NoCertificate { node_id: peer })?;
        match self.identities.get(&peer) {
            Some(identity) => check_identity(cert, identity),
            // Not a member: the Hello check refuses it first, with its own reason.
            None => Ok(()),
        }
    }
}

/// A client configuration presenting this node's certificate and trusting, for `identity`, only
/// a certificate signed by the CA that names that node. No session resumption: connections live
/// long, and a resumed session would skip the verifier.
fn client_config(
    files: &NodeTlsFiles,
    roots: &Arc<RootCertStore>,
    identity: NodeIdentity,
) -> Result<Arc<ClientConfig>, TlsError> {
    let provider = tls::provider();
    let verifier = PeerVerifier {
        roots: roots.clone(),
        algorithms: provider.signature_verification_algorithms,
        identity,
    };
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier))
        .with_client_auth_cert(
            tls::load_certs(&files.cert_file)?,
            tls::load_key(&files.key_file)?,
        )
        .map_err(|e| tls::single_cert_error(e, &files.cert_file, &files.key_file))?;
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

/// Verifies a peer's server certificate: the chain against `caFile` (webpki, as rustls' own
/// verifier does), then [`check_identity`] for the node dialed, in place of a host name check.
#[derive(Debug)]
struct PeerVerifier {
    roots: Arc<RootCertStore>,
    algorithms: WebPkiSupportedAlgorithms,
    identity: NodeIdentity,
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let parsed = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.algorithms.all,
        )?;
        check_identity(end_entity, &self.identity).map_err(|e| {
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(
                Arc::new(e),
            )))
        })?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// For logs: what a failed TLS handshake on the Raft port means, and whether this node refused
/// the peer (`true`) or the peer refused this node (`false`, it sent an alert). `None` when the
/// error is not a TLS one (a reset, a timeout).
pub fn describe_tls_failure(error: &std::io::Error) -> Option<(bool, String)> {
    let tls = error.get_ref()?.downcast_ref::<rustls::Error>()?;
    Some(match tls {
        rustls::Error::AlertReceived(alert) => (
            false,
            format!("the peer refused this node's certificate or TLS (alert {alert:?})"),
        ),
        rustls::Error::InvalidCertificate(rustls::CertificateError::Other(other)) => {
            (true, other.to_string())
        }
        rustls::Error::InvalidCertificate(e) => (
            true,
            format!("the peer's certificate is not acceptable: {e:?} (is it signed by cluster.tls.caFile?)"),
        ),
        rustls::Error::NoCertificatesPresented => (
            true,
            "the peer presented no client certificate (is [cluster.tls] set on it?)".to_owned(),
        ),
        rustls::Error::InvalidMessage(_) => (
            true,
            format!("the peer does not speak TLS ({tls}): is [cluster.tls] set on it?"),
        ),
        other => (true, format!("TLS handshake failed: {other}")),
    })
}

#[cfg(test)]
mod tests;
