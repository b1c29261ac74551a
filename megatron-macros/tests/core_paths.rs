//! A crate that depends on megatron-core and megatron-macros but not on the facade (as
//! megatron-models does) gets generated code that names `::megatron_core` and
//! `::megatron_macros`.

use megatron_core::comm::ParallelState;
use megatron_core::prelude::*;
use megatron_macros::module;

/// A two-layer feed-forward block.
#[module]
pub struct Ffn {
    #[column_parallel]
    up: Linear,
    #[row_parallel]
    down: Linear,
    #[config]
    p: f32,
}

#[module]
impl Ffn {
    /// Up, GeLU, down, dropout.
    fn forward(&self, x: Tensor) -> Tensor {
        dropout(self.down(gelu(self.up(x))), self.p)
    }
}

#[test]
fn builds_and_runs_against_megatron_core() -> megatron_core::Result<()> {
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 1).eval();
    let spec = FfnSpec {
        up: LinearSpec::new(4, 8),
        down: LinearSpec::new(8, 4),
        p: 0.5,
    };
    let ffn = Ffn::build(&spec, &mut Builder::new(1))?;
    let x = Tensor::from_vec(vec![0.5f32; 8], [2, 4])?;
    let (y, saved) = ffn.forward(&cx, Site::ROOT, &x)?;
    assert_eq!(y.dims(), [2, 4]);
    let dx = ffn.backward(&cx, Site::ROOT, saved, &y)?;
    assert_eq!(dx.dims(), [2, 4]);
    let mut names = Vec::new();
    ffn.visit_params(&mut |p| names.push(p.spec().name.clone()));
    assert_eq!(names, ["up.weight", "up.bias", "down.weight", "down.bias"]);
    Ok(())
}
