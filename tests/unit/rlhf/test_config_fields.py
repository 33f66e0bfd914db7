"""Every experiment-config field has a test that shows its effect, or a documented mapping, and a row in the docs.

``FIELD_TESTS`` maps each field to the tests that fail if the field stops doing what it says (checked to exist), or
to ``MAPPED`` + the sentence saying where the field's value goes when a test of the target covers it, or (a known
gap, listed in KNOWN_UNTESTED) to ``UNTESTED`` + where the code reads it. A new field
without an entry fails here; so does an entry whose test was renamed away.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pydantic import BaseModel

from rlhf.config import ExperimentConfig

ROOT = Path(__file__).resolve().parents[3]
MAPPED = "mapped:"
UNTESTED = "untested:"  # read by the code, but no test shows the effect yet: this list must only shrink
KNOWN_UNTESTED: set[str] = set()

TO = "tests/trainer/test_training_options.py::"
QLORA = "tests/trainer/test_qlora.py::"
PPO_PARITY = "tests/parity/test_trl_ppo.py::test_ppo_matches_trl"
GRPO_PARITY = "tests/parity/test_trl_grpo.py::test_grpo_engine_matches_trl"
RLOO_PARITY = "tests/parity/test_trl_rloo.py::test_rloo_engine_matches_trl"
DPO_PARITY = "tests/parity/test_trl_online_dpo.py::test_online_dpo_engine_matches_trl"
TRAINER_SVC = "tests/integration/test_trainer_service.py::test_trainer_trains_checkpoints_and_acks"
INTERVALS = (
    "tests/integration/test_trainer_service.py::test_weight_sync_and_log_intervals_skip_pushes_and_progress_lines"
)
ROLLOUT_SETTINGS = "tests/unit/services/rollout/test_rollout_engine_settings.py::"
SEEDS = "tests/unit/rlhf/test_config_seeds.py::"
DEVICES = "tests/unit/services/test_devices.py::"
SOURCES = "tests/unit/rlhf/test_data_sources.py::"
VERIFIERS = "tests/unit/services/reward/test_rules_verifiers.py::"
ENGINE_SMALL = TO + "test_tokenizer_sampling_mode_adam_settings_and_vf_coef_reach_the_engine"
NO_LOAD = TO + "test_no_load_optim_and_no_load_rng_per_role_on_resume"
ROLE_BF16 = TO + "test_bf16_per_role_sets_the_actors_and_the_critics_compute_and_the_push"
ROLE_SERVING = "tests/unit/rlhf/test_serving_dtype.py::test_ref_and_reward_bf16_and_seq_length_are_each_roles_own"
ALGO_TO = "tests/unit/rlhf/algo/test_algo_training_options.py::"
PER_ROLE = ALGO_TO + "test_per_role_optimizer_fields_override_the_training_section"
CRITIC_OPTIM = ALGO_TO + "test_the_critic_section_overrides_the_training_sections_optimizer_fields"
SCHEDULE = [
    TO + "test_lr_schedule_sets_each_steps_learning_rate",
    ALGO_TO + "test_lr_schedule_values_at_given_steps",
    PER_ROLE,
]
DATA = "tests/unit/rlhf/test_data_json.py::"
EVAL = "tests/unit/rlhf/test_eval_metrics.py::"
EVAL_RING = "tests/e2e/test_algorithms.py::test_evaluates_held_out_prompts_beside_training"
LORA = "tests/trainer/test_lora.py::"
ENV_SVC = "tests/integration/test_environment_service.py::"
ENV_UNIT = "tests/unit/rlhf/environments/test_environments.py::"
EPISODES = "tests/integration/test_rollout_episodes.py::"
RS = "tests/trainer/test_rejection_sampling.py::"
EPISODE_RUN = EPISODES + "test_an_episode_is_every_turn_as_generated"

FIELD_TESTS: dict[str, list[str] | str] = {
    "run_id": [TRAINER_SVC, "tests/integration/test_launcher.py::test_plan_services_order_ports_and_env"],
    "training.stage": [
        "tests/trainer/test_engine.py::test_ppo_raises_the_reward",
        "tests/trainer/test_engine.py::test_grpo_raises_the_reward",
    ],
    "training.global_batch_size": [TRAINER_SVC],
    "training.seq_length": [ROLLOUT_SETTINGS + "test_max_model_len_bounds_the_hf_engine"],
    "training.train_iters": [TRAINER_SVC],
    "training.tokenizer_name_or_path": [ENGINE_SMALL],
    "training.seed": ["tests/trainer/test_engine.py::test_checkpoint_resume_is_exact"],
    "training.lr": SCHEDULE,
    "training.weight_decay": [ENGINE_SMALL],
    "training.adam_beta1": [ENGINE_SMALL],
    "training.adam_beta2": [ENGINE_SMALL],
    "training.clip_grad": [PER_ROLE, "tests/trainer/test_robustness.py"],
    "training.lr_decay_style": SCHEDULE,
    "training.lr_warmup_fraction": [
        ALGO_TO + "test_lr_schedule_values_at_given_steps",
        PER_ROLE,
    ],
    "training.min_lr": SCHEDULE,
    "training.micro_batch_size": [
        TO + "test_critic_micro_batches_equal_one_step_on_the_whole_minibatch",
        SEEDS + "test_training_micro_batch_size_is_every_roles_default",
    ],
    "training.no_load_optim": [TO + "test_save_folders_hold_the_trained_models_and_no_load_optim_rng", NO_LOAD],
    "training.no_load_rng": [TO + "test_save_folders_hold_the_trained_models_and_no_load_optim_rng", NO_LOAD],
    "training.padding_free": [
        "tests/trainer/test_packing.py::test_update_with_padding_free_equals_padded",
        "tests/trainer/test_packing.py::test_reference_logprobs_with_padding_free_equal_padded",
        "tests/trainer/test_packing.py::test_reward_model_scores_with_padding_free_equal_padded",
    ],
    "training.activation_checkpointing": ["tests/trainer/test_distributed.py::test_world_2_update_equals_world_1"],
    "training.collective_timeout_s": ["tests/trainer/test_distributed.py::test_a_hung_collective_times_out"],
    "training.bf16": [
        "tests/trainer/test_engine.py::test_bf16_keeps_fp32_master_weights_that_learn_at_a_small_lr",
        SEEDS + "test_per_role_no_load_bf16_and_seq_length_default_to_the_training_sections",
    ],
    "training.device": ["tests/unit/rlhf/test_device_auto.py"],
    "training.save_interval": [TRAINER_SVC],
    "training.save": [
        TRAINER_SVC,
        "tests/deploy/test_chart.py::test_checkpoints_pvc_is_mounted_where_the_config_saves",
    ],
    "training.load": ["tests/trainer/test_engine.py::test_checkpoint_resume_is_exact"],
    "training.max_staleness": ["tests/integration/test_transport_streams.py::test_admission_bounds_staleness"],
    "training.weight_sync_interval": [INTERVALS],
    "training.max_mismatch_kl": [
        "tests/trainer/test_mismatch.py::test_the_mismatch_check_stops_after_patience_steps_over_the_bound",
        "tests/trainer/test_mismatch.py::test_the_mismatch_check_is_off_when_null_and_only_warns_with_top_p",
        "tests/e2e/test_mismatch_ring.py::test_a_replica_that_skips_loading_pushed_weights_stops_the_run",
    ],
    "training.mismatch_patience": [
        "tests/trainer/test_mismatch.py::test_the_mismatch_check_stops_after_patience_steps_over_the_bound",
        "tests/e2e/test_mismatch_ring.py::test_a_replica_that_skips_loading_pushed_weights_stops_the_run",
    ],
    "training.log_interval": [INTERVALS],
    "training.log_completions_interval": [TRAINER_SVC],
    "actor_rollout_ref.actor_rollout.load": ["tests/unit/rlhf/test_models_resolve.py"],
    "actor_rollout_ref.actor_rollout.save": [
        TO + "test_save_folders_hold_the_trained_models_and_no_load_optim_rng",
        SEEDS + "test_seed_000_ppo_snippet_loads_with_its_save_folders",
    ],
    "actor_rollout_ref.actor_rollout.do_sample": [
        ENGINE_SMALL,
        SEEDS + "test_a_mindspeed_style_config_that_leaves_out_do_sample_is_told_the_default_differs",
    ],
    "actor_rollout_ref.actor_rollout.temperature": [ENGINE_SMALL, GRPO_PARITY],
    "actor_rollout_ref.actor_rollout.top_p": [
        "tests/integration/test_engines.py::test_hf_truncated_logprobs_match_a_masked_forward"
    ],
    "actor_rollout_ref.actor_rollout.top_k": [
        "tests/integration/test_engines.py::test_hf_truncated_logprobs_match_a_masked_forward"
    ],
    "actor_rollout_ref.actor_rollout.max_prompt_length": [ROLLOUT_SETTINGS + "test_max_model_len_bounds_the_hf_engine"],
    "actor_rollout_ref.actor_rollout.max_new_tokens": [GRPO_PARITY],
    "actor_rollout_ref.actor_rollout.n_samples_per_prompt": [
        "tests/trainer/test_engine.py::test_grpo_raises_the_reward"
    ],
    "actor_rollout_ref.actor_rollout.ppo_mini_batch_size": [
        TO + "test_online_dpo_minibatches_epochs_and_entropy_bonus",
        PPO_PARITY,
    ],
    "actor_rollout_ref.actor_rollout.micro_batch_size": [
        TO + "test_k_micro_batches_equal_one_step_on_the_whole_minibatch"
    ],
    "actor_rollout_ref.actor_rollout.ppo_epochs": [
        TO + "test_online_dpo_minibatches_epochs_and_entropy_bonus",
        PPO_PARITY,
    ],
    "actor_rollout_ref.actor_rollout.clip_ratio": [PPO_PARITY, GRPO_PARITY],
    "actor_rollout_ref.actor_rollout.clip_ratio_high": [GRPO_PARITY],
    "actor_rollout_ref.actor_rollout.dual_clip": [
        "tests/unit/rlhf/algo/test_losses.py::test_ppo_policy_loss_dual_clip"
    ],
    "actor_rollout_ref.actor_rollout.tis_cap": [
        "tests/unit/rlhf/algo/test_losses.py::test_ppo_policy_loss_truncated_importance_sampling"
    ],
    "actor_rollout_ref.actor_rollout.shuffle_minibatch": [TO + "test_online_dpo_minibatches_epochs_and_entropy_bonus"],
    "actor_rollout_ref.actor_rollout.entropy_coeff": [TO + "test_online_dpo_minibatches_epochs_and_entropy_bonus"],
    "actor_rollout_ref.actor_rollout.freezing_actor_steps": [
        TO + "test_a_frozen_actor_does_not_change_while_the_critic_does"
    ],
    "actor_rollout_ref.actor_rollout.ptx_coef": [TO + "test_ptx_loss_enters_the_gradient_with_its_coefficient"],
    "actor_rollout_ref.actor_rollout.engine": [
        "tests/integration/test_engines.py::test_engine_choice_from_config_and_env"
    ],
    "actor_rollout_ref.actor_rollout.stop": ["tests/integration/test_engines.py::test_hf_stops_and_lengths"],
    "actor_rollout_ref.actor_rollout.apply_chat_template": [
        "tests/integration/test_rollout_openai.py::test_chat_uses_the_chat_template"
    ],
    "actor_rollout_ref.actor_rollout.tool_call_parser": [
        "tests/integration/test_tool_calling_api.py::test_a_tool_call_and_the_turn_after_it",
        "tests/unit/rlhf/test_tool_calls.py::test_the_config_names_the_parser",
    ],
    "actor_rollout_ref.actor_rollout.lora_r": [
        LORA + "test_a_lora_run_changes_only_the_adapters_and_pushes_the_merged_model",
        LORA + "test_a_lora_checkpoint_resumes_the_adapters_and_its_policy_is_the_merged_model",
    ],
    "actor_rollout_ref.actor_rollout.lora_alpha": [
        LORA + "test_a_lora_run_changes_only_the_adapters_and_pushes_the_merged_model"
    ],
    "actor_rollout_ref.actor_rollout.lora_dropout": [
        LORA + "test_lora_dropout_is_accepted_recorded_and_off_while_training"
    ],
    "actor_rollout_ref.actor_rollout.load_in_4bit": [
        QLORA + "test_a_4bit_actor_trains_its_adapters_and_pushes_the_dequantized_base_plus_them",
        QLORA + "test_without_bitsandbytes_a_4bit_actor_is_refused_at_start_with_the_install",
    ],
    "actor_rollout_ref.actor_rollout.bnb_4bit_quant_type": [QLORA + "test_the_bnb_4bit_options_reach_the_4bit_layers"],
    "actor_rollout_ref.actor_rollout.bnb_4bit_use_double_quant": [
        QLORA + "test_the_bnb_4bit_options_reach_the_4bit_layers"
    ],
    "actor_rollout_ref.actor_rollout.bnb_4bit_compute_dtype": [
        QLORA + "test_the_bnb_4bit_options_reach_the_4bit_layers"
    ],
    "actor_rollout_ref.actor_rollout.lora_target_modules": [
        LORA + "test_a_lora_run_changes_only_the_adapters_and_pushes_the_merged_model"
    ],
    "actor_rollout_ref.actor_rollout.lora_sync": [
        LORA + "test_an_adapter_push_is_the_adapter_alone_under_the_names_and_shapes_the_replica_expects",
        "tests/integration/test_lora_adapter_sync.py::"
        "test_vllm_serves_each_pushed_adapter_as_the_merged_model_and_unloads_the_old_one_after_its_requests",
    ],
    "critic.shared_backbone": [
        "tests/trainer/test_shared_value_head.py::test_the_value_loss_trains_the_shared_backbone_and_only_there",
        "tests/trainer/test_shared_value_head.py::test_the_values_are_a_head_on_the_actors_own_hidden_states",
    ],
    "actor_rollout_ref.actor_rollout.lr": SCHEDULE,
    "actor_rollout_ref.actor_rollout.weight_decay": [PER_ROLE],
    "actor_rollout_ref.actor_rollout.adam_beta1": [PER_ROLE],
    "actor_rollout_ref.actor_rollout.adam_beta2": [PER_ROLE],
    "actor_rollout_ref.actor_rollout.clip_grad": [PER_ROLE],
    "actor_rollout_ref.actor_rollout.lr_decay_style": [PER_ROLE],
    "actor_rollout_ref.actor_rollout.lr_warmup_fraction": [PER_ROLE],
    "actor_rollout_ref.actor_rollout.min_lr": [PER_ROLE],
    "actor_rollout_ref.actor_rollout.num_gpus_for_train": [
        DEVICES + "test_seed_004_gets_one_device_per_role_in_order",
        DEVICES + "test_num_gpus_for_train_is_the_trainer_group_size",
    ],
    "actor_rollout_ref.actor_rollout.num_gpus_for_infer": [
        DEVICES + "test_rollout_devices_become_replicas_of_the_tensor_parallel_size"
    ],
    "actor_rollout_ref.actor_rollout.dtype": [
        "tests/integration/test_engines.py::test_hf_swap_stages_outside_the_gate_and_installs_storage"
    ],
    "actor_rollout_ref.actor_rollout.max_model_len": [ROLLOUT_SETTINGS + "test_max_model_len_bounds_the_hf_engine"],
    "actor_rollout_ref.actor_rollout.gpu_memory_utilization": [
        ROLLOUT_SETTINGS + "test_settings_reach_vllm_engine_args"
    ],
    "actor_rollout_ref.actor_rollout.tensor_model_parallel_size": [
        ROLLOUT_SETTINGS + "test_settings_reach_vllm_engine_args",
        DEVICES + "test_rollout_devices_become_replicas_of_the_tensor_parallel_size",
    ],
    "actor_rollout_ref.actor_rollout.enforce_eager": [ROLLOUT_SETTINGS + "test_settings_reach_vllm_engine_args"],
    "actor_rollout_ref.actor_rollout.staged_weight_swap": [
        ROLLOUT_SETTINGS + "test_staged_weight_swap_reaches_the_engine_and_is_decided_by_the_worker",
        "tests/integration/test_engines.py::test_vllm_staged_swap_serves_the_old_weights_while_the_update_loads",
    ],
    "actor_rollout_ref.actor_rollout.partial_rollouts": [
        ROLLOUT_SETTINGS + "test_partial_rollouts_reach_both_engines_and_are_refused_with_adapter_pushes",
        "tests/integration/test_engines.py::test_partial_rollout_resumes_under_the_new_weights",
    ],
    "actor_rollout_ref.ref.load": [
        "tests/integration/test_reference_service.py::test_logprobs_rest_match_transformers"
    ],
    "actor_rollout_ref.ref.temperature": ["tests/integration/test_reference_service.py::test_configured_temperature"],
    "actor_rollout_ref.ref.micro_batch_size": ["tests/integration/test_engine_batching.py"],
    "actor_rollout_ref.ref.seq_length": [ROLE_SERVING],
    "actor_rollout_ref.ref.bf16": [ROLE_SERVING],
    "actor_rollout_ref.actor_rollout.seq_length": [
        SEEDS + "test_per_role_no_load_bf16_and_seq_length_default_to_the_training_sections",
        SEEDS + "test_configs_with_mindspeed_llms_trainer_key_sets_load_without_edits",
    ],
    "actor_rollout_ref.actor_rollout.bf16": [ROLE_BF16],
    "actor_rollout_ref.actor_rollout.no_load_optim": [NO_LOAD],
    "actor_rollout_ref.actor_rollout.no_load_rng": [NO_LOAD],
    "critic.seq_length": [SEEDS + "test_options_that_only_make_sense_together_are_checked_at_load"],
    "critic.bf16": [ROLE_BF16],
    "critic.no_load_optim": [NO_LOAD],
    "critic.no_load_rng": [NO_LOAD, SEEDS + "test_options_that_only_make_sense_together_are_checked_at_load"],
    "reward.seq_length": [ROLE_SERVING],
    "reward.bf16": [ROLE_SERVING],
    "critic.load": ["tests/trainer/test_engine.py::test_ppo_raises_the_reward"],
    "critic.cliprange_value": [PPO_PARITY],
    "critic.critic_mini_batch_size": [
        "tests/trainer/test_engine.py::test_critic_alongside_the_actor_matches_one_after_the_other"
    ],
    "critic.critic_update_epochs": [PPO_PARITY],
    "critic.micro_batch_size": [TO + "test_critic_micro_batches_equal_one_step_on_the_whole_minibatch"],
    "critic.save": [TO + "test_save_folders_hold_the_trained_models_and_no_load_optim_rng"],
    "critic.vf_coef": [ENGINE_SMALL],
    **{
        f"critic.{name}": [
            PER_ROLE,
            CRITIC_OPTIM,
            TO + "test_the_critic_sections_optimizer_fields_reach_its_adamw_clip_and_schedule",
        ]
        for name in (
            "lr",
            "weight_decay",
            "adam_beta1",
            "adam_beta2",
            "clip_grad",
            "lr_decay_style",
            "lr_warmup_fraction",
            "min_lr",
        )
    },
    "reward.scorers": ["tests/integration/test_reward_service.py::test_score_rest_matches_the_model_and_rules"],
    "reward.scorers[].type": ["tests/integration/test_reward_service.py::test_score_rest_matches_the_model_and_rules"],
    "reward.scorers[].name": ["tests/integration/test_reward_service.py::test_user_rule_and_bad_rule_config"],
    "reward.scorers[].load": ["tests/integration/test_reward_service.py::test_score_rest_matches_the_model_and_rules"],
    "reward.scorers[].url": ["tests/integration/test_reward_service.py::test_remote_scorer_ok_combines_with_rules"],
    "reward.scorers[].weight": ["tests/integration/test_reward_service.py::test_remote_scorer_ok_combines_with_rules"],
    "reward.scorers[].timeout_s": [
        "tests/integration/test_reward_service.py::test_remote_failures_through_the_service"
    ],
    "reward.scorers[].retries": ["tests/integration/test_reward_service.py::test_remote_scorer_retry_recovers"],
    "reward.scorers[].kwargs": [
        "tests/integration/test_reward_service.py::test_regex_pattern_comes_from_the_config_only"
    ],
    "reward.micro_batch_size": ["tests/integration/test_engine_batching.py::test_reward_model_merged_equals_alone"],
    "reward.scorers[].judge.base_url": [
        "tests/integration/test_judge_scorer.py::test_request_template_system_model_and_api_key",
        "tests/integration/test_judge_scorer.py::test_rollout_service_as_judge",
    ],
    "reward.scorers[].judge.model": [
        "tests/integration/test_judge_scorer.py::test_request_template_system_model_and_api_key",
        "tests/integration/test_judge_scorer.py::test_defaults_send_no_key_and_no_model",
    ],
    "reward.scorers[].judge.api_key_env": [
        "tests/integration/test_judge_scorer.py::test_request_template_system_model_and_api_key",
        "tests/integration/test_judge_scorer.py::test_api_key_variable_must_be_set",
    ],
    "reward.scorers[].judge.template": [
        "tests/integration/test_judge_scorer.py::test_request_template_system_model_and_api_key",
        "tests/integration/test_judge_scorer.py::test_label_needed_by_the_template_and_text_prompts",
    ],
    "reward.scorers[].judge.system": [
        "tests/integration/test_judge_scorer.py::test_request_template_system_model_and_api_key"
    ],
    "reward.scorers[].judge.temperature": [
        "tests/integration/test_judge_scorer.py::test_request_template_system_model_and_api_key",
        "tests/integration/test_judge_scorer.py::test_defaults_send_no_key_and_no_model",
    ],
    "reward.scorers[].judge.max_tokens": [
        "tests/integration/test_judge_scorer.py::test_request_template_system_model_and_api_key",
        "tests/integration/test_judge_scorer.py::test_defaults_send_no_key_and_no_model",
    ],
    "reward.scorers[].judge.concurrency": ["tests/integration/test_judge_scorer.py::test_concurrency_bound"],
    "reward.scorers[].judge.parser": ["tests/integration/test_judge_scorer.py::test_parsers"],
    "reward.scorers[].judge.pattern": [
        "tests/integration/test_judge_scorer.py::test_parsers",
        "tests/integration/test_judge_scorer.py::test_rollout_service_as_judge",
    ],
    "reward.scorers[].judge.range": ["tests/integration/test_judge_scorer.py::test_parsers"],
    "reward.scorers[].judge.normalize": ["tests/integration/test_judge_scorer.py::test_parsers"],
    "reward.scorers[].judge.choices": [
        "tests/integration/test_judge_scorer.py::test_parsers",
        "tests/integration/test_judge_scorer.py::test_rollout_service_as_judge",
    ],
    "reward.scorers[].judge.extra_body": [
        "tests/integration/test_judge_scorer.py::test_request_template_system_model_and_api_key"
    ],
    "reward.load": MAPPED + " shorthand: replaces reward.scorers with one model scorer (rlhf/config.py), whose load "
    "is tested above; " + SEEDS + "test_seed_000_ppo_snippet_loads_with_its_save_folders checks the mapping",
    "reward.max_failed_fraction": [
        "tests/integration/test_trainer_service.py::test_a_scorer_failing_on_most_samples_stops_the_run_naming_it"
    ],
    "reward.failed_patience": [
        "tests/integration/test_trainer_service.py::test_a_scorer_failing_on_most_samples_stops_the_run_naming_it"
    ],
    "algorithm.adv_estimator": [
        "tests/unit/rlhf/test_config_critic_free.py::test_stage_defaults_follow_trl_and_openrlhf",
        "tests/parity/test_openrlhf_reinforce.py",
    ],
    "algorithm.gamma": [PPO_PARITY],
    "algorithm.lam": [PPO_PARITY],
    "algorithm.kl_penalty": [
        PPO_PARITY,
        GRPO_PARITY,
        TO + "test_kl_penalty_full_penalises_the_whole_vocabulary_kl_to_the_reference",
    ],
    "algorithm.kl_ctrl.type": ["tests/unit/rlhf/algo/test_kl.py::test_make_kl_controller"],
    "algorithm.kl_ctrl.kl_coef": [PPO_PARITY],
    "algorithm.kl_ctrl.target_kl": ["tests/unit/rlhf/algo/test_kl.py::test_adaptive_controller_update_rule"],
    "algorithm.kl_ctrl.horizon": ["tests/unit/rlhf/algo/test_kl.py::test_adaptive_controller_update_rule"],
    "algorithm.missing_eos_penalty": [PPO_PARITY, DPO_PARITY],
    "algorithm.normalize_reward": [TO + "test_normalised_rewards_use_the_running_statistics_and_clipping_bounds_them"],
    "algorithm.reward_clip_range": [TO + "test_normalised_rewards_use_the_running_statistics_and_clipping_bounds_them"],
    "algorithm.reward_norm_stats": [
        TO + "test_fixed_reward_statistics_normalise_with_the_given_or_the_reward_models_mean_and_std",
        ALGO_TO + "test_fixed_moments_normalise_with_the_given_mean_and_std_exactly",
    ],
    "algorithm.reward_baseline": [
        TO + "test_ppo_reward_baseline_is_subtracted_from_the_scores_ppo_trains_on",
        ALGO_TO + "test_ppo_rollout_puts_the_baselined_score_after_the_eos_penalty_and_before_the_kl",
    ],
    "algorithm.whiten_rewards": [PPO_PARITY],
    "algorithm.whiten_advantages": [PPO_PARITY, RLOO_PARITY],
    "algorithm.score_position": ["tests/unit/rlhf/algo/test_ppo.py::test_ppo_rollout_score_positions"],
    "algorithm.loss_type": [GRPO_PARITY],
    "algorithm.scale_rewards": [GRPO_PARITY],
    "algorithm.use_bias_correction_kl": [GRPO_PARITY],
    "algorithm.importance_sampling_level": [GRPO_PARITY],
    "algorithm.mask_truncated_completions": [GRPO_PARITY, RLOO_PARITY],
    "algorithm.top_entropy_quantile": [GRPO_PARITY],
    "algorithm.rloo_convention": [RLOO_PARITY, "tests/parity/test_openrlhf_reinforce.py"],
    "algorithm.distill.coef": [
        "tests/trainer/test_distill.py::test_distillation_lowers_the_students_reverse_kl_to_the_teacher",
        "tests/unit/rlhf/algo/test_algo_distill.py::test_advantages_match_a_loop",
    ],
    "algorithm.distill.reward_coef": [
        "tests/trainer/test_distill.py::test_pure_distillation_ignores_the_score_and_reward_coef_adds_the_task_advantage",
        "tests/unit/rlhf/algo/test_algo_distill.py::test_advantages_match_a_loop",
    ],
    "algorithm.dpo_beta": [DPO_PARITY],
    "algorithm.dpo_loss_type": [DPO_PARITY],
    "resource_pool.actor_rollout": [
        DEVICES + "test_colocated_rollout_shares_the_trainers_device",
        DEVICES + "test_seed_004_gets_one_device_per_role_in_order",
    ],
    "resource_pool.ref": [DEVICES + "test_seed_004_gets_one_device_per_role_in_order"],
    "resource_pool.critic": [
        SEEDS + "test_options_that_only_make_sense_together_are_checked_at_load",
        DEVICES + "test_a_critic_with_a_device_of_its_own_is_seen_by_the_trainer_after_the_actors",
        DEVICES + "test_the_critics_own_device_is_the_one_after_the_actors_and_must_exist",
        TO + "test_a_critic_with_a_device_of_its_own_trains_on_the_cpu",
    ],
    "resource_pool.reward": [DEVICES + "test_seed_004_gets_one_device_per_role_in_order"],
    "data.path": [
        DATA + "test_a_json_array_and_json_lines_both_load_with_the_key_map",
        SOURCES + "test_mindspeed_preprocessed_prefix_is_read_as_prompt_ids",
        VERIFIERS + "test_a_reasoning_gym_task_is_a_seeded_data_source_whose_labels_recover_the_entry",
    ],
    "data.map_keys": [
        DATA + "test_a_json_array_and_json_lines_both_load_with_the_key_map",
        SOURCES + "test_alpaca_map_keys_join_prompt_and_query_and_take_the_rows_system_prompt",
    ],
    "data.generator_size": [
        VERIFIERS + "test_a_reasoning_gym_task_is_a_seeded_data_source_whose_labels_recover_the_entry"
    ],
    "data.generator_seed": [
        VERIFIERS + "test_a_reasoning_gym_task_is_a_seeded_data_source_whose_labels_recover_the_entry"
    ],
    "data.generator_options": [
        VERIFIERS + "test_a_reasoning_gym_task_is_a_seeded_data_source_whose_labels_recover_the_entry",
        VERIFIERS + "test_generator_config_errors_name_the_key",
    ],
    "data.pretrain_data": [
        TO + "test_ptx_loss_enters_the_gradient_with_its_coefficient",
        DATA + "test_bad_json_files_are_config_errors_naming_the_key",
    ],
    "data.system": [DATA + "test_max_samples_shuffle_and_system_message"],
    "data.shuffle": [DATA + "test_max_samples_shuffle_and_system_message"],
    "data.max_samples": [DATA + "test_max_samples_shuffle_and_system_message"],
    "eval.interval": [EVAL_RING, EVAL + "test_an_evaluation_past_its_deadline_is_a_failed_row"],
    "eval.before_training": [
        "tests/e2e/test_convergence.py::test_grpo_learns_reverse_words_and_keeps_learning_after_a_resume"
    ],
    "eval.path": [EVAL_RING, EVAL + "test_eval_section_reads_its_source_as_data_does"],
    "eval.map_keys": [EVAL + "test_eval_section_reads_its_source_as_data_does"],
    "eval.system": [EVAL + "test_eval_section_reads_its_source_as_data_does"],
    "eval.max_samples": [EVAL_RING, EVAL + "test_eval_section_reads_its_source_as_data_does"],
    "eval.generator_size": [EVAL + "test_eval_section_reads_its_source_as_data_does"],
    "eval.generator_seed": [EVAL + "test_eval_section_reads_its_source_as_data_does"],
    "eval.generator_options": [EVAL + "test_eval_section_reads_its_source_as_data_does"],
    "eval.n": [EVAL_RING, EVAL + "test_eval_metrics_fixed_batch"],
    "eval.temperature": [EVAL_RING, EVAL + "test_eval_config_rules"],
    "eval.max_new_tokens": [EVAL_RING, EVAL + "test_an_evaluation_past_its_deadline_is_a_failed_row"],
    "eval.pass_threshold": [EVAL_RING, EVAL + "test_eval_metrics_fixed_batch"],
    "eval.timeout_s": [EVAL + "test_an_evaluation_past_its_deadline_is_a_failed_row"],
    "training_service.enabled": [
        "tests/integration/test_up_training_service.py::test_up_starts_a_training_service_the_sdk_reaches",
        "tests/integration/test_up_training_service.py::test_up_refuses_before_starting_anything",
    ],
    "environment.name": [
        ENV_SVC + "test_a_killed_service_loses_its_episodes",
        ENV_UNIT + "test_the_environment_config_section",
    ],
    "algorithm.rejection_sampling.interval": [
        RS + "test_rejection_sampling_steps_alternate_and_raise_the_best_answers_likelihood"
    ],
    "algorithm.rejection_sampling.min_score": [RS + "test_min_score_can_keep_nothing_and_then_nothing_moves"],
    "algorithm.rejection_sampling.epochs": [RS + "test_more_epochs_fit_the_kept_answers_more"],
    "environment.max_turns": [EPISODES + "test_the_environment_section_makes_jobs_episodes", EPISODE_RUN],
    "environment.max_tokens": [EPISODES + "test_the_environment_section_makes_jobs_episodes", EPISODE_RUN],
    "environment.options": [ENV_SVC + "test_a_killed_service_loses_its_episodes"],
    "environment.timeout_s": [ENV_SVC + "test_the_config_sets_the_episode_bounds"],
    "environment.episode_ttl_s": [ENV_SVC + "test_the_config_sets_the_episode_bounds"],
    "environment.max_episodes": [ENV_SVC + "test_the_config_sets_the_episode_bounds"],
    "environment.replicas": [ENV_UNIT + "test_rlhf_up_plans_environment_services"],
}


def config_fields(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += config_fields(ann, f"{prefix}{name}.")
            continue
        out.append(prefix + name)
        args = getattr(ann, "__args__", ())
        if (
            getattr(ann, "__origin__", None) is list
            and args
            and isinstance(args[0], type)
            and issubclass(args[0], BaseModel)
        ):
            out += config_fields(args[0], f"{prefix}{name}[].")
    return out


def _test_exists(test_id: str) -> bool:
    path, _, name = test_id.partition("::")
    file = ROOT / path
    if not file.is_file():
        return False
    if not name:
        return True
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


def test_every_field_has_an_effect_test_or_a_documented_mapping():
    fields = config_fields()
    missing = [f for f in fields if f not in FIELD_TESTS]
    assert not missing, f"config fields without an effect test or mapping in FIELD_TESTS: {missing}"
    stale = [f for f in FIELD_TESTS if f not in fields]
    assert not stale, f"FIELD_TESTS names fields the config no longer has: {stale}"
    for field, tests in FIELD_TESTS.items():
        if isinstance(tests, str):
            assert tests.startswith(MAPPED) or (tests.startswith(UNTESTED) and field in KNOWN_UNTESTED), field
            assert len(tests) > 40, field
            continue
        assert tests, field
        for test_id in tests:
            assert _test_exists(test_id), f"{field}: {test_id} does not exist"


def test_the_readme_lists_every_field_with_its_default():
    readme = (ROOT / "docs" / "configuration.md").read_text()  # the README's table moved there (generated)
    rows = {line.split("|")[1].strip().strip("`"): line for line in readme.splitlines() if line.startswith("| `")}
    for field in config_fields():
        assert field in rows, f"docs/configuration.md has no row for {field}"
        assert len(rows[field].split("|")) >= 5, field
