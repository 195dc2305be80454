//! l2norm (in progress)
