//! GEMM: `C = α·A·B + β·C` on strided f32 matrices, transposes read in place.
//!
//! This module checks shapes and bounds, and splits large products into independent blocks of C
//! rows (or columns) run on the compute pool, one per thread the calling rank may use. Each block
//! is a packed product (`packed.rs`) around a register tile (`micro.rs`) chosen at run time by
//! the CPU's instruction set ([`Isa::detected`], which `MEGATRON_KERNEL_ISA` caps): AVX-512 or
//! AVX2 + FMA, and for bf16 products AVX512_BF16's tile or AMX's (`amx.rs`). A CPU without FMA
//! (or another architecture) runs `matrixmultiply`'s kernels.
//! Every path gives the same bits on a CPU with FMA (see `micro.rs`).

#[cfg(target_arch = "x86_64")]
mod amx;
mod few_rows;
mod micro;
mod packed;

use super::isa::{Isa, Level};
use super::{KernelError, parallel};

/// A read-only strided view of a matrix of f32 (or, for [`gemm_bf16_b`]'s B, bf16) values:
/// element (i, j) is `data[i·row_stride + j·col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a, T = f32> {
    data: &'a [T],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a, T: Copy> MatRef<'a, T> {
    /// A view of `rows × cols` elements; every element must lie inside `data`.
    pub fn new(
        data: &'a [T],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self, KernelError> {
        check_bounds(
            "gemm",
            "matrix",
            data.len(),
            rows,
            cols,
            row_stride,
            col_stride,
        )?;
        Ok(MatRef {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        })
    }

    /// A dense row-major `rows × cols` view.
    pub fn row_major(data: &'a [T], rows: usize, cols: usize) -> Result<Self, KernelError> {
        MatRef::new(data, rows, cols, cols, 1)
    }

    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
}

/// A writable strided view of an f32 matrix whose elements do not overlap.
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> MatMut<'a> {
    /// A view of `rows × cols` elements inside `data`; distinct elements must not share memory.
    pub fn new(
        data: &'a mut [f32],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self, KernelError> {
        check_bounds(
            "gemm",
            "output",
            data.len(),
            rows,
            cols,
            row_stride,
            col_stride,
        )?;
        let rows_apart = cols <= 1 || col_stride >= 1;
        let row_major = rows <= 1 || row_stride > cols.saturating_sub(1) * col_stride;
        let col_major = cols <= 1 || col_stride > rows.saturating_sub(1) * row_stride;
        if !(rows_apart && (row_major || col_major)) {
            return Err(KernelError::Invalid {
                kernel: "gemm",
                message: format!(
                    "output of {rows} × {cols} with strides ({row_stride}, {col_stride}) overlaps itself"
                ),
            });
        }
        Ok(MatMut {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        })
    }

    /// A dense row-major `rows × cols` view.
    pub fn row_major(data: &'a mut [f32], rows: usize, cols: usize) -> Result<Self, KernelError> {
        MatMut::new(data, rows, cols, cols, 1)
    }
}

/// Checks that every element of a strided `rows × cols` view lies in a buffer of `len`.
fn check_bounds(
    kernel: &'static str,
    what: &str,
    len: usize,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
) -> Result<(), KernelError> {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let last = (rows - 1).checked_mul(row_stride).and_then(|r| {
        (cols - 1)
            .checked_mul(col_stride)
            .and_then(|c| r.checked_add(c))
    });
    match last {
        Some(last) if last < len => Ok(()),
        _ => Err(KernelError::Invalid {
            kernel,
            message: format!(
                "{what} of {rows} × {cols} with strides ({row_stride}, {col_stride}) does not fit \
                 in {len} elements"
            ),
        }),
    }
}

/// Products smaller than this many multiply-adds per thread run on one thread.
const MIN_WORK_PER_THREAD: usize = 1 << 21;
/// Blocks of C start at multiples of this many rows or columns (whole micro-tiles).
const SPLIT_ALIGN: usize = 32;

/// A raw view of C that parallel blocks write disjoint parts of.
#[derive(Clone, Copy)]
struct RawC {
    ptr: *mut f32,
    row_stride: isize,
    col_stride: isize,
}

// SAFETY: blocks of one product write disjoint elements of C while the caller's unique borrow
// keeps it alive; the pointer is only used inside `gemm`.
unsafe impl Send for RawC {}
unsafe impl Sync for RawC {}

/// The register tile products run on with `isa`; `None`: matrixmultiply's kernels.
fn tile_for(isa: Isa) -> Option<&'static micro::Tile> {
    match isa.level() {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 | Level::Avx512Bf16 | Level::Amx => Some(&micro::AVX512),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => Some(&micro::AVX2),
        _ => None,
    }
}

/// The register tile of bf16 products with `isa`; `None`: the f32 product of the rounded
/// operands.
fn bf16_tile_for(isa: Isa) -> Option<&'static micro::Tile> {
    #[cfg(target_arch = "x86_64")]
    if isa.amx() {
        return Some(&amx::AMX_BF16);
    }
    #[cfg(target_arch = "x86_64")]
    if isa.bf16_dot() {
        return Some(&micro::AVX512_BF16);
    }
    let _ = isa;
    None
}

/// The kernel this CPU's products run on, by name (`"avx512 14×32"`, `"avx2+fma 6×16"` or
/// `"matrixmultiply"`), for the benches.
pub fn kernel_name() -> &'static str {
    tile_for(Isa::detected()).map_or("matrixmultiply", |t| t.name)
}

/// The kernel this CPU's bf16 products ([`gemm_bf16`]) run on, by name: `"avx512bf16 14×32"`,
/// or the f32 kernel's name after `"rounded, then "`.
pub fn bf16_kernel_name() -> String {
    match bf16_tile_for(Isa::detected()) {
        Some(tile) => tile.name.to_string(),
        None => format!("rounded, then {}", kernel_name()),
    }
}

/// `C = α·A·B + β·C`; with β = 0, C's previous contents are ignored (they may be NaN).
pub fn gemm(
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    c: MatMut<'_>,
) -> Result<(), KernelError> {
    gemm_on(Isa::detected(), alpha, a, b, beta, c)
}

/// [`gemm`] on the kernel of `isa`.
fn gemm_on(
    isa: Isa,
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    mut c: MatMut<'_>,
) -> Result<(), KernelError> {
    if trivial(&a, &b, beta, &mut c)? {
        return Ok(());
    }
    let tile = tile_for(isa);
    if let Some(done) = few_rows::few_rows(isa, tile.is_some(), alpha, a, b, beta, &mut c) {
        return done;
    }
    blocks(tile, alpha, a, b, beta, c);
    Ok(())
}

/// `C = α·bf16(A)·bf16(B) + β·C`: the product of A and B each rounded to bf16 (to nearest, ties
/// to even), the sums in f32, as a GPU's bf16 products with f32 accumulation. The result is, bit
/// for bit, [`gemm`] of the rounded operands: on CPUs with AVX512_BF16 it runs on bf16 pairs at
/// twice the f32 rate (there a sum that falls below f32's least normal, 2⁻¹²⁶, is flushed to
/// zero); elsewhere the operands are rounded into copies first. On CPUs with AMX it runs on the
/// tile instructions, which sum in an order of their own (`amx.rs`): there the bits are those
/// of that order.
pub fn gemm_bf16(
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    c: MatMut<'_>,
) -> Result<(), KernelError> {
    gemm_bf16_on(Isa::detected(), alpha, a, b, beta, c)
}

/// [`gemm_bf16`] on the kernels of `isa`.
fn gemm_bf16_on(
    isa: Isa,
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    mut c: MatMut<'_>,
) -> Result<(), KernelError> {
    if trivial(&a, &b, beta, &mut c)? {
        return Ok(());
    }
    let (m, k, n) = (a.rows, a.cols, b.cols);
    // The rounded copies below are dense, which the few-rows path takes where it applies: the
    // tile runs exactly where it would not.
    if let Some(tile) = bf16_tile_for(isa)
        && !few_rows::applies((m, k, n), true)
    {
        blocks(Some(tile), alpha, a, b, beta, c);
        return Ok(());
    }
    let (ra, rb) = (Dense::of(&a, to_bf16), Dense::of(&b, to_bf16));
    gemm_on(isa, alpha, ra.view()?, rb.view()?, beta, c)
}

/// A dense f32 copy of a matrix in its own order: a matrix whose columns are contiguous (read
/// transposed) is copied as its transpose's rows, so a weight read transposed is copied in one
/// sequential pass and a few-rows product of the copy sums in the order it would on the
/// original.
struct Dense {
    values: Vec<f32>,
    rows: usize,
    cols: usize,
    transposed: bool,
}

impl Dense {
    /// `x`'s elements, each mapped by `f`.
    fn of<T: Copy>(x: &MatRef<'_, T>, f: impl Fn(T) -> f32) -> Dense {
        let transposed = x.row_stride == 1 && x.col_stride != 1;
        let (lines, len, line_stride, step) = match transposed {
            true => (x.cols, x.rows, x.col_stride, x.row_stride),
            false => (x.rows, x.cols, x.row_stride, x.col_stride),
        };
        let mut values = Vec::with_capacity(lines * len);
        for line in 0..lines {
            let at = line * line_stride;
            match step {
                1 => values.extend(x.data[at..at + len].iter().map(|&v| f(v))),
                _ => values.extend((0..len).map(|e| f(x.data[at + e * step]))),
            }
        }
        Dense {
            values,
            rows: x.rows,
            cols: x.cols,
            transposed,
        }
    }

    /// The copy as a view of the matrix it copies.
    fn view(&self) -> Result<MatRef<'_>, KernelError> {
        Ok(match self.transposed {
            true => MatRef::row_major(&self.values, self.cols, self.rows)?.t(),
            false => MatRef::row_major(&self.values, self.rows, self.cols)?,
        })
    }
}

/// [`gemm_bf16`] of a B already in bf16 (a bf16 weight), with the same bits. A product of a
/// few rows against B read transposed (a decoding step's, B's columns contiguous) streams B's
/// bf16 values as they are stored, half the bytes of f32; any other product widens B into an
/// f32 copy first.
pub fn gemm_bf16_b(
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_, half::bf16>,
    beta: f32,
    c: MatMut<'_>,
) -> Result<(), KernelError> {
    gemm_bf16_b_on(Isa::detected(), alpha, a, b, beta, c)
}

/// [`gemm_bf16_b`] on the kernels of `isa`.
fn gemm_bf16_b_on(
    isa: Isa,
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_, half::bf16>,
    beta: f32,
    mut c: MatMut<'_>,
) -> Result<(), KernelError> {
    if trivial(&a, &b, beta, &mut c)? {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if few_rows::few_rows_bf16(isa, tile_for(isa).is_some(), alpha, a, b, beta, &mut c) {
        return Ok(());
    }
    let wide = Dense::of(&b, half::bf16::to_f32);
    gemm_bf16_on(isa, alpha, a, wide.view()?, beta, c)
}

/// `x` rounded to bf16 (to nearest, ties to even) and back; a denormal bf16 reads as zero of
/// its sign, as `vdpbf16ps` reads it.
fn to_bf16(x: f32) -> f32 {
    let v = half::bf16::from_f32(x).to_f32();
    if v != 0.0 && v.abs() < f32::MIN_POSITIVE {
        0.0f32.copysign(v)
    } else {
        v
    }
}

/// Checks the shapes, and computes the products that need no kernel: `Ok(true)` when C is done.
fn trivial<T: Copy>(
    a: &MatRef<'_>,
    b: &MatRef<'_, T>,
    beta: f32,
    c: &mut MatMut<'_>,
) -> Result<bool, KernelError> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k || c.rows != m || c.cols != n {
        return Err(KernelError::Invalid {
            kernel: "gemm",
            message: format!(
                "A is {m} × {k}, B is {} × {n}, C is {} × {}: expected B {k} × {n} and C {m} × {n}",
                b.rows, c.rows, c.cols
            ),
        });
    }
    if m == 0 || n == 0 {
        return Ok(true);
    }
    if k == 0 {
        // An empty product: C = β·C, where β = 0 ignores C's old contents (even NaN).
        for i in 0..m {
            for j in 0..n {
                let e = &mut c.data[i * c.row_stride + j * c.col_stride];
                *e = if beta == 0.0 { 0.0 } else { beta * *e };
            }
        }
        return Ok(true);
    }
    Ok(false)
}

/// The packed product (on `tile`, or matrixmultiply's kernels), C cut into blocks of rows or
/// columns run on the compute pool.
fn blocks(
    tile: Option<&'static micro::Tile>,
    alpha: f32,
    a: MatRef<'_>,
    b: MatRef<'_>,
    beta: f32,
    c: MatMut<'_>,
) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    let raw = RawC {
        ptr: c.data.as_mut_ptr(),
        row_stride: c.row_stride as isize,
        col_stride: c.col_stride as isize,
    };
    let work = m.saturating_mul(n).saturating_mul(k.max(1));
    let threads = parallel::threads().min(work / MIN_WORK_PER_THREAD).max(1);
    // Split the longer side of C so that each block still amortises packing of the other operand.
    let split_rows = m >= n;
    let len = if split_rows { m } else { n };
    let parts = threads.min(len.div_ceil(SPLIT_ALIGN)).max(1);
    let block = |part: usize| {
        let start = (len * part / parts) / SPLIT_ALIGN * SPLIT_ALIGN;
        let end = if part + 1 == parts {
            len
        } else {
            (len * (part + 1) / parts) / SPLIT_ALIGN * SPLIT_ALIGN
        };
        (start, end)
    };
    let run = |part: usize| {
        let (start, end) = block(part);
        if start >= end {
            return;
        }
        // SAFETY: A and B are in bounds (checked at construction); blocks cover disjoint rows (or
        // columns) of C, which does not overlap itself, and the unique borrow of C outlives them.
        unsafe {
            if split_rows {
                sgemm(
                    tile,
                    alpha,
                    &a,
                    start,
                    end - start,
                    &b,
                    0,
                    n,
                    k,
                    beta,
                    raw,
                    start,
                    0,
                );
            } else {
                sgemm(
                    tile,
                    alpha,
                    &a,
                    0,
                    m,
                    &b,
                    start,
                    end - start,
                    k,
                    beta,
                    raw,
                    0,
                    start,
                );
            }
        }
    };
    parallel::run_parts(parts, false, run);
}

/// `C = op(A) · op(B) + β·C` for row-major `A` (`am × ak`) and `B` (`bm × bk`), each
/// transposed when its flag says so; with `bf16`, of the operands rounded to bf16
/// ([`gemm_bf16`]).
pub(crate) fn product(
    bf16: bool,
    a: &[f32],
    (am, ak, a_t): (usize, usize, bool),
    b: &[f32],
    (bm, bk, b_t): (usize, usize, bool),
    beta: f32,
    c: &mut [f32],
) -> Result<(), KernelError> {
    let a = MatRef::row_major(a, am, ak)?;
    let b = MatRef::row_major(b, bm, bk)?;
    let (a, b) = (if a_t { a.t() } else { a }, if b_t { b.t() } else { b });
    let (m, n) = (a.rows(), b.cols());
    let c = MatMut::row_major(c, m, n)?;
    if bf16 {
        gemm_bf16(1.0, a, b, beta, c)
    } else {
        gemm(1.0, a, b, beta, c)
    }
}

/// One product of a grouped GEMM: `C = α·A·B + β·C` for one group (one expert's rows).
#[derive(Debug)]
pub struct Group<'a> {
    /// The group's A.
    pub a: MatRef<'a>,
    /// The group's B.
    pub b: MatRef<'a>,
    /// The group's C (disjoint from every other group's).
    pub c: MatMut<'a>,
}

/// Every group's `C = α·A·B + β·C` as one parallel job (a grouped GEMM, as MoE experts need):
/// each group's C is cut into blocks of rows, and all groups' blocks share the compute pool at
/// once, so many small products keep every thread busy. Groups may differ in every dimension.
pub fn grouped_gemm(alpha: f32, groups: Vec<Group<'_>>, beta: f32) -> Result<(), KernelError> {
    grouped_on(tile_for(Isa::detected()), alpha, groups, beta)
}

/// [`grouped_gemm`] of the operands rounded to bf16, the sums in f32: each group's C is
/// [`gemm_bf16`]'s, bit for bit, for groups of more than 4 rows (or products too small for the
/// few-rows path, which [`gemm_bf16`] takes for 4 rows or fewer). On a CPU without a bf16 tile
/// the operands are rounded into copies first.
pub fn grouped_gemm_bf16(alpha: f32, groups: Vec<Group<'_>>, beta: f32) -> Result<(), KernelError> {
    grouped_bf16_on(Isa::detected(), alpha, groups, beta)
}

/// [`grouped_gemm_bf16`] on the kernels of `isa`.
fn grouped_bf16_on(
    isa: Isa,
    alpha: f32,
    groups: Vec<Group<'_>>,
    beta: f32,
) -> Result<(), KernelError> {
    if let Some(tile) = bf16_tile_for(isa) {
        return grouped_on(Some(tile), alpha, groups, beta);
    }
    let mut rounded = Vec::with_capacity(groups.len());
    let mut outputs = Vec::with_capacity(groups.len());
    for g in groups {
        rounded.push((Dense::of(&g.a, to_bf16), Dense::of(&g.b, to_bf16)));
        outputs.push(g.c);
    }
    let mut copies = Vec::with_capacity(outputs.len());
    for ((a, b), c) in rounded.iter().zip(outputs) {
        copies.push(Group {
            a: a.view()?,
            b: b.view()?,
            c,
        });
    }
    grouped_on(tile_for(isa), alpha, copies, beta)
}

/// [`grouped_gemm`] on `tile` (or matrixmultiply's kernels).
fn grouped_on(
    tile: Option<&'static micro::Tile>,
    alpha: f32,
    groups: Vec<Group<'_>>,
    beta: f32,
) -> Result<(), KernelError> {
    // Each block holds about half a thread's share of the whole job (two blocks a thread balance
    // uneven groups), and never less than a block worth a thread: a block packs its B once, so
    // blocks much smaller than that would spend their time packing.
    let work: usize = groups
        .iter()
        .map(|g| g.a.rows * g.a.cols.max(1) * g.b.cols)
        .sum();
    let per_block = (work / (2 * parallel::threads())).max(MIN_WORK_PER_THREAD);
    let mut items = Vec::new();
    let mut raws = Vec::with_capacity(groups.len());
    let mut operands = Vec::with_capacity(groups.len());
    for (g, group) in groups.into_iter().enumerate() {
        let (m, k, n) = (group.a.rows, group.a.cols, group.b.cols);
        if group.b.rows != k || group.c.rows != m || group.c.cols != n {
            return Err(KernelError::Invalid {
                kernel: "grouped_gemm",
                message: format!(
                    "group {g}: A is {m} × {k}, B is {} × {n}, C is {} × {}: expected B {k} × {n} \
                     and C {m} × {n}",
                    group.b.rows, group.c.rows, group.c.cols
                ),
            });
        }
        raws.push(RawC {
            ptr: group.c.data.as_mut_ptr(),
            row_stride: group.c.row_stride as isize,
            col_stride: group.c.col_stride as isize,
        });
        operands.push((group.a, group.b));
        if m == 0 || n == 0 {
            continue;
        }
        let rows_per_block = (per_block / (n * k.max(1)).max(1))
            .max(1)
            .div_ceil(SPLIT_ALIGN)
            * SPLIT_ALIGN;
        let mut start = 0;
        while start < m {
            let end = (start + rows_per_block).min(m);
            items.push((g, start, end));
            start = end;
        }
    }
    let run = |&(g, start, end): &(usize, usize, usize)| {
        let (a, b) = &operands[g];
        let (k, n) = (a.cols, b.cols);
        if k == 0 {
            for i in start..end {
                for j in 0..n {
                    // SAFETY: (i, j) is inside this group's C, and only this item touches row i.
                    unsafe {
                        let e = raws[g].ptr.offset(
                            i as isize * raws[g].row_stride + j as isize * raws[g].col_stride,
                        );
                        *e = if beta == 0.0 { 0.0 } else { beta * *e };
                    }
                }
            }
            return;
        }
        // SAFETY: A and B are in bounds (checked at construction); items cover disjoint rows of
        // their group's C, groups' C do not overlap, and the borrows outlive the scope.
        unsafe {
            sgemm(
                tile,
                alpha,
                a,
                start,
                end - start,
                b,
                0,
                n,
                k,
                beta,
                raws[g],
                start,
                0,
            );
        }
    };
    // The calling rank's threads take the blocks in turn, the largest first.
    items.sort_by_key(|&(g, start, end)| {
        std::cmp::Reverse((end - start) * operands[g].0.cols.max(1) * operands[g].1.cols)
    });
    let workers = parallel::threads().min(items.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let work = || {
        while let Some(item) = items.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
            run(item);
        }
    };
    match workers {
        0 => {}
        1 => work(),
        _ => parallel::pool().scope(|s| {
            for _ in 1..workers {
                let work = &work;
                s.spawn(move |_| work());
            }
            work();
        }),
    }
    Ok(())
}

/// One block: rows `[r0, r0+mb)` of A times columns `[c0, c0+nb)` of B into the same block of C.
///
/// # Safety
/// The block must lie inside A, B and C, and no one else may access that block of C.
#[allow(clippy::too_many_arguments)]
unsafe fn sgemm(
    tile: Option<&micro::Tile>,
    alpha: f32,
    a: &MatRef<'_>,
    r0: usize,
    mb: usize,
    b: &MatRef<'_>,
    c0: usize,
    nb: usize,
    k: usize,
    beta: f32,
    c: RawC,
    cr: usize,
    cc: usize,
) {
    // SAFETY: offsets are inside the views by the caller's contract.
    unsafe {
        let a_ptr = a.data.as_ptr().add(r0 * a.row_stride);
        let b_ptr = b.data.as_ptr().add(c0 * b.col_stride);
        let c_ptr = c
            .ptr
            .offset(cr as isize * c.row_stride + cc as isize * c.col_stride);
        if let Some(tile) = tile {
            packed::sgemm(
                tile,
                (mb, k, nb),
                alpha,
                packed::Raw {
                    ptr: a_ptr,
                    rs: a.row_stride as isize,
                    cs: a.col_stride as isize,
                },
                packed::Raw {
                    ptr: b_ptr,
                    rs: b.row_stride as isize,
                    cs: b.col_stride as isize,
                },
                beta,
                c_ptr,
                (c.row_stride, c.col_stride),
            );
            return;
        }
        matrixmultiply::sgemm(
            mb,
            k,
            nb,
            alpha,
            a_ptr,
            a.row_stride as isize,
            a.col_stride as isize,
            b_ptr,
            b.row_stride as isize,
            b.col_stride as isize,
            beta,
            c_ptr,
            c.row_stride,
            c.col_stride,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Naive f64 reference of α·A·B + β·C on row-major dense inputs.
    fn reference(
        alpha: f32,
        a: &[f32],
        b: &[f32],
        beta: f32,
        c: &[f32],
        (m, k, n): (usize, usize, usize),
    ) -> Vec<f32> {
        (0..m * n)
            .map(|idx| {
                let (i, j) = (idx / n, idx % n);
                let dot: f64 = (0..k)
                    .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                    .sum();
                (alpha as f64 * dot + beta as f64 * c[idx] as f64) as f32
            })
            .collect()
    }

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 20) as f32 / 4096.0
                    - 0.5
            })
            .collect()
    }

    /// Values with full 24-bit significands, whose products round (those of [`data`] are exact).
    #[cfg(target_arch = "x86_64")]
    fn rough(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                let h = (i as u32 ^ seed.wrapping_mul(0x9e37_79b9)).wrapping_mul(2_654_435_761);
                let h = (h ^ (h >> 15)).wrapping_mul(0x2c1b_3c6d);
                (h >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// Runs `product` on a C holding `c0` (`m × n`) with rows `n + 3` apart (NaN between them),
    /// and returns C dense, row-major.
    fn through_strided_c(
        c0: &[f32],
        m: usize,
        n: usize,
        product: impl FnOnce(MatMut<'_>),
    ) -> Vec<f32> {
        let mut wide = vec![f32::NAN; m * (n + 3)];
        for i in 0..m {
            wide[i * (n + 3)..i * (n + 3) + n].copy_from_slice(&c0[i * n..(i + 1) * n]);
        }
        product(MatMut::new(&mut wide, m, n, n + 3, 1).unwrap());
        (0..m)
            .flat_map(|i| wide[i * (n + 3)..i * (n + 3) + n].to_vec())
            .collect()
    }

    fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|idx| x[(idx % rows) * cols + idx / rows])
            .collect()
    }

    fn close(got: &[f32], want: &[f32], k: usize) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (k as f32).sqrt() * (1.0 + w.abs()),
                "element {i}: {g} vs {w}"
            );
        }
    }

    #[test]
    fn a_grouped_gemm_is_each_groups_product() {
        // Groups of 0, 1, 37, 300 and 2,000 rows (the last split into several blocks), each
        // with its own B (an expert's transposed weight, read in place) and C.
        let (k, n) = (96, 80);
        let rows = [0usize, 1, 37, 300, 2000];
        let a: Vec<Vec<f32>> = rows.iter().map(|&m| data(m * k, m as u32)).collect();
        let w: Vec<Vec<f32>> = (0..rows.len())
            .map(|g| data(n * k, 99 + g as u32))
            .collect();
        let c0: Vec<Vec<f32>> = rows.iter().map(|&m| data(m * n, 7 + m as u32)).collect();
        let mut c = c0.clone();
        let groups = c
            .iter_mut()
            .enumerate()
            .map(|(g, cg)| Group {
                a: MatRef::row_major(&a[g], rows[g], k).unwrap(),
                b: MatRef::row_major(&w[g], n, k).unwrap().t(),
                c: MatMut::row_major(cg, rows[g], n).unwrap(),
            })
            .collect();
        grouped_gemm(0.5, groups, 2.0).unwrap();
        for g in 0..rows.len() {
            let want = reference(
                0.5,
                &a[g],
                &transpose(&w[g], n, k),
                2.0,
                &c0[g],
                (rows[g], k, n),
            );
            close(&c[g], &want, k);
        }
        // Shapes that do not fit are an error naming the group.
        let (a, b, mut out) = (vec![0.0; 6], vec![0.0; 6], vec![0.0; 4]);
        let bad = vec![Group {
            a: MatRef::row_major(&a, 2, 3).unwrap(),
            b: MatRef::row_major(&b, 2, 3).unwrap(),
            c: MatMut::row_major(&mut out, 2, 2).unwrap(),
        }];
        let err = grouped_gemm(1.0, bad, 0.0).unwrap_err().to_string();
        assert!(err.contains("group 0: A is 2 × 3, B is 2 × 3"), "{err}");
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn a_bf16_grouped_gemm_is_each_groups_gemm_bf16_bit_for_bit() {
        // On every instruction set (the bf16 tiles, and rounded copies where the CPU has none),
        // AMX's tile among them where it runs: groups of 0, 1, 37 and 300 rows against an
        // expert's transposed weight, and a weight gradient's group (A read transposed). k·n is
        // below the few-rows path's reach, so every group runs on the tile, as gemm_bf16 does.
        let (k, n) = (96, 80);
        assert!(!few_rows::applies((1, k, n), true));
        let rows = [0usize, 1, 37, 300];
        let a: Vec<Vec<f32>> = rows.iter().map(|&m| rough(m * k, m as u32)).collect();
        let w: Vec<Vec<f32>> = (0..rows.len())
            .map(|g| rough(n * k, 99 + g as u32))
            .collect();
        let c0: Vec<Vec<f32>> = rows.iter().map(|&m| rough(m * n, 7 + m as u32)).collect();
        let (d, x) = (rough(300 * k, 5), rough(300 * n, 6));
        let dw0 = rough(k * n, 8);
        let mut isas = Isa::supported();
        isas.extend(crate::kernels::isa::amx_for_tests());
        parallel::set_threads(2);
        for isa in isas {
            let mut c = c0.clone();
            let mut dw = dw0.clone();
            let mut groups: Vec<Group<'_>> = c
                .iter_mut()
                .enumerate()
                .map(|(g, cg)| Group {
                    a: MatRef::row_major(&a[g], rows[g], k).unwrap(),
                    b: MatRef::row_major(&w[g], n, k).unwrap().t(),
                    c: MatMut::row_major(cg, rows[g], n).unwrap(),
                })
                .collect();
            groups.push(Group {
                a: MatRef::row_major(&d, 300, k).unwrap().t(),
                b: MatRef::row_major(&x, 300, n).unwrap(),
                c: MatMut::row_major(&mut dw, k, n).unwrap(),
            });
            grouped_bf16_on(isa, 0.5, groups, 2.0).unwrap();
            for g in 0..rows.len() {
                let mut want = c0[g].clone();
                let out = MatMut::row_major(&mut want, rows[g], n).unwrap();
                let av = MatRef::row_major(&a[g], rows[g], k).unwrap();
                let bv = MatRef::row_major(&w[g], n, k).unwrap().t();
                gemm_bf16_on(isa, 0.5, av, bv, 2.0, out).unwrap();
                let same = c[g]
                    .iter()
                    .zip(&want)
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{} group {g}", isa.name());
            }
            let mut want = dw0.clone();
            let out = MatMut::row_major(&mut want, k, n).unwrap();
            let dv = MatRef::row_major(&d, 300, k).unwrap().t();
            let xv = MatRef::row_major(&x, 300, n).unwrap();
            gemm_bf16_on(isa, 0.5, dv, xv, 2.0, out).unwrap();
            let same = dw
                .iter()
                .zip(&want)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{} weight gradient", isa.name());
        }
        parallel::set_threads(parallel::cores());
    }

    #[test]
    fn every_transpose_combination_matches_the_reference() {
        for &(m, k, n) in &[
            (1, 1, 1),
            (3, 5, 7),
            (64, 33, 17),
            (130, 70, 260),
            (257, 129, 65),
            // A few rows against a large B: the unpacked path, both layouts of B.
            (1, 256, 200),
            (3, 300, 130),
        ] {
            let a = data(m * k, 1);
            let b = data(k * n, 2);
            let c0 = data(m * n, 3);
            let want = reference(0.5, &a, &b, 2.0, &c0, (m, k, n));
            let at = transpose(&a, m, k);
            let bt = transpose(&b, k, n);
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                for threads in [1, 2, 3] {
                    parallel::set_threads(threads);
                    let av = if ta {
                        MatRef::row_major(&at, k, m).unwrap().t()
                    } else {
                        MatRef::row_major(&a, m, k).unwrap()
                    };
                    let bv = if tb {
                        MatRef::row_major(&bt, n, k).unwrap().t()
                    } else {
                        MatRef::row_major(&b, k, n).unwrap()
                    };
                    let mut c = c0.clone();
                    gemm(0.5, av, bv, 2.0, MatMut::row_major(&mut c, m, n).unwrap()).unwrap();
                    close(&c, &want, k);
                }
            }
        }
        parallel::set_threads(parallel::cores());
    }

    /// The packed products' arithmetic, exactly: each element's products summed in ascending k
    /// with one fused multiply-add each, in chunks of 256 (`packed::KC`, which was
    /// matrixmultiply's) each from +0; the first chunk's sum joins β·C as `fma(α, sum, β·C)`
    /// (β = 0: `α·sum`, C unread), each later chunk's joins C as `fma(α, sum, C)`.
    #[cfg(target_arch = "x86_64")]
    fn fma_chain(
        alpha: f32,
        a: &[f32],
        b: &[f32],
        beta: f32,
        c: &[f32],
        (m, k, n): (usize, usize, usize),
    ) -> Vec<f32> {
        (0..m * n)
            .map(|idx| {
                let (i, j) = (idx / n, idx % n);
                let mut out = c[idx];
                for (chunk, start) in (0..k).step_by(packed::KC).enumerate() {
                    let mut acc = 0.0f32;
                    for p in start..(start + packed::KC).min(k) {
                        acc = a[i * k + p].mul_add(b[p * n + j], acc);
                    }
                    out = match (chunk, beta == 0.0) {
                        (0, true) => alpha * acc,
                        (0, false) => alpha.mul_add(acc, beta * out),
                        _ => alpha.mul_add(acc, out),
                    };
                }
                out
            })
            .collect()
    }

    /// The first element of `got` whose bits differ from `want`'s, as a message.
    #[cfg(target_arch = "x86_64")]
    fn first_difference(got: &[f32], want: &[f32]) -> Option<String> {
        got.iter()
            .zip(want)
            .position(|(g, w)| g.to_bits() != w.to_bits())
            .map(|e| {
                format!(
                    "element {e} is {} where the chain gives {}",
                    got[e], want[e]
                )
            })
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_instruction_sets_products_are_the_fma_chain_bit_for_bit() {
        // Each register tile against the chain, on every instruction set this CPU has (what
        // `MEGATRON_KERNEL_ISA` would force): shapes one short of, at and one past the tiles
        // (14 × 32 and 6 × 16), the chunk of k (256), the packed block of A rows (24 tiles) and
        // of B columns (4096); A and B transposed in place, C strided or column-major; 1 to 3
        // threads. What a faster kernel must keep to leave f32 runs as they are.
        if !std::arch::is_x86_feature_detected!("fma") {
            eprintln!("no FMA on this CPU: the products are plain multiplies and adds");
            return;
        }
        let shapes = [
            (1, 1, 1),
            (13, 255, 31),
            (14, 256, 32),
            (15, 257, 33),
            (5, 17, 15),
            (6, 16, 16),
            (7, 15, 17),
            (29, 513, 65),
            (335, 3, 33),
            (337, 5, 31),
            (143, 4, 17),
            (145, 6, 16),
            (15, 3, 4097),
            // Large enough to split over the threads (1, 2 or 3 by the shape's place).
            (40, 1030, 300),
        ];
        for isa in Isa::supported() {
            for (s, &(m, k, n)) in shapes.iter().enumerate() {
                parallel::set_threads(1 + s % 3);
                let a = rough(m * k, 21);
                let b = rough(k * n, 22);
                let c0 = rough(m * n, 23);
                let (at, bt) = (transpose(&a, m, k), transpose(&b, k, n));
                // matrixmultiply's tiles round α·sum apart from β·C: the chain holds at α = 1.
                let alphas: &[f32] = match tile_for(isa) {
                    Some(_) => &[1.0, 0.375],
                    None => &[1.0],
                };
                for (&alpha, beta) in alphas.iter().flat_map(|al| [(al, 0.0), (al, 0.75)]) {
                    let want = fma_chain(alpha, &a, &b, beta, &c0, (m, k, n));
                    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                        let av = match ta {
                            true => MatRef::row_major(&at, k, m).unwrap().t(),
                            false => MatRef::row_major(&a, m, k).unwrap(),
                        };
                        let bv = match tb {
                            true => MatRef::row_major(&bt, n, k).unwrap().t(),
                            false => MatRef::row_major(&b, k, n).unwrap(),
                        };
                        // C row-major with a row stride wider than the row, then column-major.
                        let rows = through_strided_c(&c0, m, n, |c| {
                            gemm_on(isa, alpha, av, bv, beta, c).unwrap()
                        });
                        let mut cm = transpose(&c0, m, n);
                        let columns = MatMut::new(&mut cm, m, n, 1, m).unwrap();
                        gemm_on(isa, alpha, av, bv, beta, columns).unwrap();
                        for (layout, got) in
                            [("strided", rows), ("column-major", transpose(&cm, n, m))]
                        {
                            if let Some(diff) = first_difference(&got, &want) {
                                panic!(
                                    "{} {m}×{k}×{n}, α {alpha} β {beta}, Aᵀ {ta} Bᵀ {tb}, {layout} C: {diff}",
                                    isa.name()
                                );
                            }
                        }
                    }
                }
            }
        }
        parallel::set_threads(parallel::cores());
    }

    #[test]
    fn bf16_operands_round_to_nearest_even_and_denormals_read_as_zero() {
        let one = 1.0f32;
        assert_eq!(
            to_bf16(one + 2f32.powi(-8)),
            1.0,
            "a tie goes to the even mantissa"
        );
        assert_eq!(to_bf16(one + 3.0 * 2f32.powi(-8)), one + 2f32.powi(-6));
        assert_eq!(
            to_bf16(one + 2f32.powi(-8) + 2f32.powi(-20)),
            one + 2f32.powi(-7)
        );
        assert_eq!(to_bf16(-3.0), -3.0);
        assert_eq!(to_bf16(1e-39).to_bits(), 0);
        assert_eq!(to_bf16(-1e-39).to_bits(), (-0.0f32).to_bits());
        assert!(to_bf16(f32::NAN).is_nan());
        assert_eq!(to_bf16(f32::INFINITY), f32::INFINITY);
    }

    #[test]
    fn bf16_products_are_the_f32_products_of_the_rounded_operands_bit_for_bit() {
        // On every instruction set this CPU has, with AVX512_BF16's tile of bf16 pairs among
        // them where it exists: shapes around the tiles, odd k (a pair half empty) and the
        // chunk of k, a few-rows product, transposed operands, C strided; 1 to 3 threads.
        let shapes = [
            (1, 1, 1),
            (13, 255, 31),
            (14, 256, 32),
            (15, 257, 33),
            (7, 15, 17),
            (29, 513, 65),
            (337, 5, 31),
            (145, 6, 16),
            (3, 300, 200),
            (40, 1031, 300),
        ];
        // AMX sums in an order of its own (`amx.rs`), checked in the next test.
        for isa in Isa::supported().into_iter().filter(|isa| !isa.amx()) {
            for (s, &(m, k, n)) in shapes.iter().enumerate() {
                parallel::set_threads(1 + s % 3);
                let a = rough(m * k, 31);
                let b = rough(k * n, 32);
                let c0 = rough(m * n, 33);
                let (ra, rb): (Vec<f32>, Vec<f32>) = (
                    a.iter().map(|&v| to_bf16(v)).collect(),
                    b.iter().map(|&v| to_bf16(v)).collect(),
                );
                let (bt, rbt) = (transpose(&b, k, n), transpose(&rb, k, n));
                for (alpha, beta) in [(1.0, 0.0), (0.375, 0.75)] {
                    for tb in [false, true] {
                        // The reference's B in the same layout: a few-rows product's order of
                        // sums follows B's layout.
                        let (bv, rbv) = match tb {
                            true => (
                                MatRef::row_major(&bt, n, k).unwrap().t(),
                                MatRef::row_major(&rbt, n, k).unwrap().t(),
                            ),
                            false => (
                                MatRef::row_major(&b, k, n).unwrap(),
                                MatRef::row_major(&rb, k, n).unwrap(),
                            ),
                        };
                        let mut want = c0.clone();
                        let out = MatMut::row_major(&mut want, m, n).unwrap();
                        gemm_on(
                            isa,
                            alpha,
                            MatRef::row_major(&ra, m, k).unwrap(),
                            rbv,
                            beta,
                            out,
                        )
                        .unwrap();
                        let av = MatRef::row_major(&a, m, k).unwrap();
                        let got = through_strided_c(&c0, m, n, |c| {
                            gemm_bf16_on(isa, alpha, av, bv, beta, c).unwrap()
                        });
                        let diff = got
                            .iter()
                            .zip(&want)
                            .position(|(g, w)| g.to_bits() != w.to_bits());
                        assert!(
                            diff.is_none(),
                            "{} {m}×{k}×{n}, α {alpha} β {beta}, Bᵀ {tb}: element {:?} differs",
                            isa.name(),
                            diff.map(|e| (got[e], want[e]))
                        );
                    }
                }
            }
        }
        parallel::set_threads(parallel::cores());
    }

    /// α·A·B + β·C summed as AMX's `tdpbf16ps` sums (Intel's manual; `amx.rs`), from the plain
    /// definition: for each element of C and each chunk of [`packed::KC`] steps of k, blocks of 32
    /// steps whose even and odd steps are summed apart (fused multiply-adds from +0), the two sums
    /// added and that added to the chunk's sum; denormals read as zero and flushed to zero; the
    /// chunk then written as the tiles write it. `a` and `b` are row-major and already bf16.
    #[cfg(target_arch = "x86_64")]
    fn amx_model(
        alpha: f32,
        a: &[f32],
        b: &[f32],
        beta: f32,
        c: &[f32],
        (m, k, n): (usize, usize, usize),
    ) -> Vec<f32> {
        let flush = |x: f32| {
            if x.is_subnormal() {
                0.0f32.copysign(x)
            } else {
                x
            }
        };
        (0..m * n)
            .map(|e| {
                let (i, j) = (e / n, e % n);
                let mut out = c[e];
                for (chunk, pc) in (0..k).step_by(packed::KC).enumerate() {
                    let kb = packed::KC.min(k - pc);
                    let mut acc = 0.0f32;
                    for q0 in (0..kb).step_by(32) {
                        let mut halves = [0.0f32; 2];
                        for q in q0..(q0 + 32).min(kb) {
                            let (x, y) = (flush(a[i * k + pc + q]), flush(b[(pc + q) * n + j]));
                            halves[q % 2] = flush(x.mul_add(y, halves[q % 2]));
                        }
                        acc = flush(acc + flush(halves[1] + halves[0]));
                    }
                    let beta = if chunk == 0 { beta } else { 1.0 };
                    out = if beta == 0.0 {
                        alpha * acc
                    } else {
                        alpha.mul_add(acc, beta * out)
                    };
                }
                out
            })
            .collect()
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn amx_bf16_products_sum_as_the_tile_instructions_do() {
        // The AMX tile's machine code, on this CPU's AMX or (without one) on the emulator, against
        // the order of sums Intel's manual gives: shapes around the 32 × 32 tile and the blocks of
        // 32 and 256 steps of k, odd k, transposed operands, a strided C, α and β, 1 to 3
        // threads; and a product of a few rows, which keeps the f32 order (`few_rows.rs`).
        let Some(isa) = crate::kernels::isa::amx_for_tests() else {
            eprintln!("no AVX512_BF16 on this CPU: neither AMX nor its emulator runs");
            return;
        };
        let emulated = !crate::kernels::isa::amx_in_hardware();
        let shapes = [
            (1, 1, 1),
            (31, 31, 33),
            (32, 32, 32),
            (33, 257, 31),
            (64, 513, 40),
            (70, 300, 97),
            (3, 300, 200),
        ];
        for (s, &(m, k, n)) in shapes.iter().enumerate() {
            parallel::set_threads(1 + s % 3);
            let mut a = rough(m * k, 41);
            // A tie, a sum that cancels (the orders differ), a denormal, a signed zero.
            a[0] = 2f32.powi(24);
            if k > 2 {
                a[2] = -2f32.powi(24);
                a[1] = 1e-39;
            }
            let b = rough(k * n, 42);
            let c0 = rough(m * n, 43);
            let (ra, rb): (Vec<f32>, Vec<f32>) = (
                a.iter().map(|&v| to_bf16(v)).collect(),
                b.iter().map(|&v| to_bf16(v)).collect(),
            );
            let bt = transpose(&b, k, n);
            for (alpha, beta) in [(1.0, 0.0), (0.375, 0.75)] {
                for tb in [false, true] {
                    let few = few_rows::applies((m, k, n), true);
                    let want = if few {
                        // The few-rows path: the f32 product of the rounded operands, B in the
                        // same layout (its order of sums follows B's).
                        let mut want = c0.clone();
                        let out = MatMut::row_major(&mut want, m, n).unwrap();
                        let rbt = transpose(&rb, k, n);
                        let bv = match tb {
                            true => MatRef::row_major(&rbt, n, k).unwrap().t(),
                            false => MatRef::row_major(&rb, k, n).unwrap(),
                        };
                        let av = MatRef::row_major(&ra, m, k).unwrap();
                        gemm_on(isa, alpha, av, bv, beta, out).unwrap();
                        want
                    } else {
                        amx_model(alpha, &ra, &rb, beta, &c0, (m, k, n))
                    };
                    let bv = match tb {
                        true => MatRef::row_major(&bt, n, k).unwrap().t(),
                        false => MatRef::row_major(&b, k, n).unwrap(),
                    };
                    let av = MatRef::row_major(&a, m, k).unwrap();
                    let got = through_strided_c(&c0, m, n, |c| {
                        gemm_bf16_on(isa, alpha, av, bv, beta, c).unwrap()
                    });
                    let what = format!("amx {m}×{k}×{n}, α {alpha} β {beta}, Bᵀ {tb}");
                    if emulated || few {
                        let diff = got
                            .iter()
                            .zip(&want)
                            .position(|(g, w)| g.to_bits() != w.to_bits());
                        assert!(
                            diff.is_none(),
                            "{what}: element {:?} differs",
                            diff.map(|e| (e, got[e], want[e]))
                        );
                    } else {
                        // The CPU's own AMX: to the precision of f32 sums, whatever order the
                        // silicon takes (the manual's is checked on the emulator).
                        let exact = reference(alpha, &ra, &rb, beta, &c0, (m, k, n));
                        let scale: f32 = exact.iter().fold(1.0, |s, v| s.max(v.abs()));
                        for (e, (g, w)) in got.iter().zip(&exact).enumerate() {
                            assert!(
                                (g - w).abs() <= 1e-5 * scale,
                                "{what}: element {e}: {g} vs {w}"
                            );
                        }
                        let same = got
                            .iter()
                            .zip(&want)
                            .filter(|(g, w)| g.to_bits() == w.to_bits())
                            .count();
                        eprintln!(
                            "{what}: {same} of {} elements have the manual's bits",
                            got.len()
                        );
                    }
                }
            }
        }
        parallel::set_threads(parallel::cores());
    }

    #[test]
    fn bf16_b_products_are_gemm_bf16_of_the_widened_b_bit_for_bit() {
        // A B stored in bf16 (a bf16 weight): decoding's few rows against B read transposed
        // stream its bf16 values; any other product widens it. Both must give gemm_bf16's bits on
        // the widened B, on every instruction set and thread count: tails past the 16 lanes,
        // columns apart by more than k, B row-major, products too large for the few-rows path,
        // and bf16 denormals (read as zero) and signed zeros among B's values.
        let shapes = [
            (1, 257, 130),
            (2, 1000, 40),
            (3, 300, 131),
            (4, 64, 600),
            (1, 4096, 9),
            (5, 300, 200),
            (40, 100, 30),
        ];
        for (s, &(m, k, n)) in shapes.iter().enumerate() {
            let a: Vec<f32> = data(m * k, 41).iter().map(|v| v * 1.1).collect();
            let c0 = data(m * n, 43);
            let mut b: Vec<half::bf16> = data(k * n, 42)
                .iter()
                .map(|&v| half::bf16::from_f32(v * 1.3))
                .collect();
            for (e, bits) in [0x0001u16, 0x8003, 0x8000, 0x0000, 0x007f]
                .into_iter()
                .enumerate()
            {
                b[(e * 7919) % (k * n)] = half::bf16::from_bits(bits);
            }
            // B's columns k + 5 apart (a view of a wider matrix), and B row-major.
            let pad = k + 5;
            let mut bt = vec![half::bf16::from_f32(7.0); n * pad];
            for p in 0..k {
                for j in 0..n {
                    bt[j * pad + p] = b[p * n + j];
                }
            }
            // The f32 reference in the same layout: a few-rows product's order of sums follows
            // B's layout.
            let wide: Vec<f32> = b.iter().map(|v| v.to_f32()).collect();
            let wide_t: Vec<f32> = bt.iter().map(|v| v.to_f32()).collect();
            for isa in Isa::supported() {
                parallel::set_threads(1 + s % 3);
                for (alpha, beta) in [(1.0, 0.0), (0.375, 0.75)] {
                    let av = MatRef::row_major(&a, m, k).unwrap();
                    for columns in [true, false] {
                        let (bv, wv) = match columns {
                            true => (
                                MatRef::new(&bt, n, k, pad, 1).unwrap().t(),
                                MatRef::new(&wide_t, n, k, pad, 1).unwrap().t(),
                            ),
                            false => (
                                MatRef::row_major(&b, k, n).unwrap(),
                                MatRef::row_major(&wide, k, n).unwrap(),
                            ),
                        };
                        let mut want = c0.clone();
                        let out = MatMut::row_major(&mut want, m, n).unwrap();
                        gemm_bf16_on(isa, alpha, av, wv, beta, out).unwrap();
                        let mut got = c0.clone();
                        let out = MatMut::row_major(&mut got, m, n).unwrap();
                        gemm_bf16_b_on(isa, alpha, av, bv, beta, out).unwrap();
                        let diff = got
                            .iter()
                            .zip(&want)
                            .position(|(g, w)| g.to_bits() != w.to_bits());
                        assert!(
                            diff.is_none(),
                            "{} {m}×{k}×{n}, α {alpha} β {beta}, columns {columns}: element {:?} \
                             differs",
                            isa.name(),
                            diff.map(|e| (got[e], want[e]))
                        );
                    }
                }
            }
        }
        parallel::set_threads(parallel::cores());
    }

    #[test]
    fn few_rows_products_are_the_same_bits_on_every_instruction_set_and_thread_count() {
        // A decoding step's products (≤ 4 rows against a large B), B as a weight read
        // transposed (its columns contiguous) and row-major: close to the f64 reference, and
        // bit for bit one result whatever the instruction set with FMA (16 lanes on AVX2 and
        // AVX-512 alike) and the threads. k = 257 and 1000 leave a tail past the 16 lanes.
        for &(m, k, n) in &[(1, 257, 130), (2, 1000, 40), (3, 300, 131), (4, 64, 600)] {
            let a = data(m * k, 31);
            let b = data(k * n, 32);
            let c0 = data(m * n, 33);
            let want = reference(0.5, &a, &b, 2.0, &c0, (m, k, n));
            let bt = transpose(&b, k, n);
            for tb in [true, false] {
                let mut fma_bits: Option<Vec<f32>> = None;
                for isa in Isa::supported() {
                    for threads in [1, 2, 3] {
                        parallel::set_threads(threads);
                        let bv = match tb {
                            true => MatRef::row_major(&bt, n, k).unwrap().t(),
                            false => MatRef::row_major(&b, k, n).unwrap(),
                        };
                        let mut c = c0.clone();
                        let out = MatMut::row_major(&mut c, m, n).unwrap();
                        gemm_on(isa, 0.5, MatRef::row_major(&a, m, k).unwrap(), bv, 2.0, out)
                            .unwrap();
                        close(&c, &want, k);
                        if tile_for(isa).is_some() {
                            let first = fma_bits.get_or_insert_with(|| c.clone());
                            assert!(
                                first
                                    .iter()
                                    .zip(&c)
                                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                                "{m}×{k}×{n} Bᵀ {tb}: {} at {threads} threads differs",
                                isa.name()
                            );
                        }
                    }
                }
            }
        }
        parallel::set_threads(parallel::cores());
    }

    #[test]
    fn large_products_split_over_threads_give_the_same_bits() {
        // Blocks are independent products of whole rows/columns, so splitting changes no bits.
        for &(m, k, n) in &[(512, 300, 96), (96, 300, 512), (2, 300, 512)] {
            let a = data(m * k, 4);
            let b = data(k * n, 5);
            let mut outs = Vec::new();
            for threads in [1, 2, 4] {
                parallel::set_threads(threads);
                let mut c = vec![f32::NAN; m * n];
                gemm(
                    1.0,
                    MatRef::row_major(&a, m, k).unwrap(),
                    MatRef::row_major(&b, k, n).unwrap(),
                    0.0,
                    MatMut::row_major(&mut c, m, n).unwrap(),
                )
                .unwrap();
                outs.push(c);
            }
            close(
                &outs[0],
                &reference(1.0, &a, &b, 0.0, &vec![0.0; m * n], (m, k, n)),
                k,
            );
            assert!(outs.iter().all(|o| o == &outs[0]));
        }
        parallel::set_threads(parallel::cores());
    }

    #[test]
    fn column_major_and_strided_outputs() {
        let (m, k, n) = (5, 4, 6);
        let a = data(m * k, 7);
        let b = data(k * n, 8);
        let want = reference(1.0, &a, &b, 0.0, &vec![0.0; m * n], (m, k, n));
        let mut c = vec![0.0; n * m];
        gemm(
            1.0,
            MatRef::row_major(&a, m, k).unwrap(),
            MatRef::row_major(&b, k, n).unwrap(),
            0.0,
            MatMut::new(&mut c, m, n, 1, m).unwrap(),
        )
        .unwrap();
        close(&transpose(&c, n, m), &want, k);
        // A row stride wider than the row (a column block of a larger matrix).
        let mut wide = vec![0.0; m * 10];
        gemm(
            1.0,
            MatRef::row_major(&a, m, k).unwrap(),
            MatRef::row_major(&b, k, n).unwrap(),
            0.0,
            MatMut::new(&mut wide, m, n, 10, 1).unwrap(),
        )
        .unwrap();
        for i in 0..m {
            close(&wide[i * 10..i * 10 + n], &want[i * n..(i + 1) * n], k);
        }
    }

    #[test]
    fn bad_shapes_and_bounds_are_errors() {
        let a = vec![0.0; 6];
        let mut c = vec![0.0; 4];
        let err = gemm(
            1.0,
            MatRef::row_major(&a, 2, 3).unwrap(),
            MatRef::row_major(&a, 2, 3).unwrap(),
            0.0,
            MatMut::row_major(&mut c, 2, 2).unwrap(),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "gemm: A is 2 × 3, B is 2 × 3, C is 2 × 2: expected B 3 × 3 and C 2 × 3"
        );
        let err = MatRef::row_major(&a, 3, 3).unwrap_err();
        assert!(
            err.to_string().contains("does not fit in 6 elements"),
            "{err}"
        );
        let err = MatMut::new(&mut c, 2, 2, 1, 1).unwrap_err();
        assert!(err.to_string().contains("overlaps itself"), "{err}");
    }
}
