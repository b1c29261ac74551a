//! `#[pipeline]`: the GPT's `blocks` cut into pipeline stages. Each stage's instance holds its
//! run of blocks (under their global names) and the parts around them on the first and last
//! stage; running the stages' `forward_pre`, `forward_layers` and `forward_post` in turn, and
//! their backwards in reverse, computes exactly what the whole model's forward and backward do.

use std::collections::BTreeMap;

use megatron::comm::ParallelState;
use megatron::models::GptConfig;
use megatron::models::gpt::Gpt;
use megatron::module::{Builder, Cx, Module, Pipelined, Site};
use megatron::pipeline_parallel::{PipelineLayout, StagePart};
use megatron::tensor::Tensor;

const S: usize = 8;
const B: usize = 2;

fn config() -> GptConfig {
    let mut c = GptConfig::new(4, 32, 4, 50, 16);
    c.make_vocab_size_divisible_by = 1;
    c.hidden_dropout = 0.2;
    c.attention_dropout = 0.2;
    c
}

fn ids(salt: usize) -> Tensor {
    let v: Vec<i64> = (0..S * B)
        .map(|i| ((i * 17 + salt * 5) % 50) as i64)
        .collect();
    Tensor::from_vec(v, [S, B]).unwrap()
}

/// Every parameter's gradient, by name.
fn grads_of<M: Module>(m: &M, out: &mut BTreeMap<String, Vec<f32>>) {
    m.visit_params(&mut |p| {
        let g = p.grad().to_vec::<f32>().unwrap();
        out.entry(p.spec().name.clone())
            .and_modify(|sum: &mut Vec<f32>| {
                for (s, x) in sum.iter_mut().zip(&g) {
                    *s += x;
                }
            })
            .or_insert(g);
    });
}

fn names_of<M: Module>(m: &M) -> Vec<String> {
    let mut out = Vec::new();
    m.visit_params(&mut |p| out.push(p.spec().name.clone()));
    out
}

#[test]
fn stages_hold_their_layers_and_ends() {
    let layout = PipelineLayout::new(4, 2, 2, None, None).unwrap();
    let spec = config().spec();
    let part = |rank, chunk| layout.part(rank, chunk);
    assert_eq!(
        part(0, 0),
        StagePart {
            layers: 0..1,
            first: true,
            last: false
        }
    );
    assert_eq!(part(1, 0).layers, 1..2);
    assert_eq!(part(0, 1).layers, 2..3);
    assert!(part(1, 1).last && !part(1, 1).first);
    let build = |p: StagePart| Gpt::build(&spec, &mut Builder::new(3).with_stage(p)).unwrap();
    let first = build(part(0, 0));
    let names = names_of(&first);
    assert_eq!(names[..2], ["wte.weight", "wpe.weight"]);
    assert!(
        names
            .iter()
            .all(|n| !n.starts_with("ln_f") && !n.starts_with("blocks.1"))
    );
    assert!(names.iter().any(|n| n.starts_with("blocks.0.")));
    let middle = build(part(0, 1));
    let names = names_of(&middle);
    assert!(
        names.iter().all(|n| n.starts_with("blocks.2.")),
        "{names:?}"
    );
    let last = build(part(1, 1));
    let names = names_of(&last);
    assert_eq!(names[0], "wte.weight");
    assert!(names.iter().any(|n| n.starts_with("blocks.3.")));
    assert!(names.iter().any(|n| n == "ln_f.weight"));
    assert!(names.iter().all(|n| n != "wpe.weight"));
    // The tied embedding is shared by the first and the last stage only.
    let mut shared = Vec::new();
    last.visit_shared_params(&mut |p| shared.push(p.spec().name.clone()));
    assert_eq!(shared, ["wte.weight"]);
    let mut none = Vec::new();
    middle.visit_shared_params(&mut |p| none.push(p.spec().name.clone()));
    build(StagePart::whole(4)).visit_shared_params(&mut |p| none.push(p.spec().name.clone()));
    assert!(none.is_empty());
    // The same names start from the same values as in the whole model.
    let whole = Gpt::build(&spec, &mut Builder::new(3)).unwrap();
    let mut values = BTreeMap::new();
    whole.visit_params(&mut |p| {
        values.insert(p.spec().name.clone(), p.value().to_vec::<f32>().unwrap());
    });
    last.visit_params(&mut |p| {
        assert_eq!(values[&p.spec().name], p.value().to_vec::<f32>().unwrap());
    });
}

#[test]
fn the_stages_in_turn_compute_what_the_whole_model_does() {
    let spec = config().spec();
    let ps = ParallelState::solo();
    let cx = Cx::new(&ps, 21).at(1, 3);
    let (tokens, targets) = (ids(1), ids(2));
    let d_losses = Tensor::from_vec(
        (0..S * B)
            .map(|i| (i as f32 * 0.37).sin())
            .collect::<Vec<_>>(),
        [S, B],
    )
    .unwrap();

    let whole = Gpt::build(&spec, &mut Builder::new(4)).unwrap();
    let (losses, saved) = whole.forward(&cx, Site::ROOT, &tokens, &targets).unwrap();
    whole.backward(&cx, Site::ROOT, saved, &d_losses).unwrap();
    let mut expected = BTreeMap::new();
    grads_of(&whole, &mut expected);

    for (pp, vpp) in [(2, 1), (4, 1), (2, 2)] {
        let layout = PipelineLayout::new(4, pp, vpp, None, None).unwrap();
        // Virtual stage order: chunk 0 of every rank, then chunk 1, ...
        let stages: Vec<Gpt> = (0..pp * vpp)
            .map(|s| {
                let part = layout.part(s % pp, s / pp);
                Gpt::build(&spec, &mut Builder::new(4).with_stage(part)).unwrap()
            })
            .collect();
        let (mut h, pre) = stages[0].forward_pre(&cx, Site::ROOT, &tokens).unwrap();
        let mut layer_saves = Vec::new();
        for stage in &stages {
            let (out, saved) = stage.forward_layers(&cx, Site::ROOT, &h).unwrap();
            h = out;
            layer_saves.push(saved);
        }
        let last = stages.last().unwrap();
        let (staged, post) = last
            .forward_post(&cx, Site::ROOT, &h, &tokens, &targets)
            .unwrap();
        assert_eq!(
            staged.to_vec::<f32>().unwrap(),
            losses.to_vec::<f32>().unwrap(),
            "pp {pp} V {vpp}: the same losses bit for bit"
        );
        let (mut d_h, (), ()) = last
            .backward_post(&cx, Site::ROOT, post, &d_losses)
            .unwrap();
        for (stage, saved) in stages.iter().zip(layer_saves).rev() {
            d_h = stage.backward_layers(&cx, Site::ROOT, saved, &d_h).unwrap();
        }
        let () = stages[0].backward_pre(&cx, Site::ROOT, pre, &d_h).unwrap();
        let mut got = BTreeMap::new();
        for stage in &stages {
            grads_of(stage, &mut got);
        }
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            expected.keys().collect::<Vec<_>>()
        );
        for (name, g) in &got {
            let e = &expected[name];
            if name == "wte.weight" {
                // The whole model sums the tied embedding's two gradients in another order.
                let scale = e.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (x, y) in g.iter().zip(e) {
                    assert!((x - y).abs() <= 1e-6 * scale, "{name}: {x} vs {y}");
                }
            } else {
                assert_eq!(g, e, "pp {pp} V {vpp}: {name}");
            }
        }
    }
}
