"""The orders torch.distributed.pipelining builds for its ZB-V and DualPipeV schedules.

Usage: python3 tools/golden/torch_pipeline_orders.py > tests/data/torch_pipeline_orders.json

Calls each schedule class's own `_calculate_single_rank_operations` for every rank (on an
instance given only the sizes that method reads, so that no process group or stage is needed)
and writes each rank's actions as `megatron schedule --json`'s trace writes them:
`[pass, local chunk, microbatch]`. The mapping from torch's actions:

- the stage index becomes the rank's local chunk: stage `rank` is chunk 0, stage
  `2·pp − 1 − rank` chunk 1 (torch's "v" stage-to-rank mapping);
- `F` stays `F`; `I` (BACKWARD_INPUT) is `B`, the input gradient; `W` stays `W`;
- `B` (FULL_BACKWARD) is `B` followed at once by `W` of the same chunk and microbatch;
- DualPipeV's `OVERLAP_F_B` (a forward of one chunk overlapped with a full backward of the
  other) is its two sub-actions in order: the forward, then the full backward as above;
- idle slots (`None`) are dropped.

tests/data/torch_pipeline_orders.json was made with torch 2.15.
"""
import json

import torch
from torch.distributed.pipelining import schedules as S


def actions(cls, pp, m, rank):
    sched = object.__new__(cls)
    sched.pp_group_size = pp
    sched._n_microbatches = m
    sched.num_stages = 2 * pp
    sched._num_stages = 2 * pp
    sched.n_local_stages = 2
    return sched._calculate_single_rank_operations(rank)


def convert(action, pp, rank):
    if action is None:
        return []
    kind = action.computation_type
    if kind == S.OVERLAP_F_B:
        return [x for sub in action.sub_actions for x in convert(sub, pp, rank)]
    chunk = 0 if action.stage_index == rank else 1
    assert action.stage_index == (rank if chunk == 0 else 2 * pp - 1 - rank)
    mb = action.microbatch_index
    if kind == S.FORWARD:
        return [["F", chunk, mb]]
    if kind == S.BACKWARD_INPUT:
        return [["B", chunk, mb]]
    if kind == S.BACKWARD_WEIGHT:
        return [["W", chunk, mb]]
    if kind == S.FULL_BACKWARD:
        return [["B", chunk, mb], ["W", chunk, mb]]
    raise ValueError(f"unexpected action {action}")


CASES = {
    "zbv": (S.ScheduleZBVZeroBubble, [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)]),
    "dualpipev": (S.ScheduleDualPipeV, [(2, 4), (2, 8), (4, 8), (4, 12), (4, 16), (8, 16)]),
}

out = {"torch": torch.__version__}
for name, (cls, sizes) in CASES.items():
    out[name] = []
    for pp, m in sizes:
        ranks = []
        for rank in range(pp):
            ranks.append([x for a in actions(cls, pp, m, rank) for x in convert(a, pp, rank)])
        out[name].append({"pp": pp, "microbatches": m, "ranks": ranks})
print(json.dumps(out))
