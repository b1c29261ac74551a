//! The NCCL communicator in one process (a world of one, as a single-GPU machine allows): every
//! operation runs through NCCL on device tensors, bootstrapped over MPI, and gives the
//! single-rank results; host tensors are refused with a clear error.
//!
//! Needs a GPU and NCCL: `cargo test -p megatron-core --features cuda,mpi --test nccl_backend -- --ignored`,
//! or the emulated GPU and its NCCL (`MEGATRON_EMULATED_GPU=1`, `tests/emulated/device.rs`).
#![cfg(all(feature = "cuda", feature = "mpi"))]

#[path = "emulated/device.rs"]
mod device;

use megatron_core::comm::mpi::MpiWorld;
use megatron_core::comm::nccl::NcclWorld;
use megatron_core::comm::{ReduceOp, World};
use megatron_core::tensor::{DType, Tensor};

type R<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[test]
#[ignore = "needs a GPU and NCCL, or the emulated ones: MEGATRON_EMULATED_GPU=1"]
fn a_world_of_one_runs_every_operation_through_nccl() -> R {
    device::install_if_requested(std::path::Path::new(env!("CARGO_MANIFEST_DIR")));
    let world = NcclWorld::init(MpiWorld::init()?)?;
    assert_eq!(world.size(), 1);
    let g = world.gpu().clone();
    let c = world.communicator("world", &[0])?;
    let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::I64] {
        let host = Tensor::from_vec(data.clone(), [1000])?.to_dtype(dtype)?;
        let t = host.to_gpu(&g)?;
        c.all_reduce(&t, ReduceOp::Sum)?;
        assert_eq!(t.to_host()?.to_vec_f32()?, host.to_vec_f32()?);
        c.broadcast(&t, 0)?;
        let out = Tensor::zeros_on([1000], dtype, &g)?;
        c.all_gather(&t, &out)?;
        assert_eq!(out.to_host()?.to_vec_f32()?, host.to_vec_f32()?);
        c.reduce_scatter(&t, &out, ReduceOp::Max)?;
        assert_eq!(out.to_host()?.to_vec_f32()?, host.to_vec_f32()?);
        c.all_to_all(&t, &[1000], &out, &[1000])?;
        assert_eq!(out.to_host()?.to_vec_f32()?, host.to_vec_f32()?);
    }
    c.barrier()?;
    let err = c
        .all_reduce(&Tensor::zeros([4], DType::F32), ReduceOp::Sum)
        .expect_err("a host tensor");
    assert!(err.to_string().contains("is on cpu"), "{err}");
    Ok(())
}
