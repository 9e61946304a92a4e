//! Hands NCCL's 128-byte unique id from rank 0 to the other ranks at `MASTER_ADDR:MASTER_PORT`, as
//! torchrun's store does. Only the id travels here; every collective runs in NCCL.
//!
//! Each rank says who it is first (a fixed greeting and its rank), so that a stray connection to the
//! port (a port scanner, a health probe) neither takes a rank's place nor receives the id, and rank
//! 0 waits for the others for a bounded time.

use std::collections::HashSet;
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::DistError;

/// How long ranks wait for each other to appear.
const WAIT: Duration = Duration::from_secs(300);
/// How long an accepted connection may take to greet.
const GREETING_WAIT: Duration = Duration::from_secs(5);
/// Connections whose greeting is awaited at once; more are closed at once.
const MAX_GREETING: usize = 64;
/// What a rank sends before its rank number (little-endian u32).
const GREETING: &[u8; 16] = b"cotrain-nccl-id1";

/// Rank 0: serves `id` to ranks 1..world on `addr:port`, each once, within `WAIT`.
pub fn serve(addr: &str, port: u16, id: &[u8; 128], world: usize) -> Result<(), DistError> {
    let listener = TcpListener::bind((addr, port)).or_else(|_| TcpListener::bind(("0.0.0.0", port))).map_err(|e| {
        DistError(format!("rank 0 cannot listen on {addr}:{port} (MASTER_ADDR:MASTER_PORT) to hand out the NCCL id: {e}"))
    })?;
    serve_on(listener, id, world, WAIT)
}

fn serve_on(
    listener: TcpListener,
    id: &[u8; 128],
    world: usize,
    wait: Duration,
) -> Result<(), DistError> {
    let (addr, port) = listener
        .local_addr()
        .map(|a| (a.ip().to_string(), a.port()))
        .map_err(|e| DistError(e.to_string()))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| DistError(format!("{addr}:{port}: {e}")))?;
    let start = Instant::now();
    let mut served = HashSet::new();
    // Greetings are read on threads of their own, so a connection that says nothing delays no rank.
    let (greeted, greetings) =
        std::sync::mpsc::channel::<(std::net::SocketAddr, Result<(usize, TcpStream), String>)>();
    let mut greeting_now = 0usize;
    while served.len() + 1 < world {
        let mut idle = true;
        while let Ok((peer, result)) = greetings.try_recv() {
            idle = false;
            greeting_now -= 1;
            match result {
                Ok((rank, mut s)) if served.insert(rank) => {
                    s.write_all(id).map_err(|e| {
                        DistError(format!("sending the NCCL id to rank {rank}: {e}"))
                    })?;
                }
                Ok((rank, _)) => {
                    tracing::warn!(%peer, rank, "a second connection claims a rank already served; ignored")
                }
                Err(why) => {
                    tracing::warn!(%peer, why, "a connection to the NCCL rendezvous that is not a rank; ignored")
                }
            }
        }
        match listener.accept() {
            Ok((_, peer)) if greeting_now >= MAX_GREETING => {
                tracing::warn!(%peer, "{MAX_GREETING} connections to the NCCL rendezvous are already greeting; this one is closed");
            }
            Ok((s, peer)) => {
                idle = false;
                greeting_now += 1;
                let greeted = greeted.clone();
                std::thread::spawn(move || {
                    let _ = greeted.send((peer, greeting(s, world)));
                });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => return Err(DistError(format!("accepting a rank on {addr}:{port}: {e}"))),
        }
        if start.elapsed() > wait {
            let missing: Vec<usize> = (1..world).filter(|r| !served.contains(r)).collect();
            return Err(DistError(format!(
                "ranks {missing:?} did not reach rank 0 at {addr}:{port} (MASTER_ADDR:MASTER_PORT) within {wait:?}"
            )));
        }
        if idle {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    Ok(())
}

/// Reads an accepted connection's greeting: its rank, if it is one of 1..world.
fn greeting(mut s: TcpStream, world: usize) -> Result<(usize, TcpStream), String> {
    s.set_nonblocking(false)
        .and_then(|_| s.set_read_timeout(Some(GREETING_WAIT)))
        .map_err(|e| e.to_string())?;
    let mut buf = [0u8; 20];
    s.read_exact(&mut buf)
        .map_err(|e| format!("no greeting: {e}"))?;
    if &buf[..16] != GREETING {
        return Err("wrong greeting".into());
    }
    let rank = u32::from_le_bytes(buf[16..].try_into().expect("4 bytes")) as usize;
    if rank == 0 || rank >= world {
        return Err(format!("rank {rank} is not in 1..{world}"));
    }
    Ok((rank, s))
}

/// Rank `rank` (≥ 1): fetches the id from rank 0, retrying until it listens.
pub fn fetch(addr: &str, port: u16, rank: usize) -> Result<[u8; 128], DistError> {
    let start = Instant::now();
    loop {
        match TcpStream::connect((addr, port)) {
            Ok(mut s) => {
                let mut hello = GREETING.to_vec();
                hello.extend((rank as u32).to_le_bytes());
                let mut id = [0u8; 128];
                s.write_all(&hello)
                    .and_then(|_| s.read_exact(&mut id))
                    .map_err(|e| {
                        DistError(format!("fetching the NCCL id from {addr}:{port}: {e}"))
                    })?;
                return Ok(id);
            }
            Err(e) if start.elapsed() > WAIT => {
                return Err(DistError(format!(
                    "rank 0 did not appear at {addr}:{port} (MASTER_ADDR:MASTER_PORT) within {WAIT:?}: {e}"
                )));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stray connection takes no rank's place, and rank 0 gives up on a missing rank in time,
    /// naming it.
    #[test]
    fn strays_are_ignored_and_a_missing_rank_is_named() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let id = [7u8; 128];
        let server = std::thread::spawn(move || serve_on(listener, &id, 3, Duration::from_secs(3)));
        // A stray: connects, says nothing useful, leaves.
        let stray = TcpStream::connect(("127.0.0.1", port)).unwrap();
        (&stray).write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        // Two that connect and say nothing at all: their greeting wait delays no rank.
        let silent = [
            TcpStream::connect(("127.0.0.1", port)).unwrap(),
            TcpStream::connect(("127.0.0.1", port)).unwrap(),
        ];
        let asked = Instant::now();
        assert_eq!(
            fetch("127.0.0.1", port, 1).unwrap(),
            id,
            "rank 1 still gets the id"
        );
        assert!(
            asked.elapsed() < GREETING_WAIT,
            "rank 1 waited behind silent connections: {:?}",
            asked.elapsed()
        );
        drop(silent);
        // Rank 2 never comes.
        let e = server.join().unwrap().unwrap_err().to_string();
        assert!(e.contains("ranks [2] did not reach rank 0"), "{e}");
    }
}
