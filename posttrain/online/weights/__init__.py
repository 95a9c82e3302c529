"""How the policy's weights reach the generators, version by version.

- shared_memory.py `SharedWeights`: a few slots in shared memory on one machine, each one version of every
  parameter in one flat buffer per dtype; the trainer publishes a version into a free slot, a generation process
  points its parameters at a slot's views (no copy). `shared_bytes` sizes them.

- transport.py: the interface of a transport to other machines (`WeightSender`, `WeightReceiver`, a version on
  every push, `WeightSyncError`), the flat per-dtype layout both ends share, and the FSDP2 gather before a send;
  collective.py, its implementation (a process group per trainer-actor pair, gloo on CPU and NCCL between GPUs,
  used by producers/ray.py).
"""

from posttrain.online.weights.shared_memory import GenerationProcessDied, SharedWeights, shared_bytes

__all__ = ["GenerationProcessDied", "SharedWeights", "shared_bytes"]
