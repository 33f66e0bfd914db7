"""Reference service: per-token log-probs under the frozen reference policy (gRPC LogProbs, REST /v1/logprobs)."""
