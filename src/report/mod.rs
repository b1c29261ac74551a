//! What a training run reports besides its progress bar: the JSON-lines log, TensorBoard scalars
//! and the loss-curve plot.

pub mod plot;
pub mod tensorboard;
