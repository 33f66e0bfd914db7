"""bench.device_check: what must work on a CUDA machine, in one bounded run: one JSON file and a log.

Made for the lent H200 (docs/device-check.md): Python 3.12 with torch 2.11 and transformers 5.17 but no vLLM, no
pydantic, fastapi, uvicorn, redis-py or grpcio-health-checking, no redis-server and no registry. Those travel as
wheels and Debian packages in ``.whl/`` (``make device-bundle``); ``bash bench/device_check.sh OUTDIR`` installs them
under /tmp and runs this module from the tree (the project itself is not installed there: it would pull its own
torch). Nothing here needs an API newer than torch 2.11.

Phases, in order (each one runs in its own process with its own time limit; its figures, or its error, go in the
JSON; one failing does not stop the others; a phase that would start after the global deadline is skipped):

``model``       builds the policy (Llama with tied embeddings, as Llama-3.2-1B: ``rlhf.tiny``'s ``llama-tied``; about
                270M parameters on the GPU, the tiny shape with ``--cpu``) and a critic/reward model of that shape.
``trainer``     ``TrainerEngine`` PPO steps on the device with ``training.bf16`` (bf16 autocast over fp32 master
                weights and fp32 AdamW state; bf16 pushed): step seconds, tokens/s, peak memory.
``rollout``     the ``hf`` rollout engine on the device: sampled tokens/s with log-probs, greedy determinism, log-probs
                recomputed by a plain forward.
``push``        tcp, grpc and collective (gloo, and nccl on CUDA) pushes from this process, as the trainer, into a
                rollout replica in another process (rollout servicer over the ``hf`` engine on the device) of the tied
                model: each lands (served version and checksum, greedy tokens change) and the originals come back.
``checkpoint``  a trainer in a one-rank process group (FSDP2 sharding, as a torchrun trainer) steps, saves a
                checkpoint (``sharded/``: torch.distributed.checkpoint) and loads it into a one-rank group and into a
                plain world-1 trainer: every weight and AdamW moment must come back bit for bit.
``ring``        ``rlhf up`` of configs/demo.yaml on the device (``engine: hf``, every service on GPU 0: no
                resource_pool, the trainer in bf16), redis-server from PATH: the mean reward must rise.
``vllm``        vLLM's own throughput and weight-transfer checks (bare ``AsyncLLM`` vs ``VllmEngine``, vLLM's nccl /
                ipc transfer into ``vllm serve``, our collective push into ``VllmEngine``): only where ``import vllm``
                works; skipped on a host without it.

Usage: ``python -m bench.device_check [--cpu] [--only PHASE[,PHASE]] [--dry-run] [--out DIR] [--work DIR]
[--deadline-s S]``. ``--out`` gets ``device_check.json`` and ``device_check.log``; models, checkpoints and the ring
go under ``--work`` (default /tmp/rlhf-device-check). Exit status: 0 every phase run passed, 1 one failed, 2 no CUDA
device (without ``--cpu``), 3 none failed but the deadline cut one.

The package: ``__main__`` (the command line), ``driver`` (runs the phases, writes the JSON; the dry run), ``probe``
(the environment), ``worker`` (one phase in its process), ``common`` (the plan, :class:`~common.Record`), and one
module per phase, each with its ``run(plan, record)``. The push phase's replica is tests/support/replica.py.
"""
