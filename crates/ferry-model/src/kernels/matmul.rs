//! `out = x · Wᵀ` for row-major `x` (`m × k`, f32) and a PyTorch-layout weight `W` (`n × k`)
//! kept in its stored precision ([`Matrix`]: segments of F32, F16, BF16, Q8_0, Q4_0, Q4_1,
//! which the kernels read in registers at every batch size; Q4_K and Q6_K (and on AVX-512 Q5_0
//! and Q5_1), which the batch-1 kernels read in registers (decode) and the batched steps
//! dequantize a block of rows at a time into an f32 scratch to multiply from there with the
//! f32 kernels: [`WeightDtype::BY_ROWS`]).
//!
//! Each output element is one dot product in the fixed order described in the parent module,
//! whatever `m` is and whichever register tile computes it, so a request's activations give the
//! same bits alone or in a batch of 64. The weights are dequantized in registers as they stream
//! past, each to exactly the f32 the loader's dequantization gives
//! ([`crate::dtype::dequantize_into`]), and enter the same fused multiply-adds in the same
//! order as f32 weights would: a model kept in its stored precision computes the bits of the
//! same model dequantized to f32 at load, reading a quarter to an eighth of the bytes.
//!
//! Speed comes from tiling, not from changing the order: a block of W rows small enough for
//! L2 is multiplied by every activation row before the next block is read, so at batch > 1
//! each weight crosses the memory bus once per step.

use std::ops::Range;

use super::Isa;
use crate::dtype::WeightDtype;
use crate::weights::matrix::Matrix;
use crate::weights::row_groups::GROUP_ROWS;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;

/// Activation rows multiplied by one W block before moving on (bounds the x working set).
const X_BLOCK: usize = 64;
/// W rows kept hot while the activation rows stream past.
const W_BLOCK: usize = 24;
/// Most W rows dequantized into panels at a time by the packed path (`run_rows_packed`),
/// and the count where the activations do not fit in L2 (a prefill chunk): they stream
/// past each block once, so a longer block reads them less often. See [`pack_rows_for`].
const PACK_BLOCK: usize = 48;
/// Bytes of W panels a block holds when the activations fit in [`PACK_X_L2_BYTES`]: with one
/// activation panel, what L1 holds (48 KiB on the machines here).
const PACK_L1_BYTES: usize = 28 << 10;
/// Bytes of packed activations that stay in L2 while the W blocks pass.
const PACK_X_L2_BYTES: usize = 1 << 20;
/// Activation rows from which a W block in another dtype than f32 is dequantized once into
/// an f32 scratch rather than in registers by every tile (the batched tile takes 4 rows).
const DEQUANT_ROWS: usize = 4;
/// Activation rows from which f32 weights go through the AVX-512 panels too
/// (`run_rows_packed`): copying a W block into panels costs a pass over it, which pays in a
/// prefill chunk (on a 2-vCPU Xeon, an F32 prefill of 512 tokens went from 700–712 to
/// 758–806 tok/s over 5 interleaved pairs; chunks of 2048, 690–778 → 771–786), not in a
/// decode batch (batch 64: layer matmuls 69.6–72.9 → 77.5–79.3 ms; batch 8: 315 → 208
/// tok/s), whose weights stream from memory once per step. 128 and 256 measured within
/// noise.
const F32_PANEL_ROWS: usize = 256;
/// Bytes of activation panels an f32 W block meets at a time (see `run_part`): with the
/// block's own panels, what L2 holds.
const F32_X_PANEL_BYTES: usize = 1 << 20;
/// Below this many multiply-adds a step is not worth handing to other threads.
const SERIAL_FMAS: usize = 1 << 15;

/// Raw output pointer shared by the tasks of one matmul.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes only the output columns of its own W rows (disjoint ranges), and
// the parallel loop ends before the `&mut` borrow of the output does.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// Rows of one dtype in memory: row `j` starts `j * row_bytes` bytes after `ptr`, the first
/// `grouped` of them in groups of four ([`crate::weights::row_groups`]: a group's bytes where
/// its rows' would be).
#[derive(Clone, Copy)]
struct Rows {
    ptr: *const u8,
    row_bytes: usize,
    dtype: WeightDtype,
    grouped: usize,
}
// SAFETY: a `Rows` only reads, from a borrowed slice that outlives the matmul it serves.
unsafe impl Send for Rows {}
unsafe impl Sync for Rows {}

/// One segment of W as the kernels see it: its rows and the first output column they fill.
#[derive(Clone, Copy)]
struct Part {
    rows: Rows,
    first_row: usize,
    n_rows: usize,
}

/// `out[i * n + j] = dot(x[i], W[j])` with `n = w.n_rows()`, `k = w.k()`, on the process's
/// instruction set.
pub fn matmul(x: &[f32], w: &Matrix, out: &mut [f32], m: usize) {
    crate::profile::count_weight_bytes(w.n_bytes());
    matmul_with(Isa::current(), x, w, out, m);
}

/// [`matmul`] with an explicit implementation.
pub fn matmul_with(isa: Isa, x: &[f32], w: &Matrix, out: &mut [f32], m: usize) {
    let k = w.k();
    let mut parts = Vec::with_capacity(w.segments().len());
    let mut first_row = 0;
    for s in w.segments() {
        let row_bytes = s
            .dtype()
            .row_bytes(k)
            .expect("a segment holds whole blocks");
        assert_eq!(
            s.bytes().len(),
            row_bytes * s.rows(),
            "matmul: segment size"
        );
        parts.push(Part {
            rows: Rows {
                ptr: s.bytes().as_ptr(),
                row_bytes,
                dtype: s.dtype(),
                grouped: s.grouped_rows(),
            },
            first_row,
            n_rows: s.rows(),
        });
        first_row += s.rows();
    }
    run(isa, x, &parts, out, m, first_row, k);
}

/// [`matmul_with`] for f32 weights in a plain slice (`n × k`), as the kernels' tests and
/// benches hold them.
pub fn matmul_f32_with(
    isa: Isa,
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
) {
    assert!(
        w.len() >= n * k,
        "matmul: w has {} floats, need {n}×{k}",
        w.len()
    );
    let part = Part {
        rows: f32_rows(w, k),
        first_row: 0,
        n_rows: n,
    };
    run(isa, x, &[part], out, m, n, k);
}

/// f32 rows `stride` floats apart.
fn f32_rows(w: &[f32], stride: usize) -> Rows {
    Rows {
        ptr: w.as_ptr().cast(),
        row_bytes: stride * size_of::<f32>(),
        dtype: WeightDtype::F32,
        grouped: 0,
    }
}

/// Checks the activations and output, then runs every part's rows, split over threads by
/// output rows only.
fn run(isa: Isa, x: &[f32], parts: &[Part], out: &mut [f32], m: usize, n: usize, k: usize) {
    assert!(
        x.len() >= m * k,
        "matmul: x has {} floats, need {m}×{k}",
        x.len()
    );
    assert!(
        out.len() >= m * n,
        "matmul: out has {} floats, need {m}×{n}",
        out.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    let ptr = OutPtr(out.as_mut_ptr());
    XPACK.with_borrow_mut(|xpack| {
        // AVX-512 batches against weights in another dtype than f32 (and, from
        // F32_PANEL_ROWS rows, f32 weights too) read the activations as panels (see
        // `run_rows_packed`), packed once here for every task.
        let packed = (cfg!(target_arch = "x86_64")
            && isa == Isa::Avx512
            && m >= DEQUANT_ROWS
            && parts.iter().any(|p| {
                let d = p.rows.dtype;
                (d != WeightDtype::F32 && !d.by_rows()) || m >= F32_PANEL_ROWS
            }))
        .then(|| {
            let panels = aligned(xpack, m * (k / 16 * 16));
            pack_x(x, m, k, panels);
            &*panels
        });
        let job = Job {
            isa,
            x,
            packed,
            m,
            n,
            k,
        };
        let each = |w_rows: Range<usize>| run_rows(job, parts, ptr, w_rows);
        if m * n * k <= SERIAL_FMAS {
            return each(0..n);
        }
        let rows = rows_per_task(n);
        super::pool::run(n.div_ceil(rows), &|t| {
            each(t * rows..((t + 1) * rows).min(n));
        });
    });
}

/// Every f16's f32 value, indexed by its bits: exactly the loader's conversion
/// (`half::f16::to_f32`, which `vcvtph2ps` also gives), built on first use (256 KiB). The
/// batch-1 quantized kernels read block scales from it with plain loads, which leave the
/// vector ports to the multiply-adds; a decode step touches only the lines of the scales its
/// weights hold, a few KiB.
fn f16_table() -> &'static [f32; 1 << 16] {
    static TABLE: std::sync::OnceLock<Box<[f32; 1 << 16]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = Box::new([0.0f32; 1 << 16]);
        for (bits, v) in t.iter_mut().enumerate() {
            *v = half::f16::from_bits(bits as u16).to_f32();
        }
        t
    })
}

/// Where the AVX-512 kernels' software prefetch (the register tiles' and the batch-1
/// quantized kernel's) puts the weight bytes they read a few row groups later, and
/// attention its next KV block ([`super::prefetch`]).
///
/// On Intel, into L2 (`prefetcht1`): a prefetch into L1 holds one of the core's few L1 fill
/// buffers until its line arrives from memory, and those buffers are all the core has for
/// its own demand loads too. Into L2, batch-1 decode of the Q8_0 file went from 137–157 to
/// 155–182 tok/s on a 2-vCPU Xeon (12 interleaved pairs of `ferry bench model`), the Q4_1 file
/// ~2% (its blocks take longer to decode per byte, so the stream waits less); once the
/// weights sat on huge pages (`weights/buf/slab.rs`), the F32 file's from 45.7–48.1 to
/// 48.1–50.9 (the AVX-512 tile's own prefetch, 4 interleaved pairs; batch 32 unchanged).
/// Once the KV arena sat on huge pages too (`ferry_arena`'s `access.rs`), batch-64 decode
/// attention went from 23.9–24.3 to 22.7–23.1 ms per step into L2 (`attn_speed`, context
/// 144). The batched packing and the AVX2 kernels (compute-bound on that host) measured the
/// same either way and keep their L1 prefetches, as does AMD (Zen 5 was tuned with them: four
/// groups ahead for Q8_0).
/// The batch-1 K-quant and 5-bit kernels prefetch into L2 on every vendor whatever this
/// says (`avx512::kernel_k_quant_1`: on Zen 4, 126-128 tok/s into L1, 138-146 into L2).
/// `FERRY_WEIGHT_PREFETCH=l1` or `=l2` overrides the choice, for A/B runs on a new host.
/// Read once per process. Only speed depends on it, never a result.
#[cfg(target_arch = "x86_64")]
pub(super) fn prefetch_to_l2() -> bool {
    static TO_L2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TO_L2.get_or_init(|| match std::env::var("FERRY_WEIGHT_PREFETCH").as_deref() {
        Ok("l2") => true,
        Ok("l1") => false,
        _ => {
            // Leaf 0 names the vendor in EBX, EDX, ECX.
            let id = std::arch::x86_64::__cpuid(0);
            [id.ebx, id.edx, id.ecx] == [0x756e_6547, 0x4965_6e69, 0x6c65_746e] // GenuineIntel
        }
    })
}

/// A software prefetch of the line holding `at` into L2 (`to_l2`, see [`prefetch_to_l2`]) or
/// into L1. A hint: it never faults, so `at` may lie past the weights' end.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_weights(at: *const u8, to_l2: bool) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
    // SAFETY: SSE is part of x86-64, and a prefetch reads nothing architecturally.
    unsafe {
        if to_l2 {
            _mm_prefetch::<_MM_HINT_T1>(at.cast());
        } else {
            _mm_prefetch::<_MM_HINT_T0>(at.cast());
        }
    }
}

/// The f32 values of a quantized block's f16 scales from `table` ([`f16_table`]): its d, and
/// its m when `with_m` (Q4_1; d again otherwise). Scalar loads only, so the batch-1 kernels
/// can broadcast them from memory.
///
/// # Safety
/// The block's first two bytes (four with `with_m`) are readable.
#[inline(always)]
unsafe fn block_scales(table: &[f32; 1 << 16], block: *const u8, with_m: bool) -> [f32; 2] {
    // SAFETY: the scales' bytes are readable, as the caller promised; unaligned reads.
    let at = |offset: usize| unsafe { block.add(offset).cast::<u16>().read_unaligned() };
    let d = table[usize::from(at(0))];
    [d, if with_m { table[usize::from(at(2))] } else { d }]
}

/// A Q4_K super-block's eight 6-bit scales (bytes 0..8 of the result) and eight 6-bit mins
/// (bytes 8..16), unpacked from its 12 packed bytes four at a time: ggml's
/// `get_scale_min_k4` word by word (the loader's [`crate::ggml::q4_k_scale_min`] byte
/// by byte), for the SIMD kernels to widen.
///
/// # Safety
/// The super-block's first 16 bytes are readable.
#[inline(always)]
unsafe fn q4_k_scales_mins(block: *const u8) -> [u32; 4] {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    // SAFETY: bytes 4..16 of the super-block, as the caller promised; unaligned reads.
    let s = |i: usize| unsafe { block.add(4 + 4 * i).cast::<u32>().read_unaligned() };
    let (s0, s1, s2) = (s(0), s(1), s(2));
    [
        s0 & K1,
        (s2 & K2) | (((s0 >> 6) & K3) << 4),
        s1 & K1,
        ((s2 >> 4) & K2) | (((s1 >> 6) & K3) << 4),
    ]
}

thread_local! {
    /// The activations packed into panels, reused from step to step.
    static XPACK: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `len` floats of `buf` starting on a 64-byte boundary, so that every chunk of 16 of a
/// panel is one cache line (a vector load across two lines costs two).
fn aligned(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buf.resize(len + 16, 0.0);
    let off = buf.as_ptr().align_offset(64).min(16);
    &mut buf[off..off + len]
}

/// Rows of a packed panel, of activations ([`pack_x`]) and of W (`avx512::pack_rows`).
const PANEL: usize = 4;

/// Activation rows `x` (`m × k`) as panels of [`PANEL`] rows (the last one may hold fewer):
/// panel `g` starts at `g * PANEL * k16` and holds, for each chunk of 16 elements in order,
/// its rows' 16 floats one after the other, so a tile reads one stream instead of one per
/// row. The elements past `k16` stay in `x`, for the tails.
fn pack_x(x: &[f32], m: usize, k: usize, out: &mut [f32]) {
    let k16 = k / 16 * 16;
    for g in 0..m.div_ceil(PANEL) {
        let rows = g * PANEL..((g + 1) * PANEL).min(m);
        let c = rows.len();
        let panel = &mut out[g * PANEL * k16..][..c * k16];
        for (cc, i) in rows.enumerate() {
            for q in 0..k16 / 16 {
                panel[(q * c + cc) * 16..][..16].copy_from_slice(&x[i * k + q * 16..][..16]);
            }
        }
    }
}

/// One task per thread, each a multiple of 24 rows (every register tile's height divides
/// it). Every task starts its row stream cold (the software prefetch runs ahead inside a
/// task only), so at batch 1 each extra task cost a ramp-up: the default model's matmul
/// shapes, Q8_0, two threads, streamed at 41-45 GB/s as two tasks and 32-33 GB/s as eight
/// (`kernel_speed`, "model-shaped layers"); batch 64 was no worse. The pool
/// still hands a task nobody has started to whoever is free, so a late helper costs at
/// most its half.
fn rows_per_task(n: usize) -> usize {
    n.div_ceil(super::threads()).next_multiple_of(24).max(24)
}

/// One dot product in the same order as one element of [`matmul_with`] with f32 weights,
/// without the tiling (attention calls it per position, so it must be cheap).
pub(super) fn dot_with(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F and BW.
        Isa::Avx512 => unsafe { avx512::dot(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2Fma` is only chosen after run-time detection of AVX2, FMA and F16C.
        Isa::Avx2Fma => unsafe { avx2::dot(a, b) },
        _ => portable::dot8(a, b),
    }
}

/// `out[r] = dot(q, rows[r * stride..r * stride + q.len()])`: one query against rows spaced
/// `stride` floats apart (K vectors of consecutive slots in a KV block), each in the order of
/// [`dot_with`], several rows at once so the FMA latency is hidden.
pub(super) fn dot_rows_with(isa: Isa, q: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    let (n, k) = (out.len(), q.len());
    if n == 0 {
        return;
    }
    assert!(
        stride >= k,
        "dot_rows: stride {stride} is shorter than a row ({k})"
    );
    assert!(
        rows.len() >= (n - 1) * stride + k,
        "dot_rows: rows too short"
    );
    let tile = Tile {
        w: f32_rows(rows, stride),
        x_rows: 0..1,
        w_rows: 0..n,
        n,
        k,
        prefetch: true,
    };
    run_tile(isa, q, out.as_mut_ptr(), &tile);
}

/// `out[i * out_stride + j] = dot(q[i * k..][..k], rows[j * stride..][..k])` for `m` query
/// rows against `n` rows spaced `stride` floats apart, each in the order of [`dot_with`]: the
/// batched register tiles over many queries that share the same K rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn dot_tile_with(
    isa: Isa,
    q: &[f32],
    k: usize,
    rows: &[f32],
    stride: usize,
    n: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let m = q.len() / k.max(1);
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        stride >= k && rows.len() >= (n - 1) * stride + k,
        "dot_tile: rows too short"
    );
    assert!(
        out_stride >= n && out.len() >= (m - 1) * out_stride + n,
        "dot_tile: out too short"
    );
    let tile = Tile {
        w: f32_rows(rows, stride),
        x_rows: 0..m,
        w_rows: 0..n,
        n: out_stride,
        k,
        prefetch: false,
    };
    run_tile(isa, q, out.as_mut_ptr(), &tile);
}

/// What every task of one matmul shares: the instruction set, the activations (`m × k`) and
/// their panels when the AVX-512 batches read them, and the output's row length `n`.
#[derive(Clone, Copy)]
struct Job<'a> {
    isa: Isa,
    x: &'a [f32],
    packed: Option<&'a [f32]>,
    m: usize,
    n: usize,
    k: usize,
}

/// All activation rows against rows `w_rows` of W, part by part.
fn run_rows(job: Job<'_>, parts: &[Part], out: OutPtr, w_rows: Range<usize>) {
    for part in parts {
        let start = w_rows.start.max(part.first_row);
        let end = w_rows.end.min(part.first_row + part.n_rows);
        if start >= end {
            continue;
        }
        // The part's rows are numbered from its first; its output columns start there.
        let local = start - part.first_row..end - part.first_row;
        let out = out.0.wrapping_add(part.first_row);
        let w = part.rows;
        if w.grouped > 0 {
            // Whole groups go to the AVX-512 kernels (the row tiles and the panels), which
            // read them as held; every other row, and every row on the other instruction
            // sets, in the file's layout.
            let whole = if job.isa == Isa::Avx512 {
                let first = local.start.next_multiple_of(GROUP_ROWS).min(local.end);
                first..(local.end.min(w.grouped) / GROUP_ROWS * GROUP_ROWS).max(first)
            } else {
                local.start..local.start
            };
            run_rows_in_file_layout(job, w, out, local.start..whole.start);
            run_part(job, w, out, whole.clone());
            run_rows_in_file_layout(job, w, out, whole.end..local.end);
            continue;
        }
        run_part(job, w, out, local);
    }
}

/// Whether `rows` of `w` are whole groups ([`crate::weights::row_groups`]): what the AVX-512
/// kernels that read groups take.
fn whole_groups(rows: &Range<usize>, w: Rows) -> bool {
    rows.start.is_multiple_of(GROUP_ROWS)
        && rows.end.is_multiple_of(GROUP_ROWS)
        && rows.end <= w.grouped
}

/// Rows `local` of `w` (all held in the file's layout, or all in whole groups for the
/// AVX-512 row tiles) against all activation rows, into `out` from column 0 of the part.
fn run_part(job: Job<'_>, w: Rows, out: *mut f32, local: Range<usize>) {
    let Job {
        isa,
        x,
        packed,
        m,
        n,
        k,
    } = job;
    if local.is_empty() {
        return;
    }
    if w.dtype.by_rows() && !(m == 1 && read_at_batch_1(isa, w.dtype)) {
        // Batched (and Q5_0 / Q5_1 at batch 1 on AVX2): every row block goes through an
        // f32 scratch and the f32 tiles compute from there. At batch 1 the K-quants (and on
        // AVX-512 the 5-bit dtypes) take their own register kernels below (the portable path
        // dequantizes a row at a time).
        return run_rows_dequantized(isa, x, w, out, m, n, k, local);
    }
    let f32_panels = packed.is_some() && m >= F32_PANEL_ROWS;
    if m >= DEQUANT_ROWS && (w.dtype != WeightDtype::F32 || f32_panels) {
        return match packed {
            #[cfg(target_arch = "x86_64")]
            Some(xp) => {
                // Each W block is multiplied by every activation panel while it sits in L2;
                // the activations stream past it once per block, so f32 weights, whose
                // panels are a plain copy, take them in blocks that stay in L2 too, each
                // block copying W again. (Decoding a quantized block again costs more.)
                let k16 = k / 16 * 16;
                let block = if w.dtype == WeightDtype::F32 {
                    (F32_X_PANEL_BYTES / (4 * k16).max(1)).max(F32_PANEL_ROWS) / PANEL * PANEL
                } else {
                    m
                };
                for x0 in (0..m).step_by(block) {
                    let rows = block.min(m - x0);
                    // SAFETY: `packed` is only made for `Avx512`, chosen after run-time
                    // detection of AVX-512F and BW; it holds x's m rows (x0 is a multiple of
                    // PANEL, so these rows' panels start at x0 * k16), and the part's rows lie
                    // inside its memory.
                    unsafe {
                        run_rows_packed(
                            &x[x0 * k..],
                            &xp[x0 * k16..],
                            w,
                            out.wrapping_add(x0 * n),
                            rows,
                            n,
                            k,
                            local.clone(),
                        )
                    };
                }
            }
            _ => run_rows_dequantized(isa, x, w, out, m, n, k, local),
        };
    }
    for x0 in (0..m).step_by(X_BLOCK) {
        let x_rows = x0..(x0 + X_BLOCK).min(m);
        for w0 in local.clone().step_by(W_BLOCK) {
            let tile = Tile {
                w,
                x_rows: x_rows.clone(),
                w_rows: w0..(w0 + W_BLOCK).min(local.end),
                n,
                k,
                prefetch: true,
            };
            run_tile(isa, x, out, &tile);
        }
    }
}

/// [`run_part`] for rows `local` of a part held (partly) in groups, copied back into the
/// file's layout [`PACK_BLOCK`] rows at a time ([`crate::weights::row_groups::file_row`]): the
/// paths that read that layout (the other instruction sets, the batched panels, rows outside
/// a whole group). A copy is a few bytes per block and row against the multiply-adds of
/// every activation row, and the same bytes, so the same bits.
fn run_rows_in_file_layout(job: Job<'_>, w: Rows, out: *mut f32, local: Range<usize>) {
    thread_local! {
        static FILE_ROWS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    if local.is_empty() {
        return;
    }
    let rb = w.row_bytes;
    // SAFETY: the caller checked the part's rows against its segment's bytes, and a
    // segment's rows are `row_bytes` apart; every row of `local` lies inside.
    let held = unsafe { std::slice::from_raw_parts(w.ptr, local.end.max(w.grouped) * rb) };
    FILE_ROWS.with_borrow_mut(|plain| {
        plain.resize(PACK_BLOCK * rb, 0);
        for w0 in local.clone().step_by(PACK_BLOCK) {
            let block = w0..(w0 + PACK_BLOCK).min(local.end);
            for (j, row) in block.clone().zip(plain.chunks_exact_mut(rb)) {
                crate::weights::row_groups::file_row(w.dtype, job.k, held, w.grouped, j, row);
            }
            let rows = Rows {
                ptr: plain.as_ptr(),
                grouped: 0,
                ..w
            };
            run_part(job, rows, out.wrapping_add(w0), 0..block.len());
        }
    });
}

/// [`run_rows`] on AVX-512 for a block of W rows in another dtype than f32 against many
/// activation rows: each block of W rows ([`pack_rows_for`]) is dequantized once into panels
/// of [`PANEL`] rows (the loader's values, so the same bits), and each activation panel
/// (`xp`, from [`pack_x`]) is multiplied by every W panel of the block in turn. A 4 × 4 tile then
/// reads two sequential streams instead of eight rows: batch-64 Q4_1 on one core went from
/// 151–171 to 199–214 GFLOP/s (`kernel_speed`), a batch-64 decode step of the default model
/// 5–10% faster. f32 weights take the panels from [`F32_PANEL_ROWS`] activation rows (on
/// Zen 5 the copy had gained nothing at batch 64; on a Xeon it does, see there).
///
/// # Safety
/// AVX-512F and BW are available; `xp` is x packed by [`pack_x`]; rows `local` lie inside `w`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_rows_packed(
    x: &[f32],
    xp: &[f32],
    w: Rows,
    out: *mut f32,
    m: usize,
    n: usize,
    k: usize,
    local: Range<usize>,
) {
    thread_local! {
        static WPACK: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let k16 = k / 16 * 16;
    WPACK.with_borrow_mut(|wpack| {
        let rows = pack_rows_for(m, k16);
        let wpack = aligned(wpack, rows * k16);
        for w0 in local.clone().step_by(rows) {
            let block = w0..(w0 + rows).min(local.end);
            // SAFETY: as for this function; `wpack` holds the block's panels.
            unsafe { avx512::pack_rows(w, block.clone(), local.end, k, wpack) };
            for i0 in (0..m).step_by(PANEL) {
                let c = (m - i0).min(PANEL);
                for j0 in block.clone().step_by(PANEL) {
                    let nr = (block.end - j0).min(PANEL);
                    let wp = &wpack[(j0 - w0) * k16..][..PANEL * k16];
                    let tile = avx512::Panels {
                        w: (wp, w, j0, nr),
                        x: (&xp[i0 * k16..][..c * k16], x, i0, c),
                        n,
                        k,
                    };
                    // SAFETY: AVX-512F and BW as above; the panels hold these rows, and the
                    // output elements lie inside the m × n output.
                    unsafe { avx512::packed_tile(&tile, out) };
                }
            }
        }
    });
}

/// W rows [`run_rows_packed`] dequantizes at a time for `m` activation rows of `k16`
/// packed elements (a multiple of [`PANEL`], so of the 4-bit row groups too). Where the
/// activations fit in L2 (a decode batch), as many rows as fill [`PACK_L1_BYTES`]: each tile
/// streams one of its two panels from L2 while the other stays in L1, and a block that fits
/// in L1 beside an activation panel is the one that stays, so each activation panel comes
/// from L2 once for every few tiles rather than a W panel for every tile. On a 2-vCPU Xeon
/// (`kernel_speed`, 8 interleaved rounds over the default model's layer shapes at batch 64,
/// Q4_1, two threads) that went from 275 to 293 GFLOP/s (median): at k = 576, 12 rows
/// against 48, 253–286 → 276–314 per shape; at k = 1536, 4 rows, 268 → 278 (12 rows there
/// spill L1: 257).
fn pack_rows_for(m: usize, k16: usize) -> usize {
    let panel_row = 4 * k16.max(16);
    if m.saturating_mul(panel_row) > PACK_X_L2_BYTES {
        return PACK_BLOCK;
    }
    (PACK_L1_BYTES / panel_row).clamp(PANEL, PACK_BLOCK) / PANEL * PANEL
}

/// [`run_rows`] for a block of W rows in another dtype than f32 against many activation
/// rows: each W block is dequantized once into an f32 scratch (the loader's values, so the
/// same bits) and multiplied by every activation row from there, rather than decoded again
/// for every 4 activation rows.
#[allow(clippy::too_many_arguments)]
fn run_rows_dequantized(
    isa: Isa,
    x: &[f32],
    w: Rows,
    out: *mut f32,
    m: usize,
    n: usize,
    k: usize,
    local: Range<usize>,
) {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    SCRATCH.with_borrow_mut(|scratch| {
        scratch.resize(W_BLOCK * k, 0.0);
        for w0 in local.clone().step_by(W_BLOCK) {
            let w_rows = w0..(w0 + W_BLOCK).min(local.end);
            let block = &mut scratch[..w_rows.len() * k];
            dequantize_rows(isa, w, w_rows.clone(), k, block);
            for x0 in (0..m).step_by(X_BLOCK) {
                let tile = Tile {
                    w: f32_rows(block, k),
                    x_rows: x0..(x0 + X_BLOCK).min(m),
                    w_rows: 0..w_rows.len(),
                    n,
                    k,
                    // Just written, so in cache; and a prefetch past the block's last rows
                    // reaches past the scratch, into pages that may not be mapped, where each
                    // one is a failed page walk (measured on Zen 1: the batched quantized
                    // tiles ran at a third of the f32 speed until the scratch grew).
                    prefetch: false,
                };
                run_tile(isa, x, out.wrapping_add(w0), &tile);
            }
        }
    });
}

/// Rows `rows` of `w` dequantized into `out` (`rows.len() × k`), exactly as the loader does
/// (the AVX2 decoders for the dtypes that have them, the batch-1 kernels' decoding for the
/// K-quants, the loader's own code otherwise).
fn dequantize_rows(isa: Isa, w: Rows, rows: Range<usize>, k: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2Fma && !w.dtype.by_rows() {
        // SAFETY: `Avx2Fma` is only chosen after run-time detection of AVX2, FMA and F16C;
        // the rows lie inside the weights the caller checked, and `out` holds them.
        return unsafe { avx2::dequantize_rows(w, rows, k, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && k_quant(w.dtype) {
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F and BW; the
        // rows lie inside the weights the caller checked (whole super-blocks), and `out`
        // holds them.
        return unsafe { avx512::dequantize_k_rows(w, rows, k, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2Fma && k_quant(w.dtype) {
        // SAFETY: as above, for AVX2, FMA and F16C.
        return unsafe { avx2::dequantize_k_rows(w, rows, k, out) };
    }
    let _ = isa;
    let n = w.dtype.row_bytes(k).expect("a row holds whole blocks");
    for (j, o) in rows.zip(out.chunks_exact_mut(k)) {
        // SAFETY: row j lies inside the weights the caller checked.
        let bytes = unsafe { std::slice::from_raw_parts(w.ptr.add(j * w.row_bytes), n) };
        crate::dtype::dequantize_into(w.dtype, bytes, o);
    }
}

/// One tile on the chosen instruction set. The callers checked that `x` and the weights
/// cover the tile's rows and that `out` covers its `m × n` output.
fn run_tile(isa: Isa, x: &[f32], out: *mut f32, tile: &Tile) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx512` is only chosen after run-time detection of AVX-512F and BW.
        Isa::Avx512 => unsafe { avx512::tile(x, out, tile) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Avx2Fma` is only chosen after run-time detection of AVX2, FMA and F16C.
        Isa::Avx2Fma => unsafe { avx2::tile(x, out, tile) },
        _ => portable::tile(x, out, tile),
    }
}

/// [`WeightDtype`]s as numbers, so a kernel can be a const-generic function of its dtype
/// (one copy per dtype, the dtype's branches resolved at compile time).
const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;
const Q8_0: u8 = 3;
const Q4_0: u8 = 4;
const Q4_1: u8 = 5;
const Q4_K: u8 = 6;
const Q6_K: u8 = 7;
const Q5_0: u8 = 8;
const Q5_1: u8 = 9;

fn dtype_code(d: WeightDtype) -> u8 {
    match d {
        WeightDtype::F32 => F32,
        WeightDtype::F16 => F16,
        WeightDtype::BF16 => BF16,
        WeightDtype::Q8_0 => Q8_0,
        WeightDtype::Q4_0 => Q4_0,
        WeightDtype::Q4_1 => Q4_1,
        WeightDtype::Q4_K => Q4_K,
        WeightDtype::Q6_K => Q6_K,
        WeightDtype::Q5_0 => Q5_0,
        WeightDtype::Q5_1 => Q5_1,
    }
}

/// Whether `d` is a K-quant (super-blocks of 256), which the batch-1 kernels read in
/// registers while the batched steps dequantize it into an f32 scratch.
fn k_quant(d: WeightDtype) -> bool {
    matches!(d, WeightDtype::Q4_K | WeightDtype::Q6_K)
}

/// Whether a [`WeightDtype::BY_ROWS`] dtype has a batch-1 register kernel on `isa`: the
/// K-quants everywhere (the portable path reads every dtype a row at a time), Q5_0 and Q5_1
/// on AVX-512.
fn read_at_batch_1(isa: Isa, d: WeightDtype) -> bool {
    k_quant(d) || (isa == Isa::Avx512 && matches!(d, WeightDtype::Q5_0 | WeightDtype::Q5_1))
}

/// One block of the output: activation rows × W rows.
struct Tile {
    w: Rows,
    x_rows: Range<usize>,
    w_rows: Range<usize>,
    /// Floats between output rows.
    n: usize,
    k: usize,
    /// Whether the kernels prefetch the W rows after the tile's current ones (for weights
    /// streaming from memory, not for rows already in cache).
    prefetch: bool,
}

/// The f32 value of element `q` of a row of `dtype` at `row`, as the loader computes it (the
/// kernels' scalar tails, and the portable path's).
///
/// # Safety
/// `row` points at a whole row of at least `q + 1` elements.
unsafe fn scalar_at(dtype: WeightDtype, row: *const u8, q: usize) -> f32 {
    let block = q / dtype.block_elems();
    let n = dtype.block_bytes();
    // SAFETY: the block holding element q lies inside the row.
    let bytes = unsafe { std::slice::from_raw_parts(row.add(block * n), n) };
    let mut values = [0.0f32; crate::ggml::QK];
    let values = &mut values[..dtype.block_elems()];
    crate::dtype::dequantize_into(dtype, bytes, values);
    values[q % dtype.block_elems()]
}

#[cfg(test)]
mod tests;
