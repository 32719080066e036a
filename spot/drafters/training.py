"""Training SPOT's order model and SPOT-Sets' set model on recorded draft-free trajectories.

A sample pairs a stale forward (record i) with a hypothesis j steps later in the same block
(record i+j, 1 <= j <= max_lookahead): the features are record i's distribution and record
i+j's mask, the label is what record i+j committed. This is exactly what the drafter sees at
depth j of a tree grown from the stale logits of record i. SPOT evaluates its model once per
tree, at the root (j = 1), and ranks the whole tree from those scores; `root_samples` keeps
the roots alone, labelled with the order of the target's next commits, to train for exactly
that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spot import noise
from spot.drafters.order_model import (
    OrderModel,
    OrderModelConfig,
    noisy_confidence,
    order_features,
)
from spot.drafters.spot_sets import (
    SetModel,
    SetModelConfig,
    exact_set_accuracy,
    set_log_likelihood,
)
from spot.drafters.trajectory import Trajectories


@dataclass(frozen=True)
class OrderSamples:
    features: torch.Tensor  # [N, B, F]
    masked: torch.Tensor  # [N, B] bool
    # [N, H, B] bool, positions committed at each of the H steps from the hypothesis on
    # (nothing past the end of the block)
    following: torch.Tensor
    stale_index: torch.Tensor  # [N] record of the stale forward (for its hidden states)
    token_ids: torch.Tensor  # [N, B] tokens the coupled noise draws at the hypothesis step
    threshold: float  # the threshold rule's confidence bar the trajectories were decoded with

    @property
    def label(self) -> torch.Tensor:
        """[N, B] bool, positions committed next."""
        return self.following[:, 0]

    def to(self, device: torch.device) -> OrderSamples:
        """The same samples with every tensor on `device`."""
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )


def build_samples(
    traj: Trajectories,
    config: OrderModelConfig,
    depths: Sequence[int] | None = None,
    horizon: int = 1,
) -> OrderSamples:
    """Samples at the given hypothesis depths (all of 1..max_lookahead by default), each
    with the target's next `horizon` commits."""
    meta = traj.meta
    steps_per_block = int(meta["steps_per_block"])
    temperature = float(meta.get("temperature", 0.0))
    confidence = meta.get("confidence", "tempered")
    seed = int(meta.get("seed", 0))
    pairs = []
    n = traj.segment.numel()
    for j in range(1, config.max_lookahead + 1) if depths is None else depths:
        i = torch.arange(n - j)
        same = traj.segment[i] == traj.segment[i + j]
        pairs.append(torch.stack([i[same], i[same] + j], dim=1))
    pairs = torch.cat(pairs)
    stale, hyp = pairs[:, 0], pairs[:, 1]
    top_logprobs = traj.top_logprobs[stale]
    top_ids = traj.top_ids[stale]
    masked = traj.masked[hyp]
    assumed = traj.masked[stale] & ~masked
    if temperature == 0.0:
        conf = noisy_confidence(top_logprobs, top_ids, None, 0.0, confidence)
        token_ids = top_ids[..., 0]
    else:
        if meta.get("noise") != noise.GENERATOR:
            raise ValueError(
                f"trajectories recorded at T={temperature} with noise generator "
                f"{meta.get('noise', 'before splitmix64-stream')!r}, not {noise.GENERATOR!r}: "
                "their features cannot be recomputed; record them again"
            )
        vocab = int(meta["vocab_size"])
        b = traj.block_length
        conf = torch.empty(top_logprobs.shape[:2], dtype=torch.float64)
        token_ids = torch.empty(top_logprobs.shape[:2], dtype=top_ids.dtype)
        for r, h in enumerate(hyp.tolist()):
            g = noise.gumbel(seed, int(traj.key[h]), int(traj.step[h]), (b, vocab))
            conf[r] = noisy_confidence(top_logprobs[r], top_ids[r], g, temperature, confidence)
            logp = top_logprobs[r].double() / temperature
            pick = (logp + g.gather(-1, top_ids[r].long())).argmax(-1, keepdim=True)
            token_ids[r] = top_ids[r].gather(-1, pick).squeeze(-1)
    features = order_features(
        top_logprobs,
        masked,
        assumed,
        conf,
        traj.block_step[hyp].float() / steps_per_block,
        (hyp - stale).float(),
        config,
    )
    following = torch.zeros(hyp.numel(), horizon, traj.block_length, dtype=torch.bool)
    for k in range(horizon):
        later = (hyp + k).clamp(max=n - 1)
        inside = (hyp + k < n) & (traj.segment[later] == traj.segment[hyp])
        following[:, k] = traj.committed[later] & inside[:, None]
    threshold = float(meta.get("threshold", 0.9))
    return OrderSamples(features, masked, following, stale, token_ids, threshold)


def root_samples(traj: Trajectories, config: OrderModelConfig) -> OrderSamples:
    """SPOT's samples: every step as a tree's root (one step past its stale forward) with
    the target's next max_lookahead commits."""
    return build_samples(traj, config, depths=(1,), horizon=config.max_lookahead)


def commit_order_log_likelihood(
    logits: torch.Tensor, masked: torch.Tensor, following: torch.Tensor
) -> torch.Tensor:
    """log P of the target's next commits in their order, per sample [N], as a SPOT tree
    reads one row of scores (Plackett-Luce): each step takes one of its committed positions
    with the softmax probability over the positions still masked (a step committing several
    counts as taking any of them), and they all leave. logits [N, B]; masked [N, B];
    following [N, H, B]. With H = 1: the log-likelihood of the next commit."""
    scores = logits.masked_fill(~masked, 0.0)  # finite everywhere: masks select below
    remaining = masked
    total = torch.zeros(logits.shape[0], dtype=logits.dtype)
    for k in range(following.shape[1]):
        step = following[:, k] & remaining
        taken = step.any(-1)
        # untaken rows (the block ended) score 0 without touching -inf: both sets equal
        pool = remaining | ~remaining.any(-1, keepdim=True)
        chosen = torch.where(taken[:, None], step, pool)
        log_z = torch.logsumexp(scores.masked_fill(~pool, float("-inf")), dim=-1)
        log_p = torch.logsumexp(scores.masked_fill(~chosen, float("-inf")), dim=-1) - log_z
        total = total + torch.where(taken, log_p, torch.zeros_like(log_p))
        remaining = remaining & ~step
    return total


@torch.no_grad()
def _batch_mean(samples: OrderSamples, batch: int, total: Callable[[torch.Tensor], float]) -> float:
    """Mean over samples of a score that `total(indices)` sums over one batch of them."""
    n = samples.label.shape[0]
    summed = sum(total(torch.arange(s, min(n, s + batch))) for s in range(0, n, batch))
    return summed / max(1, n)


def next_commit_accuracy(model: OrderModel, samples: OrderSamples, batch: int = 4096) -> float:
    """Fraction of samples whose most likely position is one the target commits next."""

    def hits(idx):
        best = model(samples.features[idx], samples.masked[idx]).argmax(dim=-1)
        return int(samples.label[idx].gather(1, best[:, None]).sum())

    return _batch_mean(samples, batch, hits)


def order_log_likelihood(model: OrderModel, samples: OrderSamples, batch: int = 4096) -> float:
    """Mean log-probability of the target's following commits in order: how well the
    model's probabilities, which score every path of a draft tree, are calibrated."""

    def total(idx):
        logits = model(samples.features[idx], samples.masked[idx])
        ll = commit_order_log_likelihood(logits, samples.masked[idx], samples.following[idx])
        return float(ll.sum())

    return _batch_mean(samples, batch, total)


def _fit(
    model: torch.nn.Module,
    samples: int,
    batch_loss: Callable[[torch.Tensor], torch.Tensor],
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    progress: Callable[[int, int, float], None] | None,
    validate: Callable[[], float] | None = None,
) -> list[float]:
    """AdamW with a one-cycle schedule over shuffled mini-batches of sample indices.

    With `validate` (a score, higher is better), the model is scored before training and
    after every epoch and the best of those states is kept: a few hundred blocks of
    trajectories are easy to overfit. Returns the scores, index 0 before training."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.01)
    total = epochs * max(1, -(-samples // batch_size))
    if total < 3:
        raise ValueError(
            f"{samples} training samples make only {total} optimizer steps at batch size "
            f"{batch_size}; record trajectories on more prompts (or train more epochs)"
        )
    # warm-up over 5% of the steps, at least two (one step exactly breaks OneCycleLR)
    pct_start = max(0.05, 2 / total)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=lr, total_steps=total, pct_start=pct_start
    )
    scores: list[float] = []
    best: dict[str, torch.Tensor] = {}

    def checkpoint() -> None:
        if validate is None:
            return
        model.eval()
        scores.append(validate())
        if scores[-1] >= max(scores):
            best.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        model.train()

    checkpoint()
    step = 0
    for _ in range(epochs):
        order = torch.randperm(samples, generator=generator)
        for s in range(0, samples, batch_size):
            with torch.enable_grad():  # whatever the caller's mode (benchmarks turn it off)
                loss = batch_loss(order[s : s + batch_size])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            step += 1
            if progress is not None:
                progress(step, total, loss.detach().item())
        checkpoint()
    if best:
        model.load_state_dict(best)
    model.eval()
    return scores


def _init(model_class, config, seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # parameter init only; the caller's RNG state is untouched
        return model_class(config)


def train_order_model(
    train: OrderSamples,
    heldout: OrderSamples,
    config: OrderModelConfig,
    epochs: int = 4,
    batch_size: int = 256,
    lr: float = 1e-3,
    seed: int = 0,
    progress: Callable[[int, int, float], None] | None = None,
    validation: OrderSamples | None = None,
    model: OrderModel | None = None,
    device: str | torch.device = "cpu",
) -> tuple[OrderModel, dict]:
    """The order model and its held-out next-commit accuracy, trained on the likelihood of
    the commits that follow each sample (the next one from `build_samples`; the order of
    the next few from `root_samples`); with `validation` samples, the epoch (0: the
    untrained model, which is the commit rule's own guess) whose probabilities fit them best
    is kept. `model` continues training a given model (a learner's previous round): epoch 0
    is then that model. It trains and is measured on `device`, and comes back on the CPU."""
    model = _init(OrderModel, config, seed) if model is None else model
    device = torch.device(device)
    model, train, heldout = model.to(device), train.to(device), heldout.to(device)
    validation = None if validation is None else validation.to(device)

    def batch_loss(idx):
        logits = model(train.features[idx], train.masked[idx])
        ll = commit_order_log_likelihood(logits, train.masked[idx], train.following[idx])
        return -ll.mean()

    n = train.label.shape[0]
    generator = torch.Generator().manual_seed(seed)
    validate = None if validation is None else lambda: order_log_likelihood(model, validation)
    scores = _fit(model, n, batch_loss, epochs, batch_size, lr, generator, progress, validate)
    metrics = {
        "heldout_next_commit_accuracy": next_commit_accuracy(model, heldout),
        "heldout_order_log_likelihood": order_log_likelihood(model, heldout),
        "train_next_commit_accuracy": next_commit_accuracy(model, train),
        "heldout_samples": int(heldout.label.shape[0]),
        "train_samples": int(n),
        **_selection(scores),
    }
    return model.cpu(), metrics


def _selection(scores: list[float]) -> dict:
    """What the validation said, for the checkpoint's metadata."""
    if not scores:
        return {}
    return {"validation_log_likelihood_by_epoch": scores, "kept_epoch": scores.index(max(scores))}


def _set_logits(model, samples: OrderSamples, idx, hidden: torch.Tensor, embed):
    """The set model's logits [n, B] for samples `idx`, and their masks [n, B]; hidden:
    [S, B, H] per record."""
    masked = samples.masked[idx]
    logits = model(
        samples.features[idx],
        hidden[samples.stale_index[idx]].float(),
        embed(samples.token_ids[idx].long()).float(),
        masked,
        samples.threshold,
    )
    return logits, masked


def set_accuracy(model, samples: OrderSamples, hidden, embed, batch: int = 2048) -> float:
    """Fraction of samples whose most likely set is exactly the committed set."""

    def hits(idx):
        logits, m = _set_logits(model, samples, idx, hidden, embed)
        return exact_set_accuracy(logits, samples.label[idx], m) * len(idx)

    return _batch_mean(samples, batch, hits)


def set_log_likelihood_of(model, samples: OrderSamples, hidden, embed, batch: int = 2048) -> float:
    """Mean per-sample Bernoulli log-likelihood of the committed sets (calibration, as for
    the order model)."""

    def total(idx):
        logits, m = _set_logits(model, samples, idx, hidden, embed)
        return float(set_log_likelihood(logits, samples.label[idx], m).sum())

    return _batch_mean(samples, batch, total)


PROJECTIONS = ("hidden_proj.", "token_proj.")  # the set model's only per-target-width parts


def adapt_set_model(source: SetModel, target_hidden_size: int, seed: int = 0) -> SetModel:
    """A set model for a target of another width: the source's shared network, frozen, with
    new projections from the new width (weights zero, biases kept: the untrained adaptation
    reads the order features alone), the only parameters left to train."""
    config = dataclasses.replace(source.config, target_hidden_size=target_hidden_size)
    model = _init(SetModel, config, seed)
    state = source.state_dict()
    for name in PROJECTIONS:
        state[name + "weight"] = torch.zeros_like(model.state_dict()[name + "weight"])
    model.load_state_dict(state)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name.startswith(PROJECTIONS))
    return model


def train_set_model(
    train: OrderSamples,
    heldout: OrderSamples,
    train_hidden: torch.Tensor,
    heldout_hidden: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    config: SetModelConfig,
    epochs: int = 4,
    batch_size: int = 256,
    lr: float = 1e-3,
    seed: int = 0,
    progress: Callable[[int, int, float], None] | None = None,
    validation: tuple[OrderSamples, torch.Tensor] | None = None,
    model: SetModel | None = None,
) -> tuple[SetModel, dict]:
    """SPOT-Sets: Bernoulli inclusion per masked position; hidden: [S, B, H] per record.
    `validation` (samples, their hidden states) selects the epoch as for the order model.
    `model` continues from a given model (`adapt_set_model`); its frozen parameters stay."""
    model = _init(SetModel, config, seed) if model is None else model

    def batch_loss(idx):
        logits, m = _set_logits(model, train, idx, train_hidden, embed)
        return -set_log_likelihood(logits, train.label[idx], m).mean()

    n = train.label.shape[0]
    generator = torch.Generator().manual_seed(seed)
    validate = None
    if validation is not None:
        samples, hidden = validation
        validate = lambda: set_log_likelihood_of(model, samples, hidden, embed)  # noqa: E731
    scores = _fit(model, n, batch_loss, epochs, batch_size, lr, generator, progress, validate)
    metrics = {
        "heldout_exact_set_accuracy": set_accuracy(model, heldout, heldout_hidden, embed),
        "train_exact_set_accuracy": set_accuracy(model, train, train_hidden, embed),
        "heldout_samples": int(heldout.label.shape[0]),
        "train_samples": int(n),
        **_selection(scores),
    }
    return model, metrics
