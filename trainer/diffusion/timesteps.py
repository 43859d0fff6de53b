"""The timestep convention every model family shares (no torch here): the model sees raw
timesteps N * sigma in [0, N] (docs/algorithms.md, "Flow matching")."""

NUM_TRAIN_TIMESTEPS = 1000
