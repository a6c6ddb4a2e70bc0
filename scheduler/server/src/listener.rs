//! The scheduler's gRPC listener, bounded: at most [`MAX_CONNECTIONS`] connections open at
//! once (beyond them the next is accepted only when one closes; the kernel's backlog holds the
//! rest), a connection that sends nothing within [`FIRST_BYTES_WITHIN`] of being accepted is
//! closed (a peer that opens sockets and says nothing would otherwise hold them for good), and
//! accept errors (out of descriptors) back off instead of spinning. Peers that do speak are kept
//! honest by HTTP/2 keepalive pings, set on the server ([`KEEPALIVE_INTERVAL`]): one that stops
//! answering them is closed.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Connections open at once: far above a job's workers, trainer and watchers.
pub const MAX_CONNECTIONS: usize = 1024;

/// How long a new connection has to send its first bytes (the HTTP/2 preface or a TLS hello).
pub const FIRST_BYTES_WITHIN: Duration = Duration::from_secs(10);

/// How often the server pings a connection that is quiet, and how long the peer has to answer.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// See [`KEEPALIVE_INTERVAL`].
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The limits of a [`bounded`] listener.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections open at once.
    pub max_connections: usize,
    /// How long a new connection has to send its first bytes.
    pub first_bytes_within: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: MAX_CONNECTIONS,
            first_bytes_within: FIRST_BYTES_WITHIN,
        }
    }
}

/// The connections `listener` accepts, within `limits`, as tonic serves them.
pub fn bounded(
    listener: TcpListener,
    limits: Limits,
) -> impl Stream<Item = std::io::Result<Connection>> + Send + 'static {
    let open = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    futures_util::stream::unfold(
        (listener, open, Duration::ZERO),
        move |(listener, open, mut backoff)| async move {
            // Waiting for a free place before accepting leaves the rest in the kernel's backlog.
            let permit = open.clone().acquire_owned().await.ok()?;
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        let _ = stream.set_nodelay(true);
                        let connection = Connection {
                            stream,
                            _permit: permit,
                            silent_until: Some(Box::pin(tokio::time::sleep(
                                limits.first_bytes_within,
                            ))),
                        };
                        return Some((Ok(connection), (listener, open, Duration::ZERO)));
                    }
                    Err(e) => {
                        // Out of descriptors, or a connection reset before it was accepted:
                        // retrying at once would spin.
                        backoff =
                            (backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                        tracing::warn!(
                            "scheduler: accepting a connection failed: {e}; trying again in {} ms",
                            backoff.as_millis()
                        );
                        tokio::time::sleep(backoff).await;
                    }
                }
            }
        },
    )
}

/// An accepted connection, holding its place among the open ones until it closes.
pub struct Connection {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
    /// Until the first bytes come: when they must have come by.
    silent_until: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Connected for Connection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        if self.silent_until.is_some() {
            match read {
                Poll::Ready(Ok(())) if buf.filled().len() > before => self.silent_until = None,
                Poll::Pending => {
                    if let Some(deadline) = self.silent_until.as_mut()
                        && deadline.as_mut().poll(cx).is_ready()
                    {
                        return Poll::Ready(Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "the peer sent nothing after connecting",
                        )));
                    }
                }
                _ => {}
            }
        }
        read
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn listening(
        limits: Limits,
    ) -> (
        std::net::SocketAddr,
        impl Stream<Item = std::io::Result<Connection>>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        (addr, Box::pin(bounded(listener, limits)))
    }

    #[tokio::test]
    async fn a_connection_that_sends_nothing_is_closed_and_one_that_speaks_is_kept() {
        let limits = Limits {
            max_connections: 8,
            first_bytes_within: Duration::from_millis(200),
        };
        let (addr, mut incoming) = listening(limits).await;
        let _silent = TcpStream::connect(addr).await.unwrap();
        let mut silent = incoming.next().await.unwrap().unwrap();
        let mut buf = [0u8; 8];
        let error = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf))
            .await
            .expect("the silent connection was not given up")
            .unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::TimedOut);

        let mut talker = TcpStream::connect(addr).await.unwrap();
        let mut speaking = incoming.next().await.unwrap().unwrap();
        talker.write_all(b"PRI").await.unwrap();
        assert_eq!(speaking.read(&mut buf).await.unwrap(), 3);
        // Past the deadline, a connection that spoke waits as long as it likes.
        tokio::time::sleep(Duration::from_millis(400)).await;
        talker.write_all(b"!").await.unwrap();
        assert_eq!(speaking.read(&mut buf).await.unwrap(), 1);
    }

    #[tokio::test]
    async fn beyond_the_cap_a_connection_is_accepted_only_once_another_closes() {
        let limits = Limits {
            max_connections: 2,
            first_bytes_within: Duration::from_secs(60),
        };
        let (addr, mut incoming) = listening(limits).await;
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(addr).await.unwrap());
        }
        let first = incoming.next().await.unwrap().unwrap();
        let _second = incoming.next().await.unwrap().unwrap();
        let third = tokio::time::timeout(Duration::from_millis(300), incoming.next()).await;
        assert!(
            third.is_err(),
            "a third connection was accepted over a cap of 2"
        );
        drop(first);
        let third = tokio::time::timeout(Duration::from_secs(5), incoming.next())
            .await
            .expect("the third connection was not accepted once the first closed");
        assert!(third.unwrap().is_ok());
    }
}
