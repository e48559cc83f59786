//! The `dflash` drafter (SpecForge's DFlash): block diffusion over the target's tapped hidden states, trained
//! with the host-built block plan ([`blocks`]) and written once over [`Backend`](crate::backend::Backend).

pub mod blocks;
