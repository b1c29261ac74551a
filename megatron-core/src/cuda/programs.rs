//! The CUDA C sources of the kernels, compiled at run time by NVRTC for the GPU at hand, once per
//! process and architecture, and loaded once per device. The PTX is also kept on disk (see
//! [`cache_dir`]), so that later processes skip NVRTC: the flash attention program alone takes
//! NVRTC over 10 seconds.
//!
//! Every program is `cu/common.cuh` followed by its own file; each kernel is `extern "C"` so that
//! it is found by its name.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use parking_lot::Mutex;

use super::error::{CudaError, Result};
use super::library;

/// Helpers every program shares: Philox, warp and block reductions, vector types.
const COMMON: &str = include_str!("cu/common.cuh");

/// The programs: (name, source). A kernel's name is unique over all of them.
pub const PROGRAMS: [(&str, &str); 13] = [
    ("elementwise", include_str!("cu/elementwise.cu")),
    ("dropout", include_str!("cu/dropout.cu")),
    ("layer_norm", include_str!("cu/layer_norm.cu")),
    ("softmax", include_str!("cu/softmax.cu")),
    ("flash_attention", include_str!("cu/flash_attention.cu")),
    ("embedding", include_str!("cu/embedding.cu")),
    ("cross_entropy", include_str!("cu/cross_entropy.cu")),
    ("adam", include_str!("cu/adam.cu")),
    ("reduce", include_str!("cu/reduce.cu")),
    ("vocab_parallel", include_str!("cu/vocab_parallel.cu")),
    ("moe", include_str!("cu/moe.cu")),
    ("rotary", include_str!("cu/rotary.cu")),
    ("heads", include_str!("cu/heads.cu")),
];

/// The NVRTC architecture name of compute capability `major.minor`, e.g. `sm_90`.
pub fn arch_name(major: i32, minor: i32) -> &'static str {
    static NAMES: OnceLock<Mutex<HashMap<(i32, i32), &'static str>>> = OnceLock::new();
    let mut names = NAMES.get_or_init(Default::default).lock();
    names
        .entry((major, minor))
        // One short string per architecture seen, for the life of the process.
        .or_insert_with(|| Box::leak(format!("sm_{major}{minor}").into_boxed_str()))
}

/// NVRTC's options for `arch`.
fn options(name: &str, arch: &'static str) -> CompileOptions {
    CompileOptions {
        arch: Some(arch),
        name: Some(format!("{name}.cu")),
        options: vec!["--std=c++17".to_string()],
        ..Default::default()
    }
}

/// The text NVRTC compiles: the shared helpers, then the program. `#line` keeps NVRTC's
/// messages pointing at the lines of the file they are about.
fn full_text(name: &str, source: &str) -> String {
    format!("#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{name}.cu\"\n{source}")
}

/// Compiles one program for `arch` (e.g. `sm_90`) to PTX.
pub fn compile(name: &'static str, source: &str, arch: &'static str) -> Result<Ptx> {
    library::require_nvrtc()?;
    compile_ptx_with_opts(full_text(name, source), options(name, arch)).map_err(|e| {
        let log = match &e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        };
        CudaError::Compile {
            program: name,
            arch: arch.to_string(),
            log,
        }
    })
}

/// Where compiled PTX is kept between processes: `$MEGATRON_KERNEL_CACHE` when set (empty or
/// `off`: nowhere), else `$XDG_CACHE_HOME/megatron-rs/kernels`, else
/// `$HOME/.cache/megatron-rs/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("MEGATRON_KERNEL_CACHE") {
        return (!dir.is_empty() && dir != "off").then(|| PathBuf::from(dir));
    }
    let base = match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(std::env::var_os("HOME")?).join(".cache"),
    };
    Some(base.join("megatron-rs").join("kernels"))
}

/// NVRTC's version, part of what decides the PTX.
fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-pointers to live integers; the library is loaded (require_nvrtc).
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

/// The cache file of one compilation: named for the program and architecture, with a SHA-256
/// of everything that decides the PTX (NVRTC's version, the options, the full source text).
fn cache_file(dir: &Path, name: &'static str, source: &str, arch: &'static str) -> PathBuf {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    hash.update(format!("{:?}", nvrtc_version()));
    hash.update(format!("{:?}", options(name, arch).options));
    hash.update(arch);
    hash.update(full_text(name, source));
    let digest: String = hash.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    dir.join(format!("{name}-{arch}-{digest}.ptx"))
}

/// The last line of a cache file: a PTX comment with the SHA-256 of everything before it.
const SEAL: &str = "// megatron-rs sha256 ";

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The PTX of a cache file's contents: `Some` only when its seal matches (a file cut short,
/// damaged or from elsewhere is refused).
pub fn unsealed(file: &str) -> Option<&str> {
    let body = file.strip_suffix('\n')?;
    let at = body.rfind('\n')? + 1;
    let (ptx, seal) = body.split_at(at);
    (seal.strip_prefix(SEAL)? == sha256_hex(ptx.as_bytes())).then_some(ptx)
}

/// `ptx` followed by its seal (see [`unsealed`]).
pub fn sealed(ptx: &str) -> String {
    let ptx = if ptx.ends_with('\n') {
        ptx.to_string()
    } else {
        format!("{ptx}\n")
    };
    let seal = sha256_hex(ptx.as_bytes());
    format!("{ptx}{SEAL}{seal}\n")
}

/// [`compile`], through the cache in `dir` (none: always NVRTC): a cached PTX file for the same
/// NVRTC, options and source, with an intact seal, is read instead of compiling; a fresh
/// compilation is written there sealed, whole or not at all (a temporary file renamed into
/// place). The cache is only a shortcut:
/// failing to read or write it falls back to NVRTC.
pub fn compile_cached(
    name: &'static str,
    source: &str,
    arch: &'static str,
    dir: Option<&Path>,
) -> Result<Ptx> {
    library::require_nvrtc()?;
    let Some(dir) = dir else {
        return compile(name, source, arch);
    };
    let path = cache_file(dir, name, source, arch);
    if let Ok(file) = std::fs::read_to_string(&path)
        && let Some(ptx) = unsealed(&file)
    {
        return Ok(Ptx::from_src(ptx));
    }
    let ptx = compile(name, source, arch)?;
    let text = ptx.to_src();
    let temp = path.with_extension(format!("ptx.{}.tmp", std::process::id()));
    let stored = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&temp, sealed(&text).as_bytes()))
        .and_then(|()| std::fs::rename(&temp, &path));
    if stored.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    Ok(Ptx::from_src(text))
}

/// The PTX of every program, by program name.
pub type CompiledPrograms = Arc<Vec<(&'static str, Ptx)>>;

/// Every program compiled for `arch` (in parallel, or read from [`cache_dir`]), kept for the
/// life of the process.
pub fn compile_all(arch: &'static str) -> Result<CompiledPrograms> {
    static CACHE: OnceLock<Mutex<HashMap<&'static str, CompiledPrograms>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(done) = cache.lock().get(arch) {
        return Ok(done.clone());
    }
    // One thread per program: NVRTC compiles independent programs in parallel.
    let dir = cache_dir();
    let ptx = std::thread::scope(|scope| {
        let jobs: Vec<_> = PROGRAMS
            .iter()
            .map(|&(name, source)| {
                let dir = dir.as_deref();
                scope.spawn(move || compile_cached(name, source, arch, dir))
            })
            .collect();
        PROGRAMS
            .iter()
            .zip(jobs)
            .map(|(&(name, _), job)| {
                let ptx = job.join().map_err(|_| CudaError::Compile {
                    program: name,
                    arch: arch.to_string(),
                    log: "the compiling thread panicked".to_string(),
                })??;
                Ok((name, ptx))
            })
            .collect::<Result<Vec<_>>>()
    })?;
    Ok(cache.lock().entry(arch).or_insert(Arc::new(ptx)).clone())
}

/// The element-wise functions of the generated kernels (`ops::fused`), before each one's source.
pub const POINTWISE: &str = include_str!("cu/pointwise.cuh");

/// The line after a generated program's PTX that starts its CUDA C, carried in PTX comments
/// (`//| ` before each line), which the driver ignores: the emulated GPU of the tests compiles
/// the kernels it has not seen from it.
pub const SOURCE_MARK: &str = "// megatron-rs generated source";

/// The PTX text a generated kernel is loaded from: the compiled `ptx`, then `source` in
/// comments after [`SOURCE_MARK`], in ASCII: the driver's PTX parser refuses any other byte,
/// comments included (an H200 refused the UTF-8 of `pointwise.cuh`'s comments with
/// `CUDA_ERROR_INVALID_PTX`), so a character outside ASCII is written `\u{hex}`. Only
/// comments hold such characters; anywhere else the escape would not compile, so the
/// emulated GPU, which compiles the carried source, would say so.
pub fn with_source(ptx: &str, source: &str) -> String {
    use std::fmt::Write as _;
    let mut text = String::with_capacity(ptx.len() + source.len() * 2);
    text.push_str(ptx);
    if !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(SOURCE_MARK);
    text.push('\n');
    for line in source.lines() {
        text.push_str("//| ");
        for c in line.chars() {
            if c.is_ascii() {
                text.push(c);
            } else {
                // Writing to a String cannot fail.
                let _ = write!(text, "\\u{{{:x}}}", u32::from(c));
            }
        }
        text.push('\n');
    }
    text
}

/// The kernel `name` of a program generated by `#[megatron::module]` (`cuda`: its CUDA C,
/// after [`POINTWISE`]), for `ctx`'s device: compiled by NVRTC on first use in the process (or
/// read from [`cache_dir`]) and loaded once per device.
pub fn generated_function(
    ctx: &Arc<CudaContext>,
    name: &'static str,
    cuda: &'static str,
) -> Result<CudaFunction> {
    type Loaded = HashMap<(usize, &'static str), CudaFunction>;
    static LOADED: OnceLock<Mutex<Loaded>> = OnceLock::new();
    let key = (ctx.ordinal(), name);
    if let Some(f) = LOADED.get_or_init(Default::default).lock().get(&key) {
        return Ok(f.clone());
    }
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|e| CudaError::driver("cuDeviceGetAttribute(compute capability)", e))?;
    let source = format!("{POINTWISE}\n#line 1 \"{name}.cu\"\n{cuda}");
    let ptx = compile_cached(
        name,
        &source,
        arch_name(major, minor),
        cache_dir().as_deref(),
    )?;
    let module = ctx
        .load_module(Ptx::from_src(with_source(&ptx.to_src(), &source)))
        .map_err(|e| CudaError::driver(format!("cuModuleLoadData({name})"), e))?;
    let f = module
        .load_function(name)
        .map_err(|e| CudaError::driver(format!("cuModuleGetFunction({name})"), e))?;
    LOADED
        .get_or_init(Default::default)
        .lock()
        .insert(key, f.clone());
    Ok(f)
}

/// The kernels of every program, loaded into one device's context.
#[derive(Debug)]
pub struct Kernels {
    functions: HashMap<String, CudaFunction>,
}

impl Kernels {
    /// The kernels for `ctx`'s device: compiled on first use in the process, loaded once per
    /// device.
    pub fn for_context(ctx: &Arc<CudaContext>) -> Result<Arc<Kernels>> {
        static LOADED: OnceLock<Mutex<HashMap<usize, Arc<Kernels>>>> = OnceLock::new();
        let loaded = LOADED.get_or_init(Default::default);
        let mut loaded = loaded.lock();
        if let Some(k) = loaded.get(&ctx.ordinal()) {
            return Ok(k.clone());
        }
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| CudaError::driver("cuDeviceGetAttribute(compute capability)", e))?;
        let programs = compile_all(arch_name(major, minor))?;
        let mut functions = HashMap::new();
        for (name, ptx) in programs.iter() {
            let module = ctx
                .load_module(ptx.clone())
                .map_err(|e| CudaError::driver(format!("cuModuleLoadData({name})"), e))?;
            for kernel in kernel_names(PROGRAMS.iter().find(|p| p.0 == *name).map_or("", |p| p.1)) {
                let f = module
                    .load_function(kernel)
                    .map_err(|e| CudaError::driver(format!("cuModuleGetFunction({kernel})"), e))?;
                functions.insert(kernel.to_string(), f);
            }
        }
        let kernels = Arc::new(Kernels { functions });
        loaded.insert(ctx.ordinal(), kernels.clone());
        Ok(kernels)
    }

    /// The kernel called `name`.
    pub fn get(&self, name: &str) -> Result<&CudaFunction> {
        self.functions.get(name).ok_or_else(|| CudaError::Driver {
            call: format!("looking up kernel {name}"),
            message: "no such kernel in the compiled programs".to_string(),
        })
    }
}

/// The names of the `extern "C" __global__` functions of a source.
pub fn kernel_names(source: &str) -> Vec<&str> {
    let mut names = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find("__global__") {
        rest = &rest[at + "__global__".len()..];
        // `__global__ void NAME(` (possibly with __launch_bounds__(...) in between).
        let Some(paren) = rest.find('(') else { break };
        let head = &rest[..paren];
        if let Some(name) = head.split_whitespace().last()
            && name != "__launch_bounds__"
        {
            names.push(name);
        } else if let Some(close) = rest.find(')') {
            // Skip `__launch_bounds__(...)` and read the name before the next parenthesis.
            let after = &rest[close + 1..];
            if let Some(p) = after.find('(')
                && let Some(name) = after[..p].split_whitespace().last()
            {
                names.push(name);
            }
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_are_read_from_the_sources() {
        let src = "extern \"C\" __global__ void a(float* x) {}\n\
                   extern \"C\" __global__ __launch_bounds__(256) void b(int n) {}";
        assert_eq!(kernel_names(src), vec!["a", "b"]);
        for (name, source) in PROGRAMS {
            assert!(!kernel_names(source).is_empty(), "{name} has no kernel");
        }
    }

    #[test]
    fn the_carried_source_is_ascii() {
        // The element-wise helpers' comments hold `−`, `·`, `√` and `π`.
        assert!(!POINTWISE.is_ascii());
        let source = format!("{POINTWISE}\nx = 1; // a·b\n");
        let text = with_source(".version 9.0\n", &source);
        assert!(text.is_ascii());
        let carried: Vec<&str> = text.lines().skip_while(|l| *l != SOURCE_MARK).collect();
        assert_eq!(carried.last(), Some(&"//| x = 1; // a\\u{b7}b"));
        assert_eq!(carried.len(), source.lines().count() + 1);
    }
}
