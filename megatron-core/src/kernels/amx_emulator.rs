//! A software AMX for CPUs without one: the few tile instructions the bf16 tile (`gemm/amx.rs`)
//! executes, carried out by a `SIGILL` handler, as the emulated GPU carries out CUDA's calls.
//!
//! A CPU without AMX raises `#UD` (`SIGILL`) at each tile instruction. The handler decodes the
//! instruction at the faulting address, performs it on this thread's tile state (eight tiles of
//! 16 rows × 64 bytes and their shapes, kept in thread-local memory) and returns past it, so the
//! kernel's machine code runs unchanged: its encodings, tile configuration, addressing and
//! strides are all exercised. `MEGATRON_EMULATE_AMX=1` turns it on for a process
//! ([`super::isa`]); the kernels' tests install it themselves.
//!
//! The instructions and their arithmetic follow Intel's Software Developer's Manual:
//!
//! | instruction | effect |
//! | --- | --- |
//! | `ldtilecfg m512` | palette 1: bytes per row and rows of each tile; all tiles zeroed |
//! | `tilerelease` | back to the unconfigured state |
//! | `tilezero tmm` | the tile's rows zeroed |
//! | `tileloadd tmm, [base + index·scale + disp]` | row r from `base + disp + r·(index << scale)` |
//! | `tilestored [..], tmm` | the reverse |
//! | `tdpbf16ps tmm1, tmm2, tmm3` | `tmm1 += tmm2 · tmm3` on bf16 pairs, below |
//!
//! `tdpbf16ps`, for each row m and column n of the destination: two f32 sums start at +0; for
//! each pair k of the sources, the sum of the low halves takes `A[m][k].lo · B[k][n].lo`, the
//! other the high halves' product, each a fused multiply-add rounded to nearest even; then the
//! two sums are added, and that added to the destination. Inputs below f32's least normal read as
//! zero and results below it are flushed to zero. Any other instruction, or a tile instruction the
//! state does not allow (an unconfigured tile, shapes that do not chain), is not emulated: the
//! handler steps aside and the instruction faults again, ending the process as hardware would.

use std::cell::UnsafeCell;
use std::sync::Once;

/// Tiles of palette 1.
const TILES: usize = 8;
/// Bytes of one tile (16 rows of 64).
const TILE_BYTES: usize = 1024;

/// One thread's tile state.
struct State {
    /// Whether `ldtilecfg` set a palette (and `tilerelease` has not cleared it).
    configured: bool,
    /// Rows of each tile.
    rows: [usize; TILES],
    /// Bytes per row of each tile.
    colsb: [usize; TILES],
    /// The tiles' data, row r of a tile at byte `64·r`.
    data: [[u8; TILE_BYTES]; TILES],
}

impl State {
    const EMPTY: State = State {
        configured: false,
        rows: [0; TILES],
        colsb: [0; TILES],
        data: [[0; TILE_BYTES]; TILES],
    };

    /// Whether `tile` is configured with a shape.
    fn valid(&self, tile: usize) -> bool {
        self.configured && tile < TILES && self.rows[tile] > 0
    }

    /// The f32 (or bf16 pair) element `e` of `tile`'s row `r`, as bits.
    fn word(&self, tile: usize, r: usize, e: usize) -> u32 {
        let at = 64 * r + 4 * e;
        let bytes = &self.data[tile][at..at + 4];
        u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
    }

    fn set_word(&mut self, tile: usize, r: usize, e: usize, bits: u32) {
        let at = 64 * r + 4 * e;
        self.data[tile][at..at + 4].copy_from_slice(&bits.to_le_bytes());
    }
}

thread_local! {
    /// This thread's tiles: const-initialised and without a destructor, so the handler's access
    /// allocates nothing.
    static STATE: UnsafeCell<State> = const { UnsafeCell::new(State::EMPTY) };
}

/// Installs the handler (once per process); later `SIGILL`s that are not tile instructions end
/// the process as before.
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: a plain sigaction with a handler of the SA_SIGINFO signature; the handler only
        // touches this thread's tile state, the faulting context and the memory the emulated
        // instruction names.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigill as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGILL, &action, std::ptr::null_mut());
        }
    });
}

/// The `SIGILL` handler: emulates the instruction at the faulting address, or restores the
/// default action so that it faults for good.
extern "C" fn on_sigill(
    _sig: libc::c_int,
    _info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes the interrupted thread's context; the instruction bytes at its
    // RIP are mapped (they just faulted on decode, not on fetch).
    unsafe {
        let context = &mut *context.cast::<libc::ucontext_t>();
        let gregs = &mut context.uc_mcontext.gregs;
        let rip = gregs[libc::REG_RIP as usize] as u64;
        let code = std::slice::from_raw_parts(rip as *const u8, 15);
        let done = STATE.with(|state| execute(&mut *state.get(), code, rip, gregs));
        match done {
            Some(len) => gregs[libc::REG_RIP as usize] += len as i64,
            None => {
                libc::signal(libc::SIGILL, libc::SIG_DFL);
            }
        }
    }
}

/// The general registers by their encoding number (rax, rcx, rdx, rbx, rsp, rbp, rsi, rdi,
/// r8–r15), as indices of the saved context.
const GPR: [libc::c_int; 16] = [
    libc::REG_RAX,
    libc::REG_RCX,
    libc::REG_RDX,
    libc::REG_RBX,
    libc::REG_RSP,
    libc::REG_RBP,
    libc::REG_RSI,
    libc::REG_RDI,
    libc::REG_R8,
    libc::REG_R9,
    libc::REG_R10,
    libc::REG_R11,
    libc::REG_R12,
    libc::REG_R13,
    libc::REG_R14,
    libc::REG_R15,
];

/// A decoded memory operand: its address and, where it has one, its SIB index scaled (a tile
/// load's or store's row stride).
struct Memory {
    address: u64,
    stride: Option<u64>,
}

/// Executes the tile instruction at the start of `code` (at address `rip`) on `state`; its
/// length, or `None` when it is not one this emulator performs.
///
/// # Safety
/// The memory the instruction names must be valid for the access (the emulated program's
/// contract, as on hardware).
unsafe fn execute(state: &mut State, code: &[u8], rip: u64, gregs: &[i64]) -> Option<usize> {
    // A three-byte VEX prefix in map 0F38, W0, L0 (the 128-bit form every tile instruction has).
    if code[0] != 0xC4 || code[1] & 0x1F != 0b00010 || code[2] & 0x84 != 0 {
        return None;
    }
    let (r, x, b) = (
        usize::from(!code[1] >> 7 & 1),
        usize::from(!code[1] >> 6 & 1),
        usize::from(!code[1] >> 5 & 1),
    );
    let vvvv = usize::from(!code[2] >> 3 & 0xF);
    let pp = code[2] & 3;
    let (opcode, modrm) = (code[3], code[4]);
    let mode = modrm >> 6;
    let reg = usize::from(modrm >> 3 & 7) | r << 3;
    let rm = usize::from(modrm & 7) | b << 3;
    let register = |n: usize| gregs[GPR[n] as usize] as u64;
    // The memory operand after ModRM, and the instruction's length.
    let memory = || -> (Memory, usize) {
        let mut len = 5;
        let (mut base, mut stride) = (None, None);
        let mut rip_relative = false;
        if modrm & 7 == 4 {
            let sib = code[5];
            len += 1;
            let index = usize::from(sib >> 3 & 7) | x << 3;
            if index != 4 {
                stride = Some(register(index) << (sib >> 6));
            }
            if !(sib & 7 == 5 && mode == 0) {
                base = Some(register(usize::from(sib & 7) | b << 3));
            }
        } else if modrm & 7 == 5 && mode == 0 {
            rip_relative = true;
        } else {
            base = Some(register(rm));
        }
        // A byte of displacement, or four (mod 10, and the forms without a base).
        let disp: i64 = match mode {
            1 => {
                len += 1;
                i64::from(code[len - 1] as i8)
            }
            _ if mode == 2 || base.is_none() => {
                len += 4;
                i64::from(i32::from_le_bytes([
                    code[len - 4],
                    code[len - 3],
                    code[len - 2],
                    code[len - 1],
                ]))
            }
            _ => 0,
        };
        let start = if rip_relative {
            rip + len as u64
        } else {
            base.unwrap_or(0)
        };
        let address = start.wrapping_add(disp as u64);
        (Memory { address, stride }, len)
    };
    match (opcode, pp, mode == 3) {
        // LDTILECFG m512.
        (0x49, 0, false) if reg & 7 == 0 => {
            let (at, len) = memory();
            let config = unsafe { std::slice::from_raw_parts(at.address as *const u8, 64) };
            configure(state, config).then_some(len)
        }
        // TILERELEASE.
        (0x49, 0, true) if modrm == 0xC0 => {
            *state = State::EMPTY;
            Some(5)
        }
        // TILEZERO tmm.
        (0x49, 3, true) if rm & 7 == 0 && state.valid(reg) => {
            state.data[reg] = [0; TILE_BYTES];
            Some(5)
        }
        // TILELOADD (or TILELOADDT1) tmm, sibmem.
        (0x4B, 3 | 1, false) if modrm & 7 == 4 && state.valid(reg) => {
            let (at, len) = memory();
            let stride = at.stride?;
            let tile = &mut state.data[reg];
            *tile = [0; TILE_BYTES];
            for row in 0..state.rows[reg] {
                let from = at.address.wrapping_add(row as u64 * stride) as *const u8;
                let bytes = unsafe { std::slice::from_raw_parts(from, state.colsb[reg]) };
                tile[64 * row..64 * row + bytes.len()].copy_from_slice(bytes);
            }
            Some(len)
        }
        // TILESTORED sibmem, tmm.
        (0x4B, 2, false) if modrm & 7 == 4 && state.valid(reg) => {
            let (at, len) = memory();
            let stride = at.stride?;
            for row in 0..state.rows[reg] {
                let to = at.address.wrapping_add(row as u64 * stride) as *mut u8;
                let bytes = &state.data[reg][64 * row..64 * row + state.colsb[reg]];
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), to, bytes.len()) };
            }
            Some(len)
        }
        // TDPBF16PS tmm1, tmm2, tmm3.
        (0x5C, 2, true) => dot_bf16_pairs(state, reg, rm, vvvv).then_some(5),
        _ => None,
    }
}

/// `ldtilecfg` of palette 1 (or 0, which releases); false for a configuration hardware rejects.
fn configure(state: &mut State, config: &[u8]) -> bool {
    match config[0] {
        0 => {
            *state = State::EMPTY;
            true
        }
        1 => {
            let mut next = State::EMPTY;
            next.configured = true;
            for t in 0..TILES {
                let colsb =
                    usize::from(u16::from_le_bytes([config[16 + 2 * t], config[17 + 2 * t]]));
                let rows = usize::from(config[48 + t]);
                if colsb > 64 || rows > 16 || (colsb == 0) != (rows == 0) {
                    return false;
                }
                (next.colsb[t], next.rows[t]) = (colsb, rows);
            }
            *state = next;
            true
        }
        _ => false,
    }
}

/// A bf16 (the high half of an f32 pattern) read as f32, a denormal as zero of its sign.
fn bf16_in(half: u32) -> f32 {
    let value = f32::from_bits(half << 16);
    if value.is_subnormal() {
        0.0f32.copysign(value)
    } else {
        value
    }
}

/// `x` with a result below f32's least normal flushed to zero of its sign.
fn flushed(x: f32) -> f32 {
    if x.is_subnormal() {
        0.0f32.copysign(x)
    } else {
        x
    }
}

/// `tdpbf16ps dst, a, b`; false when the tiles do not chain as the instruction requires.
fn dot_bf16_pairs(state: &mut State, dst: usize, a: usize, b: usize) -> bool {
    let shapes_chain = [dst, a, b].iter().all(|&t| state.valid(t))
        && dst != a
        && dst != b
        && a != b
        && state.rows[a] == state.rows[dst]
        && state.colsb[a] / 4 == state.rows[b]
        && state.colsb[b] == state.colsb[dst]
        && [dst, a, b]
            .iter()
            .all(|&t| state.colsb[t].is_multiple_of(4));
    if !shapes_chain {
        return false;
    }
    let (rows, columns, pairs) = (state.rows[dst], state.colsb[dst] / 4, state.rows[b]);
    for m in 0..rows {
        let mut sums = [0.0f32; 32];
        for k in 0..pairs {
            let x = state.word(a, m, k);
            for n in 0..columns {
                let y = state.word(b, k, n);
                for (half, shift) in [(0, 0), (1, 16)] {
                    let product = bf16_in(x >> shift & 0xFFFF)
                        .mul_add(bf16_in(y >> shift & 0xFFFF), sums[2 * n + half]);
                    sums[2 * n + half] = flushed(product);
                }
            }
        }
        for n in 0..columns {
            let pair = flushed(sums[2 * n] + sums[2 * n + 1]);
            let old = f32::from_bits(state.word(dst, m, n));
            let old = if old.is_subnormal() {
                0.0f32.copysign(old)
            } else {
                old
            };
            state.set_word(dst, m, n, flushed(old + pair).to_bits());
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::arch::asm;

    /// Palette 1 with tiles 0–2 of 2 rows: tile 0 of 2 f32 columns (8 bytes), tile 1 of 2 pairs
    /// (A, 2 × 2 pairs), tile 2 of 2 pairs by 2 columns (B).
    fn small_config() -> [u8; 64] {
        let mut config = [0u8; 64];
        config[0] = 1;
        for t in 0..3 {
            config[16 + 2 * t] = 8;
            config[48 + t] = 2;
        }
        config
    }

    fn pair(hi: f32, lo: f32) -> u32 {
        let bits = |v: f32| u32::from(half::bf16::from_f32(v).to_bits());
        (bits(hi) << 16) | bits(lo)
    }

    /// Whether the instructions would run on the CPU itself rather than here.
    fn in_hardware() -> bool {
        if crate::kernels::isa::amx_in_hardware() {
            eprintln!("this CPU has AMX: the emulator is not what runs the instructions");
            return true;
        }
        false
    }

    #[test]
    fn the_pair_sums_are_kept_apart_until_the_end_of_the_instruction() {
        if in_hardware() {
            return;
        }
        install();
        // One row of A, k = 4 steps in 2 pairs (high half the earlier step), against B = ones:
        // the steps' products are 2²⁴, 1, −2²⁴, 1. Summed in order (as an f32 FMA chain does),
        // 2²⁴ + 1 rounds to 2²⁴ (a tie, to even) and the result is 1; tdpbf16ps sums the high
        // halves (2²⁴ − 2²⁴ = 0) and the low ones (1 + 1 = 2) apart, then adds them: 2.
        let big = 2f32.powi(24);
        let a: [u32; 4] = [
            pair(big, 1.0),
            pair(-big, 1.0),
            pair(0.0, 0.0),
            pair(0.0, 0.0),
        ];
        let b: [u32; 4] = [
            pair(1.0, 1.0),
            pair(1.0, 1.0),
            pair(1.0, 1.0),
            pair(1.0, 1.0),
        ];
        // C starts at 0.5 in both columns of row 0 and −3 in row 1.
        let mut c: [f32; 4] = [0.5, 0.5, -3.0, -3.0];
        let config = small_config();
        let stride = 8usize;
        // SAFETY: the emulator is installed; every address names the arrays above, rows 8 bytes
        // apart.
        unsafe {
            asm!("ldtilecfg [{0}]", in(reg) config.as_ptr(), options(nostack, readonly));
            asm!("tileloadd tmm0, [{0} + {1}*1]", in(reg) c.as_ptr(), in(reg) stride, options(nostack, readonly));
            asm!("tileloadd tmm1, [{0} + {1}*1]", in(reg) a.as_ptr(), in(reg) stride, options(nostack, readonly));
            asm!("tileloadd tmm2, [{0} + {1}*1]", in(reg) b.as_ptr(), in(reg) stride, options(nostack, readonly));
            asm!("tdpbf16ps tmm0, tmm1, tmm2", options(nostack, nomem));
            asm!("tilestored [{0} + {1}*1], tmm0", in(reg) c.as_mut_ptr(), in(reg) stride, options(nostack));
            asm!("tilerelease", options(nostack, nomem));
        }
        assert_eq!(c, [2.5, 2.5, -3.0, -3.0]);
        let chained = ((big + 1.0) - big) + 1.0;
        assert_eq!(
            chained + 0.5,
            1.5,
            "the in-order sum this instruction does not take"
        );
    }

    #[test]
    fn tilezero_clears_and_an_unconfigured_state_is_refused() {
        if in_hardware() {
            return;
        }
        install();
        let mut state = State::EMPTY;
        assert!(
            !dot_bf16_pairs(&mut state, 0, 1, 2),
            "tiles before ldtilecfg"
        );
        assert!(configure(&mut state, &small_config()));
        assert!(
            !dot_bf16_pairs(&mut state, 0, 0, 2),
            "a tile both source and destination"
        );
        assert!(!dot_bf16_pairs(&mut state, 0, 1, 3), "an unconfigured tile");
        let mut bad = small_config();
        bad[16] = 65;
        assert!(!configure(&mut state, &bad), "rows of more than 64 bytes");
        let config = small_config();
        let mut c = [7.0f32; 4];
        let stride = 8usize;
        // SAFETY: as above.
        unsafe {
            asm!("ldtilecfg [{0}]", in(reg) config.as_ptr(), options(nostack, readonly));
            asm!("tileloadd tmm0, [{0} + {1}*1]", in(reg) c.as_ptr(), in(reg) stride, options(nostack, readonly));
            asm!("tilezero tmm0", options(nostack, nomem));
            asm!("tilestored [{0} + {1}*1], tmm0", in(reg) c.as_mut_ptr(), in(reg) stride, options(nostack));
            asm!("tilerelease", options(nostack, nomem));
        }
        assert_eq!(c, [0.0; 4]);
    }
}
