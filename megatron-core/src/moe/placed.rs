//! [`PlacedRouting`]: a micro-batch's routing where its tokens live, as the dispatcher, the
//! combine and their backwards read it. On a GPU its tables stay on the device and the host
//! holds only what the all-to-all's splits and the step's metrics need (Megatron-LM's
//! `tokens_per_expert` read back before the all-to-all).

use crate::error::Result;
use crate::tensor::Tensor;

use super::Routing;
use super::dispatcher::placed;

/// A micro-batch's routing placed where its tokens are: the weights and the map as tensors on
/// the tokens' device, the counts and the losses on the host.
#[derive(Debug, Clone)]
pub struct PlacedRouting {
    /// Tokens routed.
    pub tokens: usize,
    /// Experts.
    pub experts: usize,
    /// Tokens each expert receives (host values: the all-to-all's splits).
    pub tokens_per_expert: Vec<usize>,
    /// The load-balancing loss, coefficient included (0 without).
    pub aux_loss: f32,
    /// The z loss, coefficient included (0 without).
    pub z_loss: f32,
    /// Token-expert pairs the top-k chose that capacity dropped.
    pub dropped: usize,
    /// `[tokens, experts]` f32: each token's weight for each expert it goes to, 0 elsewhere.
    pub probs: Tensor,
    /// `[tokens, experts]` i64: 1 where the token goes to the expert (after capacity), else 0.
    pub map: Tensor,
    /// `[experts]` i64: [`PlacedRouting::tokens_per_expert`] where the tokens live (what the
    /// counts' all-to-all sends).
    pub counts: Tensor,
}

impl Routing {
    /// This host routing placed on `like`'s device (uploaded when that is a GPU).
    pub fn placed(&self, like: &Tensor) -> Result<PlacedRouting> {
        let (t, e) = (self.tokens, self.experts);
        let map: Vec<i64> = self.map.iter().map(|&m| i64::from(m)).collect();
        let counts: Vec<i64> = self.tokens_per_expert.iter().map(|&c| c as i64).collect();
        Ok(PlacedRouting {
            tokens: t,
            experts: e,
            tokens_per_expert: self.tokens_per_expert.clone(),
            aux_loss: self.aux_loss,
            z_loss: self.z_loss,
            dropped: self.dropped,
            probs: placed(Tensor::from_slice(&self.probs, [t, e])?, like)?,
            map: placed(Tensor::from_vec(map, [t, e])?, like)?,
            counts: placed(Tensor::from_vec(counts, [e])?, like)?,
        })
    }
}
