//! conv1d (in progress)
