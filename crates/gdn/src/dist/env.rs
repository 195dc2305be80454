//! The launcher's environment (torchrun's contract, which `gdn launch` follows too): `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`.

use crate::error::{GdnError, Result};

/// Where this process sits in a launched group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank on this machine: the GPU this process uses (`cuda:LOCAL_RANK`).
    pub local_rank: usize,
    /// Rank 0's address (the rendezvous).
    pub master_addr: String,
    /// Rank 0's port (the rendezvous).
    pub master_port: u16,
}

impl DistEnv {
    /// From the process environment: `None` when `WORLD_SIZE` is not set (not launched);
    /// an error naming the variable when one is missing or malformed.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// From any variable lookup (tests).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        if get("WORLD_SIZE").is_none() {
            return Ok(None);
        }
        let num = |k: &str| -> Result<usize> {
            let v = get(k).ok_or_else(|| {
                GdnError::Invalid(format!(
                    "WORLD_SIZE is set but {k} is not (a launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)"
                ))
            })?;
            v.trim()
                .parse::<usize>()
                .map_err(|_| GdnError::Invalid(format!("{k}={v:?} is not a non-negative integer")))
        };
        let world_size = num("WORLD_SIZE")?;
        let rank = num("RANK")?;
        let local_rank = match get("LOCAL_RANK") {
            Some(_) => num("LOCAL_RANK")?,
            None => rank,
        };
        if world_size == 0 || rank >= world_size {
            return Err(GdnError::Invalid(format!(
                "RANK={rank} must be below WORLD_SIZE={world_size} (and WORLD_SIZE at least 1)"
            )));
        }
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let port = get("MASTER_PORT").unwrap_or_else(|| "29500".into());
        let master_port = port
            .trim()
            .parse::<u16>()
            .map_err(|_| GdnError::Invalid(format!("MASTER_PORT={port:?} is not a port number")))?;
        Ok(Some(DistEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn look<'a>(kv: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| kv.iter().find(|(a, _)| *a == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn reads_torchruns_variables_and_names_bad_ones() {
        assert_eq!(DistEnv::from_lookup(look(&[])).unwrap(), None);
        let e = DistEnv::from_lookup(look(&[
            ("WORLD_SIZE", "2"),
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "29400"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            DistEnv {
                rank: 1,
                world_size: 2,
                local_rank: 1,
                master_addr: "10.0.0.1".into(),
                master_port: 29400
            }
        );
        let err = |kv: &[(&str, &str)]| DistEnv::from_lookup(look(kv)).unwrap_err().to_string();
        assert!(err(&[("WORLD_SIZE", "2")]).contains("RANK is not"));
        assert!(err(&[("WORLD_SIZE", "2"), ("RANK", "2")]).contains("must be below"));
        assert!(err(&[("WORLD_SIZE", "x"), ("RANK", "0")]).contains("WORLD_SIZE=\"x\""));
        assert!(
            err(&[("WORLD_SIZE", "1"), ("RANK", "0"), ("MASTER_PORT", "70000")])
                .contains("MASTER_PORT")
        );
    }
}
