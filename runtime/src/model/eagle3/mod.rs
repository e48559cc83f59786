//! The `eagle3` drafter family (SpecForge's offline EAGLE-3): its draft vocabulary maps here; the training
//! step and the export join this folder.

pub mod vocab;
