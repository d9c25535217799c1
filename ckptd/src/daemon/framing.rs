//! Authenticated framing between daemons (and `ckptctl status`) over TCP.
//!
//! Every frame carries the job key's MAC (`wire::encode`); `wire::read_frame` rejects one
//! that does not, or that is malformed or oversized. Here the network's time limits are
//! added: a peer gets `CONNECT_TIMEOUT` to accept and `FRAME_TIMEOUT` to send its next frame
//! of a conversation, so a silent or stopped peer never holds a task forever.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use lazarus_shared::wire::{self, Frame, JobKey, Message};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// How long a peer may take to accept a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a peer may take to send the next frame of a conversation.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(30);

/// Connects to `to` (`what` names it in errors), with Nagle's delay off.
pub async fn connect(to: SocketAddr, what: &str) -> Result<TcpStream> {
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(to))
        .await
        .map_err(|_| anyhow!("{what} {to} did not accept within {CONNECT_TIMEOUT:?}"))?
        .with_context(|| format!("connecting to {what} {to}"))?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// The next frame, authenticated with `key`, within `FRAME_TIMEOUT`.
pub async fn read(key: &JobKey, reader: &mut (impl AsyncRead + Unpin)) -> Result<Frame> {
    Ok(
        tokio::time::timeout(FRAME_TIMEOUT, wire::read_frame(reader, Some(key)))
            .await
            .map_err(|_| anyhow!("the peer sent nothing for {FRAME_TIMEOUT:?}"))??,
    )
}

/// Sends one frame authenticated with `key`.
pub async fn write(
    key: &JobKey,
    writer: &mut (impl AsyncWrite + Unpin),
    message: &Message,
    payload: &[u8],
) -> Result<()> {
    Ok(wire::write_frame(writer, message, payload, Some(key)).await?)
}

/// One request to `to` and its answer, on a connection of their own.
pub async fn request(key: &JobKey, to: SocketAddr, message: &Message) -> Result<Message> {
    let mut stream = connect(to, "daemon").await?;
    write(key, &mut stream, message, &[]).await?;
    Ok(read(key, &mut stream).await?.message)
}
