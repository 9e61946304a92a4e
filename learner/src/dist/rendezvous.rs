//! Hands NCCL's 128-byte unique id from rank 0 to the other ranks at `MASTER_ADDR:MASTER_PORT`, as
//! torchrun's store does. Only the id travels here; every collective runs in NCCL.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::DistError;

/// How long ranks wait for each other to appear.
const WAIT: Duration = Duration::from_secs(300);

/// Rank 0: serves `id` to `peers` connections on `addr:port`.
pub fn serve(addr: &str, port: u16, id: &[u8; 128], peers: usize) -> Result<(), DistError> {
    let listener = TcpListener::bind((addr, port)).or_else(|_| TcpListener::bind(("0.0.0.0", port))).map_err(|e| {
        DistError(format!("rank 0 cannot listen on {addr}:{port} (MASTER_ADDR:MASTER_PORT) to hand out the NCCL id: {e}"))
    })?;
    for _ in 0..peers {
        let (mut s, _) = listener.accept().map_err(|e| DistError(format!("accepting a rank on {addr}:{port}: {e}")))?;
        s.write_all(id).map_err(|e| DistError(format!("sending the NCCL id: {e}")))?;
    }
    Ok(())
}

/// Other ranks: fetches the id from rank 0, retrying until it listens.
pub fn fetch(addr: &str, port: u16) -> Result<[u8; 128], DistError> {
    let start = Instant::now();
    loop {
        match TcpStream::connect((addr, port)) {
            Ok(mut s) => {
                let mut id = [0u8; 128];
                s.read_exact(&mut id).map_err(|e| DistError(format!("reading the NCCL id from {addr}:{port}: {e}")))?;
                return Ok(id);
            }
            Err(e) if start.elapsed() > WAIT => {
                return Err(DistError(format!("rank 0 did not appear at {addr}:{port} (MASTER_ADDR:MASTER_PORT) within {WAIT:?}: {e}")));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}
