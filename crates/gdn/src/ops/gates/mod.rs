//! gates (in progress)
