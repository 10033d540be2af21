"""Checkpoints that survive a change of plan, on top of orbax.

In: a training state (a pytree of sharded `jax.Array`s, as a plan placed it) and a path;
later, the path and the plan to continue under (a decorated step or a `Plan`). Out: the
state on disk (every process writes its own shards), and the state restored onto the new
plan's shardings, whatever its mesh shape, stage count or device count.

```python
autopar.checkpoint.save("ckpt/step_3", state)
state = autopar.checkpoint.restore("ckpt/step_3", like=new_train_step, target=state_shapes)
```
"""

from autopar.checkpoint._orbax import restore, save

__all__ = ["restore", "save"]
