//! The split backward: a linear layer's backward computes its input gradient (`B`, which the
//! previous layer, and the previous pipeline stage, wait for) and hands back its weight
//! gradients as a [`WeightGrad`] (`W`, which nobody waits for). The generated code gives each
//! to [`Cx::weight_gradient`](super::Cx::weight_gradient), which runs it at once, or, in the
//! backward of a zero-bubble schedule, puts it in the step's [`DeferredWeights`] until the
//! schedule's weight-gradient pass.
//!
//! A `W` holds what it reads (the layer's kept input and its output gradient) and a handle on
//! the parameter's gradient; it runs only local products, no collective. Its results are the
//! same whenever it runs: a parameter's gradient is summed over the microbatches in their
//! order either way, since a rank runs each chunk's `W`s in microbatch order.

use std::cell::RefCell;
use std::fmt;

use crate::error::Result;
use crate::tensor::Tensor;

/// The bytes of `tensors` (what a [`WeightGrad`] holding them keeps alive).
pub fn bytes_of(tensors: &[&Tensor]) -> u64 {
    tensors
        .iter()
        .map(|t| (t.numel() * t.dtype().size()) as u64)
        .sum()
}

/// One layer's weight gradients for one microbatch, computed when run.
pub struct WeightGrad {
    /// Bytes of the tensors it keeps alive until it runs.
    held: u64,
    run: Box<dyn FnOnce() -> Result<()>>,
}

impl WeightGrad {
    /// Weight gradients that `run` accumulates, keeping `held` bytes alive until it runs (its
    /// tensors' [`bytes_of`]: memory held between the backward and the weight-gradient pass).
    pub fn new(held: u64, run: impl FnOnce() -> Result<()> + 'static) -> WeightGrad {
        WeightGrad {
            held,
            run: Box::new(run),
        }
    }

    /// No weight gradients (a frozen layer's): nothing held, nothing run.
    pub fn none() -> WeightGrad {
        WeightGrad::new(0, || Ok(()))
    }

    /// These gradients, then `other`'s, as one pass.
    pub fn and(self, other: WeightGrad) -> WeightGrad {
        let held = self.held + other.held;
        WeightGrad::new(held, move || {
            self.run()?;
            other.run()
        })
    }

    /// Bytes of the tensors it keeps until it runs.
    pub fn held_bytes(&self) -> u64 {
        self.held
    }

    /// Accumulates the gradients.
    pub fn run(self) -> Result<()> {
        (self.run)()
    }
}

impl fmt::Debug for WeightGrad {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeightGrad")
            .field("held", &self.held)
            .finish()
    }
}

/// The weight gradients a split backward put off, in the order its layers left them.
#[derive(Debug, Default)]
pub struct DeferredWeights {
    pending: RefCell<Vec<WeightGrad>>,
}

impl DeferredWeights {
    /// Keeps `w` for the weight-gradient pass.
    pub fn defer(&self, w: WeightGrad) {
        self.pending.borrow_mut().push(w);
    }

    /// The weight gradients put off so far, oldest first, leaving none.
    pub fn take(&self) -> Vec<WeightGrad> {
        std::mem::take(&mut *self.pending.borrow_mut())
    }
}
