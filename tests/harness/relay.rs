//! A fault-injecting TCP relay in front of every daemon's port, so a test can cut the network
//! between daemons and heal it, as a partition would.
//!
//! Node `i` listens on its own loopback address (`127.0.0.<i + 2>`) and its connections leave
//! from it, so the relay in front of a node knows which node every connection comes from. A
//! cut between two nodes holds their bytes in both directions, neither delivered nor dropped,
//! as a black-holed network does: connections stay open and go silent. When the cut heals,
//! the held bytes flow again, late, as TCP would retransmit them. (A connection made during
//! a cut is accepted by the relay at once and then goes silent; a real black hole would let
//! the connect itself time out.)

use std::collections::HashSet;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Node `i`'s own loopback address.
pub fn node_ip(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, i as u8 + 2))
}

#[derive(Debug, Default)]
struct Shared {
    /// Cut pairs of nodes, both orders.
    cuts: Mutex<HashSet<(usize, usize)>>,
    stop: AtomicBool,
}

impl Shared {
    fn cut(&self, from: Option<usize>, to: usize) -> bool {
        from.is_some_and(|from| {
            self.cuts
                .lock()
                .expect("not poisoned")
                .contains(&(from, to))
        })
    }
}

/// One relay per node; they stop when this is dropped.
#[derive(Debug)]
pub struct Relays {
    /// Where node `i` is reached (127.0.0.1), which is what it advertises.
    pub addresses: Vec<SocketAddr>,
    shared: Arc<Shared>,
}

impl Relays {
    /// A relay for each of `targets` (node `i`'s real listen address), on a free port.
    pub fn start(targets: &[SocketAddr]) -> Self {
        let shared = Arc::new(Shared::default());
        let mut addresses = Vec::new();
        for (to, target) in targets.iter().enumerate() {
            let listener = TcpListener::bind("127.0.0.1:0").expect("a relay port");
            listener.set_nonblocking(true).expect("non-blocking accept");
            addresses.push(listener.local_addr().expect("bound"));
            let (shared, target) = (shared.clone(), *target);
            std::thread::spawn(move || accept(listener, target, to, shared));
        }
        Self { addresses, shared }
    }

    /// Cuts `a` off from each of `others`, both ways.
    pub fn cut(&self, a: usize, others: &[usize]) {
        let mut cuts = self.shared.cuts.lock().expect("not poisoned");
        for b in others {
            cuts.insert((a, *b));
            cuts.insert((*b, a));
        }
    }

    /// Every cut heals; held bytes flow.
    pub fn heal(&self) {
        self.shared.cuts.lock().expect("not poisoned").clear();
    }
}

impl Drop for Relays {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

fn accept(listener: TcpListener, target: SocketAddr, to: usize, shared: Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        let (inbound, peer) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(error) if error.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(_) => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let from = match peer.ip() {
            IpAddr::V4(ip) if ip.octets()[..3] == [127, 0, 0] && ip.octets()[3] >= 2 => {
                Some(usize::from(ip.octets()[3]) - 2)
            }
            _ => None,
        };
        let Ok(outbound) = TcpStream::connect(target) else {
            continue;
        };
        let _ = inbound.set_nonblocking(false);
        for (reader, writer, source, sink) in [
            (inbound.try_clone(), outbound.try_clone(), from, Some(to)),
            (outbound.try_clone(), inbound.try_clone(), Some(to), from),
        ] {
            let (Ok(reader), Ok(writer)) = (reader, writer) else {
                continue;
            };
            let shared = shared.clone();
            std::thread::spawn(move || pump(reader, writer, source, sink, &shared));
        }
    }
}

/// Copies `reader` to `writer` while the pair is not cut; holds the bytes while it is.
fn pump(
    mut reader: TcpStream,
    mut writer: TcpStream,
    from: Option<usize>,
    to: Option<usize>,
    shared: &Shared,
) {
    let _ = reader.set_read_timeout(Some(Duration::from_millis(50)));
    // A receiver that stops reading must not hold this thread past the relays' end.
    let _ = writer.set_write_timeout(Some(Duration::from_secs(5)));
    let mut buffer = vec![0u8; 64 << 10];
    loop {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        if to.is_some_and(|to| shared.cut(from, to)) {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        match reader.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => {
                if writer.write_all(&buffer[..n]).is_err() {
                    break;
                }
            }
            Err(error) if matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => break,
        }
    }
    let _ = writer.shutdown(Shutdown::Write);
    let _ = reader.shutdown(Shutdown::Read);
}
