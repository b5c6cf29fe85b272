//! The executor the client runs on: glommio (the broker's own, the CLI's) or tokio (most Rust
//! services). capnp-rpc is executor-agnostic; what is not is here: opening a TCP connection,
//! spawning the connection's RPC task and the ACK-group timers, and sleeping. Everything else
//! in the client is plain futures (glommio's `local_channel` included, which needs no reactor).
//!
//! Which one is chosen per call, by where the call runs: inside a tokio runtime (a
//! `tokio::runtime::Handle` is current) it is tokio, otherwise glommio. The client is built on
//! `Rc` (capnp-rpc is), so under tokio it must run on a `tokio::task::LocalSet` (a
//! current-thread runtime with `LocalSet::run_until`, or `spawn_local` inside one): its tasks
//! are spawned with `tokio::task::spawn_local`.
//!
//! Nothing here reads a clock for logic: the timers are the executors' own.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_lite::io::{AsyncRead, AsyncWrite};

/// The executors the client can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Executor {
    Glommio,
    Tokio,
}

/// The executor of the calling task.
pub fn current() -> Executor {
    if tokio::runtime::Handle::try_current().is_ok() {
        Executor::Tokio
    } else {
        Executor::Glommio
    }
}

/// Waits `duration` on the current executor's timer.
pub async fn sleep(duration: Duration) {
    match current() {
        Executor::Glommio => glommio::timer::sleep(duration).await,
        Executor::Tokio => tokio::time::sleep(duration).await,
    }
}

/// `future`'s output, or `None` if it takes longer than `limit`.
pub async fn within<T>(limit: Duration, future: impl Future<Output = T>) -> Option<T> {
    futures_lite::future::or(async { Some(future.await) }, async {
        sleep(limit).await;
        None
    })
    .await
}

/// A task spawned on the current thread; dropping it cancels the task (as a glommio `Task`
/// does), [`Task::detach`] lets it run to its end.
pub enum Task<T> {
    Glommio(Option<glommio::Task<T>>),
    Tokio(Option<tokio::task::JoinHandle<T>>),
}

impl<T> Task<T> {
    /// Lets the task run on without this handle.
    pub fn detach(mut self) {
        match &mut self {
            Task::Glommio(task) => {
                if let Some(task) = task.take() {
                    task.detach();
                }
            }
            // Dropping a tokio JoinHandle detaches; only `Drop` below aborts.
            Task::Tokio(handle) => drop(handle.take()),
        }
    }
}

impl<T> Drop for Task<T> {
    fn drop(&mut self) {
        if let Task::Tokio(Some(handle)) = self {
            handle.abort();
        }
    }
}

/// Spawns `future` on the current thread's executor (under tokio, on the current `LocalSet`).
pub fn spawn_local<T: 'static>(future: impl Future<Output = T> + 'static) -> Task<T> {
    match current() {
        Executor::Glommio => Task::Glommio(Some(glommio::spawn_local(future))),
        Executor::Tokio => Task::Tokio(Some(tokio::task::spawn_local(future))),
    }
}

/// A TCP connection of either executor, as a futures-io stream.
pub enum Tcp {
    Glommio(glommio::net::TcpStream),
    Tokio(tokio::net::TcpStream),
}

/// glommio refuses a zero connect timeout.
const MIN_TIMEOUT: Duration = Duration::from_millis(1);

impl Tcp {
    /// Connects to `addr` within `timeout`, with `TCP_NODELAY` set (requests are small and
    /// latency matters more than packet count).
    pub async fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<Tcp> {
        let timeout = timeout.max(MIN_TIMEOUT);
        let stream = match current() {
            Executor::Glommio => Tcp::Glommio(
                glommio::net::TcpStream::connect_timeout(addr, timeout)
                    .await
                    .map_err(io::Error::from)?,
            ),
            Executor::Tokio => {
                let connect = tokio::net::TcpStream::connect(addr);
                match tokio::time::timeout(timeout, connect).await {
                    Ok(stream) => Tcp::Tokio(stream?),
                    Err(_) => {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            format!("connecting took longer than {} ms", timeout.as_millis()),
                        ))
                    }
                }
            }
        };
        match &stream {
            Tcp::Glommio(s) => s.set_nodelay(true).map_err(io::Error::from)?,
            Tcp::Tokio(s) => s.set_nodelay(true)?,
        }
        Ok(stream)
    }

    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        match self {
            Tcp::Glommio(s) => s.peer_addr().map_err(io::Error::from),
            Tcp::Tokio(s) => s.peer_addr(),
        }
    }
}

impl AsyncRead for Tcp {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Tcp::Glommio(s) => Pin::new(s).poll_read(cx, buf),
            Tcp::Tokio(s) => {
                let mut read = tokio::io::ReadBuf::new(buf);
                match tokio::io::AsyncRead::poll_read(Pin::new(s), cx, &mut read) {
                    Poll::Ready(Ok(())) => Poll::Ready(Ok(read.filled().len())),
                    Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl AsyncWrite for Tcp {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Tcp::Glommio(s) => Pin::new(s).poll_write(cx, buf),
            Tcp::Tokio(s) => tokio::io::AsyncWrite::poll_write(Pin::new(s), cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Tcp::Glommio(s) => Pin::new(s).poll_flush(cx),
            Tcp::Tokio(s) => tokio::io::AsyncWrite::poll_flush(Pin::new(s), cx),
        }
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Tcp::Glommio(s) => Pin::new(s).poll_close(cx),
            Tcp::Tokio(s) => tokio::io::AsyncWrite::poll_shutdown(Pin::new(s), cx),
        }
    }
}
