"""The transformers backend (backend.py: `TransformersBackend`) and its decoder: keyed sampling and the decode
batch (decoding.py), attention over a shared prompt (cascade.py), float32 decode attention over a bf16 cache
(decode_attention.py), prepacked linear layers (packed.py), and sequence states for prefix reuse (states.py)."""
