//! Single-source drafter kernels.
//!
//! ```text
//!  runtime ── cpu backend ──▶ these kernel bodies (host build)
//!          └─ cuda backend ─▶ the same bodies compiled for nvptx64 → PTX
//! ```
//!
//! `#![no_std]`, no allocation, no panicking paths on the device side.
#![no_std]
