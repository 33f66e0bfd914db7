"""The seeds' MindSpeed-LLM configs load: Megatron-only keys are mapped or named in one warning, misspelt keys are
errors with a suggestion, and options that only make sense together are checked at load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlhf import preflight
from rlhf.config import ConfigError, apply_overrides, config_warning, load_config, parse_config
from services.devices import rollout_replicas

SEEDS = Path(__file__).parents[1] / "seed_configs"


def test_seed_000_ppo_snippet_loads_with_its_save_folders():
    cfg = load_config(SEEDS / "ppo_trainer_llama32_1b.yaml")
    assert cfg.training.stage == "ray_ppo"
    assert cfg.actor.save == "./model_weights/llama32-mcore-save/"
    assert cfg.critic.save == "./model_weights/llama32-mcore-orm-save/"
    assert cfg.critic.load == cfg.reward.load == "./model_weights/llama32-mcore-orm/"
    assert cfg.reward.scorers[0].load == "./model_weights/llama32-mcore-orm/"
    assert config_warning(cfg) is None  # nothing in it is Megatron-only


SEED_004 = SEEDS / "ray_online_dpo_full_llama32_1b_tp1pp1.yaml"
SEED_004_DATA_PATH = "/data/ppo/llama32-ppo-trl/alpaca"  # its actor_rollout.data_path


def test_seed_004_as_printed_reads_its_actor_data_path_as_the_data_and_says_so():
    cfg = load_config(SEED_004)  # unchanged: the data is named only as MindSpeed names it
    assert cfg.data.path == SEED_004_DATA_PATH
    warning = config_warning(cfg)
    assert warning.startswith("MindSpeed-LLM keys read as this system's fields:")
    line = next(m for m in cfg.mapped_notes if m.startswith("actor_rollout_ref.actor_rollout.data_path: "))
    assert SEED_004_DATA_PATH in line and "data.path" in line and line in warning
    assert not any("data_path" in n for n in cfg.notes)  # read, not "not applicable"
    # the same value under data.path too: one source; another value: an error naming both keys
    assert load_config(SEED_004, [f"data.path={SEED_004_DATA_PATH}"]).data.path == SEED_004_DATA_PATH
    with pytest.raises(ConfigError) as err:
        load_config(SEED_004, ["data.path=prompts.jsonl"])
    assert "actor_rollout_ref.actor_rollout.data_path" in str(err.value) and "data.path" in str(err.value)
    # MindSpeed merges training into the actor's section: training.data_path is the actor's too, the actor's wins
    both = {"training": {"data_path": "a"}, "actor_rollout_ref": {"actor_rollout": {"data_path": "b"}}}
    assert parse_config({"training": {"data_path": "a"}}).data.path == "a"
    assert parse_config(both).data.path == "b"
    empty_data = {"data": None, "actor_rollout_ref": {"actor_rollout": {"data_path": "b"}}}  # ``data:`` left empty
    assert parse_config(empty_data).data.path == "b"
    # a role that reads no prompts: noted with its reason, not read
    ref = parse_config({"actor_rollout_ref": {"ref": {"data_path": "c"}}})
    assert ref.data.path == "builtin:arithmetic"
    assert any(n.startswith("actor_rollout_ref.ref.data_path: only the actor reads") for n in ref.notes)


def test_seed_004_online_dpo_test_config_loads_mapped_and_warned():
    cfg = load_config(SEED_004)
    a = cfg.actor
    # mapped to this project's fields
    assert cfg.training.stage == "ray_online_dpo" and cfg.training.no_load_optim and cfg.training.no_load_rng
    assert (a.lr, a.clip_grad, a.lr_decay_style, a.min_lr, a.micro_batch_size) == (1e-7, 10000.0, "constant", 0.0, 4)
    assert (a.num_gpus_for_train, a.num_gpus_for_infer, a.tensor_model_parallel_size) == (1, 1, 1)
    assert cfg.algorithm.missing_eos_penalty == 1.0
    assert cfg.data.shuffle is False  # actor_rollout.shuffle: false / no_shuffle: true
    assert cfg.reward.micro_batch_size == 8 and cfg.actor_rollout_ref.ref.micro_batch_size == 4
    # one warning, one line per key that does not apply, each with its reason
    warning = config_warning(cfg)
    lines = [line for line in warning.splitlines() if line.startswith("  ")]  # under the two headers
    for key in (
        "defaults",
        "training.distributed_backend",
        "reward.sequence_parallel",
        "actor_rollout_ref.actor_rollout.use_kv_cache",
        "actor_rollout_ref.actor_rollout.num_samples_per_step",
        "actor_rollout_ref.ref.tensor_model_parallel_size",
        "actor_rollout_ref.actor_rollout.clip_ratio",
        "algorithm.kl_ctrl",
    ):
        assert any(line.strip().startswith(f"{key}: ") for line in lines), key
    assert all(": " in line and len(line.split(": ", 1)[1]) > 20 for line in lines)
    # mapped keys are not in the warning
    assert not any("missing_eos_penalty" in line or "clip_grad" in line or "no_load_optim" in line for line in lines)


def test_a_misspelt_key_is_an_error_that_suggests_the_closest():
    with pytest.raises(ConfigError) as err:
        parse_config({"actor_rollout_ref": {"actor_rollout": {"ppo_mini_bach_size": 4}}})
    assert "actor_rollout_ref.actor_rollout.ppo_mini_bach_size" in str(err.value)
    assert "did you mean 'ppo_mini_batch_size'?" in str(err.value)
    with pytest.raises(ConfigError, match="did you mean 'kl_coef'"):
        parse_config({"algorithm": {"kl_ctrl": {"kl_coeff": 0.1}}})
    with pytest.raises(ConfigError, match="unknown key"):
        parse_config({"training": {"completely_unrelated": 1}})


@pytest.mark.parametrize(
    ("data", "key", "message"),
    [
        ({"critic": {"lora_r": 8}}, "critic.lora_r", "the critic with LoRA is not built.*actor_rollout.lora_r"),
        ({"critic": {"lora_alpha": 16}}, "critic.lora_alpha", "remove the key.*smaller critic.load"),
        (
            {"actor_rollout_ref": {"actor_rollout": {"load_in_8bit": True}}},
            "actor_rollout_ref.actor_rollout.load_in_8bit",
            r"not built for this model: only the trainer's actor loads in 4 bits \(actor_rollout.load_in_4bit",
        ),
        ({"critic": {"load_in_4bit": True}}, "critic.load_in_4bit", "QLoRA"),
        ({"training": {"bnb_4bit_quant_type": "nf4"}}, "training.bnb_4bit_quant_type", "QLoRA"),
        (
            {"actor_rollout_ref": {"actor_rollout": {"reward_adapter": "./reward_model"}}},
            "actor_rollout_ref.actor_rollout.reward_adapter",
            "not built: TRL's reward_adapter .* reward.scorers with type model",
        ),
        ({"reward": {"reward_adapter": "./rm"}}, "reward.reward_adapter", "not built: TRL's reward_adapter"),
    ],
)
def test_seed_001_keys_that_are_not_built_are_refused_with_what_to_use(data, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_config(data)
    assert f"{key}: " in str(err.value) and "unknown key" not in str(err.value)


def test_a_mini_batch_key_is_never_offered_for_a_micro_batch_key():
    # mini-batch: samples per optimizer step; micro-batch: samples per forward/backward (accumulated)
    with pytest.raises(ConfigError) as err:
        parse_config({"critic": {"critic_micro_batch_size": 2}})
    assert "did you mean 'micro_batch_size'?" in str(err.value) and "critic_mini_batch_size" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_config({"reward": {"mini_batch_size": 2}})
    assert "reward.mini_batch_size: unknown key" in str(err.value) and "did you mean" not in str(err.value)


def test_training_micro_batch_size_is_every_roles_default():
    cfg = parse_config({"training": {"micro_batch_size": 4}, "reward": {"micro_batch_size": 8}})
    assert (cfg.actor.micro_batch_size, cfg.critic.micro_batch_size) == (4, 4)
    assert (cfg.actor_rollout_ref.ref.micro_batch_size, cfg.reward.micro_batch_size) == (4, 8)  # a role's own wins
    # inherited into a minibatch smaller than it: one pass over the minibatch, not an error (ppo_mini_batch_size 1)
    assert cfg.actor.ppo_mini_batch_size == 1 and cfg.critic.critic_mini_batch_size == 1
    plain = parse_config({})
    assert (plain.actor.micro_batch_size, plain.critic.micro_batch_size, plain.reward.micro_batch_size) == (
        None,
        None,
        16,
    )
    # under a critic-free stage an inherited critic value is not "set by the user": no "not read" note for it
    grpo = parse_config(
        {
            "training": {"stage": "ray_grpo", "micro_batch_size": 2},
            "actor_rollout_ref": {"actor_rollout": {"n_samples_per_prompt": 2, "ppo_mini_batch_size": 4}},
        }
    )
    assert grpo.actor.micro_batch_size == 2 and config_warning(grpo) is None


def test_a_mindspeed_style_config_that_leaves_out_do_sample_is_told_the_default_differs():
    seed_style = {"defaults": ["model: llama32-1b"], "training": {"stage": "ray_ppo"}, "resource_pool": {"ref": [1]}}
    cfg = parse_config(seed_style)
    assert cfg.actor.do_sample is True
    warning = config_warning(cfg)
    assert "defaults that differ from MindSpeed-LLM's" in warning
    assert "actor_rollout_ref.actor_rollout.do_sample is not set" in warning and "false in MindSpeed-LLM" in warning
    chosen = {**seed_style, "actor_rollout_ref": {"actor_rollout": {"do_sample": False}}}
    assert "do_sample" not in config_warning(parse_config(chosen))
    assert config_warning(parse_config({"training": {"stage": "ray_ppo"}})) is None  # not a MindSpeed config


def test_hydra_style_overrides_are_applied_and_validated_like_the_file(tmp_path):
    path = tmp_path / "ppo.yaml"
    path.write_text(
        "training:\n  train_iters: 50\ncritic:\nreward:\n  scorers:\n    - {type: rule, name: char_fraction}\n"
    )
    cfg = load_config(
        path,
        [
            "training.train_iters=5",
            "actor_rollout_ref.actor_rollout.do_sample=false",  # YAML values: a bool, a float, a list, null
            "critic.lr=9e-6",
            "+resource_pool.ref=[0]",
            "reward.scorers.0.weight=2",
            "training.load=null",
        ],
    )
    assert (cfg.training.train_iters, cfg.actor.do_sample, cfg.critic.lr) == (5, False, 9e-6)
    assert cfg.resource_pool.ref == [0] and cfg.reward.scorers[0].weight == 2.0
    assert apply_overrides({"critic": {"lr": 1.0, "save": "x"}}, ["~critic.save"]) == {"critic": {"lr": 1.0}}
    for override, message in (
        ("training.no_such_key=1", "training.no_such_key: unknown key"),
        ("trainng.lr=1e-6", "did you mean 'training'"),
        ("training.lr=fast", "training.lr: Input should be a valid number"),
        ("training.lr", "command-line override 'training.lr': expected KEY=VALUE"),
        ("training.lr=[1", "command-line override training.lr: the value '[1' is not valid YAML"),
        ("training.train_iters.x=1", "training.train_iters is a value, not a section"),
        ("reward.scorers.3.weight=1", "reward.scorers.3: a list of 1 here"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(path, [override])


def test_a_mapped_key_that_contradicts_its_target_is_an_error():
    with pytest.raises(ConfigError, match="contradicts algorithm.missing_eos_penalty"):
        parse_config(
            {
                "actor_rollout_ref": {"actor_rollout": {"missing_eos_penalty": 1.0}},
                "algorithm": {"missing_eos_penalty": 0.5},
            }
        )
    with pytest.raises(ConfigError, match="only PretrainedFromHF"):
        parse_config({"training": {"tokenizer_type": "Llama2Tokenizer"}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"training": {"stage": "ray_online_dpo"}, "actor_rollout_ref": {"actor_rollout": {"do_sample": False}}},
            "set do_sample: true",
        ),
        ({"training": {"stage": "ray_grpo"}}, "set 2 or more"),
        ({"training": {"lr": 1e-6, "min_lr": 1e-5}}, "lower min_lr"),
        (
            {"actor_rollout_ref": {"actor_rollout": {"ppo_mini_batch_size": 4, "micro_batch_size": 8}}},
            "larger than ppo_mini_batch_size",
        ),
        (
            {
                "training": {"stage": "ray_grpo"},
                "actor_rollout_ref": {"actor_rollout": {"n_samples_per_prompt": 4, "freezing_actor_steps": 2}},
            },
            "only ray_ppo has a critic",
        ),
        (
            {"training": {"train_iters": 5}, "actor_rollout_ref": {"actor_rollout": {"freezing_actor_steps": 5}}},
            "would never train",
        ),
        ({"actor_rollout_ref": {"actor_rollout": {"ptx_coef": 0.5}}}, "needs data.pretrain_data"),
        ({"data": {"pretrain_data": "x.jsonl"}}, "set actor_rollout.ptx_coef"),
        ({"algorithm": {"reward_clip_range": [3, -3]}}, "low < high"),
        (
            {
                "training": {"stage": "ray_rloo"},
                "actor_rollout_ref": {"actor_rollout": {"n_samples_per_prompt": 2}},
                "algorithm": {"kl_penalty": "full"},
            },
            "built for ray_ppo only",
        ),
        (
            {"actor_rollout_ref": {"actor_rollout": {"num_gpus_for_infer": 3, "tensor_model_parallel_size": 2}}},
            "not a multiple",
        ),
        (
            {
                "actor_rollout_ref": {"actor_rollout": {"num_gpus_for_train": 1, "num_gpus_for_infer": 2}},
                "resource_pool": {"actor_rollout": [2]},
            },
            "is not num_gpus_for_train",
        ),
        ({"resource_pool": {"reward": [1, 1]}}, "runs on one machine"),
        ({"actor_rollout_ref": {"actor_rollout": {"lora_dropout": 0.05}}}, "lora_dropout .* only with lora_r > 0"),
        ({"actor_rollout_ref": {"actor_rollout": {"lora_alpha": 32}}}, "only with lora_r > 0"),
        ({"training": {"weight_sync_interval": 3, "max_staleness": 1}}, "set max_staleness >= 2"),
        (
            {"critic": {"critic_mini_batch_size": 2, "micro_batch_size": 4}},
            "critic.micro_batch_size 4 is larger than critic_mini_batch_size 2",
        ),
        ({"training": {"lr": 1e-5, "min_lr": 1e-6}, "critic": {"lr": 1e-7}}, "set critic.min_lr"),
        (
            {"algorithm": {"normalize_reward": True, "reward_norm_stats": [0.0, 1.0]}},
            "algorithm.normalize_reward .* and algorithm.reward_norm_stats .* keep one of them",
        ),
        ({"algorithm": {"reward_norm_stats": [0.0, -1.0]}}, r"must be \[mean, std\] with std > 0"),
        (
            {
                "algorithm": {"reward_norm_stats": "reward_model"},
                "reward": {"scorers": [{"type": "rule", "name": "x"}]},
            },
            "not one model scorer of weight 1; give the combined score's statistics as",
        ),
        ({"algorithm": {"reward_baseline": "leave_one_out"}}, "n_samples_per_prompt is 1: set it to 2 or more"),
        (
            {
                "training": {"stage": "ray_grpo"},
                "actor_rollout_ref": {"actor_rollout": {"n_samples_per_prompt": 4}},
                "algorithm": {"reward_baseline": "group_mean"},
            },
            r"algorithm.reward_baseline is not used by training.stage ray_grpo \(only by ray_ppo\)",
        ),
        (
            {"resource_pool": {"critic": [4]}},
            r"resource_pool.critic \[4\]: the critic runs whole on one device",
        ),
        (
            {"resource_pool": {"critic": [1]}, "critic": {"shared_backbone": True}},
            r"resource_pool.critic \[1\] with critic.shared_backbone",
        ),
        ({"reward": {"seq_length": 100}}, r"reward.seq_length 100 is shorter than the samples it receives"),
        (
            {"training": {"seq_length": 64}, "critic": {"seq_length": 60}},
            r"critic.seq_length 60 is shorter than the samples it receives \(max_prompt_length 512",
        ),
        (
            {"training": {"no_load_rng": True}, "critic": {"no_load_rng": False}},
            "critic.no_load_rng False and actor_rollout.no_load_rng True differ",
        ),
        (
            {
                "actor_rollout_ref": {
                    "actor_rollout": {"tensor_model_parallel_size": 2, "inference_tensor_model_parallel_size": 4}
                }
            },
            r"inference_tensor_model_parallel_size \(4\) contradicts actor_rollout_ref.actor_rollout."
            r"tensor_model_parallel_size \(2\)",
        ),
        (
            {"actor_rollout_ref": {"actor_rollout": {"no_shuffle": True, "shuffle": True}}},
            "actor_rollout.shuffle and actor_rollout_ref.actor_rollout.no_shuffle contradict",
        ),
        (
            {"training": {"no_shuffle": True}, "data": {"shuffle": True}},
            r"training.no_shuffle \(False\) contradicts data.shuffle \(True\)",
        ),
    ],
)
def test_options_that_only_make_sense_together_are_checked_at_load(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_rlhf_up_prints_the_not_applicable_keys_once_before_starting():
    report = preflight.check(load_config(SEED_004))
    mine = [w for w in report.warnings if "config keys accepted but not applicable here" in w]
    assert len(mine) == 1 and "training.distributed_backend" in mine[0]


# Written with exactly the keys of MindSpeed-LLM's configs/rlxf/ppo_trainer_llama32_1b.yaml and
# online_dpo_trainer_llama32_1b.yaml (read at the last commit that had them, 7e6e3cca^), with tiny values of our own
MINDSPEED_PPO = SEEDS / "mindspeed_ppo_trainer_keys.yaml"
MINDSPEED_DPO = SEEDS / "mindspeed_online_dpo_trainer_keys.yaml"


def test_configs_with_mindspeed_llms_trainer_key_sets_load_without_edits():
    ppo = load_config(MINDSPEED_PPO)
    assert ppo.training.stage == "ray_ppo" and ppo.data.path == "prompts/tiny"
    assert ppo.data.shuffle is False  # training.no_shuffle: true
    assert ppo.resource_pool.critic == [1]  # the critic's own device
    c, a = ppo.critic, ppo.actor
    assert (c.no_load_optim, c.no_load_rng, a.no_load_optim, a.no_load_rng) == (True, True, True, True)
    assert (a.seq_length, c.seq_length, ppo.reward.seq_length, ppo.max_new_tokens) == (40, None, None, 24)
    assert (a.bf16, c.bf16) == (False, False)
    assert (c.lr, c.clip_grad, c.cliprange_value, c.critic_update_epochs) == (2e-4, 2.0, 0.3, 2)
    dpo = load_config(MINDSPEED_DPO)
    assert dpo.training.stage == "ray_online_dpo" and dpo.data.path == "prompts/tiny" and dpo.data.shuffle is True
    assert dpo.actor.tensor_model_parallel_size == 1 and dpo.algorithm.missing_eos_penalty == 0.5
    for cfg in (ppo, dpo):
        assert any(m.startswith("actor_rollout_ref.actor_rollout.data_path: prompts/tiny") for m in cfg.mapped_notes)


def test_training_no_shuffle_is_the_data_order_and_the_actors_own_key_wins():
    assert parse_config({}).data.shuffle is True
    assert parse_config({"training": {"no_shuffle": True}}).data.shuffle is False
    assert parse_config({"training": {"no_shuffle": False}}).data.shuffle is True
    # MindSpeed merges training into the actor's section, the actor's value winning
    mixed = {"training": {"no_shuffle": True}, "actor_rollout_ref": {"actor_rollout": {"no_shuffle": False}}}
    assert parse_config(mixed).data.shuffle is True
    # a role that reads no prompts: noted with the reason
    cfg = parse_config({"critic": {"no_shuffle": True}})
    assert cfg.data.shuffle is True and any(n.startswith("critic.no_shuffle: only the actor reads") for n in cfg.notes)


def test_inference_tensor_model_parallel_size_is_the_rollout_engines_tensor_parallelism():
    cfg = parse_config(
        {"actor_rollout_ref": {"actor_rollout": {"inference_tensor_model_parallel_size": 2, "num_gpus_for_infer": 4}}}
    )
    assert cfg.actor.tensor_model_parallel_size == 2

    assert rollout_replicas(cfg, None) == 2  # 4 inference devices / TP 2


def test_per_role_no_load_bf16_and_seq_length_default_to_the_training_sections():
    cfg = parse_config({"training": {"no_load_optim": True, "bf16": True, "seq_length": 600}})
    a, c, ref, rw = cfg.actor, cfg.critic, cfg.actor_rollout_ref.ref, cfg.reward
    assert (a.no_load_optim, c.no_load_optim, a.no_load_rng, c.no_load_rng) == (True, True, False, False)
    assert (a.bf16, c.bf16, ref.bf16, rw.bf16) == (True, True, True, True)
    assert (a.seq_length, c.seq_length, ref.seq_length, rw.seq_length) == (600, None, None, None)
    own = parse_config(
        {
            "training": {"seq_length": 600, "bf16": True},
            "actor_rollout_ref": {"actor_rollout": {"seq_length": 520, "bf16": False}, "ref": {"bf16": False}},
            "critic": {"no_load_optim": True},
        }
    )
    assert own.max_new_tokens == 8  # the actor's seq_length 520 - max_prompt_length 512
    assert (own.actor.bf16, own.actor_rollout_ref.ref.bf16, own.critic.bf16) == (False, False, True)
    assert (own.actor.no_load_optim, own.critic.no_load_optim) == (False, True)
    # ref and reward keep no optimizer or generator state: MindSpeed's keys there are noted with the reason
    noted = parse_config({"reward": {"no_load_optim": True}, "actor_rollout_ref": {"ref": {"no_load_rng": True}}})
    assert any(n.startswith("reward.no_load_optim: reward has no optimizer") for n in noted.notes)
    assert any(n.startswith("actor_rollout_ref.ref.no_load_rng: ref keeps no random state") for n in noted.notes)
