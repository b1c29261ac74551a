//! Every CUDA kernel program compiles with NVRTC for the GPUs megatron-rs targets. Needs only
//! libnvrtc (no GPU): CI installs NVIDIA's `nvidia-cuda-nvrtc` wheel and points
//! LD_LIBRARY_PATH at it.
#![cfg(feature = "cuda")]

use megatron_core::cuda::programs::{PROGRAMS, compile, kernel_names};

#[test]
fn every_program_compiles_for_hopper_and_ampere() {
    megatron_core::cuda::require_nvrtc().expect(
        "libnvrtc is needed to compile the kernels: install CUDA or `pip install nvidia-cuda-nvrtc` \
         and add its lib directory to LD_LIBRARY_PATH",
    );
    for arch in ["sm_90", "sm_80"] {
        for (name, source) in PROGRAMS {
            let ptx = compile(name, source, arch).unwrap_or_else(|e| panic!("{e}"));
            let text = ptx.to_src();
            for kernel in kernel_names(source) {
                assert!(
                    text.contains(&format!(".entry {kernel}(")),
                    "{name}.cu for {arch}: no entry {kernel} in the PTX"
                );
            }
        }
    }
}

#[test]
fn a_broken_source_is_an_error_with_nvrtcs_log() {
    megatron_core::cuda::require_nvrtc().expect("libnvrtc");
    let err = compile(
        "broken",
        "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        "sm_90",
    )
    .expect_err("does not compile");
    let msg = err.to_string();
    assert!(
        msg.contains("broken.cu") && msg.contains("undefined_name"),
        "{msg}"
    );
}

#[test]
fn compiled_ptx_is_kept_on_disk_and_read_back() {
    use megatron_core::cuda::programs::{compile_cached, sealed, unsealed};
    megatron_core::cuda::require_nvrtc().expect("libnvrtc");
    let dir = std::env::temp_dir().join(format!("megatron-kernel-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (name, source) = PROGRAMS
        .iter()
        .copied()
        .find(|p| p.0 == "reduce")
        .expect("the reduce program");
    let compile =
        |arch| compile_cached(name, source, arch, Some(&dir)).unwrap_or_else(|e| panic!("{e}"));
    let first = compile("sm_90").to_src();
    let files: Vec<_> = std::fs::read_dir(&dir)
        .expect("the cache directory is created")
        .map(|e| e.expect("entry").path())
        .collect();
    assert_eq!(
        files.len(),
        1,
        "one whole file, no temporary left: {files:?}"
    );
    let file = &files[0];
    let stored = std::fs::read_to_string(file).expect("read");
    assert_eq!(unsealed(&stored), Some(first.as_str()));
    // A later compilation reads the file: seal a marked copy and see the mark come back.
    let marked = format!("// kept\n{first}");
    std::fs::write(file, sealed(&marked)).expect("write");
    assert_eq!(compile("sm_90").to_src(), marked);
    // Another architecture is another file.
    compile("sm_80");
    assert_eq!(std::fs::read_dir(&dir).expect("dir").count(), 2);
    // A file cut short, or changed under its seal, is compiled again and replaced.
    let resealed = sealed(&marked);
    for damaged in [
        resealed[..resealed.len() / 2].to_string(),
        resealed.replacen("kept", "kapt", 1),
    ] {
        assert_eq!(unsealed(&damaged), None);
        std::fs::write(file, &damaged).expect("write");
        assert_eq!(compile("sm_90").to_src(), first);
        assert_eq!(
            unsealed(&std::fs::read_to_string(file).expect("read")),
            Some(first.as_str())
        );
    }
    std::fs::remove_dir_all(&dir).expect("clean up");
}
