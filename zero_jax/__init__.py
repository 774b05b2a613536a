r"""zero_jax: ZeRO stages 0-3 as partition specs and explicit collectives on a JAX mesh.

The public API, in the order a training loop uses it::

    mesh = make_mesh()                               # all devices on the "data" axis
    plan = make_plan(params_shape, mesh, stage=3, layers=r"h/\d+",  # the blocks, by path
                     rules=[Rule("embed", shard=False)],        # a placement table over paths
                     precision=Precision("bf16"), offload=Offload(optimizer=1.0), comm=Comm())
    state = init_state(plan, init_params, tx, key)   # born sharded
    # or from pretrained safetensors, read into the shards: init_state(plan, params, tx)
    params = load_params(plan, "model.safetensors", mapping)
    save_safetensors(state.params, "out", mapping)   # each process writes its own shards
    step = make_train_step(plan, loss_fn, tx)        # jitted, state donated
    state, metrics = step(state, batch)
    evaluate = make_eval_step(plan, loss_fn)         # a held-out batch's loss, no update
    ckpts = Checkpoints(directory); ckpts.save(state, meta); ckpts.restore(abstract_state(...))
"""

from zero_jax.blocks import Layers, nnx_merge, remat_policy
from zero_jax.buckets import Comm
from zero_jax.checkpoint import Checkpoints
from zero_jax.embedding import take_rows
from zero_jax.grads import Weighted, batch_sum, device_key, make_grad_fn
from zero_jax.losses import cross_entropy, mean_cross_entropy
from zero_jax.mesh import keep_remat_barriers, make_mesh, simulate_cpu_devices
from zero_jax.offload import Nvme, Offload
from zero_jax.partitioning import tensor_parallel_rules
from zero_jax.plan import STAGES, Plan, Rule, make_plan, modules_pattern
from zero_jax.precision import Precision
from zero_jax.safetensors_writer import save_safetensors
from zero_jax.state import TrainState, abstract_state, init_state, state_shardings, state_specs
from zero_jax.step import TrainStep, make_eval_step, make_train_step
from zero_jax.weights import load_params

keep_remat_barriers()  # before jax starts its backend, if it has not yet

__all__ = ["STAGES", "Checkpoints", "Comm", "Layers", "Nvme", "Offload", "Plan", "Precision",
           "Rule", "TrainState", "TrainStep", "Weighted", "abstract_state", "batch_sum",
           "cross_entropy", "device_key", "init_state", "load_params", "make_eval_step",
           "make_grad_fn", "make_mesh", "make_plan", "make_train_step", "mean_cross_entropy",
           "modules_pattern", "nnx_merge", "remat_policy", "save_safetensors",
           "simulate_cpu_devices", "state_shardings", "state_specs", "take_rows",
           "tensor_parallel_rules"]
