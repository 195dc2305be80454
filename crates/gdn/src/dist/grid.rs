//! A rank's place in a `dp x cp` layout: its data-parallel group and its context-parallel group
//! (Megatron's order, CP innermost: world rank `w = d cp + c`). The CP group's ranks share the
//! same micro-batches (each holds `1 / cp` of every sequence); the DP group's ranks hold the same
//! CP rank of different micro-batches. [`crate::dist::run_grid`] makes one in process;
//! [`crate::dist::Nccl::grid`] one over NCCL (one process per GPU).

use std::sync::Arc;

use super::inproc::InProc;
use super::Communicator;
use crate::backend::Act;
use crate::error::{GdnError, Result};

/// This rank's data-parallel and context-parallel groups.
#[derive(Clone, Debug)]
pub struct Grid {
    /// The data-parallel group (size: the DP size).
    pub dp: Arc<dyn Communicator>,
    /// The context-parallel group (size: the CP size).
    pub cp: Arc<dyn Communicator>,
}

/// The layout rules, checked before anything starts: sizes at least 1, and (when launched) the
/// launcher's world size equal to `dp x cp`.
pub fn check_layout(dp: usize, cp: usize, world: Option<usize>) -> Result<()> {
    if dp == 0 {
        return Err(GdnError::Invalid(
            "the data-parallel size (--dp) must be at least 1".into(),
        ));
    }
    if cp == 0 {
        return Err(GdnError::Invalid(
            "the context-parallel size (--cp) must be at least 1".into(),
        ));
    }
    if let Some(w) = world {
        if dp.checked_mul(cp) != Some(w) {
            return Err(GdnError::Invalid(format!(
                "the launcher started WORLD_SIZE={w} processes but --dp {dp} x --cp {cp} = {} ranks are asked for (one process per rank)",
                dp.saturating_mul(cp)
            )));
        }
    }
    Ok(())
}

impl Grid {
    /// One rank alone (groups of one).
    pub fn single() -> Result<Self> {
        let one = |v: Vec<InProc>| -> Arc<dyn Communicator> {
            Arc::new(v.into_iter().next().expect("one rank"))
        };
        Ok(Grid {
            dp: one(InProc::group(1)?),
            cp: one(InProc::group(1)?),
        })
    }
    /// World rank `d cp + c`.
    pub fn rank(&self) -> usize {
        self.dp.rank() * self.cp.size() + self.cp.rank()
    }
    /// `dp x cp`.
    pub fn world(&self) -> usize {
        self.dp.size() * self.cp.size()
    }
    /// Returns once every rank of the grid has called it.
    pub fn barrier(&self) -> Result<()> {
        self.dp.barrier()?;
        self.cp.barrier()
    }
    /// World rank 0's `v` into every rank's `v` (same length everywhere): over the DP group of
    /// CP rank 0, then over every CP group.
    pub fn broadcast_host(&self, v: &mut Vec<f32>) -> Result<()> {
        for c in [&self.dp, &self.cp] {
            if c.size() > 1 {
                let mut a = Act::Host(std::mem::take(v));
                c.broadcast(&mut a, 0)?;
                *v = a.into_host()?;
            }
        }
        Ok(())
    }
    /// Whether world rank 0 says `flag` (every rank gets rank 0's value).
    pub fn agree(&self, flag: bool) -> Result<bool> {
        let mut v = vec![if flag { 1.0 } else { 0.0 }];
        self.broadcast_host(&mut v)?;
        Ok(v[0] != 0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::inproc::run_grid;

    #[test]
    fn grid_groups_ranks_cp_innermost_and_broadcasts_from_rank_0() {
        let out = run_grid(3, 2, |g| {
            // Each group's members, by world rank.
            let w = Act::Host(vec![g.rank() as f32]);
            let dp: Vec<f32> =
                g.dp.all_gather(&w)?
                    .into_iter()
                    .map(|a| a.into_host().map(|v| v[0]))
                    .collect::<Result<_>>()?;
            let cp: Vec<f32> =
                g.cp.all_gather(&w)?
                    .into_iter()
                    .map(|a| a.into_host().map(|v| v[0]))
                    .collect::<Result<_>>()?;
            let mut v = vec![g.rank() as f32 + 10.0; 2];
            g.broadcast_host(&mut v)?;
            g.barrier()?;
            let stop = g.agree(g.rank() == 0)?;
            Ok((g.rank(), g.world(), dp, cp, v, stop))
        })
        .unwrap();
        for (w, (rank, world, dp, cp, v, stop)) in out.into_iter().enumerate() {
            let (d, c) = (w / 2, w % 2);
            assert_eq!((rank, world), (w, 6));
            assert_eq!(
                dp,
                vec![c as f32, (2 + c) as f32, (4 + c) as f32],
                "rank {w}"
            );
            assert_eq!(cp, vec![(2 * d) as f32, (2 * d + 1) as f32], "rank {w}");
            assert_eq!(v, vec![10.0; 2]);
            assert!(stop);
        }
    }

    #[test]
    fn bad_layouts_are_errors() {
        assert!(check_layout(0, 1, None)
            .unwrap_err()
            .to_string()
            .contains("--dp) must be at least 1"));
        assert!(check_layout(1, 0, None)
            .unwrap_err()
            .to_string()
            .contains("--cp) must be at least 1"));
        let e = check_layout(2, 2, Some(2)).unwrap_err().to_string();
        assert!(
            e.contains("WORLD_SIZE=2 processes but --dp 2 x --cp 2 = 4 ranks"),
            "{e}"
        );
        check_layout(2, 2, Some(4)).unwrap();
        assert!(InProc::grid(0, 2).is_err());
    }
}
