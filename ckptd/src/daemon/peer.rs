//! The daemon's TCP port: each connection's first frame says what it is for — a buddy's
//! replica coming in or being fetched back (`replica`), a node's link to the leader, or a
//! question for the leader (which step to restore, events, status). Frames are
//! authenticated (`framing`); a connection that breaks the protocol is counted in
//! `peer_messages_rejected` and dropped, and nothing it said is acted on.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use lazarus_shared::wire::{self, Message, WireError};
use tokio::net::{TcpListener, TcpStream};

use super::replica::{self, ReplicaMeta};
use super::{framing, Daemon};

pub async fn serve(daemon: Arc<Daemon>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, from)) => {
                let daemon = daemon.clone();
                tokio::spawn(async move {
                    let _ = stream.set_nodelay(true);
                    if let Err(error) = connection(&daemon, stream, from).await {
                        match error.downcast_ref::<WireError>() {
                            Some(WireError::Closed) => {}
                            Some(wire) => {
                                daemon.metrics.rejected(wire.cause());
                                tracing::warn!(%from, error = %wire, "dropped a peer message");
                            }
                            None => {
                                daemon.metrics.rejected("refused");
                                tracing::warn!(%from, error = %format!("{error:#}"), "refused a peer request");
                            }
                        }
                    }
                });
            }
            Err(error) => {
                tracing::warn!(%error, "accept on the peer port");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn connection(daemon: &Arc<Daemon>, mut stream: TcpStream, from: SocketAddr) -> Result<()> {
    let first = framing::read(&daemon.key, &mut stream).await?;
    match first.message {
        Message::ReplicaBegin {
            from_node,
            run,
            rank,
            world_size,
            step,
            slot_bytes,
            chunk_bytes,
            tensors,
            blobs,
        } => {
            let blobs = wire::unpack_blobs(&blobs, &first.payload)?;
            let meta = ReplicaMeta {
                from_node,
                run,
                rank,
                world_size,
                step,
                slot_bytes,
                tensors,
                chunks: Vec::new(),
                blobs: blobs.into_iter().map(|(n, b)| (n, b.to_vec())).collect(),
            };
            let result = replica::receive(daemon, &mut stream, meta, chunk_bytes).await;
            let ack = match &result {
                Ok(()) => Message::Ack {
                    ok: true,
                    reason: String::new(),
                },
                Err(error) => Message::Ack {
                    ok: false,
                    reason: format!("{error:#}"),
                },
            };
            // A peer that broke the protocol gets no answer; one we could not serve does.
            if result
                .as_ref()
                .err()
                .and_then(|e| e.downcast_ref::<WireError>())
                .is_none()
            {
                framing::write(&daemon.key, &mut stream, &ack, &[]).await?;
            }
            result
        }
        Message::FetchReplica { run, rank, step } => {
            if run != daemon.cfg.run {
                bail!("fetch for run {run}, this daemon serves {}", daemon.cfg.run);
            }
            replica::send(daemon, &mut stream, rank, step).await
        }
        Message::NodeHello { .. } => match &daemon.leader {
            Some(leader) => {
                leader
                    .clone()
                    .node_session(daemon, stream, first.message, from)
                    .await
            }
            None => bail!("a node said hello, but this daemon is not the leader"),
        },
        Message::WhichStep {
            run,
            world_size,
            rank,
        } => {
            let reply = leader_of(daemon, "which step")?
                .which_step(&run, world_size, rank)
                .await?;
            framing::write(&daemon.key, &mut stream, &reply, &[]).await
        }
        Message::EventsRequest => {
            let reply = Message::Events(leader_of(daemon, "events")?.events().await);
            framing::write(&daemon.key, &mut stream, &reply, &[]).await
        }
        Message::StatusRequest => {
            let reply = Message::Status(leader_of(daemon, "status")?.status().await);
            framing::write(&daemon.key, &mut stream, &reply, &[]).await
        }
        other => bail!("unexpected first message {other:?}"),
    }
}

/// This daemon's leader role, for a request only the leader answers.
fn leader_of<'a>(daemon: &'a Daemon, asked: &str) -> Result<&'a Arc<super::leader::Leader>> {
    daemon
        .leader
        .as_ref()
        .ok_or_else(|| anyhow!("asked for {asked}, but this daemon is not the leader"))
}
