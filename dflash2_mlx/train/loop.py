"""The training loop: AdamW with warm-up + cosine, clipping, checkpoints, exact resume.

Determinism: the batch of step s depends only on (seed, s) — `np.random.default_rng([seed, s])`
— and initialisation only on the seed, so a run resumed from a checkpoint (weights, optimizer
state, step) continues exactly like an uninterrupted one. Checkpoints are written to a
temporary directory and renamed into place; the drafter inside is in the published layout.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..drafter.load import read_checkpoint, save_drafter, build_drafter
from ..drafter.config import parse_config
from .data import FeatureShard
from .loss import Batch, LossWeights, TrainVocab, drafter_loss, estimated_tau, position_weights
from ..paths import atomic_path


@dataclass
class TrainConfig:
    steps: int = 1000
    seqs_per_batch: int = 8
    anchors_per_seq: int = 16
    lr: float = 6e-4
    warmup_frac: float = 0.04
    min_lr_frac: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None
    selector_weight: float = 1.0
    selector_tv_weight: float = 0.0
    ce_weight: float = 1.0
    train_vocab: int = 0  # train over the N most frequent ids of the drafter's proposal vocab; 0: all
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 4
    save_every: int = 100
    freeze_backbone: bool = False


class FeatureDataset:
    """All feature shards in memory (numpy), sampled into `Batch`es.

    A block anchored at t (a trainable position) has labels `labels[t + k - 1]` for k = 1..B-1
    (the target's next token after t + k - 1), counted where that position is still trainable.

    `chain_labels`: label k also needs the text after t to follow the target's own argmax up
    to t + k - 1, so every label is the target's greedy continuation of the prefix (what the
    drafter must predict); past the first disagreement of teacher-forced text, the argmax is
    conditioned on tokens the target would not have written. A no-op on regenerated data.
    """

    def __init__(self, paths: list[Path], max_seqs: int | None = None, chain_labels: bool = True):
        self.chain_labels = chain_labels
        shards = [FeatureShard.load(p) for p in paths]
        shards = [s for s in shards if len(s)]
        if not shards:
            raise ValueError(f"no training sequences in {[str(p) for p in paths]}")
        base = np.cumsum([0] + [len(s.tokens) for s in shards[:-1]])
        self.tokens = np.concatenate([s.tokens for s in shards])
        self.labels = np.concatenate([s.labels for s in shards])
        self.anchor_ok = np.concatenate([s.anchor_ok for s in shards]).astype(bool)
        self.hidden = np.concatenate([s.hidden for s in shards])
        self.starts = np.concatenate([s.offsets[:-1] + b for s, b in zip(shards, base)])
        self.ends = np.concatenate([s.offsets[1:] + b for s, b in zip(shards, base)])
        usable = np.array([self.anchor_ok[s:e].any() for s, e in zip(self.starts, self.ends)], dtype=bool)
        self.seq_ids = np.nonzero(usable)[0][:max_seqs]

    def __len__(self) -> int:
        return len(self.seq_ids)

    @property
    def n_tokens(self) -> int:
        """Tokens of the sequences in use."""
        return int((self.ends[self.seq_ids] - self.starts[self.seq_ids]).sum())

    @property
    def n_trainable(self) -> int:
        """Positions a block may start at, in the sequences in use."""
        return int(sum(self.anchor_ok[self.starts[i] : self.ends[i]].sum() for i in self.seq_ids))

    def prompt_keys(self) -> set[bytes]:
        """Each sequence's token ids before its first trainable position (its prompt), as bytes:
        an evaluation set sharing one with the training data is not held out."""
        keys = set()
        for i in self.seq_ids:
            start, end = self.starts[i], self.ends[i]
            keys.add(self.tokens[start : start + int(np.argmax(self.anchor_ok[start:end]))].tobytes())
        return keys

    def batch(self, rng: np.random.Generator, n_seqs: int, n_anchors: int, block_size: int) -> Batch:
        seqs = self.seq_ids[rng.integers(0, len(self.seq_ids), size=n_seqs)]
        lengths = self.ends[seqs] - self.starts[seqs]
        T = int(math.ceil(lengths.max() / 32) * 32)
        width = self.hidden.shape[1]
        hidden = np.zeros((n_seqs, T, width), dtype=np.float32)
        anchors = np.zeros((n_seqs, n_anchors), dtype=np.int32)
        labels = np.zeros((n_seqs, n_anchors, block_size - 1), dtype=np.int32)
        mask = np.zeros_like(labels, dtype=np.float32)
        anchor_tokens = np.zeros((n_seqs, n_anchors), dtype=np.int32)
        for i, (seq, n) in enumerate(zip(seqs, lengths)):
            s = self.starts[seq]
            ok = self.anchor_ok[s : s + n]
            hidden[i, :n] = self.hidden[s : s + n]
            pool = np.nonzero(ok)[0]
            pick = rng.choice(pool, size=n_anchors, replace=len(pool) < n_anchors)
            anchors[i] = pick
            anchor_tokens[i] = self.tokens[s + pick]
            pos = pick[:, None] + np.arange(block_size - 1)[None, :]
            inside = pos < n
            pos = np.minimum(pos, n - 1)
            labels[i] = np.where(inside, self.labels[s + pos], 0)
            mask[i] = inside & ok[pos]
            if self.chain_labels:  # token at pos equals the target's argmax after pos - 1
                on_path = self.tokens[s + pos] == self.labels[s + np.maximum(pos - 1, 0)]
                on_path[:, 0] = True
                mask[i] = mask[i] * np.cumprod(on_path, axis=1)
        return Batch(mx.array(hidden), mx.array(lengths.astype(np.int32)), mx.array(anchors),
                     mx.array(anchor_tokens), mx.array(labels), mx.array(mask))


def lr_schedule(cfg: TrainConfig):
    warm = max(1, int(cfg.steps * cfg.warmup_frac))
    decay = optim.cosine_decay(cfg.lr, max(1, cfg.steps - warm), cfg.lr * cfg.min_lr_frac)
    return optim.join_schedules([optim.linear_schedule(cfg.lr * 0.01, cfg.lr, warm), decay], [warm])


@dataclass
class TrainState:
    step: int = 0
    history: list = field(default_factory=list)


class Trainer:
    """Owns the drafter, optimizer, data and checkpoints of one training run."""

    def __init__(self, drafter, parts, data: FeatureDataset, cfg: TrainConfig, out_dir: Path,
                 eval_data: FeatureDataset | None = None, vocab: TrainVocab | None = None):
        self.drafter, self.data, self.eval_data, self.cfg = drafter, data, eval_data, cfg
        self.out_dir = Path(out_dir)
        drafter.target = parts
        if cfg.freeze_backbone:
            if not drafter.config.is_v2:
                raise ValueError("freeze_backbone trains only the DFlash 2 convs and selector; the drafter is v1")
            drafter.freeze()
            for layer in drafter.layers:
                layer.attention_conv.unfreeze()
                layer.mlp_conv.unfreeze()
            drafter.candidate_selector.unfreeze()
        self.weights = position_weights(drafter.config.block_size, cfg.gamma)
        self.loss_weights = LossWeights(cfg.ce_weight, cfg.selector_weight, cfg.selector_tv_weight)
        self.vocab = vocab
        self.head = None if vocab is None else vocab.head(parts)
        if self.head is not None:
            mx.eval(self.head)
        self.optimizer = optim.AdamW(learning_rate=lr_schedule(cfg), weight_decay=cfg.weight_decay)
        self.optimizer.init(drafter.trainable_parameters())
        self.state = TrainState()
        self._grad = nn.value_and_grad(drafter, self._loss)

    def _loss(self, batch: Batch):
        loss, metrics = drafter_loss(self.drafter, batch, self.weights, self.loss_weights, self.vocab, self.head)
        return loss, metrics

    def make_batch(self, step: int, data: FeatureDataset | None = None) -> Batch:
        rng = np.random.default_rng([self.cfg.seed, step])
        return (data or self.data).batch(rng, self.cfg.seqs_per_batch, self.cfg.anchors_per_seq,
                                         self.drafter.config.block_size)

    def step(self) -> dict:
        batch = self.make_batch(self.state.step)
        (loss, metrics), grads = self._grad(batch)
        grads, norm = optim.clip_grad_norm(grads, self.cfg.grad_clip)
        self.optimizer.update(self.drafter, grads)
        mx.eval(self.drafter.parameters(), self.optimizer.state, metrics, norm)
        self.state.step += 1
        return _to_python(metrics) | {"grad_norm": norm.item(), "lr": float(self.optimizer.learning_rate.item())}

    def evaluate(self) -> dict:
        if self.eval_data is None:
            return {}
        sums: dict = {}
        for i in range(self.cfg.eval_batches):
            _, metrics = self._loss(self.make_batch(10_000_000 + i, self.eval_data))
            for k, v in _to_python(metrics).items():
                sums[k] = np.add(sums.get(k, 0), v)
        return {f"eval_{k}": (v / self.cfg.eval_batches).tolist() for k, v in sums.items()}

    # -- checkpoints ------------------------------------------------------------------

    def save(self, final: bool = False) -> Path:
        dest = self.out_dir / "checkpoint"
        with atomic_path(dest) as tmp:
            save_drafter(self.drafter, tmp / "drafter")
            mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state)))
            (tmp / "state.json").write_text(json.dumps({"step": self.state.step, "history": self.state.history,
                                                        "config": asdict(self.cfg)}))
        if final:
            save_drafter(self.drafter, self.out_dir)
        return dest

    def resume(self) -> bool:
        """Load the last checkpoint in out_dir if there is one; True if resumed."""
        ckpt = self.out_dir / "checkpoint"
        if not (ckpt / "state.json").exists():
            return False
        raw, weights = read_checkpoint(ckpt / "drafter")
        loaded = build_drafter(parse_config(raw), weights)
        self.drafter.update(loaded.parameters())
        opt = mx.load(str(ckpt / "optimizer.safetensors"))
        self.optimizer.state = tree_unflatten(list(opt.items()))
        state = json.loads((ckpt / "state.json").read_text())
        self.state = TrainState(step=state["step"], history=state["history"])
        mx.eval(self.drafter.parameters(), self.optimizer.state)
        return True

    # -- the run ----------------------------------------------------------------------

    def run(self, progress: bool = True) -> TrainState:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        cols = [TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[info]}")]
        log_path = self.out_dir / "train_log.jsonl"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with Progress(*cols, disable=not progress) as bar:
            task = bar.add_task("train", total=self.cfg.steps, completed=self.state.step, info="")
            while self.state.step < self.cfg.steps:
                t0 = time.perf_counter()
                m = self.step()
                m["step"], m["seconds"] = self.state.step, time.perf_counter() - t0
                acc = m.get("pick", m["top1"])
                m["tau_est"] = estimated_tau(acc)
                if self.state.step % self.cfg.eval_every == 0 or self.state.step == self.cfg.steps:
                    m.update(self.evaluate())
                    if "eval_top1" in m:
                        m["eval_tau_est"] = estimated_tau(m.get("eval_pick", m["eval_top1"]))
                self.state.history.append({k: v for k, v in m.items() if k in ("step", "loss", "tau_est", "eval_loss", "eval_tau_est")})
                with open(log_path, "a") as f:
                    f.write(json.dumps(m) + "\n")
                bar.update(task, completed=self.state.step,
                           info=f"loss {m['loss']:.3f} acc[{' '.join(f'{a:.2f}' for a in acc)}] τ≈{m['tau_est']:.2f}")
                if self.state.step % self.cfg.save_every == 0 or self.state.step == self.cfg.steps:
                    self.save(final=self.state.step == self.cfg.steps)
        return self.state


def _to_python(metrics: dict) -> dict:
    out = {}
    for k, v in metrics.items():
        arr = np.array(v)
        out[k] = arr.item() if arr.ndim == 0 else arr.tolist()
    return out
