//! norm (in progress)
