//! Hot-path kernels the candle graph calls into: a bounds-checked matrix product on slices
//! (the `gemm` crate that candle itself uses), and row-wise softmax pieces with an `exp` that
//! vectorises.
//!
//! Determinism: every reduction here has a fixed shape (eight lanes, summed in a fixed order),
//! and the arithmetic is plain IEEE multiply and add, never fused. The AVX2 and the portable
//! paths therefore give bit-identical results; AVX2 only makes them faster.
//!
//! This is the one module of the trainer allowed `unsafe`: the raw-pointer `gemm` call behind
//! a bounds-checked wrapper, products and a transpose written into memory not initialised
//! first, and calls into AVX2 code after checking the CPU has it.
#![allow(unsafe_code)]

use std::sync::Mutex;

use gemm::Parallelism;
use rayon::prelude::*;

/// A read-only matrix view: element `(r, c)` is `data[r * row_stride + c * col_stride]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a, T> {
    pub data: &'a [T],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl<'a, T> MatRef<'a, T> {
    /// A row-major `rows x cols` matrix.
    pub fn row_major(data: &'a [T], rows: usize, cols: usize) -> Self {
        Self {
            data,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transpose, without moving data.
    pub fn t(self) -> Self {
        Self {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// Rows `start..end` of this view.
    pub fn rows(self, start: usize, end: usize) -> Self {
        assert!(
            start <= end && end <= self.rows,
            "rows {start}..{end} of {}",
            self.rows
        );
        Self {
            data: if end > start {
                &self.data[start * self.row_stride..]
            } else {
                &[]
            },
            rows: end - start,
            ..self
        }
    }

    /// Columns `start..end` of this view.
    pub fn cols(self, start: usize, end: usize) -> Self {
        assert!(
            start <= end && end <= self.cols,
            "columns {start}..{end} of {}",
            self.cols
        );
        Self {
            data: if end > start {
                &self.data[start * self.col_stride..]
            } else {
                &[]
            },
            cols: end - start,
            ..self
        }
    }

    fn check(&self, what: &str) {
        if self.rows > 0 && self.cols > 0 {
            let last = (self.rows - 1) * self.row_stride + (self.cols - 1) * self.col_stride;
            assert!(
                last < self.data.len(),
                "{what}: a {}x{} view with strides ({}, {}) overruns {} elements",
                self.rows,
                self.cols,
                self.row_stride,
                self.col_stride,
                self.data.len()
            );
        }
    }
}

/// Element types the kernels take.
pub trait Element:
    Copy
    + Send
    + Sync
    + 'static
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
{
    const ZERO: Self;
    const ONE: Self;
}

impl Element for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

impl Element for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}

/// `dst = a * b`, or `dst += a * b` when `accumulate`; `dst` is row-major `a.rows x b.cols`.
/// Runs on the rayon pool's threads.
pub fn matmul<T: Element>(dst: &mut [T], a: MatRef<'_, T>, b: MatRef<'_, T>, accumulate: bool) {
    assert_eq!(dst.len(), a.rows * b.cols, "destination size");
    matmul_on(dst, b.cols, a, b, accumulate, true)
}

/// [`matmul`] on the calling thread alone, for many small products run in parallel.
pub fn matmul_serial<T: Element>(
    dst: &mut [T],
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    accumulate: bool,
) {
    assert_eq!(dst.len(), a.rows * b.cols, "destination size");
    matmul_on(dst, b.cols, a, b, accumulate, false)
}

/// [`matmul_serial`] into the first `a.rows x b.cols` block of a row-major matrix whose
/// rows are `row_stride` apart (a block of a bigger matrix); the rest of `dst` is untouched.
pub fn matmul_serial_into<T: Element>(
    dst: &mut [T],
    row_stride: usize,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    accumulate: bool,
) {
    matmul_on(dst, row_stride, a, b, accumulate, false)
}

fn matmul_on<T: Element>(
    dst: &mut [T],
    row_stride: usize,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    accumulate: bool,
    parallel: bool,
) {
    // SAFETY: `dst` is an exclusively borrowed, initialised slice of its own length.
    unsafe {
        product_raw(
            Destination {
                data: dst.as_mut_ptr(),
                len: dst.len(),
            },
            row_stride,
            a,
            b,
            accumulate,
            parallel,
        )
    }
}

/// A product's destination as a raw pointer, so that disjoint row blocks of one buffer, or a
/// buffer not yet initialised, can be written from several threads.
#[derive(Clone, Copy)]
struct Destination<T> {
    data: *mut T,
    len: usize,
}

// SAFETY: a `Destination` is only built over memory that the function building it holds
// exclusively, and the threads it is shared with write disjoint row blocks of it.
unsafe impl<T: Send> Send for Destination<T> {}
unsafe impl<T: Send> Sync for Destination<T> {}

impl<T> Destination<T> {
    /// Elements `start..start + len` of this destination.
    fn block(self, start: usize, len: usize) -> Self {
        assert!(start + len <= self.len, "destination block past its end");
        Self {
            // SAFETY: within the allocation, checked above.
            data: unsafe { self.data.add(start) },
            len,
        }
    }
}

/// `dst = a * b` (`dst += a * b` with `accumulate`) into `a.rows` rows of `b.cols` elements,
/// `row_stride` apart. Without `accumulate` every element of those rows is written and none is
/// read, so `dst` may be uninitialised.
///
/// # Safety
/// `dst` must be valid for writes of `dst.len` elements (and initialised with `accumulate`),
/// and no other thread may access the rows this product writes while it runs.
unsafe fn product_raw<T: Element>(
    dst: Destination<T>,
    row_stride: usize,
    a: MatRef<'_, T>,
    b: MatRef<'_, T>,
    accumulate: bool,
    parallel: bool,
) {
    assert_eq!(a.cols, b.rows, "inner dimensions differ");
    a.check("left operand");
    b.check("right operand");
    if a.rows == 0 || b.cols == 0 {
        return;
    }
    assert!(row_stride >= b.cols, "destination rows overlap");
    assert!(
        (a.rows - 1) * row_stride + b.cols <= dst.len,
        "destination size"
    );
    if a.cols == 0 {
        if !accumulate {
            for row in 0..a.rows {
                for column in 0..b.cols {
                    // SAFETY: inside the destination, checked above.
                    unsafe { dst.data.add(row * row_stride + column).write(T::ZERO) };
                }
            }
        }
        return;
    }
    let threads = rayon::current_num_threads();
    let parallelism = if parallel && threads > 1 {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // SAFETY: the operands were bounds-checked above against their slices' lengths, the
    // destination's rows (`a.rows` rows of `b.cols` elements, `row_stride` apart, which do not
    // overlap) against its length, and the caller guarantees it may write them. Without
    // `accumulate`, gemm is told not to read the destination (it then only stores into it).
    unsafe {
        gemm::gemm(
            a.rows,
            b.cols,
            a.cols,
            dst.data,
            1,
            row_stride as isize,
            accumulate,
            a.data.as_ptr(),
            a.col_stride as isize,
            a.row_stride as isize,
            b.data.as_ptr(),
            b.col_stride as isize,
            b.row_stride as isize,
            if accumulate { T::ONE } else { T::ZERO },
            T::ONE,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Rows of the destination, and columns of the source, a thread transposes at a time.
const TRANSPOSE_TILE: usize = 64;

/// The transpose of `src`, a row-major matrix of `src_rows` rows: row-major, `src_rows`
/// columns. Written in tiles on the rayon pool's threads, into memory that is not zero-filled
/// first. Panics unless `src_rows` divides a non-empty `src`'s length.
pub fn transposed<T: Element>(src: &[T], src_rows: usize) -> Vec<T> {
    if src.is_empty() {
        return Vec::new();
    }
    assert!(
        src_rows > 0 && src.len().is_multiple_of(src_rows),
        "a transpose of whole rows"
    );
    // The output's rows are `src`'s columns.
    let (rows, cols) = (src.len() / src_rows, src_rows);
    let mut out = Vec::with_capacity(src.len());
    out.spare_capacity_mut()[..src.len()]
        .par_chunks_mut(TRANSPOSE_TILE * cols)
        .enumerate()
        .for_each(|(tile, block)| {
            let first = tile * TRANSPOSE_TILE;
            for start in (0..cols).step_by(TRANSPOSE_TILE) {
                let end = (start + TRANSPOSE_TILE).min(cols);
                for (offset, row) in block.chunks_mut(cols).enumerate() {
                    for (c, value) in row[start..end].iter_mut().enumerate() {
                        value.write(src[(start + c) * rows + first + offset]);
                    }
                }
            }
        });
    // SAFETY: the chunks cover the first `src.len()` elements, each row of each chunk whole
    // (`src.len()` is a multiple of `cols`), and every element of every row was written above.
    unsafe { out.set_len(src.len()) };
    out
}

/// Row blocks of a row-major matrix with rows of `cols` elements, each one product: rows
/// `first..end` of block `i` are `a * b` (or gain `a * b` with `accumulate`), for
/// `(a, b) = product(i)`. The blocks run in parallel on the rayon pool, each product on one
/// thread, so that many small products (one per expert, say) keep every thread busy.
///
/// `blocks` must be ascending and disjoint; each block's product must have its row count.
pub fn matmul_blocks<'a, T: Element>(
    dst: &mut [T],
    cols: usize,
    blocks: &[(usize, usize)],
    product: impl Fn(usize) -> (MatRef<'a, T>, MatRef<'a, T>) + Sync,
    accumulate: bool,
) {
    let dst = Destination {
        data: dst.as_mut_ptr(),
        len: dst.len(),
    };
    // SAFETY: `dst` is an exclusively borrowed, initialised slice of its own length.
    unsafe { blocks_raw(dst, cols, blocks, product, accumulate) }
}

/// [`matmul_blocks`] into a new `rows x cols` matrix, whose rows the blocks must cover in
/// order (the first starts at row 0, each starts where the one before ended, the last ends at
/// `rows`). Every element is written once by a product, so the matrix is not zero-filled
/// first: a zero-fill of a large buffer is a serial pass over memory that the products
/// overwrite anyway.
pub fn matmul_blocks_new<'a, T: Element>(
    rows: usize,
    cols: usize,
    blocks: &[(usize, usize)],
    product: impl Fn(usize) -> (MatRef<'a, T>, MatRef<'a, T>) + Sync,
) -> Vec<T> {
    let mut covered = 0;
    for &(first, end) in blocks {
        assert_eq!(first, covered, "row blocks must cover the rows in order");
        covered = end;
    }
    assert_eq!(covered, rows, "row blocks must cover the rows in order");
    let mut out = Vec::with_capacity(rows * cols);
    let dst = Destination {
        data: out.as_mut_ptr(),
        len: rows * cols,
    };
    // SAFETY: `out` holds `rows * cols` elements of capacity, uninitialised, and nothing else
    // refers to it; without accumulation the products only write.
    unsafe { blocks_raw(dst, cols, blocks, product, false) };
    // SAFETY: the blocks cover every row, checked above, and each product wrote all of its
    // rows' elements (a product whose operands do not fit its block panics before this).
    unsafe { out.set_len(rows * cols) };
    out
}

/// # Safety
/// `dst` must be valid for writes of `dst.len` elements (and initialised with `accumulate`),
/// and held exclusively by the caller.
unsafe fn blocks_raw<'a, T: Element>(
    dst: Destination<T>,
    cols: usize,
    blocks: &[(usize, usize)],
    product: impl Fn(usize) -> (MatRef<'a, T>, MatRef<'a, T>) + Sync,
    accumulate: bool,
) {
    let mut last_end = 0;
    for &(first, end) in blocks {
        assert!(
            first >= last_end && end >= first,
            "row blocks must be ascending and disjoint"
        );
        last_end = end;
    }
    assert!(
        last_end * cols <= dst.len,
        "row blocks past the destination"
    );
    blocks
        .par_iter()
        .enumerate()
        .for_each(|(index, &(first, end))| {
            let (a, b) = product(index);
            assert_eq!(a.rows, end - first, "block {index}: product rows");
            assert_eq!(b.cols, cols, "block {index}: product columns");
            let block = dst.block(first * cols, (end - first) * cols);
            // SAFETY: the blocks are disjoint row ranges of the destination, checked above, so
            // this thread alone writes this block.
            unsafe { product_raw(block, cols, a, b, accumulate, false) };
        });
}

/// `exp(x)` in f32 by range reduction and a degree-6 polynomial (Cephes' `expf`), within two
/// ulps of the correctly rounded value on `[-87, 88]`. Inputs below -87 give about 1e-38
/// rather than 0, which no softmax sum can notice. Branch-free, so a loop of it vectorises.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to an integer held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let exponent = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let value = p * (r * r) + r + 1.0;
    value * f32::from_bits(((exponent + 127) as u32) << 23)
}

/// Lanes of the f64 sums here (log-sum-exp, squares, products): element `i` goes to lane `i % 16`,
/// the lanes are summed in order, and the elements past the last whole block after them.
/// Sixteen lanes are four AVX2 registers of f64, four independent chains of additions.
const SUM_LANES: usize = 16;

/// The row's maximum (a max is exact in any order).
#[inline(always)]
fn max_f32_body(row: &[f32]) -> f32 {
    row.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `sum(exp(row - max))` in f64, in the lanes of [`SUM_LANES`].
#[inline(always)]
fn exp_sum_f32_body(row: &[f32], max: f32) -> f64 {
    let mut sums = [0f64; SUM_LANES];
    let mut blocks = row.chunks_exact(SUM_LANES);
    for block in &mut blocks {
        for (sum, value) in sums.iter_mut().zip(block) {
            *sum += exp_f32(*value - max) as f64;
        }
    }
    lanes_sum(
        sums,
        blocks.remainder().iter().map(|v| exp_f32(*v - max) as f64),
    )
}

/// [`exp_sum_f32_body`], leaving `exp(row - max)` in the row: the same sum, bit for bit.
#[inline(always)]
fn exp_sum_in_place_f32_body(row: &mut [f32], max: f32) -> f64 {
    let mut sums = [0f64; SUM_LANES];
    let mut blocks = row.chunks_exact_mut(SUM_LANES);
    for block in &mut blocks {
        for (sum, value) in sums.iter_mut().zip(block) {
            *value = exp_f32(*value - max);
            *sum += *value as f64;
        }
    }
    lanes_sum(
        sums,
        blocks.into_remainder().iter_mut().map(|v| {
            *v = exp_f32(*v - max);
            *v as f64
        }),
    )
}

/// The lanes' sums in order, then the terms of the elements past the last whole block: the
/// order every lane-summed reduction here ends in.
#[inline(always)]
fn lanes_sum(sums: [f64; SUM_LANES], rest: impl Iterator<Item = f64>) -> f64 {
    let mut sum: f64 = sums.iter().sum();
    for value in rest {
        sum += value;
    }
    sum
}

/// [`exp_f32`] on a register of lanes, one list of operations for AVX2 (eight lanes) and
/// AVX-512 (sixteen): the same operations in the same order, unfused, so each lane is
/// bit-identical to [`exp_f32`] on every path.
macro_rules! exp_lanes {
    (
        $name:ident, $feature:literal, $v:ty, $min:ident, $max:ident, $set1:ident, $add:ident,
        $mul:ident, $sub:ident, $to_int:ident, $sub_int:ident, $set1_int:ident,
        $add_int:ident, $shift_left:ident, $to_float:ident
    ) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feature)]
        fn $name(x: $v) -> $v {
            use std::arch::x86_64::*;
            const ROUND: f32 = 12_582_912.0;
            let x = $min($max(x, $set1(-87.0)), $set1(88.0));
            let shifted = $add($mul(x, $set1(std::f32::consts::LOG2_E)), $set1(ROUND));
            let n = $sub(shifted, $set1(ROUND));
            let exponent = $sub_int($to_int(shifted), $set1_int(ROUND.to_bits() as i32));
            let r = $sub(
                $sub(x, $mul(n, $set1(0.693_359_4))),
                $mul(n, $set1(-2.121_944_4e-4)),
            );
            let mut p = $set1(1.987_569_1e-4);
            for c in [
                1.398_199_9e-3,
                8.333_452e-3,
                4.166_579_6e-2,
                1.666_666_5e-1,
                0.5,
            ] {
                p = $add($mul(p, r), $set1(c));
            }
            let value = $add($add($mul(p, $mul(r, r)), r), $set1(1.0));
            let scale = $to_float($shift_left::<23>($add_int(exponent, $set1_int(127))));
            $mul(value, scale)
        }
    };
}

exp_lanes!(
    exp_f32x8,
    "avx2",
    std::arch::x86_64::__m256,
    _mm256_min_ps,
    _mm256_max_ps,
    _mm256_set1_ps,
    _mm256_add_ps,
    _mm256_mul_ps,
    _mm256_sub_ps,
    _mm256_castps_si256,
    _mm256_sub_epi32,
    _mm256_set1_epi32,
    _mm256_add_epi32,
    _mm256_slli_epi32,
    _mm256_castsi256_ps
);

exp_lanes!(
    exp_f32x16,
    "avx512f",
    std::arch::x86_64::__m512,
    _mm512_min_ps,
    _mm512_max_ps,
    _mm512_set1_ps,
    _mm512_add_ps,
    _mm512_mul_ps,
    _mm512_sub_ps,
    _mm512_castps_si512,
    _mm512_sub_epi32,
    _mm512_set1_epi32,
    _mm512_add_epi32,
    _mm512_slli_epi32,
    _mm512_castsi512_ps
);

/// [`max_f32_body`] over four registers of lanes. The compiler vectorises the plain loop
/// into one register, whose every max waits on the one before.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn max_f32_avx2(row: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut blocks = row.chunks_exact(32);
    let mut maxes = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
    for block in &mut blocks {
        for (k, max) in maxes.iter_mut().enumerate() {
            // SAFETY: `block` holds 32 floats; this reads the 8 from 8k on.
            let values = unsafe { _mm256_loadu_ps(block.as_ptr().add(8 * k)) };
            *max = _mm256_max_ps(values, *max);
        }
    }
    let mut lanes = [0f32; 32];
    for (k, max) in maxes.iter().enumerate() {
        // SAFETY: `lanes` holds 32 floats; this writes the 8 from 8k on.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * k), *max) };
    }
    max_f32_body(&lanes).max(max_f32_body(blocks.remainder()))
}

/// Adds sixteen exponentials to the four registers of [`SUM_LANES`] lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn add_lanes(sums: &mut [std::arch::x86_64::__m256d; 4], exps: [std::arch::x86_64::__m256; 2]) {
    use std::arch::x86_64::*;
    for (half, exps) in exps.into_iter().enumerate() {
        let low = _mm256_cvtps_pd(_mm256_castps256_ps128(exps));
        let high = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(exps));
        sums[2 * half] = _mm256_add_pd(sums[2 * half], low);
        sums[2 * half + 1] = _mm256_add_pd(sums[2 * half + 1], high);
    }
}

/// The four registers' lanes, in lane order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn stored_lanes(sums: [std::arch::x86_64::__m256d; 4]) -> [f64; SUM_LANES] {
    let mut lanes = [0f64; SUM_LANES];
    for (k, sum) in sums.iter().enumerate() {
        // SAFETY: `lanes` holds 16 doubles; this writes the 4 from 4k on.
        unsafe { std::arch::x86_64::_mm256_storeu_pd(lanes.as_mut_ptr().add(4 * k), *sum) };
    }
    lanes
}

/// [`exp_sum_f32_body`] in AVX2 intrinsics, bit-identical to it. The compiler vectorises the
/// plain loop with one chain of additions, which waits on its own latency.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn exp_sum_f32_avx2(row: &[f32], max: f32) -> f64 {
    use std::arch::x86_64::*;
    let shift = _mm256_set1_ps(max);
    let mut sums = [_mm256_setzero_pd(); 4];
    let mut blocks = row.chunks_exact(SUM_LANES);
    for block in &mut blocks {
        // SAFETY: `block` holds 16 floats; these read the 8 from 0 and the 8 from 8.
        let values = unsafe {
            [
                _mm256_loadu_ps(block.as_ptr()),
                _mm256_loadu_ps(block.as_ptr().add(8)),
            ]
        };
        add_lanes(
            &mut sums,
            values.map(|v| exp_f32x8(_mm256_sub_ps(v, shift))),
        );
    }
    lanes_sum(
        stored_lanes(sums),
        blocks.remainder().iter().map(|v| exp_f32(*v - max) as f64),
    )
}

/// [`exp_sum_in_place_f32_body`] in AVX2 intrinsics, bit-identical to it.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn exp_sum_in_place_f32_avx2(row: &mut [f32], max: f32) -> f64 {
    use std::arch::x86_64::*;
    let shift = _mm256_set1_ps(max);
    let mut sums = [_mm256_setzero_pd(); 4];
    let mut blocks = row.chunks_exact_mut(SUM_LANES);
    for block in &mut blocks {
        let at = block.as_mut_ptr();
        // SAFETY: `block` holds 16 floats; these read the 8 from 0 and the 8 from 8.
        let values = unsafe { [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))] };
        let exps = values.map(|v| exp_f32x8(_mm256_sub_ps(v, shift)));
        // SAFETY: the same 16 floats, written back.
        unsafe {
            _mm256_storeu_ps(at, exps[0]);
            _mm256_storeu_ps(at.add(8), exps[1]);
        }
        add_lanes(&mut sums, exps);
    }
    lanes_sum(
        stored_lanes(sums),
        blocks.into_remainder().iter_mut().map(|v| {
            *v = exp_f32(*v - max);
            *v as f64
        }),
    )
}

/// [`max_f32_body`] over four registers of sixteen lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn max_f32_avx512(row: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut blocks = row.chunks_exact(64);
    let mut maxes = [_mm512_set1_ps(f32::NEG_INFINITY); 4];
    for block in &mut blocks {
        for (k, max) in maxes.iter_mut().enumerate() {
            // SAFETY: `block` holds 64 floats; this reads the 16 from 16k on.
            let values = unsafe { _mm512_loadu_ps(block.as_ptr().add(16 * k)) };
            *max = _mm512_max_ps(values, *max);
        }
    }
    let max = _mm512_max_ps(
        _mm512_max_ps(maxes[0], maxes[1]),
        _mm512_max_ps(maxes[2], maxes[3]),
    );
    _mm512_reduce_max_ps(max).max(max_f32_body(blocks.remainder()))
}

/// [`exp_sum_in_place_f32_body`] in AVX-512 intrinsics, bit-identical to it: sixteen
/// exponentials per step, lanes 0-7 and 8-15 of [`SUM_LANES`] in two registers of f64.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn exp_sum_in_place_f32_avx512(row: &mut [f32], max: f32) -> f64 {
    use std::arch::x86_64::*;
    let shift = _mm512_set1_ps(max);
    let (mut low, mut high) = (_mm512_setzero_pd(), _mm512_setzero_pd());
    let mut blocks = row.chunks_exact_mut(SUM_LANES);
    for block in &mut blocks {
        let at = block.as_mut_ptr();
        // SAFETY: `block` holds 16 floats.
        let exps = exp_f32x16(_mm512_sub_ps(unsafe { _mm512_loadu_ps(at) }, shift));
        // SAFETY: the same 16 floats, written back.
        unsafe { _mm512_storeu_ps(at, exps) };
        let halves = _mm512_castps_pd(exps);
        low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(exps)));
        high = _mm512_add_pd(
            high,
            _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(halves))),
        );
    }
    let mut lanes = [0f64; SUM_LANES];
    // SAFETY: `lanes` holds 16 doubles; these write the 8 from 0 and the 8 from 8.
    unsafe {
        _mm512_storeu_pd(lanes.as_mut_ptr(), low);
        _mm512_storeu_pd(lanes.as_mut_ptr().add(8), high);
    }
    lanes_sum(
        lanes,
        blocks.into_remainder().iter_mut().map(|v| {
            *v = exp_f32(*v - max);
            *v as f64
        }),
    )
}

fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `row[i] = scale * exp(row[i] - shift)`, in place.
#[inline(always)]
fn scaled_exp_f32_body(row: &mut [f32], shift: f32, scale: f32) {
    for value in row.iter_mut() {
        *value = scale * exp_f32(*value - shift);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn scaled_exp_f32_avx2(row: &mut [f32], shift: f32, scale: f32) {
    scaled_exp_f32_body(row, shift, scale)
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `sum(v * v)` in f64 over [`SUM_LANES`] lanes, summed in lane order, then the elements
/// past the last whole block: a fixed order, whatever the CPU.
#[inline(always)]
fn sum_of_squares_body(values: &[f32]) -> f64 {
    let mut sums = [0f64; SUM_LANES];
    let mut blocks = values.chunks_exact(SUM_LANES);
    for block in &mut blocks {
        for (sum, value) in sums.iter_mut().zip(block) {
            let value = f64::from(*value);
            *sum += value * value;
        }
    }
    lanes_sum(
        sums,
        blocks
            .remainder()
            .iter()
            .map(|v| f64::from(*v) * f64::from(*v)),
    )
}

/// `sum(a * b * c)` in f64, in the lanes and order of [`sum_of_squares_body`].
#[inline(always)]
fn triple_dot_body(a: &[f32], b: &[f32], c: &[f32]) -> f64 {
    let mut sums = [0f64; SUM_LANES];
    let whole = a.len() / SUM_LANES * SUM_LANES;
    let blocks = a[..whole]
        .chunks_exact(SUM_LANES)
        .zip(b[..whole].chunks_exact(SUM_LANES))
        .zip(c[..whole].chunks_exact(SUM_LANES));
    for ((a, b), c) in blocks {
        for (((sum, a), b), c) in sums.iter_mut().zip(a).zip(b).zip(c) {
            *sum += f64::from(*a) * f64::from(*b) * f64::from(*c);
        }
    }
    let rest = a[whole..].iter().zip(&b[whole..]).zip(&c[whole..]);
    lanes_sum(
        sums,
        rest.map(|((a, b), c)| f64::from(*a) * f64::from(*b) * f64::from(*c)),
    )
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn sum_of_squares_avx2(values: &[f32]) -> f64 {
    sum_of_squares_body(values)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn triple_dot_avx2(a: &[f32], b: &[f32], c: &[f32]) -> f64 {
    triple_dot_body(a, b, c)
}

/// The sum of the squares of `values`, in f64 (the gradient's norm, RMSNorm's rows).
pub fn sum_of_squares(values: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU was just checked to support AVX2.
        return unsafe { sum_of_squares_avx2(values) };
    }
    sum_of_squares_body(values)
}

/// `sum(a[i] * b[i] * c[i])` over three equal-length slices, in f64.
pub fn triple_dot(a: &[f32], b: &[f32], c: &[f32]) -> f64 {
    assert!(
        b.len() == a.len() && c.len() == a.len(),
        "triple_dot slices differ in length"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU was just checked to support AVX2.
        return unsafe { triple_dot_avx2(a, b, c) };
    }
    triple_dot_body(a, b, c)
}

/// `1 / (1 + exp(-a))`, with the element type's `exp`.
#[inline(always)]
fn sigmoid<T: SoftmaxRow>(a: T) -> T {
    T::ONE / (T::ONE + (T::ZERO - a).exp())
}

/// `out = silu(gate) * up`, elementwise.
#[inline(always)]
fn swiglu_body<T: SoftmaxRow>(out: &mut [T], gate: &[T], up: &[T]) {
    for ((o, a), b) in out.iter_mut().zip(gate).zip(up) {
        *o = *a * sigmoid(*a) * *b;
    }
}

/// The gradients of the gate and up inputs of [`swiglu_body`] given the upstream `grad`.
#[inline(always)]
fn swiglu_backward_body<T: SoftmaxRow>(
    (gate, up, grad): (&[T], &[T], &[T]),
    grad_gate: &mut [T],
    grad_up: &mut [T],
) {
    let inputs = gate.iter().zip(up).zip(grad);
    for (((a, b), g), (dg, du)) in inputs.zip(grad_gate.iter_mut().zip(grad_up.iter_mut())) {
        let s = sigmoid(*a);
        *du = *g * *a * s;
        *dg = *g * *b * s * (T::ONE + *a * (T::ONE - s));
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn swiglu_f32_avx2(out: &mut [f32], gate: &[f32], up: &[f32]) {
    swiglu_body(out, gate, up)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn swiglu_backward_f32_avx2(
    inputs: (&[f32], &[f32], &[f32]),
    grad_gate: &mut [f32],
    grad_up: &mut [f32],
) {
    swiglu_backward_body(inputs, grad_gate, grad_up)
}

/// One AdamW step's constants, in f32 (as the moments and master weights are).
#[derive(Clone, Copy, Debug)]
pub struct AdamWStep {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Multiplies each gradient first (clipping).
    pub grad_scale: f32,
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub correction2_sqrt: f32,
}

#[inline(always)]
fn adamw_body(c: AdamWStep, params: &mut [f32], m: &mut [f32], v: &mut [f32], grads: &[f32]) {
    let (one_minus_beta1, one_minus_beta2) = (1.0 - c.beta1, 1.0 - c.beta2);
    for (((p, m), v), g) in params.iter_mut().zip(m).zip(v).zip(grads) {
        let g = *g * c.grad_scale;
        *m = c.beta1 * *m + one_minus_beta1 * g;
        *v = c.beta2 * *v + one_minus_beta2 * (g * g);
        let denom = v.sqrt() / c.correction2_sqrt + c.eps;
        *p = *p * c.decay - c.step_size * (*m / denom);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn adamw_avx2(c: AdamWStep, params: &mut [f32], m: &mut [f32], v: &mut [f32], grads: &[f32]) {
    adamw_body(c, params, m, v, grads)
}

/// AdamW on equal-length slices of master weights, both moments and gradients, in place.
pub fn adamw(c: AdamWStep, params: &mut [f32], m: &mut [f32], v: &mut [f32], grads: &[f32]) {
    assert!(
        m.len() == params.len() && v.len() == params.len() && grads.len() == params.len(),
        "AdamW slices differ in length"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU was just checked to support AVX2.
        return unsafe { adamw_avx2(c, params, m, v, grads) };
    }
    adamw_body(c, params, m, v, grads)
}

/// One shard piece of AdamW state: master weights and both moments.
#[derive(Debug)]
pub struct AdamWSlices<'a> {
    pub params: &'a [f32],
    pub m: &'a [f32],
    pub v: &'a [f32],
}

/// The same, to write.
#[derive(Debug)]
pub struct AdamWSlicesMut<'a> {
    pub params: &'a mut [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
}

#[inline(always)]
fn adamw_into_body(
    c: AdamWStep,
    old: &AdamWSlices<'_>,
    grads: &[f32],
    new: &mut AdamWSlicesMut<'_>,
) {
    let (one_minus_beta1, one_minus_beta2) = (1.0 - c.beta1, 1.0 - c.beta2);
    let old_state = old.params.iter().zip(old.m).zip(old.v).zip(grads);
    let new_state = new
        .params
        .iter_mut()
        .zip(new.m.iter_mut())
        .zip(new.v.iter_mut());
    for ((((p, m), v), g), ((p_out, m_out), v_out)) in old_state.zip(new_state) {
        // The same operations in the same order as `adamw_body`: bit-identical results.
        let g = *g * c.grad_scale;
        let m = c.beta1 * *m + one_minus_beta1 * g;
        let v = c.beta2 * *v + one_minus_beta2 * (g * g);
        let denom = v.sqrt() / c.correction2_sqrt + c.eps;
        *p_out = *p * c.decay - c.step_size * (m / denom);
        *m_out = m;
        *v_out = v;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn adamw_into_avx2(
    c: AdamWStep,
    old: &AdamWSlices<'_>,
    grads: &[f32],
    new: &mut AdamWSlicesMut<'_>,
) {
    adamw_into_body(c, old, grads, new)
}

/// AdamW from one copy of the state into another (a snapshot slot), so the old copy stays
/// intact. Computes exactly what [`adamw`] computes in place.
pub fn adamw_into(
    c: AdamWStep,
    old: &AdamWSlices<'_>,
    grads: &[f32],
    new: &mut AdamWSlicesMut<'_>,
) {
    let n = grads.len();
    assert!(
        [
            old.params.len(),
            old.m.len(),
            old.v.len(),
            new.params.len(),
            new.m.len(),
            new.v.len()
        ]
        .iter()
        .all(|len| *len == n),
        "AdamW slices differ in length"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU was just checked to support AVX2.
        return unsafe { adamw_into_avx2(c, old, grads, new) };
    }
    adamw_into_body(c, old, grads, new)
}

/// Row-wise softmax pieces for one element type.
pub trait SoftmaxRow: Element {
    /// The row's log-sum-exp, in f64.
    fn log_sum_exp(row: &[Self]) -> f64;
    /// Turns the row into `exp(row - max)`, in place, with `max` its maximum, and returns
    /// `max` and the row's log-sum-exp as [`SoftmaxRow::log_sum_exp`] gives it, bit for bit.
    fn exp_in_place(row: &mut [Self]) -> (f64, f64);
    /// `row[i] = scale * exp(row[i] - shift)`, in place.
    fn scaled_exp(row: &mut [Self], shift: f64, scale: f64);
    fn to_f64(self) -> f64;
    fn from_f64(value: f64) -> Self;
    /// `exp`: [`exp_f32`] for f32, the exact one for f64.
    fn exp(self) -> Self;
    /// `sum(v * v)` over the row, in f64.
    fn sum_of_squares(row: &[Self]) -> f64 {
        row.iter().map(|v| v.to_f64() * v.to_f64()).sum()
    }
    /// `sum(a * b * c)` over three equal-length slices, in f64.
    fn triple_dot(a: &[Self], b: &[Self], c: &[Self]) -> f64 {
        a.iter()
            .zip(b)
            .zip(c)
            .map(|((a, b), c)| a.to_f64() * b.to_f64() * c.to_f64())
            .sum()
    }
    /// `out = silu(gate) * up`, elementwise (the experts' SwiGLU).
    fn swiglu(out: &mut [Self], gate: &[Self], up: &[Self]) {
        swiglu_body(out, gate, up)
    }
    /// The gradients of [`SoftmaxRow::swiglu`]'s `gate` and `up` given the upstream gradient:
    /// `inputs` is `(gate, up, grad)`.
    fn swiglu_backward(
        inputs: (&[Self], &[Self], &[Self]),
        grad_gate: &mut [Self],
        grad_up: &mut [Self],
    ) {
        swiglu_backward_body(inputs, grad_gate, grad_up)
    }
    /// Process-wide scratch buffers for big temporaries (the loss's logits and the transpose
    /// of its weight gradient), kept between steps so that each step does not map and fault in
    /// hundreds of megabytes afresh.
    fn scratch() -> &'static Mutex<Vec<Vec<Self>>>;
}

static SCRATCH_F32: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());
static SCRATCH_F64: Mutex<Vec<Vec<f64>>> = Mutex::new(Vec::new());

/// Scratch buffers kept between uses, per element type: as many as are in use at once (the
/// loss's logits and the transpose of its weight gradient).
const SCRATCH_KEPT: usize = 2;

/// Borrows a scratch buffer of `T` with at least `len` elements (contents unspecified) for
/// `run`: the smallest kept one that is big enough, else the biggest, grown. Nested and
/// concurrent callers each get a buffer of their own.
pub fn with_scratch<T: SoftmaxRow, R>(len: usize, run: impl FnOnce(&mut [T]) -> R) -> R {
    let mut buffer = {
        let mut kept = T::scratch().lock().unwrap_or_else(|e| e.into_inner());
        kept.sort_by_key(Vec::len);
        let fits = kept.iter().position(|buffer| buffer.len() >= len);
        match fits.or(kept.len().checked_sub(1)) {
            Some(index) => kept.remove(index),
            None => Vec::new(),
        }
    };
    if buffer.len() < len {
        buffer.resize(len, T::ZERO);
    }
    let result = run(&mut buffer[..len]);
    let mut kept = T::scratch().lock().unwrap_or_else(|e| e.into_inner());
    kept.push(buffer);
    if kept.len() > SCRATCH_KEPT {
        kept.sort_by_key(Vec::len);
        kept.remove(0);
    }
    result
}

/// [`with_scratch`] for two buffers at once, of `lens.0` and `lens.1` elements.
pub fn with_scratches<T: SoftmaxRow, R>(
    lens: (usize, usize),
    run: impl FnOnce(&mut [T], &mut [T]) -> R,
) -> R {
    with_scratch(lens.0, |first| {
        with_scratch(lens.1, |second| run(first, second))
    })
}

impl SoftmaxRow for f32 {
    fn log_sum_exp(row: &[f32]) -> f64 {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU was just checked to support AVX2.
            let max = unsafe { max_f32_avx2(row) };
            // SAFETY: as above.
            return max as f64 + unsafe { exp_sum_f32_avx2(row, max) }.ln();
        }
        let max = max_f32_body(row);
        max as f64 + exp_sum_f32_body(row, max).ln()
    }

    fn exp_in_place(row: &mut [f32]) -> (f64, f64) {
        #[cfg(target_arch = "x86_64")]
        if has_avx512() {
            // SAFETY: the CPU was just checked to support AVX-512F.
            let max = unsafe { max_f32_avx512(row) };
            // SAFETY: as above.
            let sum = unsafe { exp_sum_in_place_f32_avx512(row, max) };
            return (max as f64, max as f64 + sum.ln());
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU was just checked to support AVX2.
            let max = unsafe { max_f32_avx2(row) };
            // SAFETY: as above.
            let sum = unsafe { exp_sum_in_place_f32_avx2(row, max) };
            return (max as f64, max as f64 + sum.ln());
        }
        let max = max_f32_body(row);
        let sum = exp_sum_in_place_f32_body(row, max);
        (max as f64, max as f64 + sum.ln())
    }

    fn scaled_exp(row: &mut [f32], shift: f64, scale: f64) {
        let (shift, scale) = (shift as f32, scale as f32);
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU was just checked to support AVX2.
            return unsafe { scaled_exp_f32_avx2(row, shift, scale) };
        }
        scaled_exp_f32_body(row, shift, scale)
    }

    fn to_f64(self) -> f64 {
        self as f64
    }

    fn from_f64(value: f64) -> Self {
        value as f32
    }

    #[inline(always)]
    fn exp(self) -> Self {
        exp_f32(self)
    }

    fn sum_of_squares(row: &[f32]) -> f64 {
        sum_of_squares(row)
    }

    fn triple_dot(a: &[f32], b: &[f32], c: &[f32]) -> f64 {
        triple_dot(a, b, c)
    }

    fn swiglu(out: &mut [f32], gate: &[f32], up: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU was just checked to support AVX2.
            return unsafe { swiglu_f32_avx2(out, gate, up) };
        }
        swiglu_body(out, gate, up)
    }

    fn swiglu_backward(
        inputs: (&[f32], &[f32], &[f32]),
        grad_gate: &mut [f32],
        grad_up: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU was just checked to support AVX2.
            return unsafe { swiglu_backward_f32_avx2(inputs, grad_gate, grad_up) };
        }
        swiglu_backward_body(inputs, grad_gate, grad_up)
    }

    fn scratch() -> &'static Mutex<Vec<Vec<Self>>> {
        &SCRATCH_F32
    }
}

/// f64 is the reference precision of the gradient checks: plain, scalar and exact.
impl SoftmaxRow for f64 {
    fn log_sum_exp(row: &[f64]) -> f64 {
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln()
    }

    fn exp_in_place(row: &mut [f64]) -> (f64, f64) {
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut sum = 0.0;
        for value in row.iter_mut() {
            *value = (*value - max).exp();
            sum += *value;
        }
        (max, max + sum.ln())
    }

    fn scaled_exp(row: &mut [f64], shift: f64, scale: f64) {
        for value in row.iter_mut() {
            *value = scale * (*value - shift).exp();
        }
    }

    fn to_f64(self) -> f64 {
        self
    }

    fn from_f64(value: f64) -> Self {
        value
    }

    fn exp(self) -> Self {
        f64::exp(self)
    }

    fn scratch() -> &'static Mutex<Vec<Vec<Self>>> {
        &SCRATCH_F64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|f| f.to_bits()).collect()
    }

    #[test]
    fn exp_is_within_two_ulps_on_the_softmax_range() {
        let mut worst = 0u32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp() as f32;
            let got = exp_f32(x);
            worst = worst.max((got.to_bits() as i64 - want.to_bits() as i64).unsigned_abs() as u32);
            x += 0.0013;
        }
        assert!(worst <= 2, "worst error {worst} ulps");
        assert!(exp_f32(-1e9) < 1e-37 && exp_f32(-1e9) >= 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
    }

    #[test]
    fn adamw_into_a_copy_matches_adamw_in_place_bit_for_bit() {
        let c = AdamWStep {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            grad_scale: 0.7,
            decay: 0.999,
            step_size: 3e-3,
            correction2_sqrt: 0.4,
        };
        let n = 1000;
        let wave = |k: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i * k) % 97) as f32 - 48.0) * 0.013)
                .collect()
        };
        let (p0, m0, g) = (wave(7), wave(11), wave(13));
        let v0: Vec<f32> = wave(17).iter().map(|x| x * x).collect();
        let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
        adamw(c, &mut p, &mut m, &mut v, &g);
        let (mut p2, mut m2, mut v2) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        adamw_into(
            c,
            &AdamWSlices {
                params: &p0,
                m: &m0,
                v: &v0,
            },
            &g,
            &mut AdamWSlicesMut {
                params: &mut p2,
                m: &mut m2,
                v: &mut v2,
            },
        );
        assert_eq!(bits(&p), bits(&p2));
        assert_eq!(bits(&m), bits(&m2));
        assert_eq!(bits(&v), bits(&v2));
        assert_ne!(bits(&p), bits(&p0), "the update changed something");
    }

    #[test]
    fn both_paths_agree_bit_for_bit() {
        for len in [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1003, 50304] {
            let row: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.3)
                .collect();
            let a = f32::log_sum_exp(&row);
            let max = max_f32_body(&row);
            let b = max as f64 + exp_sum_f32_body(&row, max).ln();
            assert_eq!(a.to_bits(), b.to_bits(), "length {len}");
            let reference = {
                let max = max as f64;
                max + row
                    .iter()
                    .map(|v| (*v as f64 - max).exp())
                    .sum::<f64>()
                    .ln()
            };
            assert!((a - reference).abs() < 1e-6, "{a} vs {reference}");
            // In place: the same log-sum-exp, and each element the scalar exp of the path
            // without AVX2.
            let (mut fast, mut plain) = (row.clone(), row.clone());
            let (shift, lse) = f32::exp_in_place(&mut fast);
            let sum = exp_sum_in_place_f32_body(&mut plain, max);
            assert_eq!((shift, lse.to_bits()), (max as f64, a.to_bits()));
            assert_eq!(sum.to_bits(), exp_sum_f32_body(&row, max).to_bits());
            assert_eq!(bits(&fast), bits(&plain), "length {len}");
            assert_eq!(fast[7 % len], exp_f32(row[7 % len] - max));
            // Each vector path on its own, where this processor has it: the row's max, the
            // sum and every exponential as the path without them.
            #[cfg(target_arch = "x86_64")]
            for (has, path) in [
                (
                    has_avx2(),
                    // SAFETY: called only where the processor has AVX2.
                    (|row: &mut [f32]| unsafe {
                        let max = max_f32_avx2(row);
                        (max, exp_sum_in_place_f32_avx2(row, max))
                    }) as fn(&mut [f32]) -> (f32, f64),
                ),
                (
                    has_avx512(),
                    // SAFETY: called only where the processor has AVX-512F.
                    |row: &mut [f32]| unsafe {
                        let max = max_f32_avx512(row);
                        (max, exp_sum_in_place_f32_avx512(row, max))
                    },
                ),
            ] {
                if has {
                    let mut vector = row.clone();
                    let (vector_max, vector_sum) = path(&mut vector);
                    assert_eq!(vector_max.to_bits(), max.to_bits(), "length {len}");
                    assert_eq!(vector_sum.to_bits(), sum.to_bits(), "length {len}");
                    assert_eq!(bits(&vector), bits(&plain), "length {len}");
                }
            }
            let (mut x, mut y) = (row.clone(), row.clone());
            f32::scaled_exp(&mut x, a, 0.5);
            scaled_exp_f32_body(&mut y, a as f32, 0.5);
            assert_eq!(x, y);
        }
        let mut row = vec![0.5f64, -2.0, 3.0];
        let lse = f64::log_sum_exp(&row);
        assert_eq!(f64::exp_in_place(&mut row), (3.0, lse));
        assert_eq!(row, vec![(-2.5f64).exp(), (-5.0f64).exp(), 1.0]);
    }

    #[test]
    fn the_sums_of_products_are_the_same_on_both_paths() {
        for len in [0, 1, 15, 16, 17, 1003] {
            let values: Vec<f32> = (0..len).map(|i| (i as f32 - 7.5) * 0.37).collect();
            let exact: f64 = values.iter().map(|v| f64::from(*v).powi(2)).sum();
            let fast = sum_of_squares(&values);
            assert_eq!(fast.to_bits(), sum_of_squares_body(&values).to_bits());
            assert!(
                (fast - exact).abs() <= 1e-12 * exact.max(1.0),
                "{fast} vs {exact}"
            );
        }
    }

    #[test]
    fn swiglu_is_the_same_on_both_paths_and_matches_its_definition() {
        let n = 1003;
        let wave = |k: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i * k) % 97) as f32 - 48.0) * 0.17)
                .collect()
        };
        let (gate, up, grad) = (wave(7), wave(11), wave(13));
        let (mut fast, mut plain) = (vec![0f32; n], vec![0f32; n]);
        f32::swiglu(&mut fast, &gate, &up);
        swiglu_body(&mut plain, &gate, &up);
        assert_eq!(bits(&fast), bits(&plain));
        let silu = |a: f64| a / (1.0 + (-a).exp());
        for ((out, a), b) in fast.iter().zip(&gate).zip(&up) {
            let want = silu(f64::from(*a)) * f64::from(*b);
            assert!((f64::from(*out) - want).abs() <= 1e-5 * want.abs().max(1.0));
        }
        let mut fast = (vec![0f32; n], vec![0f32; n]);
        let mut plain = (vec![0f32; n], vec![0f32; n]);
        f32::swiglu_backward((&gate, &up, &grad), &mut fast.0, &mut fast.1);
        swiglu_backward_body((&gate, &up, &grad), &mut plain.0, &mut plain.1);
        assert_eq!(
            (bits(&fast.0), bits(&fast.1)),
            (bits(&plain.0), bits(&plain.1))
        );
        // Against central differences of the definition, in f64.
        for i in [0, 17, 500, 1002] {
            let (a, b, g) = (f64::from(gate[i]), f64::from(up[i]), f64::from(grad[i]));
            let h = 1e-6;
            let d_gate = g * (silu(a + h) - silu(a - h)) * b / (2.0 * h);
            let d_up = g * silu(a);
            assert!((f64::from(fast.0[i]) - d_gate).abs() <= 1e-4 * d_gate.abs().max(1.0));
            assert!((f64::from(fast.1[i]) - d_up).abs() <= 1e-4 * d_up.abs().max(1.0));
        }
    }

    #[test]
    fn matmul_handles_strides_and_accumulation() {
        // a: 2x3, b: 3x2 given as the transpose of a row-major 2x3.
        let a = [1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0];
        let bt = [1.0f64, 0.0, -1.0, 2.0, 1.0, 0.5];
        let mut dst = [0.0f64; 4];
        let (a, b) = (
            MatRef::row_major(&a, 2, 3),
            MatRef::row_major(&bt, 2, 3).t(),
        );
        matmul(&mut dst, a, b, false);
        assert_eq!(dst, [-2.0, 5.5, -2.0, 16.0]);
        matmul(&mut dst, a, b, true);
        assert_eq!(dst, [-4.0, 11.0, -4.0, 32.0]);
    }

    #[test]
    fn row_blocks_of_products_equal_one_product_and_must_cover_a_new_matrix() {
        // a: 5x3, b: 3x2; blocks of rows 0..2, 2..2 (empty) and 2..5.
        let a: Vec<f64> = (0..15).map(|i| i as f64 * 0.5 - 3.0).collect();
        let b: Vec<f64> = (0..6).map(|i| 1.0 + i as f64).collect();
        let (a, b) = (MatRef::row_major(&a, 5, 3), MatRef::row_major(&b, 3, 2));
        let mut whole = vec![0.0; 10];
        matmul(&mut whole, a, b, false);
        let blocks = [(0, 2), (2, 2), (2, 5)];
        let product = |index: usize| {
            let (first, end) = blocks[index];
            (a.rows(first, end), b)
        };
        assert_eq!(matmul_blocks_new(5, 2, &blocks, product), whole);
        let mut twice = whole.clone();
        matmul_blocks(&mut twice, 2, &blocks, product, true);
        let doubled: Vec<f64> = whole.iter().map(|v| v * 2.0).collect();
        assert_eq!(twice, doubled);
        // A product with no inner dimension writes zeros.
        let none = matmul_blocks_new(2, 2, &[(0, 2)], |_| {
            (
                MatRef::<f64>::row_major(&[], 2, 0),
                MatRef::row_major(&[], 0, 2),
            )
        });
        assert_eq!(none, [0.0; 4]);
        for gap in [[(0, 2), (3, 5)], [(0, 2), (2, 4)], [(1, 2), (2, 5)]] {
            let result = std::panic::catch_unwind(|| {
                matmul_blocks_new(5, 2, &gap, |index| {
                    let (first, end) = gap[index];
                    (a.rows(first, end), b)
                })
            });
            assert!(result.is_err(), "blocks {gap:?} do not cover the rows");
        }
    }

    #[test]
    fn a_transpose_moves_every_element_across_partial_tiles() {
        // 70 x 130 into 130 x 70: no side a multiple of the tile.
        let (rows, cols) = (130, 70);
        let src: Vec<f64> = (0..rows * cols).map(|i| i as f64).collect();
        let dst = transposed(&src, cols);
        for r in 0..rows {
            for c in 0..cols {
                assert_eq!(dst[r * cols + c], src[c * rows + r], "({r}, {c})");
            }
        }
        // Smaller than a tile, one row, one column, nothing.
        let src = [1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(transposed(&src, 2), [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
        assert_eq!(transposed(&src, 1), src);
        assert_eq!(transposed(&src, 6), src);
        assert!(transposed::<f64>(&[], 3).is_empty());
        let uneven = std::panic::catch_unwind(|| transposed(&src, 4));
        assert!(uneven.is_err(), "4 rows do not divide 6 elements");
    }

    #[test]
    fn a_product_computed_transposed_has_the_same_bits() {
        // The loss's weight gradient: `E^T x` against `(x^T E)^T`, over more rows than one
        // of gemm's inner-dimension blocks, stored and then accumulated.
        let (tokens, vocab, hidden) = (1100, 300, 40);
        let values = |n: usize, seed: u32| -> Vec<f32> {
            let mut state = seed;
            (0..n)
                .map(|_| {
                    state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                    (state >> 8) as f32 / 16_777_216.0 - 0.5
                })
                .collect()
        };
        let (e, x) = (values(tokens * vocab, 1), values(tokens * hidden, 2));
        let (e, x) = (
            MatRef::row_major(&e, tokens, vocab),
            MatRef::row_major(&x, tokens, hidden),
        );
        let mut direct = vec![0f32; vocab * hidden];
        let mut x_t_e = vec![0f32; hidden * vocab];
        for accumulate in [false, true] {
            matmul(&mut direct, e.t(), x, accumulate);
            matmul(&mut x_t_e, x.t(), e, accumulate);
            let back = transposed(&x_t_e, hidden);
            let differ = direct
                .iter()
                .zip(&back)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(differ, 0, "accumulate {accumulate}");
        }
    }

    #[test]
    #[should_panic(expected = "overruns")]
    fn matmul_refuses_a_view_past_its_slice() {
        let a = [1.0f32; 5];
        let mut dst = [0.0f32; 4];
        matmul(
            &mut dst,
            MatRef::row_major(&a, 2, 3),
            MatRef::row_major(&a, 3, 2),
            false,
        );
    }
}
