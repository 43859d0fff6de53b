"""What relay's model families share: RoPE, the head RMSNorm, time features and inputs, the
compile settings, and the one causal mechanism (teacher forcing and the KV-cache rollout).
A family imports from here, never from another family; nothing here imports a family."""
