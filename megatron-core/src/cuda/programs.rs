//! The CUDA C sources of the kernels, compiled at run time by NVRTC for the GPU at hand, once per
//! process and architecture, and loaded once per device.
//!
//! Every program is `cu/common.cuh` followed by its own file; each kernel is `extern "C"` so that
//! it is found by its name.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx, compile_ptx_with_opts};
use parking_lot::Mutex;

use super::error::{CudaError, Result};
use super::library;

/// Helpers every program shares: Philox, warp and block reductions, vector types.
const COMMON: &str = include_str!("cu/common.cuh");

/// The programs: (name, source). A kernel's name is unique over all of them.
pub const PROGRAMS: [(&str, &str); 10] = [
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

/// Compiles one program for `arch` (e.g. `sm_90`) to PTX.
pub fn compile(name: &'static str, source: &str, arch: &'static str) -> Result<Ptx> {
    library::require_nvrtc()?;
    let options = CompileOptions {
        arch: Some(arch),
        name: Some(format!("{name}.cu")),
        options: vec!["--std=c++17".to_string()],
        ..Default::default()
    };
    // `#line` keeps NVRTC's messages pointing at the lines of the file they are about.
    let text = format!("#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{name}.cu\"\n{source}");
    compile_ptx_with_opts(text, options).map_err(|e| {
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

/// The PTX of every program, by program name.
pub type CompiledPrograms = Arc<Vec<(&'static str, Ptx)>>;

/// Every program compiled for `arch` (in parallel), cached for the life of the process.
pub fn compile_all(arch: &'static str) -> Result<CompiledPrograms> {
    static CACHE: OnceLock<Mutex<HashMap<&'static str, CompiledPrograms>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(done) = cache.lock().get(arch) {
        return Ok(done.clone());
    }
    // One thread per program: NVRTC compiles independent programs in parallel.
    let ptx = std::thread::scope(|scope| {
        let jobs: Vec<_> = PROGRAMS
            .iter()
            .map(|&(name, source)| scope.spawn(move || compile(name, source, arch)))
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
}
