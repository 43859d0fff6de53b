"""Training objectives, one module per stage: fm (pretrain, SFT), tf_anyflow (Stage1), dmd_sgf
(Stage2, with rollout.py). They compute losses and updates, and each builds itself; what each
declares (trainer.stages.declarations, torch-free) is how the rest of relay finds and checks
it (trainer.stages.registry); trainer.run_state saves and restores them."""
