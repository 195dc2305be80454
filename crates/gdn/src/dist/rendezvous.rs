//! A small TCP rendezvous: rank 0 listens on `MASTER_ADDR:MASTER_PORT`, every other rank connects
//! (retrying until a timeout) and sends its rank; once all have connected rank 0 sends each the
//! same payload (the NCCL unique id) and the ranks go on. Errors name the address, the rank and
//! what was waited for.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{GdnError, Result};

const MAGIC: &[u8; 8] = b"gdn-rdzv";

fn io_err(what: String) -> impl Fn(std::io::Error) -> GdnError {
    move |e| GdnError::Device(format!("rendezvous: {what}: {e}"))
}

/// Share `payload` (made by rank 0 only) with every rank of `world` through `addr:port`; returns
/// it on every rank. Rank 0 waits up to `timeout` for all the others to connect; the others retry
/// connecting until `timeout`.
pub fn share(
    addr: &str,
    port: u16,
    rank: usize,
    world: usize,
    timeout: Duration,
    payload: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    if world <= 1 {
        return payload();
    }
    let deadline = Instant::now() + timeout;
    if rank == 0 {
        let bind = format!("{addr}:{port}");
        let l = TcpListener::bind(&bind).map_err(io_err(format!(
            "rank 0 cannot listen on {bind} (MASTER_ADDR:MASTER_PORT; is the port in use?)"
        )))?;
        l.set_nonblocking(true)
            .map_err(io_err("set_nonblocking".into()))?;
        let data = payload()?;
        let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        let mut joined = 1;
        while joined < world {
            match l.accept() {
                Ok((mut s, _)) => {
                    s.set_nonblocking(false)
                        .map_err(io_err("set_nonblocking".into()))?;
                    s.set_read_timeout(Some(Duration::from_secs(30)))
                        .map_err(io_err("set_read_timeout".into()))?;
                    let mut hello = [0u8; 16];
                    s.read_exact(&mut hello)
                        .map_err(io_err("reading a rank's hello".into()))?;
                    if &hello[..8] != MAGIC {
                        continue; // not one of ours
                    }
                    let r = u64::from_le_bytes(hello[8..16].try_into().expect("8 bytes")) as usize;
                    if r == 0 || r >= world || peers[r].is_some() {
                        return Err(GdnError::Device(format!(
                            "rendezvous on {bind}: a peer says it is rank {r} (world size {world}; duplicate or out of range)"
                        )));
                    }
                    peers[r] = Some(s);
                    joined += 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() > deadline {
                        let missing: Vec<usize> =
                            (1..world).filter(|&r| peers[r].is_none()).collect();
                        return Err(GdnError::Device(format!(
                            "rendezvous on {bind}: ranks {missing:?} did not connect within {} s",
                            timeout.as_secs()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(io_err(format!("accepting on {bind}"))(e)),
            }
        }
        for (r, s) in peers.iter_mut().enumerate().skip(1) {
            let s = s.as_mut().expect("every rank joined");
            let mut msg = (data.len() as u64).to_le_bytes().to_vec();
            msg.extend_from_slice(&data);
            s.write_all(&msg)
                .map_err(io_err(format!("sending the id to rank {r}")))?;
        }
        return Ok(data);
    }
    let target = format!("{addr}:{port}");
    let mut last = String::new();
    loop {
        let addrs = target
            .to_socket_addrs()
            .map_err(io_err(format!("resolving {target}")))?;
        for a in addrs {
            match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
                Ok(mut s) => {
                    let mut hello = MAGIC.to_vec();
                    hello.extend_from_slice(&(rank as u64).to_le_bytes());
                    s.write_all(&hello)
                        .map_err(io_err(format!("rank {rank} saying hello to {target}")))?;
                    let left = deadline.saturating_duration_since(Instant::now());
                    s.set_read_timeout(Some(left.max(Duration::from_secs(1))))
                        .map_err(io_err("set_read_timeout".into()))?;
                    let mut len = [0u8; 8];
                    s.read_exact(&mut len).map_err(io_err(format!(
                        "rank {rank} waiting for rank 0 on {target} to send the id"
                    )))?;
                    let n = u64::from_le_bytes(len) as usize;
                    if n > 1 << 20 {
                        return Err(GdnError::Device(format!(
                            "rendezvous: {target} sent a {n}-byte payload (not a gdn rank 0?)"
                        )));
                    }
                    let mut data = vec![0u8; n];
                    s.read_exact(&mut data)
                        .map_err(io_err(format!("rank {rank} reading the id from {target}")))?;
                    return Ok(data);
                }
                Err(e) => last = e.to_string(),
            }
        }
        if Instant::now() > deadline {
            return Err(GdnError::Device(format!(
                "rendezvous: rank {rank} could not reach rank 0 at {target} within {} s (last error: {last}); check MASTER_ADDR / MASTER_PORT and that rank 0 is running",
                timeout.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn every_rank_gets_rank_zeros_payload() {
        let port = free_port();
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    s.spawn(move || {
                        share("127.0.0.1", port, r, 3, Duration::from_secs(20), || {
                            Ok(vec![7, 8, 9])
                        })
                        .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, vec![vec![7, 8, 9]; 3]);
    }

    #[test]
    fn missing_ranks_time_out_with_a_clear_error() {
        let port = free_port();
        let e = share("127.0.0.1", port, 0, 2, Duration::from_millis(300), || {
            Ok(vec![1])
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("ranks [1] did not connect"), "{e}");
        let port = free_port();
        let e = share("127.0.0.1", port, 1, 2, Duration::from_millis(300), || {
            panic!("only rank 0 makes the payload")
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("could not reach rank 0"), "{e}");
    }
}
