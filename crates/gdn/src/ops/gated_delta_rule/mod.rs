//! gated_delta_rule (in progress)
