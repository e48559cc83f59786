//! The warp-level instructions of the flash-attention bodies ([`super`]), written once as a trait with two
//! implementations, so the host runs the very body the GPU runs:
//!
//! ```text
//!  body<const N, W: MatrixWarp<N>>   a warp value is Lanes<T, N>: what each of the N lanes this thread runs holds
//!      device  DeviceWarp, N = 1     one lane per thread: LLVM's NVVM intrinsics (mma, shfl, bar) and ldmatrix
//!      host    ModelWarp,  N = 32    the whole warp in one thread: every instruction computed lane by lane from
//!                                    the PTX ISA's fragment layouts (below), the block barrier a host barrier
//! ```
//!
//! Layouts (PTX ISA 9.0, §9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating point type", and
//! §9.7.14.5.15 "ldmatrix"; `g = laneid >> 2`, `t = laneid % 4`):
//!
//! - A (16×16, row-major, `.bf16`): four `.b32` registers of two bf16 each, low half first. `a0,a1`: row `g`,
//!   cols `2t, 2t+1`; `a2,a3`: row `g+8`, same cols; `a4,a5`: row `g`, cols `2t+8, 2t+9`; `a6,a7`: row `g+8`,
//!   cols `2t+8, 2t+9`.
//! - B (16×8, column-major, `.bf16`): two registers. `b0,b1`: rows `2t, 2t+1`, col `g`; `b2,b3`: rows `2t+8,
//!   2t+9`, col `g`.
//! - C/D (16×8, `.f32`): four registers. `c0,c1`: row `g`, cols `2t, 2t+1`; `c2,c3`: row `g+8`, same cols.
//! - `ldmatrix.sync.aligned.m8n8.x4.b16`: lanes `8m..8m+8` give the addresses of rows `0..8` of matrix `m`;
//!   register `m` of lane `l` receives row `l >> 2`, cols `2(l % 4), 2(l % 4) + 1` of matrix `m`. With `.trans`
//!   the matrix is read column-major: register `m` receives rows `2(l % 4), 2(l % 4) + 1` of col `l >> 2`.
//!
//! The model multiplies bf16 inputs exactly (a product of two bf16 fits an f32) and adds the 16 products to the
//! accumulator in f32, in `k` order. The hardware's internal order and intermediate precision inside one `mma`
//! are not documented; the tests' tolerances (bf16 inputs, [`super`]) are far wider than either difference.
//!
//! Device side: `mma` through `llvm.nvvm.mma.m16n8k16.row.col.bf16`, the shuffle through
//! `llvm.nvvm.shfl.sync.bfly.f32`, the block barrier through `llvm.nvvm.barrier0` (`_syncthreads`); LLVM
//! declares all three convergent, so no pass moves them into lane-divergent control flow. No body needs a
//! warp-only barrier (`bar.warp.sync`): a warp's lanes exchange data only through `shfl`, `mma` and `ldmatrix`,
//! which synchronise the warp themselves. `ldmatrix` stays inline assembly. LLVM 22 has its intrinsic (the
//! `.p0` overload of `llvm.nvvm.ldmatrix.sync.aligned.m8n8.x4[.trans].b16` takes the generic address these
//! bodies hold) and emits the same instruction from it, but its code generation then raises the flash entries'
//! register pressure: with ptxas 13.0.88 (sm_90) `flash_backward_kv_d128` spilled 168 bytes instead of 40 (over
//! the PTX check's bound of 64), `flash_forward_d64` took 168 registers instead of 130 and `flash_backward_q_d64`
//! 219 instead of 174; fences around the call (an empty clobbering `asm!`) and an opaque base per call did not
//! bring it back. The cost of the assembly: LLVM does not know the block is convergent. Every call sits in
//! warp-uniform control flow (loop trips and branches depend on the block index, not the lane), so only a pass
//! that sank it into a lane-dependent branch could split the warp; none does today, and no test can show it
//! never will (docs/gpu.md, "Warp instructions").

/// One value per lane of the lanes a thread runs: `N = 1` on the GPU (this lane), `N = 32` in the host model
/// (the whole warp, lane `i` in element `i`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lanes<T, const N: usize>(pub [T; N]);

impl<T: Copy, const N: usize> Lanes<T, N> {
    /// Every lane holds `value`.
    #[inline(always)]
    pub fn splat(value: T) -> Self {
        Self([value; N])
    }

    /// `f` of each lane's value.
    #[inline(always)]
    pub fn map<U: Copy>(self, mut f: impl FnMut(T) -> U) -> Lanes<U, N> {
        Lanes(core::array::from_fn(|i| f(self.0[i])))
    }

    /// `f` of each lane's pair of values.
    #[inline(always)]
    pub fn zip<U: Copy, V: Copy>(
        self,
        other: Lanes<U, N>,
        mut f: impl FnMut(T, U) -> V,
    ) -> Lanes<V, N> {
        Lanes(core::array::from_fn(|i| f(self.0[i], other.0[i])))
    }
}

impl<const N: usize> core::ops::Add for Lanes<f32, N> {
    type Output = Self;
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        self.zip(other, |a, b| a + b)
    }
}

impl<const N: usize> core::ops::Sub for Lanes<f32, N> {
    type Output = Self;
    #[inline(always)]
    fn sub(self, other: Self) -> Self {
        self.zip(other, |a, b| a - b)
    }
}

impl<const N: usize> core::ops::Mul for Lanes<f32, N> {
    type Output = Self;
    #[inline(always)]
    fn mul(self, other: Self) -> Self {
        self.zip(other, |a, b| a * b)
    }
}

impl<const N: usize> Lanes<f32, N> {
    /// The larger of the two per lane (NaN loses, as PTX `max.f32`).
    #[inline(always)]
    pub fn max(self, other: Self) -> Self {
        self.zip(other, |a, b| if b > a || a.is_nan() { b } else { a })
    }

    /// `e^x` per lane ([`crate::math::exp`]).
    #[inline(always)]
    pub fn exp(self) -> Self {
        self.map(crate::math::exp)
    }
}

/// An `mma` accumulator fragment (C/D, 16×8 f32): `c0..c3` of the module docs.
pub type Accum<const N: usize> = [Lanes<f32, N>; 4];

/// An `mma` A fragment (16×16 bf16): four registers of two bf16 each.
pub type FragA<const N: usize> = [Lanes<u32, N>; 4];

/// An `mma` B fragment (16×8 bf16): two registers.
pub type FragB<const N: usize> = [Lanes<u32, N>; 2];

/// A zero accumulator.
#[inline(always)]
pub fn accum_zero<const N: usize>() -> Accum<N> {
    [Lanes::splat(0.0); 4]
}

/// Two f32 rounded to bf16 and packed into one register, `lo` in the low half (the element with the lower
/// column index of a fragment pair).
#[inline(always)]
pub fn pack_bf16(lo: f32, hi: f32) -> u32 {
    crate::convert::f32_to_bf16_bits(lo) as u32
        | (crate::convert::f32_to_bf16_bits(hi) as u32) << 16
}

/// The f32 value of bf16 bits.
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// The instructions a flash body issues, for the `N` lanes a thread runs (module docs).
pub trait MatrixWarp<const N: usize>: Copy {
    /// `%laneid` of each lane.
    fn lane(self) -> Lanes<u32, N>;

    /// This warp's index in its block (`%tid.x / 32`).
    fn warp(self) -> usize;

    /// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`: `d = a · b + c`.
    fn mma(self, a: &FragA<N>, b: &FragB<N>, c: Accum<N>) -> Accum<N>;

    /// `ldmatrix.sync.aligned.m8n8.x4.b16` (`trans`: with `.trans`), each lane giving one row address:
    /// `rows + offset` (`offset` in bf16, the same on every lane: the device adds it inside the instruction
    /// sequence, so each call site keeps one base register instead of its own 64-bit address).
    ///
    /// # Safety
    /// Each address points at 8 readable, 16-byte aligned bf16 in shared memory; every lane of the warp calls
    /// it together.
    unsafe fn ldmatrix_x4(
        self,
        rows: Lanes<*const u16, N>,
        offset: usize,
        trans: bool,
    ) -> [Lanes<u32, N>; 4];

    /// `shfl.sync.bfly.b32` over the full warp: lane `l` gets lane `l ^ mask`'s value.
    fn shuffle_xor(self, value: Lanes<f32, N>, mask: u32) -> Lanes<f32, N>;

    /// `bar.sync 0`: every warp of the block waits for the others (shared memory written before it is visible
    /// to all after it).
    fn sync_block(self);
}

/// The thread block's barrier in the host model (the tests run a block's warps as threads).
pub trait BlockBarrier: Sync {
    /// Returns when every warp of the block has called it.
    fn wait(&self);
}

/// A deliberate fragment-layout mistake in the host model, so a test can show the kernel tests see one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayoutMutation {
    /// The documented layouts.
    None,
    /// `mma` reads A's rows `g` and `g + 8` swapped (registers `a0,a1` ↔ `a2,a3`, `a4,a5` ↔ `a6,a7`).
    MmaARowsSwapped,
    /// `ldmatrix .trans` delivers the untransposed fragment.
    LdmatrixIgnoresTrans,
}

/// The whole warp in one host thread: every instruction computed from the documented layouts.
#[derive(Clone, Copy)]
pub struct ModelWarp<'a> {
    warp: usize,
    barrier: &'a dyn BlockBarrier,
    mutation: LayoutMutation,
}

impl<'a> ModelWarp<'a> {
    /// Warp `warp` of a block whose warps share `barrier`.
    pub fn new(warp: usize, barrier: &'a dyn BlockBarrier, mutation: LayoutMutation) -> Self {
        Self {
            warp,
            barrier,
            mutation,
        }
    }
}

/// The two bf16 of a register, low half first, as f32.
#[inline(always)]
fn unpack(reg: u32) -> [f32; 2] {
    [bf16_to_f32(reg as u16), bf16_to_f32((reg >> 16) as u16)]
}

impl MatrixWarp<32> for ModelWarp<'_> {
    fn lane(self) -> Lanes<u32, 32> {
        Lanes(core::array::from_fn(|l| l as u32))
    }

    fn warp(self) -> usize {
        self.warp
    }

    fn mma(self, a: &FragA<32>, b: &FragB<32>, c: Accum<32>) -> Accum<32> {
        // Scatter the fragments into the matrices they describe, then multiply.
        let mut am = [[0.0f32; 16]; 16];
        let mut bm = [[0.0f32; 8]; 16];
        let swap = self.mutation == LayoutMutation::MmaARowsSwapped;
        for l in 0..32 {
            let (g, t) = (l >> 2, l % 4);
            for (reg, value) in a.iter().enumerate() {
                // Register r holds a_{2r}, a_{2r+1}: rows g (r = 0, 2) or g + 8 (r = 1, 3), cols +8 for r ≥ 2.
                let upper = (reg % 2 == 1) != swap;
                let row = g + if upper { 8 } else { 0 };
                let col = 2 * t + if reg >= 2 { 8 } else { 0 };
                let [lo, hi] = unpack(value.0[l]);
                am[row][col] = lo;
                am[row][col + 1] = hi;
            }
            for (reg, value) in b.iter().enumerate() {
                let row = 2 * t + 8 * reg;
                let [lo, hi] = unpack(value.0[l]);
                bm[row][g] = lo;
                bm[row + 1][g] = hi;
            }
        }
        let mut d = c;
        for l in 0..32 {
            let (g, t) = (l >> 2, l % 4);
            for (reg, out) in d.iter_mut().enumerate() {
                let row = g + if reg >= 2 { 8 } else { 0 };
                let col = 2 * t + reg % 2;
                let mut acc = out.0[l];
                for k in 0..16 {
                    acc += am[row][k] * bm[k][col];
                }
                out.0[l] = acc;
            }
        }
        d
    }

    unsafe fn ldmatrix_x4(
        self,
        rows: Lanes<*const u16, 32>,
        offset: usize,
        trans: bool,
    ) -> [Lanes<u32, 32>; 4] {
        let trans = trans && self.mutation != LayoutMutation::LdmatrixIgnoresTrans;
        let mut out = [Lanes::splat(0u32); 4];
        for (m, reg) in out.iter_mut().enumerate() {
            // Matrix m: row i at the address lane 8m + i gave.
            // SAFETY: the caller's contract: each address holds 8 bf16.
            let element =
                |row: usize, col: usize| unsafe { *rows.0[8 * m + row].add(offset + col) } as u32;
            for l in 0..32 {
                let (g, t) = (l >> 2, l % 4);
                reg.0[l] = if trans {
                    element(2 * t, g) | element(2 * t + 1, g) << 16
                } else {
                    element(g, 2 * t) | element(g, 2 * t + 1) << 16
                };
            }
        }
        out
    }

    fn shuffle_xor(self, value: Lanes<f32, 32>, mask: u32) -> Lanes<f32, 32> {
        Lanes(core::array::from_fn(|l| value.0[l ^ (mask as usize & 31)]))
    }

    fn sync_block(self) {
        self.barrier.wait();
    }
}

/// One lane of a warp on the GPU.
#[cfg(target_arch = "nvptx64")]
#[derive(Debug, Clone, Copy)]
pub struct DeviceWarp {
    lane: u32,
    warp: usize,
}

#[cfg(target_arch = "nvptx64")]
impl DeviceWarp {
    /// The calling thread: lane `%tid.x % 32` of warp `%tid.x / 32`.
    ///
    /// # Safety
    /// Every thread of the block runs the same body with its own `DeviceWarp` (the warp instructions name all
    /// 32 lanes, the block barrier all warps).
    #[inline(always)]
    pub unsafe fn new(thread: usize) -> Self {
        Self {
            lane: (thread % 32) as u32,
            warp: thread / 32,
        }
    }
}

#[cfg(target_arch = "nvptx64")]
unsafe extern "unadjusted" {
    #[link_name = "llvm.nvvm.mma.m16n8k16.row.col.bf16"]
    fn nvvm_mma_bf16(
        a0: u32,
        a1: u32,
        a2: u32,
        a3: u32,
        b0: u32,
        b1: u32,
        c0: f32,
        c1: f32,
        c2: f32,
        c3: f32,
    ) -> (f32, f32, f32, f32);
    #[link_name = "llvm.nvvm.shfl.sync.bfly.f32"]
    fn nvvm_shfl_bfly_f32(member_mask: u32, value: f32, lane_mask: u32, clamp: u32) -> f32;
}

#[cfg(target_arch = "nvptx64")]
impl MatrixWarp<1> for DeviceWarp {
    #[inline(always)]
    fn lane(self) -> Lanes<u32, 1> {
        Lanes([self.lane])
    }

    #[inline(always)]
    fn warp(self) -> usize {
        self.warp
    }

    #[inline(always)]
    fn mma(self, a: &FragA<1>, b: &FragB<1>, c: Accum<1>) -> Accum<1> {
        // SAFETY: every lane of the warp issues it together (the `DeviceWarp::new` contract).
        let (d0, d1, d2, d3) = unsafe {
            nvvm_mma_bf16(
                a[0].0[0], a[1].0[0], a[2].0[0], a[3].0[0], b[0].0[0], b[1].0[0], c[0].0[0],
                c[1].0[0], c[2].0[0], c[3].0[0],
            )
        };
        [Lanes([d0]), Lanes([d1]), Lanes([d2]), Lanes([d3])]
    }

    #[inline(always)]
    unsafe fn ldmatrix_x4(
        self,
        rows: Lanes<*const u16, 1>,
        offset: usize,
        trans: bool,
    ) -> [Lanes<u32, 1>; 4] {
        let (r0, r1, r2, r3): (u32, u32, u32, u32);
        let (address, bytes) = (rows.0[0] as u64, 2 * offset as u64);
        // SAFETY: the caller's contract (a shared-memory row per lane, the whole warp together).
        unsafe {
            if trans {
                core::arch::asm!(
                    "{{ .reg .b64 at; add.s64 at, {a}, {o};",
                    "ldmatrix.sync.aligned.m8n8.x4.trans.b16 {{{0}, {1}, {2}, {3}}}, [at]; }}",
                    out(reg32) r0, out(reg32) r1, out(reg32) r2, out(reg32) r3, a = in(reg64) address,
                    o = in(reg64) bytes,
                );
            } else {
                core::arch::asm!(
                    "{{ .reg .b64 at; add.s64 at, {a}, {o};",
                    "ldmatrix.sync.aligned.m8n8.x4.b16 {{{0}, {1}, {2}, {3}}}, [at]; }}",
                    out(reg32) r0, out(reg32) r1, out(reg32) r2, out(reg32) r3, a = in(reg64) address,
                    o = in(reg64) bytes,
                );
            }
        }
        [Lanes([r0]), Lanes([r1]), Lanes([r2]), Lanes([r3])]
    }

    #[inline(always)]
    fn shuffle_xor(self, value: Lanes<f32, 1>, mask: u32) -> Lanes<f32, 1> {
        // SAFETY: the whole warp shuffles together; clamp 0x1f is the last lane of a 32-lane segment.
        Lanes([unsafe { nvvm_shfl_bfly_f32(u32::MAX, value.0[0], mask, 0x1f) }])
    }

    #[inline(always)]
    fn sync_block(self) {
        // SAFETY: every thread of the block reaches the same barriers (the bodies' loops are block-uniform).
        unsafe { core::arch::nvptx::_syncthreads() }
    }
}

/// `pointer`, made opaque to the optimiser on the GPU (an empty `asm!` it cannot see through or move): shared
/// tile addresses derived from it are then computed where they are used, instead of being hoisted out of the key
/// loop all at once (LLVM's loop-invariant code motion does not weigh register pressure, and 64 hoisted
/// `ldmatrix` addresses would spill). The identity on the host.
#[inline(always)]
pub fn opaque<T>(pointer: *const T) -> *const T {
    #[cfg(target_arch = "nvptx64")]
    {
        let mut address = pointer as u64;
        // SAFETY: an empty instruction sequence; it only pins the value in a register.
        unsafe {
            core::arch::asm!("// opaque {0}", inout(reg64) address, options(nomem, nostack, preserves_flags))
        };
        address as *const T
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        pointer
    }
}
