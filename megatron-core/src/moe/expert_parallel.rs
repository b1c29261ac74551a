//! The `#[expert_parallel]` contract: what a layer of experts with a router provides, which the
//! generated code calls in Megatron-LM's order (gate, route, dispatch, local experts, combine)
//! and backwards in reverse.

#[cfg(doc)]
use super::ExpertParallelSaved;
use super::{DispatcherKind, PlacedRouting, RouterOutput, TpRows};
use crate::error::Result;
use crate::module::{Builder, Cx, Module, Site, WeightGrad};
use crate::tensor::Tensor;

/// Experts split over the expert-parallel group (`#[expert_parallel]`): a router chooses each
/// token's experts, the dispatcher's all-to-all over `cx.ep()` brings every rank the rows of
/// its local experts, which run as grouped products, and the combine brings their outputs back
/// to the tokens, weighted by the routing probabilities (Megatron-LM's `MoELayer`).
///
/// Generated code calls the four steps, the two all-to-alls in plain sight, and their
/// backwards in reverse; what the steps keep makes up an [`ExpertParallelSaved`].
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be split by #[expert_parallel]",
    label = "not a layer of experts with a router",
    note = "#[expert_parallel] applies to layers such as `megatron::moe::RoutedExperts`"
)]
pub trait ExpertParallel: Module {
    /// What the router's gate keeps for its backward.
    type GateSaved;
    /// What the router keeps for its backward.
    type RouterSaved;
    /// What the local experts keep for their backward.
    type LocalSaved;
    /// Builds this rank's part: the whole router and the local experts (`E / ep` of them,
    /// each split further over expert tensor parallelism).
    fn build_experts(spec: &Self::Spec, b: &mut Builder) -> Result<Self>;
    /// How tokens reach the experts: the dispatcher the generated code calls.
    fn dispatcher(&self) -> DispatcherKind;
    /// The router's gate on this rank's tokens `x` (`[seq, batch, hidden]`): the logits
    /// `[tokens, experts]` and, on a device that can, the routing and the dispatcher's
    /// preprocessing (the tokens laid out expert-major), computed where `x` lives without
    /// reading anything back (graph scopes `moe_router` and `moe_preprocess` capture it).
    fn gate(&self, cx: &Cx, site: Site, x: &Tensor) -> Result<(RouterOutput, Self::GateSaved)>;
    /// Routes the tokens `x` by what the gate gave: which experts each goes to and with what
    /// weight, placed where the tokens live (on a GPU the read-back of the counts is the
    /// device-to-host sync, after the gate's graph).
    fn route(
        &self,
        cx: &Cx,
        site: Site,
        x: &Tensor,
        gated: &RouterOutput,
    ) -> Result<(PlacedRouting, Self::RouterSaved)>;
    /// Runs the local experts (this rank's slices of them) on the rows the dispatcher brought
    /// the expert-tensor-parallel group (`[rows, hidden]`, local-expert-major as `tp` says):
    /// their outputs, partial over the group's ranks.
    fn forward_local(
        &self,
        cx: &Cx,
        site: Site,
        rows: &Tensor,
        tp: &TpRows,
    ) -> Result<(Tensor, Self::LocalSaved)>;
    /// The split backward of the local experts: their rows' input gradient, and their grouped
    /// weight gradients to run now or later ([`Cx::weight_gradient`]).
    fn backward_local_input(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::LocalSaved,
        dy: &Tensor,
    ) -> Result<(Tensor, WeightGrad)>;
    /// Accumulates the local experts' gradients (through [`Cx::weight_gradient`]) and returns
    /// their rows' input gradient.
    fn backward_local(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::LocalSaved,
        dy: &Tensor,
    ) -> Result<Tensor> {
        let (dx, w) = self.backward_local_input(cx, site, saved, dy)?;
        cx.weight_gradient(w)?;
        Ok(dx)
    }
    /// Records `routing` in the step's log and gives what the router's backward reads besides
    /// what its forward kept, where `like` lives: the routing weights' gradient `dprobs`
    /// (`[tokens, experts]`, as the combine's backward computed it) and the auxiliary losses'
    /// scale ([`Cx::aux_loss_scale`], one value), as tensors, so that a graph of the router's
    /// backward reads the current ones. Runs eagerly, before that backward.
    fn router_grads(
        &self,
        cx: &Cx,
        site: Site,
        routing: &PlacedRouting,
        dprobs: &Tensor,
        like: &Tensor,
    ) -> Result<[Tensor; 2]>;
    /// The router's backward from the weights' gradient `dprobs` and its auxiliary losses
    /// scaled by `loss_scale` (as [`Self::router_grads`] placed them): the logits' gradient,
    /// where the logits live (graph scope `moe_router` captures it with the gate's backward).
    fn backward_route(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::RouterSaved,
        routing: &PlacedRouting,
        dprobs: &Tensor,
        loss_scale: &Tensor,
    ) -> Result<Tensor>;
    /// The gate's backward: accumulates its gradient from `dlogits` and returns `dx` (the
    /// input's gradient through the experts) plus the input's gradient through the gate.
    fn backward_gate(
        &self,
        cx: &Cx,
        site: Site,
        saved: Self::GateSaved,
        dlogits: &Tensor,
        dx: Tensor,
    ) -> Result<Tensor>;
}
