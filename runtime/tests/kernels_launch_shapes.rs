//! The GPU launch shapes on the host: element-range kernels called with `chunk_len = 1` for every index (one
//! element per thread, as the CUDA wrappers launch them) and the norm weight gradient with other row chunkings
//! must give the same results as the host launchers' long chunks — bitwise for elementwise kernels, whose
//! per-element arithmetic does not depend on the chunking. The row kernels (one warp per row on the GPU) run
//! on 32 threads per row, one per lane, and must match the host launchers bit for bit, except the vocabulary
//! loss, whose softmax sums the host takes in two passes instead of the warp's online pair (within 1e-6). The
//! DFlash kernels likewise: attention (planes per query or key tile and head) within 1e-5 (the host plane's row
//! dot products sum in 8 lanes, a warp's in 32), the weighted loss within 1e-6, the embedding gather and RoPE
//! one index per thread bitwise.

use draftpipe_gpu_kernels::{activation, adamw, norm};
use draftpipe_runtime::backend::cpu::kernels;
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

fn values(rng: &mut Xoshiro256PlusPlus, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-4.0f32..4.0)).collect()
}

#[test]
fn one_element_per_index_matches_the_host_chunks_bitwise() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(77);
    let (rows, inter) = (13, 333);
    let n = rows * inter;
    let gate_up = values(&mut rng, 2 * n);
    let dact = values(&mut rng, n);

    let mut act_host = vec![f32::NAN; n];
    kernels::swiglu_forward(&gate_up, &mut act_host, inter);
    let mut dgu_host = vec![f32::NAN; 2 * n];
    kernels::swiglu_backward(&gate_up, &dact, &mut dgu_host, inter);
    let (mut act_gpu, mut dgu_gpu) = (vec![f32::NAN; n], vec![f32::NAN; 2 * n]);
    for index in 0..n {
        // SAFETY: buffers sized for `rows × inter`; `index < n`.
        unsafe {
            activation::swiglu_forward(
                gate_up.as_ptr(),
                act_gpu.as_mut_ptr(),
                std::ptr::null_mut(),
                inter,
                n,
                1,
                index,
            );
            activation::swiglu_backward(
                gate_up.as_ptr(),
                dact.as_ptr(),
                dgu_gpu.as_mut_ptr(),
                std::ptr::null_mut(),
                inter,
                n,
                1,
                index,
            );
        }
    }
    assert_eq!(act_host, act_gpu);
    assert_eq!(dgu_host, dgu_gpu);

    let (z, a, dh) = (
        values(&mut rng, n),
        values(&mut rng, n),
        values(&mut rng, n),
    );
    let (mut h_host, mut h_gpu) = (vec![f32::NAN; n], vec![f32::NAN; n]);
    kernels::head_residual_forward(&z, &a, &mut h_host);
    let (mut da_host, mut dz_host) = (vec![f32::NAN; n], z.clone());
    kernels::head_residual_backward(&a, &dh, &mut da_host, &mut dz_host);
    let (mut da_gpu, mut dz_gpu) = (vec![f32::NAN; n], z.clone());
    for index in 0..n {
        // SAFETY: all buffers hold `n` elements; `index < n`.
        unsafe {
            activation::head_residual_forward(
                z.as_ptr(),
                a.as_ptr(),
                h_gpu.as_mut_ptr(),
                n,
                1,
                index,
            );
            activation::head_residual_backward(
                a.as_ptr(),
                dh.as_ptr(),
                da_gpu.as_mut_ptr(),
                dz_gpu.as_mut_ptr(),
                n,
                1,
                index,
            );
        }
    }
    assert_eq!(h_host, h_gpu);
    assert_eq!(da_host, da_gpu);
    assert_eq!(dz_host, dz_gpu);

    let grads = values(&mut rng, n);
    let hyper = kernels::adamw_step_scalars(1e-2, 0.9, 0.99, 1e-8, 0.1, 3);
    let params = values(&mut rng, n);
    let moments: Vec<f32> = values(&mut rng, n).iter().map(|v| v * 0.01).collect();
    let second: Vec<f32> = moments.iter().map(|v| v * v).collect();
    let (mut p_host, mut m_host, mut v_host) = (params.clone(), moments.clone(), second.clone());
    kernels::adamw_update(
        &mut p_host,
        &grads,
        &mut m_host,
        &mut v_host,
        2.0,
        0.5,
        hyper,
    );
    let (mut p_gpu, mut m_gpu, mut v_gpu) = (params, moments, second);
    let (norm_value, clip) = (2.0f32, 0.5f32);
    for index in 0..n {
        // SAFETY: all buffers hold `n` elements and are distinct; the scalars are locals.
        unsafe {
            adamw::adamw_update(
                p_gpu.as_mut_ptr(),
                std::ptr::null_mut(),
                grads.as_ptr(),
                m_gpu.as_mut_ptr(),
                v_gpu.as_mut_ptr(),
                &norm_value,
                &clip,
                hyper,
                n,
                1,
                index,
            );
        }
    }
    assert_eq!(p_host, p_gpu);
    assert_eq!(m_host, m_gpu);
    assert_eq!(v_host, v_gpu);
}

#[test]
fn norm_weight_grad_is_deterministic_and_chunking_only_regroups_the_sum() {
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(78);
    let (rows, cols) = (301, 37);
    let (x, dy) = (values(&mut rng, rows * cols), values(&mut rng, rows * cols));
    let inv: Vec<f32> = (0..rows).map(|_| rng.random_range(0.1f32..2.0)).collect();
    let mut first = vec![f32::NAN; cols];
    let mut partials = vec![f32::NAN; rows * cols];
    kernels::rmsnorm_weight_grad(&x, &inv, &dy, &mut first, &mut partials, 64);
    let mut again = vec![f32::NAN; cols];
    kernels::rmsnorm_weight_grad(&x, &inv, &dy, &mut again, &mut partials, 64);
    assert_eq!(first, again, "same inputs, same chunking: bitwise equal");
    use warp_on_threads::{Shared, launch};
    // The column sums run as the GPU runs them, a simulated warp per column; at the host's chunking of 64 they
    // must give its bits.
    for rows_per_chunk in [1, 7, 64, 300, 301, 1000] {
        let chunks = rows.div_ceil(rows_per_chunk);
        let mut dw = vec![f32::NAN; cols];
        for index in 0..chunks * cols {
            // SAFETY: `partials` holds `rows · cols ≥ chunks · cols` elements; inputs hold `rows · cols`.
            unsafe {
                norm::rmsnorm_weight_grad_partials(
                    x.as_ptr(),
                    inv.as_ptr(),
                    dy.as_ptr(),
                    partials.as_mut_ptr(),
                    rows,
                    cols,
                    rows_per_chunk,
                    index,
                )
            };
        }
        let dp = Shared(dw.as_mut_ptr());
        launch(cols, |plane, col| {
            // SAFETY: `partials` holds `chunks · cols` written elements; `dw` holds `cols`.
            unsafe {
                norm::column_sums(partials.as_ptr(), dp.ptr(), chunks, cols, false, plane, col)
            };
        });
        if rows_per_chunk == 64 {
            assert_eq!(
                bits(&dw),
                bits(&first),
                "a warp per column against the host plane"
            );
        }
        for c in 0..cols {
            let scale: f32 = (0..rows)
                .map(|r| (x[r * cols + c] * dy[r * cols + c] * inv[r]).abs())
                .sum();
            assert!(
                (dw[c] - first[c]).abs() <= 1e-5 * scale,
                "rows_per_chunk {rows_per_chunk} col {c}"
            );
        }
    }
}

/// The GPU's plane launch shape on the host: 32 threads run a row's body together, each as one lane of a
/// [`ThreadLane`] plane (its share of the indices, the butterfly exchanged through shared slots between
/// barriers), as the warp lanes do. Every lane writes what its share and the leader rule say, so a missed
/// element, a race between a lane's read and another's write, or a reduction in another order shows up as a
/// difference from the host launcher's [`HostPlane`](draftpipe_gpu_kernels::plane::HostPlane) run, which must
/// match it bit for bit.
mod warp_on_threads {
    use std::sync::{Barrier, Mutex};

    use draftpipe_gpu_kernels::plane::{LaneRow, LaneValue, Plane, ROW_SLOTS, WIDTH, lane_rows};

    /// What the lanes of one simulated warp share.
    pub struct Exchange {
        slots: Mutex<[[u8; 16]; WIDTH]>,
        barrier: Barrier,
    }

    impl Exchange {
        pub fn new() -> Self {
            Self {
                slots: Mutex::new([[0; 16]; WIDTH]),
                barrier: Barrier::new(WIDTH),
            }
        }
    }

    /// Lane `lane` of a warp simulated by 32 threads.
    #[derive(Clone, Copy)]
    pub struct ThreadLane<'a> {
        pub lane: usize,
        pub exchange: &'a Exchange,
    }

    impl ThreadLane<'_> {
        /// `value` of lane `lane ^ mask`, like `shfl.sync.bfly`.
        fn shuffle_xor<T: LaneValue>(self, value: T, mask: usize) -> T {
            assert!(size_of::<T>() <= 16);
            {
                let mut slots = self.exchange.slots.lock().unwrap();
                // SAFETY: `T` is plain data of at most 16 bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (&raw const value).cast::<u8>(),
                        slots[self.lane].as_mut_ptr(),
                        size_of::<T>(),
                    )
                };
            }
            self.exchange.barrier.wait();
            let other = {
                let slots = self.exchange.slots.lock().unwrap();
                // SAFETY: the partner lane stored a `T` in its slot before the barrier.
                unsafe { std::ptr::read_unaligned(slots[self.lane ^ mask].as_ptr().cast::<T>()) }
            };
            self.exchange.barrier.wait();
            other
        }
    }

    impl Plane for ThreadLane<'_> {
        type Row = LaneRow;

        fn is_leader(self) -> bool {
            self.lane == 0
        }

        fn row_zero(self) -> LaneRow {
            [0.0; ROW_SLOTS]
        }

        fn row_load(self, n: usize, f: impl FnMut(usize) -> f32) -> LaneRow {
            lane_rows::load(self.lane, n, f)
        }

        fn row_load_into(self, row: &mut LaneRow, n: usize, f: impl FnMut(usize) -> f32) {
            lane_rows::load_into(self.lane, row, n, f)
        }

        fn row_dot(self, a: &LaneRow, b: &LaneRow, n: usize) -> f32 {
            let mut value = lane_rows::dot_partial(self.lane, a, b, n);
            let mut distance = WIDTH / 2;
            while distance > 0 {
                value += self.shuffle_xor(value, distance);
                distance /= 2;
            }
            value
        }

        fn row_scale_add(self, acc: &mut LaneRow, alpha: f32, p: f32, x: &LaneRow, n: usize) {
            lane_rows::scale_add(acc, alpha, p, x, n)
        }

        fn row_store(self, row: &LaneRow, n: usize, f: impl FnMut(usize, f32)) {
            lane_rows::store(self.lane, row, n, f)
        }

        fn reduce<S: Copy, T: LaneValue>(
            self,
            n: usize,
            init: S,
            mut step: impl FnMut(S, usize) -> S,
            lift: impl Fn(S) -> T,
            combine: impl Fn(T, T) -> T,
        ) -> T {
            let mut state = init;
            let mut i = self.lane;
            while i < n {
                state = step(state, i);
                i += WIDTH;
            }
            let mut value = lift(state);
            let mut distance = WIDTH / 2;
            while distance > 0 {
                value = combine(value, self.shuffle_xor(value, distance));
                distance /= 2;
            }
            value
        }

        fn for_each(self, n: usize, mut body: impl FnMut(usize)) {
            let mut i = self.lane;
            while i < n {
                body(i);
                i += WIDTH;
            }
        }
    }

    /// A raw pointer the lane threads share (each writes only what its share says).
    #[derive(Clone, Copy)]
    pub struct Shared<T>(pub *mut T);
    // SAFETY: the lanes write disjoint elements or the leader alone writes; the barriers order the rest.
    unsafe impl<T> Send for Shared<T> {}
    // SAFETY: as above.
    unsafe impl<T> Sync for Shared<T> {}

    impl<T> Shared<T> {
        /// The pointer (a method, so a closure captures the whole `Shared`, which is `Sync`).
        pub fn ptr(self) -> *mut T {
            self.0
        }
    }

    /// Runs `body(plane, index)` for `index` in `0..count`, each index on 32 lane threads.
    pub fn launch(count: usize, body: impl Fn(ThreadLane<'_>, usize) + Sync) {
        for index in 0..count {
            let exchange = Exchange::new();
            std::thread::scope(|scope| {
                for lane in 0..WIDTH {
                    let (exchange, body) = (&exchange, &body);
                    scope.spawn(move || body(ThreadLane { lane, exchange }, index));
                }
            });
        }
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Every pair finite and within `tolerance`, relative to the larger magnitude (absolute below 1).
fn assert_close(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite() && w.is_finite(), "{what}[{i}]: {g} vs {w}");
        let scale = g.abs().max(w.abs()).max(1.0);
        assert!(
            (g - w).abs() <= tolerance * scale,
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

#[test]
fn plane_kernels_on_simulated_warps_match_the_host_launchers() {
    use draftpipe_gpu_kernels::{loss, reduce};
    use warp_on_threads::{Shared, launch};

    let mut rng = Xoshiro256PlusPlus::seed_from_u64(79);
    // 70 and 1001 columns: partial last lane rounds; 5 rows.
    let (rows, cols, vocab) = (5, 70, 1001);

    let x = values(&mut rng, rows * cols);
    let w = values(&mut rng, cols);
    let dy = values(&mut rng, rows * cols);
    let (mut y_host, mut inv_host) = (vec![f32::NAN; rows * cols], vec![f32::NAN; rows]);
    kernels::rmsnorm_forward(&x, &w, &mut y_host, &mut inv_host, 1e-6);
    let mut dx_host = x.clone();
    kernels::rmsnorm_backward_input(&x, &w, &inv_host, &dy, &mut dx_host, true);
    let (mut y, mut inv, mut dx) = (vec![f32::NAN; rows * cols], vec![f32::NAN; rows], x.clone());
    let (yp, invp, dxp) = (
        Shared(y.as_mut_ptr()),
        Shared(inv.as_mut_ptr()),
        Shared(dx.as_mut_ptr()),
    );
    let (xs, ws, dys) = (
        Shared(x.as_ptr().cast_mut()),
        Shared(w.as_ptr().cast_mut()),
        Shared(dy.as_ptr().cast_mut()),
    );
    launch(rows, |plane, row| {
        let (yp, invp, dxp, xs, ws, dys) = (yp, invp, dxp, xs, ws, dys);
        // SAFETY: buffers sized for `rows × cols`; the lanes write as the kernels' contracts say.
        unsafe {
            norm::rmsnorm_forward(
                xs.0,
                ws.0,
                yp.0,
                std::ptr::null_mut(),
                invp.0,
                cols,
                1e-6,
                plane,
                row,
            );
            norm::rmsnorm_backward_input(
                xs.0,
                ws.0,
                inv_host.as_ptr(),
                dys.0,
                dxp.0,
                std::ptr::null_mut(),
                cols,
                true,
                plane,
                row,
            );
        }
    });
    assert_eq!(bits(&y), bits(&y_host), "rmsnorm y");
    assert_eq!(bits(&inv), bits(&inv_host), "rmsnorm inv_rms");
    assert_eq!(bits(&dx), bits(&dx_host), "rmsnorm dx");

    let logits_in: Vec<f32> = values(&mut rng, rows * vocab);
    let labels: Vec<i32> = vec![3, -1, 1000, 0, 517];
    let (mut grad_host, mut loss_host) = (logits_in.clone(), vec![f32::NAN; rows]);
    kernels::vocab_loss(&mut grad_host, &labels, 0.7, &mut loss_host, vocab);
    let (mut grad, mut row_loss, scale) = (logits_in.clone(), vec![f32::NAN; rows], 0.7f32);
    let (gp, lp) = (Shared(grad.as_mut_ptr()), Shared(row_loss.as_mut_ptr()));
    launch(rows, |plane, row| {
        let (gp, lp) = (gp, lp);
        // SAFETY: `grad` holds `rows × vocab`, `labels`/`row_loss` `rows`; labels are below `vocab`.
        unsafe { loss::vocab_loss_row(gp.0, labels.as_ptr(), &scale, lp.0, vocab, plane, row) }
    });
    // The one exception to bit identity: the warp folds each logit into an online (max, Σ exp) pair while the
    // host takes two vectorisable passes (`Plane::max_and_exp_sum`), so the sums round differently.
    assert_close(&grad, &grad_host, 1e-6, "vocab loss gradient");
    assert_close(&row_loss, &loss_host, 1e-6, "vocab loss rows");

    let n: usize = 10_007;
    let chunk_len = 1000;
    let chunks = n.div_ceil(chunk_len);
    let v = values(&mut rng, n);
    let mut host_partials = vec![f32::NAN; chunks];
    let host_total = kernels::sum(&v, chunk_len, &mut host_partials);
    let (host_norm, host_clip) = kernels::grad_norm(&v, chunk_len, &mut host_partials, 5.0);
    let (mut sums, mut squares) = (vec![f32::NAN; chunks], vec![f32::NAN; chunks]);
    let (mut total, mut norm_out, mut clip) = ([f32::NAN], [f32::NAN], [f32::NAN]);
    let (sp, qp) = (Shared(sums.as_mut_ptr()), Shared(squares.as_mut_ptr()));
    launch(chunks, |plane, chunk| {
        let (sp, qp) = (sp, qp);
        // SAFETY: `v` holds `n`, the partials `chunks` elements.
        unsafe {
            reduce::sum_partials(v.as_ptr(), sp.0, n, chunk_len, plane, chunk);
            reduce::sum_squares_partials(v.as_ptr(), qp.0, n, chunk_len, plane, chunk);
        }
    });
    let (tp, np, cp) = (
        Shared(total.as_mut_ptr()),
        Shared(norm_out.as_mut_ptr()),
        Shared(clip.as_mut_ptr()),
    );
    launch(1, |plane, _| {
        let (tp, np, cp) = (tp, np, cp);
        // SAFETY: the partials hold `chunks` elements, the outputs one each.
        unsafe {
            reduce::finish_sum(sums.as_ptr(), tp.0, chunks, plane);
            reduce::finish_grad_norm(squares.as_ptr(), np.0, cp.0, chunks, 5.0, plane);
        }
    });
    assert_eq!(total[0].to_bits(), host_total.to_bits(), "sum");
    assert_eq!(norm_out[0].to_bits(), host_norm.to_bits(), "grad norm");
    assert_eq!(clip[0].to_bits(), host_clip.to_bits(), "clip scale");
}

/// The DFlash kernels' GPU launch shapes on the host: the attention kernels (a plane per query tile or key
/// tile and head) and the weighted loss (a plane per row) on simulated warps against the host launchers, and
/// the embedding gather one element per index against the host's chunks. Attention is within 1e-5 (the host
/// plane's dot products keep 8 partial sums where a warp keeps 32 lane sums: a few ulp on the scores, which
/// the exponentials turn into relative error; the delta pass, a plain plane sum, is
/// bit-identical); the loss is within 1e-6 (the softmax sums, as for `vocab_loss_row`), its `correct`
/// flags exact.
/// Rows for the statistics pass: ties for the maximum across lanes (the later lane holds the first index)
/// and inside one lane, −∞ at the start of every lane, a row of −∞ only, NaN before the maximum; each at
/// lengths below, at and past one plane's 32 lanes.
fn stats_rows(rng: &mut Xoshiro256PlusPlus) -> Vec<Vec<f32>> {
    let neg = f32::NEG_INFINITY;
    let mut rows = Vec::new();
    for n in [1usize, 7, 31, 32, 33, 100, 1001] {
        let base = values(rng, n);
        let with = |edits: &[(usize, f32)]| {
            let mut row = base.clone();
            for &(i, v) in edits {
                if i < n {
                    row[i] = v;
                }
            }
            row
        };
        // Lanes 9 and 2: a combine that kept the lower lane instead of the lower index would answer 34.
        rows.push(with(&[(9, 9.0), (34, 9.0)]));
        // One lane (3 and 35), and an earlier-lane copy later (68 is lane 4).
        rows.push(with(&[(3, 9.0), (35, 9.0), (68, 9.0)]));
        rows.push(with(&(0..40).map(|i| (i, neg)).collect::<Vec<_>>()));
        rows.push(vec![neg; n]);
        rows.push(with(&[(0, f32::NAN), (17, f32::NAN), (20, 9.0)]));
    }
    rows
}

/// The first index of the largest non-NaN element (0 when there is none) and that element.
fn first_largest(row: &[f32]) -> (usize, f32) {
    let mut best: Option<usize> = None;
    for (i, &v) in row.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|b| v > row[b]) {
            best = Some(i);
        }
    }
    best.map_or((0, f32::NEG_INFINITY), |b| (b, row[b]))
}

/// The statistics pass's argmax (fused into the online maximum and sum, the lanes combined with their indices)
/// against a separate `Plane::argmax` of the same row and a scalar scan, on simulated warps (the PTX body) and
/// on the host plane (its own three passes): the same index on every row of [`stats_rows`], the maximum exactly,
/// the sum within 1e-5 of f64 (NaN where the row holds one) and the bf16 copy of the gradient, bit for bit, the
/// gradient's nearest even rounding.
#[test]
fn fused_argmax_agrees_with_a_separate_argmax() {
    use std::sync::Mutex;

    use draftpipe_gpu_kernels::plane::{HostPlane, Plane, RowStats};
    use warp_on_threads::{Shared, launch as on_warps};

    let mut rng = Xoshiro256PlusPlus::seed_from_u64(81);
    let (label, scale) = (0usize, 0.5f32);
    for row in stats_rows(&mut rng) {
        let n = row.len();
        let (first, max) = first_largest(&row);
        // Per plane: its name, the fused statistics, the separate argmax, the gradient and its copy.
        type Run = (&'static str, RowStats, usize, Vec<f32>, Vec<u16>);
        let mut runs: Vec<Run> = Vec::new();

        let (mut x, mut x16) = (row.clone(), vec![0x7FC1u16; n]);
        // SAFETY: `x` and `x16` hold `n` elements; `label < n`.
        let stats = unsafe {
            HostPlane.softmax_gradient_in_place(x.as_mut_ptr(), x16.as_mut_ptr(), n, label, scale)
        };
        runs.push(("host", stats, HostPlane.argmax(n, |i| row[i]), x, x16));

        let (mut x, mut x16) = (row.clone(), vec![0x7FC1u16; n]);
        let (xp, x16p) = (Shared(x.as_mut_ptr()), Shared(x16.as_mut_ptr()));
        let found = Mutex::new(None);
        on_warps(1, |plane, _| {
            let (xp, x16p) = (xp, x16p);
            let separate = plane.argmax(n, |i| row[i]);
            // SAFETY: as above; each lane writes only the elements it reads.
            let stats = unsafe { plane.softmax_gradient_in_place(xp.0, x16p.0, n, label, scale) };
            if plane.is_leader() {
                *found.lock().unwrap() = Some((stats, separate));
            }
        });
        let (stats, separate) = found.into_inner().unwrap().expect("the leader reports");
        runs.push(("warp", stats, separate, x, x16));

        for (plane, stats, separate, x, x16) in runs {
            let what = format!("{plane}, n = {n}, row {row:?}");
            assert_eq!(stats.argmax, first, "fused argmax, {what}");
            assert_eq!(separate, first, "separate argmax, {what}");
            assert_eq!(stats.max.to_bits(), max.to_bits(), "maximum, {what}");
            if row.iter().any(|v| v.is_nan()) {
                assert!(stats.sum.is_nan(), "NaN must surface in the sum, {what}");
            } else if max > f32::NEG_INFINITY {
                let exact: f64 = row.iter().map(|&v| (v as f64 - max as f64).exp()).sum();
                let err = (stats.sum as f64 - exact).abs() / exact;
                assert!(err <= 1e-5, "sum {} vs {exact}: {err:e}, {what}", stats.sum);
            }
            for (i, (&g, &c)) in x.iter().zip(&x16).enumerate() {
                let want = half::bf16::from_f32(g).to_bits();
                assert_eq!(c, want, "bf16 copy of element {i} ({g:e}), {what}");
            }
        }
    }
}

#[test]
fn dflash_kernels_on_gpu_launch_shapes_match_the_host_launchers() {
    use draftpipe_gpu_kernels::attention::{self, KEY_TILE, QUERY_TILE};
    use draftpipe_gpu_kernels::{embedding, loss};
    use draftpipe_runtime::backend::cpu::kernels::launch;
    use warp_on_threads::{Shared, launch as on_warps};

    let mut rng = Xoshiro256PlusPlus::seed_from_u64(80);
    // 11 queries: a partial query tile; 9 context keys: a partial key tile; head_dim 40: a partial lane round.
    let (queries, context, heads, kv_heads, head_dim, scale) = (11usize, 9usize, 4, 2, 40, 0.16f32);
    // Inputs in [-1, 1): scores of a few units, as after RMSNorm'd projections.
    let mut unit = |n: usize| -> Vec<f32> { values(&mut rng, n).iter().map(|v| v / 4.0).collect() };
    let q = unit(queries * heads * head_dim);
    let (k_ctx, v_ctx) = (
        unit(context * kv_heads * head_dim),
        unit(context * kv_heads * head_dim),
    );
    let (k_blk, v_blk) = (
        unit(queries * kv_heads * head_dim),
        unit(queries * kv_heads * head_dim),
    );
    let ranges: Vec<u32> = (0..queries as u32)
        .flat_map(|r| [0, (r * 3) % 10, r / 4 * 4, (r / 4 * 4 + 4).min(11)])
        .collect();
    let key_ranges_ctx: Vec<u32> = (0..context as u32).flat_map(|c| [c / 2, 11]).collect();
    let dout = values(&mut rng, q.len());
    let rows = queries * heads;

    let (mut out_host, mut lse_host) = (vec![f32::NAN; q.len()], vec![f32::NAN; rows]);
    launch::attention_forward(
        &q,
        &k_ctx,
        &v_ctx,
        &k_blk,
        &v_blk,
        &ranges,
        &mut out_host,
        &mut lse_host,
        queries,
        context,
        heads,
        kv_heads,
        head_dim,
        scale,
    );
    let mut delta_host = vec![f32::NAN; rows];
    launch::attention_delta(&out_host, &dout, &mut delta_host, head_dim, rows);
    let mut dq_host = vec![f32::NAN; q.len()];
    launch::attention_backward_q(
        &q,
        &k_ctx,
        &v_ctx,
        &k_blk,
        &v_blk,
        &ranges,
        &dout,
        &lse_host,
        &delta_host,
        &mut dq_host,
        queries,
        context,
        heads,
        kv_heads,
        head_dim,
        scale,
    );
    let (mut dk_host, mut dv_host) = (vec![f32::NAN; k_ctx.len()], vec![f32::NAN; v_ctx.len()]);
    launch::attention_backward_kv(
        &q,
        &dout,
        &lse_host,
        &delta_host,
        &k_ctx,
        &v_ctx,
        &key_ranges_ctx,
        &mut dk_host,
        &mut dv_host,
        context,
        queries,
        heads,
        kv_heads,
        head_dim,
        scale,
    );
    assert!(
        out_host
            .iter()
            .chain(&dq_host)
            .chain(&dk_host)
            .all(|v| v.is_finite())
    );

    let (mut out, mut lse, mut delta) = (
        vec![f32::NAN; q.len()],
        vec![f32::NAN; rows],
        vec![f32::NAN; rows],
    );
    let (mut dq, mut dk, mut dv) = (
        vec![f32::NAN; q.len()],
        vec![f32::NAN; k_ctx.len()],
        vec![f32::NAN; v_ctx.len()],
    );
    let (op, lp, dp) = (
        Shared(out.as_mut_ptr()),
        Shared(lse.as_mut_ptr()),
        Shared(delta.as_mut_ptr()),
    );
    on_warps(queries.div_ceil(QUERY_TILE) * heads, |plane, index| {
        let (op, lp) = (op, lp);
        // SAFETY: the buffers hold the layouts of these sizes; each plane writes its own tile's rows.
        unsafe {
            attention::attention_forward(
                q.as_ptr(),
                k_ctx.as_ptr(),
                v_ctx.as_ptr(),
                k_blk.as_ptr(),
                v_blk.as_ptr(),
                ranges.as_ptr(),
                op.0,
                lp.0,
                queries,
                context,
                heads,
                kv_heads,
                head_dim,
                scale,
                plane,
                index,
            )
        }
    });
    assert_close(&out, &out_host, 1e-5, "attention output");
    assert_close(&lse, &lse_host, 1e-5, "attention lse");
    on_warps(rows, |plane, index| {
        // SAFETY: `out`, `dout` hold `rows · head_dim`, `delta` `rows`.
        unsafe {
            attention::attention_delta(
                out_host.as_ptr(),
                dout.as_ptr(),
                dp.ptr(),
                head_dim,
                plane,
                index,
            )
        }
    });
    assert_eq!(bits(&delta), bits(&delta_host), "attention delta");
    let (qp, kp, vp) = (
        Shared(dq.as_mut_ptr()),
        Shared(dk.as_mut_ptr()),
        Shared(dv.as_mut_ptr()),
    );
    on_warps(queries.div_ceil(QUERY_TILE) * heads, |plane, index| {
        // SAFETY: as for the forward.
        unsafe {
            attention::attention_backward_q(
                q.as_ptr(),
                k_ctx.as_ptr(),
                v_ctx.as_ptr(),
                k_blk.as_ptr(),
                v_blk.as_ptr(),
                ranges.as_ptr(),
                dout.as_ptr(),
                lse_host.as_ptr(),
                delta_host.as_ptr(),
                qp.ptr(),
                queries,
                context,
                heads,
                kv_heads,
                head_dim,
                scale,
                plane,
                index,
            )
        }
    });
    assert_close(&dq, &dq_host, 1e-5, "attention dq");
    on_warps(context.div_ceil(KEY_TILE) * kv_heads, |plane, index| {
        let (kp, vp) = (kp, vp);
        // SAFETY: as for the forward; each plane writes its own key tile's rows.
        unsafe {
            attention::attention_backward_kv(
                q.as_ptr(),
                dout.as_ptr(),
                lse_host.as_ptr(),
                delta_host.as_ptr(),
                k_ctx.as_ptr(),
                v_ctx.as_ptr(),
                key_ranges_ctx.as_ptr(),
                kp.0,
                vp.0,
                context,
                queries,
                heads,
                kv_heads,
                head_dim,
                scale,
                plane,
                index,
            )
        }
    });
    assert_close(&dk, &dk_host, 1e-5, "attention dk");
    assert_close(&dv, &dv_host, 1e-5, "attention dv");

    let (loss_rows, vocab) = (5, 1001);
    let logits_in = values(&mut rng, loss_rows * vocab);
    let labels: Vec<i32> = vec![3, -1, 1000, 0, 517];
    let weights = [0.5f32, 1.0, 0.25, 2.0, 0.75];
    let norm = 0.4f32;
    let (mut grad_host, mut loss_host, mut correct_host) = (
        logits_in.clone(),
        vec![f32::NAN; loss_rows],
        vec![f32::NAN; loss_rows],
    );
    kernels::weighted_vocab_loss(
        &mut grad_host,
        &labels,
        &weights,
        norm,
        &mut loss_host,
        &mut correct_host,
        vocab,
    );
    let (mut grad, mut row_loss, mut correct) = (
        logits_in,
        vec![f32::NAN; loss_rows],
        vec![f32::NAN; loss_rows],
    );
    let (gp, lp, cp) = (
        Shared(grad.as_mut_ptr()),
        Shared(row_loss.as_mut_ptr()),
        Shared(correct.as_mut_ptr()),
    );
    on_warps(loss_rows, |plane, row| {
        let (gp, lp, cp) = (gp, lp, cp);
        // SAFETY: `grad` holds `rows × vocab`, the per-row buffers `rows`; labels are below `vocab`.
        unsafe {
            loss::weighted_vocab_loss_row(
                gp.0,
                std::ptr::null_mut(),
                labels.as_ptr(),
                weights.as_ptr(),
                &norm,
                lp.0,
                cp.0,
                vocab,
                plane,
                row,
            )
        }
    });
    assert_close(&grad, &grad_host, 1e-6, "weighted loss gradient");
    assert_close(&row_loss, &loss_host, 1e-6, "weighted loss rows");
    assert_eq!(correct, correct_host, "weighted loss correct");

    let (vocab, hidden, ids) = (50usize, 37usize, [3u32, 49, 0, 17, 3]);
    let table = values(&mut rng, vocab * hidden);
    let n = ids.len() * hidden;
    let mut gathered_host = vec![f32::NAN; n];
    kernels::embedding_gather(&table, &ids, &mut gathered_host);
    let mut gathered = vec![f32::NAN; n];
    for index in 0..n {
        // SAFETY: `table` holds `vocab · hidden`, `ids` `n / hidden`, `gathered` `n`; `index < n`.
        unsafe {
            embedding::embedding_gather(
                table.as_ptr(),
                ids.as_ptr(),
                gathered.as_mut_ptr(),
                std::ptr::null_mut(),
                vocab,
                hidden,
                n,
                1,
                index,
            )
        }
    }
    assert_eq!(bits(&gathered), bits(&gathered_host), "embedding gather");

    let (rows, heads, head_dim) = (9usize, 3usize, 22usize);
    let positions: Vec<u32> = (0..rows as u32).map(|r| r * 97 % 1000).collect();
    let x = values(&mut rng, rows * heads * head_dim);
    let mut rotated_host = x.clone();
    kernels::launch::rope(&positions, &mut rotated_host, rows, heads, head_dim, 1e4, 0);
    let mut rotated = x;
    let pairs = rows * head_dim / 2;
    for index in 0..pairs {
        // SAFETY: `rotated` holds `rows · heads · head_dim`, `positions` `rows`; `index < pairs`.
        unsafe {
            draftpipe_gpu_kernels::rope::rope(
                rotated.as_mut_ptr(),
                std::ptr::null_mut(),
                positions.as_ptr(),
                heads,
                head_dim,
                1e4,
                false,
                pairs,
                1,
                index,
            )
        }
    }
    assert_eq!(bits(&rotated), bits(&rotated_host), "rope");
}
