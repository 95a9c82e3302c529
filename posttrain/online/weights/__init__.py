"""How the policy's weights reach the generators, version by version.

- shared_memory.py `SharedWeights`: a few slots in shared memory on one machine, each one version of every
  parameter in one flat buffer per dtype; the trainer publishes a version into a free slot, a generation process
  points its parameters at a slot's views (no copy). `shared_bytes` sizes them.

A transport to other machines (e.g. a gloo group per trainer-generator pair) sends the same flat per-dtype buffers
with their version, and lives beside it in this package.
"""

from posttrain.online.weights.shared_memory import GenerationProcessDied, SharedWeights, shared_bytes

__all__ = ["GenerationProcessDied", "SharedWeights", "shared_bytes"]
