//! CPU decode ops against a plain f64 recurrence written here, padding and errors.
