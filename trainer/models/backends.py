"""Every `attention_backend` value, torch-free so the login node checks a config
(trainer.models.attention routes each form of attention to a kernel that computes it:
auto = the fastest one that runs here)."""

ATTENTION_BACKENDS = ("auto", "sdpa", "fa4", "flash_attn")
