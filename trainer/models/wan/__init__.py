"""The Wan2.1/2.2 transformer (diffusers' WanTransformer3DModel layout): family (torch-free), module."""
