//! The `eagle3` drafter family (SpecForge's offline EAGLE-3): its draft vocabulary maps and its export here; the
//! training step joins this folder.

pub mod export;
pub mod vocab;
