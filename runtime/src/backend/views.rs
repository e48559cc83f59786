//! Device buffers and the views the model and the kernels borrow of them: a backend owns [`Buf`]s; the model
//! reads through [`Src`] and writes through [`Dst`] views, so Rust's borrow rules forbid on every backend the
//! aliasing a kernel does not support; [`Matrix`] operands of a product; hidden states in their own precision
//! ([`HsBuf`], [`HsSrc`]).

use std::marker::PhantomData;

use super::Backend;
use crate::batch::HsDtype;

/// What a device buffer can hold.
pub trait Element:
    Copy
    + Default
    + Send
    + Sync
    + 'static
    + cudarc::driver::DeviceRepr
    + cudarc::driver::ValidAsZeroBits
{
}
impl Element for f32 {}
impl Element for f64 {}
impl Element for i32 {}
impl Element for u32 {}
impl Element for u8 {}
impl Element for half::bf16 {}
impl Element for half::f16 {}

/// A buffer of `len` elements on backend `B`.
pub struct Buf<B: Backend, T: Element> {
    pub(super) raw: B::Raw<T>,
    pub(super) len: usize,
}

impl<B: Backend, T: Element> Buf<B, T> {
    /// Wraps a backend's raw allocation of `len` elements.
    pub(crate) fn from_raw(raw: B::Raw<T>, len: usize) -> Self {
        Self { raw, len }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements `start..start + len`, to read.
    ///
    /// # Panics
    /// When the range is outside the buffer (a bug in the model: it sizes views from the layout).
    #[track_caller]
    pub fn at(&self, start: usize, len: usize) -> Src<'_, B, T> {
        assert!(
            start.checked_add(len).is_some_and(|end| end <= self.len),
            "view {start}+{len} outside a buffer of {}",
            self.len
        );
        Src {
            raw: &self.raw,
            start,
            len,
            _backend: PhantomData,
        }
    }

    /// Every element, to read.
    pub fn all(&self) -> Src<'_, B, T> {
        self.at(0, self.len)
    }

    /// Elements `start..start + len`, to write.
    ///
    /// # Panics
    /// As [`Buf::at`].
    #[track_caller]
    pub fn at_mut(&mut self, start: usize, len: usize) -> Dst<'_, B, T> {
        assert!(
            start.checked_add(len).is_some_and(|end| end <= self.len),
            "view {start}+{len} outside a buffer of {}",
            self.len
        );
        Dst {
            raw: &mut self.raw,
            start,
            len,
            _backend: PhantomData,
        }
    }

    /// Every element, to write.
    pub fn all_mut(&mut self) -> Dst<'_, B, T> {
        let len = self.len;
        self.at_mut(0, len)
    }
}

/// A read view of a [`Buf`].
pub struct Src<'a, B: Backend, T: Element> {
    raw: &'a B::Raw<T>,
    start: usize,
    len: usize,
    _backend: PhantomData<fn() -> B>,
}

impl<B: Backend, T: Element> Clone for Src<'_, B, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend, T: Element> Copy for Src<'_, B, T> {}

impl<'a, B: Backend, T: Element> Src<'a, B, T> {
    /// Elements in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements `start..start + len` of the view.
    ///
    /// # Panics
    /// When the range is outside the view.
    #[track_caller]
    pub fn at(&self, start: usize, len: usize) -> Self {
        assert!(
            start.checked_add(len).is_some_and(|end| end <= self.len),
            "view {start}+{len} outside a view of {}",
            self.len
        );
        Self {
            start: self.start + start,
            len,
            ..*self
        }
    }

    /// The backend's allocation, first element and length (for backend implementations).
    pub(crate) fn parts(&self) -> (&'a B::Raw<T>, usize, usize) {
        (self.raw, self.start, self.len)
    }
}

/// A write view of a [`Buf`].
pub struct Dst<'a, B: Backend, T: Element> {
    raw: &'a mut B::Raw<T>,
    start: usize,
    len: usize,
    _backend: PhantomData<fn() -> B>,
}

impl<'a, B: Backend, T: Element> Dst<'a, B, T> {
    /// Elements in the view.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The same elements, re-borrowed (to pass a view on without giving it up).
    pub fn reborrow(&mut self) -> Dst<'_, B, T> {
        Dst {
            raw: &mut *self.raw,
            start: self.start,
            len: self.len,
            _backend: PhantomData,
        }
    }

    /// Elements `start..start + len` of the view, re-borrowed (one chunk of a buffer an operation fills chunk
    /// by chunk).
    ///
    /// # Panics
    /// When the range is outside the view.
    #[track_caller]
    pub fn at_mut(&mut self, start: usize, len: usize) -> Dst<'_, B, T> {
        assert!(
            start.checked_add(len).is_some_and(|end| end <= self.len),
            "view {start}+{len} outside a view of {}",
            self.len
        );
        Dst {
            raw: &mut *self.raw,
            start: self.start + start,
            len,
            _backend: PhantomData,
        }
    }

    /// The same elements, to read (what a kernel wrote, read by the next one).
    pub fn into_read(self) -> Src<'a, B, T> {
        Src {
            raw: self.raw,
            start: self.start,
            len: self.len,
            _backend: PhantomData,
        }
    }

    /// The backend's allocation, first element and length (for backend implementations).
    pub(crate) fn parts(self) -> (&'a mut B::Raw<T>, usize, usize) {
        (self.raw, self.start, self.len)
    }
}

/// A view a [`Matrix`] can hold: something with a length.
pub trait MatrixData: Copy {
    /// Elements in the view.
    fn elements(&self) -> usize;
}

impl<B: Backend> MatrixData for Src<'_, B, f32> {
    fn elements(&self) -> usize {
        self.len()
    }
}

/// A row-major matrix operand of a product: `rows × cols` as stored, used transposed when `transposed`.
/// [`Operand`] holds f32 elements ([`Backend::gemm`]), [`HsOperand`] hidden states in their own precision
/// ([`Backend::gemm_hs`]).
#[derive(Clone, Copy)]
pub struct Matrix<D> {
    /// The stored elements (`rows · cols`).
    pub data: D,
    /// Stored rows.
    pub rows: usize,
    /// Stored columns.
    pub cols: usize,
    /// Whether the product uses the transpose.
    pub transposed: bool,
}

/// A matrix operand of [`Backend::gemm`].
pub type Operand<'a, B> = Matrix<Src<'a, B, f32>>;

impl<D: MatrixData> Matrix<D> {
    /// `data` as a row-major `[rows, cols]` matrix.
    ///
    /// # Panics
    /// When the view's length is not `rows · cols`.
    #[track_caller]
    pub fn new(data: D, rows: usize, cols: usize) -> Self {
        assert_eq!(
            data.elements(),
            rows * cols,
            "matrix view does not match its shape"
        );
        Self {
            data,
            rows,
            cols,
            transposed: false,
        }
    }

    /// The same matrix, used transposed.
    pub fn t(self) -> Self {
        Self {
            transposed: !self.transposed,
            ..self
        }
    }

    /// Rows and columns as used.
    pub fn shape(&self) -> (usize, usize) {
        if self.transposed {
            (self.cols, self.rows)
        } else {
            (self.rows, self.cols)
        }
    }
}

/// `(m, n, k)` of `c[m, n] = a[m, k] · b[k, n]`.
///
/// # Panics
/// When the shapes do not agree (a bug in the model).
#[track_caller]
pub fn gemm_shape<A: MatrixData, M: MatrixData>(
    c_len: usize,
    a: &Matrix<A>,
    b: &Matrix<M>,
) -> (usize, usize, usize) {
    let (m, k) = a.shape();
    let (kb, n) = b.shape();
    assert_eq!(k, kb, "inner dimensions differ");
    assert_eq!(
        c_len,
        m * n,
        "output view does not match the product's shape"
    );
    (m, n, k)
}

/// Hidden states on a backend, in the precision they are held in (the workspace layout's dtype of `input*.hs`).
pub enum HsBuf<B: Backend> {
    /// 32-bit floats.
    F32(Buf<B, f32>),
    /// bfloat16.
    Bf16(Buf<B, half::bf16>),
    /// IEEE half.
    F16(Buf<B, half::f16>),
}

impl<B: Backend> HsBuf<B> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(b) => b.len(),
            Self::Bf16(b) => b.len(),
            Self::F16(b) => b.len(),
        }
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> HsDtype {
        match self {
            Self::F32(_) => HsDtype::F32,
            Self::Bf16(_) => HsDtype::Bf16,
            Self::F16(_) => HsDtype::F16,
        }
    }

    /// Elements `start..start + len`, to read.
    ///
    /// # Panics
    /// As [`Buf::at`].
    #[track_caller]
    pub fn at(&self, start: usize, len: usize) -> HsSrc<'_, B> {
        match self {
            Self::F32(b) => HsSrc::F32(b.at(start, len)),
            Self::Bf16(b) => HsSrc::Bf16(b.at(start, len)),
            Self::F16(b) => HsSrc::F16(b.at(start, len)),
        }
    }
}

/// A read view of an [`HsBuf`].
pub enum HsSrc<'a, B: Backend> {
    /// 32-bit floats.
    F32(Src<'a, B, f32>),
    /// bfloat16.
    Bf16(Src<'a, B, half::bf16>),
    /// IEEE half.
    F16(Src<'a, B, half::f16>),
}

impl<B: Backend> Clone for HsSrc<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for HsSrc<'_, B> {}

impl<B: Backend> HsSrc<'_, B> {
    /// Elements in the view.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::Bf16(v) => v.len(),
            Self::F16(v) => v.len(),
        }
    }

    /// True when the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `len` elements from `offset`, in the same precision.
    ///
    /// # Panics
    /// When the range is outside the view.
    #[track_caller]
    pub fn at(self, offset: usize, len: usize) -> Self {
        match self {
            Self::F32(v) => Self::F32(v.at(offset, len)),
            Self::Bf16(v) => Self::Bf16(v.at(offset, len)),
            Self::F16(v) => Self::F16(v.at(offset, len)),
        }
    }
}

/// A matrix operand of [`Backend::gemm_hs`]: an [`Operand`] whose elements may be hidden states in their own
/// precision.
pub type HsOperand<'a, B> = Matrix<HsSrc<'a, B>>;

impl<B: Backend> MatrixData for HsSrc<'_, B> {
    fn elements(&self) -> usize {
        self.len()
    }
}

impl<'a, B: Backend> Matrix<HsSrc<'a, B>> {
    /// The f32 `[rows, cols]` operand `wide`, or its bf16 copy `copy` where the workspace keeps one (CUDA at
    /// `bf16` precision, where the product then reads 16-bit operands from memory). Both hold the same value
    /// at `bf16` precision: the copy is `wide` rounded to nearest even, as the CPU rounds `wide` inside its
    /// product.
    ///
    /// # Panics
    /// When a view's length is not `rows · cols`.
    #[track_caller]
    pub fn with_copy(
        wide: Src<'a, B, f32>,
        copy: Option<Src<'a, B, half::bf16>>,
        rows: usize,
        cols: usize,
    ) -> Self {
        match copy {
            Some(copy) => {
                assert_eq!(copy.len(), wide.len(), "a bf16 copy of another length");
                Self::new(HsSrc::Bf16(copy), rows, cols)
            }
            None => Self::new(HsSrc::F32(wide), rows, cols),
        }
    }

    /// The operand as an f32 [`Operand`], when its elements are f32.
    pub fn as_f32(&self) -> Option<Operand<'a, B>> {
        match self.data {
            HsSrc::F32(data) => Some(Operand {
                data,
                rows: self.rows,
                cols: self.cols,
                transposed: self.transposed,
            }),
            _ => None,
        }
    }
}

impl<'a, B: Backend> From<Operand<'a, B>> for HsOperand<'a, B> {
    fn from(op: Operand<'a, B>) -> Self {
        Self {
            data: HsSrc::F32(op.data),
            rows: op.rows,
            cols: op.cols,
            transposed: op.transposed,
        }
    }
}
