"""The training service: the tinker SDK's HTTP API over LoRA adapters of one base model (docs/tinker.md)."""
