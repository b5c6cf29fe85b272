//! A connection's write half that sends once per executor turn instead of once per RPC message.
//!
//! capnp-rpc's write queue flushes after every message, so at low rates each reply and each
//! `deliver` call is its own `send`, and its own wake-up of the peer. [`Coalescing`] takes the
//! bytes into a buffer and answers a flush at once, having only marked the buffer dirty; a
//! flusher task of its own yields once (so every task already runnable in this turn can add its
//! messages) and then writes everything buffered in one go. Nothing is reordered: bytes leave
//! in the order they were written.
//!
//! Bounded: once [`BUFFER_BYTES_MAX`] are waiting, writes wait for the flusher. A write error is
//! kept and returned by every later call. Closing waits until the buffer is out, then closes the
//! stream. Used by `super::connection` for a client connection's RPC stream; must run on a
//! glommio executor (the flusher is a local task).

use std::cell::RefCell;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

use futures_lite::io::{AsyncWrite, AsyncWriteExt};

/// Bytes a connection may have buffered and not yet handed to the socket before its writes wait.
pub const BUFFER_BYTES_MAX: usize = 64 << 10;

#[derive(Default)]
struct Shared {
    buf: Vec<u8>,
    /// A flush was asked for: the flusher sends what is buffered.
    dirty: bool,
    /// The writer was closed or dropped: the flusher sends what is left and closes the stream.
    closing: bool,
    /// The flusher has ended (stream closed, or failed).
    done: bool,
    error: Option<io::ErrorKind>,
    flusher: Option<Waker>,
    writer: Option<Waker>,
}

impl Shared {
    fn wake_flusher(&mut self) {
        if let Some(w) = self.flusher.take() {
            w.wake();
        }
    }

    fn wake_writer(&mut self) {
        if let Some(w) = self.writer.take() {
            w.wake();
        }
    }

    fn failed(&self) -> Option<io::Error> {
        self.error.map(|kind| io::Error::new(kind, "connection write failed"))
    }
}

/// The coalescing write half (see the module docs).
pub struct Coalescing {
    shared: Rc<RefCell<Shared>>,
}

impl Coalescing {
    /// Wraps `stream`, starting its flusher task on the current executor.
    pub fn new<W: AsyncWrite + Unpin + 'static>(stream: W) -> Coalescing {
        let shared = Rc::new(RefCell::new(Shared {
            buf: Vec::with_capacity(8 << 10),
            ..Shared::default()
        }));
        glommio::spawn_local(flusher(Rc::clone(&shared), stream)).detach();
        Coalescing { shared }
    }
}

/// Resolves once there is something to send, or the writer is closing.
fn wanted(shared: &RefCell<Shared>) -> impl Future<Output = ()> + '_ {
    futures_lite::future::poll_fn(move |cx| {
        let mut s = shared.borrow_mut();
        if s.dirty || s.closing {
            Poll::Ready(())
        } else {
            s.flusher = Some(cx.waker().clone());
            Poll::Pending
        }
    })
}

async fn flusher<W: AsyncWrite + Unpin>(shared: Rc<RefCell<Shared>>, mut stream: W) {
    let mut out = Vec::with_capacity(8 << 10);
    let result: io::Result<()> = async {
        loop {
            wanted(&shared).await;
            // Let the tasks runnable in this turn add their messages first.
            futures_lite::future::yield_now().await;
            let closing = {
                let mut s = shared.borrow_mut();
                std::mem::swap(&mut s.buf, &mut out);
                s.dirty = false;
                s.wake_writer();
                s.closing
            };
            if !out.is_empty() {
                stream.write_all(&out).await?;
                stream.flush().await?;
                out.clear();
            }
            if closing && shared.borrow().buf.is_empty() {
                return stream.close().await;
            }
        }
    }
    .await;
    let mut s = shared.borrow_mut();
    if let Err(e) = result {
        s.error = Some(e.kind());
    }
    s.done = true;
    s.wake_writer();
}

impl AsyncWrite for Coalescing {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, bytes: &[u8]) -> Poll<io::Result<usize>> {
        let mut s = self.shared.borrow_mut();
        if let Some(e) = s.failed() {
            return Poll::Ready(Err(e));
        }
        if s.done || s.closing {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        let room = BUFFER_BYTES_MAX.saturating_sub(s.buf.len());
        if room == 0 {
            s.dirty = true;
            s.writer = Some(cx.waker().clone());
            s.wake_flusher();
            return Poll::Pending;
        }
        let take = room.min(bytes.len());
        s.buf.extend_from_slice(&bytes[..take]);
        Poll::Ready(Ok(take))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut s = self.shared.borrow_mut();
        if let Some(e) = s.failed() {
            return Poll::Ready(Err(e));
        }
        if !s.buf.is_empty() {
            s.dirty = true;
            s.wake_flusher();
        }
        Poll::Ready(Ok(()))
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut s = self.shared.borrow_mut();
        if s.done {
            return Poll::Ready(s.failed().map_or(Ok(()), Err));
        }
        s.closing = true;
        s.writer = Some(cx.waker().clone());
        s.wake_flusher();
        Poll::Pending
    }
}

impl Drop for Coalescing {
    fn drop(&mut self) {
        // The flusher sends what is left, closes the stream and ends.
        let mut s = self.shared.borrow_mut();
        s.closing = true;
        s.wake_flusher();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records each write the socket receives.
    #[derive(Clone, Default)]
    struct Sink(Rc<RefCell<Vec<Vec<u8>>>>);

    impl AsyncWrite for Sink {
        fn poll_write(self: Pin<&mut Self>, _: &mut Context<'_>, b: &[u8]) -> Poll<io::Result<usize>> {
            self.0.borrow_mut().push(b.to_vec());
            Poll::Ready(Ok(b.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn run(f: impl Future<Output = ()> + 'static) {
        glommio::LocalExecutorBuilder::default()
            .spawn(|| f)
            .unwrap()
            .join()
            .unwrap();
    }

    #[test]
    fn flushes_in_one_turn_leave_in_one_send_in_order() {
        run(async {
            let sink = Sink::default();
            let mut w = Coalescing::new(sink.clone());
            for i in 0..5u8 {
                w.write_all(&[i; 3]).await.unwrap();
                w.flush().await.unwrap();
            }
            w.close().await.unwrap();
            let sends = sink.0.borrow().clone();
            assert_eq!(sends.len(), 1);
            assert_eq!(sends[0], vec![0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4]);
        });
    }

    #[test]
    fn a_full_buffer_waits_for_the_flusher_and_loses_nothing() {
        run(async {
            let sink = Sink::default();
            let mut w = Coalescing::new(sink.clone());
            let big: Vec<u8> = (0..3 * BUFFER_BYTES_MAX).map(|i| i as u8).collect();
            w.write_all(&big).await.unwrap();
            w.close().await.unwrap();
            let sent: Vec<u8> = sink.0.borrow().concat();
            assert_eq!(sent, big);
            assert!(sink.0.borrow().len() >= 3);
        });
    }
}
