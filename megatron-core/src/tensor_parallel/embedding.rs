//! Embeddings: the word embedding (whole or split by vocabulary, with its tied output layer) and
//! the learned position embedding.

use crate::backend;
use crate::documents::{Runs, each_run, map_runs};
use crate::error::Result;
use crate::invalid;
use crate::module::{
    Builder, Cx, Ids, Init, Layer, Lookup, Module, Param, Site, Split, VocabParallel, WeightGrad,
    weight_grad::bytes_of,
};
use crate::ops::{as_operand, matmul, matmul_into};
use crate::parallel::GroupKind;
use crate::tensor::{DType, Tensor};

/// Megatron-LM's padded vocabulary: `vocab` rounded up to a multiple of `divisible_by × tp`, so
/// that every tensor-parallel rank holds the same number of rows (50,257 → 50,304 at tp 1 and
/// 51,200 at tp 8 with the default 128).
pub fn padded_vocab_size(vocab: usize, divisible_by: usize, tp: usize) -> usize {
    let multiple = divisible_by.max(1) * tp.max(1);
    vocab.div_ceil(multiple) * multiple
}

/// The logical description of a word embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingSpec {
    /// Real vocabulary size (token ids are below it).
    pub vocab_size: usize,
    /// Embedding width.
    pub hidden: usize,
    /// Standard deviation of the normal initialisation.
    pub init_std: f32,
    /// The padded vocabulary is a multiple of this times the tensor-parallel size.
    pub make_vocab_size_divisible_by: usize,
    /// An output layer of its own (Megatron-LM's `--untie-embeddings-and-output-weights`): a
    /// second table of the same shape, `output_weight`, which the logits read instead of the
    /// input table.
    pub untied: bool,
}

impl EmbeddingSpec {
    /// A `vocab × hidden` embedding drawn from N(0, 0.02), padded as Megatron-LM pads (128),
    /// tied to its output layer.
    pub fn new(vocab_size: usize, hidden: usize) -> Self {
        EmbeddingSpec {
            vocab_size,
            hidden,
            init_std: 0.02,
            make_vocab_size_divisible_by: 128,
            untied: false,
        }
    }
}

/// A word embedding `[padded vocab, hidden]`; split by vocabulary rows under `#[vocab_parallel]`.
///
/// Rows past the real vocabulary (padding) are never looked up, and their logits are −∞, so
/// they never win and never receive gradient.
///
/// Untied ([`EmbeddingSpec::untied`]), the output layer has a table of its own. A pipeline's
/// first stage then holds only the input table and its last stage only the output one (the
/// other is a placeholder of its shape, never visited): nothing is shared between them.
#[derive(Debug, Clone)]
pub struct Embedding {
    weight: Param,
    /// The output layer's own table, when untied.
    output: Option<Param>,
    /// Whether this stage holds the input table and the output table (both, unless untied
    /// and cut by a pipeline).
    holds: (bool, bool),
    /// Untied and looked up after the stack too (multi-token prediction): both ends of a
    /// pipeline hold the input table, and it is the one they share.
    lookup_at_both_ends: bool,
    vocab_size: usize,
    /// First global row this rank holds.
    vocab_start: usize,
}

/// What a lookup keeps: the ids.
#[derive(Debug, Clone)]
pub struct EmbeddingSaved {
    ids: Tensor,
}

/// What the tied output layer keeps: its input.
#[derive(Debug, Clone)]
pub struct LogitsSaved {
    h: Tensor,
}

impl Embedding {
    fn build_as(spec: &EmbeddingSpec, b: &mut Builder, split: bool) -> Result<Embedding> {
        let (rank, tp) = if split { b.tp() } else { (0, 1) };
        let padded = padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by, tp);
        let how = if split {
            Split::Dim {
                dim: 0,
                group: GroupKind::Tp,
            }
        } else {
            Split::Replicated
        };
        // Untied and cut by a pipeline: the first stage looks up, the last one outputs (and
        // looks up too when the model calls the embedding after the stack).
        let lookup_at_both_ends = spec.untied && b.is_called_at_both_ends();
        let holds = match b.stage() {
            Some(stage) if spec.untied => (
                stage.first || (lookup_at_both_ends && stage.last),
                stage.last,
            ),
            _ => (true, true),
        };
        let table = |b: &mut Builder, name: &str, held: bool| {
            let make = |b: &mut Builder| {
                b.padded_param(
                    name,
                    [padded, spec.hidden],
                    how,
                    Init::Normal { std: spec.init_std },
                    true,
                    spec.vocab_size,
                )
            };
            if held { make(b) } else { b.placeholder(make) }
        };
        let weight = table(b, "weight", holds.0)?;
        let output = match spec.untied {
            true => Some(table(b, "output_weight", holds.1)?),
            false => None,
        };
        let vocab_start = rank * (padded / tp);
        Ok(Embedding {
            weight,
            output,
            holds,
            lookup_at_both_ends,
            vocab_size: spec.vocab_size,
            vocab_start,
        })
    }

    /// The output layer's table: its own when untied, else the input table.
    fn output_table(&self) -> &Param {
        self.output.as_ref().unwrap_or(&self.weight)
    }

    /// The weight (this rank's rows).
    pub fn weight(&self) -> &Param {
        &self.weight
    }

    /// The output layer's own table (this rank's rows), when untied.
    pub fn output_weight(&self) -> Option<&Param> {
        self.output.as_ref()
    }

    /// The real vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Rows of the padded vocabulary over all ranks.
    pub fn padded_vocab_size(&self) -> usize {
        self.weight.spec().logical.dims()[0]
    }

    fn local_rows(&self) -> usize {
        self.weight.value().dims()[0]
    }

    fn hidden(&self) -> usize {
        self.weight.value().dims()[1]
    }

    /// Checks that the ids are i64.
    fn check_id_type(&self, ids: &Tensor) -> Result<()> {
        if ids.dtype() != DType::I64 {
            return invalid!(
                "embedding {}: token ids must be i64, got {}",
                self.weight.spec().name,
                ids.dtype()
            );
        }
        Ok(())
    }

    /// Checks that every id is a token of the real vocabulary.
    fn check_ids(&self, ids: &Tensor) -> Result<Tensor> {
        self.check_id_type(ids)?;
        let ids = ids.contiguous()?;
        if let Some((pos, &id)) = ids
            .read::<i64>()?
            .iter()
            .enumerate()
            .find(|&(_, &id)| id < 0 || id as usize >= self.vocab_size)
        {
            return invalid!(
                "token id {id} at position {pos} is outside the vocabulary of {} tokens",
                self.vocab_size
            );
        }
        Ok(ids)
    }

    /// Host ids are checked; device ids are not (that would read them back): an id this
    /// shard does not hold gives a zero row and no gradient.
    fn lookup(&self, ids: &Tensor) -> Result<(Tensor, EmbeddingSaved)> {
        if !self.holds.0 {
            return crate::invalid!(
                "this pipeline stage looks up an untied embedding whose input table only the \
                 first stage holds (a module built without `Builder::called_at_both_ends`)"
            );
        }
        let ids = if ids.gpu().is_some() {
            self.check_id_type(ids)?;
            ids.clone()
        } else {
            self.check_ids(ids)?
        };
        // The host reads a 16-bit table's looked-up rows as they are; a device's table is f32.
        let value = self.weight.value();
        let table = match value.gpu() {
            Some(_) => value.to_f32_contiguous()?,
            None => value.to_contiguous(value.dtype())?,
        };
        let rows = (self.vocab_start, self.local_rows());
        let (out, ids) = backend::of(self.weight.value()).embedding_lookup(&ids, &table, rows)?;
        Ok((out, EmbeddingSaved { ids }))
    }

    fn lookup_backward(&self, saved: EmbeddingSaved, dy: &Tensor) -> Result<()> {
        let ops = backend::of(self.weight.grad());
        let rows = (self.vocab_start, self.local_rows());
        self.weight
            .accumulate_grad(|grad| ops.embedding_lookup_backward(&saved.ids, dy, rows, grad))
    }
}

impl Module for Embedding {
    type Spec = EmbeddingSpec;
    type Saved = EmbeddingSaved;

    fn build(spec: &EmbeddingSpec, b: &mut Builder) -> Result<Self> {
        Embedding::build_as(spec, b, false)
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        if self.holds.0 {
            f(&self.weight);
        }
        if let (Some(output), true) = (&self.output, self.holds.1) {
            f(output);
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        if self.holds.0 {
            f(&mut self.weight);
        }
        if let (Some(output), true) = (&mut self.output, self.holds.1) {
            f(output);
        }
    }

    /// Tied, the table both ends of a pipeline use; untied, the input table when both ends
    /// look up (multi-token prediction), else nothing: each end has its own.
    fn visit_tied_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        if self.output.is_none() || self.lookup_at_both_ends {
            f(&self.weight);
        }
    }
}

impl Lookup for Embedding {
    fn forward(&self, _cx: &Cx, _site: Site, ids: &Ids) -> Result<(Tensor, EmbeddingSaved)> {
        self.lookup(ids)
    }

    fn backward(&self, _cx: &Cx, _site: Site, saved: EmbeddingSaved, dy: &Tensor) -> Result<()> {
        self.lookup_backward(saved, dy)
    }
}

impl VocabParallel for Embedding {
    type LogitsSaved = LogitsSaved;

    /// Its backward converts the logits' gradient to the products' dtype first.
    const LOGITS_GRADIENT_FEEDS_PRODUCTS: bool = true;

    fn build_vocab(spec: &EmbeddingSpec, b: &mut Builder) -> Result<Self> {
        Embedding::build_as(spec, b, true)
    }

    fn forward_vocab(&self, _cx: &Cx, _site: Site, ids: &Ids) -> Result<(Tensor, EmbeddingSaved)> {
        self.lookup(ids)
    }

    fn backward_vocab(
        &self,
        _cx: &Cx,
        _site: Site,
        saved: EmbeddingSaved,
        dy: &Tensor,
    ) -> Result<()> {
        self.lookup_backward(saved, dy)
    }

    fn logits_forward(&self, _cx: &Cx, _site: Site, h: &Tensor) -> Result<(Tensor, LogitsSaved)> {
        let hidden = self.hidden();
        let table = self.output_table();
        if h.dims().last() != Some(&hidden) {
            return invalid!(
                "output layer {}: input of shape {} does not end in {hidden}",
                table.spec().name,
                h.shape()
            );
        }
        // On the weight's device (a host input is uploaded to a GPU weight).
        let h = as_operand(&backend::of(table.value()).place(h)?)?;
        let rows = h.numel() / hidden;
        let local = self.local_rows();
        let logits = matmul(&h.reshape([rows, hidden])?, &table.compute_value().t()?)?;
        // Padding rows of the vocabulary: logits −∞, so softmax gives them nothing.
        let real = self.vocab_size.saturating_sub(self.vocab_start).min(local);
        if real < local {
            mask_columns(&logits, local, real)?;
        }
        let mut dims = h.dims().to_vec();
        *dims.last_mut().expect("h has a last dimension") = local;
        Ok((logits.reshape(dims)?, LogitsSaved { h }))
    }

    fn logits_backward_input(
        &self,
        _cx: &Cx,
        _site: Site,
        saved: LogitsSaved,
        dlogits: &Tensor,
    ) -> Result<(Tensor, WeightGrad)> {
        let hidden = self.hidden();
        let local = self.local_rows();
        let rows = saved.h.numel() / hidden;
        let table = self.output_table();
        if dlogits.numel() != rows * local {
            return invalid!(
                "output layer {}: logit gradient of shape {} does not fit {rows} rows × {local} vocabulary rows",
                table.spec().name,
                dlogits.shape()
            );
        }
        // Both products read the logits' gradient: converted once.
        let d = as_operand(dlogits)?.reshape([rows, local])?;
        let h2 = saved.h.reshape([rows, hidden])?;
        let dh = matmul(&d, table.compute_value())?;
        let table = table.clone();
        let dw = WeightGrad::new(bytes_of(&[&d, &h2]), move || {
            table.accumulate_grad(|grad| Ok(matmul_into(1.0, &d.t()?, &h2, 1.0, grad)?))
        });
        Ok((dh.reshape(saved.h.shape().clone())?, dw))
    }

    fn map_kept_logits_input(
        saved: LogitsSaved,
        f: &dyn Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<LogitsSaved> {
        Ok(LogitsSaved { h: f(&saved.h)? })
    }
}

/// Sets columns `from..cols` of every row of the contiguous f32 matrix `x[.., cols]` to −∞.
fn mask_columns(x: &Tensor, cols: usize, from: usize) -> Result<()> {
    backend::of(x).mask_columns(x, cols, from)
}

/// The logical description of a learned position embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct PositionEmbeddingSpec {
    /// Longest sequence.
    pub max_positions: usize,
    /// Embedding width.
    pub hidden: usize,
    /// Standard deviation of the normal initialisation.
    pub init_std: f32,
}

impl PositionEmbeddingSpec {
    /// Positions `0..max_positions` of width `hidden`, drawn from N(0, 0.02).
    pub fn new(max_positions: usize, hidden: usize) -> Self {
        PositionEmbeddingSpec {
            max_positions,
            hidden,
            init_std: 0.02,
        }
    }
}

/// Learned absolute positions, replicated: for ids `[s, b]` (sequence first, as Megatron-LM
/// lays activations out) it returns `[s, b, hidden]` with row `i` of the table at position `i`.
#[derive(Debug, Clone)]
pub struct PositionEmbedding {
    weight: Param,
}

/// What a position embedding keeps: the runs of positions it looked up (first, count; with
/// context parallelism the rank's two chunks, else one run and an empty one) and the batch
/// length.
#[derive(Debug, Clone)]
pub struct PositionSaved {
    runs: [(usize, usize); 2],
    batch: usize,
    /// With packed documents restarting the positions, each sample's runs of local rows and
    /// the position of each run's first.
    documents: Option<Vec<Runs>>,
}

impl PositionSaved {
    /// The positions looked up.
    fn seq(&self) -> usize {
        self.runs.iter().map(|r| r.1).sum()
    }
}

impl Module for PositionEmbedding {
    type Spec = PositionEmbeddingSpec;
    type Saved = PositionSaved;

    fn build(spec: &PositionEmbeddingSpec, b: &mut Builder) -> Result<Self> {
        // With sequence parallelism each rank looks up its shard's positions: the table's
        // gradient is summed over tp.
        let weight = b
            .param(
                "weight",
                [spec.max_positions, spec.hidden],
                Split::Replicated,
                Init::Normal { std: spec.init_std },
                true,
            )?
            .in_sequence_parallel_region()?;
        Ok(PositionEmbedding { weight })
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        f(&self.weight);
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.weight);
    }
}

impl PositionEmbedding {
    /// The positions of a sequence of `whole` tokens of `batch` sequences, or with sequence
    /// parallelism of this rank's shard of it (`[s / tp, b, hidden]`, from `rank · s / tp` on);
    /// decoding with a KV cache, from its offset on; with context parallelism (`whole` this
    /// rank's positions), those of its two chunks of the sequence.
    fn positions(&self, cx: &Cx, whole: usize, batch: usize) -> Result<(Tensor, PositionSaved)> {
        let max = self.weight.value().dims()[0];
        let offset = cx.position_offset();
        let global = whole * cx.cp_size();
        if offset + global > max {
            return invalid!(
                "positions {offset}..{} exceed the {max} learned positions \
                 (--max-position-embeddings)",
                offset + global
            );
        }
        // This rank's positions: its chunks' with context parallelism, with sequence
        // parallelism its shard of them.
        let runs = cx.position_runs(whole)?;
        if let Some(docs) = cx.documents().filter(|d| d.resets_positions()) {
            // Each sample's rows from its documents' starts: the table's rows looked up per run.
            let per_sample: Vec<_> = (0..batch).map(|j| docs.local_runs(j, &runs)).collect();
            let seq = runs.iter().map(|r| r.len()).sum::<usize>();
            let rows = Tensor::empty_near([seq, batch, 1], DType::F32, self.weight.value())?;
            let out = map_runs(
                &rows,
                |j| per_sample[j].clone(),
                |part, _, first| {
                    let len = part.dims()[0];
                    let table = self.weight.value().narrow(0, first, len)?;
                    backend::of(&table).positions_forward(&table.to_f32_contiguous()?, len, 1)
                },
            )?;
            let saved = PositionSaved {
                runs: [(0, seq), (seq, 0)],
                batch,
                documents: Some(per_sample),
            };
            return Ok((out, saved));
        }
        let [first, second] = match runs.as_slice() {
            [a] => [(a.start, a.len()), (a.end, 0)],
            [a, b] => [(a.start, a.len()), (b.start, b.len())],
            _ => return invalid!("position embedding: this rank's positions lie in {runs:?}"),
        };
        let (table, seq) = (self.weight.value(), first.1 + second.1);
        let out = match second.1 {
            0 => {
                let part = table.narrow(0, first.0, first.1)?.to_f32_contiguous()?;
                backend::of(table).positions_forward(&part, seq, batch)?
            }
            _ => {
                let part = Tensor::empty_near([seq, table.dims()[1]], DType::F32, table)?;
                for (at, (start, len)) in [(0, first), (first.1, second)] {
                    part.narrow(0, at, len)?
                        .copy_from(&table.narrow(0, start, len)?.to_f32_contiguous()?)?;
                }
                backend::of(table).positions_forward(&part, seq, batch)?
            }
        };
        let runs = [first, second];
        let saved = PositionSaved {
            runs,
            batch,
            documents: None,
        };
        Ok((out, saved))
    }
}

impl Lookup for PositionEmbedding {
    /// The positions of the ids' sequence, or with sequence parallelism of this rank's shard of
    /// it (`[s / tp, b, hidden]`, the positions from `rank · s / tp` on).
    fn forward(&self, cx: &Cx, _site: Site, ids: &Ids) -> Result<(Tensor, PositionSaved)> {
        let [seq, batch] = ids.dims() else {
            return invalid!(
                "position embedding: ids must be [sequence, batch], got {}",
                ids.shape()
            );
        };
        self.positions(cx, *seq, *batch)
    }

    fn backward(&self, _cx: &Cx, _site: Site, saved: PositionSaved, dy: &Tensor) -> Result<()> {
        let h = self.weight.value().dims()[1];
        if dy.numel() != saved.seq() * saved.batch * h {
            return invalid!(
                "position embedding: gradient of shape {} does not fit [{}, {}, {h}]",
                dy.shape(),
                saved.seq(),
                saved.batch
            );
        }
        let ops = backend::of(self.weight.grad());
        let batch = saved.batch;
        let dy = dy.reshape([saved.seq(), batch, h])?;
        if let Some(per_sample) = &saved.documents {
            return each_run(
                &dy,
                |j| per_sample[j].clone(),
                |part, _, first| {
                    let len = part.dims()[0];
                    self.weight.accumulate_grad(|grad| {
                        ops.positions_backward(part, len, 1, &grad.narrow(0, first, len)?)
                    })
                },
            );
        }
        let mut at = 0;
        for (first, seq) in saved.runs.into_iter().filter(|r| r.1 > 0) {
            let part = dy.narrow(0, at, seq)?;
            self.weight.accumulate_grad(|grad| {
                ops.positions_backward(&part, seq, batch, &grad.narrow(0, first, seq)?)
            })?;
            at += seq;
        }
        Ok(())
    }
}

/// What a model's embeddings get for positions (Megatron-LM's `--position-embedding-type`).
#[derive(Debug, Clone, PartialEq)]
pub enum PositionsSpec {
    /// A learned table (`learned_absolute`).
    Learned(PositionEmbeddingSpec),
    /// Nothing here: rotary embeddings in attention (`rope`), or no positions (`none`).
    Elsewhere,
}

/// Adds a model's positions to its word embeddings, `[s, b, h] → [s, b, h]`: a learned table's
/// rows (a [`PositionEmbedding`], whose parameter it holds under the same name), or, when
/// attention turns its queries and keys by position instead ([`PositionsSpec::Elsewhere`]),
/// nothing at all: the identity, with no parameters and no work.
#[derive(Debug, Clone)]
pub struct Positions {
    table: Option<PositionEmbedding>,
}

impl Module for Positions {
    type Spec = PositionsSpec;
    type Saved = Option<PositionSaved>;

    fn build(spec: &PositionsSpec, b: &mut Builder) -> Result<Self> {
        let table = match spec {
            PositionsSpec::Learned(spec) => Some(PositionEmbedding::build(spec, b)?),
            PositionsSpec::Elsewhere => None,
        };
        Ok(Positions { table })
    }

    fn visit_params<'s>(&'s self, f: &mut dyn FnMut(&'s Param)) {
        if let Some(table) = &self.table {
            table.visit_params(f);
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        if let Some(table) = &mut self.table {
            table.visit_params_mut(f);
        }
    }
}

impl Layer for Positions {
    /// `x + positions` for `x` `[s, b, h]` (with sequence parallelism this rank's shard of the
    /// sequence: the positions from `rank · s` on), or `x` itself.
    fn forward(&self, cx: &Cx, _site: Site, x: &Tensor) -> Result<(Tensor, Option<PositionSaved>)> {
        let Some(table) = &self.table else {
            return Ok((x.clone(), None));
        };
        let [seq, batch, _] = x.dims() else {
            return invalid!(
                "positions: input must be [sequence, batch, hidden], got {}",
                x.shape()
            );
        };
        let whole = match cx.sequence_parallel() {
            true => seq * cx.tp_size(),
            false => *seq,
        };
        let (positions, saved) = table.positions(cx, whole, *batch)?;
        Ok((crate::ops::add(x, &positions)?, Some(saved)))
    }

    fn backward(
        &self,
        cx: &Cx,
        site: Site,
        saved: Option<PositionSaved>,
        dy: &Tensor,
    ) -> Result<Tensor> {
        if let (Some(table), Some(saved)) = (&self.table, saved) {
            Lookup::backward(table, cx, site, saved, dy)?;
        }
        Ok(dy.clone())
    }
}
