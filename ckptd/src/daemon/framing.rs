//! Authenticated framing between daemons (and `ckptctl status`) over TCP.
//!
//! Every frame carries the job key's MAC (`wire::encode`, or over the payload's hash for a
//! replica chunk, `wire::write_frame_hashed`); `wire::read_frame` rejects one
//! that does not, or that is malformed or oversized. Here the network's time limits are
//! added: a peer gets `CONNECT_TIMEOUT` to accept and `FRAME_TIMEOUT` to send its next frame
//! of a conversation, so a silent or stopped peer never holds a task forever.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use lazarus_shared::wire::{self, Frame, JobKey, Message};
use lazarus_shared::ChunkHash;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpSocket, TcpStream};

/// How long a peer may take to accept a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a peer may take to send the next frame of a conversation.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(30);

/// The address this daemon's connections leave from: the IP it listens on, when that is one
/// address (a host with several networks talks to peers from the one it serves them on).
static SOURCE_IP: std::sync::OnceLock<IpAddr> = std::sync::OnceLock::new();

/// Connections to peers leave from `ip` from now on (unless it is unspecified).
pub fn set_source_ip(ip: IpAddr) {
    if !ip.is_unspecified() {
        let _ = SOURCE_IP.set(ip);
    }
}

/// A TCP connection to `to`, from the daemon's source IP when it has one.
pub async fn dial(to: SocketAddr) -> std::io::Result<TcpStream> {
    let Some(ip) = SOURCE_IP.get().filter(|ip| ip.is_ipv4() == to.is_ipv4()) else {
        return TcpStream::connect(to).await;
    };
    let socket = match ip {
        IpAddr::V4(_) => TcpSocket::new_v4()?,
        IpAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.bind(SocketAddr::new(*ip, 0))?;
    socket.connect(to).await
}

/// Connects to `to` (`what` names it in errors), with Nagle's delay off.
pub async fn connect(to: SocketAddr, what: &str) -> Result<TcpStream> {
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, dial(to))
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

/// Sends one frame authenticated with `key`, within `FRAME_TIMEOUT` (a peer behind a
/// black-holed network stops reading, and a write would wait forever).
pub async fn write(
    key: &JobKey,
    writer: &mut (impl AsyncWrite + Unpin),
    message: &Message,
    payload: &[u8],
) -> Result<()> {
    tokio::time::timeout(
        FRAME_TIMEOUT,
        wire::write_frame(writer, message, payload, Some(key)),
    )
    .await
    .map_err(|_| anyhow!("the peer took nothing for {FRAME_TIMEOUT:?}"))??;
    Ok(())
}

/// [`write`] for a payload whose blake3 the sender already has (a replica chunk): the MAC
/// covers that hash, and the reader's one pass over the bytes both checks it and names them
/// (`wire::write_frame_hashed`).
pub async fn write_hashed(
    key: &JobKey,
    writer: &mut (impl AsyncWrite + Unpin),
    message: &Message,
    payload: &[u8],
    payload_hash: &ChunkHash,
) -> Result<()> {
    tokio::time::timeout(
        FRAME_TIMEOUT,
        wire::write_frame_hashed(writer, message, payload, payload_hash, Some(key)),
    )
    .await
    .map_err(|_| anyhow!("the peer took nothing for {FRAME_TIMEOUT:?}"))??;
    Ok(())
}

/// One request to `to` and its answer, on a connection of their own.
pub async fn request(key: &JobKey, to: SocketAddr, message: &Message) -> Result<Message> {
    Ok(request_frame(key, to, message).await?.message)
}

/// [`request`], with the answer's payload.
pub async fn request_frame(key: &JobKey, to: SocketAddr, message: &Message) -> Result<Frame> {
    let mut stream = connect(to, "daemon").await?;
    write(key, &mut stream, message, &[]).await?;
    read(key, &mut stream).await
}
