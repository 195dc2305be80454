//! The in-process communicator: N ranks as threads of one process, one channel per ordered pair
//! of ranks (FIFO, so the k-th message from rank s to rank d belongs to the k-th collective both
//! called). Host buffers are sent as they are; device buffers are downloaded, sent, and uploaded
//! on the receiving rank's GPU in its storage type (bf16 values survive the f32 round trip
//! exactly). Meant for tests and `gdn layer --cp N` on the CPU: every parallel code path runs
//! without NCCL or GPUs.
//!
//! The ranks take turns: one baton per group, held by the rank that computes and handed on only
//! while a rank waits for a message (and when it leaves). Ranks that share a GPU share its one
//! stream and its cuBLASLt workspace; running one at a time between collectives keeps one rank's
//! multi-kernel operations (a split-K GEMM and its reduction over the shared workspace) from
//! being interleaved with another's on that stream.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::comm::{check_a2a, copy_range, host_like, Communicator};
use super::grid::Grid;
use crate::backend::Act;
use crate::error::{GdnError, Result};

/// How long a rank waits for another's message before failing (a rank that errors out drops its
/// channels, which the others see at once; this bounds a rank that hangs).
const TIMEOUT: Duration = Duration::from_secs(600);

/// The group's turn: `true` while a rank holds it.
#[derive(Default)]
struct Baton {
    taken: Mutex<bool>,
    cv: Condvar,
}

impl Baton {
    fn take(&self) {
        let mut t = self.taken.lock().unwrap_or_else(|p| p.into_inner());
        while *t {
            t = self.cv.wait(t).unwrap_or_else(|p| p.into_inner());
        }
        *t = true;
    }
    fn give(&self) {
        *self.taken.lock().unwrap_or_else(|p| p.into_inner()) = false;
        self.cv.notify_one();
    }
}

/// One rank of an in-process group (made by [`InProc::group`]).
pub struct InProc {
    rank: usize,
    size: usize,
    baton: Arc<Baton>,
    /// Whether this rank's thread holds the baton (shared by the groups of one thread, see
    /// [`InProc::grid`]).
    holding: Arc<AtomicBool>,
    /// `to[d]`: the channel from this rank to rank `d`.
    to: Vec<Sender<Vec<f32>>>,
    /// `from[s]`: the channel from rank `s` to this rank.
    from: Vec<Mutex<Receiver<Vec<f32>>>>,
}

impl std::fmt::Debug for InProc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "InProc(rank {} of {})", self.rank, self.size)
    }
}

impl InProc {
    /// `n` connected ranks, rank `i` at index `i`; hand each to its own thread.
    pub fn group(n: usize) -> Result<Vec<InProc>> {
        if n == 0 {
            return Err(GdnError::Invalid(
                "an in-process group needs at least 1 rank".into(),
            ));
        }
        let baton = Arc::new(Baton::default());
        let holding: Vec<Arc<AtomicBool>> = (0..n).map(|_| Arc::default()).collect();
        Ok(Self::connect(&baton, &holding))
    }

    /// `dp x cp` ranks of one process as a grid (Megatron's order, CP innermost): world rank
    /// `w = d cp + c` is rank `c` of the context-parallel group `d` (its `cp` ranks hold the same
    /// micro-batches) and rank `d` of the data-parallel group `c`. Returns `(dp group, cp group)`
    /// per world rank, in world-rank order. All groups share one baton, so the threads still take
    /// turns, and a thread waiting in either group hands the turn on.
    pub fn grid(dp: usize, cp: usize) -> Result<Vec<(InProc, InProc)>> {
        if dp == 0 || cp == 0 {
            return Err(GdnError::Invalid(format!(
                "an in-process grid needs at least 1 x 1 ranks, got dp {dp} x cp {cp}"
            )));
        }
        let baton = Arc::new(Baton::default());
        let holding: Vec<Arc<AtomicBool>> = (0..dp * cp).map(|_| Arc::default()).collect();
        let mut cps: Vec<Option<InProc>> = Vec::with_capacity(dp * cp);
        for d in 0..dp {
            let h: Vec<_> = (0..cp).map(|c| holding[d * cp + c].clone()).collect();
            cps.extend(Self::connect(&baton, &h).into_iter().map(Some));
        }
        let mut dps: Vec<Option<InProc>> = (0..dp * cp).map(|_| None).collect();
        for c in 0..cp {
            let h: Vec<_> = (0..dp).map(|d| holding[d * cp + c].clone()).collect();
            for (d, g) in Self::connect(&baton, &h).into_iter().enumerate() {
                dps[d * cp + c] = Some(g);
            }
        }
        Ok(dps
            .into_iter()
            .zip(cps)
            .map(|(d, c)| (d.expect("every rank"), c.expect("every rank")))
            .collect())
    }

    /// One group of `holding.len()` ranks (rank `i` uses `holding[i]`) under `baton`.
    fn connect(baton: &Arc<Baton>, holding: &[Arc<AtomicBool>]) -> Vec<InProc> {
        let n = holding.len();
        // tx[s][d], rx[d][s]
        let mut tx: Vec<Vec<Sender<Vec<f32>>>> = (0..n).map(|_| Vec::new()).collect();
        let mut rx: Vec<Vec<Option<Receiver<Vec<f32>>>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for s in 0..n {
            for d in 0..n {
                let (t, r) = channel();
                tx[s].push(t);
                rx[d][s] = Some(r);
            }
        }
        tx.into_iter()
            .zip(rx)
            .enumerate()
            .map(|(rank, (to, from))| InProc {
                rank,
                size: n,
                baton: baton.clone(),
                holding: holding[rank].clone(),
                to,
                from: from
                    .into_iter()
                    .map(|r| Mutex::new(r.expect("every pair has a channel")))
                    .collect(),
            })
            .collect()
    }

    fn send(&self, dest: usize, v: Vec<f32>) -> Result<()> {
        self.to[dest].send(v).map_err(|_| {
            GdnError::Invalid(format!(
                "in-process rank {}: rank {dest} has left the group",
                self.rank
            ))
        })
    }

    /// Start computing: wait for the group's turn (once per rank; [`run_ranks`] does it).
    pub fn enter(&self) {
        if !self.holding.swap(true, Ordering::SeqCst) {
            self.baton.take();
        }
    }

    fn recv(&self, src: usize) -> Result<Vec<f32>> {
        let rx = self.from[src]
            .lock()
            .map_err(|_| GdnError::Invalid("in-process channel poisoned".into()))?;
        // Hand the turn on while waiting; take it back before computing again.
        let held = self.holding.swap(false, Ordering::SeqCst);
        if held {
            self.baton.give();
        }
        let r = rx.recv_timeout(TIMEOUT);
        if held {
            self.baton.take();
            self.holding.store(true, Ordering::SeqCst);
        }
        r.map_err(|e| {
            GdnError::Invalid(match e {
                RecvTimeoutError::Timeout => format!(
                    "in-process rank {}: no message from rank {src} in {} s",
                    self.rank,
                    TIMEOUT.as_secs()
                ),
                RecvTimeoutError::Disconnected => format!(
                    "in-process rank {}: rank {src} has left the group (it failed or returned early)",
                    self.rank
                ),
            })
        })
    }
}

impl Drop for InProc {
    fn drop(&mut self) {
        if self.holding.swap(false, Ordering::SeqCst) {
            self.baton.give();
        }
    }
}

/// Host copy of a buffer's values (downloads a device buffer).
fn host_values(x: &Act) -> Result<Vec<f32>> {
    match x {
        Act::Host(v) => Ok(v.clone()),
        Act::Dev(d) => d.download(),
    }
}

impl Communicator for InProc {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn kind(&self) -> &'static str {
        "in-process"
    }

    fn all_to_all(&self, send: &Act, send_counts: &[usize], recv_counts: &[usize]) -> Result<Act> {
        check_a2a(self, send, send_counts, recv_counts)?;
        let all = host_values(send)?;
        let mut off = 0;
        for (d, &c) in send_counts.iter().enumerate() {
            self.send(d, all[off..off + c].to_vec())?;
            off += c;
        }
        let mut out = Vec::with_capacity(recv_counts.iter().sum());
        for (s, &c) in recv_counts.iter().enumerate() {
            let v = self.recv(s)?;
            if v.len() != c {
                return Err(GdnError::Invalid(format!(
                    "all_to_all: rank {} expected {c} values from rank {s}, got {}",
                    self.rank,
                    v.len()
                )));
            }
            out.extend_from_slice(&v);
        }
        host_like(send, out)
    }

    fn all_gather(&self, x: &Act) -> Result<Vec<Act>> {
        let v = host_values(x)?;
        for d in 0..self.size {
            self.send(d, v.clone())?;
        }
        let mut out = Vec::with_capacity(self.size);
        for s in 0..self.size {
            let r = self.recv(s)?;
            if r.len() != v.len() {
                return Err(GdnError::Invalid(format!(
                    "all_gather: rank {} has {} values, rank {s} {}",
                    self.rank,
                    v.len(),
                    r.len()
                )));
            }
            out.push(host_like(x, r)?);
        }
        Ok(out)
    }

    fn broadcast(&self, x: &mut Act, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(GdnError::Invalid(format!(
                "broadcast: root {root} of {} ranks",
                self.size
            )));
        }
        if self.rank == root {
            let v = host_values(x)?;
            for d in (0..self.size).filter(|&d| d != root) {
                self.send(d, v.clone())?;
            }
            return Ok(());
        }
        let r = self.recv(root)?;
        if r.len() != x.len() {
            return Err(GdnError::Invalid(format!(
                "broadcast: rank {} has {} values, root {root} sent {}",
                self.rank,
                x.len(),
                r.len()
            )));
        }
        let n = r.len();
        let src = host_like(x, r)?;
        copy_range(x, 0, &src, 0, n)
    }

    fn barrier(&self) -> Result<()> {
        self.all_gather(&Act::Host(Vec::new())).map(|_| ())
    }
}

/// Run `f` on `n` in-process ranks (one thread each, taking turns between collectives) and return
/// their results in rank order; the first error (lowest rank) if any failed.
pub fn run_ranks<T, F>(n: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Arc<dyn Communicator>) -> Result<T> + Sync,
{
    let group = InProc::group(n)?;
    on_threads(group, |c| {
        c.enter();
        let c: Arc<dyn Communicator> = Arc::new(c);
        f(c)
    })
}

/// Run `f` on a `dp x cp` in-process grid ([`InProc::grid`]; one thread per rank, taking turns
/// between collectives) and return the results in world-rank order; the first error (lowest
/// rank) if any failed.
pub fn run_grid<T, F>(dp: usize, cp: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(Grid) -> Result<T> + Sync,
{
    let grid = InProc::grid(dp, cp)?;
    on_threads(grid, |(d, c)| {
        d.enter();
        f(Grid {
            dp: Arc::new(d),
            cp: Arc::new(c),
        })
    })
}

/// `f` on one scoped thread per rank's item; the results in item order, the first error (lowest
/// rank) if any failed, a panicking rank as an error.
fn on_threads<I, T, F>(items: Vec<I>, f: F) -> Result<Vec<T>>
where
    I: Send,
    T: Send,
    F: Fn(I) -> Result<T> + Sync,
{
    let f = &f;
    let results: Vec<Result<T>> = std::thread::scope(|s| {
        let handles: Vec<_> = items.into_iter().map(|x| s.spawn(move || f(x))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(GdnError::Invalid("an in-process rank panicked".into()))
                })
            })
            .collect()
    });
    results.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::{all_reduce_sum_host, Communicator};

    #[test]
    fn all_to_all_with_uneven_splits() {
        // Rank r sends (r+1)*(d+1) values to rank d, each value 100r + d + k/1000.
        let out = run_ranks(3, |c| {
            let r = c.rank();
            let counts: Vec<usize> = (0..3).map(|d| (r + 1) * (d + 1)).collect();
            let mut send = Vec::new();
            for (d, &n) in counts.iter().enumerate() {
                for k in 0..n {
                    send.push(100.0 * r as f32 + d as f32 + k as f32 / 1000.0);
                }
            }
            let recv_counts: Vec<usize> = (0..3).map(|s| (s + 1) * (r + 1)).collect();
            c.all_to_all(&Act::Host(send), &counts, &recv_counts)?
                .into_host()
        })
        .unwrap();
        for (r, got) in out.iter().enumerate() {
            let mut want = Vec::new();
            for s in 0..3 {
                for k in 0..(s + 1) * (r + 1) {
                    want.push(100.0 * s as f32 + r as f32 + k as f32 / 1000.0);
                }
            }
            assert_eq!(got, &want, "rank {r}");
        }
    }

    #[test]
    fn all_reduce_adds_in_rank_order_on_every_rank() {
        // Values whose f32 sum depends on the order: 1e8, 1, -1e8, 1 ... in rank order the sum
        // is ((1e8 + 1) - 1e8) + 1 = 1 (1e8 + 1 rounds to 1e8); another order gives other bits.
        let vals = [1e8f32, 1.0, -1e8, 1.0];
        let out = run_ranks(4, |c| {
            let mut v = vec![vals[c.rank()], c.rank() as f32];
            all_reduce_sum_host(c.as_ref(), &mut v)?;
            Ok(v)
        })
        .unwrap();
        let mut want0 = 0.0f32;
        for v in vals {
            want0 = if want0 == 0.0 { v } else { want0 + v };
        }
        for v in &out {
            assert_eq!(v[0].to_bits(), want0.to_bits());
            assert_eq!(v[1], 6.0);
        }
        assert_eq!(want0, 1.0);
    }

    #[test]
    fn gather_broadcast_barrier() {
        let out = run_ranks(3, |c| {
            let g = c.all_gather(&Act::Host(vec![c.rank() as f32; 2]))?;
            let g: Vec<Vec<f32>> = g
                .into_iter()
                .map(|a| a.into_host())
                .collect::<Result<_>>()?;
            let mut b = Act::Host(vec![c.rank() as f32 * 10.0 + 1.0; 3]);
            c.broadcast(&mut b, 2)?;
            c.barrier()?;
            Ok((g, b.into_host()?))
        })
        .unwrap();
        for (g, b) in out {
            assert_eq!(g, vec![vec![0.0; 2], vec![1.0; 2], vec![2.0; 2]]);
            assert_eq!(b, vec![21.0; 3]);
        }
    }

    #[test]
    fn bad_counts_and_a_failed_rank_are_errors() {
        let c = &InProc::group(1).unwrap()[0];
        assert!(c
            .all_to_all(&Act::Host(vec![0.0; 3]), &[2], &[3])
            .unwrap_err()
            .to_string()
            .contains("send counts add up to 2"));
        assert!(c
            .all_to_all(&Act::Host(vec![0.0; 3]), &[3, 0], &[3])
            .is_err());
        // Rank 1 returns at once; rank 0's collective fails instead of hanging.
        let r = run_ranks(2, |c| {
            if c.rank() == 1 {
                return Ok(());
            }
            c.all_gather(&Act::Host(vec![1.0]))?;
            c.all_gather(&Act::Host(vec![1.0])).map(|_| ())
        });
        let e = r.unwrap_err().to_string();
        assert!(e.contains("has left the group"), "{e}");
    }
}
