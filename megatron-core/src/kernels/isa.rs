//! Run-time instruction-set dispatch of the kernels' hot loops.
//!
//! The crate is compiled for baseline x86-64 (SSE2), so a plain loop vectorises at most 4 lanes
//! wide. The crate-private `versioned!` macro compiles a loop three times, for AVX-512 (F, BW,
//! DQ, VL), for AVX2 + FMA and for the baseline, and the caller picks one with an [`Isa`]:
//! [`Isa::detected`] is the best set this CPU supports (detected once per process). On other
//! architectures only the baseline exists.
//!
//! # Results do not depend on the version
//!
//! Rust never contracts `a·b + c` into a fused multiply-add, nor reorders floating-point
//! operations, on its own; the kernels call no `mul_add` and keep their reductions in explicit,
//! fixed-order lanes. So every version performs the same IEEE operations in the same order and
//! returns bit-identical results: a wider vector only runs more of them at once. The tests of
//! each kernel check that on every version the machine supports. (Should a kernel ever use FMA
//! deliberately, its results could differ in the last bit between instruction sets; none does.)
//!
//! # Choosing a version by hand
//!
//! The environment variable `MEGATRON_KERNEL_ISA` (`baseline`, `avx2`, `avx512`, `avx512bf16`
//! or `amx`), read once, caps the detected set, to compare the versions' speed; a set the CPU
//! lacks is never used. The CLI rejects any other value ([`check_env`]); a library user's bad
//! value is warned about and ignored.
//!
//! # AMX
//!
//! [`Level::Amx`] adds the tile instructions of AMX-BF16 (Sapphire Rapids and later), which bf16
//! products run on. Linux hands a process the tiles' register state only when asked
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`): detection asks, and a refusal leaves AMX unused.
//! `MEGATRON_EMULATE_AMX=1` runs the tile instructions in software on a CPU with AVX512_BF16 but
//! no AMX (`amx_emulator.rs`), slowly, so that a machine without AMX can check what one with it
//! computes.

use std::sync::OnceLock;

/// Instruction-set levels, in increasing order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Level {
    /// Baseline of the compilation target (SSE2 on x86-64).
    Baseline,
    /// AVX2 with FMA (Haswell and later, Zen).
    Avx2,
    /// AVX-512 F, BW, DQ and VL (Skylake-SP and later, Zen 4).
    Avx512,
    /// AVX-512 with the BF16 dot products (Cooper Lake, Sapphire Rapids and later, Zen 4): the
    /// loops run as at [`Level::Avx512`]; bf16 products have a register tile of their own.
    Avx512Bf16,
    /// [`Level::Avx512Bf16`] with AMX-TILE and AMX-BF16 (Sapphire Rapids and later): bf16
    /// products run on the tile instructions.
    Amx,
}

/// An instruction set this CPU supports: only [`Isa::detected`] and [`Isa::supported`] make one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Isa(Level);

impl Isa {
    /// The baseline, which every CPU of the compilation target supports.
    pub const BASELINE: Isa = Isa(Level::Baseline);

    /// The widest set this CPU supports, capped by `MEGATRON_KERNEL_ISA` when it is set.
    pub fn detected() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let best = best_level();
            let cap = requested_cap().unwrap_or_else(|e| {
                eprintln!("warning: {e}; using every set the CPU has");
                None
            });
            let cap = cap.unwrap_or(Level::Amx);
            Isa(best.min(cap))
        })
    }

    /// Every set this CPU supports, the baseline first.
    pub fn supported() -> Vec<Isa> {
        let best = best_level();
        [
            Level::Baseline,
            Level::Avx2,
            Level::Avx512,
            Level::Avx512Bf16,
            Level::Amx,
        ]
        .into_iter()
        .filter(|&l| l <= best)
        .map(Isa)
        .collect()
    }

    /// `"baseline"`, `"avx2"`, `"avx512"`, `"avx512bf16"` or `"amx"`.
    pub fn name(self) -> &'static str {
        match self.0 {
            Level::Baseline => "baseline",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
            Level::Avx512Bf16 => "avx512bf16",
            Level::Amx => "amx",
        }
    }

    /// Whether the CPU multiplies bf16 pairs (AVX512_BF16's `vdpbf16ps`) at this level.
    pub fn bf16_dot(self) -> bool {
        self.0 >= Level::Avx512Bf16
    }

    /// Whether bf16 products run on AMX tiles at this level.
    pub fn amx(self) -> bool {
        self.0 == Level::Amx
    }

    /// The level, for [`versioned!`]'s dispatch.
    #[inline(always)]
    pub(crate) fn level(self) -> Level {
        self.0
    }
}

/// The name of the environment variable that caps the detected set.
pub const ENV: &str = "MEGATRON_KERNEL_ISA";

/// The cap `MEGATRON_KERNEL_ISA` asks for: `None` when it is unset or empty.
fn requested_cap() -> Result<Option<Level>, super::KernelError> {
    cap_from(std::env::var_os(ENV).as_deref())
}

/// The cap a value of `MEGATRON_KERNEL_ISA` asks for.
fn cap_from(value: Option<&std::ffi::OsStr>) -> Result<Option<Level>, super::KernelError> {
    let Some(value) = value else {
        return Ok(None);
    };
    let text = value.to_string_lossy();
    if text.trim().is_empty() {
        return Ok(None);
    }
    parse_level(&text)
        .map(Some)
        .ok_or_else(|| super::KernelError::Invalid {
            kernel: "isa",
            message: format!(
                "{ENV}={text:?} names no instruction set: use baseline, avx2, avx512, avx512bf16 \
                 or amx"
            ),
        })
}

/// Checks `MEGATRON_KERNEL_ISA`: an error naming the value when it is set to no known set.
pub fn check_env() -> Result<(), super::KernelError> {
    requested_cap()?;
    emulate_amx_from(std::env::var_os(EMULATE_AMX).as_deref()).map(|_| ())
}

/// Whether a value of `MEGATRON_EMULATE_AMX` asks for the emulator: `1` yes, unset, empty or `0`
/// no, anything else an error naming the value.
fn emulate_amx_from(value: Option<&std::ffi::OsStr>) -> Result<bool, super::KernelError> {
    match value.map(|v| v.to_string_lossy()) {
        None => Ok(false),
        Some(v) if v.trim().is_empty() || v.trim() == "0" => Ok(false),
        Some(v) if v.trim() == "1" => Ok(true),
        Some(v) => Err(super::KernelError::Invalid {
            kernel: "isa",
            message: format!("{EMULATE_AMX}={v:?}: use 1 (emulate AMX) or 0"),
        }),
    }
}

fn parse_level(name: &str) -> Option<Level> {
    match name.trim().to_ascii_lowercase().as_str() {
        "baseline" | "sse2" | "none" => Some(Level::Baseline),
        "avx2" => Some(Level::Avx2),
        "avx512" | "avx-512" => Some(Level::Avx512),
        "avx512bf16" | "avx512_bf16" => Some(Level::Avx512Bf16),
        "amx" | "amx-bf16" | "amx_bf16" => Some(Level::Amx),
        _ => None,
    }
}

/// The widest level the CPU (and the OS, which must save the wide registers) supports.
fn best_level() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("bmi1")
            && std::is_x86_feature_detected!("bmi2")
            && std::is_x86_feature_detected!("lzcnt")
            && std::is_x86_feature_detected!("popcnt");
        let avx512 = avx2
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512dq")
            && std::is_x86_feature_detected!("avx512vl");
        if avx512 && std::is_x86_feature_detected!("avx512bf16") {
            return match amx_granted() || amx_emulated() {
                true => Level::Amx,
                false => Level::Avx512Bf16,
            };
        }
        if avx512 {
            return Level::Avx512;
        }
        if avx2 {
            return Level::Avx2;
        }
    }
    Level::Baseline
}

/// The name of the environment variable that runs AMX's instructions in software.
pub const EMULATE_AMX: &str = "MEGATRON_EMULATE_AMX";

/// Whether the CPU has AMX-TILE and AMX-BF16, and the OS saves the tiles' state (XCR0's
/// XTILECFG and XTILEDATA bits): AMX in silicon, not the emulator.
pub fn amx_in_hardware() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__cpuid, __cpuid_count};
        // CPUID exists on every x86-64 CPU; leaf 7 counts only when leaf 0 lists it.
        let (max_leaf, leaf7) = (__cpuid(0).eax, __cpuid_count(7, 0));
        let amx_bf16 = leaf7.edx >> 22 & 1 == 1;
        let amx_tile = leaf7.edx >> 24 & 1 == 1;
        if max_leaf < 7 || !amx_bf16 || !amx_tile || !std::is_x86_feature_detected!("xsave") {
            return false;
        }
        #[target_feature(enable = "xsave")]
        fn xcr0() -> u64 {
            // SAFETY: XSAVE (and so XGETBV) was detected.
            unsafe { std::arch::x86_64::_xgetbv(0) }
        }
        // SAFETY: XSAVE was detected above.
        let xcr0 = unsafe { xcr0() };
        return xcr0 >> 17 & 0b11 == 0b11;
    }
    #[allow(unreachable_code)]
    false
}

/// Whether this process may use the AMX tiles: the CPU has them and Linux granted their state
/// (asked once).
fn amx_granted() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        /// `arch_prctl`'s request for permission to use an XSAVE feature.
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        /// The XSAVE feature number of the tiles' data.
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        static GRANTED: OnceLock<bool> = OnceLock::new();
        return *GRANTED.get_or_init(|| {
            // SAFETY: arch_prctl with an integer argument; it changes only this process's
            // permission to use the tiles.
            amx_in_hardware()
                && unsafe {
                    libc::syscall(
                        libc::SYS_arch_prctl,
                        ARCH_REQ_XCOMP_PERM,
                        XFEATURE_XTILEDATA,
                    )
                } == 0
        });
    }
    #[allow(unreachable_code)]
    false
}

/// Whether `MEGATRON_EMULATE_AMX=1` asks for AMX in software on a CPU without it; the emulator
/// is installed when it does.
fn amx_emulated() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    if emulate_amx_from(std::env::var_os(EMULATE_AMX).as_deref()).unwrap_or(false)
        && !amx_in_hardware()
    {
        super::amx_emulator::install();
        return true;
    }
    false
}

/// AMX for the kernels' tests: the CPU's own where it has AMX and Linux grants it, else the
/// emulator, on a CPU with AVX512_BF16 (the tile's packing and epilogue use AVX-512); `None`
/// elsewhere.
#[cfg(test)]
pub(crate) fn amx_for_tests() -> Option<Isa> {
    if best_level() < Level::Avx512Bf16 {
        return None;
    }
    if amx_granted() {
        return Some(Isa(Level::Amx));
    }
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    if !amx_in_hardware() {
        super::amx_emulator::install();
        return Some(Isa(Level::Amx));
    }
    None
}

/// Runs `f` compiled for the widest instruction set this CPU supports ([`Isa::detected`]): the
/// host loops `#[megatron::module]` generates (`ops::fused`) call their loop through it. What
/// `f` calls should be `#[inline(always)]`, so that it is compiled into each version; as with
/// [`versioned!`], every version gives the same bits (no fused multiply-add is formed).
#[inline(always)]
pub fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
        #[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
        fn avx512<R>(f: impl FnOnce() -> R) -> R {
            f()
        }

        #[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }

        match Isa::detected().level() {
            // SAFETY: an `Isa` only ever holds a level the CPU supports.
            Level::Avx512 | Level::Avx512Bf16 | Level::Amx => return unsafe { avx512(f) },
            // SAFETY: as above.
            Level::Avx2 => return unsafe { avx2(f) },
            Level::Baseline => {}
        }
    }
    f()
}

/// Defines `fn name(isa: Isa, args..) -> ret` whose body is compiled once per instruction set.
///
/// ```ignore
/// versioned! {
///     /// Doc comment.
///     fn add_loop(a: &[f32], b: &[f32], out: &mut [f32]) {
///         for ((o, &p), &q) in out.iter_mut().zip(a).zip(b) { *o = p + q; }
///     }
/// }
/// add_loop(Isa::detected(), &a, &b, &mut out);
/// ```
///
/// The body must not be generic; what it calls should be `#[inline]` (small helpers
/// `#[inline(always)]`) so that it is compiled into each version rather than called at baseline.
macro_rules! versioned {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name(isa: $crate::kernels::isa::Isa, $($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
                #[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
                fn avx512($($arg: $ty),*) $(-> $ret)? $body

                #[allow(clippy::too_many_arguments)]
                #[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
                fn avx2($($arg: $ty),*) $(-> $ret)? $body

                match isa.level() {
                    // SAFETY: an `Isa` only ever holds a level the CPU supports.
                    $crate::kernels::isa::Level::Avx512
                    | $crate::kernels::isa::Level::Avx512Bf16
                    | $crate::kernels::isa::Level::Amx => {
                        return unsafe { avx512($($arg),*) };
                    }
                    // SAFETY: as above.
                    $crate::kernels::isa::Level::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::kernels::isa::Level::Baseline => {}
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = isa;
            $body
        }
    };
}

pub(crate) use versioned;

#[cfg(test)]
mod tests {
    use super::*;

    versioned! {
        fn sum_sq(xs: &[f32]) -> f32 {
            xs.iter().map(|v| v * v).sum()
        }
    }

    #[test]
    fn levels_are_ordered_and_named() {
        let all = Isa::supported();
        assert_eq!(all[0], Isa::BASELINE);
        assert!(all.contains(&Isa::detected()));
        assert!(all.windows(2).all(|w| w[0].level() < w[1].level()));
        assert_eq!(Isa::BASELINE.name(), "baseline");
        assert_eq!(parse_level(" AVX512 "), Some(Level::Avx512));
        assert_eq!(parse_level("avx2"), Some(Level::Avx2));
        assert_eq!(parse_level("AVX512_BF16"), Some(Level::Avx512Bf16));
        assert_eq!(parse_level("amx"), Some(Level::Amx));
        assert_eq!(parse_level("sse2"), Some(Level::Baseline));
        assert_eq!(parse_level("neon"), None);
    }

    #[test]
    fn a_cap_that_names_no_set_is_an_error() {
        use std::ffi::OsStr;
        assert_eq!(cap_from(None).unwrap(), None);
        assert_eq!(cap_from(Some(OsStr::new(" "))).unwrap(), None);
        assert_eq!(
            cap_from(Some(OsStr::new("avx2"))).unwrap(),
            Some(Level::Avx2)
        );
        assert!(!emulate_amx_from(None).unwrap());
        assert!(!emulate_amx_from(Some(OsStr::new("0"))).unwrap());
        assert!(emulate_amx_from(Some(OsStr::new(" 1"))).unwrap());
        let e = emulate_amx_from(Some(OsStr::new("yes")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("MEGATRON_EMULATE_AMX=\"yes\": use 1"), "{e}");
        let e = cap_from(Some(OsStr::new("neon"))).unwrap_err().to_string();
        assert!(
            e.contains("MEGATRON_KERNEL_ISA=\"neon\"") && e.contains("avx512bf16"),
            "{e}"
        );
    }

    #[test]
    fn every_version_computes_the_same() {
        let xs: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.37).sin()).collect();
        let want = sum_sq(Isa::BASELINE, &xs);
        for isa in Isa::supported() {
            assert_eq!(sum_sq(isa, &xs).to_bits(), want.to_bits(), "{}", isa.name());
        }
    }
}
