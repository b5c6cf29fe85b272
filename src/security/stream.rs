//! The one stream type connections run over: plain TCP, or TLS over TCP (rustls through
//! `futures-rustls`, which fits glommio's futures-io streams). The server's streams are
//! glommio's; a client's may be any futures-io stream (`crate::client::runtime::Tcp`, glommio's
//! or tokio's), so [`Stream`] is generic over the transport with glommio's TCP as default.
//!
//! [`accept`] does the server's handshake within a deadline, so a client that connects and says
//! nothing (or speaks plain Cap'n Proto to a TLS port) holds its connection slot no longer than
//! that: the handshake fails or times out and the connection is closed. [`connect`] does the
//! client's (its caller bounds it with its own executor's timer). Both are called once per
//! connection; the per-byte path is the `AsyncRead` and `AsyncWrite` delegation below.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_lite::io::{AsyncRead, AsyncWrite};
use glommio::net::TcpStream;
use rustls::pki_types::ServerName;

/// A connection's byte stream over the transport `S`.
pub enum Stream<S = TcpStream> {
    Plain(S),
    Tls(Box<futures_rustls::TlsStream<S>>),
}

impl<S> Stream<S> {
    /// Whether the stream is encrypted.
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    /// The peer's end-entity certificate, when it presented one over TLS.
    pub fn peer_certificate(&self) -> Option<rustls::pki_types::CertificateDer<'static>> {
        match self {
            Stream::Plain(_) => None,
            Stream::Tls(tls) => tls
                .get_ref()
                .1
                .peer_certificates()?
                .first()
                .map(|cert| cert.clone().into_owned()),
        }
    }
}

/// Does the server's side of the TLS handshake (none without `tls`) within `deadline`.
pub async fn accept(
    tls: Option<&futures_rustls::TlsAcceptor>,
    stream: TcpStream,
    deadline: Duration,
) -> io::Result<Stream> {
    let Some(acceptor) = tls else {
        return Ok(Stream::Plain(stream));
    };
    let handshake = async {
        let tls = acceptor.accept(stream).await?;
        Ok(Stream::Tls(Box::new(futures_rustls::TlsStream::Server(
            tls,
        ))))
    };
    within(deadline, handshake).await
}

/// Does the client's side of the TLS handshake (none without `tls`); the caller bounds it in
/// time with its executor's timer.
pub async fn connect<S: AsyncRead + AsyncWrite + Unpin>(
    tls: Option<(&Arc<rustls::ClientConfig>, ServerName<'static>)>,
    stream: S,
) -> io::Result<Stream<S>> {
    let Some((config, name)) = tls else {
        return Ok(Stream::Plain(stream));
    };
    let connector = futures_rustls::TlsConnector::from(config.clone());
    let tls = connector.connect(name, stream).await?;
    Ok(Stream::Tls(Box::new(futures_rustls::TlsStream::Client(
        tls,
    ))))
}

async fn within(
    deadline: Duration,
    handshake: impl std::future::Future<Output = io::Result<Stream>>,
) -> io::Result<Stream> {
    futures_lite::future::or(handshake, async {
        glommio::timer::sleep(deadline).await;
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the TLS handshake took longer than {} ms",
                deadline.as_millis()
            ),
        ))
    })
    .await
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for Stream<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_close(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_close(cx),
        }
    }
}
