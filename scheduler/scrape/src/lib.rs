//! The HTTP endpoint Prometheus scrapes, shared by the scheduler (`rollfleet scheduler
//! --metrics-addr`) and the operator (`--metrics-addr`).
//!
//! Every path gets the page, as plain text in the exposition format. A scrape may take at most
//! [`SCRAPE_WITHIN`] (reading the request and writing the page), so a client that stops reading
//! does not hold its connection for good; at most `max_open` are answered at once and more wait
//! in the kernel's backlog; a failed `accept` (out of descriptors) backs off instead of spinning.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// How long one scrape may take, reading the request and writing the page.
pub const SCRAPE_WITHIN: Duration = Duration::from_secs(10);

/// How long the request head is waited for (its content does not matter).
const READ_WITHIN: Duration = Duration::from_secs(2);

/// What an endpoint serves.
pub trait Page: Send + Sync + 'static {
    /// What [`Page::render`] hands to [`Page::served`] about the page it rendered.
    type Rendered: Send;

    /// The page, in the text exposition format.
    fn render(&self) -> (String, Self::Rendered);

    /// Called once the whole page reached `peer`.
    fn served(&self, _peer: IpAddr, _rendered: Self::Rendered) {}
}

/// Serves `page` over HTTP on `listener`, at most `max_open` scrapes at once, until the task is
/// dropped.
pub async fn serve<P: Page>(listener: TcpListener, page: Arc<P>, max_open: usize) {
    let open = Arc::new(tokio::sync::Semaphore::new(max_open.max(1)));
    let mut backoff = Duration::ZERO;
    loop {
        let Ok(permit) = open.clone().acquire_owned().await else {
            return;
        };
        let (mut socket, peer) = match listener.accept().await {
            Ok(accepted) => {
                backoff = Duration::ZERO;
                accepted
            }
            Err(_) => {
                // Out of descriptors: retrying at once would spin.
                backoff = (backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                tokio::time::sleep(backoff).await;
                continue;
            }
        };
        let page = page.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let scrape = async {
                let mut buf = [0u8; 2048];
                let _ = tokio::time::timeout(READ_WITHIN, socket.read(&mut buf)).await;
                let (body, rendered) = page.render();
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let written = async {
                    socket.write_all(head.as_bytes()).await?;
                    socket.write_all(body.as_bytes()).await?;
                    socket.shutdown().await
                };
                if written.await.is_ok() {
                    page.served(peer.ip(), rendered);
                }
            };
            let _ = tokio::time::timeout(SCRAPE_WITHIN, scrape).await;
        });
    }
}
