"""The collect and score stages of the step: draw contexts, sample G replies each, score them with
the rewards, and keep what the rollout stages (mmrl.stages) keep.

The collector holds what collecting moves: the group-id counter, the training rewards (whose state
moves with training) and, under torchrun, a fault (a reward's, or sampling's) to raise on every rank
together.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from mmrl import distributed
from mmrl.distributed import Dist
from mmrl.rewards import Reward, RewardFailure, build_reward, check_finite_reward
from mmrl.rollout import NonFiniteSampling, Rollout
from mmrl.run_config import RunConfig
from mmrl.stages import RolloutStage


class Collector:
    def __init__(self, cfg: RunConfig, policy, task, dist: Dist, stages: list[RolloutStage], generator: torch.Generator,
                 autocast, whole_model, warn):
        self.cfg, self.policy, self.task, self.dist = cfg, policy, task, dist
        self.stages = stages
        self.filters = [s for s in stages if s.is_filter]
        self.generator = generator  # the sampling stream
        self.autocast, self.whole_model, self.warn = autocast, whole_model, warn
        self.device = policy.device
        self.rewards = self.build_rewards()
        self.group_offset = 0
        self.filler: Rollout | None = None  # FSDP: a sampled row to pad a rank's batch with (Updater.pad_rows)
        self.fault: RewardFailure | NonFiniteSampling | None = None  # under torchrun, raised on every rank at once
        # How many items each rank's value of a metric is a mean over (see distributed.reduce_metrics).
        self.metric_weights: dict[str, float] = {}
        self.summed_metrics: set[str] = set()  # rewards' per-call counts: summed over ranks

    def build_rewards(self) -> list[tuple[str, float, Reward]]:
        """(name, weight, Reward) for each configured reward, freshly built (no state yet)."""
        return [(r.name, r.weight, build_reward(r.name, r.params)) for r in self.cfg.rewards]

    def sample(self, contexts: list[Any], group_size: int, generator: torch.Generator, first_group: int = 0,
               temperature: float | None = None) -> Rollout:
        """The policy's G samples per context, with group ids stamped (here, and nowhere else). With
        `rollout.batch_size`, each sampler call takes at most that many rows (whole groups, one at
        least), so its KV cache and activations are bounded whatever the step's batch."""
        rows = self.cfg.rollout.batch_size
        per_call = max(1, rows // group_size) if rows > 0 else max(1, len(contexts))
        with self.autocast, self.whole_model():
            parts = [self.policy.sample(contexts[lo:lo + per_call], group_size, generator=generator,
                                        temperature=temperature) for lo in range(0, len(contexts), per_call) or [0]]
        rollout = Rollout.concat(parts).stamp_groups(group_size, first_group)
        fault = nonfinite_sampling(rollout)
        if fault is not None:
            self.fault_met(fault)
        return rollout

    def score(self, rollout: Rollout, rewards: list[tuple[str, float, Reward]] | None = None,
              outputs: list | None = None) -> torch.Tensor:
        """Fill rollout.rewards with each reward component and their weighted "total"; `rewards`
        defaults to the training rewards, `outputs` to the rollout decoded."""
        if outputs is None:
            outputs = self.policy.decode(rollout)
        total = torch.zeros(len(rollout), device=self.device)
        for name, weight, reward in rewards or self.rewards:
            try:
                r = reward(rollout.contexts, outputs).to(self.device, torch.float32)
                check_finite_reward(name, r, rollout.contexts, outputs)
            except RewardFailure as fault:
                self.fault_met(fault)
                r = torch.zeros(len(rollout), device=self.device)  # under torchrun, until raise_faults
            rollout.rewards[name] = r
            total = total + weight * r
        rollout.rewards["total"] = total
        return total

    def fault_met(self, fault: RewardFailure | NonFiniteSampling) -> None:
        """Raise `fault` at once in one process. Under torchrun the other ranks are headed for
        collectives: keep it (the first) and go on, to raise on every rank together (raise_faults)."""
        if not self.dist.active:
            raise fault
        self.fault = self.fault or fault

    def raise_faults(self) -> None:
        """Raise the fault any rank met (the first rank's, as a reward's or sampling's), on every rank;
        called where all ranks meet."""
        if not self.dist.active:
            return
        mine = None if self.fault is None else (isinstance(self.fault, NonFiniteSampling), str(self.fault))
        self.fault = None
        first = distributed.first_message(self.dist, mine)
        if first is not None:
            sampling, message = first
            raise (NonFiniteSampling if sampling else RewardFailure)(message)

    def draw_contexts(self, n_fresh: int, n_replayed: int, sampling: bool) -> tuple[list[Any], int] | None:
        """This rank's `n_fresh` new contexts and the group id of its first context (its replayed
        contexts come first), or None when no rank samples this round. Every rank draws the whole
        round's contexts from the same stream (the task is seeded alike on every rank) and keeps its
        own slice, so ranks see disjoint contexts, the data cursor is one for all ranks, and N ranks
        draw what one process drawing their total would."""
        counts = distributed.all_gather_ints(self.dist, [n_fresh, n_replayed, int(sampling)])
        if not any(c[2] for c in counts):
            return None
        fresh = [c[0] for c in counts]
        groups = [c[0] + c[1] for c in counts]
        contexts = self.task.next_batch(sum(fresh))
        start = sum(fresh[: self.dist.rank])
        first_group = self.group_offset + sum(groups[: self.dist.rank])
        self.group_offset += sum(groups)
        return contexts[start: start + n_fresh], first_group

    def collect(self, step: int) -> tuple[Rollout, dict[str, float]]:
        """Sample one batch of groups; with filters (mmrl.stages), re-sample until enough groups
        survive or `algo.max_sampling_tries` is hit (then say so in the metrics)."""
        P, G = self.cfg.train.prompts_per_step, self.cfg.sampling.group_size
        parts, kept_groups, tries, stats = [], 0, 0, defaultdict(float)
        self.metric_weights = {}  # this step's reward metrics' weights only
        for stage in self.stages:
            stage.begin()
        for round_ in range(max(1, self.cfg.algo.max_sampling_tries)):
            # With several ranks every rank takes part in every round (the draw is collective); a
            # rank that has its groups samples nothing.
            need = P if round_ == 0 or (self.filters and kept_groups < P) else 0
            if round_ > 0 and not self.filters:
                break
            t0 = time.perf_counter()
            replayed = [c for stage in self.stages for c in stage.replayed(need)]
            drawn = self.draw_contexts(need - len(replayed), len(replayed), sampling=need > 0)
            if drawn is None:  # no rank needs more
                break
            if not need:
                continue
            fresh, first_group = drawn
            rollout = self._sample_round(replayed + fresh, len(replayed), first_group, stats, t0)
            if tries == 0:  # the raw batch's rewards (every rank's rows) are what the policy currently earns
                stats.update(self._reward_stats(rollout))
            tries += 1
            keep = torch.ones(len(rollout), dtype=torch.bool, device=self.device)
            for f in self.filters:
                keep &= f.keep(rollout)
            parts.append(rollout.select(keep) if self.filters else rollout)
            kept_groups += int(keep.sum()) // G
        batch = Rollout.concat(parts)
        for stage in self.stages:
            stats.update(stage.summary())
        if self.filters:
            batch = self._trim(batch, kept_groups, tries, stats, step)
        self.raise_faults()
        return batch, dict(stats)

    def _sample_round(self, contexts: list[Any], n_replayed: int, first_group: int, stats: dict[str, float],
                      t0: float) -> Rollout:
        """One round's rollout of `contexts` (the first `n_replayed` replayed): sampled, scored and
        shown to the rollout stages; `t0` is when the round's draw began (sampling time counts it)."""
        rollout = self.sample(contexts, self.cfg.sampling.group_size, self.generator, first_group=first_group)
        if self.dist.fsdp and self.filler is None:
            self.filler = rollout.select(torch.arange(1, device=self.device))
        stats["time/sample"] += time.perf_counter() - t0
        stats["gen_tokens"] += float(rollout.mask.sum())
        t0 = time.perf_counter()
        self.score(rollout)
        stats["time/reward"] += time.perf_counter() - t0
        for stage in self.stages:
            stage.observe(rollout, n_replayed, stats)
        return rollout

    def _reward_stats(self, rollout: Rollout) -> dict[str, float]:
        """Reward statistics of the batch over every rank's rows, and each reward's own metrics."""
        names = list(rollout.rewards)
        whole, _ = distributed.gather_rows(self.dist, [rollout.rewards[k] for k in names])
        stats = reward_stats(dict(zip(names, whole)))
        for name, _, reward in self.rewards:
            stats.update({f"reward/{name}/{k}": v for k, v in reward.metrics().items()})
            self.metric_weights.update({f"reward/{name}/{k}": w for k, w in reward.metric_weights().items()})
            self.summed_metrics.update(f"reward/{name}/{k}" for k in reward.counted_metrics())
        return stats

    def _trim(self, batch: Rollout, kept_groups: int, tries: int, stats: dict[str, float], step: int) -> Rollout:
        """The filtered batch cut to exactly `train.prompts_per_step` groups (the first ones, in
        sampling order), with the filtering's metrics; a warning when fewer were kept."""
        P, G = self.cfg.train.prompts_per_step, self.cfg.sampling.group_size
        stats["sampling/tries"] = tries
        stats["sampling/kept_groups"] = min(kept_groups, P)
        if kept_groups < P:
            stats["sampling/short_groups"] = P - kept_groups
            self.warn(f"step {step}: only {kept_groups} of {P} groups kept after {tries} tries",
                      kind="fewer groups than train.prompts_per_step kept after filtering")
        if kept_groups > P:
            batch = batch.select(torch.arange(P * G, device=self.device))
        return batch

    @torch.no_grad()
    def evaluate_rewards(self, contexts: list[Any], samples: int) -> dict[str, float]:
        """Mean rewards on the held-out `contexts`: greedy (`eval/<reward>`), and with `samples` > 0
        also over that many samples each at the training temperature (`eval/sampled_<reward>`), the
        reward the policy actually earns. Each rank scores its block of the held-out set (greedy
        scores equal one process's; the samples come from each rank's own stream, so they are a
        sample of the same distribution, not the same draw)."""
        mine = contexts[distributed.rank_block(len(contexts), self.dist)]
        gen = torch.Generator(device=self.device).manual_seed(12345)
        # Rewards built afresh: every evaluation draws the same (e.g. questions), and training's
        # rewards keep their state, so evaluating never changes what training sees.
        rewards = self.build_rewards()
        names = [name for name, _, _ in rewards] + ["total"]
        rollout, outputs = None, []
        if mine:
            rollout = self.sample(mine, 1, gen, temperature=0.0)
            outputs = self.policy.decode(rollout)
            self.score(rollout, rewards, outputs)
        scores, lengths = self._gather_scores(rollout, names)
        result = {f"eval/{k}": v.mean().item() for k, v in scores.items()}
        outputs = distributed.gather_objects(self.dist, outputs)
        result.update({f"eval/{k}": v for k, v in self.task.evaluate_outputs(contexts, outputs).items()})
        result["eval/len_mean"] = lengths.float().mean().item()
        if samples > 0:
            sampled = None
            if mine:
                sampled = self.sample(mine, samples, gen)
                self.score(sampled, rewards)
            scores, _ = self._gather_scores(sampled, names)
            result.update({f"eval/sampled_{name}": v.mean().item() for name, v in scores.items()})
        self.raise_faults()
        return result

    def _gather_scores(self, rollout: Rollout | None, names: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Each reward `names`'s scores and the lengths of every rank's evaluation rows, in held-out
        order (`rollout` None: this rank's block is empty)."""
        if rollout is None:
            local = [torch.zeros(0, device=self.device) for _ in names]
            local.append(torch.zeros(0, dtype=torch.long, device=self.device))
        else:
            local = [rollout.rewards[name] for name in names] + [rollout.lengths]
        whole, _ = distributed.gather_rows(self.dist, local)
        return dict(zip(names, whole[:-1])), whole[-1]

    def state_dict(self) -> dict[str, Any]:
        return {"group_offset": self.group_offset, "rewards": [reward.state_dict() for _, _, reward in self.rewards]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.group_offset = state["group_offset"]
        for (_, _, reward), reward_state in zip(self.rewards, state.get("rewards", [])):
            reward.load_state_dict(reward_state)


def nonfinite_sampling(rollout: Rollout) -> NonFiniteSampling | None:
    """The fault of a rollout whose sampled log-probs are NaN / inf on a trained unit (a policy with
    diverged weights samples from non-finite logits, or makes non-finite latents), else None."""
    bad = rollout.mask & ~torch.isfinite(rollout.logp_old)
    n_bad = int(bad.sum())
    if n_bad == 0:
        return None
    return NonFiniteSampling(f"the policy's outputs are not finite: its sampled log-probs are NaN/inf at {n_bad} of "
                             f"{int(rollout.mask.sum())} sampled units, in {int(bad.any(1).sum())} of {len(rollout)} "
                             f"samples (its weights have diverged)")


def reward_stats(rewards: dict[str, torch.Tensor]) -> dict[str, float]:
    """The mean of each reward component over a batch, and the spread of their weighted total."""
    out = {f"reward/{k}": v.mean().item() for k, v in rewards.items()}
    total = rewards["total"]
    out["reward/std"] = total.std().item() if len(total) > 1 else 0.0
    return out

