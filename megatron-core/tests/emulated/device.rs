//! The emulated GPU (`device.cpp`: the CUDA driver and cuBLAS calls megatron-rs makes,
//! implemented on the CPU, running the kernels' own CUDA C) for the GPU tests on a machine
//! without one. With `MEGATRON_EMULATED_GPU=1`, [`install_if_requested`] builds it with the
//! system's C++ compiler (once per source text, under the test target's temporary folder) and
//! loads it before cudarc looks for `libcuda.so` and `libcublas.so`, which then finds it: the
//! libraries are loaded under those names (their sonames), and a name already loaded is not
//! searched for again. NVRTC stays the real one (it needs no GPU): its PTX tells the emulation
//! which kernels a program has and their thread limits.
//!
//! ```sh
//! MEGATRON_EMULATED_GPU=1 cargo test -p megatron-core --features cuda --test cuda_backend -- --include-ignored
//! ```

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
    for f in ["shim.h", "launch.cpp", "device.cpp"] {
        files.push(core.join("tests/emulated").join(f));
    }
    files
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

fn install(core: &Path) {
    let mut hash = DefaultHasher::new();
    for f in sources(core) {
        std::fs::read(&f)
            .unwrap_or_else(|e| panic!("{}: {e}", f.display()))
            .hash(&mut hash);
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("emulated-gpu-{:016x}", hash.finish()));
    let (cuda, cublas) = (dir.join("libcuda.so"), dir.join("libcublas.so"));
    if !cublas.exists() {
        // Built aside and renamed into place, so that a concurrent or interrupted build never
        // leaves a partial library where the next process looks.
        let tmp = dir.with_extension(format!("tmp{}", std::process::id()));
        std::fs::create_dir_all(&tmp).expect("a folder for the emulated GPU");
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
        run(
            Command::new(&cxx)
                .args([
                    "-std=c++20",
                    "-O2",
                    "-ffp-contract=off",
                    "-fno-strict-aliasing",
                ])
                .args(["-fPIC", "-fvisibility=hidden", "-shared", "-pthread"])
                .arg("-Wl,-soname,libcuda.so")
                .arg("-I")
                .arg(core.join("src/cuda/cu"))
                .arg("-o")
                .arg(tmp.join("libcuda.so"))
                .arg(core.join("tests/emulated/device.cpp")),
            &format!("{cxx} (the emulated GPU)"),
        );
        // cuBLAS's functions are in libcuda.so (they share its streams); libcublas.so only
        // depends on it, which is enough for symbols to be found through it.
        let empty = tmp.join("empty.cpp");
        std::fs::write(&empty, "").expect("an empty source");
        run(
            Command::new(&cxx)
                .args([
                    "-fPIC",
                    "-shared",
                    "-Wl,-soname,libcublas.so",
                    "-Wl,--no-as-needed",
                ])
                .arg("-o")
                .arg(tmp.join("libcublas.so"))
                .arg(&empty)
                .arg("-L")
                .arg(&tmp)
                .arg("-l:libcuda.so"),
            &format!("{cxx} (the emulated cuBLAS)"),
        );
        match std::fs::rename(&tmp, &dir) {
            Ok(()) => {}
            // Another process put the same build there first.
            Err(_) if cublas.exists() => {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            Err(e) => panic!("{}: {e}", dir.display()),
        }
    }
    for lib in [&cuda, &cublas] {
        let path = CString::new(lib.to_string_lossy().as_bytes()).expect("a path");
        // SAFETY: libraries this module built; they stay loaded for the process.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        assert!(!handle.is_null(), "dlopen {}", lib.display());
    }
}
