"""Does the order model predict the commit order better when it also reads the target's
hidden states and the embeddings of the tokens it is about to commit (what SPOT-Sets reads)?

Trains one order model per input set on the same rows, warm from nothing, and reports each
one's next-commit accuracy and order log-likelihood on the measuring rows and the steps per
forward its SPOT tree takes there by exact replay (`spot.drafters.replay`). The rows are
`bench/learned_drafter.py record --hidden` shards of the off-corpus prompts.

    .venv/bin/python bench/order_inputs.py --rows-dir build/learned/sdar-tiny/hidden \
        --rows 600 --measure 4800:5000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from learned_drafter import load_rows  # noqa: E402

from pipeline.drafter_data import load_model_and_tokenizer  # noqa: E402
from spot.drafters.order_model import DOUBT_SCALE, Linear, OrderModel, OrderModelConfig  # noqa: E402
from spot.drafters.recipes import training_split  # noqa: E402
from spot.drafters.replay import ReplayTarget, replay  # noqa: E402
from spot.drafters.spot import SpotDrafter  # noqa: E402
from spot.drafters.training import (  # noqa: E402
    _fit,
    commit_order_log_likelihood,
    root_samples,
)

PRIOR_SCALES = (2.0, 4.0)  # besides the trained one, as the learner tries
INPUTS = {
    "stale": (False, False),
    "hidden": (True, False),
    "tokens": (False, True),
    "both": (True, True),
}


class TargetOrderModel(OrderModel):
    """The order model plus projections of the stale forward's last hidden states and of the
    input embeddings of the tokens the coupled noise draws, added to each position's input
    (zero-initialised: untrained, it is the plain order model)."""

    def __init__(self, config: OrderModelConfig, hidden_size: int, hidden: bool, tokens: bool):
        super().__init__(config)
        self.use_hidden, self.use_tokens = hidden, tokens
        self.hidden_proj = Linear(hidden_size, config.d_model)
        self.token_proj = Linear(hidden_size, config.d_model)
        for lin in (self.hidden_proj, self.token_proj):
            torch.nn.init.zeros_(lin.weight)

    def forward(self, features, masked, hidden=None, token_embeddings=None):
        b = features.shape[1]
        h = self.input(features) + self.position.weight[:b]
        if self.use_hidden:
            h = h + self.hidden_proj(hidden.float())
        if self.use_tokens:
            h = h + self.token_proj(token_embeddings.float())
        h = self.norm(self.encoder(h))
        doubt = features[..., self.config.log_doubt_index] * DOUBT_SCALE
        logits = self.head(h).squeeze(-1) - self.prior_scale * doubt
        return logits.masked_fill(~masked, float("-inf"))


class TargetSpotDrafter(SpotDrafter):
    """SPOT whose order model reads the target's hidden states and token embeddings."""

    needs_hidden = True

    def __init__(self, model: TargetOrderModel, embed, budget: int, **tree):
        super().__init__(model, budget, **tree)
        self.embed = embed

    def _evaluate(self, frontier):
        feats, masks = zip(*(self._node_features(g, n, self.model.config) for g, n in frontier))
        hidden = torch.stack([g.inp.stale_hidden.float() for g, _ in frontier])
        tokens = torch.stack([g.noise.draw(g.inp, g.nodes[n].step)[0] for g, n in frontier])
        with torch.no_grad():
            emb = self.embed(tokens.long()).float()
        return self.model(torch.cat(feats), torch.cat(masks), hidden, emb).float()


def logits_of(model, samples, idx, hidden, embed):
    return model(
        samples.features[idx],
        samples.masked[idx],
        hidden[samples.stale_index[idx]],
        embed(samples.token_ids[idx].long()).float(),
    )


@torch.no_grad()
def scores(model, samples, hidden, embed, batch: int = 2048) -> tuple[float, float]:
    """(next-commit accuracy, order log-likelihood per sample)."""
    n = samples.label.shape[0]
    hits = ll = 0.0
    for s in range(0, n, batch):
        idx = torch.arange(s, min(n, s + batch))
        logits = logits_of(model, samples, idx, hidden, embed)
        best = logits.argmax(-1)
        hits += float(samples.label[idx].gather(1, best[:, None]).sum())
        ll += float(
            commit_order_log_likelihood(logits, samples.masked[idx], samples.following[idx]).sum()
        )
    return hits / n, ll / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows-dir", required=True)
    p.add_argument("--rows", type=int, default=600, help="learn from the first ROWS rows")
    p.add_argument("--measure", default="4800:5000", help="measuring rows, start:stop")
    p.add_argument("--inputs", default="stale,hidden,tokens,both")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--replay-rows", type=int, default=60, help="validation rows replayed")
    p.add_argument("--token-choices", type=int, default=2)
    p.add_argument("--target", default="sdar-tiny")
    args = p.parse_args()
    torch.manual_seed(0)
    _, target = load_model_and_tokenizer(f"builtin:{args.target}")
    embed = target.embed
    config = OrderModelConfig()
    traj = load_rows(args.rows_dir, args.rows).canonical()
    start, stop = (int(x) for x in args.measure.split(":"))
    measuring = load_rows(args.rows_dir, stop, start).canonical()
    train, validation, _ = training_split(traj, 0.1)
    parts = {"train": train, "validation": validation, "measuring": measuring}
    samples = {k: root_samples(v, config) for k, v in parts.items()}
    hidden = {k: v.hidden.float() for k, v in parts.items()}
    hidden_size = hidden["train"].shape[-1]
    print(
        f"{args.rows} rows: {samples['train'].label.shape[0]} training samples, "
        f"{samples['validation'].label.shape[0]} validation; measuring rows {args.measure}: "
        f"{samples['measuring'].label.shape[0]} samples; hidden size {hidden_size}",
        flush=True,
    )
    rtarget = ReplayTarget.of(target)
    validation_rows = validation.of_requests(validation.key.unique()[: args.replay_rows].tolist())
    print("| inputs | accuracy | order log-likelihood | steps/forward | train s |")
    print("|---|---|---|---|---|")
    for name in args.inputs.split(","):
        use_hidden, use_tokens = INPUTS[name]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = TargetOrderModel(config, hidden_size, use_hidden, use_tokens)
        t0 = time.perf_counter()
        tr, hid = samples["train"], hidden["train"]

        def batch_loss(idx, tr=tr, hid=hid, model=model):
            logits = logits_of(model, tr, idx, hid, embed)
            return -commit_order_log_likelihood(logits, tr.masked[idx], tr.following[idx]).mean()

        def validate(model=model):
            return scores(model, samples["validation"], hidden["validation"], embed)[1]

        _fit(
            model,
            tr.label.shape[0],
            batch_loss,
            args.epochs,
            256,
            1e-3,
            torch.Generator().manual_seed(0),
            None,
            validate,
        )
        seconds = time.perf_counter() - t0
        acc, ll = scores(model, samples["measuring"], hidden["measuring"], embed)

        def steps(rows, model=model):
            drafter = TargetSpotDrafter(model, embed, args.budget, token_choices=args.token_choices)
            return replay(drafter, rows, rtarget, keep_walks=False).steps_per_forward

        # the tree's sharpness, chosen on the validation rows as the learner does
        with torch.inference_mode():
            by_scale = {}
            for scale in (float(model.prior_scale), *PRIOR_SCALES):
                model.prior_scale.data.fill_(scale)
                by_scale[scale] = steps(validation_rows)
            model.prior_scale.data.fill_(max(by_scale, key=by_scale.get))
            result = steps(measuring)
        print(
            f"| {name} | {acc:.3f} | {ll:.3f} | {result:.3f} | {seconds:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
