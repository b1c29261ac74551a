//! The emulated GPU (`device.cpp`: the CUDA driver, cuBLAS, cuBLASLt and NCCL calls megatron-rs makes,
//! implemented on the CPU, running the kernels' own CUDA C; `nccl.cpp` between processes through
//! shared memory) for the GPU tests on a machine without one. With `MEGATRON_EMULATED_GPU=1`,
//! [`install_if_requested`] builds it with the system's C++ compiler (once per source text,
//! under the test target's temporary folder) and loads it before cudarc looks for `libcuda.so`,
//! `libcublas.so`, `libcublasLt.so` and `libnccl.so`, which then finds it: the libraries are
//! loaded under those names (their sonames), and a name already loaded is not searched for
//! again. [`build`] gives the folder, for processes started with it on their library path.
//! NVRTC stays the real one (it needs no GPU): its PTX tells the emulation which kernels a
//! program has and their thread limits.
//!
//! ```sh
//! MEGATRON_EMULATED_GPU=1 cargo test -p megatron-core --features cuda --test cuda_backend -- --include-ignored
//! ```

// Each test file uses part of it.
#![allow(dead_code)]

use std::ffi::CString;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Whether the tests asked for the emulated GPU (`MEGATRON_EMULATED_GPU=1`).
pub fn requested() -> bool {
    std::env::var("MEGATRON_EMULATED_GPU").is_ok_and(|v| v == "1")
}

/// Loads the emulated GPU if [`requested`]; `core` is the megatron-core package's folder.
/// Call before anything reaches the CUDA libraries; later calls do nothing.
pub fn install_if_requested(core: &Path) {
    static DONE: OnceLock<()> = OnceLock::new();
    if requested() {
        DONE.get_or_init(|| install(core));
    }
}

/// Every file the emulation is built from.
fn sources(core: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(core.join("src/cuda/cu"))
        .expect("megatron-core/src/cuda/cu")
        .map(|e| e.expect("a kernel source").path())
        .collect();
    files.sort();
    for f in [
        "shim.h",
        "emu_kernel.h",
        "launch.cpp",
        "device.cpp",
        "nccl.cpp",
    ] {
        files.push(core.join("tests/emulated").join(f));
    }
    files
}

/// The system's C++ compiler: `$CXX`, or `c++`.
fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".to_string())
}

/// Compiles `source` into the shared library `out` the way the emulation needs (C++20; the
/// kernels' explicit roundings kept, as NVRTC keeps them; the kernels' folder on the include
/// path), with `extra` flags.
pub fn compile(core: &Path, source: &Path, out: &Path, extra: &[&str]) {
    let cxx = compiler();
    run(
        Command::new(&cxx)
            .args([
                "-std=c++20",
                "-O2",
                "-ffp-contract=off",
                "-fno-strict-aliasing",
            ])
            .args(["-fPIC", "-shared", "-pthread"])
            .args(extra)
            .arg("-I")
            .arg(core.join("src/cuda/cu"))
            .arg("-o")
            .arg(out)
            .arg(source),
        &format!("{cxx} ({})", source.display()),
    );
}

fn run(cmd: &mut Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what} could not be started ({e}): install g++"));
    assert!(
        out.status.success(),
        "{what} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The libraries the emulation is loaded as: the driver (with cuBLAS's and NCCL's functions in
/// it, as they share its streams), then libraries that only depend on it, which is enough for
/// those functions to be found through them.
const LIBRARIES: [&str; 4] = ["libcuda.so", "libcublas.so", "libcublasLt.so", "libnccl.so"];

/// Builds the emulated GPU's libraries (once per source text) and returns their folder: put it
/// first on `LD_LIBRARY_PATH` for a process of its own (with NVRTC's folder after it).
pub fn build(core: &Path) -> PathBuf {
    let mut hash = DefaultHasher::new();
    for f in sources(core) {
        std::fs::read(&f)
            .unwrap_or_else(|e| panic!("{}: {e}", f.display()))
            .hash(&mut hash);
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("emulated-gpu-{:016x}", hash.finish()));
    let built = || LIBRARIES.iter().all(|l| dir.join(l).exists());
    if built() {
        return dir;
    }
    // Built aside and renamed into place, so that a concurrent or interrupted build never
    // leaves a partial library where the next process or thread looks.
    // Per process and per call: test threads of one process may build at once.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.with_extension(format!("tmp{}-{call}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("a folder for the emulated GPU");
    // How device.cpp builds the programs generated at run time (`ops::fused`) as this
    // build's kernels are built.
    let cxx = compiler();
    let flags = format!(
        "-std=c++20 -O2 -ffp-contract=off -fno-strict-aliasing -fPIC -shared -pthread -I '{}' -I '{}'",
        core.join("src/cuda/cu").display(),
        core.join("tests/emulated").display()
    );
    let defines = [
        format!("-DEMU_CXX=\"{cxx}\""),
        format!("-DEMU_BUILD_FLAGS=\"{}\"", flags.replace('"', "\\\"")),
    ];
    let mut extra = vec!["-fvisibility=hidden", "-Wl,-soname,libcuda.so"];
    extra.extend(defines.iter().map(String::as_str));
    compile(
        core,
        &core.join("tests/emulated/device.cpp"),
        &tmp.join(LIBRARIES[0]),
        &extra,
    );
    let empty = tmp.join("empty.cpp");
    std::fs::write(&empty, "").expect("an empty source");
    for name in &LIBRARIES[1..] {
        run(
            Command::new(&cxx)
                .args(["-fPIC", "-shared", "-Wl,--no-as-needed"])
                .arg(format!("-Wl,-soname,{name}"))
                .arg("-o")
                .arg(tmp.join(name))
                .arg(&empty)
                .arg("-L")
                .arg(&tmp)
                .arg("-l:libcuda.so"),
            &format!("{cxx} (the emulated {name})"),
        );
    }
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => {}
        // Another process put the same build there first.
        Err(_) if built() => {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        Err(e) => panic!("{}: {e}", dir.display()),
    }
    dir
}

fn install(core: &Path) {
    let dir = build(core);
    for lib in LIBRARIES {
        let lib = dir.join(lib);
        let path = CString::new(lib.to_string_lossy().as_bytes()).expect("a path");
        // SAFETY: libraries this module built; they stay loaded for the process.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        assert!(!handle.is_null(), "dlopen {}", lib.display());
    }
}

/// What the calling thread (a rank's) asked of the emulated GPU so far (`megatron_emu_launches`
/// in device.cpp).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Launches {
    /// Operations the host queued itself: kernel launches, copies, products, collectives and
    /// graph launches (not the work a graph replays).
    pub host_ops: u64,
    /// Kernels run, replayed by a graph or not.
    pub kernels: u64,
    /// Graph launches.
    pub graphs: u64,
    /// Bytes its copies moved from the host to the device.
    pub to_device_bytes: u64,
    /// Bytes its copies moved from the device to the host.
    pub to_host_bytes: u64,
    /// Tiles the flash-attention kernels walked (a block's loop steps over keys or queries).
    pub tiles: u64,
}

impl std::ops::Sub for Launches {
    type Output = Launches;
    fn sub(self, before: Launches) -> Launches {
        Launches {
            host_ops: self.host_ops - before.host_ops,
            kernels: self.kernels - before.kernels,
            graphs: self.graphs - before.graphs,
            to_device_bytes: self.to_device_bytes - before.to_device_bytes,
            to_host_bytes: self.to_host_bytes - before.to_host_bytes,
            tiles: self.tiles - before.tiles,
        }
    }
}

/// The emulated GPU's counters of the calling thread, if it is loaded.
pub fn launches() -> Option<Launches> {
    let name = CString::new("megatron_emu_launches").expect("no NUL");
    // SAFETY: a lookup in the process's loaded libraries.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if f.is_null() {
        return None;
    }
    // SAFETY: device.cpp defines it as `void (unsigned long long*)`, writing six values.
    let f: extern "C" fn(*mut u64) = unsafe { std::mem::transmute(f) };
    let mut out = [0u64; 6];
    f(out.as_mut_ptr());
    Some(Launches {
        host_ops: out[0],
        kernels: out[1],
        graphs: out[2],
        to_device_bytes: out[3],
        to_host_bytes: out[4],
        tiles: out[5],
    })
}
