//! linear (in progress)
