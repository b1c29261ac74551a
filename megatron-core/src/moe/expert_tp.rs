//! Expert tensor parallelism (`--expert-tensor-parallel-size`): the ranks of an
//! expert-tensor-parallel group hold the same experts, each a slice of every expert's hidden
//! layer (fc1 split by its outputs, fc2 by its inputs, as a dense MLP's column and row parallel
//! layers). After the dispatcher, the group gathers the rows each of its ranks received, so that
//! every rank runs its slices over all of them; the partial outputs are summed and each rank gets
//! back those of its own rows (Megatron-LM's all-gather and reduce-scatter over the tensor-parallel
//! group in its token dispatchers). The rows' counts differ between ranks: both exchanges are
//! all-to-alls with uneven splits. With one rank per group they move nothing.

use crate::comm::Communicator;
use crate::error::Result;
use crate::invalid;
use crate::tensor::{DType, Tensor};

use super::dispatcher::{counts_of, placed};
use crate::backend;

/// Where the rows of an expert-tensor-parallel group came from.
#[derive(Debug, Clone)]
pub struct TpRows {
    /// Rows of each local expert on each rank of the group: `[ranks, local experts]`.
    per_rank: Vec<usize>,
    /// The same counts where the rows are (what sorts them by local expert), with more than one
    /// rank.
    counts: Option<Tensor>,
    local_experts: usize,
    hidden: usize,
    rank: usize,
}

impl TpRows {
    fn ranks(&self) -> usize {
        self.per_rank.len() / self.local_experts.max(1)
    }

    /// Rows of each rank.
    fn rows_of(&self) -> Vec<usize> {
        self.per_rank
            .chunks_exact(self.local_experts.max(1))
            .map(|c| c.iter().sum())
            .collect()
    }

    /// Rows of each local expert over the whole group (the grouped products' group sizes).
    pub fn rows_per_local_expert(&self) -> Vec<usize> {
        let l = self.local_experts;
        (0..l)
            .map(|le| (0..self.ranks()).map(|r| self.per_rank[r * l + le]).sum())
            .collect()
    }

    /// Rows of the whole group.
    pub fn rows(&self) -> usize {
        self.per_rank.iter().sum()
    }

    /// Rows of this rank.
    pub fn own_rows(&self) -> usize {
        self.rows_of()[self.rank]
    }

    /// The counts where the rows are (gathered over a group of more than one rank).
    fn counts(&self) -> Result<&Tensor> {
        match &self.counts {
            Some(counts) => Ok(counts),
            None => invalid!("expert-tensor-parallel rows of one rank have no exchanged counts"),
        }
    }
}

/// Gathers over `etp` the rows each rank's dispatcher gave it (`rows`: `[n, hidden]`,
/// `per_expert[le]` rows of each local expert, local-expert-major), ordered by local expert
/// then rank: returns them and where they came from.
pub fn gather_expert_rows(
    etp: &dyn Communicator,
    rows: &Tensor,
    per_expert: &[usize],
) -> Result<(Tensor, TpRows)> {
    let (local_experts, hidden) = (per_expert.len(), rows.dims().last().copied().unwrap_or(0));
    let counts: Vec<i64> = per_expert.iter().map(|&c| c as i64).collect();
    let (per_rank, counts) = if etp.size() == 1 {
        (per_expert.to_vec(), None)
    } else {
        let all = Tensor::zeros_near([counts.len() * etp.size()], DType::I64, rows)?;
        etp.all_gather(
            &placed(Tensor::from_vec(counts, [local_experts])?, rows)?,
            &all,
        )?;
        let per_rank = counts_of(&all)?;
        (per_rank, Some(all))
    };
    let tp = TpRows {
        per_rank,
        counts,
        local_experts,
        hidden,
        rank: etp.index(),
    };
    let gathered = regather_expert_rows(etp, rows, &tp)?;
    Ok((gathered, tp))
}

/// The gather of [`gather_expert_rows`] with a known layout: for the output gradient of this
/// rank's rows in the backward (the transpose of [`reduce_scatter_expert_rows`]).
pub fn regather_expert_rows(etp: &dyn Communicator, rows: &Tensor, tp: &TpRows) -> Result<Tensor> {
    let h = tp.hidden;
    if rows.dims() != [tp.own_rows(), h] {
        return invalid!(
            "expert-tensor-parallel rows of shape {}, this rank's are [{}, {h}]",
            rows.shape(),
            tp.own_rows()
        );
    }
    if etp.size() == 1 {
        return Ok(rows.clone());
    }
    let ops = backend::of(rows);
    let (ranks, own) = (tp.ranks(), tp.own_rows());
    // Every rank sends its rows to every rank: an all-to-all of equal sends, uneven receives.
    let copies = ops.affine_index(ranks * own, (own, 1, 0))?;
    let input = ops
        .gather_rows(rows, h, &copies)?
        .reshape([ranks * own * h])?;
    let recv: Vec<usize> = tp.rows_of().iter().map(|&r| r * h).collect();
    let output = Tensor::zeros_near([recv.iter().sum::<usize>()], DType::F32, rows)?;
    etp.all_to_all(&input, &vec![own * h; ranks], &output, &recv)?;
    let order = ops.chunk_order(tp.counts()?, tp.local_experts, tp.rows(), false)?;
    ops.gather_rows(&output, h, &order)
}

/// Sums over `etp` the partial values of the group's rows (`[group rows, hidden]`, as
/// [`gather_expert_rows`] ordered them) and returns this rank's rows (`[own rows, hidden]`,
/// local-expert-major): the reduce-scatter after the experts' row-parallel fc2, and in the
/// backward the transpose of the gather.
pub fn reduce_scatter_expert_rows(
    etp: &dyn Communicator,
    partial: &Tensor,
    tp: &TpRows,
) -> Result<Tensor> {
    let h = tp.hidden;
    if partial.dims() != [tp.rows(), h] {
        return invalid!(
            "expert-tensor-parallel partial rows of shape {}, the group's are [{}, {h}]",
            partial.shape(),
            tp.rows()
        );
    }
    if etp.size() == 1 {
        return Ok(partial.clone());
    }
    let ops = backend::of(partial);
    // Back to rank order (each rank's chunk local-expert-major), then each chunk to its rank.
    let unsort = ops.chunk_order(tp.counts()?, tp.local_experts, tp.rows(), true)?;
    let unsorted = ops.gather_rows(partial, h, &unsort)?;
    let (ranks, own) = (tp.ranks(), tp.own_rows());
    let send: Vec<usize> = tp.rows_of().iter().map(|&r| r * h).collect();
    let output = Tensor::zeros_near([own * h * ranks], DType::F32, partial)?;
    etp.all_to_all(
        &unsorted.reshape([tp.rows() * h])?,
        &send,
        &output,
        &vec![own * h; ranks],
    )?;
    // Each own row summed over the ranks' chunks, in rank order: own row t's slots are
    // r·own + t for each rank r.
    let slots = ops
        .affine_index(own * ranks, (ranks, own, 1))?
        .reshape([own, ranks])?;
    ops.sum_rows(&output, h, &slots, None)
}
