//! safetensors reading and writing (helper-owned; placeholder).
