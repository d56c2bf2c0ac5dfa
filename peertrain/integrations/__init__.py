"""Train in a swarm from a framework's own loop, unchanged but for a few lines.

  - `peertrain.integrations.hf`: a Hugging Face `Trainer` (and so Accelerate underneath it);
  - `peertrain.integrations.lightning`: a PyTorch Lightning `Trainer`.

Both are thin adapters over `followed.FollowedTraining`, which needs no framework: the framework keeps its
optimizer and steps it, and our gossip runs from that optimizer's own step hooks (WrappingOptimizer.follow).
A script that owns its loop (plain torch, Accelerate, torchrun) needs none of this: it wraps its optimizer in
`peertrain.GossipOptimizer` or `peertrain.LocalStepsOptimizer` (an `AcceleratedOptimizer` may wrap either).
Each framework module imports its framework, which is not a dependency of peertrain: install it yourself.
"""
