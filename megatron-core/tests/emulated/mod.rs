//! The CUDA kernels' own source built for the CPU (`shim.h` + `launch.cpp`, compiled with the
//! system's C++ compiler once per test process) and launched by name with cuLaunchKernel's
//! argument convention. Needs a C++20 compiler (`c++`, or `$CXX`). Every launch is checked for
//! shared-memory races (see `shim.h`): a launch with one fails.
// Each test binary uses part of it.
#![allow(dead_code)]

use std::ffi::{CString, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

pub mod device;

use megatron_core::kernels::dropout::{LogicalIndex, keep_scale, keep_threshold};
use megatron_core::rng::{DropoutStream, PHILOX_W32};

type Launch = unsafe extern "C" fn(
    *const c_char,
    *const u32,
    *const u32,
    *mut *mut c_void,
    *mut *mut c_char,
) -> c_int;

/// The kernels built for the CPU, loaded once per test process: the addresses of
/// `emu_launch_kernel` and `emu_tiles_walked_here`.
fn library() -> (usize, usize) {
    static LIBRARY: OnceLock<(usize, usize)> = OnceLock::new();
    *LIBRARY.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let lib = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("megatron-kernels-{}.so", std::process::id()));
        device::compile(&root, &root.join("tests/emulated/launch.cpp"), &lib, &[]);
        let path = CString::new(lib.to_string_lossy().as_bytes()).unwrap();
        // SAFETY: a shared library this test just built; it stays loaded for the process.
        unsafe {
            let handle = libc::dlopen(path.as_ptr(), libc::RTLD_NOW);
            assert!(!handle.is_null(), "dlopen {}", lib.display());
            let symbol = |name: &std::ffi::CStr| {
                let sym = libc::dlsym(handle, name.as_ptr());
                assert!(!sym.is_null(), "{name:?} not in {}", lib.display());
                sym as usize
            };
            let found = (
                symbol(c"emu_launch_kernel"),
                symbol(c"emu_tiles_walked_here"),
            );
            // Loaded: the file is no longer needed.
            let _ = std::fs::remove_file(&lib);
            found
        }
    })
}

/// The kernels' launcher.
fn launcher() -> Launch {
    // SAFETY: the address of `emu_launch_kernel`, whose C signature `Launch` is.
    unsafe { std::mem::transmute::<usize, Launch>(library().0) }
}

/// The tiles the flash-attention kernels walked on this thread so far (their loops' steps).
pub fn tiles_walked() -> u64 {
    // SAFETY: the address of `emu_tiles_walked_here`, `unsigned long long (void)` in C.
    let f = unsafe { std::mem::transmute::<usize, extern "C" fn() -> u64>(library().1) };
    f()
}

/// One kernel argument, as the C signature types it.
pub enum Arg {
    /// A pointer argument.
    Ptr(*mut c_void),
    /// A struct passed by value: where it lies.
    ByValue(*mut c_void),
    I32(i32),
    I64(i64),
    U32(u32),
    U64(u64),
    F32(f32),
}

/// Runs kernel `name` on `grid` blocks of `block` threads (1-D) with `args`.
pub fn launch(name: &str, grid: usize, block: usize, args: Vec<Arg>) {
    launch_3d(name, [grid, 1, 1], [block, 1, 1], args);
}

/// Runs kernel `name` on a grid of `grid` blocks of `block` threads (x, y, z) with `args`;
/// panics if it races on shared memory or deadlocks at a barrier.
pub fn launch_3d(name: &str, grid: [usize; 3], block: [usize; 3], args: Vec<Arg>) {
    if let Err(report) = try_launch_3d(name, grid, block, args) {
        panic!("{name} failed under the emulation:\n{report}");
    }
}

/// [`launch_3d`], returning the race check's report (one race per line) or the deadlock's
/// (starting `deadlock:`) instead of panicking.
pub fn try_launch_3d(
    name: &str,
    grid: [usize; 3],
    block: [usize; 3],
    mut args: Vec<Arg>,
) -> Result<(), String> {
    let mut ptrs: Vec<*mut c_void> = args
        .iter_mut()
        .map(|a| match a {
            Arg::Ptr(p) => p as *mut *mut c_void as *mut c_void,
            Arg::ByValue(p) => *p,
            Arg::I32(v) => v as *mut i32 as *mut c_void,
            Arg::I64(v) => v as *mut i64 as *mut c_void,
            Arg::U32(v) => v as *mut u32 as *mut c_void,
            Arg::U64(v) => v as *mut u64 as *mut c_void,
            Arg::F32(v) => v as *mut f32 as *mut c_void,
        })
        .collect();
    let name_c = CString::new(name).unwrap();
    let (grid, block) = (grid.map(|d| d as u32), block.map(|d| d as u32));
    let mut races: *mut c_char = std::ptr::null_mut();
    // SAFETY: each pointer addresses a value of the type the kernel's parameter has (the
    // callers follow the C signatures), alive for the call; buffers cover what the kernel reads.
    let status = unsafe {
        launcher()(
            name_c.as_ptr(),
            grid.as_ptr(),
            block.as_ptr(),
            ptrs.as_mut_ptr(),
            &mut races,
        )
    };
    let take_report = || {
        // SAFETY: on -2 and -3 the library set `races` to a NUL-terminated string from malloc.
        unsafe {
            let report = std::ffi::CStr::from_ptr(races)
                .to_string_lossy()
                .into_owned();
            libc::free(races.cast());
            report
        }
    };
    match status {
        0 => Ok(()),
        -2 => Err(take_report()),
        -3 => Err(format!("deadlock: {}", take_report())),
        _ => panic!("no kernel {name}"),
    }
}

/// Deterministic values in [lo, hi).
pub fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 40) as f32 / (1u64 << 24) as f32)
        })
        .collect()
}

/// The mask arguments of `make_mask` (no dropout: threshold 0, scale 1).
pub fn mask_args(dropout: Option<(f32, &DropoutStream, LogicalIndex)>) -> Vec<Arg> {
    let (inner, stride, start, key, id, threshold, scale) = match dropout {
        None => (1, 1, 0, [0, 0], 0, 0, 1.0),
        Some((p, s, i)) => (
            i.inner.max(1) as u64,
            i.logical_stride,
            i.logical_start,
            s.key,
            s.stream,
            keep_threshold(p).unwrap(),
            keep_scale(p),
        ),
    };
    vec![
        Arg::U64(inner),
        Arg::U64(stride),
        Arg::U64(start),
        Arg::U32(key[0]),
        Arg::U32(key[1]),
        Arg::U64(id),
        Arg::U32(threshold),
        Arg::F32(scale),
    ]
}

/// Philox4x32-10's round keys of a stream's key as the flash kernels take them (`PhiloxKeys`:
/// the 10 low words, then the 10 high words; round r adds r·W to the key, wrapping), zeros
/// without dropout.
pub fn round_keys(stream: Option<&DropoutStream>) -> [u32; 20] {
    let mut keys = [0u32; 20];
    if let Some(s) = stream {
        for r in 0..10u32 {
            keys[r as usize] = s.key[0].wrapping_add(r.wrapping_mul(PHILOX_W32[0]));
            keys[10 + r as usize] = s.key[1].wrapping_add(r.wrapping_mul(PHILOX_W32[1]));
        }
    }
    keys
}
