//! `Error`: everything that can go wrong in a model's build, forward, backward or step.

use thiserror::Error;

use crate::checkpoint::CheckpointError;
use crate::comm::CommError;
use crate::kernels::KernelError;
use crate::parallel::ConfigError;
use crate::tensor::TensorError;

/// An error of megatron-core; generated module code returns it.
#[derive(Debug, Clone, Error)]
pub enum Error {
    /// A tensor could not be used as asked (shape, dtype, layout, borrow).
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// A kernel rejected its arguments.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A collective failed (mismatch, timeout, failed peer).
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A checkpoint could not be written or read.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A parallel configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A pipeline schedule Megatron-LM refuses.
    #[error(transparent)]
    Schedule(#[from] crate::pipeline_parallel::ScheduleError),
    /// A rank's schedule order cannot be walked.
    #[error(transparent)]
    Walk(#[from] crate::pipeline_parallel::WalkError),
    /// A pipeline's transfers cannot be planned.
    #[error(transparent)]
    Plan(#[from] crate::pipeline_parallel::PlanError),
    /// The distributed optimizer's buffers cannot be laid out.
    #[error(transparent)]
    BufferLayout(#[from] crate::optimizer::LayoutError),
    /// A MoE router's settings or inputs cannot work.
    #[error(transparent)]
    Router(#[from] crate::moe::RouterError),
    /// The GPU failed (driver, NVRTC, cuBLAS, NCCL).
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
    /// A dataset file or query failed (shared: the system's error in it is not `Clone`).
    #[error(transparent)]
    Data(std::sync::Arc<crate::data::DataError>),
    /// A training step's loss or gradient norm is NaN or infinite (Megatron-LM's
    /// `--check-for-nan-in-loss-and-grad`); the step stopped before updating anything.
    #[error(
        "step {step}: the loss is {loss} and the gradient norm {grad_norm}; one is not finite, so \
         training stops before this step's update (lower --lr, check --init-method-std and the \
         data; --no-check-for-nan-in-loss-and-grad trains on)"
    )]
    NotFinite {
        /// The 0-based step.
        step: u64,
        /// Its mean loss per token.
        loss: f64,
        /// Its global gradient norm.
        grad_norm: f64,
    },
    /// A model or layer was configured or called in a way that cannot work; names the numbers.
    #[error("{0}")]
    Invalid(String),
}

/// Shorthand for results of megatron-core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Returns [`Error::Invalid`] with a formatted message.
#[macro_export]
macro_rules! invalid {
    ($($arg:tt)*) => {
        ::std::result::Result::Err($crate::Error::Invalid(::std::format!($($arg)*)))
    };
}
