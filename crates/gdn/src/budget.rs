//! Memory budget: refuse, before allocating, what cannot fit.
//!
//! Sizes computed from user input (config dimensions, token counts) are turned into bytes with
//! `u128` arithmetic (no overflow for any `usize` inputs), then compared with what the machine
//! has: `MemAvailable` of `/proc/meminfo` (or `MemTotal`), lowered to the cgroup's
//! `memory.max` headroom where one is set. Where none of that can be read, only the address
//! space limit (`isize::MAX` bytes, the most one allocation may hold) applies.

use crate::error::{GdnError, Result};

/// The most bytes one allocation can hold (`isize::MAX`).
pub const MAX_ALLOC_BYTES: u128 = isize::MAX as u128;

/// `a * b` in `u128`, saturating at `u128::MAX` (which reads as "at least that").
pub fn mul(a: u128, b: u128) -> u128 {
    a.saturating_mul(b)
}

/// Product of `dims` as bytes of `elem` bytes each, saturating.
pub fn bytes_of(dims: &[usize], elem: usize) -> u128 {
    dims.iter()
        .fold(elem as u128, |acc, &d| mul(acc, d as u128))
}

/// `MemAvailable` (else `MemTotal`) of a `/proc/meminfo` text, in bytes, with the key used.
pub fn parse_meminfo(text: &str) -> Option<(u128, &'static str)> {
    let field = |key: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(key)?.strip_prefix(':')?.trim();
            let kib = rest.strip_suffix("kB").unwrap_or(rest).trim();
            kib.parse::<u128>().ok().map(|k| k * 1024)
        })
    };
    field("MemAvailable")
        .map(|b| (b, "MemAvailable"))
        .or_else(|| field("MemTotal").map(|b| (b, "MemTotal")))
}

/// Bytes of host memory available to this process, and where that number comes from; `None`
/// where nothing can be read (then only [`MAX_ALLOC_BYTES`] applies).
pub fn host_available() -> Option<(u128, String)> {
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| parse_meminfo(&t));
    // cgroup v2: memory.max ("max" when unlimited) minus memory.current.
    let cgroup = (|| {
        let max = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok()?;
        let max: u128 = max.trim().parse().ok()?;
        let cur: u128 = std::fs::read_to_string("/sys/fs/cgroup/memory.current")
            .ok()
            .and_then(|c| c.trim().parse().ok())
            .unwrap_or(0);
        Some(max.saturating_sub(cur))
    })();
    match (mem, cgroup) {
        (Some((m, _)), Some(c)) if c < m => Some((
            c,
            "available to this process (cgroup memory.max - memory.current)".into(),
        )),
        (Some((m, key)), _) => Some((
            m,
            format!("available on this machine ({key}, /proc/meminfo)"),
        )),
        (None, Some(c)) => Some((
            c,
            "available to this process (cgroup memory.max - memory.current)".into(),
        )),
        (None, None) => None,
    }
}

/// Error unless `needed` bytes fit in one allocation ([`MAX_ALLOC_BYTES`]). Pure: no system
/// query (for `validate()`).
pub fn check_addressable(what: &str, needed: u128) -> Result<()> {
    if needed > MAX_ALLOC_BYTES {
        return Err(GdnError::Memory {
            what: what.to_string(),
            needed,
            available: MAX_ALLOC_BYTES,
            limit: "a process can address (isize::MAX)".into(),
        });
    }
    Ok(())
}

/// Error unless `needed` bytes of host memory are addressable and available now (see
/// [`host_available`]). Call it before allocating what a config or a token count sizes.
pub fn check_host(what: &str, needed: u128) -> Result<()> {
    check_addressable(what, needed)?;
    if let Some((available, limit)) = host_available() {
        if needed > available {
            return Err(GdnError::Memory {
                what: what.to_string(),
                needed,
                available,
                limit,
            });
        }
    }
    Ok(())
}

/// Error unless `needed` bytes are free on `gpu` now (the driver's free memory).
pub fn check_gpu(gpu: &crate::backend::cuda::Gpu, what: &str, needed: u128) -> Result<()> {
    let (free, _total) = gpu.mem_info()?;
    if needed > free as u128 {
        return Err(GdnError::Memory {
            what: what.to_string(),
            needed,
            available: free as u128,
            limit: format!("free on cuda:{} ({})", gpu.ordinal(), gpu.name()),
        });
    }
    Ok(())
}

/// A zeroed `Vec<f32>` of `n` values, or a [`GdnError::Memory`] error if the allocator refuses
/// (no abort).
pub fn try_zeros(what: &str, n: usize) -> Result<Vec<f32>> {
    let mut v: Vec<f32> = Vec::new();
    v.try_reserve_exact(n).map_err(|_| GdnError::Memory {
        what: what.to_string(),
        needed: bytes_of(&[n], 4),
        available: host_available().map_or(MAX_ALLOC_BYTES, |a| a.0),
        limit: "the allocator could provide".into(),
    })?;
    v.resize(n, 0.0);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_parsing() {
        let t = "MemTotal:       16314372 kB\nMemFree:  100 kB\nMemAvailable:   12000000 kB\n";
        assert_eq!(parse_meminfo(t), Some((12_000_000 * 1024, "MemAvailable")));
        assert_eq!(
            parse_meminfo("MemTotal: 2048 kB\n"),
            Some((2048 * 1024, "MemTotal"))
        );
        assert_eq!(parse_meminfo("garbage\n"), None);
    }

    #[test]
    fn host_check_refuses_the_impossible_and_passes_the_small() {
        assert!(check_host("a few bytes", 64).is_ok());
        let e = check_host("allocating everything", u128::MAX)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("allocating everything needs"), "{e}");
        assert!(e.contains("9223372036854775807 bytes"), "{e}");
        // beyond the address space is refused even where /proc is unreadable
        let e = check_addressable("x", 1 << 63).unwrap_err().to_string();
        assert!(e.contains("needs 9223372036854775808 bytes"), "{e}");
        assert!(check_addressable("x", 1 << 40).is_ok());
        assert_eq!(bytes_of(&[usize::MAX, usize::MAX, 4], 4), u128::MAX);
        assert_eq!(bytes_of(&[3, 5], 4), 60);
    }
}
