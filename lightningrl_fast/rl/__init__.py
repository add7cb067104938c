"""The LightningRL training loop: train step, advantages, log-probs, SFT, optimizer, checkpoints, data parallel, logs."""
