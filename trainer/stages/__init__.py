"""Training objectives, one module per stage: fm (pretrain, SFT), tf_anyflow (Stage1), dmd_sgf
(Stage2, with rollout.py). They compute losses and updates; trainer.build constructs them and
trainer.checkpoint.run_state saves and restores them."""
