//! CPU kernels on plain slices: every forward a GPT training step needs, each with its backward.
//!
//! Kernels take explicit output buffers and never allocate, so that later graph scopes can run
//! them on static buffers. Compute is f32; other dtypes are converted at the tensor layer.
