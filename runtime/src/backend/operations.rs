//! The operations a model calls over the kernel table, written once for every backend: provided methods of the
//! [`Backend`](super::Backend) trait, expanded inside it by [`kernel_operations!`] (so a model calls
//! `backend.rmsnorm_forward(..)` on any `B: Backend` and no backend implements them).
//!
//! ```text
//!  model ──▶ backend.rmsnorm_forward(x, weight, y, inv_rms, eps)   sizes derived from the views, checked once
//!              └──▶ self.launch(Kernel::rmsnorm_forward { x: Self::read(x), …, cols, eps, rows })
//!                     ├──▶ CPU:  launch::rmsnorm_forward(&[f32]…)         (cpu/kernels.rs, generated)
//!                     └──▶ CUDA: Launcher::rmsnorm_forward(DevicePtr…)    (cuda/launch.rs, generated)
//! ```
//!
//! A size mismatch is a bug in the model (it sizes every view from one layout): the checks panic, alike on every
//! backend. The composites (the RMSNorm weight gradient's and the reductions' two passes, the attention
//! backward's three kernels) are the table's launches in order; the CPU overrides `rope` and attention with its
//! own bodies (`draftpipe_gpu_kernels::table::HOST_BODIES`). EAGLE-3's operations are the same kind, in
//! `backend/eagle3.rs`.

/// The shared operations as provided [`Backend`](super::Backend) methods. Expanded only inside the trait in
/// `backend/mod.rs`, whose imports name the types used here.
macro_rules! kernel_operations {
    () => {
        /// RMSNorm forward over `inv_rms.len()` rows of `weight.len()` columns.
        fn rmsnorm_forward(
            &mut self,
            x: Src<'_, Self, f32>,
            weight: Src<'_, Self, f32>,
            y: Dst<'_, Self, f32>,
            inv_rms: Dst<'_, Self, f32>,
            eps: f32,
        ) -> BackendResult {
            let (rows, cols) = (inv_rms.len(), weight.len());
            assert!(
                x.len() == rows * cols && y.len() == rows * cols,
                "rmsnorm_forward: sizes"
            );
            self.launch(Kernel::rmsnorm_forward {
                x: Self::read(x),
                weight: Self::read(weight),
                y: Self::write(y),
                inv_rms: Self::write(inv_rms),
                cols,
                eps,
                rows,
            })
        }

        /// [`rmsnorm_forward`](Self::rmsnorm_forward) that also writes `y` rounded to bf16 into `y16` in the same
        /// pass (the operand of the products that read the norm's output on CUDA at `bf16` precision).
        fn rmsnorm_forward_bf16(
            &mut self,
            x: Src<'_, Self, f32>,
            weight: Src<'_, Self, f32>,
            (y, y16): (Dst<'_, Self, f32>, Dst<'_, Self, half::bf16>),
            inv_rms: Dst<'_, Self, f32>,
            eps: f32,
        ) -> BackendResult {
            let (rows, cols) = (inv_rms.len(), weight.len());
            assert!(
                x.len() == rows * cols && y.len() == rows * cols && y16.len() == rows * cols,
                "rmsnorm_forward_bf16: sizes"
            );
            self.launch(Kernel::rmsnorm_forward_bf16 {
                x: Self::read(x),
                weight: Self::read(weight),
                y: Self::write(y),
                y16: Self::reinterpret_write(Self::write(y16)),
                inv_rms: Self::write(inv_rms),
                cols,
                eps,
                rows,
            })
        }

        /// `out = x` rounded to bf16 (nearest even): the 16-bit copy of an f32 product operand that no kernel
        /// writes in 16 bits itself (the attention output; the trained weights at load and resume).
        fn round_to_bf16(
            &mut self,
            x: Src<'_, Self, f32>,
            out: Dst<'_, Self, half::bf16>,
        ) -> BackendResult {
            let n = x.len();
            assert_eq!(out.len(), n, "round_to_bf16: sizes");
            self.launch(Kernel::round_to_half {
                x: Self::read(x),
                out: Self::reinterpret_write(Self::write(out)),
                n,
                format: draftpipe_gpu_kernels::convert::FORMAT_BF16,
            })
        }

        /// RMSNorm input gradient (`dx = …`, or `dx += …` with `accumulate`).
        #[allow(clippy::too_many_arguments)]
        fn rmsnorm_backward_input(
            &mut self,
            x: Src<'_, Self, f32>,
            weight: Src<'_, Self, f32>,
            inv_rms: Src<'_, Self, f32>,
            dy: Src<'_, Self, f32>,
            dx: Dst<'_, Self, f32>,
            accumulate: bool,
        ) -> BackendResult {
            let (rows, cols) = (inv_rms.len(), weight.len());
            let n = rows * cols;
            assert!(
                x.len() == n && dy.len() == n && dx.len() == n,
                "rmsnorm_backward_input: sizes"
            );
            self.launch(Kernel::rmsnorm_backward_input {
                x: Self::read(x),
                weight: Self::read(weight),
                inv_rms: Self::read(inv_rms),
                dy: Self::read(dy),
                dx: Self::write(dx),
                cols,
                accumulate: u32::from(accumulate),
                rows,
            })
        }

        /// [`rmsnorm_backward_input`](Self::rmsnorm_backward_input) that also writes the final `dx` rounded to
        /// bf16 into `dx16` in the same pass (the gradient's operand of the backward products that read it on
        /// CUDA at `bf16` precision).
        #[allow(clippy::too_many_arguments)]
        fn rmsnorm_backward_input_bf16(
            &mut self,
            x: Src<'_, Self, f32>,
            weight: Src<'_, Self, f32>,
            inv_rms: Src<'_, Self, f32>,
            dy: Src<'_, Self, f32>,
            (dx, dx16): (Dst<'_, Self, f32>, Dst<'_, Self, half::bf16>),
            accumulate: bool,
        ) -> BackendResult {
            let (rows, cols) = (inv_rms.len(), weight.len());
            let n = rows * cols;
            assert!(
                x.len() == n && dy.len() == n && dx.len() == n && dx16.len() == n,
                "rmsnorm_backward_input_bf16: sizes"
            );
            self.launch(Kernel::rmsnorm_backward_input_bf16 {
                x: Self::read(x),
                weight: Self::read(weight),
                inv_rms: Self::read(inv_rms),
                dy: Self::read(dy),
                dx: Self::write(dx),
                dx16: Self::reinterpret_write(Self::write(dx16)),
                cols,
                accumulate: u32::from(accumulate),
                rows,
            })
        }

        /// RMSNorm weight gradient (overwritten) by the two-pass reduction through `partials`.
        fn rmsnorm_weight_grad(
            &mut self,
            x: Src<'_, Self, f32>,
            inv_rms: Src<'_, Self, f32>,
            dy: Src<'_, Self, f32>,
            dweight: Dst<'_, Self, f32>,
            mut partials: Dst<'_, Self, f32>,
        ) -> BackendResult {
            let (rows, cols) = (inv_rms.len(), dweight.len());
            let chunks = rows.div_ceil(NORM_ROWS_PER_CHUNK);
            assert!(
                x.len() == rows * cols
                    && dy.len() == rows * cols
                    && partials.len() >= chunks * cols,
                "rmsnorm_weight_grad: sizes"
            );
            self.launch(Kernel::rmsnorm_weight_grad_partials {
                x: Self::read(x),
                inv_rms: Self::read(inv_rms),
                dy: Self::read(dy),
                partials: Self::write(partials.reborrow()),
                rows,
                cols,
                rows_per_chunk: NORM_ROWS_PER_CHUNK,
            })?;
            self.launch(Kernel::column_sums {
                values: Self::read(partials.into_read()),
                out: Self::write(dweight),
                rows: chunks,
                cols,
                accumulate: 0,
            })
        }

        /// `act = silu(gate) ⊙ up` over rows `[gate | up]` of width `2·inter`.
        fn swiglu_forward(
            &mut self,
            gate_up: Src<'_, Self, f32>,
            act: Dst<'_, Self, f32>,
            inter: usize,
        ) -> BackendResult {
            let n = act.len();
            assert!(
                gate_up.len() == 2 * n && n.is_multiple_of(inter.max(1)),
                "swiglu_forward: sizes"
            );
            self.launch(Kernel::swiglu_forward {
                gate_up: Self::read(gate_up),
                act: Self::write(act),
                inter,
                n,
            })
        }

        /// [`swiglu_forward`](Self::swiglu_forward) that also writes `act` rounded to bf16 into `act16` in the
        /// same pass (the down projection's operand on CUDA at `bf16` precision).
        fn swiglu_forward_bf16(
            &mut self,
            gate_up: Src<'_, Self, f32>,
            (act, act16): (Dst<'_, Self, f32>, Dst<'_, Self, half::bf16>),
            inter: usize,
        ) -> BackendResult {
            let n = act.len();
            assert!(
                gate_up.len() == 2 * n && act16.len() == n && n.is_multiple_of(inter.max(1)),
                "swiglu_forward_bf16: sizes"
            );
            self.launch(Kernel::swiglu_forward_bf16 {
                gate_up: Self::read(gate_up),
                act: Self::write(act),
                act16: Self::reinterpret_write(Self::write(act16)),
                inter,
                n,
            })
        }

        /// Gradients of both SwiGLU inputs.
        fn swiglu_backward(
            &mut self,
            gate_up: Src<'_, Self, f32>,
            dact: Src<'_, Self, f32>,
            dgate_up: Dst<'_, Self, f32>,
            inter: usize,
        ) -> BackendResult {
            let n = dact.len();
            assert!(
                gate_up.len() == 2 * n
                    && dgate_up.len() == gate_up.len()
                    && n.is_multiple_of(inter.max(1)),
                "swiglu_backward: sizes"
            );
            self.launch(Kernel::swiglu_backward {
                gate_up: Self::read(gate_up),
                dact: Self::read(dact),
                dgate_up: Self::write(dgate_up),
                inter,
                n,
            })
        }

        /// [`swiglu_backward`](Self::swiglu_backward) that also writes `dgate_up` rounded to bf16 into
        /// `dgate_up16` in the same pass (the `[gate; up]` gradient products' operand on CUDA at `bf16`).
        fn swiglu_backward_bf16(
            &mut self,
            gate_up: Src<'_, Self, f32>,
            dact: Src<'_, Self, f32>,
            (dgate_up, dgate_up16): (Dst<'_, Self, f32>, Dst<'_, Self, half::bf16>),
            inter: usize,
        ) -> BackendResult {
            let n = dact.len();
            assert!(
                gate_up.len() == 2 * n
                    && dgate_up.len() == gate_up.len()
                    && dgate_up16.len() == gate_up.len()
                    && n.is_multiple_of(inter.max(1)),
                "swiglu_backward_bf16: sizes"
            );
            self.launch(Kernel::swiglu_backward_bf16 {
                gate_up: Self::read(gate_up),
                dact: Self::read(dact),
                dgate_up: Self::write(dgate_up),
                dgate_up16: Self::reinterpret_write(Self::write(dgate_up16)),
                inter,
                n,
            })
        }

        /// `h = z + silu(a)`.
        fn head_residual_forward(
            &mut self,
            z: Src<'_, Self, f32>,
            a: Src<'_, Self, f32>,
            h: Dst<'_, Self, f32>,
        ) -> BackendResult {
            let n = h.len();
            assert!(z.len() == n && a.len() == n, "head_residual_forward: sizes");
            self.launch(Kernel::head_residual_forward {
                z: Self::read(z),
                a: Self::read(a),
                h: Self::write(h),
                n,
            })
        }

        /// `da = dh · silu'(a)` and `dz += dh`.
        ///
        /// `da` is a separate buffer although the kernel allows `da = dh`: distinct buffers pass the compiler's
        /// runtime overlap check on the host, so the loop runs vectorised (in place it measured 4× slower).
        fn head_residual_backward(
            &mut self,
            a: Src<'_, Self, f32>,
            dh: Src<'_, Self, f32>,
            da: Dst<'_, Self, f32>,
            dz: Dst<'_, Self, f32>,
        ) -> BackendResult {
            let n = a.len();
            assert!(
                dh.len() == n && da.len() == n && dz.len() == n,
                "head_residual_backward: sizes"
            );
            self.launch(Kernel::head_residual_backward {
                a: Self::read(a),
                dh: Self::read(dh),
                da: Self::write(da),
                dz: Self::write(dz),
                n,
            })
        }

        /// Labels `[heads, tokens]` from the batch's ids, mask and sequence lengths.
        #[allow(clippy::too_many_arguments)]
        fn build_labels(
            &mut self,
            input_ids: Src<'_, Self, u32>,
            loss_mask: Src<'_, Self, u8>,
            seq_lens: Src<'_, Self, u32>,
            labels: Dst<'_, Self, i32>,
            padded_len: usize,
            vocab: usize,
        ) -> BackendResult {
            let tokens = input_ids.len();
            assert!(
                padded_len > 0
                    && tokens == seq_lens.len() * padded_len
                    && loss_mask.len() == tokens
                    && labels.len().is_multiple_of(tokens.max(1)),
                "build_labels: sizes"
            );
            let heads = labels.len() / tokens.max(1);
            self.launch(Kernel::build_labels {
                input_ids: Self::read(input_ids),
                loss_mask: Self::read(loss_mask),
                seq_lens: Self::read(seq_lens),
                labels: Self::write(labels),
                padded_len,
                tokens,
                vocab,
                heads,
            })
        }

        /// Valid-label counts and loss scales per head.
        fn head_loss_scales(
            &mut self,
            labels: Src<'_, Self, i32>,
            head_decay: f32,
            counts: Dst<'_, Self, u32>,
            scales: Dst<'_, Self, f32>,
        ) -> BackendResult {
            let heads = counts.len();
            assert!(
                heads > 0 && scales.len() == heads && labels.len().is_multiple_of(heads),
                "head_loss_scales: sizes"
            );
            let tokens = labels.len() / heads;
            self.launch(Kernel::head_loss_scales {
                labels: Self::read(labels),
                counts: Self::write(counts),
                scales: Self::write(scales),
                tokens,
                heads,
                head_decay,
            })
        }

        /// Fused cross-entropy of a logits chunk, gradient in place; `scale` is one device scalar. Labels are
        /// `< vocab` or negative (ignored).
        fn vocab_loss(
            &mut self,
            logits: Dst<'_, Self, f32>,
            labels: Src<'_, Self, i32>,
            scale: Src<'_, Self, f32>,
            row_loss: Dst<'_, Self, f32>,
            vocab: usize,
        ) -> BackendResult {
            let rows = labels.len();
            assert!(
                vocab > 0
                    && logits.len() == rows * vocab
                    && row_loss.len() == rows
                    && scale.len() == 1,
                "vocab_loss: sizes"
            );
            self.launch(Kernel::vocab_loss_row {
                labels: Self::read(labels),
                scale: Self::read(scale),
                logits: Self::write(logits),
                row_loss: Self::write(row_loss),
                vocab,
                rows,
            })
        }

        /// `out[0] = Σ values` (deterministic, two passes through `partials`, in chunks of [`REDUCE_CHUNK`] or
        /// longer: [`partial_chunk_len`]).
        fn sum(
            &mut self,
            values: Src<'_, Self, f32>,
            mut partials: Dst<'_, Self, f32>,
            out: Dst<'_, Self, f32>,
        ) -> BackendResult {
            let n = values.len();
            let chunk_len = partial_chunk_len(n, REDUCE_CHUNK);
            let chunks = n.div_ceil(chunk_len);
            assert!(partials.len() >= chunks && out.len() == 1, "sum: sizes");
            self.launch(Kernel::sum_partials {
                values: Self::read(values),
                partials: Self::write(partials.reborrow()),
                n,
                chunk_len,
            })?;
            self.launch(Kernel::finish_sum {
                partials: Self::read(partials.into_read()),
                out: Self::write(out),
                count: chunks,
            })
        }

        /// `norm_and_clip = [‖values‖₂, clip scale for max_norm]` (two passes through `partials`, chunked as
        /// [`Backend::sum`]; `max_norm ≤ 0`: no clipping).
        fn grad_norm(
            &mut self,
            values: Src<'_, Self, f32>,
            mut partials: Dst<'_, Self, f32>,
            max_norm: f32,
            norm_and_clip: Dst<'_, Self, f32>,
        ) -> BackendResult {
            let n = values.len();
            let chunk_len = partial_chunk_len(n, REDUCE_CHUNK);
            let chunks = n.div_ceil(chunk_len);
            assert!(
                partials.len() >= chunks && norm_and_clip.len() == 2,
                "grad_norm: sizes"
            );
            self.launch(Kernel::sum_squares_partials {
                values: Self::read(values),
                partials: Self::write(partials.reborrow()),
                n,
                chunk_len,
            })?;
            let (norm, clip_scale) = Self::split_write(Self::write(norm_and_clip), 1);
            self.launch(Kernel::finish_grad_norm {
                partials: Self::read(partials.into_read()),
                norm,
                clip_scale,
                count: chunks,
                max_norm,
            })
        }

        /// Advances AdamW's device state `[steps, β1^steps, β2^steps]` and writes the step's scalars (`step`: the
        /// seven floats of an [`AdamWStep`]) when the gradient norm is finite; changes nothing on a skipped step.
        fn adamw_advance(
            &mut self,
            grad_norm: Src<'_, Self, f32>,
            hyper: AdamWHyper,
            state: Dst<'_, Self, f64>,
            step: Dst<'_, Self, f32>,
        ) -> BackendResult {
            assert!(
                grad_norm.len() == 1 && state.len() == 3 && step.len() == ADAMW_STEP_FLOATS,
                "adamw_advance: sizes"
            );
            let (constants, schedule) = (hyper.constants(), hyper.schedule());
            self.launch(Kernel::adamw_advance {
                grad_norm: Self::read(grad_norm),
                state: Self::write(state),
                step: Self::reinterpret_write(Self::write(step)),
                lr: constants.lr,
                beta1: constants.beta1,
                beta2: constants.beta2,
                eps: constants.eps,
                weight_decay: constants.weight_decay,
                schedule: schedule.kind,
                warmup: schedule.warmup,
                total: schedule.total,
            })
        }

        /// One fused AdamW pass (a no-op when the norm is not finite); with `params16`, the same pass also
        /// writes the updated parameters rounded to bf16 there (the copy CUDA's 16-bit products read).
        #[allow(clippy::too_many_arguments)]
        fn adamw_update(
            &mut self,
            (params, params16): (Dst<'_, Self, f32>, Option<Dst<'_, Self, half::bf16>>),
            grads: Src<'_, Self, f32>,
            exp_avg: Dst<'_, Self, f32>,
            exp_avg_sq: Dst<'_, Self, f32>,
            norm_and_clip: Src<'_, Self, f32>,
            step: Src<'_, Self, f32>,
        ) -> BackendResult {
            let n = params.len();
            assert!(
                grads.len() == n
                    && exp_avg.len() == n
                    && exp_avg_sq.len() == n
                    && params16.as_ref().is_none_or(|copy| copy.len() == n)
                    && norm_and_clip.len() == 2
                    && step.len() == ADAMW_STEP_FLOATS,
                "adamw_update: sizes"
            );
            if let Some(params16) = params16 {
                return self.launch(Kernel::adamw_update_bf16 {
                    grads: Self::read(grads),
                    grad_norm: Self::read(norm_and_clip.at(0, 1)),
                    clip_scale: Self::read(norm_and_clip.at(1, 1)),
                    hyper: Self::reinterpret_read(Self::read(step)),
                    params: Self::write(params),
                    params16: Self::reinterpret_write(Self::write(params16)),
                    exp_avg: Self::write(exp_avg),
                    exp_avg_sq: Self::write(exp_avg_sq),
                    n,
                });
            }
            self.launch(Kernel::adamw_update {
                grads: Self::read(grads),
                grad_norm: Self::read(norm_and_clip.at(0, 1)),
                clip_scale: Self::read(norm_and_clip.at(1, 1)),
                hyper: Self::reinterpret_read(Self::read(step)),
                params: Self::write(params),
                exp_avg: Self::write(exp_avg),
                exp_avg_sq: Self::write(exp_avg_sq),
                n,
            })
        }

        /// `out[r] = table[ids[r]]`: rows of a frozen embedding table `[vocab, hidden]` by token id
        /// (`hidden = out.len() / ids.len()`; no gradient), or any whole rows by index.
        fn embedding_gather(
            &mut self,
            table: Src<'_, Self, f32>,
            ids: Src<'_, Self, u32>,
            out: Dst<'_, Self, f32>,
        ) -> BackendResult {
            let (vocab, hidden, n) =
                crate::backend::operations::gather_shape(table.len(), ids.len(), out.len());
            self.launch(Kernel::embedding_gather {
                table: Self::read(table),
                ids: Self::read(ids),
                out: Self::write(out),
                vocab,
                hidden,
                n,
            })
        }

        /// [`Backend::embedding_gather`] into bf16 only (each element rounded to nearest even): gathered rows as
        /// a 16-bit product operand (the head's rows on CUDA at `bf16`, `backend::head`).
        fn embedding_gather_bf16(
            &mut self,
            table: Src<'_, Self, f32>,
            ids: Src<'_, Self, u32>,
            out: Dst<'_, Self, half::bf16>,
        ) -> BackendResult {
            let (vocab, hidden, n) =
                crate::backend::operations::gather_shape(table.len(), ids.len(), out.len());
            self.launch(Kernel::embedding_gather_bf16 {
                table: Self::read(table),
                ids: Self::read(ids),
                out16: Self::reinterpret_write(Self::write(out)),
                vocab,
                hidden,
                n,
            })
        }

        /// RoPE in place over `x = [positions.len(), heads, head_dim]` (Hugging Face's `rotate_half` pairs
        /// `(j, j + head_dim/2)`, frequency `theta^(−2j/head_dim)`); `inverse` rotates back (the backward).
        /// The CPU has its own body (`HOST_BODIES`).
        fn rope(
            &mut self,
            x: Dst<'_, Self, f32>,
            positions: Src<'_, Self, u32>,
            theta: f32,
            heads: usize,
            head_dim: usize,
            inverse: bool,
        ) -> BackendResult {
            let rows = positions.len();
            assert!(
                x.len() == rows * heads * head_dim && head_dim.is_multiple_of(2) && theta > 0.0,
                "rope: sizes"
            );
            self.launch(Kernel::rope {
                positions: Self::read(positions),
                x: Self::write(x),
                rows,
                heads,
                head_dim,
                theta,
                inverse: u32::from(inverse),
            })
        }

        /// [`Backend::rope`] forward that also writes the rotated `x` rounded to bf16 into `copy` (the same pass,
        /// the same rotation: `x` ends bit-equal to [`Backend::rope`]'s), the flash kernels' q or k operand on
        /// CUDA at `bf16` (`backend/flash.rs`). Every backend runs the table's body: only the flash path calls
        /// it, which the CPU's steps never take.
        fn rope_bf16(
            &mut self,
            (x, copy): (Dst<'_, Self, f32>, Dst<'_, Self, half::bf16>),
            positions: Src<'_, Self, u32>,
            theta: f32,
            heads: usize,
            head_dim: usize,
        ) -> BackendResult {
            let rows = positions.len();
            assert!(
                x.len() == rows * heads * head_dim
                    && copy.len() == x.len()
                    && head_dim.is_multiple_of(2)
                    && theta > 0.0,
                "rope_bf16: sizes"
            );
            self.launch(Kernel::rope_bf16 {
                positions: Self::read(positions),
                x: Self::write(x),
                x16: Self::reinterpret_write(Self::write(copy)),
                rows,
                heads,
                head_dim,
                theta,
                inverse: 0,
            })
        }

        /// Weighted fused cross-entropy of a logits chunk `[rows, vocab]`: the gradient
        /// `weights[r] · norm · (softmax − onehot)` in place, `row_loss = weights[r] · norm · CE`, `correct = 1`
        /// where the row's argmax is its label (labels −1: zero gradient, loss and `correct`); `norm` is one
        /// device scalar, `1 / Σ weights`. With `logits16` the gradient is also written rounded to bf16 there,
        /// in the same pass (the 16-bit operand of the product that reads it, on CUDA at `bf16`).
        #[allow(clippy::too_many_arguments)]
        fn weighted_vocab_loss(
            &mut self,
            (logits, logits16): (Dst<'_, Self, f32>, Option<Dst<'_, Self, half::bf16>>),
            labels: Src<'_, Self, i32>,
            weights: Src<'_, Self, f32>,
            norm: Src<'_, Self, f32>,
            row_loss: Dst<'_, Self, f32>,
            correct: Dst<'_, Self, f32>,
            vocab: usize,
        ) -> BackendResult {
            let rows = labels.len();
            assert!(
                vocab > 0
                    && logits.len() == rows * vocab
                    && logits16.as_ref().is_none_or(|c| c.len() == rows * vocab)
                    && weights.len() == rows
                    && norm.len() == 1
                    && row_loss.len() == rows
                    && correct.len() == rows,
                "weighted_vocab_loss: sizes"
            );
            match logits16 {
                None => self.launch(Kernel::weighted_vocab_loss_row {
                    labels: Self::read(labels),
                    weights: Self::read(weights),
                    norm: Self::read(norm),
                    logits: Self::write(logits),
                    row_loss: Self::write(row_loss),
                    correct: Self::write(correct),
                    vocab,
                    rows,
                }),
                Some(logits16) => self.launch(Kernel::weighted_vocab_loss_row_bf16 {
                    labels: Self::read(labels),
                    weights: Self::read(weights),
                    norm: Self::read(norm),
                    logits: Self::write(logits),
                    logits16: Self::reinterpret_write(Self::write(logits16)),
                    row_loss: Self::write(row_loss),
                    correct: Self::write(correct),
                    vocab,
                    rows,
                }),
            }
        }

        /// `accepted[0]`: the accepted prefixes of `blocks` blocks summed, block `b`'s slot `k` at `correct[b ·
        /// block_stride + k · slot_stride]` (the loss kernels' flags; the first 0 ends a block's prefix). The
        /// exact acceptance length's numerator, left on the device with the step's other scalars.
        fn accepted_prefix_sum(
            &mut self,
            correct: Src<'_, Self, f32>,
            accepted: Dst<'_, Self, f32>,
            (blocks, slots): (usize, usize),
            (block_stride, slot_stride): (usize, usize),
        ) -> BackendResult {
            assert!(
                accepted.len() == 1
                    && correct.len()
                        >= draftpipe_gpu_kernels::acceptance::strided_len(
                            blocks,
                            slots,
                            block_stride,
                            slot_stride
                        ),
                "accepted_prefix_sum: sizes"
            );
            self.launch(Kernel::accepted_prefix_sum {
                correct: Self::read(correct),
                accepted: Self::write(accepted),
                blocks,
                slots,
                block_stride,
                slot_stride,
            })
        }

        /// Attention with two key ranges per query (see [`attention`]): `out [Q, heads, head_dim]` and the
        /// log-sum-exp `lse [Q, heads]` the backward reads (−∞ for a query without keys, whose output is 0). The
        /// CPU has its own body (`HOST_BODIES`).
        fn attention_forward(
            &mut self,
            inputs: AttentionInputs<'_, Self>,
            shape: AttentionShape,
            out: Dst<'_, Self, f32>,
            lse: Dst<'_, Self, f32>,
        ) -> BackendResult {
            let AttentionSizes { queries, context } =
                attention::check_forward(&shape, &inputs, out.len(), lse.len());
            self.launch(Kernel::attention_forward {
                q: Self::read(inputs.q),
                k_ctx: Self::read(inputs.k_ctx),
                v_ctx: Self::read(inputs.v_ctx),
                k_blk: Self::read(inputs.k_blk),
                v_blk: Self::read(inputs.v_blk),
                query_ranges: Self::read(inputs.query_ranges),
                out: Self::write(out),
                lse: Self::write(lse),
                queries,
                context,
                heads: shape.heads,
                kv_heads: shape.kv_heads,
                head_dim: shape.head_dim,
                scale: shape.scale,
            })
        }

        /// Attention backward: every gradient of `grads` overwritten, deterministically (no atomics); `delta`
        /// is scratch of `[Q, heads]` (`rowsum(dout ∘ out)`). The ranges inside the block plan are device data and
        /// are not checked here: the kernels clamp them to their key sets (the CPU, with its own body, checks
        /// them). The CPU has its own body (`HOST_BODIES`).
        fn attention_backward(
            &mut self,
            inputs: AttentionInputs<'_, Self>,
            shape: AttentionShape,
            saved: AttentionSaved<'_, Self>,
            mut delta: Dst<'_, Self, f32>,
            grads: AttentionGrads<'_, Self>,
        ) -> BackendResult {
            let AttentionSizes { queries, context } =
                attention::check_backward(&shape, &inputs, &saved, delta.len(), &grads);
            let AttentionShape {
                heads,
                kv_heads,
                head_dim,
                scale,
            } = shape;
            self.launch(Kernel::attention_delta {
                out: Self::read(saved.out),
                dout: Self::read(saved.dout),
                delta: Self::write(delta.reborrow()),
                head_dim,
                rows: queries * heads,
            })?;
            let delta = delta.into_read();
            self.launch(Kernel::attention_backward_q {
                q: Self::read(inputs.q),
                k_ctx: Self::read(inputs.k_ctx),
                v_ctx: Self::read(inputs.v_ctx),
                k_blk: Self::read(inputs.k_blk),
                v_blk: Self::read(inputs.v_blk),
                query_ranges: Self::read(inputs.query_ranges),
                dout: Self::read(saved.dout),
                lse: Self::read(saved.lse),
                delta: Self::read(delta),
                dq: Self::write(grads.dq),
                queries,
                context,
                heads,
                kv_heads,
                head_dim,
                scale,
            })?;
            let key_sets = [
                (
                    context,
                    inputs.k_ctx,
                    inputs.v_ctx,
                    saved.key_ranges_ctx,
                    grads.dk_ctx,
                    grads.dv_ctx,
                ),
                (
                    queries,
                    inputs.k_blk,
                    inputs.v_blk,
                    saved.key_ranges_blk,
                    grads.dk_blk,
                    grads.dv_blk,
                ),
            ];
            for (keys, k, v, key_ranges, dk, dv) in key_sets {
                self.launch(Kernel::attention_backward_kv {
                    q: Self::read(inputs.q),
                    dout: Self::read(saved.dout),
                    lse: Self::read(saved.lse),
                    delta: Self::read(delta),
                    k: Self::read(k),
                    v: Self::read(v),
                    key_ranges: Self::read(key_ranges),
                    dk: Self::write(dk),
                    dv: Self::write(dv),
                    keys,
                    queries,
                    heads,
                    kv_heads,
                    head_dim,
                    scale,
                })?;
            }
            Ok(())
        }
    };
}
pub(super) use kernel_operations;

/// `(vocab, hidden, n)` of a gather of `ids` whole rows of `table` into `out` elements.
///
/// # Panics
/// When `out` is not a whole number of rows per id or `table` not a whole number of rows.
pub(crate) fn gather_shape(table: usize, ids: usize, out: usize) -> (usize, usize, usize) {
    assert!(
        ids > 0 && out.is_multiple_of(ids),
        "embedding_gather: {out} outputs for {ids} ids"
    );
    let hidden = out / ids;
    assert!(
        hidden > 0 && table.is_multiple_of(hidden),
        "embedding_gather: table of {table} is not a whole number of rows of {hidden}"
    );
    (table / hidden, hidden, out)
}
