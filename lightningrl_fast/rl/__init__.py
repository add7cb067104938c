"""The LightningRL training stages: advantages, log-probs, loss, SFT warm-up and the train step."""
