"""Generated protobuf and gRPC code for package ``rlhf.v1``. Do not edit: run ``make proto``."""
