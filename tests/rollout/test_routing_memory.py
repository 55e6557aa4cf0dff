"""The memory plans count the routing record of rollout routing replay (algo.routing_replay=
"rollout", a mixture-of-experts model): the rollout pool's prefix_route / res_route
(rollout/routing.py init_route) and the update batch's UpdateBatch.routing, checked against the
arrays the engine allocates and a hand count (L x K ids a token, int8 up to 128 experts)."""
import sys
import types
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from testutil import tiny_model_config  # noqa: E402

from brorl_jax.algo import update  # noqa: E402
from brorl_jax.config import ConfigError, default_config, validate  # noqa: E402
from brorl_jax.models.hf import param_shapes  # noqa: E402
from brorl_jax.models.moe import routing_record_bytes  # noqa: E402
from brorl_jax.rollout import Engine, plan as rollout_plan  # noqa: E402
from brorl_jax.rollout.routing import init_route  # noqa: E402
from brorl_jax.train import door  # noqa: E402

MOE = dict(model_type="qwen3_moe", attention_bias=False, qk_norm=True, num_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


def test_the_rollout_plan_counts_the_pools_routing_record():
    cfg = tiny_model_config(**MOE)                      # 2 layers, top-2 of 8: int8
    p, n, s, prompts = 16, 3, 10, 4
    on, off = (rollout_plan.plan_slots(cfg, prompts, p, n, s, None, record_routing=r)
               for r in (True, False))
    assert (on.slots, on.pool) == (off.slots, off.pool)
    l, k = cfg.num_hidden_layers, cfg.num_experts_per_tok
    hand = on.pool * p * l * k + (on.pool + 1) * n * s * l * k      # prompts', samples' + spare
    spec = types.SimpleNamespace(cfg=cfg, record_routing=True, pool=on.pool, prompt_len=p,
                                 share=on.share, max_new_tokens=s)
    allocated = sum(x.size * x.dtype.itemsize
                    for x in jax.eval_shape(lambda: init_route(spec)).values())
    assert on.bytes_per_device - off.bytes_per_device == hand == allocated
    assert Engine(cfg, record_routing=True).plan(prompts, p, n, s) == on     # the engine's own
    # an open stream's larger pool holds it too; a dense model records nothing
    grown = [rollout_plan.stream_plan(cfg, x, p, s, x is on) for x in (on, off)]
    more = grown[0].pool - on.pool
    assert grown[0].bytes_per_device - grown[1].bytes_per_device == hand + more * (p + n * s) * l * k
    dense = tiny_model_config()
    assert rollout_plan.plan_slots(dense, prompts, p, n, s, None, record_routing=True) == \
        rollout_plan.plan_slots(dense, prompts, p, n, s, None)
    # past 128 experts the ids take int16
    assert routing_record_bytes(tiny_model_config(**dict(MOE, num_experts=130)), 5) == 5 * l * k * 2


def test_the_door_counts_the_update_batchs_routing_record():
    cfg = tiny_model_config(**MOE)
    c = default_config()
    c.model.remat, c.algo.micro_batch_size = True, 4
    c.algo.prompts_per_step, c.rollout.rollouts_per_prompt = 2, 4
    off = validate(c)
    c.algo.routing_replay = "rollout"
    on = validate(c)
    rows, width = on.update_rows, on.seq_len
    n_params = sum(int(x.size) for x in jax.tree.leaves(param_shapes(cfg)))
    alone = (update.train_state_bytes(cfg, n_params)
             + update.remat_saved_bytes(cfg, 4 * width, "full"))
    record = rows * width * cfg.num_hidden_layers * cfg.num_experts_per_tok       # int8
    assert door._update_micro_batch(off, cfg, alone, n_params) == []
    refused = door._update_micro_batch(on, cfg, alone, n_params)
    assert len(refused) == 1 and "GB of the batch's recorded routing" in refused[0]
    assert door._update_micro_batch(on, cfg, alone + record, n_params) == []
    assert door._update_micro_batch(on, cfg, alone + record - 1, n_params) != []
    with pytest.raises(ConfigError, match="recorded routing"):
        door.check_memory_plan(on, cfg, num_devices=1, device_bytes=alone + record - 1)
