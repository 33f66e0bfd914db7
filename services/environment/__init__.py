"""Environment service: episodes of multi-turn tasks (gRPC Reset / Step / Close, REST /v1/episodes/*)."""
