"""Training kernels the GRPO and scoring passes run under (tasks/core/grpo.py, passes.py, prefix.py): bf16
autocast (autocast.py), memory-lean recomputed activations (recompute.py), vocabulary-layer gradients added in
place (grad_into.py), and per-instance forward patches (forward_patch.py)."""
