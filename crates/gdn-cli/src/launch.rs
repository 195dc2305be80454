//! `gdn launch --nproc-per-node N -- <gdn args>`: N processes of this binary on one machine, as
//! torchrun starts them: each gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`, and always `NCCL_NVLS_ENABLE=0` (NVLink multicast stays off).
//! Their output is forwarded line by line with a `[rank i]` prefix; when one exits with a failure
//! the others are stopped and its exit status is returned.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

/// Arguments of `gdn launch`.
#[derive(Args, Debug)]
pub struct LaunchArgs {
    /// Processes to start on this machine (one per GPU: rank i uses cuda:i).
    #[arg(long, value_name = "N")]
    pub nproc_per_node: usize,
    /// Address of rank 0 (the rendezvous).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of rank 0 (the rendezvous).
    #[arg(long, value_name = "PORT", default_value_t = 29500)]
    pub master_port: u16,
    /// The gdn command each process runs, after `--` (e.g. `-- train --dp 2 --device cuda`).
    #[arg(last = true, required = true, value_name = "GDN ARGS")]
    pub args: Vec<String>,
}

/// A child failed: gdn launch exits with its status.
#[derive(Debug)]
pub struct ChildFailed {
    pub rank: usize,
    pub code: u8,
}

impl std::fmt::Display for ChildFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} failed (exit status {}); the other ranks were stopped",
            self.rank, self.code
        )
    }
}

impl std::error::Error for ChildFailed {}

fn code_of(s: ExitStatus) -> u8 {
    if let Some(c) = s.code() {
        return u8::try_from(c).unwrap_or(1).max(1);
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = s.signal() {
            return u8::try_from(128 + sig).unwrap_or(1);
        }
    }
    1
}

fn forward(rank: usize, r: impl std::io::Read + Send + 'static, err: bool) {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            if err {
                errln!("[rank {rank}] {line}");
            } else {
                outln!("[rank {rank}] {line}");
            }
        }
    });
}

pub fn run(a: LaunchArgs) -> Result<()> {
    if a.nproc_per_node == 0 {
        bail!("--nproc-per-node 0: start at least one process");
    }
    if a.args.first().map(String::as_str) == Some("launch") {
        bail!("gdn launch -- launch ...: the processes would launch again");
    }
    if uses_cuda(&a.args) {
        let gpus = gdn::device::cuda::device_count();
        if a.nproc_per_node > gpus {
            bail!(
                "--nproc-per-node {}: the ranks use one GPU each (--device cuda) and this machine has {gpus} CUDA GPUs",
                a.nproc_per_node
            );
        }
    }
    let exe = std::env::current_exe().context("finding the gdn binary to start")?;
    let n = a.nproc_per_node;
    let mut children: Vec<Child> = Vec::with_capacity(n);
    for rank in 0..n {
        let spawned = Command::new(&exe)
            .args(&a.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", &a.master_addr)
            .env("MASTER_PORT", a.master_port.to_string())
            .env("NCCL_NVLS_ENABLE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut c = match spawned {
            Ok(c) => c,
            Err(e) => {
                stop(&mut children);
                return Err(e).with_context(|| format!("starting rank {rank} ({})", exe.display()));
            }
        };
        if let Some(o) = c.stdout.take() {
            forward(rank, o, false);
        }
        if let Some(e) = c.stderr.take() {
            forward(rank, e, true);
        }
        children.push(c);
    }
    let mut done = vec![false; n];
    loop {
        for rank in 0..n {
            if done[rank] {
                continue;
            }
            if let Some(s) = children[rank].try_wait().context("waiting for a rank")? {
                done[rank] = true;
                if !s.success() {
                    stop(&mut children);
                    // Give the forwarding threads a moment to print the last lines.
                    std::thread::sleep(Duration::from_millis(200));
                    return Err(ChildFailed {
                        rank,
                        code: code_of(s),
                    }
                    .into());
                }
            }
        }
        if done.iter().all(|&d| d) {
            std::thread::sleep(Duration::from_millis(100));
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether the command runs on a GPU (`--device cuda[:N]` or `--device=cuda[:N]`).
fn uses_cuda(args: &[String]) -> bool {
    args.iter().enumerate().any(|(i, a)| {
        a.strip_prefix("--device=")
            .is_some_and(|d| d.starts_with("cuda"))
            || (a == "--device" && args.get(i + 1).is_some_and(|d| d.starts_with("cuda")))
    })
}

/// Stop every child still running (each by its own handle) and reap it.
fn stop(children: &mut [Child]) {
    for c in children.iter_mut() {
        if let Ok(None) = c.try_wait() {
            let _ = c.kill();
        }
    }
    for c in children.iter_mut() {
        let _ = c.wait();
    }
}
