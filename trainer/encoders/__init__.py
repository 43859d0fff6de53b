"""Between pixels/captions and what the model reads: the VAE and the text encoders."""
