//! The argument checks every backend makes before moving data, with one wording: a call that
//! cannot work on its own (a root outside the group, sizes that do not fit, splits that do not
//! add up) is a [`CommError::Invalid`] naming the group and the numbers.

use super::{CallDesc, CommError, OpKind, ReduceOp, Result};
use crate::tensor::Tensor;

impl CallDesc {
    /// What a rank calls: `kind` on `t`'s elements, with the reduction and root or peer if any.
    pub(crate) fn of(kind: OpKind, t: &Tensor, op: Option<ReduceOp>, peer: Option<usize>) -> Self {
        CallDesc {
            kind,
            dtype: t.dtype(),
            count: t.numel(),
            op,
            peer,
        }
    }

    /// A barrier's description (no data).
    pub(crate) fn barrier() -> Self {
        CallDesc {
            kind: OpKind::Barrier,
            dtype: crate::tensor::DType::F32,
            count: 0,
            op: None,
            peer: None,
        }
    }
}

/// One member's view of its group, for checking its calls.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Checks<'a> {
    /// The group's name.
    pub group: &'a str,
    /// Global ranks of the members, in group-rank order.
    pub ranks: &'a [usize],
    /// This member's index.
    pub index: usize,
}

impl Checks<'_> {
    /// An invalid-arguments error of this group.
    pub fn invalid(&self, message: String) -> CommError {
        CommError::Invalid {
            group: self.group.to_string(),
            message,
        }
    }

    /// `peer` (a root, a destination, a source) is a member.
    pub fn peer(&self, what: &str, peer: usize) -> Result<()> {
        let n = self.ranks.len();
        if peer >= n {
            return Err(self.invalid(format!("{what} {peer} is outside the group of {n} ranks")));
        }
        Ok(())
    }

    /// The destination of a send is another member.
    pub fn destination(&self, dst: usize) -> Result<()> {
        self.peer("send destination", dst)?;
        if dst == self.index {
            return Err(self.invalid(format!("send: rank {} sends to itself", self.ranks[dst])));
        }
        Ok(())
    }

    /// The source of a receive is another member.
    pub fn source(&self, src: usize) -> Result<()> {
        self.peer("recv source", src)?;
        if src == self.index {
            return Err(self.invalid(format!(
                "recv: rank {} receives from itself",
                self.ranks[src]
            )));
        }
        Ok(())
    }

    /// Input and output have one element type.
    pub fn same_dtype(&self, op: &str, a: &Tensor, b: &Tensor) -> Result<()> {
        if a.dtype() != b.dtype() {
            return Err(self.invalid(format!(
                "{op}: input is {} but output is {}",
                a.dtype(),
                b.dtype()
            )));
        }
        Ok(())
    }

    /// An all-gather's output holds every member's input; returns the input's elements.
    pub fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<usize> {
        self.same_dtype("all_gather", input, output)?;
        let (n, count) = (self.ranks.len(), input.numel());
        if output.numel() != n * count {
            return Err(self.invalid(format!(
                "all_gather: output has {} elements, expected {n} ranks × {count} input elements",
                output.numel(),
            )));
        }
        Ok(count)
    }

    /// A reduce-scatter's input holds a slot per member; returns the output's elements.
    pub fn reduce_scatter(&self, input: &Tensor, output: &Tensor) -> Result<usize> {
        self.same_dtype("reduce_scatter", input, output)?;
        let (n, count) = (self.ranks.len(), output.numel());
        if input.numel() != n * count {
            return Err(self.invalid(format!(
                "reduce_scatter: input has {} elements, expected {n} ranks × {count} output elements",
                input.numel(),
            )));
        }
        Ok(count)
    }

    /// An all-to-all's splits cover its buffers, one per member, and the buffers are distinct.
    pub fn all_to_all(
        &self,
        input: &Tensor,
        send_splits: &[usize],
        output: &Tensor,
        recv_splits: &[usize],
    ) -> Result<()> {
        self.same_dtype("all_to_all", input, output)?;
        let n = self.ranks.len();
        for (name, splits, t) in [("send", send_splits, input), ("recv", recv_splits, output)] {
            if splits.len() != n {
                return Err(self.invalid(format!(
                    "all_to_all: {} {name} splits for a group of {n} ranks",
                    splits.len()
                )));
            }
            let total: usize = splits.iter().sum();
            if total != t.numel() {
                return Err(self.invalid(format!(
                    "all_to_all: {name} splits {splits:?} add up to {total}, the buffer has {} elements",
                    t.numel()
                )));
            }
        }
        if input.same_storage(output) {
            return Err(self.invalid("all_to_all: input and output share storage".to_string()));
        }
        Ok(())
    }

    /// When `part` shares `whole`'s storage (an in-place all-gather or reduce-scatter), it is
    /// this member's slot of `slot` elements; `names` are (whole, part) as the call names them.
    pub fn slot(
        &self,
        op: &str,
        whole: &Tensor,
        part: &Tensor,
        slot: usize,
        names: (&str, &str),
    ) -> Result<()> {
        let expected = whole.layout().offset + self.index * slot;
        if part.layout().offset != expected {
            return Err(self.invalid(format!(
                "{op}: the {} shares storage with the {} but is not its slot {} (offset {} ≠ {expected})",
                names.1,
                names.0,
                self.index,
                part.layout().offset
            )));
        }
        Ok(())
    }
}
