"""How the policy's weights reach the generators, version by version.

- shared_memory.py `SharedWeights`: a few slots in shared memory on one machine, each one version of every
  parameter in one flat buffer per dtype; the trainer publishes a version into a free slot, a generation process
  points its parameters at a slot's views (no copy). `shared_bytes` sizes them.

- transport.py: the interface of a transport to other machines (`WeightSender`, `WeightReceiver`, a version on
  every push, `WeightSyncError`), and the flat per-dtype layout both ends share; gloo.py, its CPU implementation
  (a gloo group per trainer-actor pair, used by producers/ray.py).
"""

from posttrain.online.weights.shared_memory import GenerationProcessDied, SharedWeights, shared_bytes

__all__ = ["GenerationProcessDied", "SharedWeights", "shared_bytes"]
