"""What a run is checked for before it starts, by subject (torch-free): its stage, its LoRA and
its memory. trainer.preflight runs them with the checks of paths, data and topology."""
