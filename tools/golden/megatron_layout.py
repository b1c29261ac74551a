"""Expected outputs of `megatron layout` from Megatron-LM's own code.

Usage: python3 tools/golden/megatron_layout.py MEGATRON_LM_CHECKOUT [SEED] [CASES] > cases.json

Reads Megatron-LM's layout functions (`pad_*` from optimizer/param_layout.py,
`DistributedOptimizer._compute_per_buffer_param_layout` and `_build_model_gbuf_param_range_map`,
`group_params_for_buffers` and `_compute_default_per_buffer_param_layout`) out of the
checkout's git HEAD, runs them with stand-ins for torch's parameters on random parameter lists,
and prints each case's input and Megatron's layout in `megatron layout --json`'s format.
tests/data/megatron_layout_cases.json was made with Megatron-LM d98e8a64dd, seed 7, 150 cases.
"""
import ast, json, math, random, sys, types
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

ROOT = sys.argv[1]
import subprocess
def src(path):
    return subprocess.check_output(['git', '-C', ROOT, 'show', 'HEAD:' + path]).decode()

def extract(code, names, cls=None):
    tree = ast.parse(code)
    out = []
    nodes = tree.body
    if cls:
        nodes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls][0].body
    for n in nodes:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names:
            n.decorator_list = []
            out.append(ast.unparse(n))
    return '\n\n'.join(out)

torch = types.SimpleNamespace(dtype=object, nn=types.SimpleNamespace(Parameter=object), float='fp32')
ns = {'math': math, 'torch': torch, 'Dict': Dict, 'List': List, 'Optional': Optional, 'Tuple': Tuple,
      'dataclass': dataclass, 'field': field}
pl = src('megatron/core/optimizer/param_layout.py')
exec(extract(pl, ['pad_to_divisor', 'pad_param_start', 'bucket_end_divisor', 'pad_bucket_end']), ns)
# dataclasses: simple stand-ins
@dataclass(frozen=True)
class BufferKey:
    param_dtype: object
    grad_dtype: object
    is_expert_parallel: bool
    is_managed_by_layer_wise_optimizer: bool = False
@dataclass
class PerBufferParamLayout:
    param_index_map: dict = field(default_factory=dict)
    bucket_indices: list = field(default_factory=list)
    per_bucket_numel_unpadded: list = field(default_factory=list)
    param_indices: list = field(default_factory=list)
    num_optimizer_shards: object = None
ns['PerBufferParamLayout'] = PerBufferParamLayout
fake_pl_mod = types.ModuleType('param_layout'); fake_pl_mod.BufferKey = BufferKey; fake_pl_mod.PerBufferParamLayout = PerBufferParamLayout
do = src('megatron/core/optimizer/distrib_optimizer.py')
exec(extract(do, ['Range'], None), ns)
exec(extract(do, ['_compute_per_buffer_param_layout', '_build_model_gbuf_param_range_map'], 'DistributedOptimizer'), ns)
pgb = src('megatron/core/distributed/param_and_grad_buffer.py')
code = extract(pgb, ['group_params_for_buffers', '_compute_default_per_buffer_param_layout'])
code = code.replace('from ..optimizer.param_layout import BufferKey', '').replace('from ..optimizer.param_layout import PerBufferParamLayout', '')
ns['BufferKey'] = BufferKey
ns['_param_uses_quantized_storage'] = lambda p: False
exec(code, ns)

class P:
    def __init__(self, name, numel, dtype, shared, allreduce):
        self.name = name; self.numel = numel; self.dtype = dtype; self.requires_grad = True
        if shared: self.shared_embedding = True
        if not allreduce: self.allreduce = False
        self.data = types.SimpleNamespace(nelement=lambda: numel)
    def __hash__(self): return id(self)

def megatron_layout(case):
    params = [P(p['name'], math.prod(p['shape']), p.get('dtype', 'fp32'), p.get('shared_embedding', False), p.get('allreduce', True)) for p in case['params']]
    ddp = types.SimpleNamespace(pad_buckets_for_high_nccl_busbw=case['pad'], grad_reduce_in_fp32=case['fp32grad'])
    groups = ns['group_params_for_buffers'](params, case['fp32grad'])
    out = []
    for key, (gp, idx) in groups.items():
        dp = case['edp'] if key.is_expert_parallel else case['dp']
        if case['distopt']:
            lay = ns['_compute_per_buffer_param_layout'](gp, case['bucket'], dp, ddp, idx)
        else:
            lay = ns['_compute_default_per_buffer_param_layout'](gp, case['bucket'])
        pim = [{'param_index': params.index(p), 'name': p.name, 'numel': e - s, 'start': s, 'end': e, 'bucket_id': b}
               for p, (s, e, b) in lay.param_index_map.items()]
        per_rank = []
        if case['distopt']:
            for r in range(dp):
                buckets = []
                for bi, (bs, be) in enumerate(lay.bucket_indices):
                    size = be - bs
                    assert size % dp == 0
                    m = size // dp
                    world = ns['Range'](bs + r * m, min(size, r * m + m) + bs)
                    rmap = ns['_build_model_gbuf_param_range_map'](None, lay.param_index_map, world, bs)
                    buckets.append({'bucket': bi, 'shard_world_range': [world.start, world.end],
                                    'params': [{'param_index': params.index(p), 'gbuf_world': [v['gbuf_world'].start, v['gbuf_world'].end],
                                                'gbuf_local': [v['gbuf_local'].start, v['gbuf_local'].end], 'param': [v['param'].start, v['param'].end]}
                                               for p, v in rmap.items()]})
                per_rank.append({'dp_rank': r, 'buckets': buckets})
        out.append({'param_dtype': key.param_dtype, 'grad_dtype': key.grad_dtype, 'is_expert_parallel': key.is_expert_parallel,
                    'num_shards': lay.num_optimizer_shards, 'numel': lay.bucket_indices[-1][1],
                    'numel_unpadded': sum(lay.per_bucket_numel_unpadded), 'param_index_map': pim,
                    'bucket_indices': [list(b) for b in lay.bucket_indices], 'per_rank': per_rank})
    return {'buffers': out}

rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 7)
cases = []
dps = [1, 2, 3, 4, 5, 8, 16]
for n in range(int(sys.argv[3]) if len(sys.argv) > 3 else 150):
    k = rng.randint(1, 9)
    params = []
    mixed = rng.random() < 0.3
    experts = rng.random() < 0.25
    for i in range(k):
        shape = [rng.choice([1, 3, 7, 16, 64, 100, 130, 257, 1000, 4097])] + ([rng.choice([1, 2, 5, 8])] if rng.random() < 0.5 else [])
        p = {'name': f'p{i}', 'shape': shape}
        if mixed: p['dtype'] = rng.choice(['fp32', 'bf16', 'fp16'])
        if experts and rng.random() < 0.5: p['allreduce'] = False
        params.append(p)
    tie = rng.random()
    if tie < 0.2: params[0]['shared_embedding'] = True
    elif tie < 0.35: params[-1]['shared_embedding'] = True
    elif tie < 0.4 and k > 2: params[k // 2]['shared_embedding'] = True
    dp = rng.choice(dps)
    case = {'params': params, 'dp': dp, 'edp': rng.choice(dps) if experts else dp,
            'bucket': rng.choice([None, None, 1, 50, 500, 3000, 40000]),
            'pad': rng.random() < 0.1, 'fp32grad': rng.random() < 0.2, 'distopt': rng.random() < 0.85}
    case['expected'] = megatron_layout(case)
    cases.append(case)
json.dump(cases, sys.stdout, separators=(',', ':'))
