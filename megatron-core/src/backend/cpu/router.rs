//! [`RouterOps`] on the host: the router runs on the logits' values after the gate.

use super::Cpu;
use crate::backend::RouterOps;
use crate::cuda::DeviceRouting;
use crate::error::Result;
use crate::moe::RouterConfig;
use crate::tensor::Tensor;

impl RouterOps for Cpu {
    fn route_on_device(
        &self,
        _x: &Tensor,
        _gate: &Tensor,
        _routing: (
            usize,
            &RouterConfig,
            Option<&Tensor>,
            Option<&dyn crate::comm::Communicator>,
        ),
        _permute: bool,
    ) -> Result<Option<(Tensor, DeviceRouting)>> {
        Ok(None)
    }
}
