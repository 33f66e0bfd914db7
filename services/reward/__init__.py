"""Reward service: model, rule and remote scorers combined by weight (gRPC Score, REST /v1/score, /get_reward)."""
