//! One backend entry point for every kernel of the table: [`Kernel`], generated from `kernel_table!`
//! (`gpu-kernels/src/table.rs`), and [`Backend::launch`](super::Backend::launch), which each backend implements
//! once as a generated match (CPU: the host launchers, `cpu/kernels.rs`; CUDA: the device launcher,
//! `cuda/launch.rs`). The flash-attention table (`flash_kernel_table!`) gives [`FlashKernel`] the same way,
//! launched by [`Backend::launch_flash`](super::Backend::launch_flash) (CPU: the warp model, `cpu/flash.rs`;
//! CUDA: thread blocks of warps, `cuda/launch.rs`'s `FlashLauncher`).
//!
//! ```text
//!  model step ──▶ Backend's provided operations (`backend/mod.rs`, `backend/eagle3.rs`: sizes derived and checked
//!                 once, composites such as the two-pass sums written once)
//!                   └──▶ Kernel::NAME { reads, writes, scalars } ──▶ Backend::launch ──┬─▶ launch::NAME(slices…)
//!                                                                                       └─▶ Launcher::NAME(DevicePtr…)
//! ```
//!
//! A variant's fields are the entry's, in the table's order (reads, writes, scalars): reads as the backend's
//! [`Read`](super::Backend::Read) argument, writes as its [`Write`](super::Backend::Write), scalars as declared.
//! The table's element types are kept (AdamW's step scalars are an [`AdamWStep`]; 16-bit hidden states `u16`
//! bits): an operation turns its buffers' views into those with [`Reinterpret`]. On CUDA an argument is a device
//! address, which holds no borrow of its buffer: an operation builds its `Kernel` from its views and launches it
//! at once, so the views' borrows (which rule out a written buffer aliasing another argument) cover the launch.

use draftpipe_gpu_kernels::adamw::AdamWStep;

use super::Backend;

/// Element types whose elements a kernel may read as another type of the same bytes: AdamW's step scalars, stored
/// as seven `f32`s, as one [`AdamWStep`]; 16-bit floats as their bits.
///
/// # Safety
/// Every bit pattern of a whole number of `Self`s of `size_of::<U>()` bytes is a valid `U`, and `U` needs no
/// stricter alignment than `Self`.
pub unsafe trait Reinterpret<U> {}

// SAFETY: `AdamWStep` is `repr(C)` of seven `f32`s.
unsafe impl Reinterpret<AdamWStep> for f32 {}
// SAFETY: both are `repr(transparent)` over `u16`.
unsafe impl Reinterpret<u16> for half::bf16 {}
// SAFETY: as above.
unsafe impl Reinterpret<u16> for half::f16 {}

/// Generates enum `$enum_name` from a kernel table: one variant per entry, named as the entry point.
macro_rules! kernel_enum_named {
    ($(#[$enum_doc:meta])* $enum_name:ident; $(
        $(#[$doc:meta])*
        $name:ident {
            reads: [$($read:ident: $read_ty:ty = $read_len:expr),* $(,)?],
            writes: [$($write:ident: $write_ty:ty = $write_len:expr),* $(,)?],
            scalars: [$($scalar:ident: $scalar_ty:ty),* $(,)?],
            launch: $shape:ident($($count:expr),* $(,)?),
            body: |$($bind:ident),*| $body:expr,
        }
    )*) => {
        $(#[$enum_doc])*
        #[allow(non_camel_case_types, missing_docs)]
        pub enum $enum_name<'a, B: Backend> {
            $(
                $(#[$doc])*
                $name {
                    $($read: B::Read<'a, $read_ty>,)*
                    $($write: B::Write<'a, $write_ty>,)*
                    $($scalar: $scalar_ty,)*
                },
            )*
        }
    };
}

/// [`Kernel`] from `kernel_table!`.
macro_rules! kernel_enum {
    ($($entries:tt)*) => {
        kernel_enum_named! {
            /// One launch of a kernel of the table on backend `B`, its arguments named and ordered as the table
            /// declares them (reads, writes, scalars). Variants carry the entry points' names, so a variant reads
            /// as the kernel it launches.
            Kernel; $($entries)*
        }
    };
}

/// [`FlashKernel`] from `flash_kernel_table!`.
macro_rules! flash_kernel_enum {
    ($($entries:tt)*) => {
        kernel_enum_named! {
            /// One launch of a flash-attention kernel (`flash_kernel_table!`) on backend `B`: a thread block of
            /// warps per index, arguments as in [`Kernel`].
            FlashKernel; $($entries)*
        }
    };
}

draftpipe_gpu_kernels::kernel_table!(kernel_enum);
draftpipe_gpu_kernels::flash_kernel_table!(flash_kernel_enum);
