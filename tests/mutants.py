"""Bugs put in by hand, each beside the tests that must catch it: `python tests/mutants.py [name ...]` copies
the tree, puts one bug in the copy, runs its tests there and reports whether they failed (they must). A
check that no test makes fire is found here before a reader has to find it (docs/development.md).

Each mutant is a one-line change to a product file (or to a guard of the suite's own): the text replaced must
occur exactly once, so a mutant whose code has moved fails loudly instead of testing nothing. Every check a
change adds gets its mutant here, beside the test that makes it fire."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids (or -k expressions after "-k ") that must fail with the bug


MUTANTS = (
    Mutant(
        "cp-kv-heads",
        "distrain/strategy/context_parallel.py",
        'for key, heads in (("n_heads", m.n_heads), ("n_kv_heads", kv)):',
        'for key, heads in (("n_heads", m.n_heads),):',
        ("tests/test_context_parallel.py::test_a_layout_cp_cannot_split_is_refused_in_one_line",),
    ),
    Mutant(
        "verdict-cache-stamp",
        "distrain/storage/integrity.py",
        "return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino",
        "return st.st_size, 0, 0, st.st_ino",
        ("tests/test_damage.py::test_each_damage_falls_back_to_the_older_checkpoint_in_one_line",),
    ),
    Mutant(
        "fits-counts-scores",
        "distrain/driver/fits.py",
        "worker_memory(cfg, layout, precision, scores=False)",
        "worker_memory(cfg, layout, precision, scores=True)",
        ("tests/test_refusals.py::test_the_memory_check_leaves_out_the_attention_scores",),
    ),
    Mutant(
        "nonfinite-at-readback",
        "distrain/train/loop.py",
        'if not (math.isfinite(line["loss"]) and math.isfinite(line["grad_norm"])):',
        "if False:",
        ("tests/test_training.py::test_a_non_finite_loss_ends_the_run_before_it_is_saved",),
    ),
    Mutant(
        "digest-keys-only",
        "distrain/train/replicas.py",
        "h.update(memoryview(t.detach().reshape(-1).view(torch.uint8).cpu().numpy()))",
        "pass",
        ("tests/test_replicas.py::test_a_replacement_takes_a_replicas_state_and_one_flipped_bit_is_refused",),
    ),
    Mutant(
        "peer-rng-not-set",
        "distrain/train/state.py",
        'set_rng_states(extras["rng"], state.device)',
        "pass",
        ("tests/test_peer_recovery.py::test_a_killed_rank_costs_only_the_step_in_flight[ddp_dropout]",),
    ),
    Mutant(
        "settle-draws",
        "distrain/train/learner.py",
        'torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])',
        "contextlib.nullcontext()",
        ("tests/test_peer_recovery.py::test_a_killed_rank_costs_only_the_step_in_flight[ddp_dropout]",),
    ),
    Mutant(
        "rngs-not-seeded",
        "distrain/train/loop.py",
        'seed_rngs(cfg.trainer.seed, layout.coordinate(self.rank)["pp"])',
        "pass",
        ("tests/test_peer_recovery.py::test_a_killed_rank_costs_only_the_step_in_flight[ddp_dropout]",),
    ),
    Mutant(
        "read-lines-not-carried",
        "distrain/train/steplog.py",
        "lines = dict(self.last_read)",
        "lines = {}",
        ("tests/test_peer_recovery.py::test_a_line_only_the_survivors_read_back_is_written_by_the_new_rank_0",),
    ),
    Mutant(
        "torn-state-kept",
        "distrain/train/state.py",
        "self.whole = False  # inside the update",
        "pass  # inside the update",
        ("tests/test_peer_recovery.py::test_a_failure_inside_every_update_falls_back_to_the_checkpoint",),
    ),
    Mutant(
        "mirror-copy-trusted",
        "distrain/storage/remote.py",
        "kept = {n for n, crc in integrity.checksums(path, present).items() if crc == sums[n]}",
        "kept = set(present)",
        ("tests/test_object_storage_ckpt.py::test_a_nodes_damaged_copy_is_fetched_again_not_skipped",),
    ),
    Mutant(
        "store-sizes-unchecked",
        "distrain/storage/remote.py",
        "if found.get(name) != size:",
        "if False:",
        ("tests/test_object_storage_ckpt.py::test_a_checkpoint_the_store_holds_short_or_lacks_is_not_committed",),
    ),
    Mutant(
        "stale-summary-kept",
        "distrain/storage/record_sync.py",
        "(n not in local or n == SUMMARY)",
        "n not in local",
        (
            "tests/test_object_storage_run.py::test_a_nodes_summary_is_refreshed_when_the_store_records_more_invocations",
        ),
    ),
    Mutant(
        "fetched-shard-unchecked",
        "distrain/data/remote.py",
        "if not _whole(cache / name, wanted[name], checked):",
        "if False:",
        ("tests/test_object_storage_data.py::test_a_shard_damaged_on_the_store_is_refused_not_trained_on",),
    ),
    Mutant(
        "ring-math-in-bf16",
        "distrain/parallel/ring_attention.py",
        "with torch.autocast(q.device.type, enabled=False):  # the kernels in q's dtype",
        "with torch.autocast(q.device.type, enabled=torch.is_autocast_enabled(q.device.type)):  # q's dtype",
        ("tests/test_context_parallel.py::test_attention_in_bf16_errs_no_more_than_its_rounding",),
    ),
    Mutant(
        "ring-later-rank-front-chunk-only",
        "distrain/parallel/ring_attention.py",
        "return (None, 0, False) if source < rank else (1, None, False)",
        "return (None, 0, False) if source < rank else (1, 0, False)",
        ("tests/test_attention_blocks.py::test_the_ring_of_blocks_gives_sdpa_on_the_whole_sequence",),
    ),
    Mutant(
        "ring-flash-op-given-an-unpadded-head",
        "distrain/parallel/attention_blocks.py",
        'if device == "cuda" and choice == SDPBackend.FLASH_ATTENTION and head_dim % 8:',
        "if False:",
        ("tests/test_attention_blocks.py::test_each_choice_of_sdpa_gets_the_kernel_that_takes_it",),
    ),
    Mutant(
        "ring-block-backward-own-lse",
        "distrain/parallel/ring_attention.py",
        "got = kernel.backward(dout, q, k, v, out, lse, causal, q.shape[-1] ** -0.5)",
        "got = kernel.backward(dout, q, k, v, *kernel.forward(q, k, v, causal, q.shape[-1] ** -0.5), causal, "
        "q.shape[-1] ** -0.5)",
        ("tests/test_attention_blocks.py::test_the_ring_of_blocks_gives_sdpa_on_the_whole_sequence",),
    ),
    Mutant(
        "malformed-url-taken-for-a-path",
        "distrain/urls.py",
        'if not is_url(text) or bucket(text) == "":',
        "if False:",
        ("tests/test_urls.py::test_text_that_starts_like_a_url_is_refused_unless_well_formed",),
    ),
    Mutant(
        "run-places-unchecked",
        "distrain/driver/validation.py",
        "    _validate_places(cfg)\n",
        "\n",
        ("tests/test_urls.py::test_train_refuses_it_before_anything_starts_or_is_written",),
    ),
    Mutant(
        "job-location-unchecked",
        "distrain/driver/jobargs.py",
        "if kind is Location:",
        "if False:",
        ("tests/test_urls.py::test_every_job_refuses_it_in_one_line",),
    ),
    Mutant(
        "conditional-writes-assumed",
        "distrain/storage/objectstore.py",
        "self._conditional = first and not again",
        "self._conditional = True",
        ("tests/test_object_storage_run.py::test_the_store_lock_refuses_a_second_holder_and_is_released[gcs]",),
    ),
    Mutant(
        "lock-read-back-skipped",
        "distrain/storage/objectstore.py",
        "            return self.read_bytes(name) == data",
        "            return True",
        ("tests/test_object_storage_run.py::test_of_two_drivers_creating_the_lock_at_once_one_wins[gcs]",),
    ),
    Mutant(
        "connection-string-recorded",
        "distrain/redaction.py",
        "|sas|connection",
        "|sas",
        ("tests/test_object_storage_run.py::test_the_secret_is_in_no_file_the_run_wrote[azure]",),
    ),
    Mutant(
        "missing-bucket-made",
        "distrain/storage/objectstore.py",
        "        if not create:",
        "        if False:",
        ("tests/test_object_storage_run.py::test_a_bucket_that_does_not_exist_is_refused_unless_made",),
    ),
    Mutant(
        "ps-restore-from-a-lost-checkpoint",
        "distrain/ps/saved.py",
        "    if path is None:\n        raise DamagedCheckpointError(",
        "    if False:\n        raise DamagedCheckpointError(",
        ("tests/test_ps.py::test_a_server_restored_from_a_store_that_lost_the_checkpoint_is_refused_in_one_line",),
    ),
    Mutant(
        "output-bucket-unchecked",
        "distrain/storage/publish.py",
        'store.check_bucket(f"{key}={url!r}", storage.create_bucket)',
        "pass",
        ("tests/test_object_storage_data.py::test_an_output_into_a_bucket_that_does_not_exist_is_refused_unless_made",),
    ),
    Mutant(
        "not-finite-numbers-accepted",
        "distrain/driver/validation.py",
        'require(math.isfinite(value), f"{key}={value}: must be a finite number")',
        'require(True, f"{key}={value}: must be a finite number")',
        ("tests/test_config.py::test_a_number_that_is_not_finite_is_refused",),
    ),
    Mutant(
        "plan-starts-a-cluster",
        "distrain/driver/launch.py",
        "    if here is not None:\n        where = ",
        "    if False:\n        where = ",
        ("tests/test_plan.py::test_a_plan_without_a_cluster_to_attach_to_starts_none",),
    ),
    Mutant(
        "survivors-cut-short",
        "distrain/cluster/timeouts.py",
        "limit = self.step_limit(step_s) if returning else max(self.survivor_grace_s, 3 * (step_s or 0.0))",
        "limit = self.survivor_grace_s",
        ("tests/test_peer_recovery.py::test_survivors_slow_to_return_are_waited_for_and_recovered_from",),
    ),
    Mutant(
        "late-survivor-unnamed",
        "distrain/cluster/diagnosis.py",
        "                for rank in ranks:\n                    self.on_event(",
        "                for rank in []:\n                    self.on_event(",
        (
            "tests/test_peer_recovery.py::test_a_survivor_that_never_returns_is_named_and_the_run_goes_on_from_the_checkpoint",
        ),
    ),
    Mutant(
        "loss-beside-the-step-after",
        "distrain/progress.py",
        "step = progress.step if progress.logged is None else progress.logged",
        "step = progress.step",
        ("tests/test_progress.py::test_a_collective_ranks_loss_is_shown_beside_its_own_step",),
    ),
    Mutant(
        "restart-point-unsaid",
        "distrain/driver/collective.py",
        "        if attempt.number > 1:  # a restart",
        "        if False:  # a restart",
        (
            "tests/test_peer_recovery.py::test_a_survivor_that_never_returns_is_named_and_the_run_goes_on_from_the_checkpoint",
        ),
    ),
    Mutant(
        "rays-death-paragraph-shown",
        "distrain/cluster/runtime.py",
        "    hide_worker_deaths()\n",
        "\n",
        ("tests/test_wandb.py::test_a_recovery_from_replicas_keeps_one_wandb_run_and_ray_says_nothing",),
    ),
    Mutant(
        "handles-let-go-before-death",
        "distrain/cluster/kill.py",
        "while ids and time.monotonic() < deadline:",
        "while False:",
        ("tests/test_cluster.py::test_every_worker_of_an_ended_group_dies_by_its_kill",),
    ),
    Mutant(
        "second-signal-unacknowledged",
        "distrain/driver/stop.py",
        'self.say(f"{name} again: stopping now, without waiting for the ranks\' checkpoint")',
        "pass",
        ("tests/test_cli.py::test_a_second_signal_stops_at_once_and_says_so_in_one_line",),
    ),
    Mutant(
        "second-wandb-run",
        "distrain/storage/tracking.py",
        "kept = wandb.run if wandb.run is not None and wandb.run.id == wandb_run_id else None",
        "kept = None",
        ("tests/test_wandb.py::test_a_recovery_from_replicas_keeps_one_wandb_run_and_ray_says_nothing",),
    ),
    Mutant(
        "unrun-points-unlisted",
        "distrain/driver/sweep.py",
        'return [Point(overrides, None, "not run") for overrides in planned[len(ran) :]]',
        "return []",
        ("tests/test_sweepers.py::test_a_sweep_stopped_midway_lists_the_points_it_never_ran",),
    ),
    Mutant(
        "any-interrupt-empties-the-run",
        "distrain/driver/rerun.py",
        "    except StoppedBeforeStart:\n        if run_dir is not None",
        "    except KeyboardInterrupt:\n        if run_dir is not None",
        ("tests/test_driver.py::test_only_a_stop_before_anything_happened_empties_a_new_run_directory",),
    ),
    Mutant(
        "a-failure-record-let-go-at-a-stop",
        "distrain/cluster/history.py",
        "return not any(a.progressed or a.outcome in (Outcome.FAILED, Outcome.HUNG) for a in attempts)",
        "return not any(a.progressed for a in attempts)",
        ("tests/test_driver.py::test_a_stop_leaves_a_record_once_a_step_was_trained_or_an_attempt_failed",),
    ),
    Mutant(
        "local-asked-attaches",
        "distrain/driver/workers.py",
        'connect("local", c.local_cpus, c.local_gpus, say=say)',
        "connect(None, c.local_cpus, c.local_gpus, say=say)",
        ("tests/test_cli.py::test_a_sweep_trains_each_point_as_its_own_run",),
    ),
    Mutant(
        "stop-waits-for-survivors",
        "distrain/cluster/diagnosis.py",
        "if stop_at and time.time() > stop_at + self.timeouts.stop_grace_s - 1:",
        "if False:",
        ("tests/test_peer_recovery.py::test_a_stop_is_not_held_up_by_survivors_on_their_way_back",),
    ),
    Mutant(
        "plan-makes-the-bucket",
        "distrain/driver/objectrun.py",
        "cfg.storage.create_bucket, make=not cfg.plan):",
        "cfg.storage.create_bucket, make=True):",
        ("tests/test_object_storage_run.py::test_a_bucket_that_does_not_exist_is_refused_unless_made",),
    ),
    Mutant(
        "store-down-ends-the-restart",
        "distrain/driver/objectrun.py",
        "            if left <= 0:",
        "            if True:",
        (
            "tests/test_object_storage_restart.py::test_a_restart_waits_for_the_store_and_the_run_completes",
            "tests/test_object_storage_restart.py::test_a_restart_ends_the_run_in_one_line_when_the_store_stays_down",
        ),
    ),
    Mutant(
        "ps-shard-never-uploaded",
        "distrain/ps/saved.py",
        "        store_for(cfg.run_url, cfg.storage).upload(directory, [file], prefix)",
        "        pass",
        ("tests/test_ps.py::test_a_dead_server_is_restored_from_the_last_checkpoint[sync-store]",),
    ),
    Mutant(
        "ps-restored-from-the-mirror",
        "distrain/ps/saved.py",
        "    if not cfg.run_url:\n        return Path(resume_from)",
        "    if True:\n        return Path(resume_from)",
        ("tests/test_ps.py::test_a_dead_server_is_restored_from_the_last_checkpoint[sync-store]",),
    ),
    Mutant(
        "ps-servers-without-the-credentials",
        "distrain/ps/server.py",
        "        os.environ.update(env or {})",
        "        os.environ.update({})",
        ("tests/test_ps.py::test_a_dead_server_is_restored_from_the_last_checkpoint[sync-store]",),
    ),
    Mutant(
        "wandb-references-the-mirror",
        "distrain/storage/tracking.py",
        "            if self.record is None:",
        "            if True:",
        ("tests/test_wandb.py::test_a_run_on_an_object_store_references_its_checkpoints_there",),
    ),
    Mutant(
        "fixture-setup-unbounded",
        "tests/conftest.py",
        "outer, _ = signal.setitimer(signal.ITIMER_REAL, FIXTURE_TIMEOUT_S)",
        "outer = 0.0",
        ("tests/test_suite.py::test_a_fixture_that_overruns_its_setup_bound_fails_there",),
    ),
    Mutant(
        "stop-while-starting-not-before-start",
        "distrain/driver/launch.py",
        '            raise StoppedBeforeStart(e.signum) from None\n        summary["startup"]',
        '            raise Stopped(e.signum) from None\n        summary["startup"]',
        ("tests/test_cli.py::test_a_stop_before_the_first_step_is_stoppedbeforestart_to_a_caller_of_train",),
    ),
    Mutant(
        "clean-stop-before-a-step-kept",
        "distrain/driver/launch.py",
        "raise StoppedBeforeStart(stop.received[0])",
        "pass",
        ("tests/test_cli.py::test_ctrl_c_before_the_first_step_stops_at_once_in_one_line_and_leaves_nothing",),
    ),
    Mutant(
        "stop-at-once-before-a-step-kept",
        "distrain/driver/launch.py",
        "                raise StoppedBeforeStart(e.signum) from None",
        "                raise Stopped(e.signum) from None",
        ("tests/test_sweepers.py::test_a_sweep_stopped_midway_lists_the_points_it_never_ran",),
    ),
    Mutant(
        "guard-lets-a-stop-through",
        "distrain/driver/stop.py",
        "raise Stopped(self.received[0]) from None",
        "return None",
        ("tests/test_cli.py::test_a_second_signal_stops_at_once_and_says_so_in_one_line",),
    ),
    Mutant(
        "agents-outlive-the-killed-raylet",
        "distrain/cluster/runtime.py",
        "        for pid in below:",
        "        for pid in []:",
        ("tests/test_cli.py::test_no_process_of_the_embedded_cluster_outlives_the_run",),
    ),
    Mutant(
        "stop-vote-in-float32",
        "distrain/train/stopvote.py",
        "time.time() + last_save_s], dtype=torch.float64)",
        "time.time() + last_save_s]).to(torch.float64)",
        ("tests/test_step_path.py::test_the_stop_vote_judges_a_save_against_the_deadline_to_the_second",),
    ),
    Mutant(
        "channel-report-unlocked",
        "distrain/channel.py",
        "        with self._lock:\n",
        "        if True:\n",
        ("tests/test_progress.py::test_reports_from_two_threads_lose_neither",),
    ),
    Mutant(
        "moe-recompute-counts-figures-again",
        "distrain/model/moe.py",
        "        if MoE.recomputing:\n",
        "        if False:\n",
        ("tests/test_moe_layer.py::test_a_recomputed_block_counts_its_figures_once",),
    ),
    Mutant(
        "meshes-kept-across-groups",
        "distrain/parallel/process_group.py",
        "        forget_meshes()\n",
        "",
        ("tests/test_process_group.py::test_a_group_formed_again_builds_its_meshes_anew",),
    ),
    Mutant(
        "mixtral-export-takes-a-sigmoid-router",
        "distrain/model/families/moe.py",
        '(m.score == "softmax", f"model.moe.score={m.score}: {name}\'s router is a softmax"),',
        '(True, f"model.moe.score={m.score}: {name}\'s router is a softmax"),',
        ("tests/test_hf.py::test_a_model_transformers_cannot_hold_is_refused_by_name",),
    ),
    Mutant(
        "qwen3-norm-topk-prob-ignored",
        "distrain/model/families/moe.py",
        'experts |= {"normalize": hf.get("norm_topk_prob", False), "capacity_factor": 0.0}',
        'experts |= {"normalize": True, "capacity_factor": 0.0}',
        ("tests/test_hf.py::test_import_matches_transformers[qwen3_moe-sharded]",),
    ),
    Mutant(
        "qwen3-qk-norm-gains-unpermuted",
        "distrain/model/families/llama.py",
        '(f"{d}.attention.{n}.weight",), heads=1) for n in QK_NORMS]',
        '(f"{d}.attention.{n}.weight",)) for n in QK_NORMS]',
        ("tests/test_hf.py::test_import_matches_transformers[qwen3-sharded]",),
    ),
    Mutant(
        "qk-norm-gains-apart-on-tp-ranks",
        "distrain/model/common.py",
        'plan |= {f"{prefix}.attention.q_norm": per_head, f"{prefix}.attention.k_norm": per_head}',
        "plan |= {}",
        ("tests/test_context_parallel.py::test_context_parallel_matches_one_process[cp2_tp2_ring_qwen3]",),
    ),
    Mutant(
        "gpt2-takes-qk-norm",
        "distrain/driver/validation.py",
        "m.head_dim is None and not m.qk_norm,",
        "True,",
        ("tests/test_config.py::test_each_rule_refuses_in_its_own_words[qk norm in gpt2]",),
    ),
    Mutant(
        "hf-expert-slices-shifted",
        "distrain/model/families/moe.py",
        '(f"{d}.experts.{w}",), expert=e)',
        '(f"{d}.experts.{w}",), expert=(e + 1) % cfg.moe.num_experts)',
        ("tests/test_hf.py::test_import_matches_transformers",),
    ),
    Mutant(
        "moe-rows-to-wrong-expert",
        "distrain/model/moe.py",
        "counts = torch.bincount(chosen.flatten(), minlength=m.num_experts)",
        "counts = torch.bincount(chosen.flatten(), minlength=m.num_experts).flip(0)",
        ("tests/test_moe_layer.py::test_the_layer_is_each_token_through_its_chosen_experts",),
    ),
    Mutant(
        "moe-capacity-one-over",
        "distrain/model/moe.py",
        "starts.repeat_interleave(counts) < capacity",
        "starts.repeat_interleave(counts) <= capacity",
        ("tests/test_moe_layer.py::test_an_expert_over_capacity_drops_its_last_tokens_and_counts_them",),
    ),
    Mutant(
        "moe-aux-loss-unscaled",
        "distrain/model/moe.py",
        "return grad, torch.full_like(loss, AuxLoss.scale)",
        "return grad, torch.ones_like(loss)",
        ("tests/test_moe_layer.py::test_the_auxiliary_losses_gradient_is_that_of_adding_them_to_the_loss",),
    ),
    Mutant(
        "moe-load-not-summed-over-ranks",
        "distrain/parallel/routing.py",
        "            dist.all_reduce(figures, group=group)",
        "            pass",
        ("tests/test_moe.py::test_moe_trains_as_one_process[bias-hsdp]",),
    ),
    Mutant(
        "moe-shares-of-a-sequence-share",
        "distrain/model/moe.py",
        "            dist.all_reduce(share, group=self.sequence_group)",
        "            pass",
        ("tests/test_moe.py::test_moe_trains_as_one_process[aux-cp]",),
    ),
    Mutant(
        "pipeline-shape-inference-counted",
        "distrain/parallel/parallelize.py",
        "            with loss_context(self.vocab_sharded_loss):\n                self.pipeline.step(x, y)",
        "            with loss_context(self.vocab_sharded_loss):\n                pass",
        ("tests/test_moe.py::test_moe_trains_as_one_process[deep-ppep2]",),
    ),
    Mutant(
        "ep-tokens-to-wrong-rank",
        "distrain/parallel/expert_parallel.py",
        "send = counts.reshape(ep, local)  # row r",
        "send = counts.reshape(ep, local).roll(1, 0)  # row r",
        ("tests/test_moe.py::test_moe_trains_as_one_process[aux-ep4]",),
    ),
    Mutant(
        "ep-expert-grads-not-averaged",
        "distrain/parallel/expert_parallel.py",
        "            dist.all_reduce(flat, group=self.group)",
        "            pass",
        ("tests/test_moe.py::test_moe_trains_as_one_process[bias-dp2ep2]",),
    ),
    Mutant(
        "ep-zero3-expert-grads-divided-by-ep-rest",
        "distrain/parallel/data_parallel.py",
        "experts.set_gradient_divide_factor(float(on.layout.gradient_width))",
        "experts.set_gradient_divide_factor(float(shards.size()))",
        ("tests/test_moe.py::test_moe_trains_as_one_process[bias-zero3ep2]",),
    ),
    Mutant(
        "ep-zero3-expert-grads-reduced-twice",
        "distrain/parallel/expert_parallel.py",
        "        if self.by_fsdp:\n",
        "        if False:\n",
        ("tests/test_moe.py::test_moe_trains_as_one_process[bias-zero3ep2]",),
    ),
    Mutant(
        "ep-zero3-experts-left-whole",
        "distrain/parallel/mesh.py",
        'if not self.sharded or mesh is None or mesh["ep_shard"].size() == 1:',
        "if True:",
        ("tests/test_expert_parallel.py::test_under_zero3_the_experts_are_sharded_over_the_ranks_holding_them",),
    ),
    Mutant(
        "ep-hsdp-experts-sharded-across-replicas",
        "distrain/strategy/expert_parallel.py",
        "    within = layout.gradient_width // layout.dp_replicate\n",
        "    within = layout.gradient_width\n",
        ("tests/test_expert_parallel.py::test_expert_parallelism_borrows_consecutive_ranks_of_the_gradient_group",),
    ),
    Mutant(
        "ep-zero1-experts-not-stepped",
        "distrain/train/optim.py",
        "return zero + ([cls(apart, **options)] if apart else [])",
        "return zero",
        ("tests/test_moe.py::test_moe_trains_as_one_process[bias-zero1ep2]",),
    ),
    Mutant(
        "ep-experts-of-one-stage-summed",
        "distrain/parallel/expert_parallel.py",
        "earlier = on.experts.modules if on.experts is not None else []",
        "earlier = []",
        ("tests/test_moe.py::test_moe_trains_as_one_process[deep-ppep2]",),
    ),
    Mutant(
        "ep-pipeline-replicates-the-experts",
        "distrain/parallel/data_parallel.py",
        "replicate(model, mesh=dp_mesh, mp_policy=mixed_precision(bf16), ignored_params=ignored or None)",
        "replicate(model, mesh=dp_mesh, mp_policy=mixed_precision(bf16))",
        ("tests/test_moe.py::test_moe_trains_as_one_process[deep-ppep2]",),
    ),
    Mutant(
        "ep-replicas-of-other-experts",
        "distrain/strategy/layout.py",
        'return (*(v for k, v in c.items() if k != "dp_replicate"), self.expert_rank(rank))',
        'return (*(v for k, v in c.items() if k != "dp_replicate"), 0)',
        (
            "tests/test_expert_parallel.py::test_expert_parallelism_borrows_consecutive_ranks_of_the_gradient_group",
            "tests/test_peer_recovery.py::test_a_killed_rank_costs_only_the_step_in_flight[ddp_ep]",
        ),
    ),
    Mutant(
        "ep-resume-wrong-expert-slice",
        "distrain/parallel/mesh.py",
        "grid = ranks.reshape(-1, *split, layout.ep)",
        "grid = ranks.reshape(-1, *split, layout.ep).flip(-1)",
        ("tests/test_moe.py::test_a_checkpoint_resumes_under_another_ep[ep4-to-ep2]",),
    ),
    Mutant(
        "ep-alltoall-own-rows-counted",
        "distrain/parallel/traffic.py",
        "return row * (sum(in_rows) - in_rows[me]), row * (sum(out_rows) - out_rows[me])",
        "return row * sum(in_rows), row * sum(out_rows)",
        ("tests/test_expert_parallel.py::test_each_rank_sends_what_its_routing_says",),
    ),
    Mutant(
        "ep-alltoall-estimate-forward-only",
        "distrain/strategy/expert_parallel.py",
        "layers * tokens * c.moe.top_k * c.dim * element * 2 * 2",
        "layers * tokens * c.moe.top_k * c.dim * element * 2",
        ("tests/test_expert_parallel.py::test_each_rank_sends_what_its_routing_says",),
    ),
    Mutant(
        "moe-bias-moves-away-from-the-mean",
        "distrain/model/moe.py",
        "self.expert_bias += self.m.bias_rate * torch.sign(load.mean() - load)",
        "self.expert_bias -= self.m.bias_rate * torch.sign(load.mean() - load)",
        ("tests/test_moe_balance.py::test_balancing_lowers_the_load_imbalance",),
    ),
    Mutant(
        "moe-aux-loss-raises-the-imbalance",
        "distrain/model/moe.py",
        "return grad, torch.full_like(loss, AuxLoss.scale)",
        "return grad, torch.full_like(loss, -AuxLoss.scale)",
        ("tests/test_moe_balance.py::test_balancing_lowers_the_load_imbalance",),
    ),
    Mutant(
        "config-dir-not-checked",
        "distrain/driver/cli.py",
        "if not Path(given).is_dir():",
        "if False:",
        ("tests/test_package.py::test_a_users_preset_comes_from_config_dir",),
    ),
    Mutant(
        "config-dir-not-searched",
        "distrain/driver/cli.py",
        "return CONF_DIR, Path(given).resolve()",
        "return (CONF_DIR,)",
        ("tests/test_package.py::test_a_users_preset_comes_from_config_dir",),
    ),
    Mutant(
        "sweep-glob-misses-user-presets",
        "distrain/driver/sweep.py",
        "loader = SearchingLoader(GlobalHydra.instance().config_loader(), self.searchpath)",
        "loader = GlobalHydra.instance().config_loader()",
        ("tests/test_package.py::test_a_users_preset_comes_from_config_dir",),
    ),
    Mutant(
        "wheelhouse-without-a-checkout",
        "distrain/commands/wheelhouse.py",
        'if not (ROOT / "pyproject.toml").is_file():',
        "if False:",
        ("tests/test_wheelhouse.py::test_an_installed_distrain_sends_you_to_a_checkout",),
    ),
    Mutant(
        "presets-left-out-of-the-wheel",
        "pyproject.toml",
        'distrain = ["conf/*.yaml", "conf/*/*.yaml"]',
        "distrain = []",
        ("tests/test_package.py::test_the_wheel_installs_and_composes_outside_the_checkout",),
    ),
    Mutant(
        "checkpoint-without-the-version",
        "distrain/storage/checkpoint.py",
        '{**meta, "distrain_version": __version__}',
        "meta",
        ("tests/test_package.py::test_ray_job_submit_installs_the_wheel_and_trains",),
    ),
    Mutant(
        "summary-without-the-version",
        "distrain/storage/tracking.py",
        '{**summary, "distrain_version": __version__}',
        "summary",
        ("tests/test_package.py::test_ray_job_submit_installs_the_wheel_and_trains",),
    ),
    Mutant(
        "moe-tp-router-split-like-a-dense-mlp",
        "distrain/model/moe.py",
        '        f"{name}.router": Replicated(),',
        '        f"{name}.router": ColwiseParallel(),',
        ("tests/test_moe.py::test_moe_trains_as_one_process[aux-tp2]",),
    ),
    Mutant(
        "moe-tp-output-summed-over-tp",
        "distrain/model/moe.py",
        "            output_layouts=(Replicate(),),",
        '            output_layouts=(__import__("torch.distributed.tensor").distributed.tensor.Partial(),),',
        ("tests/test_moe.py::test_moe_trains_as_one_process[aux-tp2]",),
    ),
    Mutant(
        "tpep-experts-replicated-by-fsdp2",
        "distrain/parallel/data_parallel.py",
        "    return apply_replicate(model, mesh, on.bf16, set(own))",
        "    return apply_replicate(model, mesh, on.bf16)",
        ("tests/test_moe.py::test_moe_trains_as_one_process[bias-tpep2]",),
    ),
    Mutant(
        "moe-tp-shared-width-unchecked",
        "distrain/strategy/tensor_parallel.py",
        "    if m.moe.num_experts and m.moe.shared_experts:",
        "    if False:",
        ("tests/test_moe_layer.py::test_a_moe_setting_that_cannot_work_is_refused_in_one_line",),
    ),
    Mutant(
        "loss-chunk-negative-accepted",
        "distrain/driver/validation.py",
        "    require(t.loss_chunk >= 0,",
        "    require(True,",
        ("tests/test_config.py::test_each_rule_refuses_in_its_own_words[loss chunk]",),
    ),
    Mutant(
        "chunked-loss-takes-any-model",
        "distrain/parallel/chunked_loss.py",
        '        if not hasattr(model, "head_skipped"):',
        "        if False:",
        ("tests/test_chunked_loss.py::test_a_model_that_cannot_leave_its_head_is_refused_in_one_line",),
    ),
    Mutant(
        "learner-ignores-loss-chunk",
        "distrain/train/learner.py",
        "collective, loss_chunk=chunk, float8",
        "collective, loss_chunk=0, float8",
        ("tests/test_chunked_loss.py::test_one_process_gives_todays_loss_and_gradients_without_holding_the_logits",),
    ),
    Mutant(
        "chunked-loss-keeps-the-logits",  # no recomputation: each slice's logits saved for the backward
        "distrain/parallel/chunked_loss.py",
        "            part = checkpoint(self._slice, h, y, use_reentrant=False, preserve_rng_state=False)",
        "            part = self._slice(h, y)",
        ("tests/test_chunked_loss.py::test_one_process_gives_todays_loss_and_gradients_without_holding_the_logits",),
    ),
    Mutant(
        "chunked-loss-slices-weighed-alike",  # the short last slice counted as a full one
        "distrain/parallel/chunked_loss.py",
        "(y.numel() / total)",
        "(width * hidden.shape[0] / total)",
        ("tests/test_chunked_loss.py::test_one_process_gives_todays_loss_and_gradients_without_holding_the_logits",),
    ),
    Mutant(
        "float8-any-recipe",
        "distrain/strategy/float8.py",
        'require(f8 in ("none", *RECIPES),',
        "require(True,",
        ("tests/test_float8.py::test_bad_float8_settings_are_refused_before_anything_starts",),
    ),
    Mutant(
        "float8-without-torchao",
        "distrain/strategy/float8.py",
        'importlib.util.find_spec("torchao") is not None,',
        "True,",
        ("tests/test_float8.py::test_bad_float8_settings_are_refused_before_anything_starts",),
    ),
    Mutant(
        "float8-on-the-grid",
        "distrain/strategy/float8.py",
        's.tp == 1 or s.tp_mode == "1d",',
        "True,",
        ("tests/test_float8.py::test_bad_float8_settings_are_refused_before_anything_starts",),
    ),
    Mutant(
        "float8-on-an-a100",
        "distrain/strategy/float8.py",
        "FP8_CAPABILITY = (8, 9)",
        "FP8_CAPABILITY = (8, 0)",
        ("tests/test_float8.py::test_a_gpu_without_float8_tensor_cores_is_refused_in_one_line",),
    ),
    Mutant(
        "float8-head-converted",
        "distrain/strategy/float8.py",
        'if fqn.split(".")[0] in output_modules:',
        "if False:",
        (
            "tests/test_float8.py::test_the_rule_converts_aligned_linears_but_the_head_and_routers",
            "tests/test_float8.py::test_float8_converts_the_blocks_and_trains_as_fp32_does",
        ),
    ),
    Mutant(
        "float8-fsdp2-gathers-high-precision",
        "distrain/parallel/float8.py",
        "enable_fsdp_float8_all_gather=gather,",
        "enable_fsdp_float8_all_gather=False,",
        ("tests/test_float8.py::test_fsdp2_and_tensor_parallel_float8_match_one_process",),
    ),
    Mutant(
        "float8-gathered-under-tp",
        "distrain/strategy/float8.py",
        " and layout.tp == 1",
        "",
        ("tests/test_float8.py::test_the_plan_lists_the_converted_modules",),
    ),
    Mutant(
        "float8-checkpoint-keeps-the-wrapper",
        "distrain/train/state.py",
        "model_sd = {k: unwrapped(v) for k, v in model_sd.items()}",
        "model_sd = dict(model_sd)",
        ("tests/test_float8.py::test_fsdp2_and_tensor_parallel_float8_match_one_process",),
    ),
    Mutant(
        "lora-rank-unchecked",
        "distrain/driver/finetune.py",
        "require(lora.rank >= 0,",
        "require(True,",
        ("tests/test_lora.py::test_refused_in_one_line",),
    ),
    Mutant(
        "lora-alpha-unchecked",
        "distrain/driver/finetune.py",
        "require(lora.alpha > 0,",
        "require(True,",
        ("tests/test_lora.py::test_refused_in_one_line",),
    ),
    Mutant(
        "lora-dropout-unchecked",
        "distrain/driver/finetune.py",
        "require(0 <= lora.dropout < 1,",
        "require(True,",
        ("tests/test_lora.py::test_refused_in_one_line",),
    ),
    Mutant(
        "lora-targets-unchecked",
        "distrain/driver/finetune.py",
        "        bool(lora.targets) and not unknown,",
        "        True,",
        ("tests/test_lora.py::test_refused_in_one_line",),
    ),
    Mutant(
        "lora-ps-unchecked",
        "distrain/driver/finetune.py",
        "        cfg.ps.mode is None,",
        "        True,",
        ("tests/test_lora.py::test_refused_in_one_line",),
    ),
    Mutant(
        "lora-grid-tp-unchecked",
        "distrain/driver/finetune.py",
        '        s.tp == 1 or s.tp_mode == "1d",',
        "        True,",
        ("tests/test_lora.py::test_refused_in_one_line",),
    ),
    Mutant(
        "lora-ep-unchecked",
        "distrain/driver/finetune.py",
        "        s.ep == 1 or LORA_EXPERTS in lora.targets,",
        "        True,",
        ("tests/test_lora.py::test_refused_in_one_line",),
    ),
    Mutant(
        "lora-other-adapters-resumed",
        "distrain/driver/finetune.py",
        "saved == wanted or not",
        "True or not",
        ("tests/test_lora.py::test_a_checkpoint_of_other_adapters_or_of_another_base_is_refused",),
    ),
    Mutant(
        "lora-another-base-resumed",
        "distrain/driver/finetune.py",
        'meta.get("base") == base,',
        "True,",
        ("tests/test_lora.py::test_a_checkpoint_of_other_adapters_or_of_another_base_is_refused",),
    ),
    Mutant(
        "lora-with-float8",
        "distrain/driver/finetune.py",
        '        cfg.trainer.float8 == "none",',
        "        True,",
        ("tests/test_lora.py::test_refused_in_one_line",),
    ),
    Mutant(
        "lora-no-target-in-driver",
        "distrain/driver/finetune.py",
        "        adapter_params(cfg) > 0,",
        "        True,",
        ("tests/test_lora.py::test_refused_in_one_line",),
    ),
    Mutant(
        "lora-no-target-unchecked",
        "distrain/model/lora.py",
        "    if not chosen:",
        "    if False:",
        ("tests/test_lora.py::test_targets_matching_nothing_and_an_unknown_split_are_refused",),
    ),
    Mutant(
        "lora-any-split",
        "distrain/model/lora.py",
        "    if kind is None:",
        "    if False:",
        ("tests/test_lora.py::test_targets_matching_nothing_and_an_unknown_split_are_refused",),
    ),
    Mutant(
        "lora-adapter-nowhere",
        "distrain/model/lora_hf.py",
        "    if missing:",
        "    if False:",
        ("tests/test_lora.py::test_an_adapter_without_a_place_in_hf_is_refused_in_one_line",),
    ),
    Mutant(
        "lora-base-trained",
        "distrain/model/lora.py",
        "        p.requires_grad_(is_adapter(name))",
        "        p.requires_grad_(True)",
        ("tests/test_lora.py::test_the_base_never_moves_and_only_the_adapters_train",),
    ),
    Mutant(
        "lora-fused-rank",
        "distrain/model/lora_hf.py",
        "torch.block_diag(*b)",
        "torch.cat(b, 1)",
        ("tests/test_lora.py::test_the_adapter_loads_into_peft_and_merges",),
    ),
    Mutant(
        "lora-experts-adapters-unused",
        "distrain/model/lora.py",
        "        return super().project(name, x, counts) + adapted * self.scale",
        "        return super().project(name, x, counts)",
        (
            "tests/test_lora.py::test_the_base_never_moves_and_only_the_adapters_train",
            "tests/test_lora_experts.py::test_zero3_over_expert_parallelism_trains_the_expert_adapters_as_one_process",
        ),
    ),
    Mutant(
        "lora-experts-peft-order",
        "distrain/model/lora_hf.py",
        "b.permute(1, 2, 0)",
        "b.permute(1, 0, 2)",
        ("tests/test_lora.py::test_the_adapter_loads_into_peft_and_merges",),
    ),
    Mutant(
        "lora-experts-uncounted",
        "distrain/driver/finetune.py",
        "    return sum(3 * lora.rank * n * (dim + hidden)",
        "    return 0 * sum(3 * lora.rank * n * (dim + hidden)",
        ("tests/test_lora.py::test_the_plan_counts_the_adapters_and_their_memory",),
    ),
    Mutant(
        "lora-qwen3-dense-mlp-misread",
        "distrain/model/lora_hf.py",
        "    if misread:",
        "    if False:",
        ("tests/test_lora.py::test_an_adapter_without_a_place_in_hf_is_refused_in_one_line",),
    ),
    Mutant(
        "plan-lora-trains-whole-experts",
        "distrain/driver/plan.py",
        "        mine_trained = -(-mine * on_experts // apart) if apart else 0",
        "        mine_trained = mine",
        ("tests/test_memory.py::test_plan_memory_matches_a_measured_step",),
    ),
    Mutant(
        "plan-logits-on-every-stage",
        "distrain/driver/plan.py",
        "    if layout.num_stages - 1 not in layout.stages(pp_rank):",
        "    if False:",
        ("tests/test_plan.py::test_the_loss_logits_are_what_a_step_holds",),
    ),
    Mutant(
        "plan-logits-fp32-once",
        "distrain/driver/plan.py",
        "LOGIT_BYTES = 12 ",
        "LOGIT_BYTES = 4 ",
        ("tests/test_plan.py::test_the_loss_logits_are_what_a_step_holds",),
    ),
    Mutant(
        "mirror-pruned-as-whole-checkpoints",
        "distrain/storage/remote.py",
        "    checkpoint.prune(root, keep, step, whole=lambda path: (path / COMMIT_MARKER).exists())",
        "    checkpoint.prune(root, keep, step)",
        ("tests/test_checkpoint.py::test_a_nodes_mirror_of_a_store_is_pruned_though_it_holds_only_its_ranks_files",),
    ),
    Mutant(
        "ps-failed-upload-left-behind",
        "distrain/ps/saved.py",
        "    finally:\n        (directory / file).unlink(missing_ok=True)",
        "    else:\n        (directory / file).unlink(missing_ok=True)",
        ("tests/test_ps.py::test_a_servers_file_whose_upload_failed_is_not_left_on_its_node",),
    ),
    Mutant(
        "tp-unfreezes-norms",
        "distrain/parallel/tensor_parallel.py",
        "        p.requires_grad_(trained[name])",
        "        pass",
        ("tests/test_lora.py::test_resumes_on_the_same_base_and_refuses_another",),
    ),
    Mutant(
        "lora-base-checkpointed",
        "distrain/train/state.py",
        "if k not in learner.frozen}",
        "if k}",
        ("tests/test_lora.py::test_the_checkpoint_holds_the_adapters_and_exports_to_peft",),
    ),
    Mutant(
        "muon-ns-steps-unchecked",
        "distrain/driver/optim_rules.py",
        "require(o.ns_steps >= 1,",
        "require(True,",
        ("tests/test_config.py::test_each_rule_refuses_in_its_own_words[muon ns steps]",),
    ),
    Mutant(
        "muon-params-unchecked",
        "distrain/driver/optim_rules.py",
        "require(o.muon_params in MUON_PARAMS,",
        "require(True,",
        ("tests/test_config.py::test_each_rule_refuses_in_its_own_words[muon params]",),
    ),
    Mutant(
        "muon-on-the-parameter-server",
        "distrain/driver/optim_rules.py",
        """        cfg.ps.mode is None,
        "optim=muon needs""",
        """        True,
        "optim=muon needs""",
        ("tests/test_config.py::test_each_rule_refuses_in_its_own_words[muon on ps]",),
    ),
    Mutant(
        "muon-on-the-grid",
        "distrain/driver/optim_rules.py",
        's.tp == 1 or s.tp_mode == "1d",',
        "True,",
        ("tests/test_config.py::test_each_rule_refuses_in_its_own_words[muon on the grid]",),
    ),
    Mutant(
        "muon-shards-orthogonalised-in-pieces",
        "distrain/train/muon.py",
        "if isinstance(u, DTensor) and any(splits(p) for p in u.placements):",
        "if False:",
        ("tests/test_muon.py::test_every_layout_trains_as_one_process",),
    ),
    Mutant(
        "muon-shards-sent-back-to-the-wrong-matrix",
        "distrain/train/muon.py",
        ".to_local()[: len(chunk)].to(home)",
        ".to_local().flip(0)[: len(chunk)].to(home)",
        ("tests/test_muon.py::test_every_layout_trains_as_one_process",),
    ),
    Mutant(
        "muon-takes-embeddings-and-head",
        "distrain/train/optim.py",
        'return p.ndim == 2 and (which == "matrices" or "layers" in name.split("."))',
        "return p.ndim == 2",
        ("tests/test_muon.py::test_muon_takes_the_blocks_matrices_and_trains_as_the_published_algorithm",),
    ),
    Mutant(
        "muon-update-not-rms-matched",
        "distrain/train/muon.py",
        'alpha=-group["lr"] * RMS_MATCH * math.sqrt(max(p.shape))',
        'alpha=-group["lr"]',
        ("tests/test_muon.py::test_muon_takes_the_blocks_matrices_and_trains_as_the_published_algorithm",),
    ),
    Mutant(
        "zero1-empty-group-loaded",
        "distrain/train/state.py",
        'o.param_groups = [g for g in o.param_groups if g["params"]]',
        "pass",
        (
            "tests/test_checkpoint_state.py::test_every_layout_checkpoints_only_tensors_and_plain_data_save_after_save",
            "tests/test_muon.py::test_a_muon_run_resumes_under_another_layout_as_one_process_trains",
        ),
    ),
)


def mutated_copy(mutant: Mutant, into: Path) -> Path:
    """The tree (no virtual environment, no git, no runs) copied into `into` with the mutant's bug put in; npm's
    packages (Azurite: 360 MB) linked, not copied."""
    skip = shutil.ignore_patterns(
        ".venv", ".git", "runs", "outputs", "__pycache__", ".pytest_cache", "*.egg-info", ".npm"
    )
    tree = into / "tree"
    shutil.copytree(REPO, tree, ignore=skip, symlinks=True)
    if (REPO / ".npm").exists():
        (tree / ".npm").symlink_to(REPO / ".npm")
    path = tree / mutant.file
    text = path.read_text()
    if text.count(mutant.old) != 1:
        raise SystemExit(f"mutant {mutant.name}: {mutant.file} holds its text {text.count(mutant.old)} times, not once")
    path.write_text(text.replace(mutant.old, mutant.new))
    return tree


def run(mutant: Mutant, timeout_s: float) -> tuple[bool, float, str]:
    """Whether the mutant's tests failed with its bug in (caught), their seconds, and pytest's last line."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        tree = mutated_copy(mutant, Path(tmp))
        args = [a for t in mutant.tests for a in (t.split(" ", 1) if t.startswith("-k ") else [t])]
        env = {**os.environ, "PYTHONPATH": str(tree)}  # before the editable install: the copy's distrain
        start = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args],
                cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return False, time.monotonic() - start, f"timed out after {timeout_s:.0f} s"
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        return done.returncode == 1, time.monotonic() - start, lines[-1] if lines else done.stderr[-300:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutant's tests")
    args = parser.parse_args()
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"no mutant named {', '.join(unknown)}; known: {', '.join(known)}")
    missed = 0
    for mutant in [known[n] for n in args.names] or MUTANTS:
        caught, seconds, last = run(mutant, args.timeout)
        missed += not caught
        print(f"{'caught' if caught else 'MISSED'}  {mutant.name:<28} {seconds:6.1f} s  {last}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
