//! The daemon's TCP port: each connection's first frame says what it is for — a buddy's
//! replica coming in or being fetched back (`replica`), a node's link to the leader, or a
//! question for the leader (which step to restore, events, status). Frames are
//! authenticated (`framing`); a connection that breaks the protocol is counted in
//! `peer_messages_rejected` and dropped, and nothing it said is acted on.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
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
            rollback,
            chunking,
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
                chunking,
                blobs: blobs.into_iter().map(|(n, b)| (n, b.to_vec())).collect(),
            };
            let (mut stream, result) = daemon
                .data
                .run({
                    let daemon = daemon.clone();
                    async move {
                        let result =
                            replica::receive(&daemon, &mut stream, meta, chunk_bytes, rollback)
                                .await;
                        (stream, result)
                    }
                })
                .await;
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
        Message::NodeHello { .. } => match daemon.leader() {
            Some(leader) => {
                leader
                    .node_session(daemon, stream, first.message, from)
                    .await
            }
            None => {
                framing::write(&daemon.key, &mut stream, &not_leader(daemon), &[]).await?;
                bail!("a node said hello, but this daemon does not lead")
            }
        },
        Message::NewLeader {
            epoch,
            node,
            address,
        } => {
            let known = daemon.leadership.borrow().epoch;
            if epoch <= known {
                daemon.metrics.rejected("stale_epoch");
                bail!("{node} announced epoch {epoch}, but this daemon knows epoch {known}");
            }
            if let Some(leader) = daemon.leader() {
                // This daemon led an older epoch: its lease task steps it down.
                leader.depose();
            }
            match address.parse() {
                Ok(address) => super::election::follow(
                    daemon,
                    super::election::Leadership {
                        epoch,
                        node,
                        address,
                        succession: Vec::new(),
                    },
                ),
                Err(_) => bail!("{node} announced an unusable address {address:?}"),
            }
            let ack = Message::Ack {
                ok: true,
                reason: String::new(),
            };
            framing::write(&daemon.key, &mut stream, &ack, &[]).await
        }
        Message::WhichStep {
            run,
            world_size,
            rank,
        } => {
            let reply = match daemon.leader() {
                Some(leader) => leader.which_step(&run, world_size, rank).await?,
                None => not_leader(daemon),
            };
            framing::write(&daemon.key, &mut stream, &reply, &[]).await
        }
        Message::EventsRequest => {
            let reply = match daemon.leader() {
                Some(leader) => Message::Events(leader.events().await),
                None => not_leader(daemon),
            };
            framing::write(&daemon.key, &mut stream, &reply, &[]).await
        }
        Message::StatusRequest => {
            let (reply, payload) = match daemon.leader() {
                Some(leader) => wire::pack_status(&leader.status().await),
                None => (not_leader(daemon), Vec::new()),
            };
            framing::write(&daemon.key, &mut stream, &reply, &payload).await
        }
        other => bail!("unexpected first message {other:?}"),
    }
}

/// The answer of a daemon that does not lead to a question for the leader: who does.
fn not_leader(daemon: &Daemon) -> Message {
    let leadership = daemon.leadership.borrow();
    Message::NotLeader {
        epoch: leadership.epoch,
        leader: Some(leadership.address.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use lazarus_shared::wire::{Message, RollbackMark};
    use lazarus_shared::ChunkHash;
    use tokio::net::TcpListener;

    use super::serve;
    use crate::daemon::metrics::Cause;
    use crate::daemon::replica::{self, ReplicaSender};
    use crate::daemon::{testing, SLOT_CHUNK_BYTES};

    /// A buddy that applied a rollback refuses a replica whose sender's rank handed it over
    /// before that rollback (the sender had not heard of it yet): it is the abandoned
    /// trajectory's. One handed over after the rollback is held.
    #[tokio::test]
    async fn a_replica_handed_over_before_a_rollback_the_buddy_applied_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (daemon, _, _) = testing::follower(dir.path(), &[]).await;
        *daemon.rollback.lock().unwrap() = RollbackMark { epoch: 3, seq: 1 };
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(serve(daemon.clone(), listener));
        let data = vec![5u8; 4096];
        let hash = ChunkHash::of(&data);
        let send = |seq: u64| {
            let (daemon, data) = (daemon.clone(), data.clone());
            async move {
                let begin = Message::ReplicaBegin {
                    from_node: "n1".into(),
                    run: daemon.cfg.run.clone(),
                    rank: 0,
                    world_size: 2,
                    step: 79,
                    slot_bytes: data.len() as u64,
                    chunk_bytes: SLOT_CHUNK_BYTES,
                    tensors: Vec::new(),
                    blobs: Vec::new(),
                    rollback: RollbackMark { epoch: 3, seq },
                    chunking: Default::default(),
                };
                let mut sender = ReplicaSender::begin(&daemon, address, begin, &[]).await?;
                sender.data(0, hash, &data).await?;
                sender.end(vec![hash]).await
            }
        };
        let refused = || {
            daemon
                .metrics
                .peer_rejected
                .get_or_create(&Cause {
                    cause: "refused".into(),
                })
                .get()
        };

        assert!(send(0).await.is_err());
        for _ in 0..200 {
            if refused() == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(refused(), 1);
        assert!(replica::held(&daemon, 0, 79).unwrap().is_none());

        send(1).await.unwrap();
        let (_, meta) = replica::held(&daemon, 0, 79).unwrap().expect("held");
        assert_eq!(meta.chunks, [hash]);
    }
}
