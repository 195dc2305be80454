//! f64 reference of the pre-norm (plain loops; for tests). Shared with the gated norm's
//! reference, so it lives in `ops::common::reference`.

pub use crate::ops::common::reference::{norm_forward, norm_stats};
